"""Qwen3.5 / Qwen3-Next style hybrid decoder with its native MTP module.

`layer_types` mixes Gated DeltaNet layers ("linear_attention", gated_deltanet.py) and gated full
attention ("full_attention": q/k RMSNorm per head, partial rotary, a sigmoid output gate packed
next to q in q_proj). All RMSNorms except the DeltaNet's gated norm are zero-centred
(x * (1 + w)). The MLP is SwiGLU, or for Qwen3-Next a routed mixture of experts plus a gated
shared expert.

The MTP module (`mtp.*`) predicts t_{i+2} from the target's post-final-norm hidden h_i and the
embedding of t_{i+1}: fc([pre_fc_norm_embedding(e), pre_fc_norm_hidden(h)]) -> a full-attention
decoder layer with its own KV cache (one per draft depth with several layers, drafters/mtp.py; its
attention block-sparse with `mtp_sparse_attention`, sparse_attention.py) -> mtp.norm -> the target's
LM head.

Parameter names follow Hugging Face's Qwen3.5 layout, so checkpoints load by name.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field

import torch
from torch import Tensor, nn

from ..cache import KVCache
from ..device import of as device_of, on
from ..errors import ConfigError
from ..types import TargetOutput
from .common import CausalLM, DraftModule, Linear, RMSNorm, Rotary, SwiGLU, wide
from .forward import module_tokens, run
from .gated_deltanet import GatedDeltaNet
from .hybrid_cache import HybridCache
from .sparse_attention import Indexer, IndexKeys, SparseAttentionConfig, SparseState

LAYER_TYPES = ("linear_attention", "full_attention")


@dataclass(frozen=True)
class HybridConfig:
    vocab_size: int
    hidden_size: int
    num_layers: int
    layer_types: tuple[str, ...]  # one of LAYER_TYPES per layer
    num_heads: int  # full-attention query heads
    num_kv_heads: int  # full-attention key/value heads (GQA)
    head_dim: int
    intermediate_size: int  # dense SwiGLU width
    max_seq_len: int  # context length; KV caches are preallocated to it
    norm_eps: float = 1e-6
    rope_theta: float = 10_000_000.0
    partial_rotary_factor: float = 0.25  # rotary on the first head_dim * factor dims
    tie_embeddings: bool = False
    attention_bias: bool = False
    linear_conv_kernel_dim: int = 4  # causal conv window of the DeltaNet
    linear_key_head_dim: int = 128
    linear_value_head_dim: int = 128
    linear_num_key_heads: int = 16
    linear_num_value_heads: int = 32  # value heads share key heads in groups (nv / nk)
    num_experts: int = 0  # 0 = dense MLP everywhere (Qwen3.5); > 0 = Qwen3-Next MoE
    num_experts_per_tok: int = 0
    moe_intermediate_size: int = 0
    shared_expert_intermediate_size: int = 0
    norm_topk_prob: bool = True
    decoder_sparse_step: int = 1
    mlp_only_layers: tuple[int, ...] = field(default_factory=tuple)
    mtp_num_layers: int = 0  # decoder layers of the MTP module; 0 = no MTP module
    sparse_attention: SparseAttentionConfig | None = None  # the full-attention layers' block-sparse attention (sparse_attention.py)
    mtp_sparse_attention: SparseAttentionConfig | None = None  # the MTP module's

    def __post_init__(self) -> None:
        object.__setattr__(self, "layer_types", tuple(self.layer_types))
        object.__setattr__(self, "mlp_only_layers", tuple(self.mlp_only_layers))
        for name in ("sparse_attention", "mtp_sparse_attention"):
            try:
                object.__setattr__(self, name, SparseAttentionConfig.parse(getattr(self, name)))
            except ConfigError as e:
                raise ValueError(f"{name}: {e}") from None

    @property
    def rot_dim(self) -> int:
        return int(self.head_dim * self.partial_rotary_factor)

    def is_sparse(self, layer: int) -> bool:
        return self.num_experts > 0 and layer not in self.mlp_only_layers and (layer + 1) % self.decoder_sparse_step == 0

    def to_dict(self) -> dict:
        d = asdict(self)
        d["layer_types"], d["mlp_only_layers"] = list(self.layer_types), list(self.mlp_only_layers)
        for name in ("sparse_attention", "mtp_sparse_attention"):  # written only when set (older readers know no such field)
            if d[name] is None:
                del d[name]
        return {"arch": "qwen35", **d}


class GatedAttention(nn.Module):
    """Full attention with per-head q/k norm, partial rotary and a sigmoid output gate (forward._gated_attention)."""

    def __init__(self, cfg: HybridConfig, kv_index: int, rotary: Rotary, sparse: SparseAttentionConfig | None = None) -> None:
        super().__init__()
        hd = cfg.head_dim
        self.kv_index, self.nh, self.nkv, self.hd = kv_index, cfg.num_heads, cfg.num_kv_heads, hd
        self.q_proj = Linear(cfg.hidden_size, cfg.num_heads * hd * 2, bias=cfg.attention_bias)  # [q | gate] per head
        self.k_proj = Linear(cfg.hidden_size, cfg.num_kv_heads * hd, bias=cfg.attention_bias)
        self.v_proj = Linear(cfg.hidden_size, cfg.num_kv_heads * hd, bias=cfg.attention_bias)
        self.o_proj = Linear(cfg.num_heads * hd, cfg.hidden_size, bias=cfg.attention_bias)
        self.q_norm = RMSNorm(hd, cfg.norm_eps, zero_centred=True)
        self.k_norm = RMSNorm(hd, cfg.norm_eps, zero_centred=True)
        self.rotary = [rotary]  # a list so the shared module is not registered once per layer
        self.sparse = sparse
        if sparse is not None:
            self.indexer = Indexer(cfg.hidden_size, sparse)  # block-sparse attention (sparse_attention.py)


class SparseMoE(nn.Module):
    """Qwen3-Next MLP: softmax router over experts, top-k SwiGLU experts, plus a sigmoid-gated shared expert."""

    def __init__(self, cfg: HybridConfig) -> None:
        super().__init__()
        self.top_k, self.norm_topk = cfg.num_experts_per_tok, cfg.norm_topk_prob
        self.gate = Linear(cfg.hidden_size, cfg.num_experts, bias=False)
        self.experts = nn.ModuleList(SwiGLU(cfg.hidden_size, cfg.moe_intermediate_size) for _ in range(cfg.num_experts))
        self.shared_expert = SwiGLU(cfg.hidden_size, cfg.shared_expert_intermediate_size)
        self.shared_expert_gate = Linear(cfg.hidden_size, 1, bias=False)

    def forward(self, x: Tensor) -> Tensor:
        shape = x.shape
        x = x.reshape(-1, shape[-1])  # (N, H)
        logits = self.gate(x)  # (N, E)
        probs = torch.softmax(logits.to(wide(logits.dtype)), dim=-1)  # (N, E) in at least fp32
        w, idx = torch.topk(probs, self.top_k, dim=-1)  # (N, k)
        if self.norm_topk:
            w = w / w.sum(-1, keepdim=True)
        w = w.to(x.dtype)
        out = torch.zeros_like(x)
        for e in idx.unique().tolist():
            rows, slot = torch.where(idx == e)
            out.index_add_(0, rows, self.experts[e](x[rows]) * w[rows, slot, None])
        out = out + torch.sigmoid(self.shared_expert_gate(x)) * self.shared_expert(x)
        return out.reshape(shape)


class HybridBlock(nn.Module):
    def __init__(self, cfg: HybridConfig, layer_type: str, index: int, rotary: Rotary, sparse: bool,
                 attention: SparseAttentionConfig | None = None) -> None:
        super().__init__()
        self.layer_type = layer_type
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.norm_eps, zero_centred=True)
        if layer_type == "linear_attention":
            self.linear_attn = GatedDeltaNet(
                cfg.hidden_size, cfg.linear_num_key_heads, cfg.linear_num_value_heads, cfg.linear_key_head_dim,
                cfg.linear_value_head_dim, cfg.linear_conv_kernel_dim, cfg.norm_eps, slot=index,
            )
        else:
            self.self_attn = GatedAttention(cfg, index, rotary, attention)  # attention: its block-sparse config, or None
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.norm_eps, zero_centred=True)
        self.mlp = SparseMoE(cfg) if sparse else SwiGLU(cfg.hidden_size, cfg.intermediate_size)


class HybridBody(nn.Module):
    def __init__(self, cfg: HybridConfig, rotary: Rotary) -> None:
        super().__init__()
        self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.hidden_size)
        counters = {t: 0 for t in LAYER_TYPES}
        layers = []
        for i, lt in enumerate(cfg.layer_types):
            layers.append(HybridBlock(cfg, lt, counters[lt], rotary, cfg.is_sparse(i), cfg.sparse_attention))
            counters[lt] += 1
        self.layers = nn.ModuleList(layers)
        self.norm = RMSNorm(cfg.hidden_size, cfg.norm_eps, zero_centred=True)


class MTPModule(DraftModule):
    """x = fc([norm_e(embedding), norm_h(hidden)]) -> decoder layer(s) -> mtp.norm (forward.module_forward). Own KV cache."""

    def __init__(self, cfg: HybridConfig, rotary: Rotary) -> None:
        super().__init__()
        h = cfg.hidden_size
        self.pre_fc_norm_embedding = RMSNorm(h, cfg.norm_eps, zero_centred=True)
        self.pre_fc_norm_hidden = RMSNorm(h, cfg.norm_eps, zero_centred=True)
        self.fc = Linear(2 * h, h, bias=False)
        self.layers = nn.ModuleList(
            HybridBlock(cfg, "full_attention", i, rotary, cfg.num_experts > 0, cfg.mtp_sparse_attention)
            for i in range(cfg.mtp_num_layers)
        )
        self.norm = RMSNorm(h, cfg.norm_eps, zero_centred=True)


class HybridLM(CausalLM):
    """The hybrid target: same interface as DenseLM, plus `mtp` (None when the checkpoint has none)."""

    def __init__(self, cfg: HybridConfig) -> None:
        super().__init__()
        for t in cfg.layer_types:
            if t not in LAYER_TYPES:
                raise ValueError(f"unknown layer type '{t}' (known: {', '.join(LAYER_TYPES)})")
        self.config = cfg
        self.rotary = Rotary(cfg.rot_dim, cfg.max_seq_len, cfg.rope_theta)
        self.model = HybridBody(cfg, self.rotary)
        self.lm_head = Linear(cfg.hidden_size, cfg.vocab_size, bias=False)
        self.mtp = MTPModule(cfg, self.rotary) if cfg.mtp_num_layers > 0 else None
        self.tie_weights()

    def tie_weights(self) -> None:
        if self.config.tie_embeddings:
            self.lm_head.weight = self.model.embed_tokens.weight

    def new_cache(self, max_len: int | None = None) -> HybridCache:
        with on(device_of(self)):  # (the model's device: every buffer of the cache is made there)
            return self._new_cache(max_len)

    def _new_cache(self, max_len: int | None) -> HybridCache:
        c = self.config
        n_lin = sum(t == "linear_attention" for t in c.layer_types)
        conv_dim = 2 * c.linear_num_key_heads * c.linear_key_head_dim + c.linear_num_value_heads * c.linear_value_head_dim
        cache = HybridCache(
            n_full=len(c.layer_types) - n_lin, n_kv_heads=c.num_kv_heads, head_dim=c.head_dim, n_linear=n_lin,
            conv_dim=conv_dim, conv_kernel=c.linear_conv_kernel_dim,
            state_shape=(c.linear_num_value_heads, c.linear_key_head_dim, c.linear_value_head_dim),
            max_len=max_len or c.max_seq_len, dtype=self.dtype,
        )
        if c.sparse_attention is not None:
            cache.kv.index = IndexKeys(len(c.layer_types) - n_lin, cache.kv.max_len, c.sparse_attention, self.dtype)
        return cache

    def new_mtp_cache(self, max_len: int | None = None) -> KVCache:
        with on(device_of(self)):
            return self._new_mtp_cache(max_len)

    def _new_mtp_cache(self, max_len: int | None) -> KVCache:
        c = self.config
        cache = KVCache(max(c.mtp_num_layers, 1), c.num_kv_heads, c.head_dim, max_len or c.max_seq_len, self.dtype)
        if c.mtp_sparse_attention is not None:
            cache.index = IndexKeys(cache.k.shape[0], cache.max_len, c.mtp_sparse_attention, self.dtype)
            cache.sparse = SparseState()
        return cache

    def forward_tokens(self, tokens: Tensor, cache: HybridCache, exact: bool = False, logits: bool = True, tree=None,
                       prefill: bool = False, taps: tuple[int, ...] = ()) -> TargetOutput:
        """tokens (T,) appended at cache.length.. -> logits (T, V) (fp32, fp64 for an fp64 model), hidden (T, H) post
        final norm, the inputs of layers `taps`: see forward.run."""
        return run(self, tokens, cache, exact, logits, tree, prefill, taps)

    def mtp_forward(self, hidden: Tensor, tokens: Tensor, cache: KVCache, layer: int = 0, tree=None,
                    sparse: str = "recompute") -> Tensor:
        """MTP over pairs (hidden[i], tokens[i]) at positions cache.length..: -> its hidden (T, H); advances."""
        return module_tokens(self.mtp, self.embed, hidden, tokens, cache, layer, tree, sparse)


__all__ = ["HybridConfig", "HybridLM", "HybridCache", "MTPModule", "LAYER_TYPES"]

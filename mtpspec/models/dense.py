"""Dense decoder (Llama-2 / Qwen2 / Qwen3 / Gemma 3 style): RMSNorm, RoPE, GQA, gated MLP, tied or untied head.

Gemma 3 is this decoder with five config fields set: norms that scale by (1 + w), a norm after attention and
around the MLP (sandwich_norms), GELU-tanh in the gated MLP, the embedding scaled by sqrt(hidden), and a
second rope base for its sliding-window layers.

Parameter names follow the Hugging Face layout (model.layers.N.self_attn.q_proj.weight, ...), so
HF safetensors load by name and export is a plain state_dict.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass

import torch
from torch import Tensor, nn

from ..cache import KVCache
from ..device import of as device_of
from ..types import TargetOutput
from .common import CausalLM, DraftModule, Linear, RMSNorm, Rotary, SwiGLU
from .forward import run


@dataclass(frozen=True)
class DenseConfig:
    vocab_size: int
    hidden_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int  # < num_heads: grouped-query attention
    intermediate_size: int  # SwiGLU hidden width
    max_seq_len: int  # context length; the KV cache is preallocated to it
    head_dim: int = 0  # 0 = hidden_size // num_heads
    norm_eps: float = 1e-5
    rope_theta: float = 10000.0
    tie_embeddings: bool = True  # lm_head shares the embedding matrix
    qk_norm: bool = False  # Qwen3: RMSNorm on each head's q and k before RoPE
    attention_bias: bool = False  # Qwen2: biases on q, k, v projections
    o_proj_bias: bool = False  # Llama / Qwen3 attention_bias: o_proj has a bias too
    mlp_bias: bool = False  # Llama mlp_bias: biases on the SwiGLU projections
    rope_scaling: dict | None = None  # {"rope_type": "linear" | "llama3", "factor": ...}: see common.scale_inv_freq
    layer_windows: tuple[int, ...] = ()  # per layer: sliding-window size (0 = full attention); () = none
    rope_local_theta: float = 0.0  # Gemma 3: the rope base of sliding-window layers (0 = rope_theta everywhere)
    norm_zero_centred: bool = False  # Gemma 3 (HF layout): every RMSNorm scales by (1 + w)
    sandwich_norms: bool = False  # Gemma 3: attention and MLP outputs normed before the residual, the MLP's input too
    hidden_act: str = "silu"  # the gated MLP's activation: silu (SwiGLU) or gelu_tanh (Gemma's GeGLU)
    embed_scale: bool = False  # Gemma 3: embeddings multiplied by sqrt(hidden_size)
    # attention and RMSNorm by the row kernels (common.rows_attention, kernels/rownorm.cpp): a quantized model's 8-bit
    # activations turn any rounding difference between a verify row and a plain step into a different token
    row_kernels: bool = False

    @property
    def hd(self) -> int:
        return self.head_dim or self.hidden_size // self.num_heads

    def to_dict(self) -> dict:
        return {"arch": "dense", **asdict(self)}


def layer_rotary(cfg: DenseConfig, window: int) -> Rotary:
    """The rotary of a layer with this sliding window (0: full attention): Gemma 3's local layers rotate with their own
    base, unscaled; every other layer with rope_theta and the config's scaling."""
    if window and cfg.rope_local_theta:
        return Rotary(cfg.hd, cfg.max_seq_len, cfg.rope_local_theta)
    return Rotary(cfg.hd, cfg.max_seq_len, cfg.rope_theta, cfg.rope_scaling)


class Attention(nn.Module):
    """The attention's weights and shape (forward._dense_attention computes it)."""

    def __init__(self, cfg: DenseConfig, layer: int, rotary: Rotary) -> None:
        super().__init__()
        hd = cfg.hd
        self.layer, self.nh, self.nkv, self.hd = layer, cfg.num_heads, cfg.num_kv_heads, hd
        self.kv_index = layer  # its KV cache layer
        self.q_proj = Linear(cfg.hidden_size, cfg.num_heads * hd, bias=cfg.attention_bias)
        self.k_proj = Linear(cfg.hidden_size, cfg.num_kv_heads * hd, bias=cfg.attention_bias)
        self.v_proj = Linear(cfg.hidden_size, cfg.num_kv_heads * hd, bias=cfg.attention_bias)
        self.o_proj = Linear(cfg.num_heads * hd, cfg.hidden_size, bias=cfg.o_proj_bias)
        self.window = cfg.layer_windows[layer] if cfg.layer_windows else 0  # 0 = all earlier positions
        if cfg.qk_norm:
            self.q_norm = RMSNorm(hd, cfg.norm_eps, cfg.norm_zero_centred, cfg.row_kernels)
            self.k_norm = RMSNorm(hd, cfg.norm_eps, cfg.norm_zero_centred, cfg.row_kernels)
        self.qk_norm = cfg.qk_norm
        self.rows = cfg.row_kernels
        self.rotary = [rotary]  # a list so the shared module is not registered once per layer


class Block(nn.Module):
    """Llama layout (forward.dense_forward): x + attn(norm(x)), then x + mlp(post_attention_layernorm(x)). With sandwich_norms (Gemma 3)
    post_attention_layernorm norms the attention's output, and pre_feedforward_layernorm / post_feedforward_layernorm
    the MLP's input and output."""

    def __init__(self, cfg: DenseConfig, layer: int, rotary: Rotary) -> None:
        super().__init__()
        norm = lambda: RMSNorm(cfg.hidden_size, cfg.norm_eps, cfg.norm_zero_centred, cfg.row_kernels)  # noqa: E731
        self.input_layernorm = norm()
        self.self_attn = Attention(cfg, layer, rotary)
        self.post_attention_layernorm = norm()
        self.sandwich = cfg.sandwich_norms
        if self.sandwich:
            self.pre_feedforward_layernorm = norm()
            self.post_feedforward_layernorm = norm()
        self.mlp = SwiGLU(cfg.hidden_size, cfg.intermediate_size, bias=cfg.mlp_bias, act=cfg.hidden_act)


class DenseMTPModule(DraftModule):
    """An MTP module whose decoder layer is a dense layer (a head trained for a Llama / Qwen3 / Gemma 3 target, its
    target's own layer kind): fc([norm_e(embedding), norm_h(hidden)]) -> Block -> norm (forward.module_forward)."""

    def __init__(self, cfg: DenseConfig, rotary: Rotary) -> None:
        super().__init__()
        h = cfg.hidden_size
        norm = lambda: RMSNorm(h, cfg.norm_eps, cfg.norm_zero_centred, cfg.row_kernels)  # noqa: E731
        self.pre_fc_norm_embedding = norm()
        self.pre_fc_norm_hidden = norm()
        self.fc = Linear(2 * h, h, bias=False)
        self.layers = nn.ModuleList([Block(cfg, 0, rotary)])
        self.norm = norm()


class DenseBody(nn.Module):
    def __init__(self, cfg: DenseConfig, rotaries: list[Rotary]) -> None:
        super().__init__()
        self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.hidden_size)
        self.layers = nn.ModuleList(Block(cfg, i, rotaries[i]) for i in range(cfg.num_layers))
        self.norm = RMSNorm(cfg.hidden_size, cfg.norm_eps, cfg.norm_zero_centred, cfg.row_kernels)


class DenseLM(CausalLM):
    """A causal LM with the interface every target and draft model in mtpspec shares:
    new_cache(), forward_tokens(tokens, cache) -> TargetOutput, embed(), head()."""

    def __init__(self, cfg: DenseConfig) -> None:
        super().__init__()
        self.config = cfg
        self.rotary = layer_rotary(cfg, 0)
        rotaries = [self.rotary] * cfg.num_layers
        if cfg.rope_local_theta and any(cfg.layer_windows):  # Gemma 3: sliding-window layers rotate with their own base
            self.local_rotary = layer_rotary(cfg, max(cfg.layer_windows))
            rotaries = [self.local_rotary if w else self.rotary for w in cfg.layer_windows]
        self.model = DenseBody(cfg, rotaries)
        self.lm_head = Linear(cfg.hidden_size, cfg.vocab_size, bias=False)
        if cfg.tie_embeddings:
            self.lm_head.weight = self.model.embed_tokens.weight

    def embed(self, tokens: Tensor) -> Tensor:
        x = self.model.embed_tokens(tokens)
        if self.config.embed_scale:  # sqrt(H) rounded to the weights' dtype, as transformers' buffer is
            x = x * torch.tensor(self.config.hidden_size**0.5, dtype=x.dtype)
        return x

    def new_cache(self, max_len: int | None = None) -> KVCache:
        c = self.config
        return KVCache(c.num_layers, c.num_kv_heads, c.hd, max_len or c.max_seq_len, self.dtype, device=device_of(self))

    def forward_tokens(self, tokens: Tensor, cache: KVCache, exact: bool = False, logits: bool = True, tree=None,
                       prefill: bool = False, taps: tuple[int, ...] = ()) -> TargetOutput:
        """tokens (T,) appended at positions cache.length.. -> logits (T, V), hidden (T, H), the inputs of layers
        `taps`: see forward.run."""
        return run(self, tokens, cache, exact, logits, tree, prefill, taps)

"""An EAGLE-3 draft module (Li et al. 2025), as SpecForge trains it and vLLM / SGLang / llama.cpp run it.

The target's features are the residual stream entering three of its decoder layers (low, middle, high: by default
(2, L // 2, L - 3), vLLM's and SpecForge's choice), concatenated (3H) and fused by `fc` (3H -> H, no bias) into g.
Draft position i reads the pair (g_i, t_{i+1}) through one Llama decoder layer:

    x = cat(input_layernorm(E[t_{i+1}]), hidden_norm(g_i))          (2H: the q / k / v projections are 2H wide)
    h = r + attn(x)          r = g_i, or hidden_norm(g_i) when norm_before_residual
    o = h + mlp(post_attention_layernorm(h))                         the pre-norm output
    logits = lm_head(norm(o))                                        over the draft vocabulary (N tokens)

E is the target's embedding matrix itself (its raw rows: no Gemma sqrt(H) scale; frozen, not stored). Chained
for depth > 1 on `o`: draft step j + 1 reads (o_j, d_j) one position further, as llama.cpp's eagle3.cpp feeds its
pre-norm output (t_h_nextn) back. The draft vocabulary's token n is target token n + d2t[n] (the offsets HF
checkpoints store); t2d (V,) marks the target tokens that are in it.

The layer's arithmetic is forward.module_forward's (an `Eagle3Layer` is recognised by its hidden_norm).
"""

from __future__ import annotations

import torch
from torch import Tensor, nn

from .common import DraftModule, Linear, RMSNorm, Rotary
from .dense import Block, DenseConfig
from .draft_vocab import SubsetHead


def default_layers(num_layers: int) -> tuple[int, int, int]:
    """The target layers whose inputs EAGLE-3 reads by default: (2, L // 2, L - 3) (vLLM / SpecForge), kept inside a
    shallow target (distinct while L >= 3)."""
    low, mid, high = 2, num_layers // 2, num_layers - 3
    if num_layers < 6:
        low, mid, high = 0, num_layers // 2, num_layers - 1
    return low, mid, high


class Eagle3Layer(Block):
    """A Llama decoder layer whose attention reads 2H (the normed token embedding and the normed g), plus hidden_norm."""

    def __init__(self, cfg: DenseConfig, rotary: Rotary) -> None:
        super().__init__(cfg, 0, rotary)
        h, att = cfg.hidden_size, self.self_attn
        att.q_proj = Linear(2 * h, cfg.num_heads * cfg.hd, bias=False)
        att.k_proj = Linear(2 * h, cfg.num_kv_heads * cfg.hd, bias=False)
        att.v_proj = Linear(2 * h, cfg.num_kv_heads * cfg.hd, bias=False)
        self.hidden_norm = RMSNorm(h, cfg.norm_eps)


class Eagle3Module(DraftModule):
    """fc (3H -> H) + one Eagle3Layer + the final norm + its own LM head over the draft vocabulary. Own KV cache."""

    def __init__(self, cfg: DenseConfig, n_features: int, draft_vocab_size: int, norm_before_residual: bool = False) -> None:
        super().__init__()
        h = cfg.hidden_size
        self.rotary = Rotary(cfg.hd, cfg.max_seq_len, cfg.rope_theta)
        self.fc = Linear(n_features * h, h, bias=False)
        self.layers = nn.ModuleList([Eagle3Layer(cfg, self.rotary)])
        self.norm = RMSNorm(h, cfg.norm_eps)
        self.lm_head = Linear(h, draft_vocab_size, bias=False)
        self.norm_before_residual = norm_before_residual
        self.register_buffer("d2t", torch.zeros(draft_vocab_size, dtype=torch.long))  # (N,) target id - draft id
        self.register_buffer("t2d", torch.ones(cfg.vocab_size, dtype=torch.bool) if draft_vocab_size == cfg.vocab_size
                             else torch.zeros(cfg.vocab_size, dtype=torch.bool))  # (V,) in the draft vocabulary

    def set_vocab(self, ids: Tensor) -> None:
        """The draft vocabulary: target token ids (N,), any order; stored as HF checkpoints store it (d2t offsets in
        ascending target order, t2d the membership mask)."""
        ids = ids.sort().values
        self.d2t.copy_(ids - torch.arange(ids.numel()))
        self.t2d.zero_()
        self.t2d[ids] = True

    @property
    def ids(self) -> Tensor:
        """(N,) the target token id of each draft-vocabulary entry."""
        return torch.arange(self.d2t.numel()) + self.d2t

    def features(self, layer_inputs: Tensor) -> Tensor:
        """(T, 3H) the target's layer inputs, concatenated -> g (T, H)."""
        return self.fc(layer_inputs.to(self.norm.weight.dtype))  # (the norm's: fc may hold GGUF blocks, heads.on_blocks)


class Eagle3Vocab(SubsetHead):
    """The module's own output head over its draft vocabulary, drafted through as a draft_vocab.DraftHead is."""

    def __init__(self, module: Eagle3Module, vocab_size: int) -> None:
        super().__init__(module.ids, vocab_size)  # (N,)
        self.module = module

    def logits(self, h: Tensor) -> Tensor:
        """h (T, H) pre-norm outputs -> (T, N) float32."""
        return self.module.lm_head(self.module.norm(h)).float()


__all__ = ["Eagle3Module", "Eagle3Layer", "Eagle3Vocab", "default_layers"]

"""What both exports (export.py: Hugging Face, export_gguf.py: llama.cpp) need of a model's layout: whether it is a
Qwen3.5-style hybrid, and Qwen3-Next's fused DeltaNet input projections (the reverse of loading/hf.py's
split_qwen3_next)."""

from __future__ import annotations

import torch


def is_hybrid(module) -> bool:
    from .models.qwen35 import HybridLM

    return isinstance(module, HybridLM)


def fuse_qwen3_next(c, qkv: torch.Tensor, z: torch.Tensor, b: torch.Tensor, a: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Qwen3.5's in_proj_qkv / z / b / a -> Qwen3-Next's in_proj_qkvz / in_proj_ba, grouped per key head."""
    nk, dk, dv, h = c.linear_num_key_heads, c.linear_key_head_dim, c.linear_value_head_dim, qkv.shape[-1]
    r = c.linear_num_value_heads // nk  # value heads per key head
    q, k, v = qkv.split([nk * dk, nk * dk, nk * r * dv])  # (nk*dk, H), (nk*dk, H), (nv*dv, H)
    parts = [q.reshape(nk, dk, h), k.reshape(nk, dk, h), v.reshape(nk, r * dv, h), z.reshape(nk, r * dv, h)]
    qkvz = torch.cat(parts, dim=1).reshape(-1, h)  # (nk * (2dk + 2r dv), H)
    ba = torch.cat([b.reshape(nk, r, h), a.reshape(nk, r, h)], dim=1).reshape(-1, h)  # (nk * 2r, H)
    return qkvz.contiguous(), ba.contiguous()

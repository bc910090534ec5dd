"""Row-invariant attention for decode and verify windows: each query row computed alone (attention.cpp).

A quantized model rounds every activation to 8 bits before its products, so a difference of one ulp between a
verify row and the plain step at the same position can become a different token. The matrix products are
row-invariant (kernels.quantized); this makes attention so: a row's output is a function of its query and the keys
it sees, visited in index order, whatever else shares the call. Without a compiler (or MTPSPEC_KERNELS=0) the same
contract holds through torch, one row at a time (slower).
"""

from __future__ import annotations


import torch
from torch import Tensor

from . import Extension


def _ready() -> None:  # shapes for torch.compile's tracing
    torch.library.register_fake("mtpspec_attention::attend_rows")(lambda q, k, v, seq, lo, hi, mask, scale: torch.empty_like(q))
    torch.library.register_fake("mtpspec_attention::write_rows")(lambda k_buf, v_buf, pos, k, v: None)


_EXT = Extension("mtpspec_attention", "attention.cpp", "attention", "attention runs one row at a time through torch", _ready)


def available() -> bool:
    """Build (or load the cached build of) attention.cpp once per process; False, with a warning, if that fails."""
    return _EXT.available()


def attend_rows(q: Tensor, k: Tensor, v: Tensor, seq: Tensor, lo: Tensor, hi: Tensor, mask: Tensor | None = None,
                scale: float | None = None) -> Tensor:
    """q (R, nh, hd), k / v (B, nkv, S, hd) fp32 -> (R, nh, hd): row r attends to keys lo[r]..hi[r] of sequence seq[r]
    (where mask (R, S') allows, a token tree's ancestors), query head h reading KV head h // (nh / nkv)."""
    scale = q.shape[-1] ** -0.5 if scale is None else scale
    if q.device.type == "cpu" and available() and k.stride(-1) == 1 and v.stride(-1) == 1:
        return torch.ops.mtpspec_attention.attend_rows(q, k, v, seq, lo, hi, mask, scale)
    out = q.new_zeros(q.shape)
    g = q.shape[1] // k.shape[1]
    for r in range(q.shape[0]):
        b, a, z = int(seq[r]), int(lo[r]), int(hi[r]) + 1
        keys = torch.arange(a, z, device=k.device)
        if mask is not None:
            keys = keys[mask[r, a:z]]
        kr = k[b, :, keys].repeat_interleave(g, 0)  # (nh, n, hd)
        vr = v[b, :, keys].repeat_interleave(g, 0)
        w = torch.softmax((kr @ q[r, :, :, None])[..., 0] * scale, dim=-1)  # (nh, n)
        out[r] = (w[:, None, :] @ vr)[:, 0]
    return out

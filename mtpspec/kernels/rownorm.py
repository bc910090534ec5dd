"""RMSNorm in one call per norm, row-invariant (rownorm.cpp): for models whose every op must compute a row as its
one-row call does (GGUF block weights, with their 8-bit activations), and whose decode step is dispatch-bound."""

from __future__ import annotations


import torch
from torch import Tensor

from . import Extension


def _ready() -> None:  # shapes for torch.compile's tracing
    torch.library.register_fake("mtpspec_rownorm::rms_norm")(lambda x, w, eps, zero_centred: torch.empty_like(x))
    torch.library.register_fake("mtpspec_rownorm::norm_rope")(
        lambda x, w, eps, zero_centred, cos, sin: x.new_empty(x.shape))


_EXT = Extension("mtpspec_rownorm", "rownorm.cpp", "rownorm", "norms run on torch ops", _ready)


def available() -> bool:
    """Build (or load the cached build of) rownorm.cpp once per process; False, with a warning, if that fails."""
    return _EXT.available()


def rms_norm(x: Tensor, w: Tensor, eps: float, zero_centred: bool = False) -> Tensor:
    """x (..., D) fp32, w (D,) fp32 -> x / sqrt(mean(x^2) + eps) * w (or * (1 + w)); each row computed alone."""
    if x.device.type == "cpu" and available():
        return torch.ops.mtpspec_rownorm.rms_norm(x, w, eps, zero_centred)
    y = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps)
    return y * (1.0 + w) if zero_centred else w * y

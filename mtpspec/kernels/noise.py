"""The tokens that can win a Gumbel-max draw over a whole vocabulary (noise.cpp): sampling.gumbel_max then scores
those few where it would score all of them."""

from __future__ import annotations

from torch import Tensor

from . import Extension


_EXT = Extension("mtpspec_noise", "noise.cpp", "noise", "Gumbel-max draws score every token of their support")


def available() -> bool:
    """Build (or load the cached build of) noise.cpp once per process; False, with a warning, if that fails."""
    return _EXT.available()


def gumbel_candidates(probs: Tensor, key: int) -> Tensor | None:
    """(V,) float32 CPU probabilities and a 64-bit noise key -> (n,) ascending ids holding the Gumbel-max winner, or
    None where the kernel does not serve (another device or dtype, no build)."""
    import torch

    if probs.device.type != "cpu" or probs.dtype != torch.float32 or probs.ndim != 1 or not available():
        return None
    k = key - (1 << 64) if key >= 1 << 63 else key  # the op takes the 64-bit pattern as an int64
    return torch.ops.mtpspec_noise.gumbel_candidates(probs.contiguous(), k)

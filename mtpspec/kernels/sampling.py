"""Passes over a large vocabulary's row (sampling.cpp) that spare sampling.py whole-row sorts and scores: the
leading tokens of a row for top-p, and the tokens that can win a Gumbel-max draw."""

from __future__ import annotations

import torch
from torch import Tensor

from . import Extension


_EXT = Extension("mtpspec_sampling", "sampling.cpp", "sampling", "top-p and Gumbel-max draws run on torch ops")


def available() -> bool:
    """Build (or load the cached build of) sampling.cpp once per process; False, with a warning, if that fails."""
    return _EXT.available()


def _served(x: Tensor) -> bool:
    return x.device.type == "cpu" and x.dtype == torch.float32 and x.ndim == 1 and available()


def leading_ids(logits: Tensor, k: int) -> Tensor | None:
    """(V,) float32 CPU logits -> (n,) ascending ids of every token at or above some threshold, n >= k and few more
    (a prefix of the descending order); None where the kernel does not serve or finds no such set (a NaN logit, fewer
    than k finite ones)."""
    if not _served(logits):
        return None
    ids = torch.ops.mtpspec_sampling.leading_ids(logits.contiguous(), k)
    return ids if ids.shape[0] >= k else None


def gumbel_candidates(probs: Tensor, key: int) -> Tensor | None:
    """(V,) float32 CPU probabilities and a 64-bit noise key -> (n,) ascending ids holding the Gumbel-max winner, or
    None where the kernel does not serve (another device or dtype, no build)."""
    if not _served(probs):
        return None
    k = key - (1 << 64) if key >= 1 << 63 else key  # the op takes the 64-bit pattern as an int64
    return torch.ops.mtpspec_sampling.gumbel_candidates(probs.contiguous(), k)

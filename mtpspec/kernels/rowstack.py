"""A dense decoder stack over one sequence's rows in order, in one call (rowstack.cpp): the ops of models/forward.py's
row path (RowPlan) in the same order with the same arguments, so bitwise the same outputs, without the Python between
them (most of a small quantized model's decode step)."""

from __future__ import annotations

import torch
from torch import Tensor

from . import Extension, attention, quantized, rownorm

_EXT = Extension("mtpspec_rowstack", "rowstack.cpp", "rowstack", "the row path runs its layers one op at a time")


def available() -> bool:
    """The stack's kernel and the kernels it calls, each built (or loaded) once per process."""
    return quantized.available() and rownorm.available() and attention.available() and _EXT.available()


def dense_stack(x: Tensor, weights: list[Tensor], qtypes: list[int], ns: list[int], norms: list[Tensor], k_bufs: Tensor,
                v_bufs: Tensor, first: int, rotary: list[Tensor], lo: list[Tensor], masks: list[Tensor], seq: Tensor,
                slot: Tensor, hi: Tensor, dims: list[int], eps: float, zero_centred: bool, scale: float) -> Tensor:
    """x (N, H) entering layer `first` -> the stream after len(weights) / 7 layers (see rowstack.cpp for the lists)."""
    return torch.ops.mtpspec_rowstack.dense_stack(x, weights, qtypes, ns, norms, k_bufs, v_bufs, first, rotary, lo, masks,
                                                   seq, slot, hi, dims, eps, zero_centred, scale)

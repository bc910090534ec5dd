"""Preallocated, position-indexed KV cache: rollback moves a length pointer, nothing is re-run.

A forward over T new tokens writes keys and values at positions [length, length + T) and advances
`length`; rejecting drafts is `crop(new_length)`, after which the rejected positions are simply
overwritten by the next forward.
"""

from __future__ import annotations

import math
import mmap
from typing import Any, Protocol, runtime_checkable

import torch
from torch import Tensor

from .errors import ConfigError


def check_room(end: int, max_len: int, what: str = "model") -> None:
    """A forward that would write up to position `end` into a cache of `max_len` positions: a ConfigError naming both."""
    if end > max_len:
        raise ConfigError(f"context full: {end} positions exceed the {what}'s context of {max_len}")


LAZY_BYTES = 1 << 20  # buffers from this size on are mapped, not filled


def lazy_zeros(shape: tuple[int, ...], dtype: torch.dtype, device: torch.device | str | None = None) -> Tensor:
    """A zero tensor whose memory is committed page by page as it is written: a large buffer is an anonymous mapping
    (zero pages by definition), so a cache sized for the model's whole context costs what a sequence writes (Gemma 3's
    8192 positions are 302 MB of fp32 K / V, a short request touches a few MB) and nothing to allocate.
    device: where (None: torch's default device, which the engine sets to the model's); off the CPU a plain
    torch.zeros there, allocated whole."""
    device = torch.get_default_device() if device is None else torch.device(device)
    if device.type != "cpu":
        return torch.zeros(shape, dtype=dtype, device=device)
    size = math.prod(shape) * torch.empty(0, dtype=dtype, device="cpu").element_size()
    if size < LAZY_BYTES:
        return torch.zeros(shape, dtype=dtype, device="cpu")
    return torch.frombuffer(mmap.mmap(-1, size), dtype=dtype).view(shape)  # the tensor keeps the mapping alive


@runtime_checkable
class Cache(Protocol):
    """A sequence's cache, as every caller uses it (KVCache; HybridCache adds the Gated DeltaNet layers' state, which
    only the forward reads and records). Positions [0, length) are committed; a forward writes from `length` on and
    advances; rollback is crop (a pointer, or a slot of the last forward's recurrent state)."""

    length: int
    max_len: int  # the longest context it holds
    crops_across_forwards: bool  # crop() reaches any earlier length (False: only into the last forward; snapshot first)

    @property
    def kv(self) -> "KVCache": ...  # the key / value buffers of the attention layers

    def advance(self, t: int) -> None: ...  # after a forward of t positions
    def crop(self, length: int) -> None: ...  # roll back to the first `length` positions
    def keep(self, start: int, rows: list[int]) -> None: ...  # after a tree forward from start: its rows `rows` first
    def snapshot(self) -> Any: ...  # what restore() needs to come back here after any number of forwards
    def restore(self, snapshot: Any) -> None: ...



class KVCache:
    def __init__(
        self,
        n_layers: int,
        n_kv_heads: int,
        head_dim: int,
        max_len: int,
        dtype: torch.dtype = torch.float32,
        batch: int = 1,
        device: torch.device | str | None = None,  # None: torch's default device (the engine's: the model's)
    ) -> None:
        shape = (n_layers, batch, n_kv_heads, max_len, head_dim)
        self.k = lazy_zeros(shape, dtype, device)  # (L, B, n_kv, max_len, hd)
        self.v = lazy_zeros(shape, dtype, device)  # (L, B, n_kv, max_len, hd)
        self.max_len = max_len
        self.length = 0  # committed positions

    crops_across_forwards = True  # crop() reaches any earlier length, however many forwards ago
    index = None  # sparse attention's indexer keys (models/sparse_attention.IndexKeys), position-indexed like k / v
    sparse = None  # sparse attention's selection state (SparseState: recompute, or reuse one row's blocks), or None

    @property
    def kv(self) -> "KVCache":
        return self

    def buffers(self, layer: int) -> tuple[Tensor, Tensor]:
        """Layer `layer`'s key and value buffers (B, n_kv, max_len, hd), written by the forward at its rows' positions."""
        return self.k[layer], self.v[layer]

    def advance(self, t: int) -> None:
        self.length += t

    def keep(self, start: int, rows: list[int]) -> None:
        """After a tree forward from `start`: its entries at `rows` (the root and the accepted path) moved to
        start, start + 1, ... (so crop(start + len(rows)) keeps exactly them)."""
        if rows == list(range(len(rows))):  # already in place
            return
        idx = torch.tensor(rows, dtype=torch.long, device=self.k.device) + start
        n = len(rows)
        self.k[:, :, :, start : start + n] = self.k[:, :, :, idx]  # advanced indexing reads a copy first
        self.v[:, :, :, start : start + n] = self.v[:, :, :, idx]

    def crop(self, length: int) -> None:
        """Roll back to the first `length` positions (a pointer move)."""
        if not 0 <= length <= self.length:
            raise ValueError(f"cannot crop a cache of length {self.length} to {length}")
        self.length = length

    def snapshot(self) -> int:
        """What restore() needs to come back to the current length: the length itself."""
        return self.length

    def restore(self, snapshot: int) -> None:
        self.crop(snapshot)

"""Cache of a hybrid model: a KV cache for the full-attention layers, slot states for the linear ones.

Rollback without re-running anything, for both kinds of layer:

- full attention: keys/values live at explicit positions; `crop` moves the length pointer.
- Gated DeltaNet: every forward records, per layer, the conv inputs of the window it ran over
  (the previous K-1 inputs + the T new ones, i.e. the conv window widened by T) and the recurrent
  state after each of its T positions (the D+1 slots of a verify pass). `crop(length)` for any
  length in [start of the last forward, its end] just selects slot `length - start`; the state is
  materialised lazily by the next forward. Nothing is inverted, nothing is re-run.

Forwards longer than RECURRENT_MAX_T (prefill) keep only their final state: cropping inside such
a forward raises.
"""

from __future__ import annotations

import torch
from torch import Tensor

from ..cache import KVCache
from ..errors import ConfigError


class HybridCache:
    def __init__(
        self,
        n_full: int,
        n_kv_heads: int,
        head_dim: int,
        n_linear: int,
        conv_dim: int,
        conv_kernel: int,
        state_shape: tuple[int, int, int],  # (nv, dk, dv)
        max_len: int,
        dtype: torch.dtype,
    ) -> None:
        self.kv = KVCache(max(n_full, 1), n_kv_heads, head_dim, max_len, dtype)
        self.max_len = max_len
        self.n_linear, self.conv_dim, self.conv_kernel = n_linear, conv_dim, conv_kernel
        self.state_shape, self.dtype = state_shape, dtype
        self.length = 0  # committed positions
        self.fwd_start = 0  # start of the last forward
        self.fwd_end = 0  # end of the last forward
        self.all_slots = True  # the last forward kept the state after every position
        self.pending_all_slots = True
        self.hist: list[Tensor | None] = [None] * n_linear  # (B, C, K-1+T) conv inputs of the last forward
        # per linear layer, (slots, B, nv, dk, dv) fp32: row 0 = the state before the last forward, row j =
        # after its j-th position (only row 1 = the final state after a chunked forward). Reused across forwards.
        self.states: list[Tensor | None] = [None] * n_linear

    # -- the interface the layers use -------------------------------------------------------
    def _row(self) -> int:
        """Slot row of the state at `self.length` (positions kept of the last forward)."""
        j = self.length - self.fwd_start
        return j if self.all_slots or j == 0 else 1

    def conv_window(self, i: int, batch: int = 1) -> Tensor:
        """The K-1 conv inputs before position `self.length`: (B, C, K-1)."""
        hist = self.hist[i]
        if hist is None:
            return torch.zeros(batch, self.conv_dim, self.conv_kernel - 1, dtype=self.dtype)
        j = self.length - self.fwd_start
        return hist[:, :, j : j + self.conv_kernel - 1]

    def state(self, i: int, batch: int = 1) -> Tensor:
        """The recurrent state at `self.length`: (B, nv, dk, dv) fp32."""
        buf = self.states[i]
        if buf is None:
            return torch.zeros(batch, *self.state_shape, dtype=torch.float32)
        return buf[self._row()]

    def linear_state(self, i: int, batch: int = 1) -> tuple[Tensor, Tensor]:
        return self.conv_window(i, batch), self.state(i, batch)

    def slot_buffer(self, i: int, t: int, batch: int, all_positions: bool) -> Tensor:
        """A (1 + t | 2, B, nv, dk, dv) buffer for the coming forward, row 0 holding the current state."""
        need = t + 1 if all_positions else 2
        buf, row = self.states[i], self._row()
        if buf is None:
            buf = torch.zeros(need, batch, *self.state_shape, dtype=torch.float32)
        elif buf.shape[0] < need:
            grown = torch.empty(need, batch, *self.state_shape, dtype=torch.float32)
            grown[0] = buf[row]
            buf = grown
        elif row != 0:
            buf[0].copy_(buf[row])
        self.states[i] = buf
        return buf

    def record_linear(self, i: int, hist: Tensor, all_positions: bool) -> None:
        """After layer i's forward: keep its widened conv window (its states are already in its buffer)."""
        self.hist[i] = hist
        self.pending_all_slots = all_positions

    def begin(self, t: int) -> int:
        """Called by the model before a forward of t positions; returns the start position."""
        if self.length + t > self.max_len:
            raise ConfigError(f"context full: {self.length + t} positions exceed the model's context of {self.max_len}")
        return self.length

    def advance(self, t: int) -> None:
        if self.n_linear:
            self.all_slots = self.pending_all_slots
        self.fwd_start, self.fwd_end = self.length, self.length + t
        self.length += t
        self.kv.length = self.length

    # -- rollback ---------------------------------------------------------------------------
    def crop(self, length: int) -> None:
        """Roll back to the first `length` positions: pointer move (KV) + slot choice (recurrent)."""
        if not 0 <= length <= self.length:
            raise ValueError(f"cannot crop a cache of length {self.length} to {length}")
        if self.n_linear and length != self.length:
            if length < self.fwd_start:
                raise ValueError(
                    f"cannot crop recurrent state to {length}: only positions {self.fwd_start}..{self.fwd_end} "
                    "of the last forward have saved states"
                )
            if not self.all_slots and length not in (self.fwd_start, self.fwd_end):
                raise ValueError(
                    f"cannot crop recurrent state to {length}: the last forward ({self.fwd_end - self.fwd_start} "
                    "positions, chunked) kept only its final state"
                )
        self.length = length
        self.kv.length = length

"""Cache of a hybrid model: a KV cache for the full-attention layers, slot states for the linear ones.

Rollback without re-running anything, for both kinds of layer:

- full attention: keys/values live at explicit positions; `crop` moves the length pointer.
- Gated DeltaNet: every forward records, per layer, the conv inputs of its window (the previous K-1
  inputs + the T new ones) and what defines the recurrent state after each of its T positions (the
  D+1 slots of a verify pass). `crop(length)` for any length in [start of the last forward, its end]
  selects slot j = length - start. Nothing is inverted, nothing is re-run.

The slots are kept in factored form, per piece of at most 64 positions: the piece's incoming state
S_0 plus, per position i, the cumulative log decay gc_i from the piece start, the key k_i and the
delta-rule correction u_i that was written, so

    S_j = S_0 * exp(gc_{j-1}) + sum_{i < j} exp(gc_{j-1} - gc_i) k_i u_i^T        (j = 1..piece length)

The selected slot is materialised (in place over S_0, one pass over the state) when the next forward
starts: one pass per verify instead of D+1 full states written. Decays stay piece-local, so long windows
keep their precision. In exact mode a window keeps its T states (bitwise those of plain steps).

A prompt's prefill (ForwardBatch.prefill, as the engine runs it) is never cropped inside, so it keeps only
its final state and the two ends of its conv window. Any other forward keeps its slots. Cropping inside a
prefill raises. The draft length is limited only by the context.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

from ..cache import KVCache
from .common import wide


@dataclass
class Window:
    """One piece of a forward, for one linear layer: enough to rebuild the state at any of its slots."""

    gc: Tensor | None = None  # (B, nv, T) cumulative log decay from the piece start (inclusive)
    k: Tensor | None = None  # (B, nv, T, dk) L2-normalised keys
    u: Tensor | None = None  # (B, nv, T, dv) the corrections written (v_new of the chunk form)
    states: list[Tensor] | None = None  # or, in exact mode, the T states themselves (recurrent form)
    start: int = 0  # the piece's first position, counted from the start of the forward
    s0: Tensor | None = None  # (B, nv, dk, dv) its incoming state; None for the first piece (the cache's base)

    @property
    def length(self) -> int:
        return len(self.states) if self.states is not None else self.gc.shape[-1]

    def take(self, b: int, t: int) -> "Window":
        """Sequence b's first t positions of a batched piece (its padding rows come after them)."""
        if self.states is not None:
            return Window(states=[s[b : b + 1] for s in self.states[:t]])
        return Window(self.gc[b : b + 1, :, :t], self.k[b : b + 1, :, :t], self.u[b : b + 1, :, :t])


def slot_state(s0: Tensor, w: Window, j: int, in_place: bool = False) -> Tensor:
    """The state after the first j (>= 1) positions of piece w, from its incoming state s0: one pass over it."""
    if w.states is not None:
        return w.states[j - 1]
    g_end = w.gc[:, :, j - 1]  # (B, nv)
    kd = w.k[:, :, :j] * (g_end[..., None] - w.gc[:, :, :j]).exp()[..., None]  # (B, nv, j, dk)
    b, h, dk, dv = s0.shape
    s = s0.mul_(g_end.exp()[..., None, None]) if in_place else s0 * g_end.exp()[..., None, None]
    s.view(b * h, dk, dv).baddbmm_(kd.reshape(b * h, j, dk).transpose(1, 2), w.u[:, :, :j].reshape(b * h, j, dv))
    return s


@dataclass
class Stitch:
    """One-position forwards being joined into one rollback window (HybridCache.stitch_*)."""

    start: int
    base: list[Tensor]  # per linear layer: the state at `start` (a copy)
    conv: list[Tensor]  # per linear layer: the K-1 conv inputs before `start`
    states: list[list[Tensor]]  # per linear layer: the state after each position so far
    cols: list[list[Tensor]]  # per linear layer: each position's conv input (B, C, 1)


@dataclass(frozen=True)
class HybridSnapshot:
    """The cache at one length, copied: restore() returns to it after any number of forwards."""

    length: int
    conv: list[Tensor]  # per linear layer (B, C, K-1): the conv inputs before `length`
    state: list[Tensor]  # per linear layer (B, nv, dk, dv): the recurrent state at `length`


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
        self.hist: list[Tensor | None] = [None] * n_linear  # (B, C, K-1+T) conv inputs of the last forward
        self.base: list[Tensor | None] = [None] * n_linear  # (B, nv, dk, dv) >= fp32: state before the last forward
        self.window: list[list[Window] | None] = [None] * n_linear  # pieces of the last forward (not a prefill)
        self.final: list[Tensor | None] = [None] * n_linear  # final state of the last forward if it was a prefill

    # -- the interface the layers use -------------------------------------------------------
    def conv_window(self, i: int, batch: int = 1) -> Tensor:
        """The K-1 conv inputs before position `self.length`: (B, C, K-1)."""
        hist = self.hist[i]
        if hist is None:
            return torch.zeros(batch, self.conv_dim, self.conv_kernel - 1, dtype=self.dtype, device=self.kv.k.device)
        j = self.length - self.fwd_start
        if j and self.final[i] is not None:  # a prefill kept only the two ends of its conv window
            j = self.conv_kernel - 1
        return hist[:, :, j : j + self.conv_kernel - 1]

    def state(self, i: int, batch: int = 1, in_place: bool = False) -> Tensor:
        """The recurrent state at `self.length`: (B, nv, dk, dv) in at least fp32 (slot j of the last forward)."""
        base = self.base[i]
        if base is None:
            base = self.base[i] = torch.zeros(batch, *self.state_shape, dtype=wide(self.dtype), device=self.kv.k.device)
        j = self.length - self.fwd_start
        if j == 0:
            return base
        if self.final[i] is not None:  # after a prefill only j == T exists (crop checks it)
            return self.final[i]
        pieces = self.window[i]
        if pieces is None:
            return base
        w = next(w for w in pieces if j <= w.start + w.length)  # the piece holding slot j
        s0 = base if w.s0 is None else w.s0
        return s0 if j == w.start else slot_state(s0, w, j - w.start, in_place)

    def linear_state(self, i: int, batch: int = 1) -> tuple[Tensor, Tensor]:
        return self.conv_window(i, batch), self.state(i, batch)

    def start_state(self, i: int, batch: int = 1) -> Tensor:
        """The state a new forward starts from, materialised in place (the old slots are dropped)."""
        s = self.state(i, batch, in_place=True)
        self.base[i], self.window[i], self.final[i] = s, None, None
        return s

    def record_window(self, i: int, hist: Tensor, rec: list[Window] | Tensor) -> None:
        """After layer i's forward: its widened conv window (B, C, K-1+T) and its pieces' slots, or a prefill's final
        state (a Tensor)."""
        window, final = (None, rec) if isinstance(rec, Tensor) else (rec, None)
        if final is not None:  # crop can only select the prefill's start or end: keep the conv window's ends
            k1 = self.conv_kernel - 1
            hist = torch.cat([hist[..., :k1], hist[..., hist.shape[-1] - k1 :]], dim=-1)  # (B, C, 2(K-1))
        self.hist[i], self.window[i], self.final[i] = hist, window, final

    def advance(self, t: int) -> None:
        self.fwd_start, self.fwd_end = self.length, self.length + t
        self.length += t
        self.kv.length = self.length

    def stitch_begin(self) -> "Stitch":
        """Before one-position forwards that must roll back as one forward (exact mode's verify pass, common.by_position)."""
        n = range(self.n_linear)
        return Stitch(self.length, [self.state(i).clone() for i in n], [self.conv_window(i) for i in n], [[] for _ in n], [[] for _ in n])

    def stitch_add(self, st: "Stitch") -> None:
        """After each of them: keep the state after its position and its conv input."""
        for i in range(self.n_linear):
            st.states[i].append(self.state(i))  # a new tensor: the next forward materialises its start in place over base
            st.cols[i].append(self.hist[i][..., -1:])  # (B, C, 1)

    def stitch_end(self, st: "Stitch") -> None:
        """After the last: the cache holds a slot for each of their positions, as one forward over them would."""
        self.fwd_start, self.fwd_end = st.start, self.length
        for i in range(self.n_linear):
            self.base[i], self.final[i] = st.base[i], None
            self.hist[i] = torch.cat([st.conv[i], *st.cols[i]], dim=-1)  # (B, C, K-1+T)
            self.window[i] = [Window(states=st.states[i])]

    # -- rollback ---------------------------------------------------------------------------
    def keep(self, start: int, rows: list[int]) -> None:
        """After a tree forward from `start`: keep its rows `rows` (the root and the accepted path) as if the
        forward had run over them alone, in that order: KV entries moved, each linear layer's per-row records
        (decays, keys, corrections along each row's own path: a chain's window, tree.py) re-indexed."""
        if start != self.fwd_start:
            raise ValueError(f"keep({start}, ...) after a forward from {self.fwd_start}")
        if rows == list(range(len(rows))):  # rows 0..n in place, each row's records a chain's: the crop that follows suffices
            return
        self.kv.keep(start, rows)
        idx = torch.tensor(rows, dtype=torch.long, device=self.kv.k.device)
        k1 = self.conv_kernel - 1
        for i in range(self.n_linear):
            (w,) = self.window[i]  # a tree window is one piece (T <= 64)
            self.window[i] = [Window(w.gc[:, :, idx], w.k[:, :, idx], w.u[:, :, idx])]
            self.hist[i] = torch.cat([self.hist[i][..., :k1], self.hist[i][..., k1 + idx]], dim=-1)
        self.fwd_end = self.length = self.kv.length = start + len(rows)

    @property
    def crops_across_forwards(self) -> bool:
        """crop() reaches only into the last forward when there is recurrent state: a caller that
        runs several forwards before rolling back (a draft model drafting token by token) takes a
        snapshot() first and restore()s it."""
        return self.n_linear == 0

    def snapshot(self) -> HybridSnapshot:
        """A copy of the recurrent state at the current length (KV entries stay in place: positions are
        overwritten after a restore)."""
        n = range(self.n_linear)
        return HybridSnapshot(self.length, [self.conv_window(i).clone() for i in n], [self.state(i).clone() for i in n])

    def restore(self, snap: HybridSnapshot) -> None:
        """Back to the snapshot's length and state, whatever ran since (nothing is re-run here)."""
        if snap.length > self.length:
            raise ValueError(f"cannot restore a snapshot at {snap.length} in a cache of length {self.length}")
        self.length = self.kv.length = self.fwd_start = self.fwd_end = snap.length
        for i in range(self.n_linear):  # copies again: the next forward materialises slots in place over base
            self.hist[i], self.base[i] = snap.conv[i].clone(), snap.state[i].clone()
            self.window[i], self.final[i] = None, None

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
            prefilled = any(f is not None for f in self.final)
            if prefilled and length not in (self.fwd_start, self.fwd_end):
                raise ValueError(
                    f"cannot crop recurrent state to {length}: the last forward ({self.fwd_end - self.fwd_start} "
                    "positions) was a prefill and kept only its final state"
                )
        self.length = length
        self.kv.length = length

"""ForwardBatch: what one forward computes, row by row, stated to the forward instead of set on caches.

A forward runs B sequences x W rows (a grid; a sequence with fewer rows is padded after its real ones). Per row: its
position (`pos`), whether it is real (`rows`); per forward: whether the one sequence's rows are consecutive positions
from `start` (eager decoding, prefill, training windows: attention slices the keys it needs) or positions are known as
tensors only (batches, compiled graphs), a token tree over the rows, whether it is a prompt's prefill (never cropped
inside: a Gated DeltaNet keeps its final state only), the recurrence's form, and whether the LM head runs.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor


@dataclass(frozen=True)
class ForwardBatch:
    pos: Tensor  # (B, W) each row's position; a padding row's is past the context (a scratch position no query sees)
    rows: Tensor | None = None  # (N,) the real rows of the flattened (B, W) grid; None: all of them
    start: int | None = None  # one sequence at consecutive positions start..start+W-1 (or a tree from start); None: tensors only
    tree: object | None = None  # a TreeLayout / TreeRows over one sequence's rows: row i sees the committed keys and its ancestors
    trees: tuple | None = None  # B sequences' token trees (TreeLayout, W rows each; a chain is a path): see `many`
    anc: Tensor | None = None  # (B, W, W) with `trees`: anc[b, i, j] = row j is row i or one of its ancestors
    slots: Tensor | None = None  # (B, W) with `trees`: each row's buffer index (start + row); its position is start + depth
    prefill: bool = False  # a prompt: never cropped inside (a Gated DeltaNet keeps its final state only)
    runs: tuple[tuple[int, int], ...] | None = None  # from `many`: each sequence's (start, rows)
    sparse: str = "recompute"  # how block-sparse layers choose their blocks (sparse_attention.SELECTIONS)
    steps: bool = False  # a Gated DeltaNet window position by position, returning each state (compiled graphs of small states)
    logits: bool = True  # False: the LM head is left out (a prefill nobody reads, a tree verified lazily)

    @property
    def b(self) -> int:
        return self.pos.shape[0]

    @property
    def w(self) -> int:
        return self.pos.shape[1]

    @staticmethod
    def one(start: int, t: int, tree=None, prefill: bool = False, logits: bool = True, sparse: str = "recompute") -> "ForwardBatch":
        """One sequence's t rows from `start` (a tree's rows at start + depth)."""
        pos = torch.arange(start, start + t) if tree is None else tree.positions(start)
        return ForwardBatch(pos[None], start=start, tree=tree, prefill=prefill, logits=logits, sparse=sparse)

    @staticmethod
    def many(starts: list[int], lens: list[int], scratch: int, trees: list | None = None) -> "ForwardBatch":
        """Sequences b = 0..B-1 with lens[b] rows from starts[b], padded to the widest; padding rows continue past the
        real ones, clamped to `scratch` (a position past every sequence's context).

        trees[b]: sequence b's TreeLayout (its rows: the root, then the nodes) or None (a chain). With any tree, every
        sequence gets a layout of W rows (a chain is a path; padding rows hang below the last real row, so no real
        row sees them): row i is written at slot start + i, rotated at position start + depth, and attends to the
        committed keys and its ancestors."""
        width = max(lens)
        real = None if all(n == width for n in lens) else torch.cat([torch.arange(b * width, b * width + n) for b, n in enumerate(lens)])
        slots = torch.stack([torch.arange(s, s + width) for s in starts]).clamp(max=scratch)  # (B, W)
        runs = tuple(zip(starts, lens))
        if trees is None or all(t is None for t in trees):
            return ForwardBatch(slots, real, runs=runs)
        from ..tree import TreeLayout  # a layout is data the forward reads; tree.py builds it

        layouts = []
        for n, tree in zip(lens, trees):
            rows = tree.parent.tolist() if tree is not None else [-1] + list(range(n - 1))  # each real row's parent row
            rows += list(range(n - 1, width - 1))  # padding rows: a path below the last real row
            layouts.append(TreeLayout.of(torch.tensor(rows[1:]) - 1))  # node parents (-1: the root)
        depth = torch.stack([t.depth for t in layouts])  # (B, W)
        pos = (torch.tensor(starts)[:, None] + depth).clamp(max=scratch)  # (B, W)
        return ForwardBatch(pos, real, trees=tuple(layouts), anc=torch.stack([t.anc for t in layouts]), slots=slots, runs=runs)

    @staticmethod
    def window(b: int, t: int) -> "ForwardBatch":
        """B training windows of t positions from 0, no cache (every key is in the window)."""
        return ForwardBatch(torch.arange(t).expand(b, t), start=0, prefill=True, logits=False)

    def grid(self, x: Tensor) -> Tensor:
        """(N, d) real rows -> (B, W, d), padding rows zero."""
        if self.rows is None:
            return x.view(self.b, self.w, x.shape[-1])
        return x.new_zeros(self.b * self.w, x.shape[-1]).index_copy_(0, self.rows, x).view(self.b, self.w, x.shape[-1])

    def real(self, x: Tensor) -> Tensor:
        """(B, W, ...) -> (N, d) the real rows, flattened after the grid dims."""
        x = x.reshape(self.b * self.w, -1)
        return x if self.rows is None else x[self.rows]

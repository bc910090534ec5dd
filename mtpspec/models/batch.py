"""ForwardBatch: what one forward computes, row by row, stated to the forward instead of set on caches.

A forward runs B sequences x W rows (a grid; a sequence with fewer rows is padded after its real ones). Per row: its
position (`pos`), whether it is real (`rows`); per forward: whether the one sequence's rows are consecutive positions
from `start` (eager decoding, prefill, training windows: attention slices the keys it needs) or positions are known as
tensors only (batches, compiled graphs), a token tree over the rows, whether it is a prompt's prefill (never cropped
inside: a Gated DeltaNet keeps its final state only), the recurrence's form, and whether the LM head runs.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from functools import lru_cache

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
    keys: Tensor | None = None  # (S,) a compiled graph's KV span: rows read buffer positions 0..S-1 (S symbolic); None: all

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


@dataclass(frozen=True)
class TreeLayout:
    """The verify window of a tree draft: T rows, row 0 the root, row r's parent row `parent[r]` (-1 for row 0)."""

    parent: Tensor  # (T,) int64, parent[0] = -1, parent[r] < r
    depth: Tensor  # (T,) int64, depth[0] = 0
    anc: Tensor  # (T, T) bool: anc[r, c] = row c is row r or one of its ancestors (lower triangular)
    # the tables every layer of a forward asks for alike: "pos" / "mask" -> (start, table), "taps" -> {width: taps}
    memo: dict = field(default_factory=dict, init=False, repr=False, compare=False)

    @staticmethod
    def of(parents: Tensor) -> "TreeLayout":
        """From a draft's node parents (N,) (-1 = the root). A tree drafter repeats a few shapes step after step: each
        shape is laid out once (its per-forward tables keep the last start only)."""
        return _layout(tuple(parents.tolist()))

    @staticmethod
    def build(parents: tuple[int, ...]) -> "TreeLayout":
        parent = [-1] + [p + 1 for p in parents]  # rows
        depth, anc = [0], [[0]]  # per row: its depth, its ancestors-or-self
        for r in range(1, len(parent)):
            depth.append(depth[parent[r]] + 1)
            anc.append(anc[parent[r]] + [r])
        t = len(parent)
        mask = torch.zeros(t * t, dtype=torch.bool)
        mask[[r * t + c for r, cs in enumerate(anc) for c in cs]] = True
        return TreeLayout(torch.tensor(parent), torch.tensor(depth), mask.view(t, t))

    @property
    def size(self) -> int:
        return int(self.parent.shape[0])

    def positions(self, start: int) -> Tensor:
        """(T,) the position of each row (the same tensor for every layer that asks: Rotary keeps its gather)."""
        memo = self.memo.get("pos")
        if memo is None or memo[0] != start:
            memo = self.memo["pos"] = (start, start + self.depth)
        return memo[1]

    def attn_mask(self, start: int) -> Tensor:
        """(T, start + T) bool: the committed keys 0..start-1, then the row's ancestors and itself."""
        memo = self.memo.get("mask")
        if memo is None or memo[0] != start:
            memo = self.memo["mask"] = (start, torch.cat([torch.ones(self.size, start, dtype=torch.bool), self.anc], dim=1))
        return memo[1]

    def conv_taps(self, kern: int) -> Tensor:
        """(T K,) for a causal conv of width K over the window with its K-1 inputs before it: row r's K input
        columns, oldest first (its ancestors K-1..1 levels up, then itself), row after row."""
        memo = self.memo.setdefault("taps", {})
        if kern not in memo:
            back = self.gather_back(kern - 1)  # (T, K-1)
            memo[kern] = (torch.cat([back.flip(-1), torch.arange(self.size)[:, None]], dim=-1) + kern - 1).flatten()
        return memo[kern]

    def gather_back(self, steps: int) -> Tensor:
        """(T, steps) row indices of each row's ancestors 1..steps levels up (-m: m levels above the root,
        i.e. the m-th input before the window): what a causal conv over a row's own path reads."""
        parent = self.parent.tolist()
        out = []
        for r in range(len(parent)):
            cur, row = r, []
            for _ in range(steps):
                cur = parent[cur] if cur >= 0 else cur - 1
                row.append(cur)
            out.append(row)
        return torch.tensor(out, dtype=torch.long).view(len(parent), steps)


@lru_cache(maxsize=256)
def _layout(parents: tuple[int, ...]) -> TreeLayout:
    return TreeLayout.build(parents)

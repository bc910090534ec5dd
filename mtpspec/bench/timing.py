"""Timing loops' arithmetic: a quantile, and rounds that stop once the estimates are stable or a time budget is
spent. Used by the cost model (costmodel.py), the drafter's cost (drafter_cost.py) and bench --batch (batch.py)."""

from __future__ import annotations

from time import perf_counter
from typing import Callable, Iterator


def quantile(xs, q: float) -> float | None:
    """The q-quantile of xs (an element: the one at rank q * n), None when empty."""
    xs = sorted(xs)
    return xs[min(int(q * len(xs)), len(xs) - 1)] if xs else None


def stable(prev: list[float] | None, cur: list[float], tol: float) -> bool:
    """Every estimate within `tol` (relative) of its value one check earlier."""
    return prev is not None and all(abs(c - p) <= tol * p for p, c in zip(prev, cur))


def rounds(estimate: Callable[[], list[float]], repeat: int, min_repeat: int, tol: float, budget_s: float,
           every: int = 2) -> Iterator[int]:
    """Round numbers 0, 1, ... for a timing loop: at most `repeat`; after `min_repeat`, checked every `every`
    rounds, it stops once no estimate moved by more than `tol` since the last check or `budget_s` seconds are spent."""
    start, prev = perf_counter(), None
    for r in range(repeat):
        yield r
        done = r + 1
        if done >= min_repeat and (done - min_repeat) % every == 0:
            cur = estimate()
            if stable(prev, cur, tol) or perf_counter() - start > budget_s:
                return
            prev = cur

"""Side-by-side measurement for model cards: plain and each (drafter, D) on the same held-out prompts,
greedy, in one process: acceptance by position, mean accepted length (both as metrics.py defines
them), tokens/s relative to plain, and whether every output equals plain greedy token for token."""

from __future__ import annotations

import random
from dataclasses import dataclass

from ..metrics import Acceptance


@dataclass
class Row:
    drafter: str
    k: int
    acceptance_by_position: list[float | None]  # None: no step reached the position
    mean_accepted_length: float  # 1 + accepted / forwards
    tokens_per_second: float
    speedup: float
    identical: bool

    def markdown(self) -> str:
        acc = " / ".join("-" if a is None else f"{a:.2f}" for a in self.acceptance_by_position) or "-"
        return (f"| {self.drafter} | {self.k if self.drafter != 'none' else '-'} | {acc} | {self.mean_accepted_length:.2f} | "
                f"{self.tokens_per_second:.0f} | {self.speedup:.2f}x | {'yes' if self.identical else 'NO'} |")


HEADER = ("| drafter | D | acceptance by position | mean accepted length | tok/s | vs plain | identical to plain |\n"
          "|---|---|---|---|---|---|---|")


def measure_table(model, prompts: list[str], runs: list[tuple], max_new_tokens: int = 128, repeats: int = 1) -> list[Row]:
    """runs: (drafter, k, draft_model or None[, drafter options dict]). Plain runs first; rows keep the runs' order.

    Timing: the runs are interleaved per prompt (in a shuffled order), `repeats` rounds, and each
    (prompt, run) keeps its fastest round: other jobs on a shared machine only ever add time.
    """
    ids = [model.encode(p) for p in prompts]
    refs = [model.generate(i, max_new_tokens=max_new_tokens) for i in ids]  # warm-up + reference
    all_runs = [("none", 1, None, {})] + [(*r, {})[:4] for r in runs]
    tokens = [0] * len(all_runs)
    acceptance = [Acceptance() for _ in all_runs]
    same = [True] * len(all_runs)
    best: dict[tuple[int, int], float] = {}
    order = random.Random(0)
    for rnd in range(repeats):
        for i, (x, ref) in enumerate(zip(ids, refs)):
            for j in order.sample(range(len(all_runs)), len(all_runs)):  # a fresh order: no run always follows another
                drafter, k, dm, opts = all_runs[j]
                r = model.generate(x, drafter=drafter, k=k, draft_model=dm, max_new_tokens=max_new_tokens, **opts)
                best[i, j] = min(best.get((i, j), float("inf")), r.stats.wall_seconds)
                if rnd:
                    continue  # counts come from one round (greedy runs repeat themselves exactly)
                same[j] &= r.tokens == ref.tokens
                tokens[j] += len(r.tokens)
                acceptance[j] += Acceptance.from_steps(r.steps)
    seconds = {j: sum(best[i, j] for i in range(len(ids))) for j in range(len(all_runs))}
    base = tokens[0] / seconds[0]
    rows = []
    for j, (drafter, k, _, opts) in enumerate(all_runs):
        tps = tokens[j] / seconds[j]
        a = acceptance[j]
        label = drafter + "".join(f" ({key.replace('_', ' ')} {val})" for key, val in opts.items())
        rows.append(Row(label, k, a.by_position(k) if drafter != "none" else [], a.mean_accepted_length, tps, tps / base, same[j]))
    return rows

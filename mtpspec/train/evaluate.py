"""Side-by-side measurement for model cards: plain and each (drafter, D) on the same held-out prompts,
greedy, in one process: acceptance by position, mean accepted length (tokens per target forward),
tokens/s relative to plain, and whether every output equals plain greedy token for token."""

from __future__ import annotations

import random
from dataclasses import dataclass


@dataclass
class Row:
    drafter: str
    k: int
    acceptance_by_position: list[float]
    mean_accepted_length: float
    tokens_per_second: float
    speedup: float
    identical: bool

    def markdown(self) -> str:
        acc = " / ".join(f"{a:.2f}" for a in self.acceptance_by_position) or "-"
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
    stats = {j: {"tok": 0, "fwd": 0, "reached": [0] * r[1], "passed": [0] * r[1], "same": True} for j, r in enumerate(all_runs)}
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
                s = stats[j]
                s["same"] &= r.tokens == ref.tokens
                s["tok"] += len(r.tokens)
                s["fwd"] += r.stats.target_forwards
                for st in r.steps:
                    for a in range(min(st.num_accepted + 1, len(st.draft))):
                        s["reached"][a] += 1
                    for a in range(st.num_accepted):
                        s["passed"][a] += 1
    seconds = {j: sum(best[i, j] for i in range(len(ids))) for j in range(len(all_runs))}
    base = stats[0]["tok"] / seconds[0]
    rows = []
    for j, (drafter, k, _, opts) in enumerate(all_runs):
        s = stats[j]
        tps = s["tok"] / seconds[j]
        acc = [p / r for p, r in zip(s["passed"], s["reached"]) if r] if drafter != "none" else []
        label = drafter + "".join(f" ({key.replace('_', ' ')} {val})" for key, val in opts.items())
        rows.append(Row(label, k, acc, s["tok"] / max(s["fwd"], 1), tps, tps / base, s["same"]))
    return rows

"""Side-by-side measurement for model cards: plain and each (drafter, D) on the same held-out prompts,
greedy, in one process: acceptance by position, mean accepted length (both as metrics.py defines
them), tokens/s relative to plain, and whether every output equals plain greedy token for token."""

from __future__ import annotations

from dataclasses import dataclass

from ..alternate import alternate
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
    """runs: (drafter, k, draft_model or None[, drafter options dict]); plain first, rows in the runs' order. The runs
    are interleaved per prompt, `repeats` rounds, each (prompt, run) keeping its fastest (other jobs only add time)."""
    ids = [model.encode(p) for p in prompts]
    refs = [model.generate(i, max_new_tokens=max_new_tokens) for i in ids]  # warm-up + reference
    all_runs = [("none", 1, None, {})] + [(*r, {})[:4] for r in runs]

    def generate(run: tuple, x: list[int]):
        drafter, k, dm, opts = run
        return model.generate(x, drafter=drafter, k=k, draft_model=dm, max_new_tokens=max_new_tokens, **opts)

    results = alternate(all_runs, ids, generate, repeats)  # [run][prompt][round]
    # counts come from one round (greedy runs repeat themselves exactly); each (prompt, run) keeps its fastest time
    firsts = [[tries[0] for tries in by_prompt] for by_prompt in results]
    tokens = [sum(len(r.tokens) for r in rs) for rs in firsts]
    acceptance = [sum((Acceptance.from_steps(r.steps) for r in rs), Acceptance()) for rs in firsts]
    same = [all(r.tokens == ref.tokens for r, ref in zip(rs, refs)) for rs in firsts]
    seconds = [sum(min(r.stats.wall_seconds for r in tries) for tries in by_prompt) for by_prompt in results]
    base = tokens[0] / seconds[0]
    rows = []
    for j, (drafter, k, _, opts) in enumerate(all_runs):
        tps = tokens[j] / seconds[j]
        a = acceptance[j]
        label = drafter + "".join(f" ({key.replace('_', ' ')} {val})" for key, val in opts.items())
        rows.append(Row(label, k, a.by_position(k) if drafter != "none" else [], a.mean_accepted_length, tps, tps / base, same[j]))
    return rows

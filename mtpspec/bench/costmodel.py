"""Cost model: what a step costs on this machine, and the speedup that measured acceptance predicts.

Measured once per model (medians of repeated raw forwards, no engine around them):

- T(k): one target forward over k new tokens on a cache already holding `context` positions;
  reported as T(1) in seconds and the curve T(k)/T(1), k = 1..k_max+1.
- c_draft: seconds per drafted token, per drafter: a one-token forward of the draft model, a
  prompt-lookup proposal on a realistic context, 0 for plain decoding.
- the thread count: T(1) at 1..n threads, the fastest is used (the second core here is weak).

Prediction for a finished run, step by step: each step with d drafts costs c_draft * d + T(d + 1),
and plain decoding needs one T(1) per token, so

    predicted speedup = new_tokens * T(1) / sum over steps (c_draft * d + T(d + 1))

(for a constant D this is the textbook accepted-per-step x T(1) / (T_draft + T(D+1))). The gap to
the measured speedup is the engine's own overhead: bookkeeping, drafter catch-up, prefill.
"""

from __future__ import annotations

import os
import statistics
from dataclasses import asdict, dataclass, field
from time import perf_counter

import torch


@dataclass
class CostModel:
    t1: float  # seconds of a one-token target forward
    ratio: list[float]  # ratio[k-1] = T(k)/T(1), k = 1..len
    draft_cost: dict[str, float] = field(default_factory=dict)  # drafter -> seconds per drafted token
    threads: int = 1  # torch threads used for every timed run
    thread_t1: dict[int, float] = field(default_factory=dict)  # threads -> T(1) seconds, as measured
    context: int = 0  # cache length the forwards were timed at

    def t(self, k: int) -> float:
        """Seconds of a forward over k tokens (extrapolated linearly past the measured curve)."""
        r = self.ratio
        if k <= len(r):
            return self.t1 * r[k - 1]
        slope = r[-1] - r[-2] if len(r) > 1 else 0.0
        return self.t1 * (r[-1] + max(slope, 0.0) * (k - len(r)))

    def step_seconds(self, drafter: str, d: int) -> float:
        return self.draft_cost.get(drafter, 0.0) * d + self.t(d + 1)

    def predict_speedup(self, drafter: str, new_tokens: int, drafts_per_step: list[int]) -> float:
        """Speedup over plain decoding that these steps (d drafted tokens each) should give."""
        cost = sum(self.step_seconds(drafter, d) for d in drafts_per_step)
        return new_tokens * self.t1 / cost if cost > 0 else 0.0

    def predict_constant(self, drafter: str, d: int, mean_accepted_length: float) -> float:
        """accepted-per-step x T(1) / (T_draft + T(D+1)) for a constant depth D."""
        return mean_accepted_length * self.t1 / self.step_seconds(drafter, d)

    def to_json(self) -> dict:
        return asdict(self)


def _median_seconds(fn, repeat: int) -> float:
    fn()  # warm-up
    times = []
    for _ in range(repeat):
        t0 = perf_counter()
        fn()
        times.append(perf_counter() - t0)
    return statistics.median(times)


@torch.inference_mode()
def time_forward(module, k: int, context: int, repeat: int = 30) -> float:
    """Median seconds of module.forward_tokens over k new tokens after `context` cached positions."""
    cache = module.new_cache()
    ctx = min(context, module.max_seq_len - k)
    g = torch.Generator().manual_seed(0)
    module.forward_tokens(torch.randint(3, module.vocab_size, (ctx,), generator=g), cache)
    toks = torch.randint(3, module.vocab_size, (k,), generator=g)

    def step():
        module.forward_tokens(toks, cache)
        cache.crop(ctx)

    return _median_seconds(step, repeat)


def choose_threads(module, context: int = 128, candidates: list[int] | None = None) -> tuple[int, dict[int, float]]:
    """Time T(1) at each thread count; return the fastest and the timings. Restores nothing: the
    caller sets the winner."""
    n = os.cpu_count() or 1
    candidates = candidates or sorted({1, n} | ({2} if n >= 2 else set()))
    timings = {}
    for t in candidates:
        torch.set_num_threads(t)
        timings[t] = time_forward(module, 1, context, repeat=40)
    return min(timings, key=timings.get), timings


def _ngram_cost(k: int = 4, context: int = 128, repeat: int = 200) -> float:
    from ..drafters.ngram import NgramDrafter

    g = torch.Generator().manual_seed(0)
    ctx = torch.randint(3, 40, (context,), generator=g)  # small alphabet: matches are found
    d = NgramDrafter()
    d.prefill(ctx, None, None)
    sec = _median_seconds(lambda: d.propose(ctx, k), repeat)
    return sec / k


def measure(target, draft=None, k_max: int = 8, context: int = 128, threads: int | None = None, drafters=("none", "ngram", "draft")) -> CostModel:
    """Measure the cost model of `target` (and `draft`, a module) on this machine."""
    if threads is None:
        threads, thread_t1 = choose_threads(target, context)
    else:
        thread_t1 = {}
    torch.set_num_threads(threads)
    times = [time_forward(target, k, context) for k in range(1, k_max + 2)]
    t1 = times[0]
    cost = {"none": 0.0}
    if "ngram" in drafters:
        cost["ngram"] = _ngram_cost()
    if draft is not None and "draft" in drafters:
        cost["draft"] = time_forward(draft, 1, context)
    return CostModel(t1=t1, ratio=[t / t1 for t in times], draft_cost=cost, threads=threads, thread_t1=thread_t1, context=context)

"""What a drafter costs per step, measured in steady state by the engine's own step (engine.Session).

On a real prompt (tiled) held within a window around the requested context length, `Session.step(depth=d)` drafts,
verifies, rolls back and commits; its StepRecord gives the draft and the verify seconds. Past the window a fresh Session
is prefilled (untimed): its first step's catch-up on the prompt gives the prefill ratio. Plain steps are interleaved.
"""

from __future__ import annotations

from dataclasses import dataclass
from time import perf_counter
from typing import Callable

import torch

from ..engine import Session
from ..sampling import Sampler, SamplingParams
from .common import quantile, rounds


@dataclass(frozen=True)
class DrafterCost:
    """A drafter's measured cost on this machine."""

    steps: list[float]  # steps[d-1] = median seconds of propose(d) + commit in a step with d drafts
    verify: list[float]  # verify[d] = median seconds of the verify pass in a step with d drafts, d = 0..k_max
    prefill_ratio: float  # its catch-up on a fresh prompt / the Session's prefill of the same prompt
    samples: int  # timed steps per d (rounds run: fewer than asked once the medians are stable)


def _base_tokens(target, length: int, tokens: list[int] | None) -> list[int]:
    """A context of `length` tokens: the given ones (tiled, so text repeats as it does in real
    prompts), or random ids from a small alphabet (n-gram lookup then finds matches)."""
    if tokens:
        return (list(tokens) * -(-length // len(tokens)))[:length]
    g = torch.Generator().manual_seed(0)
    return torch.randint(3, min(40, target.vocab_size), (length,), generator=g).tolist()


@torch.inference_mode()
def time_drafter(target, make: Callable[[], object], k_max: int, context: int, tokens: list[int] | None = None,
                 repeat: int = 25, window: int = 96, min_repeat: int = 8, tol: float = 0.03, settle: int = 4,
                 budget_s: float = 3.0) -> DrafterCost:
    """Median seconds of a step with d = 1..k_max drafts (timed round-robin, up to `repeat` rounds, fewer once
    every step's median draft + verify time is stable to `tol` or `budget_s` is spent) for the drafter that
    `make()` builds, at a context of about `context` tokens."""
    hi = max(2, min(context + window // 2, target.max_seq_len - k_max - 2))  # longest context a step may start at
    lo = max(2, min(context - window // 2, hi - 2 * k_max))
    base = _base_tokens(target, lo, tokens)
    draft: dict[int, list[float]] = {d: [] for d in range(1, k_max + 1)}
    verify: dict[int, list[float]] = {d: [] for d in range(0, k_max + 1)}
    catch_up: list[tuple[float, float]] = []  # (first step's draft seconds, prefill seconds) after each fresh prefill
    med = lambda xs: quantile(xs, 0.5) or 0.0  # noqa: E731
    step_costs = lambda: [med(verify[0])] + [med(draft[d]) + med(verify[d]) for d in draft]  # noqa: E731
    session, done = None, 0
    for rep in rounds(step_costs, repeat + 1, min_repeat + 1, tol, budget_s):  # round 0 warms up
        for j, d in enumerate([0, *range(0, k_max + 1)]):  # the first plain step is untimed
            if session is None or session.context.shape[0] + 2 > hi:
                session = Session(target, base, make(), Sampler(SamplingParams(temperature=0.0), 0), k=k_max,
                                  max_new_tokens=hi - lo + 2 * k_max + 2)
                t0 = perf_counter()
                session.prefill()
                prefill = perf_counter() - t0
                catch_up.append((session.step(1).draft_seconds, prefill))
                for _ in range(settle):
                    session.step(1)
            rec = session.step(d)
            if rep > 0 and j > 0:
                verify[d].append(rec.verify_seconds)
                if d > 0:
                    draft[d].append(rec.draft_seconds)
        done = rep
    steps = [med(draft[d]) for d in draft]
    extra = [max(first - steps[0], 0.0) / pre for first, pre in catch_up[1:] if pre > 0]  # the first one is a warm-up
    return DrafterCost(steps=steps, verify=[med(verify[d]) for d in verify], prefill_ratio=med(extra), samples=done)

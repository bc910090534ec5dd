"""What a drafter costs per step, measured on the real drafter object in steady state.

Every drafter (n-gram, draft model, MTP, EAGLE, Medusa, ...) is timed the same way, by the engine's
own step (engine.Session): the target's prefill of a context feeds `drafter.prefill`, then each
`Session.step(depth=d)` drafts d tokens, verifies them for real, rolls back and commits. Its
StepRecord holds the two times used here: draft seconds (propose + commit, what the engine counts
as draft time) and verify seconds (the target forward over d + 1 tokens, the acceptance rule and
the rollback). The drafts kept are what verification really accepts on the given context (a real
prompt, tiled, as cli.py passes the median one; random ids otherwise), so a head that catches up on
every kept position (an MTP / EAGLE head runs over their target states at its next draft) is
charged for as many as it really keeps on text of that kind.

The context grows by the kept tokens, so it is held inside a window around the requested length:
when a step would leave it, a fresh Session is prefilled (untimed) and its first step, which also
catches the drafter up on the prompt (a draft model's lazy prefill, an MTP head's pass over the
prompt's hidden states), is timed apart: its excess over a steady step, relative to the Session's
prefill, is the drafter's prefill ratio. A few settling steps then run untimed before the
steady-state timing resumes.

The verify forward is timed in the drafter's loop: a target forward costs more inside a speculative
loop than back to back (the drafter's weights, caches and Python pass through the CPU caches between
two forwards), and that difference belongs to the drafter's configuration, not to the engine. Plain
steps (d = 0) are interleaved with the others, so the plain baseline is timed in the same minutes as
the drafted steps and the machine's drift cancels; the timed plain step follows an untimed one, as
in plain decoding (right after the round's deepest step the target's weights are out of the caches).
"""

from __future__ import annotations

from dataclasses import dataclass
from time import perf_counter
from typing import Callable

import torch

from ..engine import Session
from ..sampling import Sampler, SamplingParams
from .costmodel import stable


@dataclass(frozen=True)
class DrafterCost:
    """A drafter's measured cost on this machine."""

    steps: list[float]  # steps[d-1] = median seconds of propose(d) + commit in a step with d drafts
    verify: list[float]  # verify[d] = median seconds of the verify pass (target forward over d + 1 tokens, acceptance,
    # rollback) in a step with d drafts, d = 0..k_max (d = 0: a plain step of the same loop, as `--k auto` takes them)
    prefill_ratio: float  # its catch-up on a fresh prompt / the Session's prefill of the same prompt
    samples: int  # timed steps per d (rounds run: fewer than asked once the medians are stable)


def _median(xs: list[float]) -> float:
    xs = sorted(xs)
    return xs[len(xs) // 2] if xs else 0.0


def _base_tokens(target, length: int, tokens: list[int] | None) -> list[int]:
    """A context of `length` tokens: the given ones (tiled, so text repeats as it does in real
    prompts), or random ids from a small alphabet (n-gram lookup then finds matches)."""
    if tokens:
        return (list(tokens) * -(-length // len(tokens)))[:length]
    g = torch.Generator().manual_seed(0)
    return torch.randint(3, min(40, target.vocab_size), (length,), generator=g).tolist()


@torch.inference_mode()
def time_drafter(target, make: Callable[[], object], k_max: int, context: int, tokens: list[int] | None = None,
                 repeat: int = 25, window: int = 96, min_repeat: int = 11, tol: float = 0.03, settle: int = 4) -> DrafterCost:
    """Median seconds of a step with d = 1..k_max drafts (timed round-robin, up to `repeat` times
    each) for the drafter that `make()` builds, at a context of about `context` tokens.

    After `min_repeat` rounds it stops once two more rounds moved no median by more than `tol`.
    After each fresh prefill (and the timed catch-up step) `settle` steps run untimed: the first
    forwards after a prefill run slower (its large buffers have just passed through the CPU caches
    and the allocator), which a generation of 128 tokens pays only a few times out of its many steps."""
    hi = max(2, min(context + window // 2, target.max_seq_len - k_max - 2))  # longest context a step may start at
    lo = max(2, min(context - window // 2, hi - 2 * k_max))
    base = _base_tokens(target, lo, tokens)
    times: dict[int, list[float]] = {d: [] for d in range(1, k_max + 1)}  # drafted steps only: d = 0 drafts nothing
    verify: dict[int, list[float]] = {d: [] for d in range(0, k_max + 1)}
    catch_up: list[tuple[float, float]] = []  # (first step's draft seconds, prefill seconds) after each fresh prefill
    session, prev, done = None, None, 0
    for rep in range(repeat + 1):  # round 0 warms up
        for j, d in enumerate([0, *range(0, k_max + 1)]):  # the first plain step is untimed: see the module docstring
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
                    times[d].append(rec.draft_seconds)
        done = rep
        if done >= min_repeat and (done - min_repeat) % 2 == 0:
            cur = [_median(times[d]) for d in range(1, k_max + 1)]
            if stable(prev, cur, tol):
                break
            prev = cur
    steps = [_median(times[d]) for d in range(1, k_max + 1)]
    extra = [max(first - steps[0], 0.0) / pre for first, pre in catch_up[1:] if pre > 0]  # the first one is a warm-up
    return DrafterCost(steps=steps, verify=[_median(verify[d]) for d in range(0, k_max + 1)], prefill_ratio=_median(extra), samples=done)

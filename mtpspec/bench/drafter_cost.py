"""What a drafter costs per step, measured on the real drafter object in steady state.

Every drafter (n-gram, draft model, MTP, EAGLE, Medusa, ...) is timed the same way, on exactly what
the engine counts as draft time: `propose(context, d)` plus `commit(verdict, out)`. Around them the
loop is the engine's own: the target's prefill of the context feeds `drafter.prefill`, each step
runs the real verify pass over [last, d1..dD] (untimed), keeps half the drafts (rounded up: 1 of 1
or 2, 2 of 4, 4 of 8) plus the target's next token, as a typical step does, crops the target cache
to what was kept and commits. How many are kept matters for a head that catches up on every kept
position (an MTP / EAGLE head queues their target states and runs over them at its next draft);
keeping a single draft at every D made D = 4 on the demo model look cheaper than it was.

The context grows by the kept tokens, so it is held inside a window around the requested length:
when a step would leave it, the target and the drafter are prefilled again (untimed) and the first
step after that, which also catches the drafter up on the prompt (a draft model's lazy prefill, an
MTP head's pass over the prompt's hidden states), is timed apart: its excess over a steady step,
relative to the target's prefill of the same context, is the drafter's prefill ratio. A few
settling steps then run untimed before the steady-state timing resumes.

The verify forward of each step is timed too: a target forward costs more inside a speculative loop
than back to back (the drafter's weights, caches and Python pass through the CPU caches between two
forwards), and that difference belongs to the drafter's configuration, not to the engine. Plain
steps (d = 0: no propose, a one-token forward, commit) are interleaved with the others, so the plain
baseline is timed in the same minutes as the drafted steps and the machine's drift cancels. The
timed plain step follows an untimed one, as in plain decoding: right after the round's deepest step
(8 drafts through an MTP head) the target's weights are out of the caches, which put the demo
model's plain baseline 10% high and its V(1) / V(0) at 1.01 where a real run shows 1.12.
"""

from __future__ import annotations

from dataclasses import dataclass
from time import perf_counter
from typing import Callable

import torch
from torch import Tensor

from ..sampling import Sampler, SamplingParams
from ..types import Draft, Verdict


@dataclass(frozen=True)
class DrafterCost:
    """A drafter's measured cost on this machine."""

    steps: list[float]  # steps[d-1] = median seconds of propose(d) + commit in a step with d drafts
    verify: list[float]  # verify[d] = median seconds of the target forward over d + 1 tokens in a step with
    # d drafts, d = 0..k_max (d = 0: a plain step of the same loop, as `--k auto` takes them)
    prefill_ratio: float  # its catch-up on a fresh prompt / the target's prefill of the same prompt
    samples: int  # timed steps per d (rounds run: fewer than asked once the medians are stable)


def _median(xs: list[float]) -> float:
    xs = sorted(xs)
    return xs[len(xs) // 2] if xs else 0.0


def _base_tokens(target, length: int, tokens: list[int] | None) -> Tensor:
    """A context of `length` tokens: the given ones (tiled, so text repeats as it does in real
    prompts), or random ids from a small alphabet (n-gram lookup then finds matches)."""
    if tokens:
        reps = -(-length // len(tokens))
        return torch.tensor((list(tokens) * reps)[:length], dtype=torch.long)  # (length,)
    g = torch.Generator().manual_seed(0)
    return torch.randint(3, min(40, target.vocab_size), (length,), generator=g)  # (length,)


class _Session:
    """The target's cache, a drafter and the growing context, stepped as the engine steps them."""

    def __init__(self, target, make: Callable[[], object], base: Tensor) -> None:
        self.target, self.cache = target, target.new_cache()
        self.context = base  # (L,)
        t0 = perf_counter()
        out = target.forward_tokens(base[:-1], self.cache)  # prefill, all but the last token
        self.prefill_seconds = perf_counter() - t0
        self.drafter = make()
        self.drafter.prefill(base, out, Sampler(SamplingParams(temperature=0.0), 0))

    def step(self, d: int) -> tuple[float, float]:
        """One draft -> verify -> commit step; returns the drafter's seconds (propose + commit) and the verify forward's."""
        t0 = perf_counter()
        draft = self.drafter.propose(self.context, d) if d > 0 else Draft.empty()  # as the engine does
        t1 = perf_counter()
        start = self.cache.length
        tokens = torch.cat([self.context[-1:], draft.tokens])  # (D+1,)
        tv = perf_counter()
        out = self.target.forward_tokens(tokens, self.cache)  # the verify pass
        verify_seconds = perf_counter() - tv
        n = (draft.size + 1) // 2  # keep half the drafts (rounded up), then the target's own next token
        kept = torch.cat([draft.tokens[:n], out.logits[n].argmax(-1).reshape(1)])  # (n+1,)
        verdict = Verdict(num_accepted=n, tokens=kept, num_drafted=draft.size)
        self.cache.crop(start + n + 1)
        t2 = perf_counter()
        self.drafter.commit(verdict, out)
        t3 = perf_counter()
        self.context = torch.cat([self.context, kept])
        return (t1 - t0) + (t3 - t2), verify_seconds


@torch.inference_mode()
def time_drafter(target, make: Callable[[], object], k_max: int, context: int, tokens: list[int] | None = None,
                 repeat: int = 25, window: int = 96, min_repeat: int = 11, tol: float = 0.03, settle: int = 4) -> DrafterCost:
    """Median seconds of a step with d = 1..k_max drafts (timed round-robin, up to `repeat` times
    each) for the drafter that `make()` builds, at a context of about `context` tokens.

    After `min_repeat` rounds it stops once two more rounds moved no median by more than `tol`.
    After each fresh prefill (and the timed catch-up step) `settle` steps run untimed: the first
    forwards after a prefill run slower (its large buffers have just passed through the CPU caches
    and the allocator), which a generation of 128 tokens pays only a few times out of its many steps."""
    from .costmodel import stable

    hi = max(2, min(context + window // 2, target.max_seq_len - k_max - 2))  # longest context a step may start at
    lo = max(2, min(context - window // 2, hi - 2 * k_max))
    base = _base_tokens(target, lo, tokens)
    times: dict[int, list[float]] = {d: [] for d in range(1, k_max + 1)}  # drafted steps only: d = 0 drafts nothing
    verify: dict[int, list[float]] = {d: [] for d in range(0, k_max + 1)}
    catch_up: list[float] = []  # (first step's seconds, prefill seconds) after each fresh prefill
    session, prev, done = None, None, 0
    for rep in range(repeat + 1):  # round 0 warms up
        for j, d in enumerate([0, *range(0, k_max + 1)]):  # the first plain step is untimed: see below
            if session is None or session.context.shape[0] + 2 > hi:
                session = _Session(target, make, base)
                catch_up.append((session.step(1)[0], session.prefill_seconds))
                for _ in range(settle):
                    session.step(1)
            dt, dv = session.step(d)
            if rep > 0 and j > 0:
                verify[d].append(dv)
                if d > 0:
                    times[d].append(dt)
        done = rep
        if done >= min_repeat and (done - min_repeat) % 2 == 0:
            cur = [_median(times[d]) for d in range(1, k_max + 1)]
            if stable(prev, cur, tol):
                break
            prev = cur
    steps = [_median(times[d]) for d in range(1, k_max + 1)]
    extra = [max(first - steps[0], 0.0) / pre for first, pre in catch_up[1:] if pre > 0]  # the first one is a warm-up
    return DrafterCost(steps=steps, verify=[_median(verify[d]) for d in range(0, k_max + 1)], prefill_ratio=_median(extra), samples=done)

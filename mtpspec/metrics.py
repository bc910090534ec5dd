"""What a generation measured: the acceptance counters (one definition, used everywhere) and the time split.

Definitions (as vLLM's spec-decode metrics; every other module reports these, none recounts them):

- a step = one target forward over [last, d1..dD] (D = drafted, 0..k), of which n = accepted drafts
  survive, plus one recovered or bonus token.
- mean accepted length = tokens per target forward = 1 + accepted / forwards (1.0 for plain decoding, 0.0 when no
  step ran): what verification kept, not what was emitted, so a drafter is not charged where a stop token cut
  the last step.
- acceptance by position i (1-based) = P(draft i accepted | drafts 1..i-1 accepted): among the steps that checked
  draft i, the share that accepted it. A step checks positions 1..min(n + 1, D): the accepted ones and the first miss.
- time: prefill, drafting (propose + commit), verifying (target forward + acceptance rule + rollback),
  and overhead = wall - the three (the engine's own bookkeeping).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from itertools import zip_longest
from time import perf_counter
from typing import Iterable

from .types import GenerationStats, StepRecord


def mean_accepted_length(accepted: int, forwards: int) -> float:
    """Tokens per target forward: 1 + accepted / forwards (0.0 when no forward ran)."""
    return 1.0 + accepted / forwards if forwards else 0.0


@dataclass
class Acceptance:
    """Acceptance counters over steps: add steps with observe(), sum counters with +."""

    forwards: int = 0  # steps (target forwards)
    drafted: int = 0  # draft tokens proposed
    accepted: int = 0  # draft tokens accepted
    reached: list[int] = field(default_factory=list)  # [i]: steps that checked draft position i+1
    passed: list[int] = field(default_factory=list)  # [i]: ... and accepted it

    def observe(self, drafted: int, accepted: int) -> None:
        """One step: `drafted` tokens proposed (0 = a plain step), the first `accepted` of them kept."""
        if not 0 <= accepted <= drafted:
            raise ValueError(f"accepted must be in 0..drafted, got {accepted} of {drafted}")
        self.forwards += 1
        self.drafted += drafted
        self.accepted += accepted
        if drafted > len(self.reached):
            grow = drafted - len(self.reached)
            self.reached += [0] * grow
            self.passed += [0] * grow
        for i in range(min(accepted + 1, drafted)):  # the accepted positions and the first miss
            self.reached[i] += 1
        for i in range(accepted):
            self.passed[i] += 1

    @classmethod
    def from_steps(cls, steps: Iterable[StepRecord]) -> Acceptance:
        """The counters of a generation's steps (GenerationResult.steps)."""
        acc = cls()
        for s in steps:
            acc.observe(len(s.draft), s.num_accepted)
        return acc

    def __add__(self, other: Acceptance) -> Acceptance:
        def add(xs: list[int], ys: list[int]) -> list[int]:  # position-wise, the shorter padded with 0
            return [a + b for a, b in zip_longest(xs, ys, fillvalue=0)]

        return Acceptance(
            forwards=self.forwards + other.forwards, drafted=self.drafted + other.drafted,
            accepted=self.accepted + other.accepted,
            reached=add(self.reached, other.reached), passed=add(self.passed, other.passed),
        )

    @property
    def mean_accepted_length(self) -> float:
        return mean_accepted_length(self.accepted, self.forwards)

    @property
    def draft_acceptance(self) -> float | None:
        """accepted / drafted over all positions (None when nothing was drafted)."""
        return self.accepted / self.drafted if self.drafted else None

    def by_position(self, size: int | None = None) -> list[float | None]:
        """Acceptance at draft positions 1..size (default: the longest draft seen); None where no step reached it."""
        n = len(self.reached) if size is None else size
        return [self.passed[i] / self.reached[i] if i < len(self.reached) and self.reached[i] else None for i in range(n)]


class Metrics:
    """One generation's counters: the engine calls prefill_done, observe per step, then finish."""

    def __init__(self, k: int) -> None:
        self.start = perf_counter()
        self.k = k  # acceptance_by_position reports positions 1..k
        self.acceptance = Acceptance()
        self.prefill_seconds = 0.0
        self.draft_seconds = 0.0
        self.verify_seconds = 0.0
        self.cached_tokens = 0  # prompt positions copied from a kept prefix instead of prefilled (prefix.py)

    def prefill_done(self) -> None:
        self.prefill_seconds = perf_counter() - self.start

    def observe(self, drafted: int, accepted: int, draft_s: float, verify_s: float) -> None:
        self.acceptance.observe(drafted, accepted)
        self.draft_seconds += draft_s
        self.verify_seconds += verify_s

    def finish(self, new_tokens: int) -> GenerationStats:
        wall = perf_counter() - self.start
        a = self.acceptance
        return GenerationStats(
            target_forwards=a.forwards,
            draft_tokens=a.drafted,
            accepted_tokens=a.accepted,
            mean_accepted_length=a.mean_accepted_length,
            # GenerationStats keeps a list of floats: a position no step reached reads 0.0
            acceptance_by_position=[0.0 if x is None else x for x in a.by_position(self.k)],
            wall_seconds=wall,
            tokens_per_second=new_tokens / wall if wall > 0 else 0.0,
            prefill_seconds=self.prefill_seconds,
            draft_seconds=self.draft_seconds,
            verify_seconds=self.verify_seconds,
            overhead_seconds=max(wall - self.prefill_seconds - self.draft_seconds - self.verify_seconds, 0.0),
            cached_tokens=self.cached_tokens,
        )

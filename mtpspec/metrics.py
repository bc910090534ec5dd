"""Per-generation counters: forwards, drafted and accepted tokens, acceptance by position, time split.

- mean accepted length = tokens emitted per target forward = 1 + accepted / forwards (as vLLM).
- acceptance by position i = P(draft i accepted | drafts 1..i-1 accepted), over steps that drafted i.
- time: prefill, drafting (propose + commit), verifying (target forward + acceptance rule + rollback),
  and overhead = wall - the three (the engine's own bookkeeping).
"""

from __future__ import annotations

from time import perf_counter

from .types import GenerationStats


class Metrics:
    def __init__(self, k: int) -> None:
        self.start = perf_counter()
        self.prefill_seconds = 0.0
        self.forwards = 0
        self.drafted = 0
        self.accepted = 0
        self.reached = [0] * k  # steps in which draft position i was checked (all earlier accepted)
        self.passed = [0] * k  # ... and accepted
        self.draft_seconds = 0.0
        self.verify_seconds = 0.0

    def prefill_done(self) -> None:
        self.prefill_seconds = perf_counter() - self.start

    def observe(self, drafted: int, accepted: int, draft_s: float, verify_s: float) -> None:
        self.forwards += 1
        self.drafted += drafted
        self.accepted += accepted
        for i in range(min(accepted + 1, drafted)):
            self.reached[i] += 1
        for i in range(accepted):
            self.passed[i] += 1
        self.draft_seconds += draft_s
        self.verify_seconds += verify_s

    def finish(self, new_tokens: int) -> GenerationStats:
        wall = perf_counter() - self.start
        f = max(self.forwards, 1)
        return GenerationStats(
            target_forwards=self.forwards,
            draft_tokens=self.drafted,
            accepted_tokens=self.accepted,
            mean_accepted_length=1.0 + self.accepted / f if self.forwards else 0.0,
            acceptance_by_position=[p / r if r else 0.0 for p, r in zip(self.passed, self.reached)],
            wall_seconds=wall,
            tokens_per_second=new_tokens / wall if wall > 0 else 0.0,
            prefill_seconds=self.prefill_seconds,
            draft_seconds=self.draft_seconds,
            verify_seconds=self.verify_seconds,
            overhead_seconds=max(wall - self.prefill_seconds - self.draft_seconds - self.verify_seconds, 0.0),
        )

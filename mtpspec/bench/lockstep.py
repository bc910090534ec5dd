"""Several generations in turn, a few milliseconds of each at a time, so the machine's drift cancels.

Each job is a greenlet in the caller's thread (not an OS thread: those migrate between cores and malloc
arenas, and measured slower). After every engine step it calls `Turn.step_done`, which, once its 5 ms
slice is used up, switches to the next job; each pass over the jobs runs them in a fresh seeded order,
so no job always follows the same other one. The time a job spends away is recorded (`Turn.waited`)
and subtracted from its time. Run the rotation inside torch.inference_mode(): a job leaving the mode
would switch it off for the others. Measurements: docs/benchmarks.md ("Alternation").
"""

from __future__ import annotations

import random
from time import perf_counter, process_time
from typing import Callable, Generic, TypeVar

from greenlet import getcurrent, greenlet

R = TypeVar("R")

SLICE_SECONDS = 0.005


class Turn:
    """A job's view of the rotation: call `step_done` after every step; `waited` = seconds away."""

    def __init__(self, rotation: "Lockstep") -> None:
        self._rotation = rotation
        self.waited = 0.0
        self.waited_cpu = 0.0  # process CPU time spent by the other jobs meanwhile
        self._since = perf_counter()  # start of the current slice (the job starts when created)

    def step_done(self, _tokens: object = None) -> None:
        """Hand the turn on if this job's slice is used up; return when the turn comes back."""
        now = perf_counter()
        if now - self._since < self._rotation.slice_seconds:
            return
        cpu = process_time()
        self._rotation._hub.switch()  # back to the scheduler, which resumes the next job
        self._since = perf_counter()
        self.waited_cpu += process_time() - cpu
        self.waited += self._since - now


class Lockstep(Generic[R]):
    """Run jobs (each `job(turn) -> result`) in turn, one slice at a time; results in job order."""

    def __init__(self, slice_seconds: float = SLICE_SECONDS, seed: int | str = 0) -> None:
        self.slice_seconds = slice_seconds
        self.rng = random.Random(seed)

    def run(self, jobs: list[Callable[[Turn], R]]) -> list[R]:
        self._hub = getcurrent()
        results: list[R | None] = [None] * len(jobs)
        live = [greenlet(lambda i=i: results.__setitem__(i, jobs[i](Turn(self)))) for i in range(len(jobs))]
        order = list(live)  # the first pass in job order, each later one shuffled
        while live:  # an exception in a job propagates here, the others are dropped
            for g in order:
                g.switch()
            live = [g for g in live if not g.dead]
            order = self.rng.sample(live, len(live))
        return results  # type: ignore[return-value]

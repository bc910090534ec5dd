"""Several generations in turn, a few milliseconds of each at a time, so machine drift cancels.

On a shared VM the speed of one core drifts by up to 2x within seconds (other tenants on the same
physical core and caches). Timing whole generations one after another leaves each method at the
mercy of the stretch it happened to land in: methods doing identical work measured 5-8% apart
over 20 prompts x best of 3. Interleaving them at step granularity puts every method through the
same stretches.

Each job is a greenlet in the caller's thread: after every engine step it calls `Turn.step_done`,
which, once the job's slice (5 ms) is used up, switches to the next job, and the job resumes where
it stopped when its turn comes back. Every pass over the jobs runs them in a fresh (seeded) order,
so no job always runs right after the same other one (which leaves its data in the CPU caches).
The time away is recorded per job (`Turn.waited`) and subtracted from its wall time, so a job's
time is its own work only. Greenlets, not threads: OS threads would migrate between cores at every
switch (cold L1/L2) and allocate from their own malloc arenas, which cost 5-25% here; a greenlet
switch is a stack swap on the same core. Every
job still has its own cache, drafter and buffers; what the jobs share is the CPU caches, as a
real server shares them with other work. Measured on stories260K: one job in a rotation runs at
0.99x its time alone, nine jobs sharing the caches at 1.02x.

The engine enters torch.inference_mode per step (engine.step); run the rotation inside it
(`with torch.inference_mode(): ...`), or a job leaving the mode would switch it off for the others.
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
        self._hub = getcurrent()

    def run(self, jobs: list[Callable[[Turn], R]]) -> list[R]:
        self._hub = getcurrent()
        results: list[R | None] = [None] * len(jobs)

        def body(i: int) -> None:
            results[i] = jobs[i](Turn(self))

        live = [greenlet(lambda i=i: body(i)) for i in range(len(jobs))]
        first = True
        while live:  # round robin; an exception in a job propagates here, the others are dropped
            order = list(live)
            if not first:  # each pass in a fresh order: whose leftovers sit in the caches varies
                self.rng.shuffle(order)
            first = False
            for g in order:
                g.switch()
            live = [g for g in live if not g.dead]
        return results  # type: ignore[return-value]

"""Run configurations alternately over prompts and compare: the one loop the demo, the model-card
table (train/evaluate.py), the trace and the bench use.

Round after round, every prompt is run by every configuration before the next prompt starts, in an
order shuffled afresh for every (round, prompt) (seeded, so a run reproduces). Slow drift of the
machine (other jobs, thermal state) then falls on all configurations alike, and no configuration
always runs right after the same other one (whatever a run leaves behind, in the CPU caches or the
allocator, does not fall on one configuration only). What to keep of the rounds (the fastest, the
median, the mean) is the caller's choice: every result comes back.
"""

from __future__ import annotations

import random
from typing import Callable, Sequence, TypeVar

C = TypeVar("C")  # a configuration
P = TypeVar("P")  # a prompt
R = TypeVar("R")  # a result

Results = list[list[list[R]]]  # [config][prompt][round]


def alternate(configs: Sequence[C], prompts: Sequence[P], run: Callable[[C, P], R], rounds: int = 1, seed: int | str = 0,
              together: Callable[[list[C], P], list[R]] | None = None) -> Results:
    """results[c][p][r] = run(configs[c], prompts[p]) in round r.

    together(configs, prompt), when given, runs one prompt's configurations (in the shuffled order)
    and returns their results in that order, in place of `run` on each in turn (the bench runs them
    interleaved step by step)."""
    out: Results = [[[] for _ in prompts] for _ in configs]
    for r in range(rounds):
        for p, prompt in enumerate(prompts):
            order = random.Random(f"{seed}/{r}/{p}").sample(range(len(configs)), len(configs))
            cs = [configs[c] for c in order]
            got = together(cs, prompt) if together is not None else [run(c, prompt) for c in cs]
            for c, res in zip(order, got):
                out[c][p].append(res)
    return out

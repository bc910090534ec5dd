"""Run configurations alternately over prompts (the demo, train/evaluate.py, the trace and the bench): each prompt
by every configuration before the next, in an order shuffled (seeded) per (round, prompt), so a machine's drift
falls on all alike. Every round's result comes back; what to keep is the caller's choice.
"""

from __future__ import annotations

import random
from typing import Callable, Sequence, TypeVar

C = TypeVar("C")  # a configuration
P = TypeVar("P")  # a prompt
R = TypeVar("R")  # a result


def alternate(configs: Sequence[C], prompts: Sequence[P], run: Callable[[C, P], R], rounds: int = 1, seed: int | str = 0,
              together: Callable[[list[C], P], list[R]] | None = None) -> list[list[list[R]]]:
    """results[c][p][r] = run(configs[c], prompts[p]) in round r.

    together(configs, prompt), when given, runs one prompt's configurations (in the shuffled order) and
    returns their results in that order, in place of `run` on each (the bench interleaves them step by step)."""
    out: list[list[list[R]]] = [[[] for _ in prompts] for _ in configs]
    for r in range(rounds):
        for p, prompt in enumerate(prompts):
            order = random.Random(f"{seed}/{r}/{p}").sample(range(len(configs)), len(configs))
            cs = [configs[c] for c in order]
            got = together(cs, prompt) if together is not None else [run(c, prompt) for c in cs]
            for c, res in zip(order, got):
                out[c][p].append(res)
    return out

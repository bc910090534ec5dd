"""Gemma 3 270M plain greedy, eager against --compile, in one process: methods interleaved, medians of the rounds.

    python scripts/compiled_vs_eager.py [THREADS=2] [ROUNDS=3]
"""

from __future__ import annotations

import statistics
import sys
import time

import mtpspec
from mtpspec.prompts import load_prompts


def run(model, prompts: list[list[int]]) -> tuple[float, list[list[int]]]:
    """(tokens/s over the prompts, each prompt's greedy continuation)."""
    outs, t0 = [], time.perf_counter()
    for ids in prompts:
        outs.append(model.generate(ids, drafter="none", max_new_tokens=128).tokens)
    return sum(map(len, outs)) / (time.perf_counter() - t0), outs


def main() -> None:
    threads = int(sys.argv[1]) if len(sys.argv) > 1 else 2
    rounds = int(sys.argv[2]) if len(sys.argv) > 2 else 3
    models = {"eager": mtpspec.load("gemma3-270m", threads=threads),
              "compiled": mtpspec.load("gemma3-270m", threads=threads, compile=True)}
    prompts = [models["eager"].tokenizer.encode(p.text)[-160:] for p in load_prompts("humaneval", limit=3)]
    for m in models.values():  # every graph the runs use is built (or read from the disk cache) before timing
        run(m, prompts)
    speed, texts = {name: [] for name in models}, {}
    for r in range(rounds):
        for name in (("eager", "compiled") if r % 2 == 0 else ("compiled", "eager")):
            s, texts[name] = run(models[name], prompts)
            speed[name].append(s)
    for name, v in speed.items():
        print(f"{name}: {statistics.median(v):.1f} tok/s median, rounds {[round(x, 1) for x in v]}")
    ratio = statistics.median(speed["compiled"]) / statistics.median(speed["eager"])
    print(f"compiled / eager {ratio:.3f}; the same greedy text: {texts['eager'] == texts['compiled']}")


if __name__ == "__main__":
    main()

"""What `mtpspec bench --interleave step` costs our methods: the same generations in the bench's 5 ms rotation of
seven methods (mtpspec/bench/lockstep.py) and each alone, in one process, alternating per prompt.

A peer (llama.cpp, transformers) runs whole requests alone, so a comparison with one is fair only if our methods
run the same way: this script measures what the rotation costs them (docs/benchmarks.md, "Alternation").

    python scripts/rotation_cost.py [--compile] [--rounds 2]      # demo model, 8 held-out Python prompts
"""

from __future__ import annotations

import argparse
import gc

import torch

import mtpspec
from mtpspec.bench.harness import Method, OursRunner
from mtpspec.bench.lockstep import Lockstep
from mtpspec.models.compiled import prepare
from mtpspec.prompts import Prompt
from mtpspec.train.data import code_prompts, stdlib_files


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--compile", action="store_true")
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--tokens", type=int, default=128)
    args = ap.parse_args()
    torch.set_num_threads(1)
    model = mtpspec.load("demo", threads=1, compile=args.compile)
    prompts = [Prompt(str(i), "python", t) for i, t in enumerate(code_prompts(stdlib_files()[1], 8))]
    ids = [model.encode(p.text)[-(model.max_seq_len - args.tokens):] for p in prompts]
    prepare(model.module, range(1, 7), min(map(len, ids)), max(map(len, ids)) + args.tokens + 5, chains=range(1, 6))
    runner = OursRunner(model)
    methods = [Method("mtpspec", "none", None)] + [Method("mtpspec", d, k) for d in ("mtp", "ngram") for k in (1, 3, 5)]
    watched = [methods[0], methods[3]]  # plain, mtp@5
    for i in range(2):  # warm-up, untimed
        for m in methods:
            runner.run(m, prompts[i], ids[i], 16, 0.0, 0)
    gc.collect()
    gc.freeze()
    decode = {(m.label, mode): [] for m in watched for mode in ("rotation", "alone")}

    def keep(m: Method, mode: str, run) -> None:
        decode[m.label, mode].append(run.wall_seconds - run.prefill_seconds)

    for r in range(args.rounds):
        for i, (p, x) in enumerate(zip(prompts, ids)):
            def rotation() -> None:
                with torch.inference_mode():
                    got = Lockstep(seed=f"{r}/{i}").run([lambda turn, m=m: runner.run(m, p, x, args.tokens, 0.0, 0, turn)
                                                         for m in methods])
                for m, run in zip(methods, got):
                    if m in watched:
                        keep(m, "rotation", run)

            def alone() -> None:
                for m in watched:
                    keep(m, "alone", runner.run(m, p, x, args.tokens, 0.0, 0))

            for f in (rotation, alone) if (r + i) % 2 == 0 else (alone, rotation):
                f()
    for m in watched:
        rot, solo = decode[m.label, "rotation"], decode[m.label, "alone"]
        n = args.tokens * len(rot)
        print(f"{m.label}: in the rotation {n / sum(rot):.0f} tok/s, alone {n / sum(solo):.0f} tok/s, "
              f"alone / rotation {sum(rot) / sum(solo):.3f}")


if __name__ == "__main__":
    main()

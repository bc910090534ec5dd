"""A verify pass's cost over a plain step on a model: T(k)/T(1), all k rows' logits, split into the layers and the LM head.

At each context, forwards of 1, 5 and 9 tokens with and without logits, round-robin (median of --reps rounds,
bench.costmodel.time_forwards), the cache cropped back after each; the LM head's share is the difference.

    python scripts/verify_cost.py --model gemma3-270m --threads 1 --contexts 160,752
"""

from __future__ import annotations

import argparse

import torch

import mtpspec
from mtpspec.bench.costmodel import time_forwards


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", default="gemma3-270m")
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--contexts", default="160,752")
    ap.add_argument("--reps", type=int, default=30)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    m = mtpspec.load(args.model, threads=args.threads).module
    keys = [(k, logits) for k in (1, 5, 9) for logits in (True, False)]
    for ctx in map(int, args.contexts.split(",")):
        with torch.inference_mode():
            t = time_forwards(m, keys, ctx, repeat=args.reps, q=0.5, min_repeat=args.reps)
        ms = {key: 1e3 * x for key, x in zip(keys, t)}
        t1 = ms[(1, True)]
        layers = [ms[(k, False)] for k in (1, 5, 9)]
        head = [ms[(k, True)] - ms[(k, False)] for k in (1, 5, 9)]
        print(f"context {ctx}, {args.threads} thread(s): T(1) {t1:.2f} ms, T(5)/T(1) {ms[(5, True)] / t1:.3f}, "
              f"T(9)/T(1) {ms[(9, True)] / t1:.3f}; layers {' / '.join(f'{x:.2f}' for x in layers)} ms, "
              f"LM head {' / '.join(f'{x:.2f}' for x in head)} ms at 1 / 5 / 9 rows", flush=True)


if __name__ == "__main__":
    main()

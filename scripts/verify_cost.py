"""A verify pass's cost over a plain step on a model: T(k)/T(1), all k rows' logits, split into the layers and the LM head.

At each context, forwards of 1, 5 and 9 tokens with and without logits, round-robin (median of --reps rounds), the
cache cropped back after each; the LM head's share is the difference.

    python scripts/verify_cost.py --model gemma3-270m --threads 1 --contexts 160,752
"""

from __future__ import annotations

import argparse
import statistics
from time import perf_counter

import torch

import mtpspec


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", default="gemma3-270m")
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--contexts", default="160,752")
    ap.add_argument("--reps", type=int, default=30)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    m = mtpspec.load(args.model, threads=args.threads).module
    g = torch.Generator().manual_seed(0)
    ks = (1, 5, 9)
    for ctx in map(int, args.contexts.split(",")):
        cache = m.new_cache()
        m.forward_tokens(torch.randint(3, m.vocab_size, (ctx,), generator=g), cache)
        toks = {k: torch.randint(3, m.vocab_size, (k,), generator=g) for k in ks}
        times = {(k, lg): [] for k in ks for lg in (True, False)}
        with torch.inference_mode():
            for rep in range(args.reps + 2):
                for k, lg in times:
                    t0 = perf_counter()
                    m.forward_tokens(toks[k], cache, logits=lg)
                    dt = perf_counter() - t0
                    cache.crop(ctx)
                    if rep >= 2:
                        times[(k, lg)].append(dt)
        ms = {key: 1e3 * statistics.median(v) for key, v in times.items()}
        t1 = ms[(1, True)]
        layers = [ms[(k, False)] for k in ks]
        head = [ms[(k, True)] - ms[(k, False)] for k in ks]
        print(f"context {ctx}, {args.threads} thread(s): T(1) {t1:.2f} ms, T(5)/T(1) {ms[(5, True)] / t1:.3f}, "
              f"T(9)/T(1) {ms[(9, True)] / t1:.3f}; layers {' / '.join(f'{x:.2f}' for x in layers)} ms, "
              f"LM head {' / '.join(f'{x:.2f}' for x in head)} ms at 1 / 5 / 9 rows", flush=True)


if __name__ == "__main__":
    main()

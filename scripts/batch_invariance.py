"""How often a request's greedy tokens depend on its batch, default mode against exact mode, and what exact costs.

Each prompt is generated alone (plain decoding, batch 1) and then inside a batch of `--batch` requests whose
drafters and depths differ (plain, MTP at k = 1..3, prompt lookup); the count of requests whose tokens are
identical is printed per dtype and mode, with the throughput of each run.

    python scripts/batch_invariance.py --model demo --prompts humaneval --limit 16 --batch 8
"""

from __future__ import annotations

import argparse
from time import perf_counter

import mtpspec
from mtpspec.drafters import make_drafter
from mtpspec.engine import Engine
from mtpspec.prompts import load_prompts
from mtpspec.sampling import Sampler, SamplingParams

MIX = [("none", 1), ("mtp", 1), ("mtp", 2), ("mtp", 3), ("ngram", 3)]


def run(model, prompts, batch: int, exact: bool, mix: bool, n: int) -> tuple[list[list[int]], float]:
    """Tokens per prompt and tokens/s, `batch` sequences at a time; mix: each sequence its own drafter and k."""
    m, out, tokens, seconds = model.module, [None] * len(prompts), 0, 0.0
    for lo in range(0, len(prompts), batch):
        eng = Engine(m, max_batch=batch, exact=exact)
        ids = {}
        for i in range(lo, min(lo + batch, len(prompts))):
            d, k = MIX[i % len(MIX)] if mix else ("none", 1)
            ids[i] = eng.add(prompts[i], make_drafter(d, m), Sampler(SamplingParams()), k, n)
        t0 = perf_counter()
        res = eng.run()
        seconds += perf_counter() - t0
        for i, sid in ids.items():
            out[i] = res[sid].tokens
            tokens += len(out[i])
    return out, tokens / seconds


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="demo")
    ap.add_argument("--prompts", default="humaneval")
    ap.add_argument("--limit", type=int, default=16)
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--max-new-tokens", type=int, default=64)
    args = ap.parse_args()
    for dtype in ("fp32", "bf16"):
        model = mtpspec.load(args.model, dtype=dtype, threads=1)
        prompts = [model.encode(p.text) for p in load_prompts(args.prompts, limit=args.limit)]
        for exact in (False, True):
            alone, tps_alone = run(model, prompts, 1, exact, False, args.max_new_tokens)
            batched, tps_batch = run(model, prompts, args.batch, exact, True, args.max_new_tokens)
            same = sum(a == b for a, b in zip(alone, batched))
            mode = "exact" if exact else "default"
            print(f"{dtype} {mode:7s}: {same}/{len(prompts)} requests identical alone and in a mixed batch of {args.batch}; "
                  f"plain alone {tps_alone:.0f} tok/s, mixed batch {tps_batch:.0f} tok/s")


if __name__ == "__main__":
    main()

"""Token trees against chains, one sequence at a time, every method stepped in turn (bench/batch.run_round).

    python scripts/tree_bench.py --model demo --prompts humaneval --limit 8 --drafter mtp --ks 3,5 --trees 6,10,16 --beams 1,4
    python scripts/tree_bench.py --model $A/stories260K.bin --tokenizer $A/tok512.bin --prompts tinystories \\
        --drafter eagle --draft-model models/heads/stories260K-eagle --ks 4,6 --trees 8,16

For each prompt, plain decoding, each chain depth and each tree (node budget x depth) decode it together,
one engine step each in turn, each timed by its own steps; tokens and seconds are summed over the prompts.
Prints a markdown table: tokens per target forward, tokens/s, speedup over plain, greedy identity.
"""

from __future__ import annotations

import argparse
import time

import torch

import mtpspec
from mtpspec.bench.batch import BatchMethod, run_round
from mtpspec.bench.harness import prepare_ids
from mtpspec.prompts import load_prompts


def model_args(p: argparse.ArgumentParser) -> argparse.ArgumentParser:
    """The model, its prompts and the drafter (shared with tree_leaf_value.py)."""
    p.add_argument("--model", required=True)
    p.add_argument("--tokenizer")
    p.add_argument("--prompts", default="humaneval")
    p.add_argument("--limit", type=int, default=8)
    p.add_argument("--drafter", required=True)
    p.add_argument("--draft-model")
    return p


def main() -> None:
    p = model_args(argparse.ArgumentParser())
    p.add_argument("--ks", default="3,5")
    p.add_argument("--trees", default="8,16")
    p.add_argument("--beams", default="", help="trees also with these tree_beam values (e.g. 1,4); default: the drafter's")
    p.add_argument("--max-new-tokens", type=int, default=96)
    a = p.parse_args()
    torch.set_num_threads(1)
    model = mtpspec.load(a.model, a.tokenizer)
    ids = prepare_ids(model, load_prompts(a.prompts, a.limit), a.max_new_tokens)
    ks, trees = [int(x) for x in a.ks.split(",")], [x if x == "auto" else int(x) for x in a.trees.split(",")]
    methods = [BatchMethod("none", 1)] + [BatchMethod(a.drafter, k) for k in ks]
    beams = [int(x) for x in a.beams.split(",")] if a.beams else [None]
    methods += [BatchMethod(a.drafter, k, n, b) for b in beams for n in trees for k in ks]
    dm = {a.drafter: a.draft_model} if a.draft_model else {}
    run_round(model, methods, ids[:1], 8, dm)  # warm-up
    t0 = time.time()
    tot = {m.label: [0, 0.0, 0.0, 0] for m in methods}  # tokens, seconds, forwards, identical
    for i, x in enumerate(ids):
        runs = run_round(model, methods, [x], a.max_new_tokens, dm, round_=i)
        plain = runs[0].tokens
        for r in runs:
            t = tot[r.method]
            t[0] += r.decode_tokens
            t[1] += r.decode_seconds
            t[2] += r.decode_tokens / r.tokens_per_forward if r.tokens_per_forward else 0
            t[3] += r.tokens == plain
    base = tot["plain"][0] / tot["plain"][1]
    print(f"{len(ids)} prompts x {a.max_new_tokens} tokens, {time.time() - t0:.0f} s\n")
    print("| method | tokens / target forward | tok/s | vs plain | identical |\n|---|---:|---:|---:|---:|")
    for lab, (n, s, f, same) in tot.items():
        print(f"| {lab} | {n / f if f else 1.0:.2f} | {n / s:.1f} | {n / s / base:.2f} | {same}/{len(ids)} |")


if __name__ == "__main__":
    main()

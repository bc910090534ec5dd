"""What a beam-1 tree's extra leaves are worth against what their rows cost: the ceiling on a tree's tok/s over its chain.

    python scripts/tree_leaf_value.py --model demo --prompts humaneval --drafter mtp --k 5
    python scripts/tree_leaf_value.py --model $A/stories260K.bin --tokenizer $A/tok512.bin --prompts tinystories \\
        --drafter eagle --draft-model models/heads/stories260K-eagle --k 4

A beam-1 tree of depth D is the chain's D drafts plus, at each level, the drafter's runner-up as a leaf (tree.py).
Greedy verification accepts along the best path exactly as the chain does, and a runner-up leaf adds one token when
it is reached (its parent accepted) and taken. Each prompt is decoded by the chain and by the whole tree (every grown
node kept), in turns prompt by prompt, with the step API; every step's seconds (propose + verify + commit) are summed.
Printed: how often a reached leaf is taken, by the drafter's q of it; each step's cost; and for the policy "keep a leaf
only when its q >= t" (an oracle's choice of t, its rows priced at the measured cost per extra row) the tok/s it
would reach against the chain's. When even the best t stays near 1.0x, no choice of leaves beats the chain on this
machine: a tree needs cheaper rows or a drafter whose runner-up is taken more often.
"""

from __future__ import annotations

import argparse
import math

import torch

import mtpspec
from mtpspec.bench.harness import prepare_ids
from mtpspec.drafters import make_drafter
from mtpspec.engine import Session
from mtpspec.prompts import load_prompts
from mtpspec.sampling import Sampler, SamplingParams
from tree_bench import model_args  # scripts/ is on the path when a script runs

BUCKETS = (0.0, 0.05, 0.1, 0.2, 0.3, 0.5, 1.01)  # q edges
NEW_TOKENS = 96  # per prompt


def decode(model, x: list[int], drafter: str, draft_model, k: int, tree: int | None):
    """One prompt -> (steps, tokens, seconds, leaves): leaves = (q, reached, taken) of every runner-up leaf of every step."""
    steps = tokens = 0
    seconds, leaves = 0.0, []
    d = make_drafter(drafter, model.module, draft_model, **({} if tree is None else {"tree": tree}))
    s = Session(model.module, x, d, Sampler(SamplingParams()), k=k, max_new_tokens=NEW_TOKENS)
    s.prefill()
    while not s.done:
        r = s.step()
        steps, tokens, seconds = steps + 1, tokens + len(r.emitted), seconds + r.draft_seconds + r.verify_seconds
        if tree is None or r.path is None or d.proposed is None:
            continue
        on_path = set(r.path)
        for n, (parent, rank, lq) in enumerate(zip(d.proposed.parents, d.proposed.ranks, d.proposed.logq)):
            if rank == 1:
                leaves.append((math.exp(lq), parent < 0 or parent in on_path, n in on_path))
    return steps, tokens, seconds, leaves


def main() -> None:
    p = model_args(argparse.ArgumentParser())
    p.add_argument("--k", type=int, default=5)
    p.add_argument("--rounds", type=int, default=2)
    a = p.parse_args()
    torch.set_num_threads(1)
    model = mtpspec.load(a.model, a.tokenizer)
    ids = prepare_ids(model, load_prompts(a.prompts, a.limit), NEW_TOKENS)
    tree = min(2 * a.k, 63)  # a beam-1 tree grows 2 nodes per level: every one is kept
    decode(model, ids[0], a.drafter, a.draft_model, a.k, None)  # warm-up
    decode(model, ids[0], a.drafter, a.draft_model, a.k, tree)
    tot = {None: [0, 0, 0.0, []], tree: [0, 0, 0.0, []]}  # steps, tokens, seconds, leaves
    for r in range(a.rounds):  # chain and tree take turns, prompt by prompt, the first one alternating
        for i, x in enumerate(ids):
            for t in ((None, tree) if (i + r) % 2 == 0 else (tree, None)):
                for j, v in enumerate(decode(model, x, a.drafter, a.draft_model, a.k, t)):
                    tot[t][j] += v
    (c_steps, c_tok, c_sec, _), (t_steps, t_tok, t_sec, leaves) = tot[None], tot[tree]
    s_c, s_t = c_sec / c_steps, t_sec / t_steps
    rows = len(leaves) / t_steps  # extra rows per tree step
    row_cost = (s_t - s_c) / rows
    print(f"chain D={a.k}: {c_tok / c_steps:.2f} tok/step, {1e3 * s_c:.2f} ms/step, {c_tok / c_sec:.1f} tok/s")
    print(f"tree  D={a.k} + runner-ups: {t_tok / t_steps:.2f} tok/step, {1e3 * s_t:.2f} ms/step, {t_tok / t_sec:.1f} tok/s "
          f"({t_tok / t_sec / (c_tok / c_sec):.3f}x); {rows:.2f} extra rows/step at {1e3 * row_cost:.3f} ms each "
          f"(drafting and walk included); a row pays when it adds > {row_cost * c_tok / c_sec:.3f} tokens\n")
    print("| runner-up q | reached | taken when reached |\n|---|---:|---:|")
    for lo, hi in zip(BUCKETS, BUCKETS[1:]):
        sel = [x for x in leaves if lo <= x[0] < hi and x[1]]
        if sel:
            print(f"| {lo:.2f}-{min(hi, 1):.2f} | {len(sel)} | {sum(x[2] for x in sel) / len(sel):.3f} |")
    print("\n| keep a leaf when q >= | rows/step | + tok/step | tok/s vs chain |\n|---:|---:|---:|---:|")
    for t in BUCKETS[:-1]:  # a chain step plus the chosen leaves: their rows at the measured price, their tokens
        sel = [x for x in leaves if x[0] >= t]
        gain, n = sum(x[2] for x in sel) / t_steps, len(sel) / t_steps
        rate = (c_tok / c_steps + gain) / (s_c + n * row_cost)
        print(f"| {t:.2f} | {n:.2f} | {gain:.3f} | {rate / (c_tok / c_sec):.3f} |")


if __name__ == "__main__":
    main()

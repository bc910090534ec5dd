"""Where llama.cpp's greedy text leaves ours on the same GGUF, and which side the exact model takes there.

For each prompt: both sides' greedy continuations (ours: plain decoding; llama.cpp: llama-server, its top-2
log-probabilities kept), the first token where they differ, our logit margin there (our token minus theirs), and the
margin of the exact model (the file dequantized, fp64: transformers' function to 1e-10) between the same two tokens,
positive where it takes our side. After `make llamacpp`.

    python scripts/llamacpp_splits.py --model gemma3-270m --threads 1 --limit 8
"""

from __future__ import annotations

import argparse
import json

import torch

import mtpspec
from mtpspec.bench.harness import logit_margin, prepare_ids, split_at
from mtpspec.bench.llamacpp import LlamaCppRunner, request_body
from mtpspec.bench.peers import Method
from mtpspec.loading.gguf_model import load_gguf_model
from mtpspec.prompts import load_prompts


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", default="gemma3-270m")
    ap.add_argument("--groups", default="code=humaneval,chat=mt_bench,summaries=build/summaries.jsonl")
    ap.add_argument("--limit", type=int, default=8)
    ap.add_argument("--tokens", type=int, default=128)
    ap.add_argument("--threads", type=int, default=1)
    args = ap.parse_args()
    model = mtpspec.load(args.model, threads=args.threads)
    exact = load_gguf_model(model.path, dtype=torch.float64)
    rows = []
    with LlamaCppRunner(model.path, args.threads, 2048, tuple(model.tokenizer.stop_ids)) as peer:
        server = peer.server(Method("llamacpp", "none", None))
        for group, source in (g.split("=") for g in args.groups.split(",")):
            prompts = load_prompts(source, args.limit)
            for p, ids in zip(prompts, prepare_ids(model, prompts, args.tokens)):
                ours = list(model.generate(ids, max_new_tokens=args.tokens, drafter="none").tokens)
                body = request_body(ids, args.tokens) | {"n_probs": 2}
                steps = server.post("/completion", body)["completion_probabilities"]
                theirs = [s["id"] for s in steps]
                theirs = theirs[:-1] if theirs and theirs[-1] in model.tokenizer.stop_ids else theirs
                row = {"group": group, "prompt": p.id, "split": split_at(ours, theirs)}
                i = row["split"]
                if i is not None and i < min(len(ours), len(theirs)):
                    top = steps[i]["top_logprobs"]
                    at = ids + ours[:i]
                    row |= {"ours": ours[i], "theirs": theirs[i], "our_margin": logit_margin(model.module, at, ours[i], theirs[i]),
                            "exact_margin": logit_margin(exact, at, ours[i], theirs[i]),
                            "llamacpp_top2_gap": top[0]["logprob"] - top[1]["logprob"]}
                print(json.dumps(row), flush=True)
                rows.append(row)
    split = [r for r in rows if "exact_margin" in r]
    print(f"equal: {sum(r['split'] is None for r in rows)}/{len(rows)}; at the {len(split)} splits the exact model takes "
          f"our token at {sum(r['exact_margin'] > 0 for r in split)}, llama.cpp's at {sum(r['exact_margin'] < 0 for r in split)}; "
          f"|exact margin| median {sorted(abs(r['exact_margin']) for r in split)[len(split) // 2]:.3f}" if split else "")


if __name__ == "__main__":
    main()

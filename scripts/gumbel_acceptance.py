"""Acceptance of Gumbel-max sampling against rejection sampling, same drafter, same prompts and seeds.

For each model, temperature and sampler: every prompt generated with --drafter mtp at a fixed k, one thread; printed
are the accepted share of drafted tokens, the mean accepted length (tokens per target forward, bonus / recovered
token included) and tokens/s, with the CPU model (lscpu), the thread count and the commit. Gumbel drafts with the
target's noise (argmax(log q + g_t)); rejection draws q's sample and accepts it with probability min(1, p/q).

    .venv/bin/python scripts/gumbel_acceptance.py [--models demo,gemma3-270m] [--prompts 4] [--tokens 64] [--k 3]
"""

from __future__ import annotations

import argparse
import subprocess
import sys
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))  # this tree's mtpspec, whichever copy the environment installed

import mtpspec  # noqa: E402
from mtpspec.prompts import tinystories_prompts  # noqa: E402


def cpu_model() -> str:
    try:
        out = subprocess.run(["lscpu"], capture_output=True, text=True, check=True).stdout
    except (OSError, subprocess.CalledProcessError):
        return "unknown (no lscpu)"
    return next((line.split(":", 1)[1].strip() for line in out.splitlines() if line.startswith("Model name")), "unknown")


def commit() -> str:
    r = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, capture_output=True, text=True)
    dirty = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"], cwd=ROOT, capture_output=True, text=True).stdout
    return (r.stdout.strip() or "unknown") + (" (with uncommitted changes)" if dirty.strip() else "")


def prompts_for(name: str, n: int) -> list[str]:
    if name == "demo":  # held-out Python source, the demo model's domain
        from mtpspec.train.data import code_prompts, stdlib_files

        return code_prompts(stdlib_files()[1], n)
    return tinystories_prompts(n)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--models", default="demo,gemma3-270m")
    ap.add_argument("--prompts", type=int, default=4)
    ap.add_argument("--tokens", type=int, default=64)
    ap.add_argument("--k", type=int, default=3)
    ap.add_argument("--temperatures", default="0.7,1.0")
    ap.add_argument("--threads", type=int, default=1)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    print(f"CPU: {cpu_model()}; threads: {args.threads}; commit: {commit()}")
    print(f"drafter mtp, k={args.k}, {args.prompts} prompts x {args.tokens} new tokens, seeds 0..{args.prompts - 1}")
    print("| model | T | sampler | accepted / drafted | tokens per forward | tokens/s |")
    print("|---|---|---|---|---|---|")
    for name in args.models.split(","):
        model = mtpspec.load(name, threads=args.threads)
        texts = prompts_for(name, args.prompts)
        model.generate(texts[0], drafter="mtp", k=args.k, max_new_tokens=4)  # warm-up
        for t in (float(x) for x in args.temperatures.split(",")):
            for sampler in ("rejection", "gumbel"):
                drafted = accepted = forwards = new = 0
                seconds = 0.0
                for seed, text in enumerate(texts):
                    r = model.generate(text, drafter="mtp", k=args.k, temperature=t, seed=seed, sampler=sampler,
                                       max_new_tokens=args.tokens)
                    drafted += r.stats.draft_tokens
                    accepted += r.stats.accepted_tokens
                    forwards += r.stats.target_forwards
                    new += len(r.tokens)
                    seconds += r.stats.wall_seconds
                print(f"| {name} | {t:g} | {sampler} | {accepted / max(drafted, 1):.3f} | {new / max(forwards, 1):.2f} | "
                      f"{new / seconds:.1f} |", flush=True)


if __name__ == "__main__":
    main()

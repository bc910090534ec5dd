"""Decode speed of this tree against an earlier commit's, side by side (a change to the forward or the step must keep
each ratio >= 0.97).

A git worktree of `--commit` is made under build/; each round runs the same generations (demo model, greedy, one
thread) once in each tree, each in its own subprocess with PYTHONPATH=<tree>, the trees' order alternating by round
(an even number of rounds: on a VM where whichever runs first in a round runs faster, each tree is first as often).
B = 1: new tokens / (wall - prefill) per prompt, methods alternating prompt by prompt; --batch N: every prompt in one
Model.generate_batch of up to N sequences, new tokens / wall. Printed: the median per (tree, method), new / old of
the medians, the median of the rounds' own ratios, the same by process CPU time, and whether both trees emit the
same tokens.

    .venv/bin/python scripts/engine_vs_commit.py --commit REV [--python] [--prompts 4] [--tokens 128] [--rounds 4]
        [--batch 8] [--methods none@1,mtp@3] [--compile none|new|old|both] [--temperature T --top-p P [--seed S]]
"""

from __future__ import annotations

import argparse
import inspect
import json
import os
import statistics
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def child(args: argparse.Namespace) -> None:
    """In a subprocess, with PYTHONPATH=<tree>: warm up, then one generation per (prompt, method); JSON on stdout."""
    from time import process_time

    import torch

    import mtpspec
    from mtpspec.prompts import tinystories_prompts

    torch.set_num_threads(args.threads)
    model = mtpspec.load(args.model, threads=args.threads, **({"compile": True} if args.compile_child else {}))
    if args.python:  # held-out Python source (the demo model's domain), as make demo and the llama.cpp tables use
        from mtpspec.train.data import code_prompts, stdlib_files

        texts = code_prompts(stdlib_files()[1], args.prompts)
    else:
        texts = tinystories_prompts(args.prompts)
    ids = [model.encode(t) for t in texts]
    sampling = {"temperature": args.temperature, "top_p": args.top_p, **({"seed": args.seed} if args.seed is not None else {})}
    methods = [(d, k if k == "auto" else int(k)) for d, k in (m.split("@") if "@" in m else (m, "1") for m in args.methods.split(","))]
    if args.compile_child:  # every graph the runs reach, built (or loaded from the disk cache) before any is timed
        from mtpspec.models.compiled import prepare

        k_top = max(8 if k == "auto" else k for _, k in methods)  # --k auto drafts up to 8 deep
        prepare(model.module, range(1, k_top + 2), min(map(len, ids)), max(map(len, ids)) + args.tokens + k_top,
                **({"chains": range(1, k_top + 1)} if "chains" in inspect.signature(prepare).parameters else {}))
    for drafter, k in methods:  # first-call costs are not measured
        model.generate(ids[0], drafter=drafter, k=k, max_new_tokens=8, **sampling)
    out = {"mtpspec": str(Path(mtpspec.__file__).parent), "methods": {}}
    acc = {f"{d}@{k}": {"tokens": 0, "decode_seconds": 0.0, "cpu_seconds": 0.0, "ids": []} for d, k in methods}
    if args.batch > 1:  # every prompt in one batch: decode rate = new tokens / wall time of the whole batch
        from time import perf_counter
        for drafter, k in methods:
            c0, t0 = process_time(), perf_counter()
            res = model.generate_batch(ids, drafter=drafter, k=k, max_new_tokens=args.tokens, max_batch=args.batch, **sampling)
            a = acc[f"{drafter}@{k}"]
            a["cpu_seconds"] += process_time() - c0
            a["decode_seconds"] += perf_counter() - t0
            a["tokens"] += sum(len(r.tokens) for r in res)
            a["ids"] += [list(r.tokens) for r in res]
        ids = []
    for p in ids:  # methods alternate prompt by prompt
        for drafter, k in methods:
            c0 = process_time()
            res = model.generate(p, drafter=drafter, k=k, max_new_tokens=args.tokens, **sampling)
            a = acc[f"{drafter}@{k}"]
            a["cpu_seconds"] += process_time() - c0
            a["tokens"] += len(res.tokens)
            a["decode_seconds"] += res.stats.wall_seconds - res.stats.prefill_seconds
            a["ids"].append(list(res.tokens))
    for lab, a in acc.items():
        out["methods"][lab] = {"decode_tokens_per_second": a["tokens"] / a["decode_seconds"],
                               "cpu_tokens_per_second": a["tokens"] / a["cpu_seconds"], "ids": a["ids"]}
    print(json.dumps(out))


def worktree(commit: str) -> Path:
    """build/engine-<commit>: a detached worktree of `commit` (made once, reused)."""
    sha = subprocess.run(["git", "rev-parse", "--short", commit], cwd=ROOT, check=True, capture_output=True, text=True).stdout.strip()
    path = ROOT / "build" / f"engine-{sha}"
    if not (path / "mtpspec").exists():
        path.parent.mkdir(exist_ok=True)
        subprocess.run(["git", "worktree", "add", "--detach", str(path), sha], cwd=ROOT, check=True, capture_output=True)
    return path


def run_tree(tree: Path, args: argparse.Namespace) -> dict:
    sys.path.insert(0, str(ROOT))
    from mtpspec.loading import assets_dir  # this tree's: a worktree under build/ has no ../shared beside it

    env = {**os.environ, "PYTHONPATH": str(tree), "OMP_NUM_THREADS": str(args.threads), "MTPSPEC_ASSETS": str(assets_dir().resolve())}
    cmd = [sys.executable, str(Path(__file__).resolve()), "--child", "--model", args.model, "--prompts", str(args.prompts),
           "--tokens", str(args.tokens), "--methods", args.methods, "--threads", str(args.threads),
           "--batch", str(args.batch), "--temperature", str(args.temperature), "--top-p", str(args.top_p)]
    cmd += ["--python"] if args.python else []
    cmd += ["--seed", str(args.seed)] if args.seed is not None else []
    cmd += ["--compile-child"] if args.compile in ("both", "new" if tree == ROOT else "old") else []
    got = subprocess.run(cmd, env=env, cwd=tree, capture_output=True, text=True)
    if got.returncode != 0:
        raise RuntimeError(f"the run in {tree} failed:\n{got.stderr}")
    res = json.loads(got.stdout.strip().splitlines()[-1])
    if Path(res["mtpspec"]) != tree / "mtpspec":
        raise RuntimeError(f"the subprocess imported {res['mtpspec']}, not {tree / 'mtpspec'}")
    return res


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--commit", default="HEAD~1")
    ap.add_argument("--model", default="demo")
    ap.add_argument("--prompts", type=int, default=4)
    ap.add_argument("--tokens", type=int, default=128)
    ap.add_argument("--rounds", type=int, default=4, help="rounds (even: each tree runs first in half of them)")
    ap.add_argument("--methods", default="none@1,mtp@3", help="drafter@k, comma-separated (none@1 = plain)")
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--batch", type=int, default=1)
    ap.add_argument("--temperature", type=float, default=0.0, help="0 = greedy")
    ap.add_argument("--top-p", type=float, default=1.0)
    ap.add_argument("--seed", type=int, default=None, help="a seeded sampled run draws by Gumbel-max (the same text in both trees)")
    ap.add_argument("--python", action="store_true", help="held-out Python prompts (default: TinyStories prompts)")
    ap.add_argument("--compile", default="none", choices=["none", "new", "old", "both"],
                    help="which tree loads the model with compile=True (its graphs cached by a first, unmeasured run)")
    ap.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--compile-child", action="store_true", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.child:
        return child(args)
    model = str((ROOT / "models" / "demo").resolve()) if args.model == "demo" else args.model  # the same weights in both trees
    args.model = model
    trees = {"old": worktree(args.commit), "new": ROOT}
    rates: dict[tuple[str, str], list[float]] = {}  # (tree, method) -> decode tokens/s per round
    cpu: dict[tuple[str, str], list[float]] = {}  # the same by CPU time
    ids: dict[str, dict] = {}
    if args.compile != "none":  # graphs built (or loaded from the on-disk cache) before anything is timed
        for name in trees:
            run_tree(trees[name], argparse.Namespace(**{**vars(args), "prompts": 1, "tokens": 16}))
    for r in range(args.rounds):
        for name in (["old", "new"] if r % 2 == 0 else ["new", "old"]):
            res = run_tree(trees[name], args)
            for lab, m in res["methods"].items():
                rates.setdefault((name, lab), []).append(m["decode_tokens_per_second"])
                cpu.setdefault((name, lab), []).append(m["cpu_tokens_per_second"])
                ids.setdefault(name, {})[lab] = m["ids"]
            got = ", ".join(f"{lab} {m['decode_tokens_per_second']:.1f} tok/s" for lab, m in res["methods"].items())
            print(f"round {r} {name}: {got}", file=sys.stderr)
    print(f"B = {args.batch} decode tokens/s, median of {args.rounds} rounds ({args.prompts} {'Python' if args.python else 'TinyStories'} "
          f"prompts x {args.tokens} tokens, "
          f"{f'T = {args.temperature}, top-p {args.top_p}, seed {args.seed}' if args.temperature else 'greedy'}, {args.threads} thread(s)); old = {args.commit}, new = working tree; "
          f"compiled: {args.compile}")
    print("| method | old | new | new / old | per-round new / old | by CPU time | same tokens |\n|---|---:|---:|---:|---:|---:|---|")
    for lab in ids["new"]:
        o, n = statistics.median(rates[("old", lab)]), statistics.median(rates[("new", lab)])
        paired = statistics.median(b / a for a, b in zip(rates[("old", lab)], rates[("new", lab)]))
        by_cpu = statistics.median(b / a for a, b in zip(cpu[("old", lab)], cpu[("new", lab)]))
        same = sum(a == b for a, b in zip(ids["old"][lab], ids["new"][lab]))
        print(f"| {lab} | {o:.1f} | {n:.1f} | {n / o:.3f} | {paired:.3f} | {by_cpu:.3f} | {same}/{len(ids['new'][lab])} |")


if __name__ == "__main__":
    main()

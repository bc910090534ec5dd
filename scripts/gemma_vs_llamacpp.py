"""Gemma 3 270M (Q4_K_M GGUF) against llama.cpp on the same file: plain decoding, per prompt group and thread count.

Runs `mtpspec bench --model gemma3-270m --peers llamacpp` (the public command) once per group (code: HumanEval,
chat: MT-bench, summaries: Spec-Bench's summarization rows) and thread count, methods interleaved, and prints one
table: decode-only tokens/s of our plain decoding and llama.cpp's (medians over rounds, as the bench reports them),
their ratio, and our verify pass's cost T(k)/T(1) at k = 5 and 9 (the bench's cost model, all rows' logits).

    python scripts/gemma_vs_llamacpp.py --out build/gemma-llamacpp [--threads 1,2] [--limit 4] [--repeat 3]

Needs llama.cpp (`make llamacpp`) and the `real` extra. About 2-3 minutes per group and thread count at 128 tokens.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
from pathlib import Path

GROUPS = {"code": "humaneval", "chat": "mt_bench", "summaries": "summarization"}


def _summaries_file(out: Path) -> Path:
    """Spec-Bench's summarization rows as their own prompt file (the bench takes a set by name or a file)."""
    from mtpspec.loading import assets_dir

    src = assets_dir() / "prompts" / "spec_bench_question.jsonl"
    rows = [line for line in src.read_text().splitlines() if json.loads(line).get("category") == "summarization"]
    path = out / "spec_bench_summarization.jsonl"
    path.write_text("\n".join(rows) + "\n")
    return path


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", required=True)
    p.add_argument("--threads", default="1,2")
    p.add_argument("--groups", default=",".join(GROUPS))
    p.add_argument("--limit", type=int, default=4)
    p.add_argument("--repeat", type=int, default=3)
    p.add_argument("--max-new-tokens", type=int, default=128)
    p.add_argument("--drafters", default="none", help="our methods beside plain (bench --drafters)")
    args = p.parse_args(argv)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    rows = []
    for threads in (int(t) for t in args.threads.split(",")):
        for group in args.groups.split(","):
            prompts = str(_summaries_file(out)) if GROUPS[group] == "summarization" else GROUPS[group]
            run = out / f"{group}-t{threads}"
            cmd = [sys.executable, "-m", "mtpspec", "bench", "--model", "gemma3-270m", "--prompts", prompts,
                   "--drafters", args.drafters, "--k", "4", "--limit", str(args.limit), "--repeat", str(args.repeat),
                   "--max-new-tokens", str(args.max_new_tokens), "--threads", str(threads), "--peers", "llamacpp",
                   "--no-progress", "--out", str(run)]
            print("$", " ".join(cmd[1:]), flush=True)
            subprocess.run(cmd, check=True, stdout=subprocess.DEVNULL)
            res = json.loads((run / "results.json").read_text())
            overall, ratio = res["summary"]["overall"], res["cost_model"]["ratio"]
            ours = overall["ours:plain"]["decode_tokens_per_second"]
            peer = overall["llamacpp:plain"]["decode_tokens_per_second"]
            same = overall["llamacpp:plain"].get("lossless", "-")
            rows.append((group, threads, ours, peer, ours / peer, ratio[4], ratio[8], same, res["cost_model"]["t1"] * 1e3))
    print("\n| group | threads | ours plain tok/s | llama.cpp plain tok/s | ours / llama.cpp | T(5)/T(1) | T(9)/T(1) "
          "| llama.cpp text = ours | our T(1) ms |")
    print("|---|---:|---:|---:|---:|---:|---:|---:|---:|")
    for g, t, a, b, r, t5, t9, same, t1 in rows:
        print(f"| {g} | {t} | {a:.1f} | {b:.1f} | {r:.3f} | {t5:.2f} | {t9:.2f} | {same} | {t1:.1f} |")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

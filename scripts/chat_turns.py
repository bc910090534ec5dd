"""A multi-turn chat against `mtpspec serve` with and without prefix reuse (--prefix-cache): time to first token and
the prompt positions copied per turn, the replies checked equal between the two servers.

Each round starts one server per setting (the order rotated) and holds the same conversation: the user turns are the
first --turns MT-bench prompts, each reply (greedy, --max-tokens) goes back into the next request, as a chat client
sends it. Printed per turn: prompt tokens, the positions reused, the median TTFT of each setting.

    python scripts/chat_turns.py --model gemma3-270m --turns 6 --rounds 3 --threads 1
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time

import httpx

from mtpspec.bench.common import ServerProcess
from mtpspec.prompts import load_prompts


def conversation(url: str, turns: list[str], max_tokens: int) -> list[dict]:
    """Streamed chat completions, one per user turn, each with every earlier turn: per turn TTFT, usage and reply."""
    messages, out = [], []
    for text in turns:
        messages.append({"role": "user", "content": text})
        body = {"model": "m", "messages": messages, "max_tokens": max_tokens, "temperature": 0, "stream": True,
                "stream_options": {"include_usage": True}}
        t0, ttft, reply, usage = time.perf_counter(), None, "", None
        with httpx.stream("POST", url + "v1/chat/completions", json=body, timeout=600) as r:
            for line in r.iter_lines():
                if not line.startswith("data: ") or line == "data: [DONE]":
                    continue
                obj = json.loads(line[6:])
                delta = "".join((c.get("delta") or {}).get("content") or "" for c in obj.get("choices") or [])
                if delta and ttft is None:
                    ttft = time.perf_counter() - t0
                reply += delta
                usage = obj.get("usage") or usage
        messages.append({"role": "assistant", "content": reply})
        out.append({"ttft": ttft, "reply": reply, "prompt_tokens": usage["prompt_tokens"],
                    "cached": usage["prompt_tokens_details"]["cached_tokens"]})
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", default="gemma3-270m")
    ap.add_argument("--turns", type=int, default=6)
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--settings", default="0,4096", help="--prefix-cache values, comma-separated")
    args = ap.parse_args()
    turns = [p.text for p in load_prompts("mt_bench", limit=args.turns)]
    settings = [int(x) for x in args.settings.split(",")]
    runs: dict[int, list[list[dict]]] = {s: [] for s in settings}
    for r in range(args.rounds):
        for s in settings[r % len(settings):] + settings[: r % len(settings)]:
            argv = lambda port, s=s: [sys.executable, "-m", "mtpspec", "serve", "--model", f"m={args.model}", "--port", str(port),  # noqa: E731
                                      "--drafter", "none", "--threads", str(args.threads), "--prefix-cache", str(s)]
            with ServerProcess(argv, 300) as server:
                runs[s].append(conversation(server.url, turns, args.max_tokens))
            print(f"round {r + 1}, --prefix-cache {s}: done", file=sys.stderr, flush=True)
    first = runs[settings[0]][0]
    same = all(t["reply"] == f["reply"] for rs in runs.values() for run in rs for t, f in zip(run, first))
    print("| turn | prompt tokens | " + " | ".join(f"reused at {s}" for s in settings) + " | "
          + " | ".join(f"TTFT ms at {s}" for s in settings) + " |")
    print("|---:|---:|" + "---:|" * (2 * len(settings)))
    for i in range(args.turns):
        cached = [runs[s][0][i]["cached"] for s in settings]
        ttft = [1e3 * statistics.median(run[i]["ttft"] for run in runs[s]) for s in settings]
        print(f"| {i + 1} | {first[i]['prompt_tokens']} | " + " | ".join(map(str, cached)) + " | "
              + " | ".join(f"{x:.0f}" for x in ttft) + " |")
    print(f"\nreplies equal in every run and setting: {same}")


if __name__ == "__main__":
    main()

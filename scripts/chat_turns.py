"""A multi-turn chat against `mtpspec serve` with and without prefix reuse (--prefix-cache), and llama.cpp's
llama-server on the same GGUF (its prompt cache on, as it ships): time to first token and the prompt positions
reused per turn.

Each round starts one server per setting (the order rotated) and holds the same conversation: the user turns are the
first --turns MT-bench prompts, each reply (greedy, --max-tokens) goes back into the next request, as a chat client
sends it. Every request is the conversation rendered by the model's chat template here and sent as token ids to
/v1/completions, so both servers see the same ids for the same text. Printed per turn: prompt tokens and the median
TTFT of each setting; our two settings' replies are checked equal (llama.cpp's are its own arithmetic's).

    python scripts/chat_turns.py --model gemma3-270m --turns 6 --rounds 3 --threads 1 [--peer]
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time

import httpx

import mtpspec
from mtpspec.bench.common import ServerProcess
from mtpspec.bench.harness import Method
from mtpspec.bench.llamacpp import LlamaServer, find_binary, peer_gguf, server_args
from mtpspec.chat import ChatTemplate
from mtpspec.prompts import load_prompts


def conversation(url: str, model, turns: list[str], max_tokens: int) -> list[dict]:
    """Streamed completions, one per user turn, each of every earlier turn: per turn TTFT, prompt size, reused
    positions (where the server says) and the reply."""
    chat, messages, out = ChatTemplate.for_tokenizer(model.tokenizer), [], []
    for text in turns:
        messages.append({"role": "user", "content": text})
        ids = chat.prompt_ids(model, messages)
        body = {"model": "m", "prompt": ids, "max_tokens": max_tokens, "temperature": 0, "stream": True,
                "stream_options": {"include_usage": True}}
        t0, ttft, reply, usage = time.perf_counter(), None, "", {}
        with httpx.stream("POST", url + "v1/completions", json=body, timeout=600) as r:
            for line in r.iter_lines():
                if not line.startswith("data: ") or line == "data: [DONE]":
                    continue
                obj = json.loads(line[6:])
                piece = "".join(c.get("text") or "" for c in obj.get("choices") or [])
                if piece and ttft is None:
                    ttft = time.perf_counter() - t0
                reply += piece
                usage = obj.get("usage") or usage
        messages.append({"role": "assistant", "content": reply})
        out.append({"ttft": ttft, "reply": reply, "prompt_tokens": len(ids),
                    "cached": (usage.get("prompt_tokens_details") or {}).get("cached_tokens")})
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", default="gemma3-270m")
    ap.add_argument("--turns", type=int, default=6)
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--settings", default="0,4096", help="our --prefix-cache values, comma-separated")
    ap.add_argument("--peer", action="store_true", help="also llama.cpp's llama-server (after `make llamacpp`)")
    args = ap.parse_args()
    model = mtpspec.load(args.model, threads=args.threads)
    turns = [p.text for p in load_prompts("mt_bench", limit=args.turns)]
    settings = [f"ours:{x}" for x in args.settings.split(",")] + (["llamacpp"] if args.peer else [])
    exe = find_binary("llama-server") if args.peer else None

    def argv(setting: str, port: int) -> list[str]:
        if setting == "llamacpp":  # one slot: its KV holds the last request's, reused for the next (cache_prompt, its default)
            return server_args(exe, peer_gguf(model, "build", "chat_turns"), Method("llamacpp", "none", None), args.threads, 8192, port)
        return [sys.executable, "-m", "mtpspec", "serve", "--model", f"m={args.model}", "--port", str(port), "--drafter", "none",
                "--threads", str(args.threads), "--prefix-cache", setting.split(":")[1]]

    runs: dict[str, list[list[dict]]] = {s: [] for s in settings}
    for r in range(args.rounds):
        for s in settings[r % len(settings):] + settings[: r % len(settings)]:
            with (LlamaServer if s == "llamacpp" else ServerProcess)(lambda port, s=s: argv(s, port), 300) as server:
                runs[s].append(conversation(server.url, model, turns, args.max_tokens))
            print(f"round {r + 1}, {s}: done", file=sys.stderr, flush=True)
    ours = [s for s in settings if s != "llamacpp"]
    same = all(t["reply"] == f["reply"] for s in ours for run in runs[s] for t, f in zip(run, runs[ours[0]][0]))
    print("| turn | " + " | ".join(f"{s}: prompt tokens, reused, TTFT ms" for s in settings) + " |")
    print("|---:|" + "---:|" * len(settings))
    for i in range(args.turns):
        cells = []
        for s in settings:
            first = runs[s][0][i]
            ttft = 1e3 * statistics.median(run[i]["ttft"] for run in runs[s])
            cells.append(f"{first['prompt_tokens']}, {'-' if first['cached'] is None else first['cached']}, {ttft:.0f}")
        print(f"| {i + 1} | " + " | ".join(cells) + " |")
    print(f"\nour replies equal in every run and setting: {same}")


if __name__ == "__main__":
    main()

"""Structured output's cost under speculation on the demo model: tok/s and acceptance with and without a JSON schema,
and the grammar's own time (masks, path steps and rollback in grammar.GrammarState.allowed) per emitted token and per
masked row.

Each round runs every prompt once per (drafter, constraint), greedy, one thread; printed: the medians over rounds of
new tokens / wall, mean accepted length (tokens per target forward) and acceptance of draft tokens, and the grammar's
share of the wall time.

    .venv/bin/python scripts/grammar_cost.py [--rounds 3] [--tokens 64] [--drafters none,mtp@3,ngram@3]
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

import mtpspec
from mtpspec import Grammar
from mtpspec.grammar import GrammarState

SCHEMA = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 24},
                                           "age": {"type": "integer", "minimum": 0, "maximum": 150},
                                           "tags": {"type": "array", "items": {"enum": ["a", "b", "c"]}, "maxItems": 4},
                                           "kind": {"enum": ["cat", "dog", "bird"]}},
          "required": ["name", "age", "tags", "kind"], "additionalProperties": False}
PROMPTS = ["def to_json(self):\n    return ", "config = ", "    data = json.loads(text)\n    assert data == ",
           "DEFAULTS = ", "    result = "]


class Clock:
    """Time spent in GrammarState.allowed, and the rows it masked."""

    def __init__(self) -> None:
        self.seconds, self.rows = 0.0, 0
        inner = GrammarState.allowed

        def timed(state, rows):
            t0 = time.perf_counter()
            out = inner(state, rows)
            self.seconds += time.perf_counter() - t0
            self.rows += len(rows)
            return out

        GrammarState.allowed = timed


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--tokens", type=int, default=64)
    ap.add_argument("--drafters", default="none,mtp@3,ngram@3")
    args = ap.parse_args()
    torch.set_num_threads(1)
    model = mtpspec.load("demo", threads=1)
    clock = Clock()
    grammar = Grammar.json_schema(SCHEMA)
    methods = [(d.partition("@")[0], int(d.partition("@")[2] or 1)) for d in args.drafters.split(",")]
    for p in PROMPTS[:2]:  # warm-up: kernels, the tokenizer's llguidance form
        model.generate(p, grammar=grammar, drafter="mtp", k=3, max_new_tokens=8)
    rows = []
    for drafter, k in methods:
        for constrained in (False, True):
            tps, mal, acc, share, per_tok, per_row = [], [], [], [], [], []
            for _ in range(args.rounds):
                tokens = forwards = drafted = accepted = 0
                wall = 0.0
                clock.seconds, clock.rows = 0.0, 0
                for p in PROMPTS:
                    t0 = time.perf_counter()
                    r = model.generate(p, grammar=grammar if constrained else None, drafter=drafter, k=k, max_new_tokens=args.tokens)
                    wall += time.perf_counter() - t0
                    s = r.stats
                    tokens += len(r.tokens)
                    forwards += s.target_forwards
                    drafted += s.draft_tokens
                    accepted += s.accepted_tokens
                tps.append(tokens / wall)
                mal.append((accepted + forwards) / max(forwards, 1))  # the engine's mean accepted length (a stop token counts)
                acc.append(accepted / drafted if drafted else float("nan"))
                share.append(clock.seconds / wall)
                per_tok.append(clock.seconds / tokens * 1e6)
                per_row.append(clock.seconds / max(clock.rows, 1) * 1e6)
            med = statistics.median
            rows.append((f"{drafter}@{k}" if drafter != "none" else "none", "json_schema" if constrained else "-", med(tps), med(mal),
                         med(acc), tokens, med(share) if constrained else 0.0, med(per_tok) if constrained else 0.0,
                         med(per_row) if constrained else 0.0))
    print("| drafter | constraint | tok/s | mean accepted length | acceptance | tokens (5 prompts) | grammar share of wall | "
          "grammar µs / token | µs / masked row |")
    print("|---|---|---:|---:|---:|---:|---:|---:|---:|")
    for name, c, t, m, a, n, sh, pt, pr in rows:
        acc = "-" if a != a else f"{a:.2f}"  # (no drafts: NaN)
        print(f"| {name} | {c} | {t:.1f} | {m:.2f} | {acc} | {n} | {sh * 100:.1f} % | {pt:.0f} | {pr:.0f} |")


if __name__ == "__main__":
    main()

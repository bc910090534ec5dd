"""`make demo`: plain vs speculative decoding side by side, with speedup and acceptance."""

from __future__ import annotations

import torch

from .api import load
from .loading import assets_dir
from .prompts import tinystories_prompts


def demo(max_new_tokens: int = 200, n_prompts: int = 5) -> None:
    torch.set_num_threads(1)  # a 260K-parameter model: one thread is fastest on this 2-core machine
    models = assets_dir() / "models"
    target = load(models / "stories260K.bin", models / "tok512.bin")
    draft = load(models / "stories260K_q80.bin", models / "tok512.bin")
    prompts = tinystories_prompts(n_prompts)
    runs = [("plain", "none", 1), ("prompt lookup (n-gram)", "ngram", 4), ("draft model (Q8_0 twin)", "draft", 4)]
    print(f"target: stories260K.bin (fp32), {len(prompts)} TinyStories prompts x {max_new_tokens} new tokens, greedy\n")
    first = target.generate(prompts[0], max_new_tokens=max_new_tokens)
    print(f"prompt: {prompts[0]!r}\n{prompts[0]}{first.text}\n")
    totals = {}
    for label, drafter, k in runs:
        tokens = seconds = forwards = 0
        identical = True
        for p in prompts:
            ref = target.generate(p, max_new_tokens=max_new_tokens) if drafter != "none" else None
            r = target.generate(p, drafter=drafter, k=k, draft_model=draft, max_new_tokens=max_new_tokens)
            identical &= ref is None or r.tokens == ref.tokens
            tokens += len(r.tokens)
            seconds += r.stats.wall_seconds
            forwards += r.stats.target_forwards
        totals[label] = (tokens / seconds, tokens / forwards, identical)
    base = totals["plain"][0]
    print(f"{'decoding':<26}{'tok/s':>9}{'speedup':>9}{'tokens/forward':>16}  identical to plain")
    for label, (tps, tpf, same) in totals.items():
        print(f"{label:<26}{tps:>9.0f}{tps / base:>8.2f}x{tpf:>16.2f}  {'yes' if same else 'NO'}")
    print(
        "\nThe Q8_0 twin agrees with the target almost always, but dequantised it is the target's size, so each"
        "\ndrafted token costs a full forward: high acceptance, no speedup. Prompt lookup drafts for free."
    )

"""Weight-only quantization measured side by side (mtpspec.quant): speed and greedy agreement.

1. demo model (fp32 / int8 / int4, bf16 for reference): decode-only tok/s, plain and MTP D=2, held-out stdlib
   prompts, greedy, one thread, every variant in turn per prompt and round (drift hits all alike), median;
   and each quantized variant's greedy agreement with fp32 (common prefix, teacher-forced top-1 match).
2. --big: the Qwen3.5-0.8B-shaped hybrid (random weights, bf16 / int8 / int4): T(1) ms (one-token forward over a
   128-token cache) and one MTP draft step (layer + head), interleaved, median.

    python scripts/quant_bench.py [--prompts 8] [--new 64] [--rounds 2] [--big] [--threads 1]
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch


def decode_tps(r) -> float:
    s = r.stats
    return max(0, len(r.tokens) - 1) / max(1e-9, s.wall_seconds - s.prefill_seconds)


def demo_table(n_prompts: int, new: int, rounds: int, threads: int) -> None:
    import mtpspec
    from mtpspec.quant import greedy_agreement
    from mtpspec.train.data import code_prompts, stdlib_files

    prompts = code_prompts(stdlib_files()[1], n_prompts)
    variants = {"fp32": mtpspec.load("demo", threads=threads), "bf16": mtpspec.load("demo", dtype="bf16", threads=threads),
                "int8": mtpspec.load("demo", quant="int8", threads=threads), "int4 g64": mtpspec.load("demo", quant="int4", threads=threads),
                "int4 g32": mtpspec.load("demo", quant="int4", group_size=32, threads=threads)}
    runs = [("plain", "none", 1), ("MTP D=2", "mtp", 2)]
    tps = {(v, r[0]): [] for v in variants for r in runs}
    same = {v: True for v in variants}
    for m in variants.values():
        m.generate(prompts[0], max_new_tokens=8, drafter="mtp", k=2)  # warm-up
    for _ in range(rounds):
        for p in prompts:
            for v, m in variants.items():
                ref = None
                for label, d, k in runs:
                    r = m.generate(p, drafter=d, k=k, max_new_tokens=new)
                    tps[(v, label)].append(decode_tps(r))
                    ref = r.tokens if ref is None else ref
                    same[v] &= r.tokens == ref
    base = statistics.median(tps[("fp32", "plain")])
    print(f"\ndemo, {len(prompts)} held-out prompts x {new} new tokens, greedy, {threads} thread(s), {rounds} rounds, median decode tok/s")
    print("| weights | plain tok/s | MTP D=2 tok/s | plain vs fp32 | MTP identical to its plain |")
    print("|---|---|---|---|---|")
    for v in variants:
        a, b = statistics.median(tps[(v, "plain")]), statistics.median(tps[(v, "MTP D=2")])
        print(f"| {v} | {a:.0f} | {b:.0f} | {a / base:.2f}x | {'yes' if same[v] else 'NO'} |", flush=True)
    print(f"\ngreedy agreement with fp32 ({len(prompts)} prompts x {new} tokens)")
    print("| weights | mean common prefix | prefixes | teacher-forced top-1 match |")
    print("|---|---|---|---|")
    for v in ("bf16", "int8", "int4 g64", "int4 g32"):
        a = greedy_agreement(variants["fp32"], variants[v], prompts, new)
        print(f"| {v} | {a.mean_prefix:.1f} / {new} | {a.prefix_lengths} | {a.match_rate:.3f} |", flush=True)


def big_table(reps: int, layers: int, threads: int) -> None:
    import copy

    from mtpspec.quant import quantize

    from threads_t1 import qwen35_08b

    torch.set_num_threads(threads)
    base = qwen35_08b(layers)
    models = {"bf16": base}
    for kind, g in (("int8", 64), ("int4", 64), ("int4", 128)):
        m = copy.deepcopy(base)
        rep = quantize(m, kind, g)
        models[f"{kind}" + (f" g{g}" if kind == "int4" else "")] = m
        print(f"{kind} g{g}: {rep.layers}, {rep.bytes_before / 1e6:.0f} MB -> {rep.bytes_after / 1e6:.0f} MB", flush=True)
    cache = 128
    prompt = torch.randint(0, base.vocab_size, (cache,), generator=torch.Generator().manual_seed(1))
    t1 = {n: [] for n in models}
    mtp = {n: [] for n in models}
    with torch.inference_mode():
        state = {}
        for n, m in models.items():
            c = m.new_cache()
            out = m.forward_tokens(prompt, c)
            mc = m.new_mtp_cache()
            m.mtp_forward(out.hidden[:-1], prompt[1:], mc)
            state[n] = (c, mc, out.hidden[-1:])
        for i in range(reps + 1):  # the first round warms up
            for n, m in models.items():
                c, mc, h = state[n]
                s = time.perf_counter()
                m.forward_tokens(prompt[i : i + 1], c)
                dt = time.perf_counter() - s
                c.crop(cache)
                s = time.perf_counter()
                m.head(m.mtp_forward(h, prompt[i : i + 1], mc)).argmax(-1)
                dm = time.perf_counter() - s
                mc.crop(cache - 1)
                if i:
                    t1[n].append(dt)
                    mtp[n].append(dm)
    b = statistics.median(t1["bf16"])
    print(f"\nQwen3.5-0.8B-shaped hybrid ({layers} layers, random weights), {threads} thread(s), {reps} interleaved reps, median")
    print("| weights | T(1) ms | vs bf16 | MTP draft step ms |")
    print("|---|---|---|---|")
    for n in models:
        a = statistics.median(t1[n])
        print(f"| {n} | {a * 1e3:.0f} | {a / b:.2f}x | {statistics.median(mtp[n]) * 1e3:.0f} |")


def main() -> None:
    import sys
    from pathlib import Path

    ap = argparse.ArgumentParser()
    ap.add_argument("--prompts", type=int, default=8)
    ap.add_argument("--new", type=int, default=64)
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--big", action="store_true")
    ap.add_argument("--no-demo", action="store_true")
    ap.add_argument("--reps", type=int, default=7)
    ap.add_argument("--layers", type=int, default=24)
    args = ap.parse_args()
    sys.path.insert(0, str(Path(__file__).parent))
    if not args.no_demo:
        demo_table(args.prompts, args.new, args.rounds, args.threads)
    if args.big:
        big_table(args.reps, args.layers, args.threads)


if __name__ == "__main__":
    main()

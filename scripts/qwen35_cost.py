"""Forward cost at the Qwen3.5-0.8B text shape (random bf16 weights, seed 0): the tables docs/benchmarks.md and
docs/models.md cite. The model is built by transformers (Qwen3_5ForCausalLM), saved as a transformers folder (the
demo's tokenizer beside it) and loaded by `mtpspec.load()`; llama.cpp runs the same tensors as a bf16 GGUF
(`mtpspec.export_gguf`). T(k): one forward of k new tokens over a `--cache`-token cache (k = D + 1).

    python scripts/qwen35_cost.py forward [--hf] [--ks 1,2,3,5] [--threads 1] [--reps 5]  # ours (and transformers')
    python scripts/qwen35_cost.py llamacpp [--ks 1,2,3,5]     # llama-bench: T(1) from generation, T(k) a k-token prompt pass
    python scripts/qwen35_cost.py quant [--requant] [--demo]  # T(1) on llama-quantize's files, ours loading them too
                                                              # (--requant: ours quantizes the bf16 model itself)
"""

from __future__ import annotations

import argparse
import copy
import json
import shutil
import statistics
import subprocess
from pathlib import Path
from time import perf_counter

import torch

import mtpspec
from mtpspec.bench.costmodel import time_forwards
from mtpspec.bench.llamacpp import find_binary
from mtpspec.loading import shipped_demo_dir


def hf_model(layers: int):
    from transformers import Qwen3_5ForCausalLM, Qwen3_5TextConfig

    torch.manual_seed(0)
    cfg = Qwen3_5TextConfig(
        vocab_size=248320, hidden_size=1024, intermediate_size=3584, num_hidden_layers=layers, num_attention_heads=8,
        num_key_value_heads=2, head_dim=256, linear_num_key_heads=16, linear_num_value_heads=16, linear_key_head_dim=128,
        linear_value_head_dim=128, linear_conv_kernel_dim=4, rms_norm_eps=1e-6, tie_word_embeddings=True,
        max_position_embeddings=262144, rope_parameters={"rope_type": "default", "rope_theta": 1e7, "partial_rotary_factor": 0.25})
    return Qwen3_5ForCausalLM(cfg).to(torch.bfloat16).eval()


def saved(out: Path, layers: int, demo: bool, gguf: bool) -> tuple[Path, Path]:
    """(the folder mtpspec loads, the GGUF llama.cpp runs), each written on first use."""
    folder = shipped_demo_dir() if demo else out / f"qwen35_08b_{layers}l"
    path = out / ("demo-f32.gguf" if demo else f"qwen35_08b_{layers}l-bf16.gguf")
    if not (folder / "config.json").exists() and not demo:
        hf_model(layers).save_pretrained(folder)
        shutil.copy(shipped_demo_dir() / "tokenizer.json", folder)
    if gguf and not path.exists():
        from mtpspec.export_gguf import export_gguf

        m = mtpspec.load(folder, dtype="fp32" if demo else "bf16")
        export_gguf(m.module, m.tokenizer, path, outtype="f32" if demo else "bf16")
    return folder, path


def llama_bench(gguf: Path, threads: int, ks: list[int], reps: int, cache: int) -> dict[int, float]:
    """k -> median ms of llama-bench's forward over k new tokens after `cache` tokens (k = 1: a generation step)."""
    pp = ",".join(str(k) for k in ks if k > 1) or "0"
    out = subprocess.run([str(find_binary("llama-bench")), "-m", str(gguf), "-t", str(threads), "-d", str(cache), "-r", str(reps),
                          "-o", "json", "-n", "16", "-p", pp], capture_output=True, text=True, check=True).stdout
    return {t["n_prompt"] or 1: statistics.median(t["samples_ns"]) / 1e6 / max(t["n_gen"], 1) for t in json.loads(out)}


@torch.inference_mode()
def hf_times(ks: list[int], cache: int, reps: int, layers: int) -> dict[int, float]:
    """transformers' median seconds per forward of k tokens over a copy of a `cache`-token DynamicCache."""
    from transformers.cache_utils import DynamicCache

    ref = hf_model(layers)
    past = DynamicCache(config=ref.config)
    ref(torch.randint(0, 248320, (1, cache)), cache=past, use_cache=True)
    times = {k: [] for k in ks}
    for _ in range(reps + 1):
        for k in ks:
            c = copy.deepcopy(past)
            t0 = perf_counter()
            ref(torch.randint(0, 248320, (1, k)), cache=c, use_cache=True)
            times[k].append(perf_counter() - t0)
    return {k: statistics.median(v[1:]) for k, v in times.items()}


def row(name: str, t: dict[int, float], ks: list[int]) -> str:
    return f"| {name} | {t[1]:.1f} | " + " | ".join(f"{t[k] / t[1]:.2f}" for k in ks if k > 1) + " |"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("table", choices=["forward", "llamacpp", "quant"])
    ap.add_argument("--ks", default="1,2,3,5", help="forward widths k (T(1) always)")
    ap.add_argument("--hf", action="store_true", help="forward: transformers' Qwen3_5ForCausalLM too")
    ap.add_argument("--compile", action="store_true", help="forward: ours through the compiled step")
    ap.add_argument("--requant", action="store_true", help="quant: ours quantizes the f32 / bf16 model into the same block types (q8_0 / q4_0 against Q8_0 / Q4_0)")
    ap.add_argument("--demo", action="store_true", help="quant: the demo model (f32) instead of the 0.8B shape")
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--rounds", type=int, default=3, help="quant: alternating rounds of llama-bench and ours")
    ap.add_argument("--cache", type=int, default=256)
    ap.add_argument("--layers", type=int, default=24)
    ap.add_argument("--out", type=Path, default=Path("build/qwen35_cost"))
    args = ap.parse_args()
    ks = sorted({1, *map(int, args.ks.split(","))})
    folder, gguf = saved(args.out, args.layers, args.demo, args.table != "forward")
    head = "| T(1) ms | " + " | ".join(f"T({k})/T(1)" for k in ks[1:]) + " |"
    if args.table == "llamacpp":
        print(f"| llama-bench, {args.threads} thread(s), cache {args.cache} {head}\n" + "|---" * (len(ks) + 1) + "|")
        print(row("llama.cpp", llama_bench(gguf, args.threads, ks, args.reps, args.cache), ks))
    elif args.table == "forward":
        ours = mtpspec.load(folder, dtype="bf16", threads=args.threads, compile=args.compile)
        t = time_forwards(ours.module, ks, args.cache, repeat=args.reps, q=0.5, min_repeat=args.reps)
        print(f"| model, {args.threads} thread(s), cache {args.cache} {head}\n" + "|---" * (len(ks) + 1) + "|")
        print(row("mtpspec" + " (compiled)" * args.compile, {k: 1e3 * x for k, x in zip(ks, t)}, ks))
        if args.hf:
            print(row("transformers", {k: 1e3 * x for k, x in hf_times(ks, args.cache, args.reps, args.layers).items()}, ks))
    else:
        base = "F32" if args.demo else "BF16"
        types = [base] + (["Q8_0", "Q4_0"] if args.requant else ["Q8_0", "Q4_K_M"])
        files = {base: gguf} | {q: gguf.with_name(f"{gguf.stem}-{q}.gguf") for q in types[1:]}
        for q, f in files.items():
            if not f.exists():
                subprocess.run([str(find_binary("llama-quantize")), str(gguf), str(f), q], capture_output=True, check=True)
        dtype = "fp32" if args.demo else "bf16"
        ours = {q: mtpspec.load(folder if q == base or args.requant else f, dtype=dtype, threads=args.threads,
                                quant={"Q8_0": "q8_0", "Q4_0": "q4_0"}.get(q) if args.requant else None) for q in types}
        theirs, mine = {q: [] for q in types}, {q: [] for q in types}
        for _ in range(args.rounds):
            for q in types:
                theirs[q].append(llama_bench(files[q], args.threads, [1], args.reps, args.cache)[1])
                mine[q].append(1e3 * time_forwards(ours[q].module, [1], args.cache, repeat=args.reps, q=0.5, min_repeat=args.reps)[0])
        print(f"T(1) ms over a {args.cache}-token cache, {args.threads} thread(s), median of {args.rounds} alternating rounds")
        print("| type | file MB | llama.cpp T(1) ms | ours T(1) ms | ours / llama.cpp |\n|---|---:|---:|---:|---:|")
        for q in types:
            a, b = statistics.median(theirs[q]), statistics.median(mine[q])
            print(f"| {q} | {files[q].stat().st_size / 1e6:.0f} | {a:.1f} | {b:.1f} | {b / a:.2f} |")


if __name__ == "__main__":
    main()

"""llama.cpp's Q8_0 / Q4_0 next to our int8 / int4 (mtpspec.quant) on the same weights: T(1) from llama-bench.

--gguf: llama-quantize's Q8_0 and Q4_K_M files themselves, loaded by mtpspec (their blocks kept, the block kernel),
against llama-bench on the same files: the same bytes on both sides.

The demo model is exported as an f32 GGUF (mtpspec.export_gguf); llama-quantize makes Q8_0 and Q4_0 from it;
llama-bench times token generation (-n, one token per forward) after a `--cache`-token context (-d), one
thread, alternating round by round with our T(1) of the same weights quantized by mtpspec.quant (fp32 / bf16
against F32 / BF16, int8 against Q8_0, int4 g64 against Q4_0). --big does the same for the Qwen3.5-0.8B-shaped random hybrid (bf16 GGUF).

    MTPSPEC_LLAMACPP_BIN_DIR=.../build/bin python scripts/quant_llamacpp.py [--big] [--reps 5] [--threads 1]
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
from pathlib import Path

import torch


def qwen35_08b(layers: int = 24):
    """Our hybrid with the Qwen3.5-0.8B text shape, random weights (seed 0), bf16, no MTP layer."""
    from mtpspec.loading.hf import build_empty, config_from_hf

    hf = dict(model_type="qwen3_5_text", vocab_size=248320, hidden_size=1024, intermediate_size=3584, num_hidden_layers=layers,
              num_attention_heads=8, num_key_value_heads=2, head_dim=256, linear_num_key_heads=16, linear_num_value_heads=16,
              linear_key_head_dim=128, linear_value_head_dim=128, linear_conv_kernel_dim=4, rms_norm_eps=1e-6,
              tie_word_embeddings=True, max_position_embeddings=262144,
              layer_types=[("full_attention" if (i + 1) % 4 == 0 else "linear_attention") for i in range(layers)],
              rope_parameters={"rope_type": "default", "rope_theta": 10_000_000.0, "partial_rotary_factor": 0.25})
    model = build_empty(config_from_hf(hf, "qwen3.5-0.8b-shaped", mtp_layers=0, max_seq_len=2048)[0], torch.bfloat16)
    g = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for name, p in model.named_parameters():  # matrices N(0, 0.02), zero-centred norms, A_log / dt_bias uniform
            p.copy_(torch.randn(p.shape, generator=g) * 0.02 if p.ndim > 1 else torch.zeros(p.shape) if "norm" in name
                    else torch.rand(p.shape, generator=g))
    return model


def t1_ms(bench: Path, gguf: Path, threads: int, reps: int, cache: int, n: int) -> float:
    out = subprocess.run([str(bench), "-m", str(gguf), "-t", str(threads), "-d", str(cache), "-r", str(reps), "-o", "json",
                          "-n", str(n), "-p", "0"], capture_output=True, text=True, check=True).stdout
    (t,) = [x for x in json.loads(out) if x["n_gen"] > 0]
    return statistics.median(t["samples_ns"]) / 1e6 / t["n_gen"]


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--big", action="store_true")
    ap.add_argument("--gguf", action="store_true", help="ours loads llama-quantize's Q8_0 / Q4_K_M files themselves")
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--cache", type=int, default=128)
    ap.add_argument("--out", default="build/quant_gguf")
    ap.add_argument("--rounds", type=int, default=3)
    args = ap.parse_args()
    import torch

    import mtpspec
    from mtpspec.bench.llamacpp import find_binary
    from mtpspec.export_gguf import export_gguf
    from mtpspec.loading import shipped_demo_dir

    bench, quantize_exe = find_binary("llama-bench"), find_binary("llama-quantize")
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    demo = mtpspec.load(shipped_demo_dir())
    todo = [("demo", demo.module, "f32", 64)]
    if args.big:
        todo.append(("qwen35-0.8b-shaped", qwen35_08b(), "bf16", 16))
    from mtpspec.bench.costmodel import time_forwards
    from mtpspec.quant import quantize

    print(f"T(1) ms: llama-bench (tg after a {args.cache}-token context) and ours (one-token forward over a {args.cache}-token "
          f"cache), {args.threads} thread(s), {args.rounds} alternating rounds (each llama-bench run: median of {args.reps})")
    print("| model | llama.cpp type | MB | llama.cpp T(1) ms | ours | ours T(1) ms | ours / llama.cpp |")
    print("|---|---|---|---|---|---|---|")
    import copy

    torch.set_num_threads(args.threads)
    for name, module, outtype, n in todo:
        base = out / f"{name}-{outtype}.gguf"
        if not base.exists():
            export_gguf(module, demo.tokenizer, base, outtype=outtype)
        pairs = [(outtype.upper(), base, outtype, module)]
        for q, kind in ((("Q8_0", "gguf"), ("Q4_K_M", "gguf")) if args.gguf else (("Q8_0", "int8"), ("Q4_0", "int4"))):
            f = out / f"{name}-{q}.gguf"
            if not f.exists():
                subprocess.run([str(quantize_exe), str(base), str(f), q], capture_output=True, check=True)
            if kind == "gguf":
                m = mtpspec.load(str(f)).module
            else:
                m = copy.deepcopy(module)
                quantize(m, kind, 64)
            pairs.append((q, f, kind, m))
        theirs = {q: [] for q, *_ in pairs}
        ours = {q: [] for q, *_ in pairs}
        for _ in range(args.rounds):
            for q, f, kind, m in pairs:
                theirs[q].append(t1_ms(bench, f, args.threads, args.reps, args.cache, n))
                ours[q].append(time_forwards(m, [1], args.cache, repeat=args.reps, q=0.5, min_repeat=args.reps)[0] * 1e3)
        for q, f, kind, m in pairs:
            a, b = statistics.median(theirs[q]), statistics.median(ours[q])
            print(f"| {name} | {q} | {f.stat().st_size / 1e6:.0f} | {a:.2f} | {kind} | {b:.2f} | {b / a:.1f}x |", flush=True)

if __name__ == "__main__":
    main()

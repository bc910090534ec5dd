"""llama.cpp's forward cost at the Qwen3.5-0.8B shape, on the tensors scripts/qwen35_forward_cost.py times.

The same random bf16 model (transformers' Qwen3_5ForCausalLM, seed 0, same config) is loaded into
ours by name and written as a bf16 GGUF (mtpspec.export_gguf; the demo's tokenizer, padded to the
248k vocabulary: llama-bench feeds random ids). llama-bench then measures, over a 256-token cache
(-d 256), T(1) from token generation (-n, one token per forward) and T(k), k > 1, from a k-token
prompt pass (-p k). Its prompt pass computes logits for the last position only, where a verify
needs all k: T(k) here leaves out k - 1 rows of the 248k-row head.

    python scripts/qwen35_llamacpp_cost.py --gguf build/qwen35_08b_bf16.gguf [--threads 1,2] [--ks 1,5,9] [--reps 5]
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
from pathlib import Path

import torch


def export(path: Path, layers: int) -> None:
    """The random model of qwen35_forward_cost.py as a bf16 GGUF (no MTP layer: llama-bench runs the trunk)."""
    from transformers import Qwen3_5ForCausalLM

    from mtpspec.api import load
    from mtpspec.export_gguf import export_gguf
    from mtpspec.loading import shipped_demo_dir
    from mtpspec.loading.hf import build_empty, config_from_hf, load_state_strict

    sys.path.insert(0, str(Path(__file__).parent))
    from qwen35_forward_cost import qwen35_08b_config

    torch.manual_seed(0)  # as qwen35_forward_cost.py: the same weights
    hf_cfg = qwen35_08b_config(layers)
    ref = Qwen3_5ForCausalLM(hf_cfg).to(torch.bfloat16).eval()
    cfg, _ = config_from_hf(hf_cfg.to_dict(), "qwen3.5-0.8b", mtp_layers=0, max_seq_len=2048)
    ours = build_empty(cfg, torch.bfloat16)
    load_state_strict(ours, [(k, (lambda v=v: v), tuple(v.shape)) for k, v in ref.state_dict().items()], "qwen3.5-0.8b", "Qwen3.5")
    path.parent.mkdir(parents=True, exist_ok=True)
    export_gguf(ours, load(shipped_demo_dir()).tokenizer, path, outtype="bf16")


def bench(exe: Path, gguf: Path, threads: int, ks: list[int], reps: int, cache: int) -> dict[int, float]:
    """k -> median ms per forward of k new tokens over `cache` cached tokens."""
    pp = [k for k in ks if k > 1]
    args = [str(exe), "-m", str(gguf), "-t", str(threads), "-d", str(cache), "-r", str(reps), "-o", "json", "-n", "16",
            "-p", ",".join(map(str, pp)) if pp else "0"]
    out = subprocess.run(args, capture_output=True, text=True, check=True).stdout
    res = {}
    for t in json.loads(out):
        ms = statistics.median(t["samples_ns"]) / 1e6
        if t["n_gen"] > 0:
            res[1] = ms / t["n_gen"]
        elif t["n_prompt"] > 0:
            res[t["n_prompt"]] = ms
    return res


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--gguf", default="build/qwen35_08b_bf16.gguf", help="written first when missing")
    ap.add_argument("--threads", default="1,2")
    ap.add_argument("--ks", default="1,5,9")
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--cache", type=int, default=256)
    ap.add_argument("--layers", type=int, default=24)
    args = ap.parse_args()
    from mtpspec.bench.llamacpp import find_binary

    exe = find_binary("llama-bench")
    gguf = Path(args.gguf)
    if not gguf.exists():
        export(gguf, args.layers)
    ks = [int(k) for k in args.ks.split(",")]
    print(f"llama-bench {exe}, {gguf.name}, cache {args.cache}, median of {args.reps}")
    print("| threads | " + " | ".join(f"T({k}) ms" for k in ks) + " | " + " | ".join(f"T({k})/T(1)" for k in ks[1:]) + " |")
    print("|---" * (1 + 2 * len(ks) - 1) + "|")
    for th in [int(t) for t in args.threads.split(",")]:
        r = bench(exe, gguf, th, ks, args.reps, args.cache)
        print(f"| {th} | " + " | ".join(f"{r[k]:.1f}" for k in ks) + " | " + " | ".join(f"{r[k] / r[1]:.2f}" for k in ks[1:]) + " |")


if __name__ == "__main__":
    main()

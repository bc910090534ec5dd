"""The small-row kernel (mtpspec/kernels) against torch's F.linear, weights streamed from memory as in a decode step.

For each (N, K) shape, enough distinct weights to fill --mb megabytes (more than the last-level cache, so every
product reads its weight from DRAM, as a model's step does) are multiplied in turn by an (M, K) input; the script
prints the effective weight bandwidth in GB/s and microseconds per product, median of --reps passes, the two
methods alternating pass by pass.

    .venv/bin/python scripts/kernel_bench.py [--dtype fp32|bf16] [--rows 1,2,3,5,9,16,64] [--mb 64] [--reps 7]
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch
import torch.nn.functional as F

from mtpspec import kernels


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--dtype", default="fp32", choices=["fp32", "bf16"])
    ap.add_argument("--rows", default="1,2,3,5,9,16,64")
    ap.add_argument("--shapes", default="640x256,256x640,4096x256,3584x1024,1024x3584")
    ap.add_argument("--mb", type=float, default=64.0)
    ap.add_argument("--reps", type=int, default=7)
    ap.add_argument("--threads", type=int, default=1)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    dtype = {"fp32": torch.float32, "bf16": torch.bfloat16}[args.dtype]
    assert kernels.available(), kernels._EXT.error
    print(f"{args.dtype}, {args.threads} thread(s), {args.mb:.0f} MB of weights per pass, median of {args.reps}")
    print("| N x K | rows | F.linear GB/s | kernel GB/s | F.linear us | kernel us | speedup |")
    print("|---|---:|---:|---:|---:|---:|---:|")
    for shape in args.shapes.split(","):
        n, k = (int(v) for v in shape.split("x"))
        count = max(2, int(args.mb * 1e6 / (n * k * dtype.itemsize)))
        weights = [torch.randn(n, k).to(dtype) for _ in range(count)]
        panels = [kernels.pack(w) for w in weights]
        for m in (int(r) for r in args.rows.split(",")):
            x = torch.randn(m, k).to(dtype)
            runs = {"torch": (lambda w: F.linear(x, w), weights), "kernel": (lambda p: kernels.packed_linear(x, p, n), panels)}
            times: dict[str, list[float]] = {name: [] for name in runs}
            with torch.inference_mode():
                for rep in range(args.reps + 1):
                    for name, (fn, items) in runs.items():
                        t0 = time.perf_counter()
                        for item in items:
                            fn(item)
                        if rep:  # the first pass warms up
                            times[name].append((time.perf_counter() - t0) / count)
            med = {name: statistics.median(v) for name, v in times.items()}
            gbs = {name: n * k * dtype.itemsize / s / 1e9 for name, s in med.items()}
            print(f"| {n} x {k} | {m} | {gbs['torch']:.1f} | {gbs['kernel']:.1f} | {med['torch'] * 1e6:.0f} | "
                  f"{med['kernel'] * 1e6:.0f} | {med['torch'] / med['kernel']:.2f}x |")


if __name__ == "__main__":
    main()

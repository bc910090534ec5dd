"""Time mtpspec.kernels.quantized.linear on Gemma 3 270M's Q4_K_M shapes at 1, 5 and 9 rows, 1 thread.

Each weight is random valid blocks of its type. Weights smaller than the last-level cache are cycled through enough
copies (>= 128 MB) that every call reads its weight from memory, as a decode step does. Rounds interleave shapes and
row counts; the median of the rounds is printed with the effective weight bandwidth (bytes read / time).

    .venv/bin/python scripts/gguf_kernel_speed.py [--rounds 7]
"""

from __future__ import annotations

import argparse
import statistics
import time

import numpy as np
import torch
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType as QT

from mtpspec.kernels import quantized as Q

SHAPES = [  # (qtype, N out, K in, where in Gemma 3 270M)
    (QT.Q8_0, 262144, 640, "token embedding / LM head"),
    (QT.Q5_0, 2048, 640, "ffn gate, up"),
    (QT.Q6_K, 640, 2048, "ffn down"),
    (QT.Q5_0, 1024, 640, "attn q"),
    (QT.Q4_K, 640, 1024, "attn output"),
]
SCALE_AT = {QT.Q8_0: (0,), QT.Q5_0: (0,), QT.Q4_K: (0, 2), QT.Q6_K: (208,)}
ROWS = (1, 5, 9)
CYCLE_BYTES = 128 << 20


def random_weight(qtype: QT, n: int, k: int, rng: np.random.Generator) -> Q.QuantizedWeight:
    bs, ts = GGML_QUANT_SIZES[qtype]
    blocks = rng.integers(0, 256, (n * k // bs, ts), dtype=np.uint8)
    for off in SCALE_AT[qtype]:
        blocks[:, off : off + 2] = np.array([0.01], np.float16).view(np.uint8)
    return Q.from_gguf(blocks, qtype, (n, k))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rounds", type=int, default=7)
    args = ap.parse_args()
    torch.set_num_threads(1)
    if not Q.available():
        raise SystemExit(f"the GGUF block kernel is not available: {Q._state.get('error')}")
    rng = np.random.default_rng(0)
    weights = []
    for qtype, n, k, _ in SHAPES:
        w = random_weight(qtype, n, k, rng)
        copies = [w] + [Q.QuantizedWeight(w.qtype, w.shape, w.data.clone(), w.layout) for _ in range(CYCLE_BYTES // w.nbytes)]
        weights.append(copies)
    xs = {(k, m): torch.randn(m, k) for _, _, k, _ in SHAPES for m in ROWS}
    times: dict[tuple[int, int], list[float]] = {}
    for _ in range(args.rounds + 1):  # the first round warms up
        for i, (_, _, k, _) in enumerate(SHAPES):
            for m in ROWS:
                x = xs[k, m]
                t0 = time.perf_counter()
                for w in weights[i]:
                    Q.linear(x, w)
                times.setdefault((i, m), []).append((time.perf_counter() - t0) / len(weights[i]))
    print(f"isa {Q.isa()}, 1 thread, median of {args.rounds} rounds, weights read from memory")
    print(f"{'type':5} {'N':>7} {'K':>5} {'MB':>7}  " + "  ".join(f"{'M=' + str(m) + ' ms':>9} {'GB/s':>5}" for m in ROWS) + "   M=5/M=1  M=9/M=1")
    for i, (qtype, n, k, what) in enumerate(SHAPES):
        nbytes = weights[i][0].nbytes
        med = {m: statistics.median(times[i, m][1:]) for m in ROWS}
        cells = "  ".join(f"{med[m] * 1e3:9.3f} {nbytes / med[m] / 1e9:5.1f}" for m in ROWS)
        print(f"{qtype.name:5} {n:7d} {k:5d} {nbytes / 1e6:7.2f}  {cells}   {med[5] / med[1]:7.2f}  {med[9] / med[1]:7.2f}   {what}")


if __name__ == "__main__":
    main()

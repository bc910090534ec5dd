"""Time the GGUF block kernel on Gemma 3 270M's Q4_K_M shapes, and the whole quantized model's step, at 1, 5, 9 rows.

Kernel mode (default): mtpspec.kernels.quantized.linear on each shape, random valid blocks of its type. Weights
smaller than the last-level cache are cycled through enough copies (>= 128 MB) that every call reads its weight from
memory, as a decode step does. Model mode (--model): `mtpspec.load("gemma3-270m").module.forward_tokens` of T tokens
at context --context, the cache cropped back after each call. Rounds interleave everything timed; medians of the
rounds are printed.

--baseline DIR times the kernels DIR/gguf_blocks.cpp and DIR/attention.cpp (an earlier version, same packed layout)
in the same rounds, built as separate torch libraries, and prints new / baseline ratios: on a shared, noisy machine
only ratios measured in one run compare.

    .venv/bin/python scripts/gguf_kernel_speed.py [--rounds 7] [--threads 1] [--model] [--baseline DIR]
"""

from __future__ import annotations

import argparse
import os
import statistics
import time
from pathlib import Path

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


def build_baseline(src: Path) -> dict[str, object]:
    """The kernels in `src` built as libraries mtpspec_gguf_base / mtpspec_attention_base: their linear and
    attend_rows ops."""
    from torch.utils.cpp_extension import load

    build = Path(os.environ.get("TMPDIR", "/tmp")) / f"mtpspec-baseline-{os.getuid()}"
    build.mkdir(parents=True, exist_ok=True)
    ops = {}
    for name, lib in (("gguf_blocks.cpp", "mtpspec_gguf"), ("attention.cpp", "mtpspec_attention")):
        text = (src / name).read_text().replace(f"TORCH_LIBRARY({lib},", f"TORCH_LIBRARY({lib}_base,")
        text = text.replace(f"TORCH_LIBRARY_IMPL({lib},", f"TORCH_LIBRARY_IMPL({lib}_base,")
        out = build / f"{lib}_base.cpp"
        if not out.exists() or out.read_text() != text:
            out.write_text(text)
        (build / lib).mkdir(exist_ok=True)
        load(name=f"{lib}_base", sources=[str(out)], build_directory=str(build / lib), is_python_module=False, verbose=False,
             extra_cflags=["-O3", "-march=native", "-fopenmp", "-ffp-contract=off"], extra_ldflags=["-fopenmp"])
    ops["linear"] = torch.ops.mtpspec_gguf_base.linear.default
    ops["attend_rows"] = torch.ops.mtpspec_attention_base.attend_rows
    return ops


class Kernels:
    """Switches the model's block products and attention between this tree's kernels and the baseline's."""

    def __init__(self, base: dict[str, object] | None):
        from mtpspec.kernels import attention as A

        self.A, self.base = A, base
        self.own = {"linear": Q._ops["linear"], "attend_rows": A.attend_rows}

    def use(self, which: str) -> None:
        if which == "new":
            Q._ops["linear"], self.A.attend_rows = self.own["linear"], self.own["attend_rows"]
            return
        op = self.base["attend_rows"]

        def attend_rows(q, k, v, seq, lo, hi, mask=None, scale=None):
            return op(q, k, v, seq, lo, hi, mask, q.shape[-1] ** -0.5 if scale is None else scale)

        Q._ops["linear"], self.A.attend_rows = self.base["linear"], attend_rows


def kernel_mode(args, base) -> None:
    rng = np.random.default_rng(0)
    weights = []
    for qtype, n, k, _ in SHAPES:
        w = random_weight(qtype, n, k, rng)
        copies = [w] + [Q.QuantizedWeight(w.qtype, w.shape, w.data.clone(), w.layout) for _ in range(CYCLE_BYTES // w.nbytes)]
        weights.append(copies)
    xs = {(k, m): torch.randn(m, k) for _, _, k, _ in SHAPES for m in ROWS}
    ops = {"new": Q._ops["linear"]} | ({"base": base["linear"]} if base else {})
    times: dict[tuple[str, int, int], list[float]] = {}
    for _ in range(args.rounds + 1):  # the first round warms up
        for i, (qtype, n, k, _) in enumerate(SHAPES):
            for m in ROWS:
                for which, op in ops.items():
                    x = xs[k, m]
                    t0 = time.perf_counter()
                    for w in weights[i]:
                        op(x, w.data, qtype.value, n)
                    times.setdefault((which, i, m), []).append((time.perf_counter() - t0) / len(weights[i]))
    print(f"isa {Q.isa()}, {args.threads} thread(s), median of {args.rounds} rounds, weights read from memory, "
          f"load average {os.getloadavg()[0]:.2f}")
    print(f"{'':4} {'type':5} {'N':>7} {'K':>5} {'MB':>7}  " + "  ".join(f"{'M=' + str(m) + ' ms':>9} {'GB/s':>5}" for m in ROWS)
          + "   M=5/M=1  M=9/M=1")
    for i, (qtype, n, k, what) in enumerate(SHAPES):
        nbytes = weights[i][0].nbytes
        med = {(wh, m): statistics.median(times[wh, i, m][1:]) for wh in ops for m in ROWS}
        for wh in ops:
            cells = "  ".join(f"{med[wh, m] * 1e3:9.3f} {nbytes / med[wh, m] / 1e9:5.1f}" for m in ROWS)
            print(f"{wh:4} {qtype.name:5} {n:7d} {k:5d} {nbytes / 1e6:7.2f}  {cells}   {med[wh, 5] / med[wh, 1]:7.2f}  "
                  f"{med[wh, 9] / med[wh, 1]:7.2f}   {what}")
        if base:
            print(f"{'':4} new / base: " + "  ".join(f"M={m} {med['new', m] / med['base', m]:.2f}" for m in ROWS))


def model_mode(args, base) -> None:
    import mtpspec

    model = mtpspec.load(args.name).module
    kern = Kernels(base)
    ids = torch.randint(0, 1000, (args.context,))
    cache = model.new_cache()
    with torch.inference_mode():
        model.forward_tokens(ids, cache, logits=False)
        times: dict[tuple[str, int], list[float]] = {}
        names = ["new"] + (["base"] if base else [])
        for _ in range(args.rounds + 1):
            for t in ROWS:
                for which in names:
                    kern.use(which)
                    toks = torch.randint(0, 1000, (t,))
                    t0 = time.perf_counter()
                    model.forward_tokens(toks, cache)
                    times.setdefault((which, t), []).append(time.perf_counter() - t0)
                    cache.crop(args.context)
        kern.use("new")
    print(f"{args.name} forward_tokens at context {args.context}, isa {Q.isa()}, {args.threads} thread(s), "
          f"median of {args.rounds} rounds, load average {os.getloadavg()[0]:.2f}")
    for which in names:
        med = {t: statistics.median(times[which, t][1:]) for t in ROWS}
        print(f"{which:4} " + "  ".join(f"T({t}) {med[t] * 1e3:7.2f} ms" for t in ROWS)
              + f"   T(5)/T(1) {med[5] / med[1]:.2f}  T(9)/T(1) {med[9] / med[1]:.2f}")
    if base:
        print("new / base: " + "  ".join(f"T({t}) {statistics.median(times['new', t][1:]) / statistics.median(times['base', t][1:]):.2f}"
                                         for t in ROWS))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rounds", type=int, default=7)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--model", action="store_true", help="time the whole model's step instead of the kernel alone")
    ap.add_argument("--name", default="gemma3-270m", help="model mode: what mtpspec.load loads")
    ap.add_argument("--context", type=int, default=128, help="model mode: cached positions before each timed step")
    ap.add_argument("--baseline", type=Path, help="a folder with an earlier gguf_blocks.cpp and attention.cpp to time beside")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    if not Q.available():
        raise SystemExit(f"the GGUF block kernel is not available: {Q._EXT.error}")
    base = build_baseline(args.baseline) if args.baseline else None
    model_mode(args, base) if args.model else kernel_mode(args, base)


if __name__ == "__main__":
    main()

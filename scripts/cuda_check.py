"""The device check: run on a machine with a CUDA GPU (and a CUDA build of torch) when one is lent; under 8 minutes.

    python scripts/cuda_check.py                    # on cuda: the lossless tests there, then plain vs MTP / EAGLE tok/s
    python scripts/cuda_check.py --device cpu --tests device --tokens 16    # the CPU smoke test of this script

1. Tests: `MTPSPEC_DEVICE=<device> pytest -k "lossless or device"` over tests/test_device.py (all of it: its CUDA tests
   run there), test_lossless.py and test_mtp_lossless.py: the default suite's losslessness with every model loaded on
   the device (--tests device: only test_device.py; none: no tests). The pytest run is cut at --test-seconds.
2. Throughput: per model (the demo, Gemma 3 270M when installed, stories260K with its shipped EAGLE / MTP heads),
   plain decoding and each drafter at batch 1 (the prompts one after another) and batch 8 (all together), greedy:
   tokens per second, the speedup over plain at that batch size, whether every sequence's tokens equal plain's there,
   and the mean accepted length. The card's name and torch's versions head the report.
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))  # this checkout's mtpspec, whatever is installed

import torch  # noqa: E402

import mtpspec  # noqa: E402
from mtpspec.device import name, resolve, synchronize  # noqa: E402
from mtpspec.prompts import tinystories_prompts  # noqa: E402

TESTS = {"lossless": ["tests/test_device.py", "tests/test_lossless.py", "tests/test_mtp_lossless.py"],
         "device": ["tests/test_device.py"], "none": []}
HEADS = ROOT / "models" / "heads"


def models(which: list[str]) -> list[tuple[str, dict, list[tuple[str, dict]]]]:
    """(label, load() arguments, [(method label, generate() drafter arguments)]) per model asked for and present."""
    from mtpspec.loading import assets_dir
    from mtpspec.loading.realmodels import gemma3_270m_available

    out = []
    if "demo" in which:
        out.append(("demo", {"path": "demo"}, [("mtp", {"drafter": "mtp"}), ("ngram", {"drafter": "ngram"})]))
    if "gemma3-270m" in which:
        if gemma3_270m_available():
            out.append(("gemma3-270m", {"path": "gemma3-270m"}, [("mtp (shipped head)", {"drafter": "mtp"}),
                                                                  ("ngram", {"drafter": "ngram"})]))
        else:
            print("gemma3-270m: not installed (the `real` extra), skipped")
    if "stories" in which:
        a = assets_dir() / "models"
        out.append(("stories260K", {"path": a / "stories260K.bin", "tokenizer": a / "tok512.bin"},
                    [("eagle (shipped head)", {"drafter": "eagle", "draft_model": str(HEADS / "stories260K-eagle")}),
                     ("mtp (shipped head)", {"drafter": "mtp", "draft_model": str(HEADS / "stories260K-mtp")})]))
    return out


def run_tests(device: str, which: str, seconds: int) -> bool:
    files = TESTS[which]
    if not files:
        return True
    cmd = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-k", "lossless or device", *files]
    print(f"$ MTPSPEC_DEVICE={device} {' '.join(cmd[2:])}", flush=True)
    t0 = time.perf_counter()
    try:
        r = subprocess.run(cmd, cwd=ROOT, env={**os.environ, "MTPSPEC_DEVICE": device}, capture_output=True, text=True,
                           timeout=seconds)
        tail, ok = (r.stdout + r.stderr).strip().splitlines()[-25:], r.returncode == 0
    except subprocess.TimeoutExpired as e:
        out = (e.stdout or b"").decode() if isinstance(e.stdout, bytes) else (e.stdout or "")
        tail, ok = out.strip().splitlines()[-25:] + [f"(cut at {seconds} s)"], False
    print("\n".join(tail))
    print(f"tests: {'passed' if ok else 'FAILED'} in {time.perf_counter() - t0:.0f} s\n", flush=True)
    return ok


def timed(device, run):
    synchronize(device)
    t0 = time.perf_counter()
    res = run()
    synchronize(device)
    return res, time.perf_counter() - t0


def bench_model(label: str, load_args: dict, methods, device, prompts: list[str], tokens: int, batch: int) -> bool:
    args = dict(load_args)
    t0 = time.perf_counter()
    model = mtpspec.load(args.pop("path"), device=device, **args)
    print(f"## {label}: loaded on {model.device} in {time.perf_counter() - t0:.1f} s", flush=True)
    alone = prompts[:4]
    together = (prompts * batch)[:batch]
    model.generate(alone[0], max_new_tokens=4)  # warm-up: the device's kernels and handles, the first allocations
    rows, lossless = [], True
    plain1 = plainb = None
    for method, kw in [("plain", {}), *methods]:
        kw = {**kw, "k": 3} if kw else kw
        try:
            model.generate(alone[0], max_new_tokens=4, **kw)  # the method's warm-up
            r1, s1 = timed(device, lambda: [model.generate(p, max_new_tokens=tokens, **kw) for p in alone])
            rb, sb = timed(device, lambda: model.generate_batch(together, max_new_tokens=tokens, **kw))
        except mtpspec.MtpspecError as e:
            print(f"{method}: not run ({e})")
            continue
        n1, nb = sum(len(r.tokens) for r in r1), sum(len(r.tokens) for r in rb)
        if plain1 is None:
            plain1, plainb = (n1 / s1, [r.tokens for r in r1]), (nb / sb, [r.tokens for r in rb])
        same1 = [r.tokens for r in r1] == plain1[1]
        sameb = [r.tokens for r in rb] == plainb[1]
        lossless &= same1 and sameb
        forwards = sum(r.stats.target_forwards for r in r1)
        rows.append((method, n1 / s1, n1 / s1 / plain1[0], same1, nb / sb, nb / sb / plainb[0], sameb, n1 / max(forwards, 1)))
    print(f"| method | B=1 tok/s | x plain | = plain | B={batch} tok/s | x plain | = plain | tokens / forward (B=1) |")
    print("|---|---:|---:|---|---:|---:|---|---:|")
    for m, t1, x1, e1, tb, xb, eb, acc in rows:
        print(f"| {m} | {t1:.1f} | {x1:.2f} | {'yes' if e1 else 'NO'} | {tb:.1f} | {xb:.2f} | {'yes' if eb else 'NO'} | {acc:.2f} |")
    print(flush=True)
    return lossless


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--device", default="cuda", help="cuda (default), cuda:N, or cpu for a smoke test of this script")
    p.add_argument("--tests", choices=sorted(TESTS), default="lossless", help="which pytest files run first (default lossless)")
    p.add_argument("--test-seconds", type=int, default=240, help="each pytest run is cut after this long (default 240)")
    p.add_argument("--models", default="demo,gemma3-270m,stories", help="comma-separated: demo, gemma3-270m, stories")
    p.add_argument("--tokens", type=int, default=64, help="new tokens per sequence (default 64)")
    p.add_argument("--batch", type=int, default=8, help="the batched run's size (default 8)")
    args = p.parse_args(argv)
    try:
        device = resolve(args.device)
    except mtpspec.MtpspecError as e:
        print(f"cuda_check: error: {e}", file=sys.stderr)
        return 2
    t0 = time.perf_counter()
    cuda = torch.version.cuda or "none"
    print(f"# mtpspec device check on {name(device)}: torch {torch.__version__}, CUDA {cuda}\n", flush=True)
    ok = run_tests(str(device), args.tests, args.test_seconds)
    prompts = tinystories_prompts(8)
    for label, load_args, methods in models([m.strip() for m in args.models.split(",") if m.strip()]):
        ok &= bench_model(label, load_args, methods, device, prompts, args.tokens, args.batch)
    print(f"# {'all lossless' if ok else 'SOMETHING FAILED OR DIFFERED (see above)'}; {time.perf_counter() - t0:.0f} s in all on "
          f"{name(device)}")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())

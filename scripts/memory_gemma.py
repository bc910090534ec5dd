"""What `mtpspec.load("gemma3-270m")` adds to a process's memory, against the GGUF file's size.

Run it in a fresh process each time (`python scripts/memory_gemma.py`, from the repository root): it measures RSS and
USS (private: pages no other process maps) after `import mtpspec` and again after the load, with glibc's free heap
handed back first (malloc_trim) so freed scratch does not count, then breaks the difference down: the weights' tensors
(GGUF blocks, norms), the rotary tables, the tokenizer (a second load of it alone, in a child process), and the rest.
`--steps` instead loads it piece by piece (parse, model, tokenizer), printing the memory and time of each step.
"""

from __future__ import annotations

import argparse
import ctypes
import gc
import json
import os
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))  # this checkout's mtpspec, not an installed one


def memory() -> tuple[float, float]:
    """(RSS, USS) in bytes after the heap's free pages are handed back."""
    import psutil

    gc.collect()
    try:
        ctypes.CDLL("libc.so.6").malloc_trim(0)
    except (OSError, AttributeError):
        pass
    info = psutil.Process().memory_full_info()
    return float(info.rss), float(info.uss)


def tensor_bytes(model) -> dict[str, int]:
    """Bytes of the model's distinct tensor storages: GGUF block weights, other parameters, rotary tables."""
    import torch

    from mtpspec.models import common

    rotaries = getattr(common, "rotaries", lambda m: [r for r in m.modules() if isinstance(r, common.Rotary)])
    seen: dict[int, tuple[str, int]] = {}

    def add(kind: str, t) -> None:
        if isinstance(t, torch.Tensor) and not t.is_meta:
            s = t.untyped_storage()
            seen.setdefault(s.data_ptr(), (kind, s.nbytes()))

    for r in rotaries(model):
        for t in (r.cos, r.sin, *(getattr(r, "fp64", None) or ())):
            add("rotary", t)
    for m in model.modules():
        q = getattr(m, "qweight", None)
        if q is not None:
            for t in (q.data, q.dense, q.panels):
                add("weights", t)
        for p in m.parameters(recurse=False):
            add("weights", p)
        for b in m.buffers(recurse=False):
            add("buffers", b)
    out: dict[str, int] = {}
    for kind, n in seen.values():
        out[kind] = out.get(kind, 0) + n
    return out


def tokenizer_alone(path: str) -> dict:
    """The tokenizer's cost, measured in a child process (its own baseline)."""
    out = subprocess.run([sys.executable, __file__, "--tokenizer-child", path], capture_output=True, text=True,
                         check=True).stdout
    return json.loads(out.strip().splitlines()[-1])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", action="store_true", help="parse, model and tokenizer one by one, with times")
    ap.add_argument("--tokenizer-child", metavar="PATH", help=argparse.SUPPRESS)
    args = ap.parse_args()

    import mtpspec  # the baseline holds torch and mtpspec imported
    from mtpspec.loading.realmodels import gemma3_270m_path

    path = str(gemma3_270m_path())
    file_size = os.path.getsize(path)
    if args.tokenizer_child:
        from mtpspec.loading.gguf import read_gguf
        from mtpspec.loading.tokenizer_gguf import load_gguf_tokenizer

        rss0, uss0 = memory()
        f = read_gguf(args.tokenizer_child)  # its metadata (the vocabulary) freed below
        tok = load_gguf_tokenizer(f)
        del f
        rss1, uss1 = memory()
        print(json.dumps({"rss": rss1 - rss0, "uss": uss1 - uss0, "vocab": tok.vocab_size, "kind": type(tok).__name__}))
        return

    x = lambda b: f"{b / 1e6:7.1f} MB  {b / file_size:5.2f}x"  # noqa: E731
    rss0, uss0 = memory()
    print(f"mtpspec {mtpspec.__file__}\nfile    {path}: {file_size:,} bytes")
    print(f"baseline (torch + mtpspec imported): RSS {rss0 / 1e6:.1f} MB, USS {uss0 / 1e6:.1f} MB")
    if args.steps:
        from mtpspec.loading.gguf import read_gguf
        from mtpspec.loading.gguf_model import load_gguf_model
        from mtpspec.loading.tokenizer_gguf import load_gguf_tokenizer

        t0, c0 = time.perf_counter(), time.process_time()
        f = read_gguf(path)
        t1 = time.perf_counter()
        model = load_gguf_model(f)
        t2, c2 = time.perf_counter(), time.process_time()
        rss_m, uss_m = memory()
        t3, c3 = time.perf_counter(), time.process_time()
        tok = load_gguf_tokenizer(f)
        t4, c4 = time.perf_counter(), time.process_time()
        rss_t, uss_t = memory()
        del f
        rss_e, uss_e = memory()
        print(f"parse {t1 - t0:.2f} s, model {t2 - t1:.2f} s, tokenizer {t4 - t3:.2f} s "
              f"(CPU time: {c2 - c0:.2f} s + {c4 - c3:.2f} s)")
        print(f"after the model (file mapped):     RSS +{x(rss_m - rss0)}, USS +{x(uss_m - uss0)}")
        print(f"after the tokenizer (file mapped): RSS +{x(rss_t - rss0)}, USS +{x(uss_t - uss0)}")
        print(f"file unmapped, metadata freed:     RSS +{x(rss_e - rss0)}, USS +{x(uss_e - uss0)}  "
              f"({type(model).__name__}, {type(tok).__name__} of {tok.vocab_size:,} tokens)")
        return

    t0, c0 = time.perf_counter(), time.process_time()
    loaded = mtpspec.load("gemma3-270m")
    seconds, cpu = time.perf_counter() - t0, time.process_time() - c0
    rss1, uss1 = memory()
    parts = tensor_bytes(loaded.module)
    tok = tokenizer_alone(path)
    print(f"load: {seconds:.2f} s ({cpu:.2f} s of CPU time)")
    print(f"held after load:  RSS +{x(rss1 - rss0)}   USS (private) +{x(uss1 - uss0)}")
    print(f"  weights         {x(parts.get('weights', 0))}  (GGUF blocks re-laid for the kernel, norms)")
    print(f"  rotary tables   {x(parts.get('rotary', 0))}  (positions reached so far)")
    if parts.get("buffers"):
        print(f"  other buffers   {x(parts['buffers'])}")
    print(f"  tokenizer       {x(tok['rss'])}  (alone, in a child process: {tok['kind']}, {tok['vocab']:,} tokens)")
    rest = rss1 - rss0 - sum(parts.values()) - tok["rss"]
    print(f"  the rest        {x(rest)}  (Python objects, allocator slack, code pages)")


if __name__ == "__main__":
    main()

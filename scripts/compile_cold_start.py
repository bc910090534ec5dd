"""--compile's cold start on the demo model: plain, MTP at D = 3, then --k auto, each over the same held-out Python
prompts, in one process with an empty compile cache; per method the seconds of its first pass (compilation included)
and of a second one, the graphs built, and whether every output equals eager plain greedy.

    .venv/bin/python scripts/compile_cold_start.py [PROMPTS=4] [TOKENS=128]
"""

from __future__ import annotations

import os
import sys
import tempfile
import time

os.environ["MTPSPEC_COMPILE_CACHE"] = tempfile.mkdtemp(prefix="mtpspec-cold-")  # before mtpspec reads it

import mtpspec  # noqa: E402
from mtpspec.train.data import code_prompts, stdlib_files  # noqa: E402


def main() -> None:
    n = int(sys.argv[1]) if len(sys.argv) > 1 else 4
    tokens = int(sys.argv[2]) if len(sys.argv) > 2 else 128
    eager = mtpspec.load("demo", threads=1)
    prompts = [eager.encode(t) for t in code_prompts(stdlib_files()[1], n)]
    want = [eager.generate(p, drafter="none", max_new_tokens=tokens).tokens for p in prompts]
    model = mtpspec.load("demo", threads=1, compile=True)
    steps = (model.module.compiled_step, model.module.mtp.compiled_step)
    t0 = time.perf_counter()
    for name, kw in (("plain", {"drafter": "none"}), ("mtp@3", {"drafter": "mtp", "k": 3}), ("mtp@auto", {"drafter": "mtp", "k": "auto"})):
        for p in ("first", "second"):
            t, graphs = time.perf_counter(), sum(s.stats.graphs for s in steps)
            same = all(model.generate(ids, max_new_tokens=tokens, **kw).tokens == w for ids, w in zip(prompts, want))
            print(f"{name:9s} {p:6s} pass {time.perf_counter() - t:6.1f} s, {sum(s.stats.graphs for s in steps) - graphs:2d} "
                  f"graphs built, outputs {'= eager plain' if same else 'DIFFER from eager plain'}; "
                  f"{time.perf_counter() - t0:6.1f} s since the compiled model loaded", flush=True)


if __name__ == "__main__":
    main()

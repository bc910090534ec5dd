"""Setting the loaded heap aside from Python's garbage collector while timed or served work runs."""

from __future__ import annotations

import gc
from contextlib import contextmanager
from typing import Iterator


@contextmanager
def frozen_heap() -> Iterator[None]:
    """Everything alive now (the models; torch's and transformers' modules: ~300k objects with the demo) set aside
    from the garbage collector for the block. A full collection that walks it takes 0.15-0.3 s and lands inside one
    step: of a timed run, most often the method that allocates most (in `bench --batch` all 5 such pauses seen in 2
    runs hit `--k auto`, the depth policy's bookkeeping, each 7% of its round at B = 8; frozen, a full collection took
    38 ms, not 196), or of a served request's token latency."""
    gc.collect()
    gc.freeze()
    try:
        yield
    finally:
        gc.unfreeze()

"""Setting the loaded heap aside from Python's garbage collector while timed or served work runs."""

from __future__ import annotations

import gc
from contextlib import contextmanager
from typing import Iterator


@contextmanager
def frozen_heap() -> Iterator[None]:
    """Everything alive now (the models; torch's and transformers' modules: hundreds of thousands of objects) set
    aside from the garbage collector for the block. A full collection that walks them lands inside one step, of a
    timed run (most often the method that allocates most) or of a served request's token latency
    (docs/decisions.md#frozen-heap)."""
    gc.collect()
    gc.freeze()
    try:
        yield
    finally:
        gc.unfreeze()

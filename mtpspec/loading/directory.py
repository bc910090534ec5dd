"""Directory checkpoints: Hugging Face (config.json + safetensors + tokenizer) and the project's own (mtpspec.json)."""

from __future__ import annotations

from pathlib import Path

import torch

from ..errors import ModelLoadError


def load_directory(path: Path, tokenizer, dtype: torch.dtype, with_tokenizer: bool = True):
    """Return (model, tokenizer or None) for a directory checkpoint."""
    path = Path(path)
    if (path / "mtpspec.json").exists():
        from .native import load_native

        return load_native(path, tokenizer, dtype, with_tokenizer)
    if (path / "config.json").exists():
        from .hf import load_hf_model
        from .tokenizer_hf import load_hf_tokenizer

        model = load_hf_model(path, dtype)
        if not with_tokenizer:
            return model, None
        return model, load_hf_tokenizer(path, tokenizer)
    try:
        hint = _hint(path)
    except OSError:
        hint = ""
    raise ModelLoadError(f"{path}: not a checkpoint directory (no config.json or mtpspec.json){hint}")


def _hint(path: Path) -> str:
    """Why a directory without config.json / mtpspec.json is not a model, when its files say."""
    if (path / "head.json").exists():
        return "; it is a drafter head: pass it as --draft-model, with its target as --model"
    if any(path.glob("*.safetensors")):
        return "; it has .safetensors files but a Hugging Face checkpoint also needs its config.json"
    if any(path.glob("pytorch_model*.bin")):
        return "; PyTorch pickle checkpoints are not supported (use safetensors)"
    subdirs = sorted(p.name for p in path.iterdir() if p.is_dir() and ((p / "config.json").exists() or (p / "mtpspec.json").exists()))
    if subdirs:
        return f"; did you mean {path / subdirs[0]}?"
    bins = sorted(p.name for p in path.glob("*.bin"))
    if bins:
        return f"; for a llama2.c checkpoint pass the file itself ({path / bins[0]})"
    return ""

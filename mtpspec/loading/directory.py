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
    raise ModelLoadError(f"{path}: not a checkpoint directory (no config.json or mtpspec.json)")

"""Directory checkpoints: Hugging Face (config.json + safetensors + tokenizer) and the project's own."""

from __future__ import annotations

from pathlib import Path

import torch

from ..errors import ModelLoadError


def load_directory(path: Path, tokenizer, dtype: torch.dtype, with_tokenizer: bool = True):
    raise ModelLoadError(f"{path}: directory checkpoints are not supported yet")

"""Prompt sets from the assets folder (real text made by others, never downloaded at run time)."""

from __future__ import annotations

from pathlib import Path

from .errors import ConfigError
from .loading import assets_dir


def tinystories_prompts(n: int = 20, words: int = 12, path: str | Path | None = None) -> list[str]:
    """The opening `words` words of the first n stories of the TinyStories validation prefix.

    Stories are paragraphs that open a story ("Once upon a time", "One day"); the file's first
    paragraph is the tail of a story cut mid-way and is skipped.
    """
    path = Path(path) if path else assets_dir() / "prompts" / "tinystories_val_prefix.txt"
    if not path.exists():
        raise ConfigError(f"prompt file not found: {path}")
    paragraphs = [p.strip() for p in path.read_text(encoding="utf-8").split("\n\n") if p.strip()]
    openers = [p for p in paragraphs[1:] if p.startswith(("Once upon a time", "One day"))]
    return [" ".join(p.split()[:words]) for p in openers[:n]]

"""The Python standard library's source as text (no download): whole modules held out (HELDOUT) for the demo, the
bench and evaluation; the rest trains the demo model (train/data.py).
"""

from __future__ import annotations

import random
import sysconfig
from pathlib import Path

SKIP_DIRS = {"test", "tests", "idle_test", "site-packages", "__pycache__", "lib2to3", "turtledemo"}
HELDOUT = ("json", "csv.py", "textwrap.py", "pprint.py", "fractions.py", "calendar.py", "ftplib.py", "statistics.py")


def stdlib_dir() -> Path:
    return Path(sysconfig.get_paths()["stdlib"])


def stdlib_files(root: Path | None = None, heldout: tuple[str, ...] = HELDOUT) -> tuple[list[Path], list[Path]]:
    """(train, held-out) .py files of the stdlib; held-out = top-level names in `heldout`. Sorted, so stable."""
    root = root or stdlib_dir()
    train, held = [], []
    for f in sorted(root.rglob("*.py")):
        rel = f.relative_to(root)
        if any(p in SKIP_DIRS for p in rel.parts):
            continue
        (held if rel.parts[0] in heldout else train).append(f)
    return train, held


def read_texts(files: list[Path]) -> list[str]:
    out = []
    for f in files:
        try:
            out.append(f.read_text(encoding="utf-8"))
        except (UnicodeDecodeError, OSError):
            continue
    return out


def code_prompts(files: list[Path], n: int, n_lines: int = 12, seed: int = 0) -> list[str]:
    """n prompts from held-out files: a function or class header with the lines before it (<= n_lines)."""
    rng = random.Random(seed)
    cands = []
    for f in files:
        try:
            lines = f.read_text(encoding="utf-8").splitlines()
        except (UnicodeDecodeError, OSError):
            continue
        for i, ln in enumerate(lines):
            if ln.lstrip().startswith(("def ", "class ")) and i >= 2:
                cands.append("\n".join(lines[max(0, i - n_lines + 1) : i + 1]) + "\n")
    rng.shuffle(cands)
    return cands[:n]

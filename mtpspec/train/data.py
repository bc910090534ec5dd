"""Training data: the Python standard library's own source, a byte-level BPE tokenizer, token windows.

The stdlib is on every machine that runs Python, so the demo model's data needs no download. Whole
modules are held out (HELDOUT) for evaluation and for the demo's prompts; the training stream never
sees them.
"""

from __future__ import annotations

import sysconfig
from pathlib import Path

import torch
from torch import Tensor

EOT = "<|endoftext|>"  # separates files; also the BOS every prompt starts with and the stop token
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


def train_tokenizer(texts: list[str], vocab_size: int):
    """A byte-level BPE (GPT-2 style) trained with `tokenizers`; EOT is id 0 and is added as BOS."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers

    from ..loading.tokenizer_hf import HFTokenizer

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size, special_tokens=[EOT], initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(texts, trainer)
    tok.post_processor = processors.TemplateProcessing(single=f"{EOT} $A", special_tokens=[(EOT, 0)])
    return HFTokenizer(tok, stop_ids=(0,))


def encode_stream(tokenizer, texts: list[str]) -> Tensor:
    """All texts as one int32 stream, each file preceded by EOT: (N,)."""
    ids: list[int] = []
    for enc in tokenizer.tokenizer.encode_batch(texts, add_special_tokens=True):
        ids += enc.ids
    return torch.tensor(ids, dtype=torch.int32)


def random_windows(stream: Tensor, batch: int, length: int, gen: torch.Generator) -> Tensor:
    """(batch, length) int64 windows at random offsets of the stream."""
    starts = torch.randint(0, stream.shape[0] - length, (batch,), generator=gen)
    return torch.stack([stream[s : s + length] for s in starts.tolist()]).long()


def eval_windows(stream: Tensor, length: int, n: int) -> Tensor:
    """(n', length) fixed, non-overlapping windows spread over the stream (the same every evaluation)."""
    total = stream.shape[0] // length
    step = max(1, total // n)
    return torch.stack([stream[i * length : (i + 1) * length] for i in range(0, total, step)][:n]).long()


def code_prompts(files: list[Path], n: int, n_lines: int = 12, seed: int = 0) -> list[str]:
    """n prompts from held-out files: a function or class header with the lines before it (<= n_lines)."""
    import random

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

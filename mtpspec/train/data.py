"""Training data: the Python standard library's own source, a byte-level BPE tokenizer, token windows.

The stdlib is on every machine with Python: no download. Whole modules are held out (HELDOUT) for evaluation and
the demo's prompts.
"""

from __future__ import annotations

import torch
from torch import Tensor

# the stdlib text lives in core (the demo and the bench read it too)
from ..stdlib_text import HELDOUT, code_prompts, read_texts, stdlib_files  # noqa: F401

EOT = "<|endoftext|>"  # separates files; also the BOS every prompt starts with and the stop token


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

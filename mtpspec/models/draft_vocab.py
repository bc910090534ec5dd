"""A reduced draft vocabulary: the drafter's LM head over the N most frequent tokens only.

On a small model the LM head (V x H) is the largest matrix an MTP draft step reads, so it is most of
what a draft costs. Restricting the drafter's head to the tokens that make up most of the text
(FR-Spec, Zhao et al. 2025; EAGLE-3's draft vocabulary) cuts that cost by V / N, while the tokens a
drafter gets right are overwhelmingly frequent ones. Verification still uses the target's full head,
so the output stays lossless:

- greedy: the draft is the argmax over the subset; a token outside it simply cannot be drafted.
- sampling: q is the drafter's distribution renormalised over the subset (zero elsewhere), and the
  draft is sampled from exactly that q, so rejection sampling stays exact.

The ranking comes with the checkpoint as `draft_vocab.json` (written by `mtpspec train pretrain`
from the token counts of its training data):

    {"ranked_ids": [most frequent id, ...], "counts": [...], "default_size": N, "source": "..."}
"""

from __future__ import annotations

import json
import weakref
from dataclasses import dataclass
from pathlib import Path

import torch
from torch import Tensor

from .. import kernels
from ..kernels import quantized
from ..device import of as device_of
from ..errors import ConfigError, ModelLoadError
from ..weight_cache import weights_version
from .blocks import holds_blocks

FILE = "draft_vocab.json"
DEFAULT_COVERAGE = 0.9  # default_size: the fewest tokens (a multiple of 256) covering 90% of the training text


@dataclass(frozen=True)
class TokenRanking:
    """Token ids by training frequency (most frequent first) and the recommended subset size."""

    ranked_ids: Tensor  # (V,) int64
    default_size: int

    def top(self, n: int) -> Tensor:
        return self.ranked_ids[:n]


def ranking_from_counts(counts: Tensor, coverage: float = DEFAULT_COVERAGE) -> tuple[Tensor, int]:
    """counts (V,) token counts -> (ranked ids (V,), default size: the fewest multiple of 256 covering `coverage`)."""
    order = torch.argsort(counts, descending=True, stable=True)  # (V,)
    cum = counts[order].double().cumsum(0) / max(float(counts.sum()), 1.0)
    n = int((cum < coverage).sum()) + 1
    size = min(-(-n // 256) * 256, counts.shape[0])
    return order, size


def write_draft_vocab(directory: str | Path, stream: Tensor, vocab_size: int, source: str) -> Path:
    """Count the token ids of `stream` (a training corpus) and write draft_vocab.json into `directory`."""
    counts = torch.bincount(stream.flatten(), minlength=vocab_size)[:vocab_size]  # (V,)
    order, size = ranking_from_counts(counts)
    return write_ranking(directory, TokenRanking(order, size), counts[order].tolist(), f"{source} ({int(counts.sum())} tokens)")


def write_ranking(directory: str | Path, ranking: TokenRanking, counts: list[int] | None = None, source: str = "") -> Path:
    path = Path(directory) / FILE
    meta = {"ranked_ids": ranking.ranked_ids.tolist(), "default_size": ranking.default_size}
    if counts is not None:
        meta["counts"] = counts
    if source:
        meta["source"] = source
    path.write_text(json.dumps(meta) + "\n")
    return path


def read_draft_vocab(directory: Path, vocab_size: int) -> TokenRanking | None:
    """The checkpoint's ranking, or None when it has no draft_vocab.json."""
    path = Path(directory) / FILE
    if not path.exists():
        return None
    try:
        meta = json.loads(path.read_text())
        ids = torch.tensor(meta["ranked_ids"], dtype=torch.long)
        size = int(meta["default_size"])
    except (ValueError, KeyError, TypeError) as e:
        raise ModelLoadError(f"{path}: not a draft vocabulary file ({e})") from None
    if ids.ndim != 1 or ids.numel() == 0 or int(ids.min()) < 0 or int(ids.max()) >= vocab_size:
        raise ModelLoadError(f"{path}: ranked_ids must be token ids below the vocabulary size {vocab_size}")
    return TokenRanking(ids, max(1, min(size, ids.numel())))


class SubsetHead:
    """Logits over a subset `ids` (N,) of a V-token vocabulary, what MTPDrafter drafts through: `logits` (the
    subclass's) over the subset, their token ids, and the full-vocabulary logits (-inf outside)."""

    def __init__(self, ids: Tensor, vocab_size: int) -> None:
        self.ids, self.vocab_size = ids, vocab_size

    def token(self, sub_index: Tensor) -> Tensor:
        return self.ids[sub_index]

    def full(self, sub_logits: Tensor) -> Tensor:
        """(T, N) -> (T, V): -inf outside the subset, so any sampling transform of it is supported there only."""
        out = sub_logits.new_full((*sub_logits.shape[:-1], self.vocab_size), float("-inf"))
        out[..., self.ids] = sub_logits
        return out


class DraftHead(SubsetHead):
    """The target's LM head restricted to `ids`: logits over the subset, mapped back to token ids.

    Its rows are copied once: for the small-row kernel (fp32 / bf16 heads), or, from a head kept in GGUF blocks, as
    Q8_0 blocks on the block kernel (bit for bit a Q8_0 head's rows; other block types re-quantized): a draft step
    reads a quarter of the bytes of fp32 rows. Only what is drafted changes; verification reads the target's head."""

    def __init__(self, lm_head, ids: Tensor) -> None:
        super().__init__(ids.to(device_of(lm_head)), lm_head.out_features)  # ids beside the LM head (mtpspec.device)
        rows = lm_head.rows(ids)  # (N, H) in the model's dtype (blocks: dequantized)
        self.blocks = quantized.q8_0(rows) if holds_blocks(lm_head) and rows.device.type == "cpu" and quantized.available() else None
        self.product = None if self.blocks is not None else kernels.Product(rows)

    def logits(self, h: Tensor) -> Tensor:
        """h (T, H) -> (T, N) float32 logits over the subset."""
        if self.blocks is not None:
            return quantized.linear(h.float(), self.blocks)
        return self.product(h, widen=True).float()


def make_draft_head(target, size: int | None) -> DraftHead | None:
    """The draft head for `target`: size None = the checkpoint's default (full vocabulary when it has
    no draft_vocab.json), 0 or >= V = the full vocabulary, else the `size` most frequent tokens."""
    ranking: TokenRanking | None = getattr(target, "token_ranking", None)
    if size is not None and size < 0:
        raise ConfigError(f"--draft-vocab must be >= 0 (0 = the full vocabulary), got {size}")
    if size is None:
        size = ranking.default_size if ranking is not None else 0
    if size == 0 or size >= target.vocab_size:
        return None
    if ranking is None:
        raise ConfigError(
            f"--draft-vocab {size} needs the model's token ranking ({FILE} next to the checkpoint, written by "
            "`mtpspec train pretrain`); this model has none"
        )
    lm_head = target.lm_head
    key = (size, weights_version(lm_head.parameters()), id(ranking))
    cached = _HEADS.setdefault(lm_head, {})  # built once per LM head, size, weights version and ranking
    if key not in cached:
        cached.clear()
        cached[key] = DraftHead(lm_head, ranking.top(size))
    return cached[key]


_HEADS: "weakref.WeakKeyDictionary" = weakref.WeakKeyDictionary()  # LM head -> {key: its DraftHead}: drafters share it

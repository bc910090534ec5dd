"""Prefix reuse: the KV of finished sequences, kept for later prompts that start with the same tokens.

A chat client sends the whole conversation again each turn; an agent repeats one long system prompt. A new
prompt's longest common prefix with a kept context is copied into its cache and only the rest is prefilled.

Only where the copy is bitwise what a prefill would have written: a model whose every operation computes a row
exactly as its one-row step does (`config.row_kernels`: a dense model loaded from a GGUF file), so a position's keys and
values do not depend on how the prompt was split or on which step wrote them; a plain KVCache (no recurrent state,
no sparse-attention index); and a sequence that reads nothing else from the prefill (no drafter that takes the
prompt's logits, hidden states or layer inputs: the MTP, EAGLE and Medusa heads, lookahead's Jacobi guesses; no prompt
log-probs). There, a reused prompt's text is the one a fresh prefill gives, token for token.
"""

from __future__ import annotations

from collections import OrderedDict

import torch
from torch import Tensor

from .cache import KVCache
from .errors import ConfigError

MIN_REUSE = 16  # positions below which a copy is not worth looking for


def keeps_rows(target) -> bool:
    """Whether `target` computes every row as its one-row step does (the condition for reuse)."""
    return bool(getattr(getattr(target, "config", None), "row_kernels", False))


def plain_kv(cache) -> bool:
    return type(cache) is KVCache and cache.index is None and cache.sparse is None


class PrefixStore:
    """Kept contexts (token ids) with copies of their keys and values, least recently used dropped first, at most
    `budget` positions in all. One per engine; used by its thread only."""

    def __init__(self, budget: int) -> None:
        if not isinstance(budget, int) or isinstance(budget, bool) or budget < 1:
            raise ConfigError(f"a prefix store holds an integer >= 1 of positions, got {budget!r}")
        self.budget = budget
        # id -> (tokens (n,), keys, values (L, 1, n_kv, n, hd) each: exactly the kept positions)
        self.entries: OrderedDict[int, tuple[Tensor, Tensor, Tensor]] = OrderedDict()
        self.positions = 0
        self.next_id = 0

    def keep(self, tokens: Tensor, cache) -> None:
        """Keep the committed positions of `cache` (a finishing sequence's; tokens: its context); an entry that is a
        prefix of it is dropped (this one serves every prompt it served)."""
        if not plain_kv(cache):
            return
        n = min(cache.length, tokens.shape[0])
        if n < MIN_REUSE or n > self.budget:
            return
        tokens = tokens[:n].clone()
        for key, (t, _, _) in list(self.entries.items()):
            if t.shape[0] <= n and torch.equal(t, tokens[: t.shape[0]]):
                self._drop(key)
        self.entries[self.next_id] = (tokens, cache.k[:, :, :, :n].clone(), cache.v[:, :, :, :n].clone())
        self.next_id += 1
        self.positions += n
        while self.positions > self.budget:
            self._drop(next(iter(self.entries)))

    def reuse(self, prompt: Tensor, cache) -> int:
        """Copy the longest kept prefix of prompt[:-1] (the part a prefill computes) into `cache`, a new sequence's
        empty cache; returns the positions copied (0: none of at least MIN_REUSE)."""
        if not plain_kv(cache) or cache.length:
            return 0
        want = prompt.shape[0] - 1
        best, key = 0, None
        for k, (t, _, _) in self.entries.items():
            m = min(t.shape[0], want)
            same = t[:m] == prompt[:m]
            p = m if bool(same.all()) else int(same.int().argmin())
            if p > best:
                best, key = p, k
        if best < MIN_REUSE:
            return 0
        _, keys, values = self.entries[key]
        cache.k[:, :, :, :best] = keys[:, :, :, :best]
        cache.v[:, :, :, :best] = values[:, :, :, :best]
        cache.advance(best)
        self.entries.move_to_end(key)
        return best

    def _drop(self, key: int) -> None:
        tokens, _, _ = self.entries.pop(key)
        self.positions -= tokens.shape[0]

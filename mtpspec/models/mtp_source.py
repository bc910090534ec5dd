"""The interface the MTP drafter reads from its source (MTPSource), kept with the models that implement it (below
the drafters that read it)."""

from __future__ import annotations

from typing import Protocol, runtime_checkable

from torch import Tensor, nn

from ..cache import KVCache


@runtime_checkable
class MTPConfig(Protocol):
    mtp_num_layers: int  # decoder layers of the MTP module (the drafter supports 1)


@runtime_checkable
class MTPSource(Protocol):
    """What the MTP drafter (drafters/mtp.py) reads: a target with its own MTP module (HybridLM), or
    a trained MTP / EAGLE / EAGLE-3 head attached to a frozen target (models.heads.AttachedHead, Eagle3Head).

    The module reads pairs (h_i, e(t_{i+1})), the target's post-final-norm hidden state at i and the
    embedding of the token after it, and returns a hidden state (T, H) for the target's LM head.
    Besides the members below, the drafter reads `token_ranking` (a models.draft_vocab.TokenRanking,
    or None / absent when the checkpoint has no draft vocabulary) through getattr, and from an EAGLE-3 head
    `pair_hidden(out)` (its pairs' hidden states from a target forward's layer inputs, in place of out.hidden), `taps`
    (the target layers whose inputs pair_hidden reads: the drafter's own `taps`) and `own_head` (its own
    draft-vocabulary LM head, in place of the target's).
    """

    mtp: nn.Module | None  # forward(hidden (T, H), emb (T, H), cache, start, layer) -> (T, H); None = the model has none
    config: MTPConfig
    vocab_size: int  # V of the target's LM head
    lm_head: nn.Linear  # the target's LM head (weight (V, H)): a draft vocabulary restricts its rows

    def new_mtp_cache(self) -> KVCache:
        """An empty KV cache for the MTP module's own positions (one entry per pair)."""

    def embed(self, tokens: Tensor) -> Tensor:
        """tokens (T,) -> (T, H) the target's input embeddings."""

    def head(self, hidden: Tensor) -> Tensor:
        """hidden (T, H) -> (T, V) logits through the target's LM head (at least float32)."""

    def mtp_forward(self, hidden: Tensor, tokens: Tensor, cache: KVCache, layer: int = 0, tree=None,
                    sparse: str = "recompute") -> Tensor:
        """The MTP module over pairs (hidden (T, H), tokens (T,)) at cache.length.. (a token tree's rows: `tree`; a
        block-sparse module's selection: `sparse`) -> (T, H); advances the cache by T."""

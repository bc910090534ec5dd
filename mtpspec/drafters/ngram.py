"""Prompt lookup (n-gram) drafting: find the last n tokens earlier in the context, propose what followed.

The n-grams are indexed as tokens arrive (each position is indexed once), so a proposal is a few
dictionary lookups whatever the context length. The most recent earlier occurrence wins; longer
n is tried first. No probabilities: the verifier treats the draft as a point mass. With `tree`
(a node budget) the continuations of several earlier occurrences (most recent first, longest n
first) are merged into a token tree (tree.py) instead.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

from ..errors import ConfigError
from ..sampling import Sampler
from ..tree import observe_step, tree_budget
from ..types import Draft, TargetOutput, Verdict
from .base import DrafterOptions, option


@dataclass(frozen=True)
class NgramOptions(DrafterOptions):
    n_min: int = option("ngram_min", "--ngram-min", 1)  # shortest suffix looked up
    n_max: int = option("ngram_max", "--ngram-max", 3)  # longest suffix looked up (tried first)
    tree: int | str | None = option("tree", "--tree", None)  # a node budget: merge several continuations into a tree

    def __post_init__(self) -> None:
        super().__post_init__()
        if not 1 <= self.n_min <= self.n_max:
            raise ConfigError(f"n-gram range must satisfy 1 <= n_min <= n_max, got {self.n_min}..{self.n_max}")


class NgramDrafter:
    name = "ngram"
    prefill_logits = False  # it never reads the target's logits over the prompt
    prefill_hidden = False  # nor its hidden states
    taps = ()  # nor any layer's inputs

    def __init__(self, n_min: int = 1, n_max: int = 3, tree: int | None = None) -> None:
        from ..tree import TreeChoice, TreeSizer, check_tree_budget

        NgramOptions(n_min, n_max)  # checked: integers, 1 <= n_min <= n_max
        self.n_min, self.n_max, self.tree = n_min, n_max, check_tree_budget(tree)
        self.sizer = TreeChoice(TreeSizer()) if tree == "auto" else None  # --tree auto (its own: no model to share one on)
        self.tokens: list[int] = []  # mirror of the context, appended to, never rescanned
        self.index: dict[tuple[int, ...], int] = {}  # n-gram -> position of the token that followed it (the latest)
        self.earlier: dict[tuple[int, ...], list[int]] = {}  # with a tree: n-gram -> every such position
        self.indexed = 0  # positions j < indexed have had their preceding n-grams registered

    def prefill(self, context: Tensor, out: TargetOutput | None, sampler: Sampler) -> None:
        self.tokens, self.index, self.earlier, self.indexed = [], {}, {}, 0

    def _catch_up(self, context: Tensor) -> None:
        toks = self.tokens
        if len(context) > len(toks):
            toks.extend(context[len(toks) :].tolist())
        for j in range(max(self.indexed, 1), len(toks)):  # token j exists: register the n-grams before it
            for n in range(self.n_min, min(self.n_max, j) + 1):
                key = tuple(toks[j - n : j])
                self.index[key] = j
                if self.tree is not None:  # (a tree of any budget, or "auto")
                    self.earlier.setdefault(key, []).append(j)
        self.indexed = max(self.indexed, len(toks))

    def propose(self, context: Tensor, k: int) -> Draft:
        self._catch_up(context)
        budget = tree_budget(self.tree, self.sizer)
        if budget is not None:
            return self._tree(k, budget)
        toks, end = self.tokens, len(self.tokens)
        for n in range(min(self.n_max, end), self.n_min - 1, -1):  # longest match first
            j = self.index.get(tuple(toks[end - n :]))
            if j is not None:
                return Draft(tokens=torch.tensor(toks[j : j + k], dtype=torch.long))
        return Draft.empty()

    def _tree(self, k: int, budget: int) -> Draft:
        """Continuations of earlier occurrences of the suffix (longest n first, most recent first) merged into a
        trie of at most `budget` nodes, each continuation up to k tokens."""
        toks, end = self.tokens, len(self.tokens)
        children: dict[tuple[int, int], int] = {}  # (parent node, token) -> node
        tokens, parents, seen = [], [], set()
        for n in range(min(self.n_max, end), self.n_min - 1, -1):
            for j in reversed(self.earlier.get(tuple(toks[end - n :]), ())):
                if j in seen:
                    continue
                seen.add(j)
                node = -1
                for t in toks[j : j + k]:
                    if (node, t) not in children:
                        if len(tokens) >= budget:
                            break
                        children[(node, t)] = len(tokens)
                        tokens.append(t)
                        parents.append(node)
                    node = children[(node, t)]
                if len(tokens) >= budget:
                    break
            if len(tokens) >= budget:
                break
        if not tokens:
            return Draft.empty()
        return Draft(tokens=torch.tensor(tokens, dtype=torch.long), parents=torch.tensor(parents, dtype=torch.long))

    def commit(self, verdict: Verdict, out: TargetOutput) -> None:
        observe_step(self.sizer, verdict)

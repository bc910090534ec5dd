"""Suffix lookup (after SuffixDecoding, Oliaro et al. 2024): a suffix trie over the prompt and the
output so far (and, optionally, over the outputs of earlier sequences), proposing the continuation
of the longest matching suffix that occurred most often. No draft model, no probabilities.

The trie holds every substring of up to `depth` tokens of the text fed to it, each node counting
how often its substring occurred. Feeding a token is O(depth): a cursor keeps the nodes of the text's
last depth-1 suffixes, and each grows by the new token. A proposal:

1. match: the longest suffix of the context (up to depth-1 tokens) that the trie holds with a
   continuation, i.e. that occurred before and was followed by something;
2. walk down from it, each time to the child seen most often (then most recently), up to k tokens;
   at the trie's depth the walk matches again from the extended context, so a chain can run past it.

With a shared SuffixPool (`suffix_shared`, or SuffixDrafter(pool=...)), every sequence also feeds its
output to one trie that lives as long as the target model, and the longer of the two matches (the
sequence's own trie on a tie) proposes; SuffixDecoding's global tree over earlier outputs. The pool
forgets everything at `SuffixPool.max_tokens` and starts again. Drafts never change what is emitted
(the verifier treats them as point masses), but a shared pool makes one request's speed depend on
another's text: leave it off where that matters.
"""

from __future__ import annotations

import weakref
from dataclasses import dataclass

import torch
from torch import Tensor

from ..errors import ConfigError
from ..sampling import Sampler
from ..types import Draft, TargetOutput, Verdict
from .base import DrafterOptions, option


@dataclass(frozen=True)
class SuffixOptions(DrafterOptions):
    depth: int = option("suffix_depth", "--suffix-depth", 24)  # longest substring held (matched: up to depth-1 tokens)
    shared: bool = option("suffix_shared", "--suffix-shared", False)  # also match the outputs of earlier sequences (one pool per target)

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.depth < 2:
            raise ConfigError(f"--suffix-depth must be >= 2 (a matched suffix of at least one token and its continuation), got {self.depth}")


class Node:
    """One substring: how often it occurred, when last, and the substrings one token longer."""

    __slots__ = ("children", "count", "stamp")

    def __init__(self) -> None:
        self.children: dict[int, Node] = {}
        self.count = 0
        self.stamp = 0


class SuffixTrie:
    def __init__(self, depth: int) -> None:
        self.depth = depth
        self.root = Node()
        self.stamp = 0  # tokens fed so far
        self.size = 0  # nodes

    def feed(self, cursor: list[Node], tokens: list[int]) -> list[Node]:
        """Append `tokens` to the text whose suffix nodes are `cursor` (cursor[i]: the last i+1 tokens); returns the new cursor."""
        for t in tokens:
            self.stamp += 1
            grown = []
            for node in [self.root] + cursor[: self.depth - 1]:
                child = node.children.get(t)
                if child is None:
                    child = node.children[t] = Node()
                    self.size += 1
                child.count += 1
                child.stamp = self.stamp
                grown.append(child)
            cursor = grown
        return cursor

    def match(self, tokens: list[int]) -> tuple[int, Node | None]:
        """(m, node): the longest suffix of `tokens` (m <= depth-1) held with a continuation; (0, None) if none.

        Binary search over m: every substring of a held substring is held, with the same continuations
        among its own, so "the last m tokens are held with a continuation" is true up to some m and false above."""
        lo, hi, found = 0, min(self.depth - 1, len(tokens)), None  # the answer is in lo..hi; lo holds (or is 0)
        while lo < hi:
            m = (lo + hi + 1) // 2
            node = self._find(tokens[len(tokens) - m :])
            if node is not None and node.children:
                lo, found = m, node
            else:
                hi = m - 1
        return (lo, found) if found is not None else (0, None)

    def _find(self, key: list[int]) -> Node | None:
        node = self.root
        for t in key:
            node = node.children.get(t)
            if node is None:
                return None
        return node

    @staticmethod
    def walk(node: Node, k: int) -> list[int]:
        """Up to k tokens down from `node`, each time to the child seen most often, then most recently."""
        out = []
        while len(out) < k and node.children:
            t, node = max(node.children.items(), key=lambda kv: (kv[1].count, kv[1].stamp))
            out.append(t)
        return out


class SuffixPool:
    """A trie over the outputs of many sequences (one drafter each), shared for the target's lifetime."""

    def __init__(self, depth: int = 24, max_tokens: int = 1 << 18) -> None:
        self.depth, self.max_tokens = depth, max_tokens
        self.trie = SuffixTrie(depth)
        self.generation = 0  # bumped when the pool forgets: cursors into the old trie are dropped

    def feed(self, cursor: list[Node], generation: int, tokens: list[int]) -> tuple[list[Node], int]:
        if self.trie.stamp + len(tokens) > self.max_tokens:
            self.trie, self.generation = SuffixTrie(self.depth), self.generation + 1
        if generation != self.generation:
            cursor = []
        return self.trie.feed(cursor, tokens), self.generation


_POOLS: "weakref.WeakKeyDictionary[object, dict[int, SuffixPool]]" = weakref.WeakKeyDictionary()


def shared_pool(target, depth: int) -> SuffixPool:
    """The pool of `target` for tries of this depth (created on first use, dropped with the target)."""
    pools = _POOLS.setdefault(target, {})
    if depth not in pools:
        pools[depth] = SuffixPool(depth)
    return pools[depth]


class SuffixDrafter:
    name = "suffix"
    prefill_logits = False  # it never reads the target's logits over the prompt
    prefill_hidden = False  # nor its hidden states
    taps = ()  # nor any layer's inputs

    def __init__(self, depth: int = 24, pool: SuffixPool | None = None) -> None:
        SuffixOptions(depth)  # checked: an integer >= 2
        if pool is not None and pool.depth != depth:
            raise ConfigError(f"the shared suffix pool holds depth {pool.depth}, the drafter was asked for {depth}")
        self.depth, self.pool = depth, pool
        self._reset()

    def _reset(self) -> None:
        self.trie = SuffixTrie(self.depth)  # this sequence: prompt and output
        self.cursor: list[Node] = []
        self.tokens: list[int] = []  # mirror of the committed context
        self.pool_cursor: list[Node] = []
        self.pool_generation = -1

    def prefill(self, context: Tensor, out: TargetOutput | None, sampler: Sampler) -> None:
        self._reset()
        self._extend(context.tolist(), output=False)

    def _extend(self, new: list[int], output: bool) -> None:
        self.tokens += new
        self.cursor = self.trie.feed(self.cursor, new)
        if output and self.pool is not None:
            self.pool_cursor, self.pool_generation = self.pool.feed(self.pool_cursor, self.pool_generation, new)

    def propose(self, context: Tensor, k: int) -> Draft:
        if len(context) > len(self.tokens):  # catch up (commit mirrors every kept token, so normally none)
            self._extend(context[len(self.tokens) :].tolist(), output=True)
        seq = self.tokens[max(len(self.tokens) - (self.depth - 1), 0) :]  # all a match reads, then the chain
        draft: list[int] = []
        while len(draft) < k:
            m, node = self.trie.match(seq)
            if self.pool is not None:
                pm, pnode = self.pool.trie.match(seq)
                if pm > m:
                    m, node = pm, pnode
            if node is None:
                break
            more = SuffixTrie.walk(node, k - len(draft))
            draft += more
            seq += more
        return Draft(tokens=torch.tensor(draft, dtype=torch.long))

    def commit(self, verdict: Verdict, out: TargetOutput) -> None:
        self._extend(verdict.tokens.tolist(), output=True)

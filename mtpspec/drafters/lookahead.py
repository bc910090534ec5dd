"""Lookahead decoding (Fu et al. 2024) on this engine's verify pass: an n-gram pool fed by the context
and by the target's own guesses past the accepted prefix, proposed as a chain. No draft model.

The paper's lookahead and verification branches share the D draft positions of this engine's
forward [last, d1..dD] (docs/trees.md, "Lookahead decoding in this engine"):

- **Pool.** For every key of 1..n-1 tokens, the tokens seen after it, with how often and how
  recently: the context's own n-grams (prompt and output) and the target's guesses, in one table.
- **Free Jacobi guesses.** Each verify pass gives the target's argmax y_j at every row j. Rows past
  the recovered token (j > n) were computed after a rejected draft token d_{n+1}: the target's
  continuation of a guessed prefix, exactly what one Jacobi iteration computes. Each gives an n-gram
  (.., d_j) -> y_j for the pool, and y_{n+1}..y_D, shifted, are the next step's Jacobi guesses for
  the positions after the recovered token. The target's prefill adds its guesses over the prompt
  the same way (rows where its argmax differs from the prompt's next token).
- **Proposal.** Token by token, up to k: the longest key that is a suffix of context + draft so far
  wins, then its most frequent continuation, then the most recent; where the pool knows no key,
  the Jacobi guess for that position.

No probabilities (q = None): the verifier treats the chain as a point mass, so greedy output equals
plain greedy and sampled output keeps the target's distribution (verify.py), whatever the pool holds.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

from ..errors import ConfigError
from ..sampling import Sampler
from ..types import Draft, TargetOutput, Verdict
from .base import DrafterOptions, option


@dataclass(frozen=True)
class LookaheadOptions(DrafterOptions):
    n: int = option("lookahead_n", "--lookahead-n", 5)  # n-gram size N: keys of 1..N-1 tokens
    jacobi: bool = option("lookahead_jacobi", "--lookahead-jacobi", True)  # feed the target's guesses (off: context n-grams only)

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.n < 2:
            raise ConfigError(f"--lookahead-n must be >= 2 (an n-gram is a key of n-1 tokens and its next token), got {self.n}")


class NgramPool:
    """key (1..n-1 tokens) -> its continuations, each with a count and the stamp of its latest sighting.

    `best[key]` caches the continuation that ranks first (most frequent, then most recent), so a
    lookup is one dictionary get per key length, however many continuations a key has."""

    def __init__(self, n: int) -> None:
        self.n = n
        self.seen: dict[tuple[int, ...], dict[int, list[int]]] = {}  # key -> next -> [count, stamp]
        self.best: dict[tuple[int, ...], int] = {}  # key -> its first-ranked next token
        self.stamp = 0

    def add(self, tokens: list[int], end: int, nxt: int) -> None:
        """Record that `nxt` followed tokens[:end] (every key that is a suffix of it)."""
        self.stamp += 1
        for m in range(1, min(self.n - 1, end) + 1):
            key = tuple(tokens[end - m : end])
            nexts = self.seen.setdefault(key, {})
            c = nexts.setdefault(nxt, [0, 0])
            c[0] += 1
            c[1] = self.stamp
            b = self.best.get(key)
            if b is None or c[0] >= nexts[b][0]:  # this sighting is the newest: it wins ties
                self.best[key] = nxt

    def lookup(self, tokens: list[int], m: int) -> int | None:
        """The first-ranked continuation of the last m tokens, or None."""
        return self.best.get(tuple(tokens[len(tokens) - m :]))


class LookaheadDrafter:
    name = "lookahead"
    taps = ()  # it reads no layer's inputs
    prefill_hidden = False  # nor the hidden states

    def __init__(self, n: int = 5, jacobi: bool = True) -> None:
        LookaheadOptions(n, jacobi)  # checked: integers, n >= 2
        self.n, self.jacobi = n, jacobi
        self.prefill_logits = jacobi  # the Jacobi pool starts from the target's guesses over the prompt
        self._reset()

    def _reset(self) -> None:
        self.tokens: list[int] = []  # mirror of the committed context
        self.pool = NgramPool(self.n)  # n-grams of the context and of the target's guesses
        self.tail: list[int] = []  # Jacobi guesses for draft positions 1, 2, .. of the next step
        self.draft: list[int] = []  # the chain proposed this step

    def prefill(self, context: Tensor, out: TargetOutput | None, sampler: Sampler) -> None:
        self._reset()
        self._extend(context.tolist())
        if self.jacobi and out is not None:  # row i of the prefill predicts context[i + 1]
            guess = out.logits.argmax(-1).tolist()  # (L-1,)
            for i, g in enumerate(guess):
                if g != self.tokens[i + 1]:
                    self.pool.add(self.tokens, i + 1, g)

    def _extend(self, new: list[int]) -> None:
        toks = self.tokens
        for t in new:
            toks.append(t)
            if len(toks) > 1:
                self.pool.add(toks, len(toks) - 1, t)

    def propose(self, context: Tensor, k: int) -> Draft:
        if len(context) > len(self.tokens):  # catch up (commit mirrors every kept token, so normally none)
            self._extend(context[len(self.tokens) :].tolist())
        seq = self.tokens[max(len(self.tokens) - (self.n - 1), 0) :]  # the context's last n-1 tokens (all a key reads), then the chain
        draft: list[int] = []
        while len(draft) < k:
            t = self._next(seq)
            if t is None and len(draft) < len(self.tail):
                t = self.tail[len(draft)]  # the Jacobi guess for this position
            if t is None:
                break
            draft.append(t)
            seq.append(t)
        self.draft = draft
        return Draft(tokens=torch.tensor(draft, dtype=torch.long))

    def _next(self, seq: list[int]) -> int | None:
        for m in range(min(self.n - 1, len(seq)), 0, -1):  # longest key first
            t = self.pool.lookup(seq, m)
            if t is not None:
                return t
        return None

    def commit(self, verdict: Verdict, out: TargetOutput) -> None:
        n, d = verdict.num_accepted, verdict.num_drafted
        draft = self.draft[:d] if d else []
        self.draft = []
        if self.jacobi and n < d:  # rows n+1..D followed a rejected draft token: free Jacobi guesses
            y = out.logits[n + 1 : d + 1].argmax(-1).tolist()  # (D-n,) the target's guess after d_{n+1}..d_D
            hypo = self.tokens[max(len(self.tokens) - (self.n - 1), 0) :] + draft  # the context's end (`last` last), then the chain
            base = len(hypo) - len(draft)  # where d_1 sits in hypo
            for j, g in zip(range(n + 1, d + 1), y):
                self.pool.add(hypo, base + j, g)  # (.., d_j) -> y_j
            self.tail = y
        else:
            self.tail = []
        self._extend(verdict.tokens.tolist())

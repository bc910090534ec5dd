"""The values that flow through one decoding step, named once and used everywhere.

Vocabulary (one meaning each, in every file of the project):

- **draft** tokens d1..dD: what a drafter guesses after the last committed token.
- **accepted** tokens: the longest prefix of the draft that verification keeps.
- the **recovered** token: emitted at the first rejected position, argmax of p (greedy) or a sample
  from the residual norm(max(p - q, 0)) (sampling).
- the **bonus** token: emitted from p at position D+1 when all D drafts were accepted.
- p is always the target's distribution, q the drafter's.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field

import torch
from torch import Tensor


@dataclass(frozen=True)
class Draft:
    """A drafter's guess for the next D tokens."""

    tokens: Tensor  # (D,) int64, D may be 0 (nothing to propose: a plain step)
    q: Tensor | None = None  # (D, V) float probabilities the tokens were sampled from; None = point mass
    parents: Tensor | None = None  # (D,) int64: a token tree (tree.py), node i's parent (-1 = the root); None = a chain

    @property
    def size(self) -> int:
        return int(self.tokens.shape[0])

    @property
    def is_tree(self) -> bool:
        return self.parents is not None

    @staticmethod
    def empty() -> "Draft":
        return Draft(tokens=torch.empty(0, dtype=torch.long))

    def first(self, n: int) -> "Draft":
        """Its first n tokens: a chain's prefix, or a tree's first n nodes (a node comes after its parent, so they are a
        tree)."""
        if self.size <= n:
            return self
        cut = slice(0, max(n, 0))
        return Draft(self.tokens[cut], None if self.q is None else self.q[cut], None if self.parents is None else self.parents[cut])


@dataclass(frozen=True)
class Verdict:
    """What verification kept: num_accepted draft tokens plus one recovered or bonus token."""

    num_accepted: int  # n in 0..D
    tokens: Tensor  # (n + 1,) int64: d1..dn then the recovered (n < D) or bonus (n == D) token
    num_drafted: int  # D
    path: tuple[int, ...] | None = None  # a tree draft: the verify-window rows of the n accepted nodes (tree.py)

    @property
    def bonus(self) -> bool:
        return self.num_accepted == self.num_drafted


@dataclass(frozen=True)
class TargetOutput:
    """One target forward over T new positions."""

    logits: Tensor | None  # (T, V) float32, next-token logits at each position (None: a prefill asked for none)
    hidden: Tensor  # (T, H) last hidden state after the final norm (what MTP / EAGLE heads read)
    prenorm_hidden: Tensor | None = None  # (T, H) before the final norm, for heads trained on it
    # layer id -> (T, H) the residual stream entering that decoder layer, for the layers the forward was asked to tap
    # (forward_tokens(..., taps): an EAGLE-3 drafter's features); None when it taps none
    layer_inputs: dict[int, Tensor] | None = None

    def rows(self, rows: list[int]) -> "TargetOutput":
        """The output at these rows only (a tree's accepted path)."""
        idx = torch.tensor(rows, dtype=torch.long, device=self.hidden.device)
        return TargetOutput(None if self.logits is None else self.logits[idx], self.hidden[idx],
                            None if self.prenorm_hidden is None else self.prenorm_hidden[idx],
                            None if self.layer_inputs is None else {i: x[idx] for i, x in self.layer_inputs.items()})

    @staticmethod
    def cat(outs: list["TargetOutput"]) -> "TargetOutput":
        """Forwards over consecutive positions (prefill chunks, one-position passes) as one output."""
        if len(outs) == 1:
            return outs[0]
        pre, logits, taps = [o.prenorm_hidden for o in outs], [o.logits for o in outs], [o.layer_inputs for o in outs]
        return TargetOutput(logits=None if any(x is None for x in logits) else torch.cat(logits), hidden=torch.cat([o.hidden for o in outs]),
                            prenorm_hidden=None if any(p is None for p in pre) else torch.cat(pre),
                            layer_inputs=None if any(t is None for t in taps) else {i: torch.cat([t[i] for t in taps]) for i in taps[0]})


@dataclass(frozen=True)
class StepRecord:
    """One draft -> verify -> accept round, as measured (feeds traces and the live verify page)."""

    draft: list[int]  # the D drafted token ids
    num_accepted: int  # how many of them survived
    emitted: list[int]  # tokens actually appended (accepted + recovered/bonus, cut at EOS / limit)
    draft_seconds: float  # drafter propose + commit
    verify_seconds: float  # target forward + acceptance rule
    # the rest filled only with trace=True; p = softmax(logits) when greedy, else the sampling distribution
    p_of_emitted: list[float] = field(default_factory=list)  # target probability of each emitted token
    start_seconds: float = 0.0  # when the step began, seconds since generation started (prefill included)
    p_of_draft: list[float] = field(default_factory=list)  # (D,) target probability of each draft token
    target_choice: list[int] = field(default_factory=list)  # (D+1,) argmax of p at every verified position
    draft_parents: list[int] | None = None  # a token tree: each drafted node's parent (-1 = after the last token)
    path: list[int] | None = None  # a token tree: the accepted nodes, in order (indices into draft)


@dataclass(frozen=True)
class SeqStep:
    """One sequence's part of an engine step (what a depth policy learns from)."""

    seq: int  # the sequence's id in the engine
    drafted: int  # D_i, 0 = a plain step for this sequence
    accepted: int  # n_i in 0..D_i
    draft_seconds: float  # its drafter's propose + commit (a batched propose is shared out by drafted tokens)
    batched: bool = False  # drafted in one batched propose with other sequences (MTP, EAGLE: one module forward per position)


@dataclass(frozen=True)
class BatchStep:
    """One engine step over the running batch: one target forward over `rows` new positions."""

    rows: int  # positions in the target forward: sum over sequences of D_i + 1 (before padding)
    width: int  # the forward's width: max D_i + 1 (rows are padded to batch x width when batched)
    forward_seconds: float  # the target forward + verification + rollback of every sequence
    overhead_seconds: float  # the step's wall time minus drafting and forward: the engine's own work
    seqs: tuple[SeqStep, ...]


@dataclass(frozen=True)
class GenerationStats:
    """Counters of one generation, named as the serving engines report them."""

    target_forwards: int  # decode-time target forwards (one per step; prefill not counted)
    draft_tokens: int  # total drafted tokens
    accepted_tokens: int  # total accepted draft tokens
    mean_accepted_length: float  # tokens per target forward = 1 + accepted / forwards
    acceptance_by_position: list[float]  # P(draft i accepted | drafts < i accepted), i = 1..Dmax
    wall_seconds: float  # prefill + decode
    tokens_per_second: float  # new tokens / wall_seconds
    prefill_seconds: float
    draft_seconds: float
    verify_seconds: float
    overhead_seconds: float  # wall - prefill - draft - verify: the engine's own work
    cached_tokens: int = 0  # prompt positions whose KV was copied from a kept prefix, not prefilled

    def to_json(self) -> dict:
        return asdict(self)


@dataclass(frozen=True)
class GenerationResult:
    """What generate() returns."""

    tokens: list[int]  # new tokens only (never past a stop token or max_new_tokens)
    prompt_tokens: list[int]
    text: str
    finish_reason: str  # "stop" (stop token), "length" (max_new_tokens) or "context" (model context full)
    stats: GenerationStats
    steps: list[StepRecord] = field(default_factory=list)

    def to_json(self) -> dict:
        return {
            "text": self.text,
            "tokens": self.tokens,
            "prompt_tokens": self.prompt_tokens,
            "finish_reason": self.finish_reason,
            "stats": self.stats.to_json(),
        }

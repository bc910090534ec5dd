"""A drafter whose draft is given: the verify page's typed draft (or another drafter's proposal) through
the engine's real step, with the verify pass kept so the page can show the target's whole distribution."""

from __future__ import annotations

import torch
from torch import Tensor

from ..sampling import Sampler
from ..types import Draft, TargetOutput, Verdict
from .base import Drafter


class FixedDrafter:
    """Proposes `tokens` (at most k of them) at its first step and nothing after (later steps are plain);
    with `inner` instead, proposes what that drafter does (told everything it is told).

    `verified` is the last verify pass over [last, d1..dD] (its logits (D+1, V)): the target's full
    distribution at every checked position, which a StepRecord summarises only as p_of_draft and target_choice."""

    name = "fixed"

    def __init__(self, tokens: list[int] | None = None, inner: Drafter | None = None) -> None:
        if (tokens is None) == (inner is None):
            raise ValueError("FixedDrafter takes the draft's tokens or an inner drafter, not both or neither")
        self.tokens = torch.tensor(tokens if tokens is not None else [], dtype=torch.long)  # (D,)
        self.inner = inner
        self.verified: TargetOutput | None = None

    @property
    def prefill_logits(self) -> bool:
        return self.inner is not None and self.inner.prefill_logits

    @property
    def prefill_hidden(self) -> bool:
        return self.inner is not None and self.inner.prefill_hidden

    @property
    def taps(self) -> tuple[int, ...]:
        return self.inner.taps if self.inner is not None else ()

    def prefill(self, context: Tensor, out: TargetOutput | None, sampler: Sampler) -> None:
        if self.inner is not None:
            self.inner.prefill(context, out, sampler)

    def propose(self, context: Tensor, k: int) -> Draft:
        if self.inner is not None:
            return self.inner.propose(context, k)
        draft, self.tokens = Draft(tokens=self.tokens[:k]), self.tokens[:0]  # used once
        return draft

    def commit(self, verdict: Verdict, out: TargetOutput) -> None:
        self.verified = out
        if self.inner is not None:
            self.inner.commit(verdict, out)

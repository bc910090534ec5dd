"""The interface every drafter satisfies, so all of them share one lossless verify path.

A drafter sees the committed context (prompt + emitted tokens; the last one is not yet in the
target's cache), proposes up to k tokens after it, and is told what verification kept.
Drafters that read the target (MTP, Medusa, EAGLE) use the TargetOutput of prefill and of each
verify pass: logits and post-final-norm hidden states at every forwarded position.
"""

from __future__ import annotations

from typing import Protocol

from torch import Tensor

from ..sampling import Sampler
from ..types import Draft, TargetOutput, Verdict


class Drafter(Protocol):
    name: str

    def prefill(self, context: Tensor, out: TargetOutput | None, sampler: Sampler) -> None:
        """context (L,) the prompt; out: the target's prefill over context[:-1] (None if L == 1)."""

    def propose(self, context: Tensor, k: int) -> Draft:
        """context (L,) all committed tokens -> up to k draft tokens after context[-1] (k >= 1)."""

    def commit(self, verdict: Verdict, out: TargetOutput) -> None:
        """Verification kept verdict.tokens; out is the verify pass over [last, d1..dD]."""


class NoDrafter:
    """Plain decoding: no draft, every step is a one-token target forward."""

    name = "none"

    def prefill(self, context: Tensor, out: TargetOutput | None, sampler: Sampler) -> None:
        pass

    def propose(self, context: Tensor, k: int) -> Draft:
        return Draft.empty()

    def commit(self, verdict: Verdict, out: TargetOutput) -> None:
        pass

"""The interfaces of drafting: what every drafter does, what a batch-capable drafter adds, and how a
drafter's options are declared and checked (what the MTP drafter reads from its source: models/mtp_source.py).

A drafter sees the committed context (prompt + emitted tokens; the last one is not yet in the
target's cache), proposes up to k tokens after it, and is told what verification kept.
Drafters that read the target (MTP, Medusa, EAGLE) use the TargetOutput of prefill and of each
verify pass: logits and post-final-norm hidden states at every forwarded position (a prefill's logits only
for a drafter whose `prefill_logits` is True: the LM head over a long prompt costs seconds and gigabytes).
"""

from __future__ import annotations

import typing
from dataclasses import dataclass, field, fields
from typing import Any, Protocol, Self, runtime_checkable

from torch import Tensor

from ..errors import ConfigError
from ..sampling import Sampler
from ..types import Draft, TargetOutput, Verdict


@runtime_checkable
class Drafter(Protocol):
    """One drafter instance per sequence: it holds that sequence's drafting state (an n-gram index,
    an MTP cache, the last hidden state), so a batch of B sequences has B drafters.

    The engine's calls, in order, for one sequence:

    1. prefill(context, out, sampler) once, after the target's prefill over context[:-1];
    2. per step: propose(context, d) when the step drafts (d >= 1; a step the depth policy gives
       d = 0 calls nothing), then one verify pass over [context[-1], d1..dD], then
       commit(verdict, out) after every verify pass, drafted or not (verdict.num_drafted = 0 then).

    A drafter may return fewer than d tokens (even none: the step is then a plain step). It never
    reads the target's cache: everything it learns of the target comes through `out`.
    """

    name: str  # the registry name (--drafter)
    # whether prefill's `out` must carry the target's logits over the prompt (lookahead's Jacobi guesses read them);
    # when False, out.logits is None and the target skips its LM head over the prompt's rows
    prefill_logits: bool
    # whether prefill's `out.hidden` (the target's hidden states over the prompt) is read (the MTP, EAGLE and Medusa
    # heads): such a sequence's prompt is prefilled whole, never started from a kept prefix's copy (mtpspec.prefix)
    prefill_hidden: bool
    # the target layers whose inputs every `out` of this sequence must carry (TargetOutput.layer_inputs: an EAGLE-3
    # head's features); the engine passes them to each of its target forwards (forward_tokens(..., taps)). () for
    # every other drafter: its sequence's forwards tap nothing
    taps: tuple[int, ...]

    def prefill(self, context: Tensor, out: TargetOutput | None, sampler: Sampler) -> None:
        """context (L,) the prompt; out: the target's prefill over context[:-1] (None if L == 1)."""

    def propose(self, context: Tensor, k: int) -> Draft:
        """context (L,) all committed tokens -> up to k draft tokens after context[-1] (k >= 1)."""

    def commit(self, verdict: Verdict, out: TargetOutput) -> None:
        """Verification kept verdict.tokens; out is the verify pass over [last, d1..dD]."""


@runtime_checkable
class BatchDrafter(Drafter, Protocol):
    """A drafter that can draft for several sequences in one call (optional).

    The engine groups a step's drafting sequences by drafter class: for a class that defines the
    classmethod `propose_batch` it calls it once per group instead of `propose` per sequence; for
    any other class it calls `propose` per sequence. Contract, for i in range(len(drafters)):

    - drafters[i] is the drafter of sequence i, contexts[i] (L_i,) its committed tokens and ks[i] >= 1
      its draft length this step (ragged: each sequence drafts its own number);
    - the result's [i] is what drafters[i].propose(contexts[i], ks[i]) would return: the same tokens
      (and q) and the same state left in drafters[i] for its commit, so batching is never visible in
      the output. Sequences the engine does not draft for this step are not passed at all.
    """

    @classmethod
    def propose_batch(cls, drafters: list[Self], contexts: list[Tensor], ks: list[int]) -> list[Draft]:
        """drafters, contexts (L_i,), ks: one entry per drafted sequence -> one Draft per sequence, same order."""


class NoDrafter:
    """Plain decoding: no draft, every step is a one-token target forward."""

    name = "none"
    prefill_logits = False
    prefill_hidden = False
    taps = ()

    def prefill(self, context: Tensor, out: TargetOutput | None, sampler: Sampler) -> None:
        pass

    def propose(self, context: Tensor, k: int) -> Draft:
        return Draft.empty()

    def commit(self, verdict: Verdict, out: TargetOutput) -> None:
        pass


def option(key: str, flag: str, default: Any) -> Any:
    """A drafter option field: `key` is the keyword callers pass (Model.generate, make_drafter), `flag`
    the name its errors use (the CLI flag that sets it)."""
    return field(default=default, metadata={"key": key, "flag": flag})


@dataclass(frozen=True)
class DrafterOptions:
    """A drafter's options: a frozen dataclass of option() fields, type-checked on construction.

    Fields are int or bool, or `int | None` (None = the drafter's own default, decided later)."""

    def __post_init__(self) -> None:
        hints = typing.get_type_hints(type(self))
        for f in fields(self):
            value, hint = getattr(self, f.name), hints[f.name]
            args = typing.get_args(hint) or (hint,)
            if value is None and type(None) in args:
                continue
            if str in args and isinstance(value, str):  # a word the drafter checks ("auto")
                continue
            if bool in args:
                if not isinstance(value, bool):
                    raise ConfigError(f"{f.metadata['flag']} must be true or false, got {value!r}")
            elif not isinstance(value, int) or isinstance(value, bool):
                raise ConfigError(f"{f.metadata['flag']} must be an integer, got {value!r}")

    @classmethod
    def keys(cls) -> dict[str, str]:
        """keyword -> field name."""
        return {f.metadata["key"]: f.name for f in fields(cls)}

    @classmethod
    def flags(cls) -> dict[str, str]:
        """keyword -> the flag its errors name."""
        return {f.metadata["key"]: f.metadata["flag"] for f in fields(cls)}

    @classmethod
    def types(cls) -> dict[str, type]:
        """keyword -> the value's type (int or bool)."""
        hints = typing.get_type_hints(cls)
        return {f.metadata["key"]: bool if bool in (typing.get_args(hints[f.name]) or (hints[f.name],)) else int for f in fields(cls)}

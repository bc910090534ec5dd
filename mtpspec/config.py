"""What one generation is asked to do: the drafter, its depth, sampling, limits, as one object.

`Model.generate(prompt, config)` and `Model.generate_batch(prompts, config)` take it; keyword arguments
override its fields (`model.generate(p, drafter="mtp", k=3)`), and keywords that are not fields are the
drafter's options, checked by the drafter registry (an unknown one is an error with a "did you mean").
"""

from __future__ import annotations

from dataclasses import dataclass, field, fields, replace
from pathlib import Path

from .errors import ConfigError
from .sampling import SamplingParams, pick_sampler


DEFAULT_K = 4  # a greedy generation's draft length when none is asked for


@dataclass(frozen=True)
class GenerationConfig:
    drafter: str = "none"  # none | ngram | draft | mtp | eagle | medusa
    k: int | str | None = None  # draft length D, or "auto": chosen per step (and per sequence in a batch) from cost and
    # acceptance; None: `depth()`
    draft_model: object = None  # a loaded Model or a path: the draft model (--drafter draft) or a trained head
    temperature: float = 0.0  # 0 = greedy
    top_k: int = 0  # 0 = off
    top_p: float = 1.0  # 1 = off
    min_p: float = 0.0  # 0 = off; the rest: sampling.SamplingParams (each row with its own context, lossless)
    repetition_penalty: float = 1.0  # 1 = off; over prompt + generated tokens
    frequency_penalty: float = 0.0  # in [-2, 2], over generated tokens
    presence_penalty: float = 0.0  # in [-2, 2], over generated tokens
    logit_bias: dict = field(default_factory=dict)  # {token id: bias in [-100, 100]}
    banned_ids: tuple = ()  # token ids never generated
    min_tokens: int = 0  # no stop token before this many new tokens
    grammar: object = None  # a mtpspec.Grammar (json_schema / json_object / regex / lark): the output matches it
    seed: int = 0  # the sampler's RNG (each sequence of a batch: seed + its index)
    sampler: str = "auto"  # auto (= gumbel when sampling: the text a function of the seed alone) | gumbel | rejection
    max_new_tokens: int = 256
    exact: bool = False  # every position computed as a one-token step computes it: bitwise batch / k invariant
    trace: bool = False  # record per-step probabilities and timings (traces, the verify page)
    threads: int | None = None  # torch threads; None = the model's (mtpspec.threads)
    options: dict = field(default_factory=dict)  # the drafter's options (ngram_min, draft_vocab, ...)

    def sampling(self) -> SamplingParams:
        """The sampling params these fields ask for (a ConfigError names a bad one)."""
        return SamplingParams(temperature=self.temperature, top_k=self.top_k, top_p=self.top_p, min_p=self.min_p,
                              repetition_penalty=self.repetition_penalty, frequency_penalty=self.frequency_penalty,
                              presence_penalty=self.presence_penalty, logit_bias=self.logit_bias, banned_ids=self.banned_ids,
                              min_tokens=self.min_tokens, sampler=pick_sampler(self.sampler, self.temperature, seeded=True))

    def depth(self) -> int | str:
        """k, or where it is None: 4 for greedy decoding, "auto" when sampling, whose text rejects more drafts, so
        that the depth policy can step aside (docs/decisions.md)."""
        if self.k is not None:
            return self.k
        return DEFAULT_K if self.sampling().greedy else "auto"

    def with_overrides(self, **kw) -> "GenerationConfig":
        """A copy with fields replaced; keywords that are not fields join `options`."""
        names = {f.name for f in fields(self)}
        own = {k: v for k, v in kw.items() if k in names}
        opts = {k: v for k, v in kw.items() if k not in names}
        if opts:
            own["options"] = {**self.options, **own.get("options", {}), **opts}
        return replace(self, **own)


def draft_model_arg(draft_model, drafter: str):
    """What make_drafter gets: a loaded Model's module (a draft model), a path, a head, or None."""
    module = getattr(draft_model, "module", None)
    if module is not None and not isinstance(draft_model, (str, Path)):
        if drafter in ("mtp", "eagle", "eagle3", "medusa"):
            raise ConfigError(
                f"--drafter {drafter} takes a trained head (a folder from `mtpspec train head`) as its draft model, "
                "not a loaded model (a loaded model is a draft model for --drafter draft)"
            )
        return module
    return draft_model

"""The draft -> verify -> accept loop.

The target's cache always holds every token except the last one emitted (`last`); each step runs
ONE target forward over [last, d1..dD], which yields D+1 next-token distributions p. Verification
keeps the longest agreeing prefix plus one recovered or bonus token, and the cache is cropped back
to what was kept (a pointer move for KV, a slot choice for recurrent state).
"""

from __future__ import annotations

from dataclasses import replace
from numbers import Integral
from time import perf_counter
from typing import Callable, Protocol

import torch
from torch import Tensor

from .drafters.base import Drafter
from .errors import ConfigError
from .metrics import Metrics
from .sampling import Sampler
from .types import Draft, GenerationResult, StepRecord, TargetOutput, Verdict
from .verify import verify


class Cache(Protocol):
    length: int

    def crop(self, length: int) -> None: ...


class Target(Protocol):
    max_seq_len: int

    def new_cache(self) -> Cache: ...
    def forward_tokens(self, tokens: Tensor, cache: Cache) -> TargetOutput: ...


class DepthPolicy(Protocol):
    """Chooses the draft length D of each step (0 = a plain step); told how each step went."""

    def next_depth(self, k_max: int) -> int: ...
    def observe(self, drafted: int, accepted: int, draft_seconds: float, verify_seconds: float) -> None: ...


def check_prompt(prompt: list[int], max_seq_len: int, vocab_size: int | None = None) -> None:
    if not prompt:
        raise ConfigError("the prompt holds no token (give some text, or token ids; this tokenizer may add no BOS)")
    if len(prompt) > max_seq_len:
        raise ConfigError(f"prompt of {len(prompt)} tokens is longer than the model's context of {max_seq_len}")
    bad = [t for t in prompt if not isinstance(t, Integral) or isinstance(t, bool)]
    if bad:
        raise ConfigError(f"prompt token ids must be integers, got {bad[0]!r}")
    if vocab_size is not None and (min(prompt) < 0 or max(prompt) >= vocab_size):
        t = min(prompt) if min(prompt) < 0 else max(prompt)
        raise ConfigError(f"prompt token id {t} is outside the model's vocabulary [0, {vocab_size})")


def check_count(name: str, n, minimum: int) -> int:
    """An integer setting (bools and floats refused, never truncated)."""
    if not isinstance(n, Integral) or isinstance(n, bool):
        raise ConfigError(f"{name} must be an integer, got {n!r}")
    if n < minimum:
        raise ConfigError(f"{name} must be >= {minimum}, got {n}")
    return int(n)


def _cut(tokens: list[int], stop_ids: tuple[int, ...], budget: int) -> tuple[list[int], str | None]:
    """Emitted tokens of one step, cut before the first stop token and at the token budget."""
    for i, t in enumerate(tokens[:budget]):
        if t in stop_ids:
            return tokens[:i], "stop"
    return tokens[:budget], ("length" if len(tokens) >= budget else None)


def _traced(step: StepRecord, logits: Tensor, draft: Tensor, start: float, sampler: Sampler) -> StepRecord:
    """The step with what a trace shows: the target's probabilities p (D+1, V) and argmaxes.

    p is softmax(logits) when greedy (the target's confidence), else the sampling distribution itself.
    """
    p = torch.softmax(logits.float(), dim=-1) if sampler.params.greedy else sampler.probs(logits)  # (D+1, V)
    d = draft.shape[0]
    p_draft = p[torch.arange(d), draft].tolist()  # (D,)
    p_emitted = p[torch.arange(len(step.emitted)), torch.tensor(step.emitted, dtype=torch.long)].tolist()
    return replace(step, start_seconds=start, p_of_emitted=p_emitted, p_of_draft=p_draft, target_choice=p.argmax(-1).tolist())


def _verify_pass(target: Target, cache: Cache, last: Tensor, draft: Draft, width: int) -> TargetOutput:
    """One target forward over [last, d1..dD], padded to `width` rows; outputs cut back to D+1 rows.

    Padding matters in exact mode only: every decode forward then has the same shape, so each row is
    computed by the same kernels whether it is a plain step or one of D+1 verified positions.
    """
    tokens = torch.cat([last, draft.tokens])  # (D+1,)
    n = tokens.shape[0]
    if width <= n:
        return target.forward_tokens(tokens, cache)
    out = target.forward_tokens(torch.cat([tokens, tokens.new_zeros(width - n)]), cache)  # (W,) pads after
    pre = out.prenorm_hidden[:n] if out.prenorm_hidden is not None else None
    return TargetOutput(logits=out.logits[:n], hidden=out.hidden[:n], prenorm_hidden=pre)


@torch.inference_mode()
def generate_tokens(
    target: Target,
    prompt: list[int],
    drafter: Drafter,
    k: int,
    sampler: Sampler,
    max_new_tokens: int,
    stop_ids: tuple[int, ...] = (),
    on_tokens: Callable[[list[int]], None] | None = None,
    depth: DepthPolicy | None = None,
    trace: bool = False,
    exact: bool = False,
) -> GenerationResult:
    """Generate up to max_new_tokens after `prompt` (which starts with BOS); text is left empty.

    trace=True also records, per step, its start time and the target's probabilities and choices
    (StepRecord.start_seconds, p_of_emitted, p_of_draft, target_choice) for traces and the verify page.
    exact=True makes every decode forward k+1 rows wide (plain steps included) with row-exact
    attention, so a position's logits are bitwise the same however many drafts shared its pass.
    """
    k = check_count("k (draft length)", k, 1)
    max_new_tokens = check_count("max-new-tokens", max_new_tokens, 0)
    check_prompt(prompt, target.max_seq_len, getattr(target, "vocab_size", None))
    k = min(k, target.max_seq_len)  # no draft is longer than the context (and Metrics sizes by k)
    metrics = Metrics(k)
    cache = target.new_cache()
    cache.exact = exact
    # the context never outgrows the model's: max_seq_len tokens in the cache + the last one emitted
    buf = torch.empty(min(len(prompt) + max_new_tokens, target.max_seq_len + 1) + 1, dtype=torch.long)  # preallocated token buffer
    buf[: len(prompt)] = torch.tensor(prompt, dtype=torch.long)
    context = buf[: len(prompt)]  # (L,) a view that grows by the emitted tokens, never copied
    new: list[int] = []
    steps: list[StepRecord] = []
    finish = "length"
    cache.prefill = len(prompt) > 1  # nothing is cropped inside the prefill: a hybrid's cache keeps its final state only
    out = target.forward_tokens(context[:-1], cache) if len(prompt) > 1 else None  # prefill, all but last
    drafter.prefill(context, out, sampler)
    metrics.prefill_done()
    while len(new) < max_new_tokens:
        d = min(depth.next_depth(k) if depth is not None else k, max_new_tokens - len(new) - 1, target.max_seq_len - cache.length - 1)
        if d < 0:
            finish = "context"
            break
        t0 = perf_counter()
        draft = drafter.propose(context, d) if d > 0 else Draft.empty()  # 1. draft
        t1 = perf_counter()
        start = cache.length
        width = min(k + 1, target.max_seq_len - start) if exact else 0
        out = _verify_pass(target, cache, context[-1:], draft, width)  # 2. one verify pass, D+1 positions
        verdict: Verdict = verify(draft, out.logits, sampler)  # 3. accept n + recovered/bonus
        cache.crop(start + verdict.num_accepted + 1)  # 4. roll back rejected drafts (pointer / slot)
        t2 = perf_counter()
        drafter.commit(verdict, out)  # 5. the drafter catches up
        t3 = perf_counter()
        kept = verdict.tokens.tolist()
        emitted, stop = _cut(kept, stop_ids, max_new_tokens - len(new))
        new += emitted
        n_ctx = context.shape[0]
        buf[n_ctx : n_ctx + len(kept)] = verdict.tokens
        context = buf[: n_ctx + len(kept)]
        metrics.observe(draft.size, verdict.num_accepted, t1 - t0 + t3 - t2, t2 - t1)
        if depth is not None:
            depth.observe(draft.size, verdict.num_accepted, t1 - t0 + t3 - t2, t2 - t1)
        step = StepRecord(draft.tokens.tolist(), verdict.num_accepted, emitted, t1 - t0 + t3 - t2, t2 - t1)
        steps.append(_traced(step, out.logits, draft.tokens, t0 - metrics.start, sampler) if trace else step)
        if on_tokens is not None and emitted:
            on_tokens(emitted)
        if stop is not None:
            finish = stop
            break
    stats = metrics.finish(len(new))
    return GenerationResult(tokens=new, prompt_tokens=list(prompt), text="", finish_reason=finish, stats=stats, steps=steps)

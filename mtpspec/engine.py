"""The draft -> verify -> accept loop, for one sequence or many sharing each target forward (docs/engine.md).

A sequence's target cache holds every token except the last one emitted (`last`); each step runs ONE target forward
over [last, d1..dD] of every running sequence (D+1 distributions p each), keeps the longest agreeing prefix plus one
recovered or bonus token, and crops each cache back to what was kept (a pointer move for KV, a slot choice for
recurrent state). Sequences draft to different depths (0 = a plain step), accept and roll back on their own.

`step` is the only implementation of a step: `Engine` runs it over a changing batch (prompts prefilled in chunks
between decode steps), `Session` is its one-sequence view, `generate_tokens` runs a Session to the end.

Exact mode (`exact=True`): every position is computed as a one-token step computes it (row_invariant products,
one-row attention, the recurrent Gated DeltaNet), so a sequence's tokens and logits are bitwise the same whatever
shares its forward; each sequence then runs its own forward, as GEMM kernels cannot make a row's result independent
of the other rows (models/common.row_invariant).

Devices (mtpspec/device.py): the engine runs where its target's weights are. Off the CPU every Engine / Session call
runs under `device.on(...)`, so what a step makes (token buffers, caches, drafts, verdicts, sampling tensors) is made
there; the host reads back the accept decisions only (greedy: one transfer per step for the whole batch). There a
batched verify pass is not bitwise a one-token step (cuBLAS picks its kernels by shape): greedy tokens equal plain
decoding's except where the top two logits tie within rounding; exact mode's width-one calls make them bitwise.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass, replace
from numbers import Integral
from time import perf_counter
from typing import Callable, Protocol, runtime_checkable

import torch
from torch import Tensor

from .batching import SlotKV, clone_cache, verify_pass
from .cache import Cache
from .device import of as device_of, on
from .drafters.base import Drafter
from .errors import ConfigError
from .metrics import Metrics
from .prefix import PrefixStore, keeps_rows
from .models.batch import TreeLayout
from .sampling import Sampler
from .types import BatchStep, Draft, GenerationResult, SeqStep, StepRecord, TargetOutput, Verdict
from .tree import kept_rows, row_paths, verify_tree, verify_tree_lazily
from .verify import verify, verify_greedy_many


@runtime_checkable
class Target(Protocol):
    """A causal LM the engine verifies with (DenseLM, HybridLM)."""

    max_seq_len: int
    vocab_size: int

    def new_cache(self) -> Cache: ...
    def forward_tokens(self, tokens: Tensor, cache: Cache, exact: bool = False, logits: bool = True, tree=None,
                       prefill: bool = False, taps: tuple[int, ...] = ()) -> TargetOutput:
        """tokens (T,) appended at cache.length -> TargetOutput (T rows) (models/forward.run): exact, one-position
        forwards; logits=False, the LM head may be skipped (None); tree, a token tree's rows; prefill, a prompt (never
        cropped inside); taps, the decoder layers whose inputs (the residual stream entering each) the output carries
        as layer_inputs: the sequence's drafter's `taps`, passed on each of its forwards and kept nowhere (() leaves
        layer_inputs None; only a forward that taps runs eagerly on a compiled model)."""
        ...
    def head(self, hidden: Tensor) -> Tensor: ...


class DepthPolicy(Protocol):
    """Chooses each running sequence's draft length D_i (0 = a plain step); learns from each step."""

    def next_depths(self, seqs: list[int], k_max: list[int]) -> list[int]: ...
    def observe(self, step: BatchStep) -> None: ...
    def drop(self, seq: int) -> None: ...


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


class Sequence:
    """One generation in flight: its context, target cache, drafter, sampler and counters."""

    def __init__(self, sid: int, target: Target, prompt: list[int], drafter: Drafter, sampler: Sampler, k: int,
                 max_new_tokens: int, stop_ids: tuple[int, ...] = (), on_tokens: Callable[[list[int]], None] | None = None,
                 trace: bool = False, logprobs: int | None = None, prompt_logprobs: int | None = None) -> None:
        self.id, self.drafter, self.k = sid, drafter, min(k, target.max_seq_len)
        self.sampler = sampler.bind(prompt, stop_ids, getattr(target, "vocab_size", None))  # its own context (the controls')
        self.prompt, self.max_new_tokens, self.stop_ids = list(prompt), max_new_tokens, stop_ids
        self.on_tokens, self.trace, self.logprobs = on_tokens, trace, logprobs
        self.cache = target.new_cache()
        self.max_seq_len = target.max_seq_len
        # the context never outgrows the model's: max_seq_len tokens in the cache + the last one emitted
        self.buf = torch.empty(min(len(prompt) + max_new_tokens, target.max_seq_len + 1) + 1, dtype=torch.long)
        self.buf[: len(prompt)] = torch.tensor(prompt, dtype=torch.long)
        self.context = self.buf[: len(prompt)]  # (L,) a view that grows by the emitted tokens, never copied
        self.prefilled = 0  # prompt positions in the cache (the prefill covers all but the last token)
        self.prefill_outs: list[TargetOutput] = []
        self.prefilled_all = False  # the whole prompt is in and the drafter was told
        self.copies: list[Sequence] = []  # sequences of the same prompt that take this one's prefill (Engine.add prefill_from)
        self.prompt_logprobs = prompt_logprobs  # n: the prompt tokens' log p (and n most likely) from the prefill's logits
        self.prompt_lps: list[TokenLogprob] = []  # then: one per prompt token after the first
        self.looked_up = False  # the engine's prefix store was asked for this prompt (prefix.PrefixStore)
        self.new: list[int] = []
        self.pending: list[int] = []  # emitted by the last step, not yet given to on_tokens
        self.pending_logprobs: list[TokenLogprob] = []  # with logprobs: one per pending token
        self.steps: list[StepRecord] = []
        self.finish_reason: str | None = None
        self.metrics = Metrics(self.k)

    @property
    def ready(self) -> bool:
        """Prefilled: the sequence takes part in decode steps."""
        return self.prefilled_all

    @property
    def done(self) -> bool:
        return self.finish_reason is not None

    def room(self) -> int:
        """The most drafts the next step may carry (-1: no room for another token at all)."""
        if len(self.new) >= self.max_new_tokens:
            return -1
        return min(self.k, self.max_new_tokens - len(self.new) - 1, self.max_seq_len - self.cache.length - 1)

    def prefill(self, target: Target, chunk: int, exact: bool) -> None:
        """The next `chunk` prompt positions into the cache; the drafter is told when the prompt is in (and each copy
        gets the prompt's cache and prefill output, computed once)."""
        end = min(self.prefilled + chunk, len(self.prompt) - 1)
        if end > self.prefilled:
            # the LM head over the prompt's rows only where something reads them (a drafter, the prompt's log-probs):
            # with a large vocabulary, a long prompt's logits are gigabytes and teraflops that nothing would use
            # nothing is cropped inside a prefill: a hybrid keeps its final state only
            logits = self.prompt_logprobs is not None or any(s.drafter.prefill_logits for s in [self, *self.copies])
            # the layer inputs any of them reads (an EAGLE-3 drafter's features); none otherwise
            taps = tuple(sorted(set().union(*(s.drafter.taps for s in [self, *self.copies]))))
            self.prefill_outs.append(target.forward_tokens(self.context[self.prefilled : end], self.cache, exact,
                                                           logits=logits, prefill=True, taps=taps))
            self.prefilled = end
        if self.prefilled >= len(self.prompt) - 1:
            out = TargetOutput.cat(self.prefill_outs) if self.prefill_outs else None
            self.prefill_outs = []
            if self.prompt_logprobs is not None and out is not None:  # row i of the prefill predicts prompt[i + 1]
                self.prompt_lps = token_logprobs(out.logits, self.prompt[1:], self.prompt_logprobs)
            for s in self.copies:
                if not s.done:
                    s.cache = clone_cache(self.cache, s.cache)
                    s.prefilled, s.prompt_lps = self.prefilled, self.prompt_lps
                    s._prefilled(out)
            self.copies = []
            self._prefilled(out)

    def _prefilled(self, out: TargetOutput | None) -> None:
        """The prompt is in the cache (`out`: the prefill's output): the drafter is told; the sequence is ready."""
        self.drafter.prefill(self.context, out, self.sampler)
        self.prefilled_all = True
        self.metrics.prefill_done()
        if self.room() < 0:
            self.finish_reason = "length"

    def accept(self, verdict: Verdict, draft: Draft, out: TargetOutput, draft_s: float, verify_s: float, t0: float,
               full: TargetOutput | None = None) -> StepRecord:
        """Append what verification kept; record the step; cut at a stop token or the budget."""
        kept = verdict.tokens.tolist()
        emitted, stop = _cut(kept, self.stop_ids, self.max_new_tokens - len(self.new))
        self.new += emitted
        n = self.context.shape[0]
        self.buf[n : n + len(kept)] = verdict.tokens
        self.context = self.buf[: n + len(kept)]
        self.metrics.observe(draft.size, verdict.num_accepted, draft_s, verify_s)
        step = StepRecord(draft.tokens.tolist(), verdict.num_accepted, emitted, draft_s, verify_s)
        if draft.is_tree:  # `out` holds the kept rows only; `full`, every row of the tree's verify window
            step = replace(step, draft_parents=draft.parents.tolist(), path=[r - 1 for r in verdict.path])
        if self.trace:
            step = _traced(step, out.logits, draft, verdict, t0 - self.metrics.start, self.sampler, None if full is None else full.logits)
        self.sampler.advance(kept)  # after the trace: it reads the rows with this step's context
        self.steps.append(step)
        self.pending = emitted  # handed to on_tokens once the step's clock has stopped (a slow reader is not engine time)
        if self.logprobs is not None:
            self.pending_logprobs = token_logprobs(out.logits[: len(emitted)], emitted, self.logprobs)
        if stop is not None:
            self.finish_reason = stop
        elif len(self.new) >= self.max_new_tokens:
            self.finish_reason = "length"
        elif self.room() < 0:
            self.finish_reason = "context"
        return step

    def result(self) -> GenerationResult:
        stats = self.metrics.finish(len(self.new))
        return GenerationResult(tokens=self.new, prompt_tokens=self.prompt, text="", finish_reason=self.finish_reason or "length",
                                stats=stats, steps=self.steps)


@dataclass(frozen=True)
class TokenLogprob:
    """log p(token) under the target's distribution at its position (softmax of the raw logits, temperature 1),
    and the `top` most likely tokens there as (id, log p)."""

    token: int
    logprob: float
    top: tuple[tuple[int, float], ...]


def token_logprobs(logits: Tensor, tokens: list[int], top: int) -> list[TokenLogprob]:
    """Row j of `logits` (n, V) is the distribution token j was drawn from (row 0 follows `last`)."""
    if not tokens:
        return []
    lp = torch.log_softmax(logits.float(), dim=-1)  # (n, V)
    chosen = lp[torch.arange(len(tokens)), torch.tensor(tokens, dtype=torch.long)].tolist()  # (n,)
    if top > 0:
        vals, ids = lp.topk(min(top, lp.shape[-1]), dim=-1)  # (n, top)
        tops = [tuple(zip(i, v)) for i, v in zip(ids.tolist(), vals.tolist())]
    else:
        tops = [()] * len(tokens)
    return [TokenLogprob(t, c, tp) for t, c, tp in zip(tokens, chosen, tops)]


def _cut(tokens: list[int], stop_ids: tuple[int, ...], budget: int) -> tuple[list[int], str | None]:
    """Emitted tokens of one step, cut before the first stop token and at the token budget."""
    for i, t in enumerate(tokens[:budget]):
        if t in stop_ids:
            return tokens[:i], "stop"
    return tokens[:budget], ("length" if len(tokens) >= budget else None)


def _traced(step: StepRecord, logits: Tensor, draft: Draft, verdict: Verdict, start: float, sampler: Sampler,
            tree_logits: Tensor | None = None) -> StepRecord:
    """The step with what a trace shows: the target's probabilities p (D+1, V) and argmaxes.

    p is softmax(logits) when greedy (the target's confidence; after the sampling controls), else the sampling
    distribution itself. A tree: logits are its kept rows; a node's p comes from its parent's row of the whole
    window (tree_logits). Each row with its own context (sampling.Paths).
    """
    def probs(lg: Tensor, paths) -> Tensor:
        return torch.softmax(sampler.logits(lg, paths).float(), dim=-1) if sampler.params.greedy else sampler.probs(lg, paths)

    d = draft.size
    p = probs(logits, verdict.tokens if draft.is_tree else draft.tokens)  # (D+1, V) (a tree's kept rows: its accepted path)
    if draft.is_tree:
        paths = row_paths(draft.tokens.tolist(), draft.parents.tolist()) if sampler.reads_context else None
        p_draft = probs(tree_logits, paths)[draft.parents + 1, draft.tokens].tolist()  # (N,) at each node's parent row
    else:
        p_draft = p[torch.arange(d), draft.tokens].tolist()  # (D,)
    p_emitted = p[torch.arange(len(step.emitted)), torch.tensor(step.emitted, dtype=torch.long)].tolist()
    return replace(step, start_seconds=start, p_of_emitted=p_emitted, p_of_draft=p_draft, target_choice=p.argmax(-1).tolist())


def propose(seqs: list[Sequence], depths: list[int]) -> tuple[list[Draft], list[float], list[bool]]:
    """Each sequence's draft of (at most) its depth; drafters of one class with a propose_batch draft together.
    Returns the drafts, each sequence's share of the drafting seconds, and whether it drafted in a batch."""
    drafts: list[Draft | None] = [Draft.empty() if d == 0 else None for d in depths]
    secs, batched = [0.0] * len(seqs), [False] * len(seqs)
    groups: dict[type, list[int]] = {}
    for i, d in enumerate(depths):
        if d > 0:
            groups.setdefault(type(seqs[i].drafter), []).append(i)
    for cls, idx in groups.items():
        t0 = perf_counter()
        if len(idx) > 1 and hasattr(cls, "propose_batch"):
            got = cls.propose_batch([seqs[i].drafter for i in idx], [seqs[i].context for i in idx], [depths[i] for i in idx])
            share = (perf_counter() - t0) / len(idx)
            for i, dr in zip(idx, got):
                drafts[i], secs[i], batched[i] = dr, share, True
            continue
        for i in idx:
            t1 = perf_counter()
            drafts[i] = seqs[i].drafter.propose(seqs[i].context, depths[i])
            secs[i] = perf_counter() - t1
    return drafts, secs, batched


@torch.inference_mode()
def step(target: Target, seqs: list[Sequence], depths: list[int], exact: bool = False, storage: SlotKV | None = None) -> BatchStep:
    """One draft -> verify -> accept -> roll back -> commit round over `seqs` (one target forward for all of them;
    `storage`: their KV slots 0..B-1 for a batched forward). Returns what a depth policy learns from."""
    t0 = perf_counter()
    drafts, draft_s, batched = propose(seqs, depths)  # 1. draft
    # a tree's nodes may outnumber its depth: its window is cut to the context left, as a chain's depth is
    drafts = [d.first(s.max_seq_len - s.cache.length - 1) if d.is_tree else d for d, s in zip(drafts, seqs)]
    # under a grammar a chain is cut at its first token outside it (its later rows could never be accepted)
    drafts = [d if d.is_tree else d.first(s.sampler.within_grammar(d.tokens)) for d, s in zip(drafts, seqs)]
    t1 = perf_counter()
    starts = [s.cache.length for s in seqs]
    tokens = [torch.cat([s.context[-1:], d.tokens]) for s, d in zip(seqs, drafts)]  # [last, d1..dD] per sequence
    layouts = [TreeLayout.of(d.parents) if d.is_tree else None for d in drafts]
    trees = any(d.is_tree for d in drafts)
    if trees and exact:
        raise ConfigError("token trees are not available in exact mode (its verify pass is one-position forwards)")
    # a greedy tree leaves its LM head to verification, which runs it only where its walk goes
    heads_later = [d.is_tree and not s.trace and s.sampler.params.greedy and not s.sampler.reads_context for d, s in zip(drafts, seqs)]
    taps = [s.drafter.taps for s in seqs]  # the layer inputs each drafter reads from the pass (EAGLE-3's features)
    outs = verify_pass(target, storage, [s.cache for s in seqs], tokens, layouts, heads_later, taps, exact)  # 2. ONE pass
    lazy: dict[int, Tensor] = {}  # sequence -> its tree's kept rows' logits
    if all(s.sampler.params.greedy and not s.sampler.reads_context for s in seqs) and not trees:  # 3. accept n_i + recovered/bonus
        verdicts = verify_greedy_many(drafts, torch.cat([o.logits.argmax(-1) for o in outs]))  # (one host sync)
    else:
        verdicts = []
        for i, (d, o, s) in enumerate(zip(drafts, outs, seqs)):
            if d.is_tree and o.logits is None:
                v, lazy[i] = verify_tree_lazily(d, o, target.head)
            else:
                at = s.context.shape[0]  # the absolute position of the window's first new token (Gumbel noise's key)
                v = verify_tree(d, o.logits, s.sampler, at) if d.is_tree else verify(d, o.logits, s.sampler, at)
            verdicts.append(v)
    full = list(outs)  # a tree's whole verify window (traces read every node's row)
    for i, (s, v, start) in enumerate(zip(seqs, verdicts, starts)):
        if v.path is not None:  # a tree: its root and accepted path to the front of the window
            kept = kept_rows(v)
            s.cache.keep(start, kept)
            outs[i] = outs[i].rows(kept) if i not in lazy else replace(outs[i].rows(kept), logits=lazy[i])
        s.cache.crop(start + v.num_accepted + 1)  # 4. roll back rejected drafts (pointer / slot)
    t2 = perf_counter()
    parts = []
    for i, (s, v, o, d) in enumerate(zip(seqs, verdicts, outs, drafts)):
        t3 = perf_counter()
        s.drafter.commit(v, o)  # 5. the drafter catches up
        draft_s[i] += perf_counter() - t3
        s.accept(v, d, o, draft_s[i], (t2 - t1) / len(seqs), t0, full[i])
        parts.append(SeqStep(s.id, d.size, v.num_accepted, draft_s[i], batched[i]))
    rows = sum(t.shape[0] for t in tokens)
    overhead = max(perf_counter() - t0 - (t2 - t1) - sum(draft_s), 0.0)
    record = BatchStep(rows=rows, width=max(t.shape[0] for t in tokens), forward_seconds=t2 - t1, overhead_seconds=overhead, seqs=tuple(parts))
    for s in seqs:  # callbacks run outside the step's time
        if s.on_tokens is not None and s.pending:
            s.on_tokens(s.pending)
    return record


def _on_device(method):
    """Run an Engine / Session method with torch's default device set to the engine's (nothing on the CPU)."""
    @functools.wraps(method)
    def run(self, *args, **kwargs):
        with on(self.device):
            return method(self, *args, **kwargs)
    return run


class Engine:
    """Continuous batching over `step`: sequences join (add) and leave (finish, cancel) between steps.

    Each call of `step()` first prefills up to `prefill_chunk` positions of the waiting prompts (in arrival
    order, while slots are free), then runs one decode step over every prefilled sequence (at most `max_batch` share a forward). `depth` chooses the
    draft lengths (None: each sequence drafts its k, as room allows).
    """

    def __init__(self, target: Target, max_batch: int = 1, exact: bool = False, depth: DepthPolicy | None = None,
                 prefill_chunk: int = 512, prefixes: PrefixStore | None = None) -> None:
        """prefixes: where finished sequences' KV is kept for later prompts that start the same way (it may outlive
        this engine: a server's, a chat's), used on a model where a copy is bitwise a prefill (prefix.py), else not."""
        self.target, self.exact, self.depth = target, exact, depth
        self.device = device_of(target)  # where its weights are: every tensor of a step is made there
        self.max_batch = check_count("max batch", max_batch, 1)
        self.prefill_chunk = check_count("prefill chunk", prefill_chunk, 1)
        self.running: list[Sequence] = []  # prefilled, decoding; running[i] holds KV slot i
        self.waiting: list[Sequence] = []  # prefilling, in arrival order
        self.finished: dict[int, Sequence] = {}
        self.storage: SlotKV | None = None  # created with the first sequence when max_batch > 1
        if prefixes is not None and not isinstance(prefixes, PrefixStore):
            raise ConfigError(f"prefixes must be a mtpspec.PrefixStore, got {type(prefixes).__name__}")
        self.prefixes = prefixes if prefixes is not None and keeps_rows(target) else None
        self.next_id = 0

    @_on_device
    @torch.inference_mode()  # the caches are inference tensors: in-place writes then skip autograd's version counting
    def add(self, prompt: list[int], drafter: Drafter, sampler: Sampler, k: int = 4, max_new_tokens: int = 256,
            stop_ids: tuple[int, ...] = (), on_tokens: Callable[[list[int]], None] | None = None, trace: bool = False,
            logprobs: int | None = None, prompt_logprobs: int | None = None, prefill_from: int | None = None) -> int:
        """Queue a generation; returns its id. logprobs=n: each step's emitted tokens also get their log p under the
        target and the n most likely tokens (Sequence.pending_logprobs, beside `pending`); prompt_logprobs=n: the
        prompt's tokens too, from the prefill's logits (Sequence.prompt_lps). prefill_from: a waiting sequence with
        the same prompt whose prefill this one takes (its cache copied when that prefill is done, instead of a
        second prefill; if that sequence leaves first, this one prefills itself)."""
        k = check_count("k (draft length)", k, 1)
        max_new_tokens = check_count("max-new-tokens", max_new_tokens, 0)
        check_prompt(prompt, self.target.max_seq_len, getattr(self.target, "vocab_size", None))
        seq = Sequence(self.next_id, self.target, prompt, drafter, sampler, k, max_new_tokens, stop_ids, on_tokens, trace, logprobs,
                       prompt_logprobs)
        if prefill_from is not None:
            source = next((s for s in self.waiting if s.id == prefill_from), None)
            if source is None or source.prompt != seq.prompt or source.prompt_logprobs != prompt_logprobs:
                raise ConfigError(f"prefill_from: sequence {prefill_from} is not waiting with the same prompt (and prompt_logprobs)")
            source.copies.append(seq)
        self.next_id += 1
        self.waiting.append(seq)
        return seq.id

    def cancel(self, sid: int) -> None:
        """Stop sequence `sid` now (a client went away): its slot is freed; its result so far is kept."""
        for s in self.waiting + self.running:
            if s.id == sid and not s.done:
                s.finish_reason = "cancelled"
        self._retire()

    @property
    def active(self) -> bool:
        return bool(self.waiting or self.running)

    @property
    def admitting(self) -> bool:
        """A waiting prompt has a free slot: the next step prefills (some of) it."""
        return bool(self.waiting) and len(self.running) < self.max_batch

    @_on_device
    @torch.inference_mode()
    def step(self) -> BatchStep | None:
        """Up to `prefill_chunk` prompt positions of the waiting sequences, in arrival order, while slots are free
        (several short prompts join in one step, a long one takes several), then one decode step."""
        budget = self.prefill_chunk
        while self.admitting and budget > 0:
            seq = self.waiting[0]
            if self.prefixes is not None and not seq.looked_up:
                self._reuse(seq)
            before = seq.prefilled
            if not seq.ready:  # (a copy of an earlier prompt's prefill is ready on arrival here)
                seq.prefill(self.target, budget, self.exact)
            budget -= max(seq.prefilled - before, 1)  # (a one-token prompt has nothing to prefill: it still counts)
            if not seq.ready:
                break
            self.waiting.pop(0)
            self._join(seq)
        self._retire()
        if not self.running:
            return None
        room = [s.room() for s in self.running]
        if self.depth is not None:
            depths = [min(d, r) for d, r in zip(self.depth.next_depths([s.id for s in self.running], room), room)]
        else:
            depths = room
        rec = step(self.target, self.running, depths, self.exact, self.storage)
        if self.depth is not None:
            self.depth.observe(rec)
        self._retire()
        return rec

    def run(self) -> dict[int, GenerationResult]:
        """Step until every sequence has finished; results by id."""
        while self.active:
            self.step()
        return {sid: s.result() for sid, s in self.finished.items()}

    def _reuse(self, seq: Sequence) -> None:
        """Start seq's prefill from the longest kept prefix of its prompt, unless something reads the prefill's output
        (a drafter's logits, hidden states or layer inputs, the prompt's log-probs), which a copy does not give."""
        seq.looked_up = True
        readers = [s.drafter for s in (seq, *seq.copies)]
        # a drafter from outside that does not say whether it reads the hidden states is taken to read them
        if seq.prefilled or seq.prompt_logprobs is not None or any(
                d.prefill_logits or getattr(d, "prefill_hidden", True) or d.taps for d in readers):
            return
        seq.prefilled = seq.metrics.cached_tokens = self.prefixes.reuse(seq.context, seq.cache)

    def _join(self, seq: Sequence) -> None:
        if seq.done:
            self.finished[seq.id] = seq
            return
        if self.max_batch > 1:
            if self.storage is None:
                self.storage = SlotKV(seq.cache.kv, self.max_batch)
            self.storage.bind(seq.cache.kv, len(self.running))
        self.running.append(seq)

    def _retire(self) -> None:
        """Move finished sequences out; the last running sequence takes a freed slot (slots stay 0..B-1)."""
        for s in [s for s in self.waiting if s.done]:
            self.waiting.remove(s)
            self.finished[s.id] = s
            heirs = [c for c in s.copies if not c.done]  # copies of a prompt whose prefill left unfinished:
            if heirs:  # the first prefills it for the others
                heirs[0].copies += heirs[1:]
            s.copies = []
        i = 0
        while i < len(self.running):
            s = self.running[i]
            if not s.done:
                i += 1
                continue
            self.finished[s.id] = s
            if self.prefixes is not None:  # before its slot is given to another sequence
                self.prefixes.keep(s.context, s.cache)
            last = self.running.pop()
            if last is not s:
                if self.storage is not None:
                    self.storage.move(last.cache.kv, i)
                self.running[i] = last
            if self.depth is not None:
                self.depth.drop(s.id)


class Session:
    """One sequence stepped by hand (the step API): prefill(), step() -> StepRecord, finish() -> GenerationResult."""

    def __init__(self, target: Target, prompt: list[int], drafter: Drafter, sampler: Sampler, k: int = 4,
                 max_new_tokens: int = 256, stop_ids: tuple[int, ...] = (), exact: bool = False, trace: bool = False,
                 on_tokens: Callable[[list[int]], None] | None = None) -> None:
        self.engine = Engine(target, 1, exact, prefill_chunk=max(len(prompt), 1))
        self.engine.add(prompt, drafter, sampler, k, max_new_tokens, stop_ids, on_tokens, trace)
        self.seq = self.engine.waiting[0]

    @property
    def device(self) -> torch.device:
        return self.engine.device

    @property
    def cache(self) -> Cache:
        return self.seq.cache

    @property
    def context(self) -> Tensor:
        return self.seq.context

    @property
    def done(self) -> bool:
        return self.seq.done

    @_on_device
    @torch.inference_mode()
    def prefill(self) -> None:
        """The prompt into the target's cache and the drafter (all but its last token: that one is `last`)."""
        if self.engine.waiting:
            self.seq.prefill(self.engine.target, self.engine.prefill_chunk, self.engine.exact)
            self.engine.waiting.pop(0)
            self.engine._join(self.seq)

    @_on_device
    @torch.inference_mode()
    def step(self, depth: int | None = None) -> StepRecord:
        """One draft -> verify -> accept -> roll back -> commit round with `depth` drafts (None: k), within the room left."""
        self.prefill()
        room = self.seq.room()
        if self.done or room < 0:
            raise ConfigError("the sequence has finished: no step is left to take")
        d = room if depth is None else min(check_count("depth", depth, 0), room)
        step(self.engine.target, [self.seq], [d], self.engine.exact)
        self.engine._retire()
        return self.seq.steps[-1]

    def finish(self) -> GenerationResult:
        return self.seq.result()


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
    """
    engine = Engine(target, 1, exact, depth, prefill_chunk=max(len(prompt), 1))
    sid = engine.add(prompt, drafter, sampler, k, max_new_tokens, stop_ids, on_tokens, trace)
    return engine.run()[sid]

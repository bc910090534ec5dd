"""Run a prompt set through plain decoding and every requested drafter / depth, alternating runs.

The methods alternate over the prompts as alternate.py runs configurations (every prompt by every
method, in an order shuffled per prompt and round), so speedups are ratios from the same stretch
of the machine. Our methods of one prompt go further: they run in a Lockstep rotation, a few
milliseconds of each in turn (lockstep.py), so they share the machine's drift step by step, not run
by run. Plain decoding (ours) is always included: it is the reference for speedup and for the
lossless check (greedy output equal to it).
"""

from __future__ import annotations

import gc
from dataclasses import asdict, dataclass, field, replace
from functools import partial
from itertools import count
from time import process_time
from typing import Callable

import torch

from ..adaptive import AdaptiveDepth
from ..errors import ConfigError
from ..metrics import Acceptance
from ..prompts import Prompt, fit_prompt
from .alternate import alternate
from .costmodel import CostModel
from .lockstep import Lockstep, Turn


@dataclass(frozen=True)
class Method:
    """One way to decode: our engine or a peer, a drafter, a depth."""

    engine: str  # "mtpspec", "transformers" or "llamacpp"
    drafter: str  # "none" | "ngram" | "draft" | "mtp" | ... (peers: none | ngram | draft; llama.cpp also mtp)
    k: int | str | None  # draft depth D, "auto", or None (plain / the peer's own default)

    @property
    def label(self) -> str:
        who = {"mtpspec": "ours", "transformers": "hf"}.get(self.engine, self.engine)
        if self.drafter == "none":
            return f"{who}:plain"
        return f"{who}:{self.drafter}" + (f"@{self.k}" if self.k is not None else "")


PLAIN = Method("mtpspec", "none", None)


@dataclass
class Run:
    """One prompt through one method, as measured."""

    method: str
    prompt_id: str
    category: str
    prompt_tokens: int
    tokens: list[int]
    wall_seconds: float
    prefill_seconds: float | None = None
    draft_seconds: float | None = None
    verify_seconds: float | None = None
    overhead_seconds: float | None = None
    target_forwards: int | None = None
    draft_tokens: int | None = None
    accepted_tokens: int | None = None
    reached: list[int] = field(default_factory=list)  # steps that checked draft position i
    passed: list[int] = field(default_factory=list)  # ... and accepted it
    drafts_per_step: list[int] = field(default_factory=list)
    lossless: bool | None = None  # greedy output equal to ours:plain (None when sampling)
    cpu_seconds: float | None = None  # process CPU time of the call: blind to time other jobs took the core
    decode_tokens: int | None = None  # tokens that wall - prefill paid for, when not all (llama.cpp: its first comes from the prompt pass)

    @property
    def new_tokens(self) -> int:
        return len(self.tokens)

    def to_json(self) -> dict:
        d = asdict(self)
        d["new_tokens"] = self.new_tokens
        return d


def run_from_result(method: Method, prompt: Prompt, res) -> Run:
    s, acc = res.stats, Acceptance.from_steps(res.steps)
    return Run(
        method=method.label, prompt_id=prompt.id, category=prompt.category, prompt_tokens=len(res.prompt_tokens),
        tokens=list(res.tokens), wall_seconds=s.wall_seconds, prefill_seconds=s.prefill_seconds,
        draft_seconds=s.draft_seconds, verify_seconds=s.verify_seconds, overhead_seconds=s.overhead_seconds,
        target_forwards=s.target_forwards, draft_tokens=s.draft_tokens, accepted_tokens=s.accepted_tokens,
        reached=acc.reached, passed=acc.passed, drafts_per_step=[len(st.draft) for st in res.steps],
    )


class OursRunner:
    """Our engine: model.generate with preloaded draft models / heads (loading is never timed)."""

    def __init__(self, model, draft_models: dict[str, object] | None = None, cost: CostModel | None = None, k_max_auto: int = 8) -> None:
        self.model, self.cost, self.k_max_auto = model, cost, k_max_auto
        self.draft_models = dict(draft_models or {})  # drafter -> its draft_model argument (a module, a head)

    def policy(self, method: Method) -> AdaptiveDepth:
        c = self.cost
        return AdaptiveDepth(
            k_max=self.k_max_auto,
            verify_cost=c.ratio if c else None,
            draft_cost=c.draft_seconds(method.drafter, 4) / 4 if c else None,
            target_cost=c.t1 if c else None,
        )

    def run(self, method: Method, prompt: Prompt, ids: list[int], max_new_tokens: int, temperature: float, seed: int,
            turn: Turn | None = None) -> Run:
        """One generation; with a `turn` it runs in a Lockstep rotation and its waits are not its time."""
        if method.drafter == "draft" and self.draft_models.get("draft") is None:
            raise ConfigError("--drafters draft needs --draft-model")
        if method.k == "auto":
            kw = dict(k=self.k_max_auto, depth_policy=self.policy(method))
        else:
            kw = dict(k=method.k or 1)
        c0 = process_time()
        res = self.model.generate(
            ids, drafter=method.drafter, draft_model=self.draft_models.get(method.drafter),
            temperature=temperature, seed=seed, max_new_tokens=max_new_tokens,
            on_tokens=turn.step_done if turn is not None else None, **kw,
        )
        run = run_from_result(method, prompt, res)
        run.cpu_seconds = process_time() - c0
        if turn is not None:  # time away while other jobs ran is not this run's
            run.cpu_seconds -= turn.waited_cpu
            run.wall_seconds -= turn.waited
            run.overhead_seconds = max((run.overhead_seconds or 0.0) - turn.waited, 0.0)
        return run


_TIMES = ("wall_seconds", "prefill_seconds", "draft_seconds", "verify_seconds", "overhead_seconds", "cpu_seconds")


def _mean_run(rs: list[Run]) -> Run:
    """One run with the rounds' mean times (the rounds are the same generation: same seed, same tokens)."""
    out = replace(rs[0])
    for f in _TIMES:
        vals = [getattr(r, f) for r in rs]
        setattr(out, f, None if any(v is None for v in vals) else sum(vals) / len(vals))
    return out


def prepare_ids(model, prompts: list[Prompt], max_new_tokens: int) -> list[list[int]]:
    """Token ids of every prompt (BOS first), cut to the model's context minus max_new_tokens."""
    budget = model.max_seq_len - max_new_tokens
    if budget < 2:
        raise ConfigError(f"max-new-tokens {max_new_tokens} leaves no room for a prompt in a context of {model.max_seq_len}")
    out = []
    for p in prompts:
        text = p.text[-budget * 8 :]  # characters: generous for any tokenizer, keeps encoding fast
        out.append(fit_prompt(model.encode(text), budget))
    return out


def warm_up(methods: list[Method], prompt: Prompt, ids: list[int], runners: dict[str, object], temperature: float = 0.0,
            seed: int = 0, tokens: int = 8) -> None:
    """Run every method once, untimed: first-call costs (allocations, lazy imports) are not measured."""
    for m in methods:
        runners[m.engine].run(m, prompt, ids, tokens, temperature, seed)


def run_bench(
    methods: list[Method],
    prompts: list[Prompt],
    ids: list[list[int]],
    runners: dict[str, object],  # engine name -> runner with .run(method, prompt, ids, ...)
    max_new_tokens: int,
    temperature: float = 0.0,
    seed: int = 0,
    progress: Callable[[str], None] | None = None,
    warmup_tokens: int = 8,
    repeat: int = 1,
    interleave: str = "step",
    keep: str = "mean",
) -> list[Run]:
    """Every prompt through every method (order shuffled per prompt and round); lossless flags filled in.

    Our methods run as one block and the peers after it, and the block starts with a short untimed
    plain run: a transformers run leaves caches and the allocator in another state, and methods
    doing the same work measured up to +-15% apart per category when they followed one at random.

    warmup_tokens = 0 skips the warm-up (the caller ran `warm_up`).
    repeat > 1 runs each (prompt, method) that many times, in separate alternating rounds; keep="mean"
    averages the rounds' times, keep="best" keeps each one's fastest. The mean keeps the pairing
    that interleaving gives (every method of a round went through the same stretch of the machine);
    the fastest of each, taken separately, picks each method's luckiest round, which breaks it.
    interleave="step" runs our methods of one prompt in a Lockstep rotation (5 ms of each in turn,
    time away not counted; one torch thread only); "run" runs each whole generation in turn.
    """
    if interleave not in ("step", "run"):
        raise ConfigError(f"interleave must be 'step' or 'run', got {interleave!r}")
    if keep not in ("mean", "best"):
        raise ConfigError(f"keep must be 'mean' or 'best', got {keep!r}")
    if PLAIN not in methods:
        methods = [PLAIN, *methods]
    if warmup_tokens > 0:
        warm_up(methods, prompts[0], ids[0], runners, temperature, seed, warmup_tokens)
    # Everything alive now (models, transformers' modules when peers run: twice the objects) is
    # set aside from the garbage collector: a full collection that walks it takes ~0.3 s and would
    # land, at random, inside one timed run.
    gc.collect()
    gc.freeze()
    turns = count()

    def run(m: Method, prompt: tuple[Prompt, list[int]], turn: Turn | None = None) -> Run:
        r = runners[m.engine].run(m, *prompt, max_new_tokens, temperature, seed, *([turn] if turn else []))
        if progress:
            progress(m.label)
        return r

    def together(ms: list[Method], prompt: tuple[Prompt, list[int]]) -> list[Run]:
        """Ours (interleaved step by step, or run by run), then the peers; results in the order of `ms`."""
        ours = [i for i, m in enumerate(ms) if m.engine == PLAIN.engine]
        peers = [i for i, m in enumerate(ms) if m.engine != PLAIN.engine]
        if peers:  # settle after the previous prompt's peer runs (untimed)
            runners[PLAIN.engine].run(PLAIN, *prompt, max(warmup_tokens, 8), temperature, seed)
        if interleave == "step":
            jobs = [partial(run, ms[i], prompt) for i in ours]  # each job(turn)
            with torch.inference_mode():  # one mode for all: a job leaving its own would end the others'
                got = Lockstep(seed=f"{seed}/{next(turns)}").run(jobs)
        else:
            got = [run(ms[i], prompt) for i in ours]
        by_index = dict(zip(ours, got)) | {i: run(ms[i], prompt) for i in peers}
        return [by_index[i] for i in range(len(ms))]

    try:
        results = alternate(methods, list(zip(prompts, ids)), run, repeat, seed, together)
    finally:
        gc.unfreeze()
    runs: list[Run] = []
    for i in range(len(prompts)):
        ref = results[methods.index(PLAIN)][i][0].tokens
        for j in range(len(methods)):
            rs = results[j][i]
            r = _mean_run(rs) if keep == "mean" else min(rs, key=lambda x: x.wall_seconds)
            r.lossless = (r.tokens == ref) if temperature == 0 else None
            runs.append(r)
    return runs

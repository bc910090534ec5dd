"""Run a prompt set through plain decoding and every requested drafter / depth, alternating runs.

Every prompt goes through every method in a shuffled order (alternate.py); our methods of one prompt take turns a few
milliseconds at a time (common.Lockstep), so speedups are ratios from the same stretch of the machine. Plain decoding
(ours) is the reference for speedup and for the lossless check.
"""

from __future__ import annotations

import statistics

from dataclasses import asdict, dataclass, field, replace
from itertools import count
from time import process_time
from typing import Callable

import torch

from ..adaptive import AdaptiveDepth
from ..alternate import alternate
from ..errors import ConfigError
from ..heap import frozen_heap
from ..metrics import Acceptance
from ..models.compiled import auto_depth
from ..prompts import Prompt, fit_prompt
from .costmodel import CostModel
from .common import Lockstep, Turn


@dataclass(frozen=True)
class Method:
    """One way to decode: our engine or a peer, a drafter, a depth."""

    engine: str  # "mtpspec", "transformers" or "llamacpp"
    drafter: str  # "none" | "ngram" | "draft" | "mtp" | ... (peers: none | ngram | draft; llama.cpp also mtp)
    k: int | str | None  # draft depth D, "auto", or None (plain / the peer's own default)
    options: tuple[tuple[str, object], ...] = ()  # ours: drafter options (--drafters mtp+mtp_lookup=4)

    @property
    def label(self) -> str:
        who = {"mtpspec": "ours", "transformers": "hf"}.get(self.engine, self.engine)
        if self.drafter == "none":
            return f"{who}:plain"
        opts = "".join(f"+{key}={value}" for key, value in self.options)
        return f"{who}:{self.drafter}{opts}" + (f"@{self.k}" if self.k is not None else "")


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
    split: int | None = None  # a peer's greedy output: the first new token where it leaves ours:plain
    split_margin: float | None = None  # ... and our logit of our token minus our logit of the peer's token there
    cpu_seconds: float | None = None  # process CPU time of the call: blind to time other jobs took the core
    decode_tokens: int | None = None  # tokens that wall - prefill paid for, when not all (llama.cpp: its first comes from the prompt pass)

    @property
    def new_tokens(self) -> int:
        return len(self.tokens)

    def to_json(self) -> dict:
        return asdict(self) | {"new_tokens": self.new_tokens}


class OursRunner:
    """Our engine: model.generate with preloaded draft models / heads (loading is never timed)."""

    def __init__(self, model, draft_models: dict[str, object] | None = None, cost: CostModel | None = None) -> None:
        self.model, self.cost = model, cost
        self.draft_models = dict(draft_models or {})  # drafter -> its draft_model argument (a module, a head)

    def run(self, method: Method, prompt: Prompt, ids: list[int], max_new_tokens: int, temperature: float, seed: int,
            turn: Turn | None = None) -> Run:
        """One generation; with a `turn` it runs in a Lockstep rotation and its waits are not its time."""
        kw = dict(k=method.k or 1)
        if method.k == "auto":
            c = self.cost  # the policy's priors: the measured T(k)/T(1) and the drafter's cost per token at d = 4
            deepest = auto_depth(self.model.module)  # a compiled model's graphs go to AUTO_DEPTH
            kw = dict(k=deepest, depth_policy=AdaptiveDepth(
                k_max=deepest, verify_cost=c.ratio if c else None,
                draft_cost=c.draft_seconds(method.drafter, 4) / 4 if c else None, target_cost=c.t1 if c else None))
        c0 = process_time()
        res = self.model.generate(
            ids, drafter=method.drafter, draft_model=self.draft_models.get(method.drafter), temperature=temperature, seed=seed,
            max_new_tokens=max_new_tokens, on_tokens=turn.step_done if turn is not None else None, **kw, **dict(method.options))
        s, acc = res.stats, Acceptance.from_steps(res.steps)
        run = Run(
            method=method.label, prompt_id=prompt.id, category=prompt.category, prompt_tokens=len(res.prompt_tokens),
            tokens=list(res.tokens), wall_seconds=s.wall_seconds, prefill_seconds=s.prefill_seconds, draft_seconds=s.draft_seconds,
            verify_seconds=s.verify_seconds, overhead_seconds=s.overhead_seconds, target_forwards=s.target_forwards,
            draft_tokens=s.draft_tokens, accepted_tokens=s.accepted_tokens, reached=acc.reached, passed=acc.passed,
            drafts_per_step=[len(st.draft) for st in res.steps], cpu_seconds=process_time() - c0)
        if turn is not None:  # time away while other jobs ran is not this run's
            run.cpu_seconds -= turn.waited_cpu
            run.wall_seconds -= turn.waited
            run.overhead_seconds = max((run.overhead_seconds or 0.0) - turn.waited, 0.0)
        return run



def logit_margin(module, ids: list[int], a: int, b: int) -> float:
    """module's logit of token a minus its logit of token b after `ids` (one forward over them)."""
    with torch.inference_mode():
        lg = module.forward_tokens(torch.tensor(list(ids)), module.new_cache()).logits[-1].double()
    return float(lg[a] - lg[b])


def split_at(ours: list[int], theirs: list[int]) -> int | None:
    """The first index where two greedy outputs differ (one ending early counts), None where they are equal."""
    i = next((j for j, (a, b) in enumerate(zip(ours, theirs)) if a != b), min(len(ours), len(theirs)))
    return None if ours == theirs else i


def _mean_run(rs: list[Run], median: bool = False) -> Run:
    """One run with the rounds' mean (or median) times, field by field (the rounds are the same generation: same seed,
    same tokens)."""
    out = replace(rs[0])
    for f in ("wall_seconds", "prefill_seconds", "draft_seconds", "verify_seconds", "overhead_seconds", "cpu_seconds"):
        vals = [getattr(r, f) for r in rs]
        setattr(out, f, None if None in vals else statistics.median(vals) if median else sum(vals) / len(vals))
    return out


def prepare_ids(model, prompts: list[Prompt], max_new_tokens: int) -> list[list[int]]:
    """Token ids of every prompt (BOS first), cut to the model's context minus max_new_tokens."""
    budget = model.max_seq_len - max_new_tokens
    if budget < 2:
        raise ConfigError(f"max-new-tokens {max_new_tokens} leaves no room for a prompt in a context of {model.max_seq_len}")
    # characters: text[-budget * 8:] is generous for any tokenizer and keeps encoding fast
    return [fit_prompt(model.encode(p.text[-budget * 8 :]), budget) for p in prompts]


def warm_up(methods: list[Method], prompt: Prompt, ids: list[int], runners: dict[str, object], temperature: float = 0.0,
            seed: int = 0, tokens: int = 8) -> None:
    """Run every method once, untimed: first-call costs (allocations, lazy imports) are not measured."""
    for m in methods:
        runners[m.engine].run(m, prompt, ids, tokens, temperature, seed)


def run_bench(methods: list[Method], prompts: list[Prompt], ids: list[list[int]], runners: dict[str, object], max_new_tokens: int,
              temperature: float = 0.0, seed: int = 0, progress: Callable[[str], None] | None = None, repeat: int = 1,
              interleave: str = "step", keep: str = "mean") -> list[Run]:
    """Every prompt through every method (after `warm_up`), `repeat` alternating rounds; lossless flags filled in.

    Ours run as one block, interleaved step by step (interleave="step", one torch thread) or run by run, then the peers
    after a short untimed plain run. keep="mean" averages the rounds' times (keeping the pairing), "median" takes their medians, "best" the fastest."""
    if PLAIN not in methods:
        methods = [PLAIN, *methods]
    turns = count()

    def run(m: Method, prompt: tuple[Prompt, list[int]], turn: Turn | None = None) -> Run:
        r = runners[m.engine].run(m, *prompt, max_new_tokens, temperature, seed, *([turn] if turn else []))
        if progress:
            progress(m.label)
        return r

    def together(ms: list[Method], prompt: tuple[Prompt, list[int]]) -> list[Run]:
        """Ours (interleaved step by step, or run by run), then the peers; results in the order of `ms`."""
        ours = [m for m in ms if m.engine == PLAIN.engine]
        peers = [m for m in ms if m.engine != PLAIN.engine]
        if peers:  # settle after the previous prompt's peer runs (untimed)
            runners[PLAIN.engine].run(PLAIN, *prompt, 8, temperature, seed)
        if interleave == "step":
            with torch.inference_mode():  # one mode for all: a job leaving its own would end the others'
                got = Lockstep(seed=f"{seed}/{next(turns)}").run([lambda turn, m=m: run(m, prompt, turn) for m in ours])
        else:
            got = [run(m, prompt) for m in ours]
        by_method = dict(zip(ours, got)) | {m: run(m, prompt) for m in peers}
        return [by_method[m] for m in ms]

    with frozen_heap():
        results = alternate(methods, list(zip(prompts, ids)), run, repeat, seed, together)
    runs, margins = [], {}  # (prompt, split, peer's token) -> our logit margin there
    for i in range(len(prompts)):
        ref = results[methods.index(PLAIN)][i][0].tokens
        for j in range(len(methods)):
            r = min(results[j][i], key=lambda x: x.wall_seconds) if keep == "best" else _mean_run(results[j][i], keep == "median")
            r.lossless = (r.tokens == ref) if temperature == 0 else None
            if r.lossless is False and methods[j].engine != PLAIN.engine:
                r.split = s = split_at(ref, r.tokens)
                if s < min(len(ref), len(r.tokens)):  # a peer's methods split alike (its speculation is lossless): one forward
                    key = (i, s, r.tokens[s])
                    if key not in margins:
                        margins[key] = logit_margin(runners[PLAIN.engine].model.module, ids[i] + ref[:s], ref[s], r.tokens[s])
                    r.split_margin = margins[key]
            runs.append(r)
    return runs

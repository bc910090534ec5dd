"""Cost model: what a step costs on this machine, and the speedup that measured acceptance predicts.

Measured once per model (target forwards raw, no engine around them; the k's are timed round-robin so
drift falls on all of them alike, each T(k) is the lower quartile of its repeats, since other jobs
only ever add time, and the curve is made non-decreasing in k by pooling adjacent violators):

- T(k): one target forward over k new tokens on a cache already holding `context` positions;
  reported as T(1) in seconds and the curve T(k)/T(1), k = 1..k_max+1.
- the drafter's cost, for every drafter alike (drafter_cost.py): the real drafter object in steady
  state, propose(d) + commit timed for d = 1..k_max (what the engine counts as draft time), and its
  catch-up on a fresh prompt relative to the target's prefill; 0 for plain decoding.
- the verify forward in situ: the same steady-state loop times each step's target forward over
  d + 1 tokens, V_drafter(d), with plain steps (d = 0) interleaved in it. Back to back a forward
  finds the target's weights and the interpreter warm in the CPU caches; inside a run the drafter's
  own work passes through them between two forwards, so an in-run forward costs more (more with a
  heavier drafter). The prediction uses the in-situ times, which puts that cost on the
  configuration that causes it instead of on the engine, and takes its plain baseline from the
  same loop, so drift of the machine between the drafters' measurements cancels.
- the thread count: T(1) at 1..n threads, the fastest is used (the second core here is weak).

Prediction for a finished run, step by step: each step with d drafts costs C_draft(d) + V(d)
(V = the in-situ verify forward, T(d + 1) where none was measured), and plain decoding needs one
V(0) per token, so

    predicted speedup = (P + new_tokens * V(0)) / (P (1 + f) + sum over steps (C_draft(d) + V(d)))

where P is the target's prefill of the same prompts as measured in the plain runs and f the
drafter's prefill relative to it (measured: a draft model reads the prompt too, an MTP / EAGLE head
runs over the prompt's hidden states; n-gram lookup and Medusa pay next to nothing). Without
prefill and for a constant D this is the textbook accepted-per-step x T(1) / (T_draft + T(D+1)),
with T measured where it is paid.
The gap to the measured speedup is the engine's own overhead (acceptance, sampling, bookkeeping,
Python between the forwards; the drafter's own Python is inside C_draft) and machine drift.
"""

from __future__ import annotations

import os
from dataclasses import asdict, dataclass, field
from time import perf_counter

import torch


@dataclass
class CostModel:
    t1: float  # seconds of a one-token target forward
    ratio: list[float]  # ratio[k-1] = T(k)/T(1), k = 1..len
    draft_cost: dict[str, float] = field(default_factory=dict)  # drafter -> seconds per drafted token (at d = 4)
    draft_steps: dict[str, list[float]] = field(default_factory=dict)  # drafter -> seconds of propose + commit in a step of d drafts, d = 1..
    prefill_ratio: dict[str, float] = field(default_factory=dict)  # drafter -> its catch-up on a prompt / the target's prefill
    verify_steps: dict[str, list[float]] = field(default_factory=dict)  # drafter -> seconds of the verify forward of a step
    # with d drafts, d = 0..k_max, timed in that drafter's loop (d = 0: its interleaved plain steps)
    threads: int = 1  # torch threads used for every timed run
    thread_t1: dict[int, float] = field(default_factory=dict)  # threads -> T(1) seconds, as measured
    context: int = 0  # cache length the forwards were timed at

    def t(self, k: int) -> float:
        """Seconds of a forward over k tokens (extrapolated linearly past the measured curve)."""
        r = self.ratio
        if k <= len(r):
            return self.t1 * r[k - 1]
        slope = r[-1] - r[-2] if len(r) > 1 else 0.0
        return self.t1 * (r[-1] + max(slope, 0.0) * (k - len(r)))

    def draft_seconds(self, drafter: str, d: int) -> float:
        """The drafter's cost of one step with d drafts (its forwards, where modelled per step)."""
        if d <= 0:
            return 0.0
        curve = self.draft_steps.get(drafter)
        if curve:
            if d <= len(curve):
                return curve[d - 1]
            per = (curve[-1] - curve[0]) / (len(curve) - 1) if len(curve) > 1 else curve[0]
            return curve[-1] + per * (d - len(curve))
        return self.draft_cost.get(drafter, 0.0) * d

    def plain_seconds(self, drafter: str = "none") -> float:
        """Seconds of a plain step's forward: in situ (the plain steps of `drafter`'s loop) when measured, else T(1)."""
        curve = self.verify_steps.get(drafter)
        return curve[0] if curve else self.t1

    def verify_seconds(self, drafter: str, d: int) -> float:
        """The target forward of a step with d drafts: in situ when measured (scaled along T(k) past the
        measured depths), else T(d + 1)."""
        curve = self.verify_steps.get(drafter)
        if not curve:
            return self.t(max(d, 0) + 1)
        if d < len(curve):
            return curve[max(d, 0)]
        return curve[-1] * self.t(d + 1) / self.t(len(curve))

    def step_seconds(self, drafter: str, d: int) -> float:
        return self.draft_seconds(drafter, d) + self.verify_seconds(drafter, d)

    def run_seconds(self, drafter: str, drafts_per_step: list[int], prefill_seconds: float = 0.0) -> float:
        """Predicted seconds of one generation: prefill (+ the drafter's, paid lazily at its first draft,
        so only runs that drafted pay it) and every step."""
        steps = sum(self.step_seconds(drafter, d) for d in drafts_per_step)
        return steps + prefill_seconds * (1 + (self.prefill_ratio.get(drafter, 0.0) if any(drafts_per_step) else 0.0))

    def predict_speedup(self, drafter: str, new_tokens: int, drafts_per_step: list[int], prefill_seconds: float = 0.0) -> float:
        """Speedup over plain decoding that these steps (d drafted tokens each) should give.

        prefill_seconds: the target's prefill of the same prompt (measured), paid by both sides."""
        cost = self.run_seconds(drafter, drafts_per_step, prefill_seconds)
        return (new_tokens * self.plain_seconds(drafter) + prefill_seconds) / cost if cost > 0 else 0.0

    def to_json(self) -> dict:
        return asdict(self)


def _quantile(xs: list[float], q: float) -> float:
    xs = sorted(xs)
    return xs[min(int(q * len(xs)), len(xs) - 1)]


def _monotone(ys: list[float]) -> list[float]:
    """Least-squares non-decreasing fit (pool adjacent violators)."""
    blocks: list[list[float]] = []  # [sum, count]
    for y in ys:
        blocks.append([y, 1])
        while len(blocks) > 1 and blocks[-2][0] / blocks[-2][1] > blocks[-1][0] / blocks[-1][1]:
            s, n = blocks.pop()
            blocks[-1][0] += s
            blocks[-1][1] += n
    return [b[0] / b[1] for b in blocks for _ in range(b[1])]


def stable(prev: list[float] | None, cur: list[float], tol: float) -> bool:
    """Every estimate within `tol` (relative) of its value one check earlier."""
    return prev is not None and all(abs(c - p) <= tol * p for p, c in zip(prev, cur))


@torch.inference_mode()
def time_forwards(module, ks: list[int], context: int, repeat: int = 30, q: float = 0.25, min_repeat: int | None = None,
                  tol: float = 0.02) -> list[float]:
    """Seconds of module.forward_tokens over k new tokens after `context` cached positions, for
    each k in ks (timed round-robin; lower quartile of up to `repeat` timings each).

    min_repeat: stop early, after at least this many rounds, once 8 more rounds moved no estimate
    by more than `tol` (the curve is stable: more rounds would only cost time)."""
    cache = module.new_cache()
    ctx = max(1, min(context, module.max_seq_len - max(ks)))
    g = torch.Generator().manual_seed(0)
    module.forward_tokens(torch.randint(3, module.vocab_size, (ctx,), generator=g), cache)
    toks = {k: torch.randint(3, module.vocab_size, (k,), generator=g) for k in ks}
    times: dict[int, list[float]] = {k: [] for k in ks}
    prev = None
    for rep in range(repeat + 2):  # two warm-up rounds
        for k in ks:
            t0 = perf_counter()
            module.forward_tokens(toks[k], cache)
            dt = perf_counter() - t0
            cache.crop(ctx)
            if rep >= 2:
                times[k].append(dt)
        done = rep - 1  # timed rounds so far
        if min_repeat is not None and done >= min_repeat and done % 8 == 0:
            cur = [_quantile(times[k], q) for k in ks]
            if stable(prev, cur, tol):
                break
            prev = cur
    return [_quantile(times[k], q) for k in ks]


@torch.inference_mode()
def choose_threads(module, context: int = 128, candidates: list[int] | None = None, budget_s: float = 0.5) -> tuple[int, dict[int, float]]:
    """Time T(1) at each thread count (at most `budget_s` seconds each: on a loaded machine a
    multi-threaded forward can take 100x longer; a count whose first timings are all over twice
    the best so far is dropped early); return the fastest and the timings. The caller sets the winner."""
    n = os.cpu_count() or 1
    candidates = candidates or sorted({1, n} | ({2} if n >= 2 else set()))
    timings = {}
    tok = torch.tensor([5])
    cache = module.new_cache()  # prefilled once: the prompt's cost does not depend on the thread count
    module.forward_tokens(torch.arange(3, 3 + min(context, module.max_seq_len - 1)) % module.vocab_size, cache)
    ctx = cache.length
    for t in candidates:
        torch.set_num_threads(t)
        best = min(timings.values(), default=None)
        times, start = [], perf_counter()
        while len(times) < 20 and perf_counter() - start < budget_s:
            t0 = perf_counter()
            module.forward_tokens(tok, cache)
            times.append(perf_counter() - t0)
            cache.crop(ctx)
            if best is not None and len(times) >= 3 and min(times) > 2 * best:
                break
        timings[t] = _quantile(times, 0.25)
    return min(timings, key=timings.get), timings


def measure(target, k_max: int = 8, context: int = 128, threads: int | None = None, drafters=("none",),
            draft_models: dict | None = None, tokens: list[int] | None = None, repeat: int = 25) -> CostModel:
    """Measure the cost model of `target` on this machine, and the cost of every drafter in `drafters`.

    draft_models: drafter name -> what make_drafter gets as its draft_model (a draft model's module,
    a loaded head); tokens: a real prompt to build the timing context from (tiled to its length)."""
    from ..drafters import make_drafter
    from .drafter_cost import time_drafter

    if threads is None:
        threads, thread_t1 = choose_threads(target, context)
    else:
        thread_t1 = {}
    torch.set_num_threads(threads)
    times = _monotone(time_forwards(target, list(range(1, k_max + 2)), context, repeat=40, min_repeat=16))
    t1 = times[0]
    cost, steps, prefill, verify = {"none": 0.0}, {}, {}, {}
    dms = draft_models or {}
    for name in drafters:
        if name == "none":
            continue
        dc = time_drafter(target, lambda: make_drafter(name, target, draft_model=dms.get(name)), k_max, context, tokens, repeat)
        steps[name] = _monotone(dc.steps)
        verify[name] = _monotone(dc.verify)
        prefill[name] = dc.prefill_ratio
        d = min(4, k_max)
        cost[name] = steps[name][d - 1] / d  # seconds per drafted token at a typical depth (what the policy's prior reads)
    return CostModel(t1=t1, ratio=[t / t1 for t in times], draft_cost=cost, draft_steps=steps, prefill_ratio=prefill,
                     verify_steps=verify, threads=threads, thread_t1=thread_t1, context=context)

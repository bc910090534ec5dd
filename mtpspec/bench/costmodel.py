"""Cost model: what a step costs on this machine, and the speedup that measured acceptance predicts.

T(k), a raw target forward over k new tokens (lower quartile, made non-decreasing), and per drafter, from its own
loop (drafter_cost.py), C_draft(d), the in-situ verify V(d) and its prompt catch-up f relative to the prefill P:

    speedup = (P + new_tokens * V(0)) / (P (1 + f) + sum over steps (C_draft(d) + V(d)))

The gap to the measured speedup is the engine's own overhead (and the machine's drift). docs/benchmarks.md, "Cost model".
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from time import perf_counter

import torch

from ..device import of as device_of, synchronize
from .common import quantile, rounds


@dataclass
class CostModel:
    t1: float  # seconds of a one-token target forward
    ratio: list[float]  # ratio[k-1] = T(k)/T(1), k = 1..len
    draft_steps: dict[str, list[float]] = field(default_factory=dict)  # drafter -> seconds of propose + commit in a step of d drafts, d = 1..
    prefill_ratio: dict[str, float] = field(default_factory=dict)  # drafter -> its catch-up on a prompt / the target's prefill
    verify_steps: dict[str, list[float]] = field(default_factory=dict)  # drafter -> seconds of the verify forward of a step
    # with d drafts, d = 0..k_max, timed in that drafter's loop (d = 0: its interleaved plain steps)
    threads: int = 1  # torch threads used for every timed run
    context: int = 0  # cache length the forwards were timed at

    def t(self, k: int) -> float:
        """Seconds of a forward over k tokens (extrapolated linearly past the measured curve)."""
        return self.t1 * _extend(self.ratio, k)

    def draft_seconds(self, drafter: str, d: int) -> float:
        """The drafter's cost of one step with d drafts (0 for an unmeasured drafter: n-gram lookup is ~free)."""
        curve = self.draft_steps.get(drafter)
        return _extend(curve, d) if curve and d > 0 else 0.0

    def plain_seconds(self, drafter: str = "none") -> float:
        """Seconds of a plain step's forward: in situ (the plain steps of `drafter`'s loop) when measured, else T(1)."""
        return self.verify_seconds(drafter, 0)

    def verify_seconds(self, drafter: str, d: int) -> float:
        """The target forward of a step with d drafts: in situ when measured (scaled along T(k) past the
        measured depths), else T(d + 1)."""
        curve = self.verify_steps.get(drafter)
        if not curve:
            return self.t(max(d, 0) + 1)
        return curve[max(d, 0)] if d < len(curve) else curve[-1] * self.t(d + 1) / self.t(len(curve))

    def run_seconds(self, drafter: str, drafts_per_step: list[int], prefill_seconds: float = 0.0) -> float:
        """Predicted seconds of one generation: prefill (+ the drafter's, paid lazily at its first draft,
        so only runs that drafted pay it) and every step."""
        steps = sum(self.draft_seconds(drafter, d) + self.verify_seconds(drafter, d) for d in drafts_per_step)
        return steps + prefill_seconds * (1 + (self.prefill_ratio.get(drafter, 0.0) if any(drafts_per_step) else 0.0))

    def predict_speedup(self, drafter: str, new_tokens: int, drafts_per_step: list[int], prefill_seconds: float = 0.0) -> float:
        """Speedup over plain decoding that these steps (d drafted tokens each) should give.

        prefill_seconds: the target's prefill of the same prompt (measured), paid by both sides."""
        cost = self.run_seconds(drafter, drafts_per_step, prefill_seconds)
        return (new_tokens * self.plain_seconds(drafter) + prefill_seconds) / cost if cost > 0 else 0.0

    def to_json(self) -> dict:
        return asdict(self)


def _extend(curve: list[float], x: int) -> float:
    """curve[x - 1], continued linearly (never downward) past its end."""
    if x <= len(curve):
        return curve[x - 1]
    slope = (curve[-1] - curve[0]) / (len(curve) - 1) if len(curve) > 1 else curve[0]
    return curve[-1] + max(slope, 0.0) * (x - len(curve))


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


@torch.inference_mode()
def time_forwards(module, ks: list, context: int, repeat: int = 40, q: float = 0.25, min_repeat: int = 8,
                  tol: float = 0.02, budget_s: float = 2.0) -> list[float]:
    """Seconds of module.forward_tokens over k new tokens after `context` cached positions, for each entry of ks: k
    (all rows' logits) or (k, logits) (logits False: the layers alone). Timed round-robin after two warm-up rounds;
    the q-quantile of each entry's timings; `rounds` stops early."""
    keys = [k if isinstance(k, tuple) else (k, True) for k in ks]
    widths = sorted({k for k, _ in keys})
    cache = module.new_cache()
    dev = device_of(module)  # (a device's forward is asynchronous: each timing waits for it)
    ctx = max(1, min(context, module.max_seq_len - widths[-1]))
    g = torch.Generator().manual_seed(0)
    module.forward_tokens(torch.randint(3, module.vocab_size, (ctx,), generator=g), cache)
    toks = {k: torch.randint(3, module.vocab_size, (k,), generator=g) for k in widths}
    times: dict[tuple, list[float]] = {key: [] for key in keys}
    estimate = lambda: [quantile(times[key], q) for key in keys]  # noqa: E731
    for rep in rounds(estimate, repeat + 2, min_repeat + 2, tol, budget_s, every=4):
        for k, logits in keys:
            t0 = perf_counter()
            module.forward_tokens(toks[k], cache, logits=logits)
            synchronize(dev)
            dt = perf_counter() - t0
            cache.crop(ctx)
            if rep >= 2:
                times[(k, logits)].append(dt)
    return estimate()


def measure(target, k_max: int = 8, context: int = 128, threads: int = 1, drafters=("none",),
            draft_models: dict | None = None, tokens: list[int] | None = None) -> CostModel:
    """Measure the cost model of `target` on this machine (torch already set to `threads`), and the cost of every
    drafter in `drafters`. draft_models: drafter name -> what make_drafter gets as its draft_model (a draft
    model's module, a loaded head); tokens: a real prompt to build the timing context from (tiled to its length)."""
    from ..drafters import make_drafter
    from .drafter_cost import time_drafter

    times = _monotone(time_forwards(target, list(range(1, k_max + 2)), context))
    steps, prefill, verify = {}, {}, {}
    for name in drafters:
        if name != "none":
            dc = time_drafter(target, lambda: make_drafter(name, target, draft_model=(draft_models or {}).get(name)), k_max,
                              context, tokens)
            steps[name], verify[name], prefill[name] = _monotone(dc.steps), _monotone(dc.verify), dc.prefill_ratio
    return CostModel(t1=times[0], ratio=[t / times[0] for t in times], draft_steps=steps, prefill_ratio=prefill,
                     verify_steps=verify, threads=threads, context=context)

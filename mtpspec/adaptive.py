"""Adaptive draft depth (`--k auto`): choose D each step from running acceptance and measured cost.

Model of one step at depth D (D = 0 is a plain step):

    tokens(D) = 1 + a1 + a1 a2 + ... + a1 a2 ... aD   (a_i = P(draft i ok | drafts before it ok))
    time(D)   = c_draft * D + v1 * r(D + 1) + o      (drafter per token, target verify, engine overhead)

and D = argmax tokens(D) / time(D) over 0..k_max. Each a_i is a decayed running estimate of the
conditional acceptance at draft position i, shrunk toward the pooled estimate over all positions
where position i has little evidence (prompt lookup is typically unsure of its first token and sure
of the rest once a copy has started; a draft model decays with depth). `c_draft`, `v1` and `o` are
running estimates from the measured time of each step, and r(k) = T(k)/T(1) is the target's cost
curve (measured once by the benchmark's cost model; flat when unknown, which is what a tiny model
shows).

Plain decoding wins ties: speculation must promise `margin` (3%) more tokens per second, plus 10%
of the drafter's cost relative to a target step, because a costly drafter has costs this model
does not see (a draft model reads the whole prompt at its first draft and catches up after every
plain stretch). A draft model as big as the target can at best gain a few percent with perfect
acceptance, so it is never tried; prompt lookup (nearly free) only has to beat 3%.

Choosing D = 0 gives no new evidence about acceptance, so while it runs plain steps the evidence
fades (`forget` per step: text that did not repeat may start to) toward the sequence's long-run
acceptance (the prior until it has drafted: fading toward the optimistic prior made it retry hopeless
text, such as prompt lookup at 10% acceptance, every few dozen steps), and after a run of plain steps the policy
probes with the best D >= 1 until a step actually drafts (prompt lookup may have nothing to offer,
which costs nothing). The wait between probes is sized so probing costs about `explore` (2%) of
the time: a probe costs c_draft + v1 (r(2) - 1), so a nearly free drafter (prompt lookup) probes
every few steps and a drafter as costly as the target every ~50; a failed probe doubles the wait
(up to 4x), a successful one resets it. A hopeless drafter loses at most a few percent, and one
that starts to pay (a story that begins to repeat itself) is found again.
"""

from __future__ import annotations

from time import perf_counter
from typing import Sequence


class AdaptiveDepth:
    """A DepthPolicy (see engine.py): next_depth(k_max) -> D in 0..k_max, observe(...) after each step."""

    def __init__(
        self,
        k_max: int = 8,
        verify_ratio: Sequence[float] | None = None,  # r[k-1] = T(k)/T(1) for k = 1..; None = flat
        draft_cost: float | None = None,  # prior drafter seconds per drafted token (None: learn)
        target_cost: float | None = None,  # prior seconds of a one-token target step T(1) (None: learn)
        decay: float = 0.97,  # weight of the past in the acceptance estimates (about 30 steps of memory)
        prior_acceptance: float = 0.6,
        shrink: float = 2.0,  # pseudo-observations pulling each a_i toward the pooled estimate
        forget: float = 0.98,  # per plain step, acceptance evidence fades toward its long-run level (text changes)
        explore: float = 0.02,  # share of time that probing may cost
        probe_min: int = 4,  # fewest plain steps between probes
        margin: float = 0.03,  # speculation must promise this much over a plain step to be chosen ...
        cost_margin: float = 0.1,  # ... plus this times c_draft / T(1): a costly drafter's hidden costs
        # (reading the prompt at its first draft, catching up after plain stretches) grow with its cost
    ) -> None:
        if k_max < 0:
            raise ValueError(f"k_max must be >= 0, got {k_max}")
        self.k_max = k_max
        self.ratio = list(verify_ratio) if verify_ratio else None
        self._r = [self.r(k) for k in range(1, k_max + 2)]  # r(d + 1) for d = 0..k_max
        self.decay, self.shrink, self.forget = decay, shrink, forget
        self.prior_acceptance = prior_acceptance
        # prior drafter cost relative to a target step (scaled by the running step time until drafts are seen)
        self.c_ratio = draft_cost / target_cost if (draft_cost is not None and target_cost) else None
        n = max(k_max, 1)
        self.passed = [0.0] * n  # decayed counts per draft position
        self.reached = [0.0] * n
        self.pool_passed, self.pool_reached = prior_acceptance * 2.0, 2.0  # pooled, with a prior of 2
        self.long_passed, self.long_reached = 0.0, 0.0  # the sequence's acceptance over ~200 drafting steps
        self.c_draft = draft_cost if self.c_ratio is None else None  # seconds per drafted token, as observed
        self.v1: float | None = target_cost  # seconds of a one-token verify (target step)
        self.o = 0.0  # seconds of engine overhead per step
        self.explore, self.probe_min, self.margin, self.cost_margin = explore, probe_min, margin, cost_margin
        self.probe_wait: int | None = None  # set from the costs at the first plain step
        self.plain_run = 0  # consecutive D = 0 choices
        self.probing = False
        self.last_depth = 0
        self._t_choose: float | None = None
        self._step_work = 0.0
        self._pays_cached, self._pays_at = True, None
        self._warm = 2 if (draft_cost is not None and target_cost is not None) else 0  # drafting steps seen
        self.history: list[int] = []  # chosen D per step (for tests and traces)

    # --- estimates -------------------------------------------------------------------------
    @property
    def acceptance(self) -> float:
        """Pooled conditional acceptance over all draft positions."""
        return self.pool_passed / self.pool_reached

    def acceptance_at(self) -> list[float]:
        """a_i for i = 1..k_max, each shrunk toward the pooled estimate."""
        pooled, w = self.acceptance, self.shrink
        return [(p + w * pooled) / (r + w) for p, r in zip(self.passed, self.reached)]

    def r(self, k: int) -> float:
        """T(k)/T(1), from the measured curve (extended linearly past its end) or flat."""
        if not self.ratio:
            return 1.0
        if k <= len(self.ratio):
            return self.ratio[k - 1]
        last = self.ratio[-1]
        slope = (last - self.ratio[-2]) if len(self.ratio) > 1 else 0.0
        return last + max(slope, 0.0) * (k - len(self.ratio))

    def expected_tokens(self, d: int) -> float:
        total, run = 1.0, 1.0
        for a in self.acceptance_at()[:d]:
            run *= a
            total += run
        return total

    def _c(self) -> float:
        """Drafter seconds per drafted token: observed, else the prior ratio x step time, else half a step."""
        v1 = self.v1 or 1.0
        if self.c_draft is not None:
            return self.c_draft
        return (self.c_ratio if self.c_ratio is not None else 0.5) * v1

    def step_time(self, d: int) -> float:
        v1 = self.v1 if self.v1 is not None else 1.0
        c = self._c()
        return c * d + v1 * self.r(d + 1) + self.o

    def best_depth(self, k_max: int, min_depth: int = 0) -> int:
        v1 = self.v1 if self.v1 is not None else 1.0
        c = self._c()
        best, best_rate = min_depth, -1.0
        tokens, run = 1.0, 1.0
        acc = self.acceptance_at()
        margin = self.plain_margin()
        for d in range(0, k_max + 1):
            if d > 0:
                run *= acc[d - 1]
                tokens += run
            if d < min_depth:
                continue
            rate = tokens / (c * d + v1 * self._r[d] + self.o)
            if d == 0:  # costs the model does not see (drafter catch-up, bookkeeping) favour plain
                rate *= 1.0 + margin
            if rate > best_rate * 1.0001:  # ties go to the smaller D
                best, best_rate = d, rate
        return best

    # --- DepthPolicy -----------------------------------------------------------------------
    def probe_base(self) -> int:
        """Plain steps between probes so that probing costs about `explore` of the time."""
        v1 = self.v1 or 1.0
        c = self._c()
        cost = (c + v1 * (self.r(2) - 1.0)) / (v1 + self.o)  # a D = 1 probe, in plain steps
        return max(self.probe_min, int(cost / self.explore + 0.5))

    def plain_margin(self) -> float:
        v1 = self.v1 or 1.0
        c = self._c()
        return self.margin + self.cost_margin * min(c / v1, 1.0)

    def can_pay(self, k_max: int) -> bool:
        """Would speculation beat a plain step even if every draft were accepted? (If not, probing
        is pointless: a drafter as costly as the target can never pay.)"""
        v1 = self.v1 or 1.0
        c = self._c()
        plain = (1.0 + self.plain_margin()) / (v1 + self.o)
        return any((d + 1) / (c * d + v1 * self._r[d] + self.o) > plain for d in range(1, k_max + 1))

    def _fade(self) -> None:
        """A plain step brings no evidence; old evidence fades so the prior can call for a retry."""
        f = self.forget
        self.passed = [x * f for x in self.passed]
        self.reached = [x * f for x in self.reached]
        w = 2.0 * (1.0 - f)  # pooled estimate drifts back toward this sequence's long-run acceptance
        target = (self.long_passed + 2.0 * self.prior_acceptance) / (self.long_reached + 2.0)  # (the prior, until drafts are seen)
        self.pool_passed = f * self.pool_passed + w * target
        self.pool_reached = f * self.pool_reached + w

    def _pays(self, k_max: int) -> bool:
        """can_pay, re-evaluated every 16 steps (the costs move slowly)."""
        if self._pays_at is None or len(self.history) - self._pays_at >= 16:
            self._pays_cached, self._pays_at = self.can_pay(k_max), len(self.history)
        return self._pays_cached

    def next_depth(self, k_max: int) -> int:
        now = perf_counter()
        if self._t_choose is not None:  # whole previous step minus its draft + verify = engine overhead
            over = max(now - self._t_choose - self._step_work, 0.0)
            self.o = over if len(self.history) == 1 else 0.8 * self.o + 0.2 * over
        self._t_choose = now
        k_max = min(k_max, self.k_max)
        if k_max <= 0:
            d = 0
        elif self.v1 is None or (self.c_draft is None and self.c_ratio is None) or self._warm < 2:  # warm-up: learn what a step and a draft cost
            d = min(2, k_max)
        elif not self._pays(k_max):  # even perfect acceptance would lose: stay plain, skip the search
            d = 0
        else:
            d = self.best_depth(k_max)
            if d > 0:
                self.plain_run = 0
            elif self.probing:  # a probe that has not drafted yet (prompt lookup found nothing)
                d = self.best_depth(k_max, 1)
            else:
                self.plain_run += 1
                self._fade()
                if self.probe_wait is None:
                    self.probe_wait = self.probe_base()
                if self.plain_run >= self.probe_wait:
                    d, self.probing, self.plain_run = self.best_depth(k_max, 1), True, 0
        self.last_depth = d
        self.history.append(d)
        return d

    def pause(self, seconds: float) -> None:
        """`seconds` between steps were spent outside this generation (a benchmark running other
        methods in turn): not engine overhead."""
        if self._t_choose is not None:
            self._t_choose += seconds

    def observe(self, drafted: int, accepted: int, draft_seconds: float, verify_seconds: float) -> None:
        self._step_work = draft_seconds + verify_seconds
        v = verify_seconds / (self._r[drafted] if drafted < len(self._r) else self.r(drafted + 1))
        self.v1 = v if self.v1 is None else 0.8 * self.v1 + 0.2 * v
        if drafted > 0:
            c = draft_seconds / drafted
            self._warm += 1
            if self.c_ratio is not None:  # a prior: running average, a slow call (catch-up) clipped at 4x it
                base = self._c()
                self.c_draft = 0.8 * base + 0.2 * min(c, 4 * self.c_ratio * self.v1 + 1e-5)
            elif self.c_draft is None or self._warm == 2:  # warm-up: the first draft also read the prompt
                self.c_draft = c
            else:
                self.c_draft = 0.8 * self.c_draft + 0.2 * min(c, 4 * self.c_draft + 1e-5)
            g = self.decay
            reached = min(accepted + 1, drafted)  # positions checked: all accepted + the first miss
            for i in range(min(drafted, len(self.passed))):
                self.passed[i] *= g
                self.reached[i] *= g
                if i < reached:
                    self.reached[i] += 1.0
                    self.passed[i] += 1.0 if i < accepted else 0.0
            self.pool_passed = g * self.pool_passed + accepted
            self.pool_reached = g * self.pool_reached + reached
            self.long_passed = 0.995 * self.long_passed + accepted
            self.long_reached = 0.995 * self.long_reached + reached
            if self.probing:  # a probe that paid resets the wait; one that failed doubles it (up to 4x)
                base = self.probe_base()
                wait = self.probe_wait or base
                self.probe_wait = base if accepted > 0 else min(wait * 2, 4 * base)
                self.probing = False
        elif self.last_depth > 0 and self.c_draft is None and self.c_ratio is None:
            self.c_draft = draft_seconds  # asked for drafts, got none (n-gram miss): cost of asking

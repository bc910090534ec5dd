"""Adaptive draft depth (`--k auto`): choose D each step from running acceptance and measured cost.

Model of one step at depth D (D = 0 is a plain step):

    tokens(D) = 1 + a + a^2 + ... + a^D          (geometric acceptance, a = P(draft i ok | i-1 ok))
    time(D)   = c_draft * D + v1 * r(D + 1) + o   (drafter per token, target verify, engine overhead)

and D = argmax tokens(D) / time(D) over 0..k_max. `a` is a decayed running estimate of the
conditional acceptance (passed / reached draft positions), `c_draft`, `v1` and `o` are running
estimates from the measured time of each step, and r(k) = T(k)/T(1) is the target's cost curve
(measured once by the benchmark's cost model; flat when unknown, which is what a tiny model shows).

Choosing D = 0 gives no new evidence about acceptance, so after a run of plain steps the policy
probes once with the best D >= 1; a failed probe doubles the wait before the next one (bounded),
so a hopeless drafter costs at most a few percent and a drafter that starts to pay is found again.
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
        decay: float = 0.85,  # weight of the past in the acceptance estimate (about 7 steps of memory)
        prior_acceptance: float = 0.6,
        probe_min: int = 8,  # plain steps before the first probe
        probe_max: int = 64,  # longest wait between probes after repeated failures
    ) -> None:
        if k_max < 0:
            raise ValueError(f"k_max must be >= 0, got {k_max}")
        self.k_max = k_max
        self.ratio = list(verify_ratio) if verify_ratio else None
        self.decay = decay
        self.passed = prior_acceptance * 2.0  # decayed sums; the prior weighs two draft positions
        self.reached = 2.0
        self.c_draft = draft_cost  # seconds per drafted token
        self.v1: float | None = None  # seconds of a one-token verify (target step)
        self.o = 0.0  # seconds of engine overhead per step
        self.probe_min, self.probe_max = probe_min, probe_max
        self.probe_wait = probe_min
        self.plain_run = 0  # consecutive D = 0 choices
        self.probing = False
        self.last_depth = 0
        self._t_choose: float | None = None
        self._step_work = 0.0
        self.history: list[int] = []  # chosen D per step (for tests and traces)

    # --- estimates -------------------------------------------------------------------------
    @property
    def acceptance(self) -> float:
        return self.passed / self.reached if self.reached > 0 else 0.0

    def r(self, k: int) -> float:
        """T(k)/T(1), from the measured curve (extended linearly past its end) or flat."""
        if not self.ratio:
            return 1.0
        if k <= len(self.ratio):
            return self.ratio[k - 1]
        last = self.ratio[-1]
        slope = (last - self.ratio[-2]) if len(self.ratio) > 1 else 0.0
        return last + max(slope, 0.0) * (k - len(self.ratio))

    def expected_tokens(self, d: int, a: float | None = None) -> float:
        a = self.acceptance if a is None else a
        return sum(a**i for i in range(d + 1))  # 1 + a + ... + a^d

    def step_time(self, d: int) -> float:
        v1 = self.v1 if self.v1 is not None else 1.0
        c = self.c_draft if self.c_draft is not None else 0.5 * v1  # unknown drafter: assume half a step
        return c * d + v1 * self.r(d + 1) + self.o

    def best_depth(self, k_max: int, min_depth: int = 0) -> int:
        best, best_rate = min_depth, -1.0
        for d in range(min_depth, k_max + 1):
            rate = self.expected_tokens(d) / self.step_time(d)
            if rate > best_rate * 1.0001:  # ties go to the smaller D
                best, best_rate = d, rate
        return best

    # --- DepthPolicy -----------------------------------------------------------------------
    def next_depth(self, k_max: int) -> int:
        now = perf_counter()
        if self._t_choose is not None:  # whole previous step minus its draft + verify = engine overhead
            over = max(now - self._t_choose - self._step_work, 0.0)
            self.o = over if not self.history else 0.8 * self.o + 0.2 * over
        self._t_choose = now
        k_max = min(k_max, self.k_max)
        if k_max <= 0:
            d = 0
        elif self.v1 is None or self.c_draft is None:  # warm-up: learn what a draft costs
            d = min(2, k_max)
        else:
            d = self.best_depth(k_max)
            self.probing = False
            if d == 0:
                self.plain_run += 1
                if self.plain_run >= self.probe_wait:
                    d, self.probing, self.plain_run = max(self.best_depth(k_max, 1), 1), True, 0
            else:
                self.plain_run = 0
        self.last_depth = d
        self.history.append(d)
        return d

    def observe(self, drafted: int, accepted: int, draft_seconds: float, verify_seconds: float) -> None:
        self._step_work = draft_seconds + verify_seconds
        v = verify_seconds / self.r(drafted + 1)
        self.v1 = v if self.v1 is None else 0.8 * self.v1 + 0.2 * v
        if drafted > 0:
            c = draft_seconds / drafted
            self.c_draft = c if self.c_draft is None else 0.8 * self.c_draft + 0.2 * c
            reached = min(accepted + 1, drafted)  # positions checked: all accepted + the first miss
            self.passed = self.decay * self.passed + accepted
            self.reached = self.decay * self.reached + reached
            if self.probing:  # a probe that paid resets the wait; one that failed doubles it
                ok = accepted > 0
                self.probe_wait = self.probe_min if ok else min(self.probe_wait * 2, self.probe_max)
        elif self.last_depth > 0 and self.c_draft is None:
            self.c_draft = draft_seconds  # asked for drafts, got none (n-gram miss): cost of asking

"""Adaptive draft depth (`--k auto`): each step, a depth D_i for every running sequence, chosen from
the whole batch's cost, so that speculation steps aside as the batch fills the compute.

Model of one engine step (D_i = 0 is a plain step for sequence i):

    tokens_i(D) = 1 + a_i1 + a_i1 a_i2 + ... + a_i1 ... a_iD   (a_ij = P(draft j ok | drafts before it ok))
    time        = T(rows) + c sum_i D_i + o,   rows = sum_i (D_i + 1)
    rate        = sum_i tokens_i(D_i) / time

T(rows) is the target forward over `rows` new positions across the batch, c the drafter's seconds per
drafted token and o the engine's own seconds per step: all three are learned from observe() only (the
policy has no clock). T is fitted to the observed (rows, seconds) pairs: a running mean per rows value,
pulled toward a prior curve where one is given (the benchmark's cost model measures T(k)/T(1) at batch 1),
made non-decreasing (pool adjacent violators), interpolated between the rows values seen and extended
linearly past the last one. Adding a draft position to any sequence costs the same, T(rows + 1) - T(rows)
+ c, and the marginal tokens of sequence i's next position, a_i1 ... a_i(D+1), never grow with D: so the
best allocation of n draft positions takes the n largest marginal gains over the batch, and the policy
takes the n that maximises the rate (exact, one sort). As rows fill the compute T steepens, n shrinks
smoothly toward 0, and the positions left go to the sequences whose drafts are most often accepted.

Each a_ij is a decayed running estimate of sequence i's conditional acceptance at draft position j,
shrunk toward its pooled estimate over all positions where position j has little evidence (prompt
lookup is typically unsure of its first token and sure of the rest once a copy has started; a draft
model decays with depth).

Plain decoding wins ties: speculation must promise `margin` (3%) more tokens per second, plus 10% of the
drafter's cost relative to T(1), because a costly drafter has costs this model does not see (a draft
model reads the whole prompt at its first draft and catches up after every plain stretch). A drafter
that could not beat the step even if every draft were accepted (a draft model as big as the target,
or any drafter once the batch fills the compute) is never tried.

Choosing D_i = 0 gives no new evidence about sequence i, so while it runs plain its evidence fades
(`forget` per step: text that did not repeat may start to) toward its long-run acceptance (the prior
until it has drafted: fading toward the optimistic prior made it retry hopeless text, such as prompt
lookup at 10% acceptance, every few dozen steps), and after a run of plain steps the policy probes it
with its best D >= 1 until a step actually drafts (prompt lookup may have nothing to offer, which costs
nothing). The wait between probes is sized so that probing costs about `explore` (2%) of the time: a
nearly free drafter probes every few steps, a costly one every ~50; a failed probe doubles the wait (up
to 4x), a successful one resets it.
"""

from __future__ import annotations

from bisect import bisect_right
from typing import Sequence

from .errors import ConfigError
from .types import BatchStep, SeqStep


class ForwardCost:
    """T(rows): seconds of one target forward over `rows` new positions, learned, non-decreasing in rows."""

    def __init__(self, prior: Sequence[float] | None = None, t1: float | None = None) -> None:
        self.prior = list(prior) if prior else ([1.0] if t1 is not None else [])  # prior[n-1] = T(n)/T(1)
        self.scale = t1  # T(1) of the prior curve: given, else learned from the steps inside the curve
        self.mean: dict[int, float] = {}  # rows -> running mean of its forward seconds
        self.count: dict[int, int] = {}
        self._table: list[float] = []  # T(n) for n = 1..len; refitted at a new rows value or every 8 steps
        self._upto, self._changes = 16, 0

    @property
    def known(self) -> bool:
        return self.scale is not None

    def ratio(self, rows: int) -> float:
        """The prior T(rows)/T(1), extended linearly past its end."""
        r = self.prior
        if not r:
            return 1.0
        if rows <= len(r):
            return r[rows - 1]
        slope = max(r[-1] - r[-2], 0.0) if len(r) > 1 else 0.0
        return r[-1] + slope * (rows - len(r))

    def observe(self, rows: int, seconds: float) -> None:
        self._changes += 1
        if rows not in self.count or self._changes >= 8:
            self._table, self._changes = [], 0
        n = self.count.get(rows, 0) + 1
        m = self.mean.get(rows, seconds)
        self.count[rows], self.mean[rows] = n, m + (seconds - m) / min(n, 5)  # a mean, then a running one
        s = seconds / self.ratio(rows)
        if self.scale is None:
            self.scale = s
        elif rows <= len(self.prior):
            self.scale = 0.8 * self.scale + 0.2 * s

    def __call__(self, rows: int) -> float:
        return self.table(rows)[rows - 1]

    def table(self, upto: int) -> list[float]:
        """[T(1), T(2), ...], at least up to T(upto)."""
        if upto > len(self._table):
            self._upto = max(self._upto, upto)
            self._build(self._upto)
        return self._table

    def _build(self, upto: int) -> None:
        knots = sorted(set(range(1, len(self.prior) + 1)) | set(self.mean))
        blocks: list[list[float]] = []  # [value, weight, knots]: pool adjacent violators -> non-decreasing
        for n in knots:
            w0 = 1.0 if n <= len(self.prior) else 0.0  # the prior counts as one observation
            w = min(self.count.get(n, 0), 10)
            blocks.append([(w * self.mean.get(n, 0.0) + w0 * self.scale * self.ratio(n)) / (w + w0), w + w0, 1])
            while len(blocks) > 1 and blocks[-2][0] > blocks[-1][0]:
                v2, w2, k2 = blocks.pop()
                v1, w1, k1 = blocks.pop()
                blocks.append([(v1 * w1 + v2 * w2) / (w1 + w2), w1 + w2, k1 + k2])
        fit = [v for v, _, k in blocks for _ in range(int(k))]
        last = knots[-1]
        j = max([i for i, n in enumerate(knots) if 2 * n <= last] or [0])  # extend with the slope over the upper half
        slope = (fit[-1] - fit[j]) / (last - knots[j]) if last > knots[j] else 0.0
        table = []
        for n in range(1, upto + 1):
            i = bisect_right(knots, n) - 1  # the last rows value seen <= n
            if i < 0:  # fewer rows than any seen: optimistic (trying them is how they are learned)
                table.append(fit[0] * n / knots[0])
            elif n >= last:
                table.append(fit[-1] + slope * (n - last))
            else:  # between rows values seen: flat to the middle of the gap, the least a non-decreasing T
                lo, hi = knots[i], knots[i + 1]  # can be (optimistic, so it is tried), then straight up to hi
                mid = (lo + hi) / 2
                table.append(fit[i] + (fit[i + 1] - fit[i]) * max(n - mid, 0.0) / (hi - mid))
        self._table = table


class SeqAcceptance:
    """One sequence's acceptance by draft position, and its probing state."""

    def __init__(self, k: int, prior: float) -> None:
        self.passed, self.reached = [0.0] * k, [0.0] * k  # decayed counts per draft position
        self.pool_passed, self.pool_reached = 2.0 * prior, 2.0  # pooled, with a prior of 2
        self.long_passed, self.long_reached = 0.0, 0.0  # acceptance over ~200 drafting steps
        self.plain_run = 0  # consecutive D = 0 choices
        self.probe_wait: int | None = None
        self.probing = False
        self.asked = 0  # D chosen for the last step
        self._gains: list[float] | None = None  # until the estimates change

    def gains(self, d: int, shrink: float) -> list[float]:
        """Marginal expected tokens of draft positions 1..d: a1, a1 a2, ..., each a_j shrunk to the pool."""
        if self._gains is None:
            pooled, self._gains, run = self.pool_passed / self.pool_reached, [], 1.0
            for p, r in zip(self.passed, self.reached):
                run *= (p + shrink * pooled) / (r + shrink)
                self._gains.append(run)
        return self._gains[:d]

    def learn(self, drafted: int, accepted: int, g: float) -> None:
        self._gains, reached = None, min(accepted + 1, drafted)  # positions checked: all accepted + the first miss
        for i in range(min(drafted, len(self.passed))):
            self.passed[i] = g * self.passed[i] + (1.0 if i < accepted else 0.0)
            self.reached[i] = g * self.reached[i] + (1.0 if i < reached else 0.0)
        self.pool_passed, self.pool_reached = g * self.pool_passed + accepted, g * self.pool_reached + reached
        self.long_passed, self.long_reached = 0.995 * self.long_passed + accepted, 0.995 * self.long_reached + reached

    def fade(self, f: float, prior: float) -> None:
        """A plain step brings no evidence; old evidence fades so the prior can call for a retry."""
        self._gains = None
        self.passed = [x * f for x in self.passed]
        self.reached = [x * f for x in self.reached]
        w = 2.0 * (1.0 - f)  # the pool drifts toward the long-run acceptance (the prior until drafts are seen)
        target = (self.long_passed + 2.0 * prior) / (self.long_reached + 2.0)
        self.pool_passed, self.pool_reached = f * self.pool_passed + w * target, f * self.pool_reached + w


class AdaptiveDepth:
    """A DepthPolicy: next_depths(seqs, k_max) -> D_i per sequence, observe(BatchStep) after each step."""

    def __init__(
        self,
        k_max: int = 8,
        verify_cost: Sequence[float] | None = None,  # prior T(rows)/T(1), r[rows-1] for rows = 1..; None = flat
        draft_cost: float | None = None,  # prior drafter seconds per drafted token (None: learn)
        target_cost: float | None = None,  # prior seconds of a one-row target forward T(1) (None: learn)
        decay: float = 0.97,  # weight of the past in the acceptance estimates (about 30 steps of memory)
        prior_acceptance: float = 0.6,
        shrink: float = 2.0,  # pseudo-observations pulling each a_j toward the pooled estimate
        forget: float = 0.98,  # per plain step, acceptance evidence fades toward its long-run level
        explore: float = 0.02,  # share of time that probing may cost
        probe_min: int = 4,  # fewest plain steps between probes
        margin: float = 0.03,  # speculation must promise this much over plain decoding to be chosen ...
        cost_margin: float = 0.1,  # ... plus this times c / T(1): a costly drafter's hidden costs
    ) -> None:
        if k_max < 0:
            raise ConfigError(f"k_max must be >= 0, got {k_max}")
        self.k_max, self.T = k_max, ForwardCost(verify_cost, target_cost)
        self.decay, self.shrink, self.forget, self.prior_acceptance = decay, shrink, forget, prior_acceptance
        self.explore, self.probe_min, self.margin, self.cost_margin = explore, probe_min, margin, cost_margin
        # prior drafter cost relative to T(1), scaled by the learned T(1) until drafts are seen
        self.c_ratio = draft_cost / target_cost if (draft_cost is not None and target_cost) else None
        self.c = draft_cost if self.c_ratio is None else None  # seconds per drafted token, as observed
        self.o = 0.0  # engine overhead seconds per step
        self._steps = 0
        self._warm = 2 if (draft_cost is not None and target_cost is not None) else 0  # drafting steps seen
        self._probe_base = probe_min
        self.seqs: dict[int, SeqAcceptance] = {}

    def _c(self) -> float:
        """Drafter seconds per drafted token: observed, else the prior ratio x T(1), else half a forward."""
        if self.c is not None:
            return self.c
        return (self.c_ratio if self.c_ratio is not None else 0.5) * self.T(1)

    def plain_margin(self) -> float:
        return self.margin + self.cost_margin * min(self._c() / self.T(1), 1.0)

    def _seq(self, seq: int) -> SeqAcceptance:
        if seq not in self.seqs:
            self.seqs[seq] = SeqAcceptance(max(self.k_max, 1), self.prior_acceptance)
        return self.seqs[seq]

    def _best_added(self, gains: list[float], tokens: float, rows: int, drafted: int) -> int:
        """Best D >= 1 for one more sequence's drafts (marginal `gains`) on top of a batch."""
        best, best_rate, c = 1, -1.0, self._c()
        for d in range(1, len(gains) + 1):
            tokens += gains[d - 1]
            rate = tokens / (self.T(rows + d) + c * (drafted + d) + self.o)
            if rate > best_rate * 1.0001:
                best, best_rate = d, rate
        return best

    def _pays(self, cap: int, others: list[float], B: int, rate: float, k: int) -> bool:
        """Would `cap` drafts that are all accepted, ahead of the drafting sequences' gains, beat `rate`?"""
        tokens, c, hidden = float(B), self._c(), 1.0 + self.plain_margin() * (k + 1) / B
        for m, g in enumerate([1.0] * cap + others, 1):
            tokens += g
            if tokens / (self.T(B + m) + c * m + self.o) / hidden > rate:
                return True
        return False

    # --- DepthPolicy -----------------------------------------------------------------------
    def next_depths(self, seqs: Sequence[int], k_max: int | Sequence[int]) -> list[int]:
        """D_i for each running sequence id (0 = a plain step for it); k_max may be per sequence (room left)."""
        caps = [min(k, self.k_max) for k in ([k_max] * len(seqs) if isinstance(k_max, int) else k_max)]
        states = [self._seq(s) for s in seqs]
        if not self.T.known or (self.c is None and self.c_ratio is None) or self._warm < 2:
            ds = [max(min(2, k), 0) for k in caps]  # warm-up: learn what a forward and a draft cost
        else:
            ds = self._allocate(states, caps)
        for st, d in zip(states, ds):
            st.asked = d
        return ds

    def _allocate(self, states: list[SeqAcceptance], caps: list[int]) -> list[int]:
        B, c, o = len(states), self._c(), self.o
        gains = [st.gains(cap, self.shrink) if cap > 0 else [] for st, cap in zip(states, caps)]
        order = sorted([(g, i) for i, gs in enumerate(gains) for g in gs], reverse=True)
        T = self.T.table(B + sum(caps) + 1)  # T[rows - 1]
        margin = (self.margin + self.cost_margin * min(c / T[0], 1.0)) / B  # per drafting sequence
        n, tokens, rate, k = 0, float(B), B / (T[B - 1] + o), 0
        total, drafters, drafting = tokens, 0, [False] * B
        for m, (g, i) in enumerate(order, 1):  # take the m best positions: the rate of each m, best kept
            total += g
            if not drafting[i]:  # a sequence's hidden costs count once it drafts
                drafting[i], drafters = True, drafters + 1
            r = total / ((T[B + m - 1] + c * m + o) * (1.0 + margin * drafters))
            if r > rate * 1.0001:  # ties go to fewer drafts
                n, tokens, rate, k = m, total, r, drafters
            elif r < 0.8 * rate:  # well past the best (the rate is one-humped but for steps in T)
                break
        ds = [0] * B
        for _, i in order[:n]:
            ds[i] += 1
        rows, drafted = B + n, n
        step = T[rows - 1] + c * drafted + o  # a D = 1 probe per sequence, in steps, so probes cost `explore`
        self._probe_base = max(self.probe_min, int(B * (c + T[rows] - T[rows - 1]) / step / self.explore + 0.5))
        pays: dict[int, bool] = {}
        for i, st in enumerate(states):
            if caps[i] <= 0:
                continue
            if ds[i] > 0:
                st.plain_run = 0
                continue
            if not st.probing:  # drafts that could not pay even if all accepted: no fading, no probe
                if caps[i] not in pays:
                    pays[caps[i]] = self._pays(caps[i], [g for g, j in order if ds[j] > 0], B, rate, k)
                if not pays[caps[i]]:
                    continue
                st.plain_run += 1
                st.fade(self.forget, self.prior_acceptance)
                if st.probe_wait is None:
                    st.probe_wait = self._probe_base
                if st.plain_run < st.probe_wait:
                    continue
                st.probing, st.plain_run = True, 0
            d = self._best_added(gains[i], tokens, rows, drafted)  # a probe (or one that has not drafted yet)
            ds[i], rows, drafted, tokens = d, rows + d, drafted + d, tokens + sum(gains[i][:d])
        return ds

    def observe(self, step: BatchStep | int, *legacy: float) -> None:
        """After each engine step. (Shim until the batched engine lands: observe(drafted, accepted,
        draft_seconds, verify_seconds) from the one-sequence engine, see observe_step.)"""
        if not isinstance(step, BatchStep):
            return self.observe_step(step, *legacy)
        self.T.observe(step.rows, step.forward_seconds)
        self.o = step.overhead_seconds if self._steps == 0 else 0.8 * self.o + 0.2 * step.overhead_seconds
        self._steps += 1
        drafted = sum(s.drafted for s in step.seqs)
        if drafted > 0:
            self._learn_cost(sum(s.draft_seconds for s in step.seqs if s.drafted > 0) / drafted)
        for s in step.seqs:
            st = self._seq(s.seq)
            if s.drafted > 0:
                st.learn(s.drafted, s.accepted, self.decay)
                if st.probing:  # a probe that paid resets the wait; one that failed doubles it (up to 4x)
                    base = self._probe_base
                    st.probe_wait = base if s.accepted > 0 else min(2 * (st.probe_wait or base), 4 * base)
                    st.probing = False
            elif st.asked > 0 and self.c is None and self.c_ratio is None:
                self.c = s.draft_seconds  # asked for drafts, got none (n-gram miss): the cost of asking

    def _learn_cost(self, c: float) -> None:
        self._warm += 1
        if self.c_ratio is not None:  # a prior: running average, a slow call (catch-up) clipped at 4x it
            self.c = 0.8 * self._c() + 0.2 * min(c, 4 * self.c_ratio * self.T(1) + 1e-5)
        elif self.c is None or self._warm == 2:  # warm-up: the first draft also read the prompt
            self.c = c
        else:
            self.c = 0.8 * self.c + 0.2 * min(c, 4 * self.c + 1e-5)

    def drop(self, seq: int) -> None:
        """Sequence `seq` left the batch: forget its acceptance estimates."""
        self.seqs.pop(seq, None)

    # --- one sequence (the engine before batching; remove with the observe shim) -------------
    def next_depth(self, k_max: int) -> int:
        return self.next_depths([0], k_max)[0]

    def observe_step(self, drafted: int, accepted: int, draft_seconds: float, verify_seconds: float) -> None:
        self.observe(BatchStep(rows=drafted + 1, width=drafted + 1, forward_seconds=verify_seconds,
                               overhead_seconds=0.0, seqs=(SeqStep(0, drafted, accepted, draft_seconds),)))

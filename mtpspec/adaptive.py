"""Adaptive draft depth (`--k auto`): a depth D_i for every running sequence, chosen each step from the
whole batch's cost, so that speculation steps aside, smoothly, as the batch fills the compute.

    tokens_i(D) = 1 + a_i1 + a_i1 a_i2 + ... + a_i1 ... a_iD   (a_ij = P(draft j ok | drafts before it ok))
    rate        = sum_i tokens_i(D_i) / (T(size) + c (phi max_i D_i + (1 - phi) sum_i D_i) + o)

T(size): a target forward over B x max_i(D_i + 1) positions (`padded`: the batched forward's cost follows that
grid), else over sum_i (D_i + 1); c: drafter seconds per draft token (its marginal part), phi: the share of it a
batched drafter (MTP, EAGLE) pays once for the batch; o: engine seconds per step. All are learned from observe()
alone (no clock). a_ij is a decayed per-sequence estimate, shrunk toward the sequence's pooled acceptance times
position j's shape over every sequence served (AcceptancePool). Plain wins ties (`margin`); a plain sequence's
estimates fade (`forget`) and it is probed at its best D >= 1 at about `explore` of the time. Never more than one
draft position deeper than any forward seen. Each rule and the failure it prevents: docs/engine.md, "Depth by batch".
"""

from __future__ import annotations

from bisect import bisect_right
from typing import Sequence

from .errors import ConfigError
from .types import BatchStep


CURVE_PENALTY = 2.0  # the cost curve is a line unless a bend halves the residual (docs/decisions.md#forward-cost-curve-penalty)
ANCHOR = 63  # forwards per size whose median in seconds is the machine-speed yardstick (docs/decisions.md#machine-speed-yardstick)


def _least_squares(x: list[list[float]], y: list[float], w: list[float]) -> list[float] | None:
    """argmin_b sum_i w_i (x_i . b - y_i)^2 by the normal equations, None if singular (plain Python: at most 3 columns,
    where numpy's per-call cost outweighs the work)."""
    m = len(x[0])
    a = [[sum(wi * xi[r] * xi[c] for xi, wi in zip(x, w)) for c in range(m)]
         + [sum(wi * xi[r] * yi for xi, yi, wi in zip(x, y, w))] for r in range(m)]
    for c in range(m):  # Gauss-Jordan with partial pivoting on [X'WX | X'Wy]
        p = max(range(c, m), key=lambda r: abs(a[r][c]))
        if abs(a[p][c]) < 1e-12 * max(1.0, abs(a[c][c])):
            return None
        a[c], a[p] = a[p], a[c]
        for r in range(m):
            if r != c:
                f = a[r][c] / a[c][c]
                a[r] = [v - f * u for v, u in zip(a[r], a[c])]
    return [a[r][m] / a[r][r] for r in range(m)]


class ForwardCost:
    """T(size): seconds of one target forward over `size` positions, learned, non-decreasing in size.

    Stored in units of the machine's current speed (a running factor: a forward's seconds over its size's median,
    once seen 3 times), so that a slow spell of a shared machine does not make the widths it ran look dearer."""

    def __init__(self, prior: Sequence[float] | None = None, t1: float | None = None, smooth: bool = False) -> None:
        self.prior = list(prior) if prior else ([1.0] if t1 is not None else [])  # prior[n-1] = T(n)/T(1)
        self.smooth = smooth  # read T off one rising curve through every drafting size seen (_quadratic)
        self.window = 15 if smooth else 5  # forwards per size whose median is its T
        self.scale = t1  # T(1) of the prior curve: given, else learned from the sizes inside the curve
        self.speed = 1.0  # the machine's current slowness: seconds = stored value x speed
        self.mean, self.count = {}, {}  # size -> the median of its last `window` forwards (stored units), and how many seen
        self.recent: dict[int, list[float]] = {}  # size -> its last `window` forwards
        self.raw: dict[int, list[float]] = {}  # size -> its last ANCHOR forwards in seconds: the speed's yardstick
        self.seen: dict[int, int] = {}  # size -> the observation count (of all sizes) when it was last seen
        self.plain: set[int] = set()  # sizes seen as plain forwards: kept out of the curve (see _build)
        self.n = 0  # observations of any size
        self._table: list[float] = []  # T(n) for n = 1..len, stored units; refitted at a new size or every 8 steps
        self._fitted: dict[int, float] = {}  # plain size -> its median when the table was last fitted
        self._upto, self._changes = 16, 0

    def observe(self, size: int, seconds: float, plain: bool = False) -> None:
        """One forward over `size` positions took `seconds`; `plain`: a step without drafts (its own kernel path)."""
        if plain:
            self.plain.add(size)
        self._changes += 1
        if size not in self.count or self._changes >= 8:
            self._table, self._changes = [], 0
        raw = self.raw.get(size, [])
        if len(raw) >= 3:  # the machine's speed: this forward against its size's usual seconds
            self.speed = 0.9 * self.speed + 0.1 * min(max(seconds / sorted(raw)[len(raw) // 2], 0.5), 2.0)
        self.raw[size] = (raw + [seconds])[-ANCHOR:]
        x = seconds / self.speed
        last = (self.recent.get(size, []) + [x])[-self.window :]
        self.recent[size], self.count[size] = last, self.count.get(size, 0) + 1
        self.mean[size] = sorted(last)[(len(last) - 1) // 2]  # the (lower) median: other jobs only ever add time
        if plain and size in self._fitted and abs(self.mean[size] - self._fitted[size]) > 0.1 * self.mean[size]:
            self._table = []  # a plain T that moved 10% refits now (docs/decisions.md: "A plain forward's T refitted")
        self.n += 1
        self.seen[size] = self.n
        s = x / (self.prior[min(size, len(self.prior)) - 1] if self.prior else 1.0)  # a T(1)
        if self.scale is None or size <= len(self.prior):
            self.scale = s if self.scale is None else 0.8 * self.scale + 0.2 * s

    def age(self, size: int) -> float:
        """Observations since `size` was last seen (inf if never)."""
        return self.n - self.seen[size] if size in self.seen else float("inf")

    def table(self, upto: int) -> list[float]:
        """[T(1), T(2), ...] in seconds at the machine's current speed, at least up to T(upto)."""
        if upto > len(self._table):
            self._upto = max(self._upto, upto)
            self._build(self._upto)
        return [t * self.speed for t in self._table]

    def at(self, size: int) -> float:
        """T(size) in seconds at the machine's current speed (one value: no copy of the table)."""
        if size > len(self._table):
            self.table(size)
        return self._table[size - 1] * self.speed

    def _build(self, upto: int) -> None:
        self._fitted = {n: self.mean[n] for n in self.plain if n in self.mean}
        knots = sorted(set(range(1, len(self.prior) + 1)) | set(self.mean))
        upto = self._upto = max(upto, knots[-1])  # through every size seen (the narrowest drafting one may lie past upto)
        blocks: list[list[float]] = []  # [value, weight, knots]: pool adjacent violators -> non-decreasing
        for n in knots:
            w0, w = (1.0 if n <= len(self.prior) else 0.0), min(self.count.get(n, 0), 10)  # the prior: one step
            prior = self.scale * self.prior[n - 1] if w0 else 0.0
            blocks.append([(w * self.mean.get(n, 0.0) + w0 * prior) / (w + w0), w + w0, 1])
            while len(blocks) > 1 and blocks[-2][0] > blocks[-1][0]:
                (v1, w1, k1), (v2, w2, k2) = blocks.pop(-2), blocks.pop()
                blocks.append([(v1 * w1 + v2 * w2) / (w1 + w2), w1 + w2, k1 + k2])
        fit = [v for v, _, k in blocks for _ in range(int(k))]
        last = knots[-1]
        j = max([i for i, n in enumerate(knots) if 2 * n <= last] or [0])  # extended with the upper half's slope
        slope = (fit[-1] - fit[j]) / (last - knots[j]) if last > knots[j] else 0.0
        self._table = []
        for n in range(1, upto + 1):
            i = bisect_right(knots, n) - 1  # the last size seen <= n
            if i < 0:  # below every size seen: proportional (optimistic: trying it is how it is learned)
                t = fit[0] * n / knots[0]
            elif n >= last:  # past every size seen: flat to half as far again (so it is tried), then the slope
                t = fit[-1] + slope * max(n - 1.5 * last, 0.0)
            else:  # in a gap: flat to its middle (the least a non-decreasing T can be), then up to the next
                mid = (knots[i] + knots[i + 1]) / 2
                t = fit[i] + (fit[i + 1] - fit[i]) * max(n - mid, 0.0) / (knots[i + 1] - mid)
            self._table.append(t)
        # the curve only through drafting forwards: a plain one takes another kernel path (the DeltaNet's recurrent
        # step), and a joint fit made the first draft positions look free (docs/decisions.md: "Plain forwards priced apart")
        drafting = [n for n in knots if n not in self.plain]
        q = self._quadratic(drafting) if self.smooth else None
        if q is not None:  # from the smallest drafting size on: the curve, made non-decreasing
            n0 = drafting[0]
            first = q[0] + q[1] * n0 + q[2] * n0 * n0
            for n in range(1, n0):  # a plain forward: no dearer than the narrowest drafting one (one slow cold step)
                self._table[n - 1] = min(self._table[n - 1], first)
            top, last = self._table[n0 - 2] if n0 > 1 else 0.0, max(n for n in drafting if n in self.mean)
            tangent = q[1] + 2 * q[2] * last  # past the widest drafting size: a line, the curve's slope there
            for n in range(n0, upto + 1):
                m = min(n, last)
                top = max(top, q[0] + q[1] * m + q[2] * m * m + tangent * (n - m))
                self._table[n - 1] = top

    def _quadratic(self, knots: list[int]) -> tuple[float, float, float] | None:
        """T(n) = a + b n + c n^2 rising from the smallest knot n0 (b, c >= 0 in n - n0; a line unless the bend pays,
        CURVE_PENALTY), least squares through each size's median weighted by its count (up to 10); None under 3
        sizes. One curve, because a size's own median wanders as much as a draft position adds."""
        pts = [(n, self.mean[n], float(min(self.count[n], 10))) for n in knots if n in self.mean]
        if len(pts) < 3:
            return None
        # a bend needs 4 sizes: through 3 it fits exactly
        shapes = ((0, 1, 2), (0, 2), (0, 1), (0,)) if len(pts) >= 4 else ((0, 1), (0,))
        n0, top = pts[0][0], max(n for n, _, _ in pts)
        data = [((n - n0) / (top - n0), v, w) for n, v, w in pts]  # u: 0 at n0, 1 at the largest size
        y, w = [v for _, v, _ in data], [x for _, _, x in data]
        best = None  # (residual, [a, b, c] in u): the feasible fit of least residual over the active sets (b, c >= 0)
        for free in shapes:
            coef = _least_squares([[u**j for j in free] for u, _, _ in data], y, w)
            if coef is None:
                continue
            full = [0.0, 0.0, 0.0]
            for j, v in zip(free, coef):
                full[j] = v
            if min(full[1:]) >= 0:
                r = sum(wt * (full[0] + full[1] * u + full[2] * u * u - v) ** 2 for u, v, wt in data)
                r *= CURVE_PENALTY if full[2] > 0 else 1.0
                if best is None or r < best[0]:
                    best = (r, full)
        a, b, c = best[1]  # the constant alone is always feasible
        s = 1.0 / (top - n0)  # back to n: a + b s (n - n0) + c s^2 (n - n0)^2
        return a - b * s * n0 + c * s * s * n0 * n0, b * s - 2 * c * s * s * n0, c * s * s


class AcceptancePool:
    """Acceptance by draft position over every sequence served (decayed: ~500 sequence steps of memory): each new
    sequence's prior, and how each position runs against a sequence's average."""

    def __init__(self, k: int, prior: float, decay: float = 0.998) -> None:
        self.passed, self.reached = [0.0] * k, [0.0] * k  # decayed counts per position
        self.expected = [0.0] * k  # per position, the sum over checks of the sequence's own pooled acceptance
        self.prior, self.decay, self.version = prior, decay, 0

    def learn(self, drafted: int, accepted: int, level: float) -> None:
        """A sequence whose pooled acceptance is `level` had `accepted` of `drafted` drafts accepted."""
        self.version += 1
        for i in range(min(drafted, len(self.passed))):
            checked = i <= accepted  # every accepted position and the first miss
            self.passed[i] = self.decay * self.passed[i] + (1.0 if i < accepted else 0.0)
            self.reached[i] = self.decay * self.reached[i] + checked
            self.expected[i] = self.decay * self.expected[i] + (level if checked else 0.0)

    def level(self) -> float:
        """Acceptance per checked draft position, over every position (the prior, as 2 observations, until seen)."""
        return (sum(self.passed) + 2.0 * self.prior) / (sum(self.reached) + 2.0)

    def shape(self) -> list[float]:
        """Position j's acceptance over the average acceptance of the sequences that reached it (not the pool's: deep
        positions are reached mostly by good sequences), shrunk toward 1 by 2 observations."""
        return [(p + 2.0) / (e + 2.0) for p, e in zip(self.passed, self.expected)]


class SeqAcceptance:
    """One sequence's acceptance by draft position, and its probing state."""

    def __init__(self, k: int, prior: float) -> None:
        self.passed, self.reached = [0.0] * k, [0.0] * k  # decayed counts per draft position
        self.pool_passed, self.pool_reached = 2.0 * prior, 2.0  # pooled, with a prior of 2
        self.long_passed, self.long_reached = 0.0, 0.0  # acceptance over ~200 drafting steps
        # plain steps in a row that could have drafted, plain steps between probes, probing now, last D chosen
        self.plain_run, self.probe_wait, self.probing, self.asked = 0, 0, False, 0
        self.drafted_last = False  # it drafted in its last step (so its drafter has no tokens to catch up on)
        self.drafts = 0  # its drafting steps so far
        self._gains: list[float] | None = None  # until the estimates (or the pool's shape: _version) change
        self._version = 0

    def gains(self, d: int, shrink: float, shape: list[float] | None = None, version: int = 0) -> list[float]:
        """Marginal expected tokens of draft positions 1..d: a1, a1 a2, ..., each a_j shrunk toward the sequence's
        pooled acceptance times `shape[j]` (how position j runs against the average, over every sequence)."""
        if self._gains is None or self._version != version or len(self._gains) < min(d, len(self.passed)):
            pooled, self._gains, run, self._version = self.pool_passed / self.pool_reached, [], 1.0, version
            for j, (p, r) in enumerate(zip(self.passed[:d], self.reached[:d])):  # only as deep as asked
                run *= (p + shrink * min(pooled * (shape[j] if shape else 1.0), 1.0)) / (r + shrink)
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
        self.passed, self.reached = [x * f for x in self.passed], [x * f for x in self.reached]
        w = 2.0 * (1.0 - f)  # the pool drifts toward the long-run acceptance (the prior until drafts are seen)
        target = (self.long_passed + 2.0 * prior) / (self.long_reached + 2.0)
        self.pool_passed, self.pool_reached = f * self.pool_passed + w * target, f * self.pool_reached + w


Allocation = tuple[list[int], float, float]  # (D_i per sequence, expected tokens, rate with the margin)


def allocate_ragged(gains: list[list[float]], B: int, c: float, phi: float, o: float, margin: float,
                    T: list[float]) -> Allocation:
    """Forward over sum_i (D_i + 1) rows: the m largest marginal gains of the batch, for the best m."""
    order = sorted([(g, i) for i, gs in enumerate(gains) for g in gs], reverse=True)
    n, tokens, rate = 0, float(B), B / (T[B - 1] + o)
    total, drafters, counts, levels = tokens, 0, [0] * B, 0
    for m, (g, i) in enumerate(order, 1):
        total += g
        drafters += counts[i] == 0  # a sequence's hidden costs count once it drafts
        counts[i] += 1
        levels = max(levels, counts[i])
        r = total / ((T[B + m - 1] + c * (phi * levels + (1 - phi) * m) + o) * (1.0 + margin * drafters))
        if r > rate * 1.0001:  # ties go to fewer drafts
            n, tokens, rate = m, total, r
        elif r < 0.8 * rate:  # well past the best (the rate is one-humped but for steps in T)
            break
    ds = [0] * B
    for _, i in order[:n]:
        ds[i] += 1
    return ds, tokens, rate


def allocate_padded(gains: list[list[float]], B: int, c: float, phi: float, o: float, margin: float,
                    T: list[float]) -> Allocation:
    """Forward over B x W rows: for each W, every sequence drafts its positions below W whose tokens pay
    for their drafting at the best rate so far (the forward costs the same); the best W kept."""
    ds, tokens, drafted, drafters = [0] * B, float(B), 0, 0
    best = ([0] * B, tokens, B / (T[B - 1] + o))
    for w in range(1, max(map(len, gains)) + 1):  # w draft positions: width w + 1
        for i, gs in enumerate(gains):
            if ds[i] == w - 1 and len(gs) >= w and gs[w - 1] >= (1 - phi) * c * best[2]:
                ds[i], tokens, drafted, drafters = w, tokens + gs[w - 1], drafted + 1, drafters + (w == 1)
        r = tokens / ((T[B * (w + 1) - 1] + c * (phi * w + (1 - phi) * drafted) + o) * (1.0 + margin * drafters))
        if r > best[2] * 1.0001:
            best = (list(ds), tokens, r)
        elif r < 0.8 * best[2]:
            break
    return best


class AdaptiveDepth:
    """A DepthPolicy: next_depths(seqs, k_max) -> D_i per sequence, observe(BatchStep) after each step."""

    def __init__(
        self,
        k_max: int = 8,
        verify_cost: Sequence[float] | None = None,  # prior T(n)/T(1), r[n-1] for n = 1.. positions; None = flat
        draft_cost: float | None = None,  # prior drafter seconds per drafted token (None: learn)
        target_cost: float | None = None,  # prior seconds of a one-position target forward T(1) (None: learn)
        decay: float = 0.97,  # weight of the past in the acceptance estimates (about 30 steps of memory)
        prior_acceptance: float = 0.6,  # a new sequence's acceptance until the pool has seen drafts
        shrink: float = 32.0,  # pseudo-observations pulling a_j toward pooled x shape (docs/decisions.md#acceptance-shrink)
        forget: float = 0.98,  # per plain step, acceptance evidence fades toward its long-run level
        explore: float = 0.02,  # share of time that probing may cost
        probe_min: int = 4,  # fewest plain steps between probes
        margin: float = 0.03,  # speculation must promise this much over plain decoding to be chosen ...
        cost_margin: float = 0.1,  # ... plus this times c / T(1): a costly drafter's hidden costs
        padded: bool = True,  # price a forward by its grid, B x its widest rows
        batch_probe: int = 16,  # after this many all-plain steps of a batch (B > 1), one step where every sequence drafts 1
        width_probe: int = 16,  # padded: a grid width beside the chosen one, unseen for this many steps, is run once
        warmup_depth: int = 3,  # the depth of the drafting steps before the drafter's cost is known
        start_steps: int = 6,  # a new sequence's first drafting steps in a batch: warmup_depth deep (beside older ones: no deeper)
        pool: AcceptancePool | None = None,  # acceptance over every sequence served (shared by ByBatchSize's classes)
        smooth_cost: bool = False,  # T off one rising curve through every drafting size seen (ByBatchSize: for B >= 2)
    ) -> None:
        if k_max < 0:
            raise ConfigError(f"k_max must be >= 0, got {k_max}")
        self.k_max, self.T, self.padded = k_max, ForwardCost(verify_cost, target_cost, smooth_cost), padded
        self.decay, self.shrink, self.forget = decay, shrink, forget
        self.explore, self.probe_min, self.margin, self.cost_margin = explore, probe_min, margin, cost_margin
        # prior drafter cost relative to T(1), scaled by the learned T(1) until drafts are seen
        self.c_ratio = draft_cost / target_cost if (draft_cost is not None and target_cost) else None
        self.c_prior = draft_cost if self.c_ratio is None else None  # seconds per drafted token, given without a T(1)
        self.c: float | None = None  # drafter cost per drafted token in plain forwards at its batch size (holds across sizes)
        self.slope: float | None = None  # its marginal part (see _marginal), from decayed sums of 1, u, u^2, y, u y
        self._line = [0.0] * 5
        self.o = 0.0  # engine overhead seconds per step
        self.phi = 0.0  # share of drafting paid once per draft position for the whole batch (batched drafters)
        self._fit = [0.0] * 5  # decayed sums for phi: levels^2, levels n, n^2, levels y, n y
        self._steps, self._probe_base = 0, probe_min
        self._warm = 1 if (draft_cost is not None and target_cost is not None) else 0  # drafting steps learned from
        self.seqs: dict[int, SeqAcceptance] = {}
        self.pool = pool or AcceptancePool(max(k_max, 1), prior_acceptance)
        self._width_seen = 1  # the widest forward observed (1 + its deepest draft)
        self.batch_probe, self._all_plain, self._probe_left = batch_probe, 0, 0  # all-plain batch steps in a row; probe steps left
        self.width_probe = width_probe
        self.warmup_depth, self.start_steps = warmup_depth, start_steps

    def _c(self) -> float:
        """Drafter cost per drafted token, in plain forwards at the current batch size: observed, else the prior
        (a ratio to T(1), or seconds over the learned T(1)), else half a forward."""
        if self.c is not None:
            return self.c
        if self.c_prior is not None:
            return self.c_prior / self.T.at(1)
        return self.c_ratio if self.c_ratio is not None else 0.5

    def _marginal(self) -> float:
        """What one more draft position costs, in plain forwards: the slope of drafting seconds over drafting units
        once different widths were seen, else their ratio (a step's fixed part, the drafter's catch-up, is paid
        whatever the depth, so it must not be priced per position)."""
        c = self._c()
        return min(max(self.slope, 0.25 * c), c) if self.slope is not None and self.c is not None else c

    def _new(self, seq: int) -> SeqAcceptance:
        self.seqs[seq] = SeqAcceptance(max(self.k_max, 1), self.pool.level())
        return self.seqs[seq]

    def next_depths(self, seqs: Sequence[int], k_max: int | Sequence[int]) -> list[int]:
        """D_i for each running sequence id (0 = a plain step for it); k_max may be per sequence (room left)."""
        caps = [min(k, self.k_max) for k in ([k_max] * len(seqs) if isinstance(k_max, int) else k_max)]
        states = [self.seqs.get(s) or self._new(s) for s in seqs]
        if not states:
            return []
        if self.T.scale is None or (self.c is None and self.c_ratio is None and self.c_prior is None) or self._warm < 1:
            # warm-up: a plain step (T at this batch size: the unit of the drafter's cost), then two drafting steps
            d = self.warmup_depth if len(caps) in self.T.count else 0
            ds = [max(min(d, k), 0) for k in caps]
        else:  # never more than one draft position deeper than any step so far: T is known only where it was seen
            ds = [min(d, self._width_seen) for d in self._choose(states, caps)]
            ds = self._probe_batch(self._start(ds, states, caps), caps)
        for st, d in zip(states, ds):
            st.asked = d
        return ds

    def _start(self, ds: list[int], states: list[SeqAcceptance], caps: list[int]) -> list[int]:
        """A new sequence's first `start_steps` drafting steps in a batch: warmup_depth deep where the whole batch is
        new, else as deep as the others draft, never deeper (its estimates are still a prior). Not in a plain step, a
        batch probe, or for a lone sequence (docs/decisions.md#start-rule)."""
        new = [st.drafts < self.start_steps for st in states]
        if not any(ds) or not any(new) or len(states) == 1:
            return ds
        top = max([d for d, n in zip(ds, new) if not n], default=self.warmup_depth)
        return [min(max(d, min(self.warmup_depth, top)), top, cap) if n else d for d, n, cap in zip(ds, new, caps)]

    def _probe_batch(self, ds: list[int], caps: list[int]) -> list[int]:
        """A batch plain `batch_probe` steps in a row drafts one token everywhere for two steps (the first is the
        drafter's catch-up), so the costs that kept it plain are measured again at this batch size."""
        if self._probe_left and len(ds) >= 2 and max(caps) >= 1:
            self._probe_left -= 1
            return [max(d, min(1, cap)) for d, cap in zip(ds, caps)]
        if len(ds) < 2 or not self.batch_probe or any(ds) or max(caps) < 1:
            self._all_plain = 0
            return ds
        self._all_plain += 1
        if self._all_plain < self.batch_probe:
            return ds
        self._all_plain, self._probe_left = 0, 1
        return [min(1, cap) for cap in caps]

    def _choose(self, states: list[SeqAcceptance], caps: list[int]) -> list[int]:
        B, phi, o = len(states), self.phi, self.o
        shape, version = self.pool.shape(), self.pool.version
        deep = self._width_seen  # never more than one draft position deeper than any step so far (see next_depths)
        gains = [st.gains(min(cap, deep), self.shrink, shape, version) if cap > 0 else [] for st, cap in
                 zip(states, caps)]
        T = self.T.table(B * (max(caps) + 2))  # T[size - 1]
        c = self._marginal() * T[B - 1]  # seconds per drafted token at this batch size
        # per drafting sequence; the cost part only for the share paid per sequence (1 - phi), not a batched drafter's
        margin = (self.margin + self.cost_margin * (1.0 - phi) * min(c / T[0], 1.0)) / B
        allocate = allocate_padded if self.padded else allocate_ragged
        ds, tokens, rate = allocate(gains, B, c, phi, o, margin, T)
        rows, width, drafted = B + sum(ds), max(ds) + 1, sum(ds)

        def step(d: int) -> float:  # the step's seconds if one more sequence drafts d (as probes move rows, width)
            forward = T[B * max(width, d + 1) - 1] if self.padded else T[rows + d - 1]
            return forward + c * (phi * max(width - 1, d) + (1 - phi) * (drafted + d)) + o

        # steps between probes so that they cost `explore` (padded: any probe serves every sequence)
        share = (1 if self.padded else B) * (step(1) - step(0)) / step(0)
        self._probe_base = max(self.probe_min, int(share / self.explore + 0.5))
        pays: dict[int, bool] = {}
        for i, st in enumerate(states):
            if caps[i] <= 0 or ds[i] > 0:
                st.plain_run = 0
                continue
            if not st.probing:  # drafts that could not pay even if all accepted: no fading, no probe
                # (padded: asked with every sequence drafting, as one alone never pays for a grid B rows wider)
                key = -1 if self.padded else caps[i]
                if key not in pays:
                    perfect = [[1.0] * k for k in caps] if self.padded else gains[:i] + [[1.0] * caps[i]] + gains[i + 1 :]
                    pays[key] = allocate(perfect, B, c, phi, o, margin, T)[2] > rate * 1.0001
                if not pays[key]:
                    continue
                st.plain_run += 1
                st.fade(self.forget, self.pool.level())
                st.probe_wait = st.probe_wait or (self._probe_base if st.long_reached > 8 else self.probe_min)
                if st.plain_run < st.probe_wait:
                    continue
                st.probing, st.plain_run = True, 0
            gs = gains[i]  # a probe (or one that has not drafted yet): its best D >= 1 on top of the batch
            d = max(range(1, len(gs) + 1), key=lambda n: (tokens + sum(gs[:n])) / step(n))
            ds[i], rows, width, drafted, tokens = d, rows + d, max(width, d + 1), drafted + d, tokens + sum(gs[:d])
        if self.padded and any(ds):
            ds = self._probe_width(ds, caps, B)
            width = max(ds) + 1
        if self.padded:  # the forward is as wide as its widest: up to that, drafting costs only the drafter
            for i, gs in enumerate(gains):
                while ds[i] < min(len(gs), width - 1) and gs[ds[i]] >= (1 - phi) * c * rate:
                    ds[i], states[i].plain_run = ds[i] + 1, 0
        return ds

    def _probe_width(self, ds: list[int], caps: list[int], B: int) -> list[int]:
        """A grid width beside the chosen one not run for `width_probe` steps runs once (one draft position more for
        the deepest sequences that may, or one less), so a price set in a slow spell does not keep it out for good."""
        w = max(ds)  # the deepest draft: the grid is w + 1 wide

        def stale(size: int) -> bool:  # a width seen once or twice is seen again sooner: one sample may be a spike
            return self.T.age(size) >= self.width_probe * min(self.T.count.get(size, 0) + 1, 3) / 3

        if not self.width_probe:
            return ds
        if stale(B * (w + 2)) and any(d == w < cap for d, cap in zip(ds, caps)):
            return [d + 1 if d == w < cap else d for d, cap in zip(ds, caps)]
        if stale(B * w):
            return [d - 1 if d == w else d for d in ds]
        return ds

    def observe(self, step: BatchStep) -> None:
        """After each engine step: learn T, c, o and each sequence's acceptance."""
        self.T.observe(len(step.seqs) * step.width if self.padded else step.rows, step.forward_seconds, step.width == 1)
        o = step.overhead_seconds  # a pause (a full collection) clipped at 4x the running overhead
        self.o = o if self._steps == 0 else 0.8 * self.o + 0.2 * min(o, 4 * self.o + 1e-5)
        self._width_seen = max(self._width_seen, step.width)
        self._steps += 1
        n, levels = sum(s.drafted for s in step.seqs), max((s.drafted for s in step.seqs), default=0)
        t_plain = self.T.at(len(step.seqs))  # a plain step's forward at this batch size
        # drafting seconds = c (phi levels + (1 - phi) n) in plain forwards at this batch size; learned only where
        # that plain forward was seen, and only from steps whose drafting sequences also drafted in their last step
        # (after plain steps a drafter first catches up on the tokens it missed, inside the same call)
        clean = all(s.drafted == 0 or (s.seq in self.seqs and self.seqs[s.seq].drafted_last) for s in step.seqs)
        if n > 0 and clean and len(step.seqs) in self.T.count:
            y = sum(s.draft_seconds for s in step.seqs if s.drafted > 0) / t_plain  # in plain forwards
            if self.c is not None:
                y = min(y, 4 * self.c * (self.phi * levels + (1 - self.phi) * n) + 1e-5)  # a slow call: clipped
            if not self._fit[0] and any(s.batched for s in step.seqs):
                self.phi = 1.0  # a batched drafter pays per draft position, until a fit says otherwise
            x = (levels * levels, levels * n, n * n, levels * y, n * y)
            self._fit = [0.99 * v + u for v, u in zip(self._fit, x)]
            ll, ln, nn, ly, ny = self._fit  # least squares y = a levels + b n, once they vary apart
            det = ll * nn - ln * ln
            if det > 0.01 * ll * nn:
                a, b = max((ly * nn - ny * ln) / det, 0.0), max((ny * ll - ly * ln) / det, 0.0)
                self.phi = a / (a + b) if a + b > 0 else self.phi
            u = self.phi * levels + (1 - self.phi) * n  # drafting units of this step
            self._line = [0.99 * v + x for v, x in zip(self._line, (1.0, u, u * u, y, u * y))]
            s0, su, suu, sy, suy = self._line  # least squares y = a + slope u, once u varies
            if s0 * suu - su * su > 0.01 * s0 * suu:
                self.slope = (s0 * suy - su * sy) / (s0 * suu - su * su)
            self._learn_cost(y / u)
        for s in step.seqs:
            st = self.seqs.get(s.seq) or self._new(s.seq)
            st.drafted_last = s.drafted > 0
            st.drafts += s.drafted > 0
            if s.drafted > 0:
                self.pool.learn(s.drafted, s.accepted, st.pool_passed / st.pool_reached)
                st.learn(s.drafted, s.accepted, self.decay)
                if st.probing:  # a probe that paid resets the wait; one that failed doubles it (up to 4x)
                    base = self._probe_base
                    st.probe_wait = base if s.accepted > 0 else min(2 * (st.probe_wait or base), 4 * base)
                    st.probing = False
            elif st.asked > 0 and self.c is None and self.c_ratio is None and self.c_prior is None:
                self.c = s.draft_seconds / t_plain  # asked for drafts, got none (n-gram miss): the cost of asking

    def _learn_cost(self, c: float) -> None:
        self._warm += 1
        if self.c_ratio is None and self.c_prior is None and self.c is None:
            self.c = c
        else:  # a running mean (from the prior, if any), a slow call (a catch-up) clipped at 4x it
            self.c = 0.8 * self._c() + 0.2 * min(c, 4 * self._c() + 1e-5)

    def drop(self, seq: int) -> None:
        """Sequence `seq` left the batch: forget its acceptance estimates."""
        self.seqs.pop(seq, None)


class ByBatchSize:
    """A DepthPolicy for a batch whose size wanders (a server): one AdaptiveDepth per batch-size class (1, 2-3, 4-7,
    ...), each learning its own costs, all sharing one AcceptancePool (docs/decisions.md#one-depth-policy-per-batch-size-class)."""

    def __init__(self, **options) -> None:
        self.options, self.policies = options, {}
        self.padded = options.get("padded", True)  # how its forwards are priced (every class alike)
        self.policy(1)  # bad options are an error here, not at the first step
        self.options["pool"] = self.policies[1].pool  # acceptance does not depend on the batch size: one pool

    def policy(self, batch: int) -> AdaptiveDepth:
        """The policy for a batch of `batch` sequences."""
        size_class = batch.bit_length()
        if size_class not in self.policies:
            self.policies[size_class] = AdaptiveDepth(**{"smooth_cost": size_class > 1, **self.options})
        return self.policies[size_class]

    def next_depths(self, seqs: Sequence[int], k_max: int | Sequence[int]) -> list[int]:
        return self.policy(len(seqs)).next_depths(seqs, k_max)

    def observe(self, step: BatchStep) -> None:
        self.policy(len(step.seqs)).observe(step)  # the step ran the batch next_depths was asked for

    def drop(self, seq: int) -> None:
        for p in self.policies.values():
            p.drop(seq)

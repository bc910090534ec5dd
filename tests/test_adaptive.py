"""AdaptiveDepth (`--k auto`) on synthetic observations: D = 0 when drafts never pay, deep D when they do,
and depth by batch: shrinking smoothly to 0 as the batch fills the compute."""

from __future__ import annotations

import random
from pathlib import Path

import pytest

import mtpspec.adaptive
from mtpspec.adaptive import AdaptiveDepth, ByBatchSize, ForwardCost
from mtpspec.errors import ConfigError
from mtpspec.types import BatchStep, SeqStep


def drive(policy: AdaptiveDepth, steps: int, accept_rate: float, draft_cost: float, verify: float = 1e-3, k_max: int = 8) -> list[int]:
    """One sequence, `steps` steps: each drafted token costs draft_cost s, a forward `verify` s whatever its
    rows; acceptance is deterministic: the first round(accept_rate * d) drafts survive."""
    chosen = []
    for _ in range(steps):
        d = policy.next_depths([0], k_max)[0]
        chosen.append(d)
        acc = int(round(accept_rate * d)) if accept_rate < 1 else d
        policy.observe(BatchStep(rows=d + 1, width=d + 1, forward_seconds=verify, overhead_seconds=0.0,
                                 seqs=(SeqStep(0, d, acc, draft_cost * d),)))
    return chosen


def steep(rows: int) -> float:
    """A forward that rides on idle compute up to 8 rows, then pays for every row."""
    return 1e-3 * (1.0 + 0.5 * max(rows - 8, 0))


def drive_batch(policy: AdaptiveDepth, steps: int, accept: list[float], draft_cost: float = 2e-5,
                cost=steep, k_max: int | list[int] = 8, seed: int = 0, batched: bool = False) -> list[list[int]]:
    """len(accept) sequences; sequence i accepts each draft position with probability accept[i]; the
    forward costs cost(its positions): B x width when the policy expects padding, else sum of D_i + 1;
    `batched`: the drafting sequences drafted together (SeqStep.batched, as the MTP head does)."""
    rng, chosen = random.Random(seed), []
    for _ in range(steps):
        ds = policy.next_depths(list(range(len(accept))), k_max)
        seqs = []
        for i, (d, a) in enumerate(zip(ds, accept)):
            n = 0
            while n < d and rng.random() < a:
                n += 1
            seqs.append(SeqStep(i, d, n, draft_cost * d, batched and d > 0))
        rows, width = sum(d + 1 for d in ds), max(ds) + 1
        size = len(ds) * width if policy.padded else rows  # the forward's positions, padding included
        policy.observe(BatchStep(rows=rows, width=width, forward_seconds=cost(size), overhead_seconds=0.0,
                                 seqs=tuple(seqs)))
        chosen.append(ds)
    return chosen


RATIO = [1.0, 1.1, 1.15, 1.2, 1.2, 1.25, 1.3, 1.3, 1.4]  # T(k)/T(1) as measured for stories260K
STEEP = [steep(n) / steep(1) for n in range(1, 145)]


# --- one sequence ----------------------------------------------------------------------------
def test_zero_acceptance_chooses_plain_and_keeps_probing():
    p = AdaptiveDepth(k_max=8, verify_cost=RATIO)
    chosen = drive(p, 300, accept_rate=0.0, draft_cost=1e-5)
    tail = chosen[50:]
    assert tail.count(0) / len(tail) > 0.8  # mostly plain steps (retries: evidence fades)
    assert any(d > 0 for d in tail)  # ... but it still probes
    assert all(d <= 2 for d in tail)


def test_drafter_that_can_never_pay_is_never_probed():
    """Costly drafts (a target step each) with zero acceptance: plain after warm-up, no probes."""
    p = AdaptiveDepth(k_max=8, verify_cost=RATIO, draft_cost=1e-3, target_cost=1e-3)
    chosen = drive(p, 300, accept_rate=0.0, draft_cost=1e-3)
    assert chosen.count(0) == 300


def test_high_acceptance_cheap_drafter_goes_deep():
    p = AdaptiveDepth(k_max=8)
    chosen = drive(p, 100, accept_rate=1.0, draft_cost=1e-6)
    assert min(chosen[10:]) >= 6


def test_recovers_when_acceptance_returns():
    p = AdaptiveDepth(k_max=8)
    drive(p, 200, accept_rate=0.0, draft_cost=1e-4)
    chosen = drive(p, 200, accept_rate=1.0, draft_cost=1e-4)
    assert max(chosen[-50:]) >= 4 and chosen[-1] >= 4


def test_expensive_draft_with_perfect_acceptance_stays_plain():
    """A drafter as costly as the target (the q80 twin) cannot pay: tokens(D)/time(D) <= 1 step."""
    p = AdaptiveDepth(k_max=8, verify_cost=RATIO)
    chosen = drive(p, 200, accept_rate=1.0, draft_cost=1e-3)
    assert chosen[100:].count(0) > 80


def test_respects_k_max_and_engine_cap():
    p = AdaptiveDepth(k_max=3)
    assert all(d <= 3 for d in drive(p, 50, 1.0, 1e-6))
    assert all(d <= 2 for d in drive(p, 20, 1.0, 1e-6, k_max=2))
    with pytest.raises(ConfigError):
        AdaptiveDepth(k_max=-1)


def test_same_size_draft_model_stays_plain_small_one_goes_deep():
    """Perfect acceptance: a drafter at 0.9 of a target step cannot clear the margin; one at 0.1 can."""
    costly = AdaptiveDepth(k_max=8, verify_cost=RATIO, draft_cost=0.9e-3, target_cost=1e-3)
    assert set(drive(costly, 100, accept_rate=1.0, draft_cost=0.9e-3)) == {0}
    cheap = AdaptiveDepth(k_max=8, verify_cost=RATIO, draft_cost=0.1e-3, target_cost=1e-3)
    # warm-up (a plain step, then drafting), the sequence's first drafting steps at warmup_depth (start_steps), then deep
    assert min(drive(cheap, 100, accept_rate=1.0, draft_cost=0.1e-3)[1 + cheap.start_steps :]) >= 4


# --- the forward's cost ----------------------------------------------------------------------
def test_forward_cost_is_learned_monotone_and_extended():
    t = ForwardCost(RATIO, t1=1e-3)
    assert t.table(9)[0] == pytest.approx(1e-3) and t.table(9)[8] == pytest.approx(1.4e-3)
    for rows, s in [(4, 2e-3), (5, 1.5e-3), (16, 8e-3)] * 5:  # noisy: 5 rows measured cheaper than 4
        t.observe(rows, s)
    curve = t.table(40)
    assert all(x <= y for x, y in zip(curve, curve[1:]))  # non-decreasing
    assert curve[15] == pytest.approx(8e-3, rel=0.05)  # observed sizes dominate the prior
    assert curve[31] > curve[15] * 1.5  # extended past the last size with the slope seen below it


def convex(size: int) -> float:
    """A batch of 8's forward as measured on the demo model with plain and drafting sizes read as one curve (13 ms
    plain, ~2.5 ms per grid column, a little convex); apart, the demo's drafting widths measured straight or bent down."""
    return 1e-3 * (13 + 0.3 * size + 0.002 * size * size)


def test_smooth_forward_cost_is_one_convex_curve_through_noisy_sizes():
    """Each size's median wanders with the machine; one quadratic through all of them keeps their shape (samples
    0.9-1.3x the cost, ~33 per size: each size's median of 15 is off by ~4%, the curve's ratios by up to 9%)."""
    rng, t = random.Random(0), ForwardCost(smooth=True)
    for _ in range(200):
        n = 8 * rng.randint(1, 6)
        t.observe(n, convex(n) * rng.uniform(0.9, 1.3))  # other jobs only ever add time
    curve = t.table(64)
    assert all(x <= y for x, y in zip(curve, curve[1:]))
    for w in range(2, 7):  # the shape, relative to a plain step
        assert curve[8 * w - 1] / curve[7] == pytest.approx(convex(8 * w) / convex(8), rel=0.1)
    assert all(type(x) is float for x in curve)  # not numpy scalars (the policy's arithmetic stays plain Python)


def stepped(size: int, batch: int = 8) -> float:
    """A batch of 8's forward with the demo's step at the first draft position: plain 15 ms (the DeltaNet's recurrent
    step), then 23.2 ms at width 2 and 3 ms per width more (its chunk form and per-position rollback states)."""
    return 1e-3 * (15.0 if size == batch else 23.2 + 3.0 * (size // batch - 2))


def test_a_plain_forwards_cost_is_refitted_as_soon_as_its_median_moves():
    """The table is refitted every 8 observations (or at a new size); a plain size whose median moved 10% is refitted
    at once. Eight steps late, a batch priced its plain forward at the old 14 ms while it ran 20 ms, and stayed plain."""
    t = ForwardCost(smooth=True)
    for _ in range(3):
        for w in (1, 2, 3, 4):
            t.observe(4 * w, (14e-3 if w == 1 else 20e-3 + 2.5e-3 * w), plain=w == 1)
    assert t.at(4) == pytest.approx(14e-3, rel=0.02)
    seen = []
    for _ in range(6):  # the plain forward, slower now (14 -> 20 ms): its lower median of 15 moves on the 4th
        t.observe(4, 20e-3, plain=True)
        seen.append((t.at(4) / t.speed, t.mean[4]))  # the table against the median, in stored units
    moved = next(i for i, (x, _) in enumerate(seen) if x > 16e-3)
    assert moved == 3 and seen[moved][0] == pytest.approx(seen[moved][1], rel=1e-9)  # the step it moved, not 8 later


def test_smooth_cost_fits_drafting_forwards_only_and_keeps_plain_its_own():
    """A plain forward takes another kernel path: the curve goes through drafting sizes only, and plain keeps its own
    median. Through both, the convex fit flattened the step (its vertex inside the range, the running max lifting
    plain toward width 2), pricing the first draft position at about half its cost."""
    rng, t = random.Random(0), ForwardCost(smooth=True)
    for _ in range(300):
        w = rng.randint(1, 6)
        t.observe(8 * w, stepped(8 * w) * rng.uniform(0.95, 1.05), plain=w == 1)
    curve = t.table(64)
    assert all(x <= y for x, y in zip(curve, curve[1:]))
    assert curve[7] == pytest.approx(15e-3, rel=0.05)  # plain: its own median
    for w in range(2, 7):  # the drafting widths: the line through them
        assert curve[8 * w - 1] == pytest.approx(stepped(8 * w), rel=0.05)
    assert (curve[15] - curve[7]) / (curve[23] - curve[15]) > 2  # the first draft position: dearer than the next


def test_smooth_cost_stays_increasing_when_a_narrow_width_was_slow_and_plain_was_cold():
    """A width run rarely (2, probes only) measured 30% slow, and the batch's few plain forwards include its first
    decode step, cold (2x): the curve still rises by each width's cost (a convex fit alone put its vertex inside the
    range, and the running max made widths 2-5 look free), and plain is priced no dearer than width 2."""
    t = ForwardCost(smooth=True)
    t.observe(8, 2 * stepped(8), plain=True)  # the first decode step
    for _ in range(2):
        t.observe(16, 1.3 * stepped(16))
    for _ in range(10):
        for w in range(3, 7):
            t.observe(8 * w, stepped(8 * w))
    curve = t.table(64)
    assert curve[7] <= curve[15]
    for w in range(3, 6):  # each width dearer than the last by about its 3 ms
        assert (curve[8 * w + 7] - curve[8 * w - 1]) == pytest.approx(3e-3, rel=0.3)


def test_smooth_cost_answers_below_its_narrowest_drafting_size():
    """A batch class first run by 16 sequences near their budgets: its warm-up drafted at widths 2-4 (each as deep as
    its room allowed), and the first table asked for is T(16), a plain step's, below every drafting size. The table
    is built through every size seen (it was built to 16 and indexed to 31: IndexError)."""
    t = ForwardCost(smooth=True)
    t.observe(16, stepped(16, 16), plain=True)
    for w in (4, 3, 2, 4, 3):
        t.observe(16 * w, stepped(16 * w, 16))
    assert t.at(16) == pytest.approx(15e-3)
    assert t.at(32) < t.at(48) < t.at(64)


def test_a_width_not_run_for_600_forwards_keeps_its_price():
    """The machine's speed carries a slow spell to the widths not run during it. Judged against a median in its own
    units, it drifted: a shared machine's noise only adds time, so a forward averaged ~1.08 of the median, each one
    raised the speed and the running width's median fell to match (its product stayed right). Over 600 forwards at
    one width the speed doubled, and a width last run before them was priced 2x (demo, 8 sequences: 63 ms at width 4,
    measured 34), so the batch kept to the width it was running. Noise: 1 + an exponential of mean 0.08."""
    rng, t = random.Random(0), ForwardCost(smooth=True)
    noise = lambda: 1.0 + rng.expovariate(1 / 0.08)  # noqa: E731
    for _ in range(10):
        t.observe(8, 20e-3 * noise(), plain=True)
    for _ in range(20):
        for size, ms in ((16, 25), (24, 28), (32, 34)):
            t.observe(size, ms * 1e-3 * noise())
    before = t.at(32)
    for _ in range(600):
        t.observe(16, 25e-3 * noise())
    assert t.at(32) == pytest.approx(before, rel=0.15)  # was 2.1x
    assert t.at(16) == pytest.approx(25e-3 * 1.08, rel=0.1)


def test_smooth_cost_bends_on_four_sizes_and_runs_on_as_a_line():
    """A real B = 8 trace: the warm-up's two forwards at width 4 ran cold (30.8 ms; later ones ~20), widths 2-3 ran
    18.7 and 19.5 ms. A quadratic through those 3 sizes fits them exactly, so its bend "paid", and run on past width 4
    it priced widths 5 and 6 at 40 and 57 ms: the batch drafted 1 deep for 40 steps where D = 2-3 were best. On 3
    sizes the curve is a line; past the widest size seen it continues with its slope there, whatever its bend."""
    t = ForwardCost(smooth=True)
    t.observe(8, 14e-3, plain=True)
    for size, ms in ((32, 30.8), (32, 30.8), (16, 18.7), (16, 18.7), (24, 19.5)):
        t.observe(size, ms * 1e-3)
    line = [t.at(8 * w) for w in range(2, 7)]
    steps = [b - a for a, b in zip(line, line[1:])]
    assert max(steps) == pytest.approx(min(steps), rel=1e-6)  # one slope: no bend on three sizes
    for _ in range(10):  # a fourth size, and a real bend through all four: past the widest, a line at its slope
        for w in range(2, 6):
            t.observe(8 * w, convex(8 * w) + 2e-3 * (w - 2) ** 2)
    bent = [t.at(8 * w) for w in range(2, 9)]
    past = [b - a for a, b in zip(bent[3:], bent[4:])]  # widths 5-8
    assert past[1] == pytest.approx(past[0], rel=1e-6) and past[2] == pytest.approx(past[0], rel=1e-6)
    assert bent[2] - bent[1] < bent[3] - bent[2]  # inside: the bend is kept


def test_smooth_cost_keeps_a_noisy_batch_at_its_best_widths():
    """8 sequences at 0.8 acceptance, a forward whose every sample is 0.9-1.3x its cost: widths 3 and 4 give the best
    rates (0.746 and 0.741 tokens/ms, the next 0.711). With T read per size the width wandered (17-23% of steps
    elsewhere in 3 of 4 seeds, down to plain and up to 7); with one curve it stays (12 seeds: 86-94% of steps at
    widths 3-4, 92.5% on average; most of the rest are width probes, one each side every 16 steps)."""
    shares = []
    for seed in range(4):
        noise = random.Random(seed + 1)
        cost = lambda size: convex(size) * noise.uniform(0.9, 1.3)  # noqa: E731
        chosen = drive_batch(AdaptiveDepth(k_max=8, smooth_cost=True), 600, [0.8] * 8, draft_cost=3e-4, cost=cost, seed=seed)
        widths = [max(ds) + 1 for ds in chosen[200:]]
        shares.append(sum(w in (3, 4) for w in widths) / len(widths))
        assert shares[-1] >= 0.85, (seed, sorted(set(widths)))
        assert widths.count(1) <= 1  # plain at most once: a width probe one below a step that drafted 1 deep
    assert sum(shares) / len(shares) >= 0.9, shares


# --- depth by batch (the forward padded to B x width, or ragged: sum of D_i + 1 rows) ----------
def batch_policy(padded: bool) -> AdaptiveDepth:
    return AdaptiveDepth(k_max=8, verify_cost=STEEP, draft_cost=2e-5, target_cost=1e-3, padded=padded)


@pytest.mark.parametrize("padded", [True, False])
def test_depth_shrinks_smoothly_to_zero_as_the_batch_fills(padded):
    """T grows steeply past 8 positions: one sequence drafts deep, 16 do not draft, and the forward's
    positions per sequence never rise as the batch grows (no cliff at a threshold)."""
    per_seq = []
    for b in range(1, 17):
        p = batch_policy(padded)
        chosen = drive_batch(p, 200, [0.9] * b, seed=b)[100:]
        size = [b * (max(ds) + 1) if padded else sum(d + 1 for d in ds) for ds in chosen]
        per_seq.append(sum(size) / len(size) / b)
        if b == 16:  # plain, but for the batch probes: two steps in batch_probe where every sequence drafts 1
            probes = [ds for ds in chosen if any(ds)]
            assert len(probes) <= 2 * (len(chosen) // p.batch_probe + 1) and all(max(ds) == 1 for ds in probes)
    assert per_seq[0] >= 6
    assert all(y <= x + 0.05 for x, y in zip(per_seq, per_seq[1:])), per_seq
    assert per_seq[-1] <= 1.0 + 2.0 / 16 + 1e-9


@pytest.mark.parametrize("padded", [True, False])
def test_depth_goes_to_the_sequence_whose_drafts_are_accepted(padded):
    chosen = drive_batch(batch_policy(padded), 300, [0.9, 0.3])[100:]
    good, poor = (sum(ds[i] for ds in chosen) / len(chosen) for i in (0, 1))
    # padded, the good sequence sets the grid's width; the poor one's second draft (worth 0.3 x 0.3 = 0.09 tokens)
    # costs the drafter about 0.08 tokens' time here, so drafting 1 or 2 in its padding is a near tie either way
    assert good > poor + 0.9 and poor <= 2.0


@pytest.mark.parametrize("padded", [True, False])
def test_hopeless_sequence_in_a_batch_is_probed_rarely(padded):
    chosen = drive_batch(batch_policy(padded), 400, [0.9, 0.0])[100:]
    hopeless = [ds[1] for ds in chosen]
    assert hopeless.count(0) / len(hopeless) > 0.8 and any(hopeless)  # mostly plain, still probed
    assert sum(ds[0] for ds in chosen) / len(chosen) >= (3 if padded else 4)  # padded: 2 x 4 positions fit


def test_a_batched_drafter_is_charged_per_draft_position_not_per_sequence():
    """MTP drafts the whole batch's position j in one call: its seconds grow with max D_i, not sum D_i."""
    p = AdaptiveDepth(k_max=8, verify_cost=STEEP, target_cost=1e-3, padded=True)
    for b in (1, 4, 1, 4) * 10:
        ds = p.next_depths(list(range(b)), 3)
        seqs = tuple(SeqStep(i, d, d, 1e-4 * max(ds) / b) for i, d in enumerate(ds))  # the call shared out
        p.observe(BatchStep(sum(ds) + b, max(ds) + 1, steep(b * (max(ds) + 1)), 0.0, seqs))
    assert p.phi > 0.8 and p.c * p.T.table(1)[0] == pytest.approx(1e-4, rel=0.2)  # (c is in plain forwards)


def test_per_sequence_room_caps_depth():
    for ds in drive_batch(batch_policy(True), 50, [1.0, 1.0], k_max=[1, 8]):
        assert ds[0] <= 1 and ds[1] <= 8


def test_drop_forgets_a_sequence():
    p = batch_policy(True)
    drive_batch(p, 100, [0.0, 0.9])
    low = p.seqs[0].gains(8, p.shrink)
    p.drop(0)
    assert 0 not in p.seqs
    fresh = p.next_depths([0], 8)[0]  # seq id 0 again: a new sequence, back to the prior
    assert p.seqs[0].gains(8, p.shrink)[0] > low[0] and fresh > 0  # new: drafting on the prior (the old one was plain)


def test_policy_has_no_clock():
    """The policy learns only through observe(): no timer of its own."""
    src = Path(mtpspec.adaptive.__file__).read_text()
    assert "perf_counter" not in src and "import time" not in src and "from time" not in src


def test_one_paused_step_does_not_price_the_next_ones():
    """A full garbage collection (~0.25 s) inside one step's overhead is clipped; a lasting rise is still learned."""
    p = AdaptiveDepth(k_max=4)

    def step(overhead: float) -> None:
        ds = p.next_depths([0, 1], 4)
        p.observe(BatchStep(rows=2 + sum(ds), width=max(ds) + 1, forward_seconds=20e-3, overhead_seconds=overhead,
                            seqs=tuple(SeqStep(i, d, d, 1e-3 * d) for i, d in enumerate(ds))))

    for _ in range(20):
        step(0.2e-3)
    step(0.25)
    assert p.o < 1e-3
    for _ in range(10):
        step(2e-3)
    assert p.o == pytest.approx(2e-3, rel=0.15)


def test_a_draft_cost_learned_in_a_full_batch_scales_to_the_sequences_left():
    """A batched drafter's step costs about what the target's forward does over the same rows: its cost is learned in
    plain forwards at the batch size seen, so 16 sequences' drafting cost does not keep the last one plain."""

    def forward(rows: int) -> float:  # grows with the rows: 16 rows cost 6x one
        return 1e-3 * (1.0 + rows / 2)

    rng, p = random.Random(0), AdaptiveDepth(k_max=8)
    for b, steps in ((16, 60), (1, 60)):
        for seq in range(1, 16) if b == 1 else ():
            p.drop(seq)
        chosen = []
        for _ in range(steps):
            ds = p.next_depths(list(range(b)), 8)
            width = max(ds) + 1
            level = 0.15 * forward(b)  # one batched draft step: 0.15 of a plain forward at this batch size
            seqs = []
            for i, d in enumerate(ds):
                n = 0
                while n < d and rng.random() < 0.8:
                    n += 1
                seqs.append(SeqStep(i, d, n, level * max(ds) / b))
            p.observe(BatchStep(sum(d + 1 for d in ds), width, forward(b * width), 0.0, tuple(seqs)))
            chosen.append(ds)
    # alone, a draft costs 0.15 T(1) and a row 0.33 T(1): D = 2 is best, D = 1 within 2% of it (in seconds learned at
    # 16: 0.9 T(1), plain)
    assert sum(ds[0] for ds in chosen[-30:]) / 30 >= 1.0 and sum(ds[0] == 0 for ds in chosen[-30:]) <= 3


def test_by_batch_size_learns_each_size_class_apart():
    """A server's batch wanders: the costs learned alone do not price 16 sequences (one policy per size class)."""
    p = ByBatchSize(k_max=8, verify_cost=STEEP, draft_cost=2e-5, target_cost=1e-3)
    alone = drive_batch(p, 60, [0.9])[20:]
    full = drive_batch(p, 60, [0.9] * 16)[20:]
    assert sorted(p.policies) == [1, 5] and p.policy(16) is p.policy(31) and p.policy(1) is not p.policy(16)
    assert min(ds[0] for ds in alone) >= 4 and sum(map(max, full)) <= len(full) // p.policy(16).batch_probe * 2 + 2
    p.drop(0)
    assert all(0 not in q.seqs for q in p.policies.values())



def test_a_new_sequence_starts_from_the_acceptance_of_those_before_it():
    """The prior of a new sequence is what the policy's earlier sequences accepted (0.9 here), not the fixed 0.6, in
    every size class; and a position's shape is taken against each sequence's own average."""
    p = ByBatchSize(k_max=8, verify_cost=STEEP, draft_cost=2e-5, target_cost=1e-3)
    fresh = p.policy(4)._new(99).gains(3, 2.0)
    drive_batch(p, 200, [0.9])
    pool = p.policy(1).pool
    assert p.policy(4).pool is pool and pool.level() == pytest.approx(0.9, abs=0.05)
    late = p.policy(4)._new(100).gains(3, 2.0, pool.shape(), pool.version)
    assert fresh[0] == pytest.approx(0.6) and late[0] == pytest.approx(0.9, abs=0.05) and late[2] > 0.6
    mixed = AdaptiveDepth(k_max=8, verify_cost=STEEP, draft_cost=2e-5, target_cost=1e-3)
    drive_batch(mixed, 300, [0.9, 0.3])  # deep positions are reached mostly by the good sequence
    assert all(0.85 < x < 1.15 for x in mixed.pool.shape()[:4]), mixed.pool.shape()


def test_by_batch_size_reads_a_smooth_cost_for_batches_only():
    p = ByBatchSize(k_max=8)
    assert not p.policy(1).T.smooth and p.policy(2).T.smooth and p.policy(16).T.smooth
    assert not ByBatchSize(k_max=8, smooth_cost=False).policy(8).T.smooth


def test_a_new_sequence_starts_at_the_warmup_depth_however_its_first_drafts_go():
    """A new sequence's first start_steps drafting steps are warmup_depth deep, or beside established sequences as deep
    as they draft and never deeper, whatever its prior says (a pool at 0.95 asks for 5+) and however its first checks go
    (a start's drafts are the hardest: estimated, a new group drafted 5-7 deep and then 1-2 after a miss or two)."""
    p = AdaptiveDepth(k_max=8, draft_cost=2e-5, target_cost=1e-3, width_probe=0)  # (a probe adds a width, once)
    flat = lambda n: 1e-3 * (1.0 + 0.01 * n)  # rows nearly free: depth is worth its drafts
    drive_batch(p, 150, [0.95] * 4, cost=flat)  # the pool learns 0.95: a new sequence's prior
    assert min(p.next_depths([0, 1, 2, 3], 8)) >= 5
    first = []  # a new group of 4 whose drafts stop at the first position: warmup_depth, not 5+, not 1
    for _ in range(p.start_steps):
        ds = p.next_depths([10, 11, 12, 13], 8)
        first.append(ds)
        p.observe(BatchStep(rows=sum(ds) + 4, width=max(ds) + 1, forward_seconds=flat(4 * (max(ds) + 1)), overhead_seconds=0.0,
                            seqs=tuple(SeqStep(10 + i, d, min(d, 1), 2e-5 * d) for i, d in enumerate(ds))))
    assert first == [[p.warmup_depth] * 4] * p.start_steps
    assert max(p.next_depths([10, 11, 12, 13], 8)) < p.warmup_depth  # then its own estimates: shallower
    for i in range(3):
        p.drop(i)
    mixed = p.next_depths([3, 20], 8)  # beside an established sequence: as deep as it drafts
    assert mixed[1] == mixed[0] >= p.warmup_depth
    shallow = batch_policy(True)  # rows dear past 8: 4 sequences draft 1 deep, and a new one no deeper
    drive_batch(shallow, 150, [0.95] * 4)
    ds = shallow.next_depths([0, 1, 2, 30], 8)
    assert 0 < max(ds[:3]) < shallow.warmup_depth and ds[3] == max(ds[:3])


def test_a_lone_new_sequence_drafts_as_its_estimates_say():
    """Alone, a new sequence widens no one's grid: no start rule, its prior decides (a pool at 0.95: 5+ deep, where the
    start rule held it at warmup_depth; demo B = 1, where D = 5 is best: 0.958 of D = 5 with the rule, 0.977 without)."""
    p = AdaptiveDepth(k_max=8, draft_cost=2e-5, target_cost=1e-3, width_probe=0)
    flat = lambda n: 1e-3 * (1.0 + 0.01 * n)  # rows nearly free: depth is worth its drafts
    drive_batch(p, 150, [0.95] * 4, cost=flat)  # the pool learns 0.95: a new sequence's prior
    for i in range(4):
        p.drop(i)
    assert p.next_depths([10], 8)[0] >= 5 > p.warmup_depth


@pytest.mark.parametrize("batched", [True, False])
def test_a_batched_drafters_cost_is_not_held_against_a_sequences_forward(batched):
    """16 sequences at 0.25 acceptance: drafting 1 gains 8% over plain. The cost margin (for a drafter that pays per
    sequence, with costs unseen here) compared a drafter's cost with T(1); a batched drafter's is per draft position
    for the whole batch, 16x one sequence's share, so the margin reached its cap (13%) and the batch stayed plain.
    Paid per sequence, the same seconds are a sixteenth a token: a small margin either way, and the batch drafts."""
    p = AdaptiveDepth(k_max=8, smooth_cost=True)
    grid = lambda n: 22e-3 if n == 16 else 24e-3 + 2e-3 * (n // 16 - 2)  # plain 22 ms, width 2 24 ms, +2 ms a width
    chosen = [max(ds) for ds in drive_batch(p, 300, [0.25] * 16, 1.5e-3 / 16, grid, batched=batched)]
    late = chosen[100:]  # (1.5 ms a draft position for the batch, shared out by drafted tokens)
    assert sum(d == 1 for d in late) > 0.8 * len(late), chosen

"""AdaptiveDepth (`--k auto`) on synthetic observations: D = 0 when drafts never pay, deep D when they do."""

from __future__ import annotations

from mtpspec.adaptive import AdaptiveDepth


def drive(policy: AdaptiveDepth, steps: int, accept_rate: float, draft_cost: float, verify: float = 1e-3, k_max: int = 8) -> list[int]:
    """Feed `steps` steps: each drafted token costs draft_cost s, verify costs `verify`; acceptance
    is deterministic: the first round(accept_rate * d) drafts survive."""
    chosen = []
    for _ in range(steps):
        d = policy.next_depth(k_max)
        chosen.append(d)
        acc = int(round(accept_rate * d)) if accept_rate < 1 else d
        policy.observe(d, acc, draft_cost * d, verify)
    return chosen


RATIO = [1.0, 1.1, 1.15, 1.2, 1.2, 1.25, 1.3, 1.3, 1.4]  # T(k)/T(1) as measured for stories260K


def test_zero_acceptance_chooses_plain_and_keeps_probing():
    p = AdaptiveDepth(k_max=8, verify_ratio=RATIO)
    chosen = drive(p, 300, accept_rate=0.0, draft_cost=1e-5)
    tail = chosen[50:]
    assert tail.count(0) / len(tail) > 0.8  # mostly plain steps (retries: evidence fades)
    assert any(d > 0 for d in tail)  # ... but it still probes
    assert all(d <= 2 for d in tail)


def test_drafter_that_can_never_pay_is_never_probed():
    """Costly drafts (a target step each) with zero acceptance: plain after warm-up, no probes."""
    p = AdaptiveDepth(k_max=8, verify_ratio=RATIO, draft_cost=1e-3, target_cost=1e-3)
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
    p = AdaptiveDepth(k_max=8, verify_ratio=[1.0, 1.1, 1.15, 1.2, 1.2, 1.25, 1.3, 1.3, 1.4])
    chosen = drive(p, 200, accept_rate=1.0, draft_cost=1e-3)
    assert chosen[100:].count(0) > 80


def test_respects_k_max_and_engine_cap():
    p = AdaptiveDepth(k_max=3)
    assert all(d <= 3 for d in drive(p, 50, 1.0, 1e-6))
    assert all(d <= 2 for d in drive(p, 20, 1.0, 1e-6, k_max=2))


def test_same_size_draft_model_stays_plain_small_one_goes_deep():
    """Perfect acceptance: a drafter at 0.9 of a target step cannot clear the margin; one at 0.1 can."""
    costly = AdaptiveDepth(k_max=8, verify_ratio=RATIO, draft_cost=0.9e-3, target_cost=1e-3)
    assert set(drive(costly, 100, accept_rate=1.0, draft_cost=0.9e-3)) == {0}
    cheap = AdaptiveDepth(k_max=8, verify_ratio=RATIO, draft_cost=0.1e-3, target_cost=1e-3)
    assert min(drive(cheap, 100, accept_rate=1.0, draft_cost=0.1e-3)[5:]) >= 4

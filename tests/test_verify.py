"""Table-driven cases for the acceptance rule, greedy and sampled."""

import pytest
import torch

from mtpspec.sampling import Sampler, SamplingParams
from mtpspec.types import Draft
from mtpspec.verify import verify, verify_greedy

V = 8


def logits_with_argmax(targets: list[int]) -> torch.Tensor:
    """(len(targets), V) logits whose argmax at row i is targets[i]."""
    x = torch.randn(len(targets), V, generator=torch.Generator().manual_seed(0))
    x[torch.arange(len(targets)), torch.tensor(targets)] = 10.0
    return x


@pytest.mark.parametrize(
    "draft, target_argmax, n, emitted",
    [
        ([3, 4, 5], [3, 4, 5, 6], 3, [3, 4, 5, 6]),  # all accepted: bonus from the last position
        ([1, 4, 5], [3, 4, 5, 6], 0, [3]),  # first rejected: recovered = target's choice there
        ([3, 1, 5], [3, 4, 5, 6], 1, [3, 4]),  # middle rejected: later (agreeing) guesses are discarded
        ([3, 4, 1], [3, 4, 5, 6], 2, [3, 4, 5]),  # last rejected
        ([3, 2, 5], [3, 2, 5, 7], 3, [3, 2, 5, 7]),  # EOS (2) inside the draft is accepted like any token
        ([], [6], 0, [6]),  # no draft: a plain step
    ],
)
def test_greedy_table(draft, target_argmax, n, emitted):
    v = verify_greedy(torch.tensor(draft, dtype=torch.long), logits_with_argmax(target_argmax))
    assert v.num_accepted == n
    assert v.tokens.tolist() == emitted
    assert v.bonus == (n == len(draft))


def test_sampling_point_mass_accepts_sure_token_and_rejects_impossible():
    s = Sampler(SamplingParams(temperature=1.0), seed=0)
    p = torch.full((3, V), -1e9)
    p[0, 2] = 0.0  # position 0: target is sure of token 2
    p[1, 5] = 0.0  # position 1: sure of 5
    p[2, 1] = 0.0
    v = verify(Draft(tokens=torch.tensor([2, 4])), p, s)  # 2 accepted (p=1), 4 impossible -> rejected
    assert v.num_accepted == 1 and v.tokens.tolist() == [2, 5]


def test_sampling_residual_excludes_rejected_token():
    s = Sampler(SamplingParams(temperature=1.0), seed=0)
    p_logits = torch.zeros(2, V)  # uniform target
    q = torch.zeros(1, V)
    q[0, 3] = 1.0  # drafter certain of 3: accepted w.p. 1/8; on rejection 3 can never be the recovered token
    for seed in range(200):
        s = Sampler(SamplingParams(temperature=1.0), seed=seed)
        v = verify(Draft(tokens=torch.tensor([3]), q=q), p_logits, s)
        if v.num_accepted == 0:
            assert v.tokens.tolist() != [3]


def test_seeded_verify_is_deterministic():
    p = torch.randn(5, V)
    q = torch.softmax(torch.randn(4, V), -1)
    d = Draft(tokens=torch.tensor([1, 2, 3, 4]), q=q)
    a = [verify(d, p, Sampler(SamplingParams(temperature=0.7), seed=s)).tokens.tolist() for s in range(20)]
    b = [verify(d, p, Sampler(SamplingParams(temperature=0.7), seed=s)).tokens.tolist() for s in range(20)]
    assert a == b


def _one_step_distribution(p_probs: torch.Tensor, q_probs: torch.Tensor | None, n: int) -> torch.Tensor:
    """Empirical distribution of the first emitted token: draft one token x ~ q (or a fixed token), verify."""
    counts = torch.zeros(V)
    gen = torch.Generator().manual_seed(123)
    logits = torch.log(p_probs).expand(2, V)
    for seed in range(n):
        s = Sampler(SamplingParams(temperature=1.0), seed=seed)
        if q_probs is None:
            d = Draft(tokens=torch.tensor([2]))
        else:
            x = torch.multinomial(q_probs, 1, generator=gen)
            d = Draft(tokens=x, q=q_probs[None])
        counts[verify(d, logits, s).tokens[0]] += 1
    return counts / n


@pytest.mark.parametrize("kind", ["q", "point_mass"])
def test_rejection_sampling_matches_target_distribution(kind):
    """The first emitted token is distributed as p, whatever q is; TV distance shrinks with samples."""
    p = torch.softmax(torch.randn(V, generator=torch.Generator().manual_seed(1)) * 1.5, -1)
    q = torch.softmax(torch.randn(V, generator=torch.Generator().manual_seed(2)) * 1.5, -1) if kind == "q" else None
    tv = []
    for n in (500, 8000):
        emp = _one_step_distribution(p, q, n)
        tv.append(0.5 * (emp - p).abs().sum().item())
    assert tv[1] < 0.03, tv
    assert tv[1] < tv[0], tv


def test_top_p_and_top_k_transform():
    from mtpspec.sampling import logits_to_probs

    logits = torch.log(torch.tensor([0.5, 0.3, 0.15, 0.05]))
    p = logits_to_probs(logits, SamplingParams(temperature=1.0, top_p=0.7))
    assert p.tolist() == pytest.approx([0.625, 0.375, 0.0, 0.0])
    p = logits_to_probs(logits, SamplingParams(temperature=1.0, top_k=3))
    assert p[3] == 0 and p.sum().item() == pytest.approx(1.0)
    p = logits_to_probs(logits, SamplingParams(temperature=0.0))
    assert p.tolist() == [1.0, 0.0, 0.0, 0.0]


def _rows_262k():
    """Rows of Gemma's vocabulary size: flat to peaked, few distinct values (ties everywhere), banned tokens, after
    top-k 40."""
    g = torch.Generator().manual_seed(0)
    v = 262144
    rows = [torch.randn(v, generator=g) * s for s in (1.0, 3.0, 6.0, 12.0)]
    tied = (torch.randn(v, generator=g) * 4).round()
    rows += [tied, tied.masked_fill(torch.rand(v, generator=g) < 0.3, float("-inf"))]
    kth = torch.topk(rows[2], 40).values[-1]
    return rows + [rows[2].masked_fill(rows[2] < kth, float("-inf"))]


@pytest.mark.parametrize("kernel", [True, False], ids=["kernel", "torch"])
def test_top_p_from_a_prefix_is_the_whole_sort_bitwise(kernel):
    """A large vocabulary's nucleus found among its leading tokens (sampling.cpp's threshold, or topk's K-th logit)
    equals the definition (a stable sort of the whole row): both prefixes and the fallback, ties at the prefix's edge,
    banned tokens, top-k before it, top_p near 0 and near 1."""
    from mtpspec.kernels import torch_path
    from mtpspec.sampling import NUCLEUS_PREFIX, _kth_largest, _nucleus, _nucleus_drop, _prefix_nucleus, _scale

    rows = _rows_262k()
    used = set()
    with torch_path(not kernel):
        for raw in rows:
            for t in (0.7, 1.0):
                probs = torch.softmax(_scale(raw, t), dim=-1)
                for top_p in (1e-30, 0.5, 0.9, 0.95, 0.999999):
                    drop = _nucleus_drop(raw, probs, top_p)
                    assert torch.equal(_nucleus(raw, probs, top_p), probs.masked_fill(drop, 0.0))
                    alone = {k: _prefix_nucleus(raw, probs, top_p, (k,)) for k in NUCLEUS_PREFIX}
                    assert all(torch.equal(ids.sort().values, torch.nonzero(~drop).flatten()) for ids in alone.values() if ids is not None)
                    used.add(next((k for k, ids in alone.items() if ids is not None), "whole"))
        assert used == {*NUCLEUS_PREFIX, "whole"}, used
        raw = rows[2]  # top-k's own cut tried first (logits_to_probs passes it): the same nucleus
        kth, lead = _kth_largest(raw, 40)
        assert torch.equal(kth, torch.topk(raw, 40).values[-1])
        probs = torch.softmax(_scale(raw.masked_fill(raw < kth, float("-inf")), 0.8), dim=-1)
        for top_p in (1e-30, 0.5, 0.95, 0.999999):
            want = probs.masked_fill(_nucleus_drop(raw, probs, top_p), 0.0)
            assert torch.equal(_nucleus(raw, probs, top_p, lead), want)


def test_leading_ids_are_a_prefix_of_the_order_and_hold_the_top_k():
    """sampling.cpp's leading tokens: every token at or above a threshold (so a prefix of the descending order), at
    least k of them; top-k's K-th value taken among them is topk's over the whole row; a NaN row, or one with fewer
    than k finite tokens, is not served."""
    from mtpspec.kernels import sampling as kernel
    from mtpspec.sampling import _kth_largest

    if not kernel.available():
        pytest.skip(f"sampling.cpp did not build: {kernel._EXT.error}")
    for raw in _rows_262k():
        for k in (1, 40, 256, 4096):
            ids = kernel.leading_ids(raw, k)
            if int((raw > float("-inf")).sum()) < k:  # fewer finite tokens than k (after top-k 40): not served
                assert ids is None
                continue
            assert ids is not None and ids.shape[0] >= k and torch.equal(ids, ids.sort().values)
            inside = torch.zeros(raw.shape[0], dtype=torch.bool)
            inside[ids] = True
            assert bool((raw[~inside] < raw[ids].min()).all())  # nothing outside reaches the threshold
            assert torch.equal(_kth_largest(raw, k)[0], torch.topk(raw, k).values[-1])
    nan = _rows_262k()[0].clone()
    nan[7] = float("nan")
    assert kernel.leading_ids(nan, 40) is None

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

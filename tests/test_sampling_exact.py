"""Speculative sampling keeps the target's distribution exactly, on the real model.

The first two emitted tokens are drawn many times (one seed each) with temperature and top-p; their
empirical joint distribution is compared with the exact one computed from the target, for a
point-mass drafter (n-gram) and a q-distribution drafter (the Q8_0 draft model).
"""

import math

import pytest
import torch

from mtpspec.sampling import SamplingParams, logits_to_probs

PROMPT = "The cat sat on the mat. The dog sat on the mat. The cat sat on the"
PARAMS = SamplingParams(temperature=0.8, top_p=0.9)


def exact_pairs(model, ids) -> dict[tuple[int, int], float]:
    m = model.module
    cache = m.new_cache()
    out = m.forward_tokens(torch.tensor(ids), cache)
    p1 = logits_to_probs(out.logits[-1], PARAMS)
    base = cache.length
    pairs = {}
    for t1 in torch.nonzero(p1).flatten().tolist():
        cache.crop(base)
        p2 = logits_to_probs(m.forward_tokens(torch.tensor([t1]), cache).logits[-1], PARAMS)
        for t2 in torch.nonzero(p2).flatten().tolist():
            pairs[(t1, t2)] = p1[t1].item() * p2[t2].item()
    return pairs


def chi_square(counts: dict, exact: dict, n: int) -> tuple[float, int]:
    """Pearson chi-square over cells with expected count >= 5, the rest pooled into one cell."""
    stat, df, rest_obs, rest_exp = 0.0, -1, 0, 0.0
    for cell, p in exact.items():
        e, o = p * n, counts.get(cell, 0)
        if e >= 5:
            stat += (o - e) ** 2 / e
            df += 1
        else:
            rest_obs, rest_exp = rest_obs + o, rest_exp + e
    rest_obs += sum(c for cell, c in counts.items() if cell not in exact)  # impossible pairs
    if rest_exp > 0:
        stat += (rest_obs - rest_exp) ** 2 / rest_exp
        df += 1
    return stat, df


# make test-slow (25 s each): the default suite runs the same model, prompt, drafters and sampling parameters through
# the same engine, 1200 seeds 16 at a time (test_batch.py's batched distribution test: each sequence drafts with its own
# propose() and is verified by the same verify() as here), and single sequences on hybrids (test_mtp_lossless.py[mtp],
# test_heads.py[medusa])
@pytest.mark.slow
@pytest.mark.parametrize("drafter, k", [("ngram", 3), ("draft", 2)])
def test_first_two_tokens_follow_the_target_distribution(stories, stories_q80, drafter, k):
    ids = stories.encode(PROMPT)
    exact = exact_pairs(stories, ids)
    n = 1500
    counts: dict[tuple[int, int], int] = {}
    drafted = 0
    for seed in range(n):
        r = stories.generate(ids, drafter=drafter, k=k, draft_model=stories_q80 if drafter == "draft" else None, temperature=PARAMS.temperature,
                             top_p=PARAMS.top_p, seed=seed, max_new_tokens=2)
        cell = tuple(r.tokens)
        counts[cell] = counts.get(cell, 0) + 1
        drafted += r.stats.draft_tokens
    assert drafted > n // 2  # the drafter really proposed
    stat, df = chi_square(counts, exact, n)
    assert stat < df + 5 * math.sqrt(2 * df), (stat, df)  # far beyond the 1e-4 tail of chi2(df)
    # total variation distance, which shrinks like 1/sqrt(n) for an exact sampler
    tv = 0.5 * sum(abs(counts.get(c, 0) / n - exact.get(c, 0.0)) for c in set(counts) | set(exact))
    assert tv < 0.12, tv


def test_inverse_cdf_draws_each_token_at_its_weight_and_never_a_zero_one(monkeypatch):
    """Sampler.sample's draw: one uniform a row against the fp64 running sum; a product rounded up to the total falls
    back to the row's last positive token."""
    from mtpspec.sampling import inverse_cdf

    g = torch.Generator().manual_seed(0)
    w = torch.tensor([0.0, 0.1, 0.0, 0.2, 0.3, 0.4, 0.0])
    n = 20000
    got = inverse_cdf(w.expand(n, -1).contiguous(), g)
    assert not (w[got] == 0).any()
    counts = torch.bincount(got, minlength=7).tolist()
    stat, df = chi_square(dict(enumerate(counts)), {i: float(w[i]) for i in range(7) if w[i] > 0}, n)
    assert stat < df + 5 * math.sqrt(2 * df), (stat, df)
    monkeypatch.setattr(torch, "rand", lambda *a, **kw: torch.ones(a, dtype=torch.float64))  # u * total = the total
    assert inverse_cdf(torch.tensor([[0.25, 0.75, 0.0, 0.0]]), g).tolist() == [1]

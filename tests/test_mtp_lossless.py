"""--drafter mtp (D = 1, 2, 4) and ngram on the hybrid model: greedy token-identical to plain, sampling exact."""

from __future__ import annotations

import pytest
import torch

from mtpspec.drafters import make_drafter
from mtpspec.engine import generate_tokens
from mtpspec.errors import ConfigError
from mtpspec.models.qwen35 import HybridConfig, HybridLM
from mtpspec.sampling import Sampler, SamplingParams
from mtpspec.types import Draft
from qwen35_tiny import randomize

V = 16  # small vocabulary: drafts get accepted now and then, and the sampling test has few outcomes
CFG = HybridConfig(
    vocab_size=V, hidden_size=32, num_layers=4, layer_types=("linear_attention", "full_attention", "linear_attention", "full_attention"),
    num_heads=4, num_kv_heads=2, head_dim=16, intermediate_size=48, max_seq_len=256, linear_key_head_dim=8,
    linear_value_head_dim=8, linear_num_key_heads=2, linear_num_value_heads=4, mtp_num_layers=1, tie_embeddings=False,
)
PROMPTS = [[3], [1, 4, 1, 5, 9, 2, 6], [7, 7, 7, 7], list(range(16)) + list(range(8)), [2, 3, 5, 7, 11, 13, 2, 3, 5]]
N = 48


def tiny_hybrid() -> HybridLM:
    """The tiny hybrid with an MTP module these tests (and test_sampling_controls.py) run on: V = 16."""
    torch.manual_seed(0)
    m = HybridLM(CFG)
    randomize(m, 5)
    return m.eval()


@pytest.fixture(scope="module")
def model():
    return tiny_hybrid()


def run(model, prompt, drafter, k, params=SamplingParams(), seed=0, n=N, **opts):
    d = make_drafter(drafter, model, **opts)
    return generate_tokens(model, prompt, d, k, Sampler(params, seed), n)


@pytest.fixture(scope="module")
def plain(model):
    return [run(model, p, "none", 1).tokens for p in PROMPTS]


@pytest.mark.parametrize("drafter, k", [("mtp", 1), ("mtp", 2), ("mtp", 4), ("ngram", 3)])
def test_greedy_identical_to_plain(model, plain, drafter, k):
    accepted = 0
    for prompt, ref in zip(PROMPTS, plain):
        r = run(model, prompt, drafter, k)
        assert r.tokens == ref, f"{drafter} k={k} differs on prompt {prompt}"
        accepted += r.stats.accepted_tokens
    assert accepted > 0  # drafts really were accepted, so rollback of rejected ones was exercised too


class OracleDrafter:
    """Proposes the true greedy continuation with every 3rd-ish token corrupted: accepts n = 0..D all occur."""

    name = "oracle"
    prefill_logits = False
    prefill_hidden = False
    taps = ()

    def __init__(self, prompt_len: int, truth: list[int], seed: int) -> None:
        self.prompt_len, self.truth = prompt_len, truth
        self.g = torch.Generator().manual_seed(seed)

    def prefill(self, context, out, sampler) -> None:
        pass

    def propose(self, context, k: int) -> Draft:
        done = len(context) - self.prompt_len
        toks = self.truth[done : done + k]
        toks = [t if torch.rand(1, generator=self.g).item() > 0.3 else (t + 1) % V for t in toks]
        return Draft(tokens=torch.tensor(toks, dtype=torch.long))

    def commit(self, verdict, out) -> None:
        pass


@pytest.mark.parametrize("k", [1, 3, 6])
def test_every_accept_count_rolls_back_exactly(model, plain, k):
    seen = set()
    for i, (prompt, ref) in enumerate(zip(PROMPTS, plain)):
        r = generate_tokens(model, prompt, OracleDrafter(len(prompt), ref, i), k, Sampler(SamplingParams()), N)
        assert r.tokens == ref
        seen |= {s.num_accepted for s in r.steps if len(s.draft) == k}
    assert seen == set(range(k + 1))


def test_prenorm_switch_stays_lossless(model, plain):
    r = run(model, PROMPTS[1], "mtp", 3, mtp_prenorm_hidden=True)
    assert r.tokens == plain[1]


@torch.inference_mode()
def test_mtp_drafts_are_the_mtp_argmax(model):
    """The first draft after prefill is argmax of head(mtp(h_{L-2}, e_{L-1})), computed by hand."""
    prompt = torch.tensor(PROMPTS[1])
    cache = model.new_cache()
    out = model.forward_tokens(prompt[:-1], cache)
    d = make_drafter("mtp", model)
    d.prefill(prompt, out, Sampler(SamplingParams()))
    draft = d.propose(prompt, 2)
    mcache = model.new_mtp_cache()
    h = model.mtp_forward(out.hidden, prompt[1:], mcache)[-1:]
    first = model.head(h)[0].argmax()
    second = model.head(model.mtp_forward(h, first.reshape(1), mcache))[0].argmax()
    assert draft.tokens.tolist() == [first.item(), second.item()]


def test_bos_alone_gives_an_empty_first_draft(model):
    d = make_drafter("mtp", model)
    ctx = torch.tensor([3])
    d.prefill(ctx, None, Sampler(SamplingParams()))
    assert d.propose(ctx, 3).size == 0


def test_model_without_mtp_is_a_clear_error():
    m = HybridLM(HybridConfig(**{**CFG.__dict__, "mtp_num_layers": 0}))
    with pytest.raises(ConfigError, match="MTP module"):
        make_drafter("mtp", m)


def _exact_two_token_distribution(model, prompt, params, stop_ids=()):
    """P(t1, t2) of plain sampling after `prompt` (its second token with t1 in its context): (V, V)."""
    s = Sampler(params).bind(prompt, stop_ids, V)
    cache = model.new_cache()
    p1 = s.probs(model.forward_tokens(torch.tensor(prompt), cache).logits[-1])  # (V,)
    joint = torch.zeros(V, V, dtype=torch.float64)
    for t1 in range(V):
        if p1[t1] == 0:
            continue
        c = model.new_cache()
        p2 = s.probs(model.forward_tokens(torch.tensor(prompt + [t1]), c).logits[-1], [[t1]])
        joint[t1] = p1[t1].double() * p2.double()
    return joint


def _chi_square_ok(counts: torch.Tensor, probs: torch.Tensor, n: int) -> tuple[bool, float, int]:
    """Pearson chi-square with outcomes of expected count < 5 pooled; accept below df + 5 sqrt(2 df)."""
    exp = (probs * n).flatten()
    obs = counts.flatten().double()
    big = exp >= 5
    e = torch.cat([exp[big], exp[~big].sum().reshape(1)])
    o = torch.cat([obs[big], obs[~big].sum().reshape(1)])
    keep = e > 0
    stat = (((o - e) ** 2)[keep] / e[keep]).sum().item()
    df = int(keep.sum()) - 1
    return stat < df + 5 * (2 * df) ** 0.5, stat, df


# ngram's distribution on the hybrid is in make test-slow (20 s): the default suite keeps mtp's here (the hybrid's rollback
# after sampled rejections) and ngram's on the real model (test_batch.py's batched distribution test)
@pytest.mark.parametrize("drafter, k", [("mtp", 2), pytest.param("ngram", 2, marks=pytest.mark.slow)])
def test_sampling_distribution_is_the_targets(model, drafter, k):
    params = SamplingParams(temperature=0.9, top_p=0.9)
    prompt = [2, 9, 4, 2, 9]  # the n-gram drafter finds "2 9" -> proposes "4 2"
    joint = _exact_two_token_distribution(model, prompt, params)
    n_runs = 1000
    counts = torch.zeros(V, V)
    for seed in range(n_runs):
        r = run(model, prompt, drafter, k, params, seed=seed, n=2)
        counts[r.tokens[0], r.tokens[1]] += 1
    ok, stat, df = _chi_square_ok(counts, joint, n_runs)
    assert ok, f"{drafter}: chi-square {stat:.1f} with {df} degrees of freedom"
    tv = 0.5 * (counts.double() / n_runs - joint).abs().sum().item()
    noise = 0.5 * (2 * joint * (1 - joint) / (torch.pi * n_runs)).sqrt().sum().item()  # E[TV] of exact sampling
    assert tv < 1.5 * noise, f"{drafter}: total variation {tv:.3f}, sampling noise alone gives ~{noise:.3f}"


def test_context_end_stays_lossless():
    """A prompt near the end of a 32-position context: generation stops when it is full, identically."""
    torch.manual_seed(0)
    small = HybridLM(HybridConfig(**{**CFG.__dict__, "max_seq_len": 32}))
    randomize(small, 5)
    prompt = PROMPTS[3][:26]
    ref = run(small.eval(), prompt, "none", 1, n=20)
    assert ref.finish_reason == "context"
    for k in (1, 3, 8):
        r = run(small, prompt, "mtp", k, n=20)
        assert r.tokens == ref.tokens and r.finish_reason == "context"

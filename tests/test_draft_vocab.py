"""A reduced draft vocabulary for the MTP drafter: still lossless (greedy and sampling), loaded with the checkpoint."""

from __future__ import annotations

import json

import pytest
import torch

from mtpspec.drafters import make_drafter
from mtpspec.models.draft_vocab import FILE, TokenRanking, ranking_from_counts, read_draft_vocab, write_draft_vocab
from mtpspec.engine import generate_tokens
from mtpspec.errors import ConfigError, ModelLoadError
from mtpspec.loading import load_module
from mtpspec.loading.native import save_checkpoint
from mtpspec.models.qwen35 import HybridLM
from mtpspec.sampling import Sampler, SamplingParams
from qwen35_tiny import randomize
from test_mtp_lossless import CFG, PROMPTS, V, _chi_square_ok, _exact_two_token_distribution

SUBSET = 8  # half of the 16-token vocabulary


@pytest.fixture(scope="module")
def model():
    torch.manual_seed(0)
    m = HybridLM(CFG)
    randomize(m, 5)
    # rank the tokens the model likes most first, so that drafts from the subset still get accepted
    likes = torch.zeros(V)
    for p in PROMPTS:
        likes += torch.softmax(m.forward_tokens(torch.tensor(p), m.new_cache()).logits, -1).sum(0)
    m.token_ranking = TokenRanking(torch.argsort(likes, descending=True), SUBSET)
    return m.eval()


def run(model, prompt, k, params=SamplingParams(), seed=0, n=48, **opts):
    return generate_tokens(model, prompt, make_drafter("mtp", model, **opts), k, Sampler(params, seed), n)


@pytest.fixture(scope="module")
def plain(model) -> list[list[int]]:
    """Plain greedy's 48 tokens after each prompt."""
    return [generate_tokens(model, p, make_drafter("none", model), 1, Sampler(SamplingParams()), 48).tokens for p in PROMPTS]


@pytest.mark.parametrize("k", [1, 3])
def test_greedy_identical_to_plain_and_drafts_stay_in_the_subset(model, plain, k):
    subset = set(model.token_ranking.top(SUBSET).tolist())
    accepted = 0
    for prompt, ref in zip(PROMPTS, plain):
        r = run(model, prompt, k)  # default size: the ranking's
        assert r.tokens == ref
        assert all(t in subset for s in r.steps for t in s.draft)
        accepted += r.stats.accepted_tokens
    assert accepted > 0


def test_zero_means_the_full_vocabulary(model):
    d = make_drafter("mtp", model, draft_vocab=0)
    assert d.head is None
    assert make_drafter("mtp", model, draft_vocab=4).head.ids.tolist() == model.token_ranking.top(4).tolist()


@pytest.mark.slow  # 15-30 s; the default suite proves its parts: q is zero outside the subset (below), a q drafter keeps the
# target's distribution (test_verify.py, test_batch.py[draft]), the MTP drafter's (test_mtp_lossless.py[mtp])
def test_sampling_distribution_is_the_targets(model):
    params = SamplingParams(temperature=0.9, top_p=0.9)
    prompt = [2, 9, 4, 2, 9]
    joint = _exact_two_token_distribution(model, prompt, params)
    n_runs = 1000
    counts = torch.zeros(V, V)
    for seed in range(n_runs):
        r = run(model, prompt, 2, params, seed=seed, n=2)
        counts[r.tokens[0], r.tokens[1]] += 1
    ok, stat, df = _chi_square_ok(counts, joint, n_runs)
    assert ok, f"chi-square {stat:.1f} with {df} degrees of freedom"


def test_q_is_zero_outside_the_subset(model):
    d = make_drafter("mtp", model)
    ctx = torch.tensor(PROMPTS[1])
    cache = model.new_cache()
    d.prefill(ctx, model.forward_tokens(ctx[:-1], cache), Sampler(SamplingParams(temperature=1.0), 0))
    q = d.propose(ctx, 2).q  # (2, V)
    outside = torch.ones(V, dtype=torch.bool)
    outside[model.token_ranking.top(SUBSET)] = False
    assert torch.all(q[:, outside] == 0) and torch.allclose(q.sum(-1), torch.ones(2))


def test_default_size_covers_the_text():
    counts = torch.tensor([5000, 3000, 1000, 500] + [1] * 1020)  # 4 tokens make 90.3% of the text
    order, size = ranking_from_counts(counts)
    assert order[:4].tolist() == [0, 1, 2, 3] and size == 256


def test_written_with_the_checkpoint_and_loaded(tmp_path, model):
    save_checkpoint(model, None, tmp_path)
    assert load_module(tmp_path).token_ranking is None  # no draft_vocab.json: the full vocabulary
    write_draft_vocab(tmp_path, torch.tensor([3, 3, 3, 5, 5, 7]), V, "test stream")
    meta = json.loads((tmp_path / FILE).read_text())
    assert meta["ranked_ids"][:3] == [3, 5, 7] and "6 tokens" in meta["source"]
    assert load_module(tmp_path).token_ranking.top(3).tolist() == [3, 5, 7]


def test_bad_inputs_are_named(tmp_path, model):
    bare = HybridLM(CFG)
    with pytest.raises(ConfigError, match="draft_vocab.json"):
        make_drafter("mtp", bare, draft_vocab=8)
    with pytest.raises(ConfigError, match=">= 0"):
        make_drafter("mtp", model, draft_vocab=-1)
    (tmp_path / FILE).write_text(json.dumps({"ranked_ids": [0, 99], "default_size": 1}))
    with pytest.raises(ModelLoadError, match="below the vocabulary size"):
        read_draft_vocab(tmp_path, V)
    (tmp_path / FILE).write_text("{not json")
    with pytest.raises(ModelLoadError, match="not a draft vocabulary file"):
        read_draft_vocab(tmp_path, V)


def test_draft_head_of_block_weights_is_q8_0_blocks_of_the_same_rows():
    """A GGUF block LM head's draft head keeps its rows as Q8_0 blocks on the block kernel (a quarter of the bytes of
    fp32 rows): a Q8_0 head's rows bit for bit (re-quantizing Q8_0 values is exact), logits the block product."""
    from mtpspec.kernels import quantized as Q
    from mtpspec.models.common import Linear
    from mtpspec.models.draft_vocab import DraftHead

    if not Q.available():
        pytest.skip("the block kernel could not be built here")
    g = torch.Generator().manual_seed(0)
    head = Linear.of_blocks(Q.q8_0(torch.randn(96, 64, generator=g)))
    ids = torch.tensor([5, 0, 77, 31, 95, 12])
    draft = DraftHead(head, ids)
    assert draft.blocks is not None and torch.equal(Q.dequantize(draft.blocks), head.rows(ids))
    h = torch.randn(3, 64, generator=g)
    assert torch.equal(draft.logits(h), Q.linear(h, draft.blocks))
    assert torch.equal(draft.logits(h), head(h)[:, ids])  # each output the head's own product of that row

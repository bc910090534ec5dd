"""Gumbel-max sampling with position-keyed noise (SamplingParams.sampler = "gumbel").

- Identity: one seed gives the same tokens with speculation off and with every drafter (ngram, the draft model,
  mtp / eagle / medusa heads, mtp's lookup shortcut, the demo model's own MTP module), depths 1..4, k="auto", token
  trees, inside a batch of other requests, and under context controls (frequency penalty).
- Distribution: the first two tokens of speculative runs (mtp, k = 3) over many seeds follow plain sampling's exact
  joint distribution (chi-square, as test_mtp_lossless.py); a single row's Gumbel-max choice follows p.
- The noise is SplitMix64 by hand, keyed by all 64 bits of the seed; "auto" picks gumbel for seeded sampled requests.
"""

from __future__ import annotations

import json

import pytest
import torch

import mtpspec
from mtpspec.cli import main
from mtpspec.config import GenerationConfig
from mtpspec.drafters import make_drafter
from mtpspec.engine import Engine
from mtpspec.errors import ConfigError
from mtpspec.loading import shipped_demo_dir
from mtpspec.prompts import tinystories_prompts
from mtpspec.sampling import (_GOLDEN, Sampler, SamplingParams, gumbel_max, gumbel_uniforms, pick_sampler, position_key,
                              splitmix64)
from mtpspec.types import Draft
from mtpspec.verify import verify
from test_mtp_lossless import V, _chi_square_ok, _exact_two_token_distribution, tiny_hybrid

HEADS = str(shipped_demo_dir().parent / "heads") + "/stories260K-"
PROMPTS = tinystories_prompts(3)
N = 40
SAMPLED = dict(temperature=0.8, top_p=0.95, sampler="gumbel", max_new_tokens=N)


def drafter_kw(name: str, q80) -> dict:
    """generate() keywords of a drafter of stories260K (its shipped heads, the Q8_0 copy as draft model)."""
    return {"ngram": {}, "draft": dict(draft_model=q80), "lookup": dict(drafter="mtp", draft_model=HEADS + "mtp", mtp_lookup=2)}.get(
        name, dict(draft_model=HEADS + name))


@pytest.fixture(scope="module")
def plain(stories):
    return [stories.generate(p, seed=11 + i, **SAMPLED).tokens for i, p in enumerate(PROMPTS)]


def test_noise_is_splitmix64_keyed_by_seed_and_position():
    ids = torch.tensor([0, 1, 2, 511, 262143])
    for seed, t in ((0, 0), (7, 3), (2**64 - 1, 10**6)):
        key = position_key(seed, t)
        want = [((splitmix64(key + (v + 1) * _GOLDEN) >> 12) + 0.5) / 2**52 for v in ids.tolist()]
        assert gumbel_uniforms(key, ids).tolist() == want  # bit for bit: the same numbers on any machine
    # all 64 bits of the seed count (torch's CPU generator keeps only the low 32 of its seed), and the position too
    keys = {position_key(s, t) for s in (1, 1 + 2**32, 2**63 + 1) for t in (0, 1, 2**32)}
    assert len(keys) == 9
    # a row's choice reads its support's noise only: the same token whether the rest of V is scored or not
    p = torch.zeros(4096)
    p[[3, 70, 900]] = torch.tensor([0.5, 0.3, 0.2])
    dense = p.clone()
    dense += 1e-30  # a full support: scored over the whole vocabulary (1e-30 never wins here)
    assert all(int(gumbel_max(p, 5, t)) == int(gumbel_max(dense / dense.sum(), 5, t)) for t in range(50))


def test_the_winner_is_among_the_kernels_candidates():
    """sampling.cpp's candidates always hold the token the whole support's scores pick (torch ops, computed apart), and
    are few: flat and peaked rows of Gemma's vocabulary size, a truncated support, tied probabilities."""
    from mtpspec.kernels import sampling as kernel

    if not kernel.available():
        pytest.skip(f"sampling.cpp did not build: {kernel._EXT.error}")
    g = torch.Generator().manual_seed(3)
    v = 262144
    rows = [torch.softmax(torch.randn(v, generator=g) * s, -1) for s in (0.5, 3.0, 8.0)]
    cut = rows[1].clone()
    cut[cut < cut.topk(50).values[-1]] = 0  # 50 tokens left
    tied = torch.zeros(v)
    tied[::1000] = 1.0  # 263 equal probabilities
    for p in rows + [cut / cut.sum(), tied / tied.sum()]:
        for t in range(40):
            key = position_key(9, t)
            ids = kernel.gumbel_candidates(p, key)
            full = int(torch.argmax(p.double() / -torch.log(gumbel_uniforms(key, torch.arange(v)))))
            assert full in ids.tolist() and ids.shape[0] <= 64, (full, ids.shape)
            assert torch.equal(ids, ids.sort().values) and bool((p[ids] > 0).all())
            assert int(gumbel_max(p, 9, t)) == full


def test_one_row_follows_p():
    p = torch.tensor([0.4, 0.25, 0.15, 0.1, 0.05, 0.03, 0.02, 0.0])
    n = 6000
    counts = torch.zeros(8)
    for seed in range(n):
        counts[int(gumbel_max(p, seed, 12))] += 1
    assert counts[7] == 0  # never outside the support
    ok, stat, df = _chi_square_ok(counts, p.double(), n)
    assert ok, (stat, df)


def test_auto_picks_gumbel_for_seeded_sampling():
    assert pick_sampler("auto", 0.7, seeded=True) == "gumbel"
    assert pick_sampler("auto", 0.7, seeded=False) == "rejection"  # an unseeded server request: today's draws
    assert pick_sampler("auto", 0.0, seeded=True) == "rejection"  # greedy reads no noise
    assert pick_sampler("gumbel", 0.7, seeded=False) == "gumbel"
    assert GenerationConfig(temperature=0.5).sampling().sampler == "gumbel"  # the API and CLI always seed (default 0)
    assert GenerationConfig(temperature=0.5, sampler="rejection").sampling().sampler == "rejection"
    with pytest.raises(ConfigError, match="sampler must be one of auto, rejection, gumbel, got 'gumble'"):
        pick_sampler("gumble", 0.7, True)
    with pytest.raises(ConfigError, match="sampler must be one of rejection, gumbel, got 'auto'"):
        SamplingParams(temperature=1.0, sampler="auto")  # resolved per request, never stored


def test_verify_needs_the_position():
    s = Sampler(SamplingParams(temperature=1.0, sampler="gumbel"), 3)
    with pytest.raises(ValueError, match="absolute positions"):
        verify(Draft(torch.tensor([1])), torch.zeros(2, 8), s)


def test_a_draft_drawn_with_the_same_noise_from_p_is_always_accepted():
    torch.manual_seed(0)
    s = Sampler(SamplingParams(temperature=1.0, sampler="gumbel"), 9)
    for at in range(20):
        logits = torch.randn(5, 32)  # (D + 1, V)
        p = s.probs(logits)
        d = s.draw(p[:4], at)  # (4,) drafted at positions at..at+3
        v = verify(Draft(d, q=p[:4]), logits, s, at)
        assert v.num_accepted == 4 and v.tokens.tolist() == d.tolist() + [int(s.choose(p[4:], [at + 4])[0])]


# the default suite keeps a point mass (ngram, lookup) and a q drafter (mtp); the other q drafters in make test-slow
@pytest.mark.parametrize("drafter", ["ngram", "mtp", "lookup", *(pytest.param(d, marks=pytest.mark.slow) for d in ("draft", "eagle", "medusa"))])
def test_every_drafter_and_depth_gives_plain_sampling_text(stories, stories_q80, plain, drafter):
    kw = {"drafter": drafter, **drafter_kw(drafter, stories_q80)}
    accepted = 0
    for i, (prompt, want) in enumerate(zip(PROMPTS, plain)):
        for k in (1, 2, 3, 4, "auto"):
            r = stories.generate(prompt, k=k, seed=11 + i, **kw, **SAMPLED)
            assert r.tokens == want, (drafter, k, prompt)
            accepted += r.stats.accepted_tokens
    assert accepted > 0  # drafts were really accepted (and so verified against the target's choice)


@pytest.mark.parametrize("drafter, tree", [("eagle", 8), ("mtp", "auto"), ("draft", 6), ("medusa", 8)])
def test_token_trees_give_plain_sampling_text(stories, stories_q80, plain, drafter, tree):
    for i, (prompt, want) in enumerate(zip(PROMPTS, plain)):
        r = stories.generate(prompt, drafter=drafter, k=4, tree=tree, seed=11 + i, **drafter_kw(drafter, stories_q80), **SAMPLED)
        assert r.tokens == want, (drafter, tree, prompt)


def test_inside_a_batch_of_other_requests(stories, stories_q80, plain):
    """Each sequence's text is its own seed's, whoever shares its forwards (greedy and rejection-sampled neighbours)."""
    m = stories.module
    engine = Engine(m, max_batch=8)
    gumbel = SamplingParams(temperature=0.8, top_p=0.95, sampler="gumbel")
    ids = [stories.encode(p) for p in PROMPTS]
    sids = []
    for i, (x, d, k) in enumerate(zip(ids, ["draft", "eagle", "mtp"], [3, 2, 4])):
        dm = stories_q80.module if d == "draft" else HEADS + d
        sids.append(engine.add(x, make_drafter(d, m, draft_model=dm), Sampler(gumbel, 11 + i), k, N, stories.tokenizer.stop_ids))
        engine.add(x[:5], make_drafter("ngram", m), Sampler(SamplingParams(temperature=1.0), i), 2, 30)  # neighbours
        engine.add(x, make_drafter("none", m), Sampler(SamplingParams()), 1, 20)
    got = engine.run()
    assert [got[s].tokens for s in sids] == plain
    # generate_batch: sequence i is seeded seed + i, as alone
    batch = stories.generate_batch(PROMPTS, drafter="draft", draft_model=stories_q80, k=3, seed=11, **SAMPLED)
    assert [r.tokens for r in batch] == plain


def test_under_context_controls(stories, stories_q80):
    kw = dict(SAMPLED, frequency_penalty=1.2, presence_penalty=0.3, seed=4)
    want = stories.generate(PROMPTS[1], **kw).tokens
    assert want != stories.generate(PROMPTS[1], **{**kw, "frequency_penalty": 0.0, "presence_penalty": 0.0}).tokens
    for drafter in ("draft", "eagle", "ngram"):
        for k in (2, "auto"):
            r = stories.generate(PROMPTS[1], drafter=drafter, k=k, **drafter_kw(drafter, stories_q80), **kw)
            assert r.tokens == want, (drafter, k)


@pytest.fixture(scope="module")
def demo():
    return mtpspec.load("demo", threads=1)


def test_demo_model_own_mtp_module(demo):
    prompt = "def add(a, b):\n"
    kw = dict(temperature=1.0, sampler="gumbel", seed=5, max_new_tokens=48)
    want = demo.generate(prompt, drafter="none", **kw).tokens
    for opts in ({"k": 1}, {"k": 3}, {"k": 4}, {"k": "auto"}, {"k": 4, "tree": 8}):
        assert demo.generate(prompt, drafter="mtp", **opts, **kw).tokens == want, opts
    batch = demo.generate_batch([prompt, "x = [", prompt], drafter="mtp", k=3, **{**kw, "seed": 3})
    assert batch[2].tokens == want and batch[0].tokens != want  # seeds 3, 4, 5


def _two_token_counts(model, prompt, params, k, opts, n) -> tuple[torch.Tensor, int]:
    """(V, V) counts of the first two tokens of n mtp runs, seeds 0..n-1, 32 sequences to a batch; accepted drafts."""
    engine = Engine(model, max_batch=32)
    for seed in range(n):
        engine.add(prompt, make_drafter("mtp", model, **opts), Sampler(params, seed), k, 2)
    counts = torch.zeros(V, V)
    results = engine.run().values()
    for r in results:
        counts[r.tokens[0], r.tokens[1]] += 1
    return counts, sum(r.stats.accepted_tokens for r in results)


@pytest.mark.parametrize("k, opts, n", [(3, {}, 800), pytest.param(3, {}, 3000, marks=pytest.mark.slow),
                                        pytest.param(4, {"tree": 6}, 1500, marks=pytest.mark.slow)])
def test_speculative_tokens_follow_plain_sampling(k, opts, n):
    """The first two tokens of mtp runs on the tiny hybrid (V = 16) over many seeds, batched: plain sampling's joint
    distribution (the second token drawn with the first in its context)."""
    model = tiny_hybrid()
    prompt = [1, 4, 1, 5, 9, 2, 6]
    params = SamplingParams(temperature=1.0, sampler="gumbel")
    exact = _exact_two_token_distribution(model, prompt, params)
    counts, accepted = _two_token_counts(model, prompt, params, k, opts, n)
    assert accepted > n // 20  # drafts were accepted: the second token often came from a verified draft
    ok, stat, df = _chi_square_ok(counts, exact, n)
    assert ok, (stat, df)


def test_cli_flag(capsys, assets):
    model = ["--model", str(assets / "models" / "stories260K.bin"), "--tokenizer", str(assets / "models" / "tok512.bin")]
    runs = []
    for extra in (["--drafter", "none"], ["--drafter", "ngram", "--k", "auto"], ["--drafter", "none", "--sampler", "gumbel"]):
        assert main(["generate", "Once upon a time", *model, "--temperature", "0.9", "--seed", "3", "--max-new-tokens", "16",
                     "--json", "--threads", "1", *extra]) == 0
        runs.append(capsys.readouterr().out)
    assert len({json.loads(r)["text"] for r in runs}) == 1  # auto is gumbel: one text with or without drafts
    with pytest.raises(SystemExit) as e:
        main(["generate", "hi", *model, "--sampler", "gumble"])
    assert e.value.code == 2 and "invalid choice: 'gumble'" in capsys.readouterr().err


@pytest.mark.slow
def test_gemma_mtp_head_gives_plain_sampling_text():
    from conftest_gemma import gemma_path

    model = mtpspec.load(str(gemma_path()), threads=1)
    prompt = "The three primary colors are"
    kw = dict(temperature=0.7, sampler="gumbel", seed=2, max_new_tokens=32)
    want = model.generate(prompt, drafter="none", **kw).tokens
    for k in (2, 4, "auto"):
        r = model.generate(prompt, drafter="mtp", k=k, **kw)
        assert r.tokens == want, k
        assert r.stats.accepted_tokens > 0 or k == "auto", k  # auto may step aside to plain steps where drafts do not pay

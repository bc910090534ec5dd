"""--drafter lookahead and --drafter suffix: model-free drafts on the common verify path.

Greedy output is token-identical to plain greedy (stories260K, the demo model, a tiny hybrid), sampled
output follows the target's distribution (the chi-square tests of test_sampling_exact and
test_mtp_lossless, reused), the pools rank as documented, and bad options are ConfigErrors.
"""

from __future__ import annotations

import math

import pytest
import torch

import mtpspec
from mtpspec.drafters import make_drafter
from mtpspec.drafters.lookahead import LookaheadDrafter, NgramPool
from mtpspec.drafters.suffix import SuffixDrafter, SuffixPool, SuffixTrie, shared_pool
from mtpspec.engine import generate_tokens
from mtpspec.errors import ConfigError
from mtpspec.prompts import tinystories_prompts
from mtpspec.sampling import Sampler, SamplingParams
from mtpspec.types import TargetOutput, Verdict
from test_mtp_lossless import CFG as HYBRID_CFG
from test_mtp_lossless import V as HYBRID_V
from test_mtp_lossless import _chi_square_ok, _exact_two_token_distribution
from test_sampling_exact import PARAMS, PROMPT, chi_square, exact_pairs

DRAFTERS = ("lookahead", "suffix")
PROMPTS = tinystories_prompts(5)
N = 96
CODE = [
    "def fib(n):\n    if n < 2:\n        return n\n    return fib(n - 1) + fib(n - 2)\n\n\ndef fact(n):\n",
    "import os\n\n\ndef list_files(path):\n    \"\"\"Return the files under path.\"\"\"\n",
    "class Stack:\n    def __init__(self):\n        self.items = []\n\n    def push(self, x):\n",
]


@pytest.fixture(scope="module")
def plain(stories):
    return [stories.generate(p, max_new_tokens=N).tokens for p in PROMPTS]


@pytest.mark.parametrize("drafter", DRAFTERS)
@pytest.mark.parametrize("k", [1, 3, 6])
def test_greedy_identical_to_plain_stories(stories, plain, drafter, k):
    accepted = 0
    for prompt, ref in zip(PROMPTS, plain):
        r = stories.generate(prompt, drafter=drafter, k=k, max_new_tokens=N)
        assert r.tokens == ref, f"{drafter} k={k} differs from plain on {prompt!r}"
        accepted += r.stats.accepted_tokens
    assert accepted > 0  # drafts were made and verified, rejected ones rolled back


@pytest.fixture(scope="module")
def demo():
    return mtpspec.load("demo")


@pytest.fixture(scope="module")
def demo_plain(demo):
    return [demo.generate(p, max_new_tokens=64).tokens for p in CODE]


# k = 2 (3-6 s each) in make test-slow: the stories tests above vary k (1, 3, 6), here k = 5 rolls back 0..5 drafts
@pytest.mark.parametrize("drafter", DRAFTERS)
@pytest.mark.parametrize("k", [pytest.param(2, marks=pytest.mark.slow), 5])
def test_greedy_identical_to_plain_demo(demo, demo_plain, drafter, k):
    """The hybrid demo model (Gated DeltaNet state rolled back on rejection) on Python prompts."""
    accepted = 0
    for prompt, ref in zip(CODE, demo_plain):
        r = demo.generate(prompt, drafter=drafter, k=k, max_new_tokens=64)
        assert r.tokens == ref, f"{drafter} k={k} differs from plain on {prompt!r}"
        accepted += r.stats.accepted_tokens
    assert accepted > 0


@pytest.mark.parametrize("drafter, opts", [
    ("lookahead", dict(lookahead_n=2)), ("lookahead", dict(lookahead_n=6)), ("lookahead", dict(lookahead_jacobi=False)),
    ("suffix", dict(suffix_depth=2)), ("suffix", dict(suffix_depth=6)), ("suffix", dict(suffix_shared=True)),
])
def test_options_stay_lossless(stories, plain, drafter, opts):
    for prompt, ref in zip(PROMPTS[:3], plain):
        assert stories.generate(prompt, drafter=drafter, k=4, max_new_tokens=N, **opts).tokens == ref


def test_auto_depth_and_a_batch_stay_lossless(stories, plain):
    for drafter in DRAFTERS:
        assert stories.generate(PROMPTS[0], drafter=drafter, k="auto", max_new_tokens=N).tokens == plain[0]
        got = stories.generate_batch(PROMPTS[:3], drafter=drafter, k=3, max_new_tokens=N)
        assert [r.tokens for r in got] == plain[:3]


@pytest.fixture(scope="module")
def hybrid():
    from mtpspec.models.qwen35 import HybridLM
    from qwen35_tiny import randomize

    torch.manual_seed(0)
    m = HybridLM(HYBRID_CFG)
    randomize(m, 5)
    return m.eval()


HYBRID_PROMPTS = [[3], [1, 4, 1, 5, 9, 2, 6], [7, 7, 7, 7], list(range(16)) + list(range(8))]


@pytest.fixture(scope="module")
def hybrid_plain(hybrid) -> list[list[int]]:
    """Plain greedy's 48 tokens after each of HYBRID_PROMPTS."""
    return [generate_tokens(hybrid, p, make_drafter("none", hybrid), 1, Sampler(SamplingParams()), 48).tokens for p in HYBRID_PROMPTS]


@pytest.mark.parametrize("drafter", DRAFTERS)
def test_greedy_identical_to_plain_tiny_hybrid(hybrid, hybrid_plain, drafter):
    """A 16-token vocabulary: short loops, many rejections, so the Jacobi guesses and the trie's walk are used a lot."""
    accepted = 0
    for prompt, ref in zip(HYBRID_PROMPTS, hybrid_plain):
        for k in (1, 4):
            r = generate_tokens(hybrid, prompt, make_drafter(drafter, hybrid), k, Sampler(SamplingParams()), 48)
            assert r.tokens == ref, f"{drafter} k={k} differs on {prompt}"
            accepted += r.stats.accepted_tokens
    assert accepted > 0


# make test-slow (25-30 s each): with two new tokens one verify runs, on the draft built from the prompt (its n-grams
# and, for lookahead, the prefill's argmax guesses), a point mass fixed before any random draw, as ngram's is in the
# default suite's test_batch.py[ngram] (lookahead's later, Jacobi-fed drafts: the hybrid test below)
@pytest.mark.slow
@pytest.mark.parametrize("drafter", DRAFTERS)
def test_first_two_tokens_follow_the_target_distribution(stories, drafter):
    ids = stories.encode(PROMPT)
    exact = exact_pairs(stories, ids)
    n = 1500
    counts: dict[tuple[int, int], int] = {}
    drafted = 0
    for seed in range(n):
        r = stories.generate(ids, drafter=drafter, k=3, temperature=PARAMS.temperature, top_p=PARAMS.top_p, seed=seed, max_new_tokens=2)
        counts[tuple(r.tokens)] = counts.get(tuple(r.tokens), 0) + 1
        drafted += r.stats.draft_tokens
    assert drafted > n // 2  # the drafter really proposed
    stat, df = chi_square(counts, exact, n)
    assert stat < df + 5 * math.sqrt(2 * df), (stat, df)
    tv = 0.5 * sum(abs(counts.get(c, 0) / n - exact.get(c, 0.0)) for c in set(counts) | set(exact))
    assert tv < 0.12, tv


def _exact_three_token_distribution(model, prompt, params) -> dict[tuple[int, int, int], float]:
    """P(t1, t2, t3) of plain sampling after `prompt`, over the cells of nonzero probability."""
    s = Sampler(params)

    def probs(ids):
        return s.probs(model.forward_tokens(torch.tensor(ids), model.new_cache()).logits[-1]).double()  # (V,)

    joint = {}
    p1 = probs(prompt)
    for t1 in torch.nonzero(p1).flatten().tolist():
        p2 = probs(prompt + [t1])
        for t2 in torch.nonzero(p2).flatten().tolist():
            p3 = probs(prompt + [t1, t2])
            for t3 in torch.nonzero(p3).flatten().tolist():
                joint[(t1, t2, t3)] = (p1[t1] * p2[t2] * p3[t3]).item()
    return joint


@pytest.mark.slow  # 60 s
@pytest.mark.parametrize("drafter, n_tokens", [("lookahead", 3), ("suffix", 2)])
def test_sampling_distribution_on_a_hybrid(hybrid, drafter, n_tokens):
    """lookahead: three tokens, so a second step drafts from the first verify's guesses (the Jacobi tail
    and the pool's guessed n-grams, which read the target's logits) and the test covers that path."""
    params = SamplingParams(temperature=0.9, top_p=0.9)
    prompt = [2, 9, 4, 2, 9]  # "2 9" occurred before: both drafters propose "4 2"
    n_runs = 1500 if n_tokens == 3 else 1000
    counts: dict[tuple, int] = {}
    drafted = 0
    for seed in range(n_runs):
        r = generate_tokens(hybrid, prompt, make_drafter(drafter, hybrid), 2, Sampler(params, seed), n_tokens)
        counts[tuple(r.tokens)] = counts.get(tuple(r.tokens), 0) + 1
        drafted += r.stats.draft_tokens
    assert drafted >= n_runs  # every first step drafted
    if n_tokens == 2:
        joint = _exact_two_token_distribution(hybrid, prompt, params)
        dense = torch.zeros(HYBRID_V, HYBRID_V)
        for (a, b), c in counts.items():
            dense[a, b] = c
        ok, stat, df = _chi_square_ok(dense, joint, n_runs)
        assert ok, f"{drafter}: chi-square {stat:.1f} with {df} degrees of freedom"
        exact = {(a, b): joint[a, b].item() for a in range(HYBRID_V) for b in range(HYBRID_V) if joint[a, b] > 0}
    else:
        exact = _exact_three_token_distribution(hybrid, prompt, params)
        stat, df = chi_square(counts, exact, n_runs)
        assert df >= 20 and stat < df + 5 * math.sqrt(2 * df), (stat, df)
        return  # (many cells: the total variation of 1500 exact samples is itself ~0.25, no test)
    tv = 0.5 * sum(abs(counts.get(c, 0) / n_runs - exact.get(c, 0.0)) for c in set(counts) | set(exact))
    assert tv < 0.12, tv


def test_seeded_sampling_reproduces(stories):
    for drafter in DRAFTERS:
        runs = [stories.generate(PROMPTS[0], drafter=drafter, k=4, temperature=0.8, top_p=0.9, seed=7, max_new_tokens=40).tokens
                for _ in range(2)]
        assert runs[0] == runs[1]


# --- the pools themselves ---


def test_ngram_pool_ranks_by_count_then_recency():
    pool, toks = NgramPool(3), [5, 6, 7, 5, 6, 8, 5, 6, 8]
    for j in range(1, len(toks)):
        pool.add(toks, j, toks[j])
    assert pool.lookup([5, 6], 2) == 8  # 8 followed "5 6" twice, 7 once
    pool.add([5, 6], 2, 7)  # "5 6 7" again: a tie, and 7 is the newer
    assert pool.lookup([5, 6], 2) == 7
    assert pool.lookup([1, 2, 3], 2) is None


def test_jacobi_guesses_feed_the_pool_and_the_next_draft():
    """A rejected draft: the target's argmax at the rows after it become n-grams and the next step's guesses."""
    d = LookaheadDrafter(n=3)
    d.prefill(torch.tensor([1, 2, 3]), None, Sampler(SamplingParams()))
    draft = d.propose(torch.tensor([1, 2, 3]), 3)
    assert draft.tokens.tolist() == []  # nothing seen after "3" (or after "2 3") yet
    d.draft = [9, 10, 11]  # as if it had proposed this chain
    logits = torch.zeros(4, 32)
    for row, tok in enumerate([4, 20, 21, 22]):  # the target: 4 after "3" (d1 = 9 rejected), then 20 after 9, ...
        logits[row, tok] = 1.0
    d.commit(Verdict(num_accepted=0, tokens=torch.tensor([4]), num_drafted=3), TargetOutput(logits=logits, hidden=torch.zeros(4, 1)))
    assert d.tail == [20, 21, 22]
    assert d.pool.lookup([3, 9], 2) == 20 and d.pool.lookup([9, 10, 11], 2) == 22
    assert d.propose(torch.tensor([1, 2, 3, 4]), 3).tokens.tolist() == [20, 21, 22]  # the Jacobi guesses, shifted


def test_suffix_trie_matches_the_longest_suffix_and_walks_the_most_frequent():
    trie = SuffixTrie(depth=4)
    text = [1, 2, 3, 4, 9, 2, 3, 5, 7, 2, 3, 5, 8]
    trie.feed([], text)
    m, node = trie.match([6, 2, 3])
    assert m == 2 and node.count == 3  # "2 3" occurred three times; "6 2 3" never
    assert SuffixTrie.walk(node, 3) == [5, 8]  # "5" twice beats "4" once; "7" and "8" once each, "8" newer; then depth 4 ends it
    assert trie.match([42]) == (0, None)  # never seen
    assert trie.match([5, 8]) == (0, None)  # seen, but never followed by anything


def test_suffix_drafter_chains_past_the_trie_depth():
    d = SuffixDrafter(depth=3)
    ctx = torch.tensor([1, 2, 3, 4, 5, 6, 7, 1, 2])
    d.prefill(ctx, None, Sampler(SamplingParams()))
    assert d.propose(ctx, 5).tokens.tolist() == [3, 4, 5, 6, 7]  # matched again from the extended context


def test_a_shared_pool_carries_one_sequences_output_to_the_next(stories, plain):
    pool = SuffixPool(depth=24)
    ids = stories.encode(PROMPTS[1])
    runs = [generate_tokens(stories.module, ids, SuffixDrafter(24, pool), 6, Sampler(SamplingParams()), N) for _ in range(2)]
    assert runs[0].tokens == runs[1].tokens == plain[1]
    assert runs[1].stats.target_forwards < runs[0].stats.target_forwards  # the second run drafts from the first's output
    assert shared_pool(stories.module, 24) is shared_pool(stories.module, 24)
    assert shared_pool(stories.module, 24) is not shared_pool(stories.module, 8)


def test_a_shared_pool_forgets_when_full():
    pool = SuffixPool(depth=4, max_tokens=10)
    cur, gen = pool.feed([], pool.generation, list(range(8)))
    assert pool.trie.stamp == 8
    cur, gen2 = pool.feed(cur, gen, [1, 2, 3])  # over the cap: a fresh trie, the stale cursor dropped
    assert gen2 == gen + 1 and pool.trie.stamp == 3 and pool.trie.match([5, 6]) == (0, None)


# --- options ---


@pytest.mark.parametrize("drafter, opts, msg", [
    ("lookahead", dict(lookahead_n=1), "--lookahead-n must be >= 2"),
    ("lookahead", dict(lookahead_n="3"), "--lookahead-n must be an integer"),
    ("lookahead", dict(lookahead_n=2.5), "--lookahead-n must be an integer"),
    ("lookahead", dict(lookahead_jacobi=1), "--lookahead-jacobi must be true or false"),
    ("lookahead", dict(ngram_max=3), "--ngram-max is not used by --drafter lookahead"),
    ("lookahead", dict(suffix_depth=8), "--suffix-depth is not used by --drafter lookahead"),
    ("suffix", dict(suffix_depth=1), "--suffix-depth must be >= 2"),
    ("suffix", dict(suffix_depth=True), "--suffix-depth must be an integer"),
    ("suffix", dict(suffix_shared="yes"), "--suffix-shared must be true or false"),
    ("suffix", dict(lookahead_n=3), "--lookahead-n is not used by --drafter suffix"),
    ("ngram", dict(lookahead_n=3), "--lookahead-n is not used by --drafter ngram"),
    ("suffix", dict(suffix_dept=3), "did you mean 'suffix_depth'"),
])
def test_bad_options_are_config_errors(stories, drafter, opts, msg):
    with pytest.raises(ConfigError, match=msg):
        make_drafter(drafter, stories.module, **opts)
    with pytest.raises(ConfigError, match=msg):
        stories.generate("x", drafter=drafter, max_new_tokens=2, **opts)


def test_no_draft_model_and_matching_pool_depth(stories, stories_q80):
    for drafter in DRAFTERS:
        with pytest.raises(ConfigError, match=f"--draft-model is not used by --drafter {drafter}"):
            make_drafter(drafter, stories.module, draft_model=stories_q80.module)
    with pytest.raises(ConfigError, match="depth 24"):
        SuffixDrafter(depth=8, pool=SuffixPool(depth=24))
    with pytest.raises(ConfigError, match="--lookahead-n must be >= 2"):
        LookaheadDrafter(n=0)


def test_cli_flags(assets, plain, capsys):
    """mtpspec generate takes the drafters' options as flags; a bad value is one line and exit code 2."""
    import json

    from mtpspec.cli import main

    m = assets / "models"
    base = ["generate", PROMPTS[0], "--model", str(m / "stories260K.bin"), "--tokenizer", str(m / "tok512.bin"),
            "--max-new-tokens", str(N), "--json", "--k", "3"]
    for extra in (["--drafter", "lookahead", "--lookahead-n", "3", "--no-lookahead-jacobi"], ["--drafter", "lookahead", "--lookahead-jacobi"],
                  ["--drafter", "suffix", "--suffix-depth", "8", "--suffix-shared"]):
        assert main(base + extra) == 0
        assert json.loads(capsys.readouterr().out)["tokens"] == plain[0]
    for extra, msg in ((["--drafter", "suffix", "--suffix-depth", "1"], "--suffix-depth must be >= 2"),
                       (["--drafter", "ngram", "--lookahead-n", "3"], "--lookahead-n is not used by --drafter ngram")):
        assert main(base + extra) == 2
        err = capsys.readouterr().err
        assert msg in err and "Traceback" not in err

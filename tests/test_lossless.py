"""Every drafter, several k: greedy output token-identical to plain greedy on real prompts (fp32)."""

import pytest

from mtpspec.drafters import make_drafter
from mtpspec.engine import generate_tokens
from mtpspec.prompts import tinystories_prompts
from mtpspec.sampling import Sampler, SamplingParams

PROMPTS = tinystories_prompts(6)
N = 96


@pytest.fixture(scope="module")
def plain(stories):
    return [stories.generate(p, max_new_tokens=N).tokens for p in PROMPTS]


@pytest.mark.parametrize("drafter, k", [("ngram", 1), ("ngram", 2), ("ngram", 5), ("ngram", 8),
                                        ("draft", 1), ("draft", 3), ("draft", 6)])
def test_greedy_identical_to_plain(stories, stories_q80, plain, drafter, k):
    accepted = 0
    for prompt, ref in zip(PROMPTS, plain):
        r = stories.generate(prompt, drafter=drafter, k=k, draft_model=stories_q80 if drafter == "draft" else None, max_new_tokens=N)
        assert r.tokens == ref, f"{drafter} k={k} differs from plain on {prompt!r}"
        assert r.stats.target_forwards < len(ref) or drafter == "ngram"
        accepted += r.stats.accepted_tokens
    assert accepted > 0  # the drafter really drafted and was really verified


def test_ngram_options_stay_lossless(stories, plain):
    for prompt, ref in zip(PROMPTS[:3], plain):
        assert stories.generate(prompt, drafter="ngram", k=3, ngram_min=2, ngram_max=4, max_new_tokens=N).tokens == ref


def test_seeded_sampling_reproduces(stories, stories_q80):
    for drafter in ("none", "ngram", "draft"):
        runs = [stories.generate(PROMPTS[0], drafter=drafter, draft_model=stories_q80 if drafter == "draft" else None, temperature=0.8, top_p=0.9,
                                 seed=7, max_new_tokens=40).tokens for _ in range(2)]
        assert runs[0] == runs[1]
    other = stories.generate(PROMPTS[0], temperature=0.8, seed=8, max_new_tokens=40).tokens
    assert other != runs[0]


def test_stop_token_inside_an_accepted_draft(stories, stories_q80, plain):
    """A stop token among accepted drafts ends generation there; nothing after it is emitted."""
    ref = plain[0]
    stop = ref[20]
    cut = ref[: ref.index(stop)]
    ids = stories.encode(PROMPTS[0])
    for drafter in ("none", "draft"):
        d = make_drafter(drafter, stories.module, draft_model=stories_q80.module if drafter == "draft" else None)
        r = generate_tokens(stories.module, ids, d, 8, Sampler(SamplingParams()), N, stop_ids=(stop,))
        assert r.tokens == cut and r.finish_reason == "stop"


@pytest.mark.parametrize("limit", [0, 1, 7, 13])
def test_max_new_tokens_inside_a_step(stories, stories_q80, plain, limit):
    r = stories.generate(PROMPTS[0], drafter="draft", k=8, draft_model=stories_q80, max_new_tokens=limit)
    assert r.tokens == plain[0][:limit] and r.finish_reason == "length"


def test_context_end(stories, stories_q80):
    """A prompt near the 512-token context: generation stops when the context is full, still lossless."""
    ids = [1] + stories.encode(" ".join(tinystories_prompts(200, words=60)))[1:509]  # 509 tokens
    ref = stories.generate(ids, max_new_tokens=50)
    assert ref.finish_reason == "context" and len(ref.tokens) == 512 - 509 + 1
    for drafter in ("ngram", "draft"):
        r = stories.generate(ids, drafter=drafter, k=8, draft_model=stories_q80 if drafter == "draft" else None, max_new_tokens=50)
        assert r.tokens == ref.tokens and r.finish_reason == "context"


def test_fp64_end_to_end_every_drafter_identical(assets, capsys):
    """`--dtype fp64` computes in float64 throughout (no float32 cast left in the forward), and the
    speculative drafters give plain greedy's tokens there too: identity with no rounding to blame."""
    import json

    import torch

    import mtpspec
    from mtpspec.cli import main

    m = assets / "models"
    model = mtpspec.load(m / "stories260K.bin", tokenizer=m / "tok512.bin", dtype="fp64")
    out = model.module.forward_tokens(torch.tensor([1, 403, 407]), model.module.new_cache())
    assert out.logits.dtype == torch.float64 and out.hidden.dtype == torch.float64
    base = ["generate", PROMPTS[0], "--model", str(m / "stories260K.bin"), "--tokenizer", str(m / "tok512.bin"),
            "--dtype", "fp64", "--max-new-tokens", "48", "--json"]
    runs = {}
    for extra in (["--drafter", "none"], ["--drafter", "ngram", "--k", "3"], ["--drafter", "draft", "--draft-model", str(m / "stories260K_q80.bin"), "--k", "4"]):
        assert main(base + extra) == 0
        runs[" ".join(extra)] = json.loads(capsys.readouterr().out)["tokens"]
    assert len(set(map(tuple, runs.values()))) == 1, runs

"""Verify windows longer than the short-window path (T > 16 positions) on hybrid models.

Any forward but a prompt prefill keeps what rebuilds the recurrent state after each of its positions
(pieces of at most 64 positions, each with its incoming state), so `crop` rolls back exactly at any
position of a window of any length, with no re-forward; exact mode keeps its position-by-position
path for every window, so speculation stays bitwise equal to plain decoding at k >= 16.

The maths is proven in float64. Tolerance: on the tiny model below the measured differences between a
cropped window and a direct forward of the kept prefix are <= 4e-14 (states ~3, logits ~5 in size);
fp64 rounding over the ~1e3 operations each value depends on keeps them below ~1e-12 of the scale on
any CPU, while a wrong slot or piece (what these tests catch) moves them by ~1e-1. Hence 1e-10.
"""

from __future__ import annotations

import pytest
import torch

import mtpspec
from mtpspec.drafters import make_drafter
from mtpspec.engine import generate_tokens
from mtpspec.models.qwen35 import HybridConfig, HybridLM
from mtpspec.sampling import Sampler, SamplingParams
from exact_passes import logits_in_passes
from qwen35_tiny import randomize

CFG = HybridConfig(
    vocab_size=64, hidden_size=32, num_layers=4, layer_types=("linear_attention", "linear_attention", "full_attention", "linear_attention"),
    num_heads=4, num_kv_heads=2, head_dim=16, intermediate_size=48, max_seq_len=192, linear_key_head_dim=8,
    linear_value_head_dim=8, linear_num_key_heads=2, linear_num_value_heads=4, mtp_num_layers=1,
)
REL = 1e-10  # fp64, relative to the reference's largest magnitude (see the module docstring)
P = 20  # prompt length: > 16, so its prefill runs the chunked form


@pytest.fixture(scope="module")
def model64():
    torch.manual_seed(0)
    m = HybridLM(CFG)
    randomize(m, 3)
    return m.double().eval()


def _close(a: torch.Tensor, b: torch.Tensor) -> None:
    torch.testing.assert_close(a, b, rtol=0, atol=REL * max(b.abs().max().item(), 1.0))


def _prefilled(model, tokens: torch.Tensor):
    cache = model.new_cache()
    out = model.forward_tokens(tokens, cache, prefill=True)  # chunked, final state only: an independent reference for the window paths
    return cache, out


def _tokens(seed: int, t: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, 64, (P,), generator=g), torch.randint(0, 64, (t,), generator=g)


@pytest.mark.parametrize("t", [17, 40, 70, 130])
def test_crop_to_every_position_equals_a_direct_forward(model64, t):
    prompt, window = _tokens(t, t)
    spec, _ = _prefilled(model64, prompt)
    out = model64.forward_tokens(window, spec).logits  # ONE forward over t positions (pieces of <= 64)
    for j in range(t, -1, -1):  # crop only moves down: every slot, last first
        spec.crop(P + j)
        direct, ref = _prefilled(model64, torch.cat([prompt, window[:j]]))
        for i in range(spec.n_linear):
            (conv_a, s_a), (conv_b, s_b) = spec.linear_state(i), direct.linear_state(i)
            _close(conv_a, conv_b)
            _close(s_a, s_b)
        if j:
            _close(out[:j], ref.logits[P:])


@pytest.mark.parametrize("t", [40, 130])
def test_generation_continues_from_any_slot(model64, t):
    """The next forward materialises the chosen slot in place (in the right piece): continuing matches."""
    prompt, window = _tokens(100 + t, t)
    probe = torch.tensor([5, 9, 2])
    for j in sorted({0, 1, 16, 17, 63, 64, 65, 127, 128, t - 1, t} & set(range(t + 1))):
        spec, _ = _prefilled(model64, prompt)
        model64.forward_tokens(window, spec)
        spec.crop(P + j)
        direct, _ = _prefilled(model64, torch.cat([prompt, window[:j]]))
        _close(model64.forward_tokens(probe, spec).logits, model64.forward_tokens(probe, direct).logits)


def test_a_prefill_keeps_only_its_final_state_and_conv_ends(model64):
    prompt, window = _tokens(7, 100)
    cache, _ = _prefilled(model64, torch.cat([prompt, window]))
    k1 = CFG.linear_conv_kernel_dim - 1
    assert all(w is None for w in cache.window)  # no per-position slots for a prefill
    assert all(h.shape[-1] == 2 * k1 for h in cache.hist)  # nor its whole conv window
    probe = torch.tensor([3, 1, 4, 1, 5])
    unflagged = model64.new_cache()
    model64.forward_tokens(torch.cat([prompt, window]), unflagged)  # keeps its slots (pieces)
    _close(model64.forward_tokens(probe, cache).logits, model64.forward_tokens(probe, unflagged).logits)
    cache.crop(len(prompt) + 100 + 2)  # inside the probe forward (a short window): fine
    with pytest.raises(ValueError, match="only positions"):
        cache.crop(len(prompt) + 50)


@pytest.mark.parametrize("drafter", ["mtp", "ngram"])
@pytest.mark.parametrize("prompt", [[1], [1, 7, 8, 9, 7, 8, 9, 7, 8] * 3])
def test_fp64_speculation_with_long_windows_is_plain_greedy(model64, drafter, prompt):
    """k = 20 and 40 on a BOS-only prompt (no prefill: the first verify window starts at 0) and a long one."""
    def run(name: str, k: int) -> list[int]:
        return generate_tokens(model64, prompt, make_drafter(name, model64), k, Sampler(SamplingParams()), 32).tokens

    ref = run("none", 1)
    for k in (20, 40):
        assert run(drafter, k) == ref, (drafter, k)


# -- exact mode: position by position for any window, bitwise equal to plain steps -------------------

EXACT_CFG = HybridConfig(
    vocab_size=16, hidden_size=32, num_layers=4, layer_types=("linear_attention", "full_attention", "linear_attention", "full_attention"),
    num_heads=4, num_kv_heads=2, head_dim=16, intermediate_size=48, max_seq_len=256, linear_key_head_dim=8,
    linear_value_head_dim=8, linear_num_key_heads=2, linear_num_value_heads=4, mtp_num_layers=1,
)


@pytest.fixture(scope="module")
def model_bf16():
    torch.manual_seed(0)
    m = HybridLM(EXACT_CFG)
    randomize(m, 5)
    return m.to(torch.bfloat16).eval()


@pytest.mark.parametrize("k", [16, 17, 31])
def test_exact_verify_rows_bitwise_equal_plain_steps(model_bf16, k):
    ids = torch.randint(0, 16, (P + 2 * (k + 1) + 3,), generator=torch.Generator().manual_seed(k))
    plain = logits_in_passes(model_bf16, ids, P, 1)
    for chunk in (7, k + 1):
        assert torch.equal(logits_in_passes(model_bf16, ids, P, chunk), plain), f"k={k}, passes of {chunk}"


# k = 17 and 31 (6-7 s each) in make test-slow: the default suite has their bitwise rows (above), what token identity
# follows from, and k = 16 (the first window past 16 positions) end to end
@pytest.mark.parametrize("k", [16, pytest.param(17, marks=pytest.mark.slow), pytest.param(31, marks=pytest.mark.slow)])
def test_exact_bf16_speculation_token_identical(model_bf16, k):
    prompts = [[10, 1, 6, 7, 7, 14, 8, 1, 5, 9, 13] * 2, [3]]  # a prefilled prompt, and BOS only
    for prompt in prompts:
        def run(name: str) -> list[int]:
            return generate_tokens(model_bf16, prompt, make_drafter(name, model_bf16), k, Sampler(SamplingParams()), 24, exact=True).tokens

        ref = run("none")
        for drafter in ("mtp", "ngram"):
            assert run(drafter) == ref, (prompt, drafter, k)


# -- the shipped demo model (the crash of issue 12: --drafter mtp --k 20) ----------------------------

@pytest.fixture(scope="module")
def demo():
    return mtpspec.load("demo")


@pytest.fixture(scope="module")
def demo_plain(demo):
    return demo.generate("def parse_args(argv):", max_new_tokens=24).tokens


@pytest.mark.parametrize("drafter", ["mtp", "ngram"])
@pytest.mark.parametrize("k", [17, 20, 31])
def test_demo_long_drafts_give_plain_greedy_tokens(demo, demo_plain, drafter, k):
    assert demo.generate("def parse_args(argv):", drafter=drafter, k=k, max_new_tokens=24).tokens == demo_plain


def test_demo_sampling_with_a_long_draft_is_a_valid_run(demo):
    res = demo.generate("def parse_args(argv):", drafter="mtp", k=33, max_new_tokens=24, temperature=1.0, seed=3)
    assert len(res.tokens) == 24 and all(0 <= t < demo.module.vocab_size for t in res.tokens)


def test_demo_verify_page_checks_a_64_token_draft(demo, demo_plain):
    """The verify page's longest draft (D = 64): one 65-position pass, its verdict plain greedy's tokens."""
    from mtpspec.server.verify_page import MAX_DRAFT, verify_draft

    res = verify_draft(demo, "def parse_args(argv):", drafter="mtp", k=MAX_DRAFT)
    assert res["num_drafted"] == MAX_DRAFT
    emitted = [t["id"] for t in res["emitted"]]
    assert len(emitted) == res["num_accepted"] + 1
    assert emitted[:24] == demo_plain[: len(emitted)]


@pytest.mark.parametrize("temperature", [0.0, 0.9])
def test_hybrid_draft_model_rolls_back_across_its_draft_forwards(model64, temperature):
    """A hybrid as `--drafter draft`'s draft model drafts one forward per token, further back than a
    crop reaches: it restores a snapshot taken after the context. Greedy equals plain; sampling runs
    and keeps the draft model in step with the context (acceptance well above chance)."""
    torch.manual_seed(1)
    draft = HybridLM(CFG)
    randomize(draft, 5)
    draft = draft.double().eval()
    prompt = [1, *_tokens(3, 1)[0].tolist()]
    params = SamplingParams(temperature=temperature)
    plain = generate_tokens(model64, prompt, make_drafter("none", model64), 1, Sampler(params, 7), 40)
    for k in (1, 3, 6):
        res = generate_tokens(model64, prompt, make_drafter("draft", model64, draft_model=draft), k, Sampler(params, 7), 40)
        assert res.stats.draft_tokens > 0
        if temperature == 0.0:
            assert res.tokens == plain.tokens, k
    self_drafted = generate_tokens(model64, prompt, make_drafter("draft", model64, draft_model=model64), 4, Sampler(params, 7), 40)
    if temperature == 0.0:  # the target drafting for itself: every draft accepted, only if its state stays in step
        assert self_drafted.tokens == plain.tokens and self_drafted.stats.accepted_tokens == self_drafted.stats.draft_tokens

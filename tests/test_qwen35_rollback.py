"""Exact rollback of the hybrid cache: "verify D, accept n" leaves the state of feeding those n + 1 tokens directly."""

from __future__ import annotations

import copy

import pytest
import torch

from mtpspec.models.qwen35 import HybridConfig, HybridLM
from qwen35_tiny import randomize

CFG = HybridConfig(
    vocab_size=64, hidden_size=32, num_layers=4, layer_types=("linear_attention", "linear_attention", "full_attention", "linear_attention"),
    num_heads=4, num_kv_heads=2, head_dim=16, intermediate_size=48, max_seq_len=128, linear_key_head_dim=8,
    linear_value_head_dim=8, linear_num_key_heads=2, linear_num_value_heads=4, mtp_num_layers=1,
)


# Rolled-back vs directly computed, in units of eps(dtype) * max |reference|: the same maths through
# differently shaped passes (a verify window vs the kept prefix), so only rounding differs. Measured with
# d = 1..16: conv window <= 5.4 / 27, state <= 10.5 / 33, next logits <= 15.5 / 22 (fp32 / fp64).
# fp64 bound: 1e-10 relative, i.e. the maths; fp32: 256 eps32 (~16x margin). A wrong slot is O(1).
ULPS = {torch.float32: 256, torch.float64: 1e-10 / torch.finfo(torch.float64).eps}
DTYPES = pytest.mark.parametrize("dtype", [torch.float32, torch.float64], ids=["fp32", "fp64"])


@pytest.fixture(scope="module")
def models():
    torch.manual_seed(0)
    m = HybridLM(CFG)
    randomize(m, 3)
    m.eval()
    return {torch.float32: m, torch.float64: copy.deepcopy(m).double()}


@pytest.fixture
def model(models, dtype):
    return models[dtype]


@pytest.fixture
def dtype():
    return torch.float32


def _close(got: torch.Tensor, want: torch.Tensor, what: str = "") -> None:
    assert got.dtype == want.dtype
    err = (got - want).abs().max() / (torch.finfo(want.dtype).eps * want.abs().max())
    assert err < ULPS[want.dtype], f"{what}: {err.item():.1f} eps * scale apart"


def _states(cache):
    return [cache.linear_state(i) for i in range(cache.n_linear)]


@DTYPES
@pytest.mark.parametrize("d", [1, 2, 4, 8])
def test_crop_selects_the_slot_of_feeding_the_kept_tokens(model, d):
    g = torch.Generator().manual_seed(d)
    prompt = torch.randint(0, 64, (20,), generator=g)  # > 16 tokens: prefilled by the chunked form
    window = torch.randint(0, 64, (d + 1,), generator=g)  # [last, d1..dD]
    probe = torch.randint(0, 64, (3,), generator=g)
    for n in range(d + 1):
        spec = model.new_cache()
        model.forward_tokens(prompt, spec)
        model.forward_tokens(window, spec)  # verify pass over D + 1 positions
        spec.crop(len(prompt) + n + 1)  # accept n drafts (+ the recovered / bonus token's predecessor)
        direct = model.new_cache()
        model.forward_tokens(prompt, direct)
        model.forward_tokens(window[: n + 1], direct)
        assert spec.length == direct.length
        for (conv_a, s_a), (conv_b, s_b) in zip(_states(spec), _states(direct)):
            _close(conv_a, conv_b, f"conv window, n={n}")  # same maths; GEMM row blocking may differ
            _close(s_a, s_b, f"state, n={n}")
        # and the model continues identically from both
        a = model.forward_tokens(probe, spec).logits
        b = model.forward_tokens(probe, direct).logits
        _close(a, b, f"next logits, n={n}")


@DTYPES
def test_crop_to_the_start_of_the_last_forward(model):
    prompt = torch.arange(10)
    spec, direct = model.new_cache(), model.new_cache()
    model.forward_tokens(prompt, spec)
    model.forward_tokens(torch.tensor([5, 6, 7]), spec)
    spec.crop(10)
    model.forward_tokens(prompt, direct)
    x = torch.tensor([9, 8])
    _close(model.forward_tokens(x, spec).logits, model.forward_tokens(x, direct).logits, "after crop")


def test_crop_beyond_saved_slots_raises(model):
    cache = model.new_cache()
    model.forward_tokens(torch.arange(30), cache, prefill=True)  # a prompt prefill: chunked, only the final state is kept
    with pytest.raises(ValueError, match="kept only its final state"):
        cache.crop(25)
    model.forward_tokens(torch.arange(4), cache)
    with pytest.raises(ValueError, match="only positions 30..34"):
        cache.crop(29)
    cache.crop(31)  # inside the last (recurrent) forward: fine


@DTYPES
def test_mtp_cache_crop(model, dtype):
    cache = model.new_mtp_cache()
    h = torch.randn(5, CFG.hidden_size, generator=torch.Generator().manual_seed(0)).to(dtype)
    full = model.mtp_forward(h, torch.arange(5), cache)
    cache.crop(3)
    again = model.mtp_forward(h[3:], torch.arange(3, 5), cache)
    _close(again, full[3:], "mtp after crop")

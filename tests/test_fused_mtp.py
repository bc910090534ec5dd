"""The folded decode copy of MTP / EAGLE modules (models/fused_mtp.py): same outputs and KV entries as
the module up to rounding, rebuilt when weights change, and a fallback for layouts it cannot fold."""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch

import mtpspec
from mtpspec.drafters import make_drafter
from mtpspec.models.batch import ForwardBatch
from mtpspec.models.forward import module_forward
from mtpspec.models.fused_mtp import fused_mtp
from mtpspec.models.qwen35 import HybridLM
from test_heads import CFG as HEAD_TARGET_CFG
from test_heads import _head
from test_mtp_lossless import CFG, run
from qwen35_tiny import randomize


def _model(cfg=CFG, seed=5) -> HybridLM:
    torch.manual_seed(0)
    m = HybridLM(cfg)
    randomize(m, seed)
    return m.eval()


# Folded copy vs module, in units of eps(dtype) * max |module output| (outputs and KV entries): the same
# maths with products folded in another order. Measured on the cases below: <= 7.8 in fp32, <= 7.2 in fp64.
# The fp64 bound (1e-10 relative) proves the folding is exact maths; the fp32 one has a 16x margin.
# A folding bug (a missing sqrt(D), an fp32 rotary table in fp64, a wrong column) is >= 1e-7 relative.
ULPS = {torch.float32: 128, torch.float64: 1e-10 / torch.finfo(torch.float64).eps}
DTYPES = pytest.mark.parametrize("dtype", [torch.float32, torch.float64], ids=["fp32", "fp64"])


def _close(got: torch.Tensor, want: torch.Tensor, what: str) -> None:
    assert got.dtype == want.dtype
    err = ((got - want).abs().max() / (torch.finfo(want.dtype).eps * want.abs().max())).item()
    assert err < ULPS[want.dtype], f"{what}: {err:.1f} eps * scale apart"


def _compare(module, new_cache, hidden_size: int, vocab: int, embed, windows=(20, 1, 2, 1, 4, 3, 1)) -> None:
    """Module vs folded copy on the same (hidden, token) pairs, window by window, each on its own cache."""
    fused = fused_mtp(module)
    assert fused is not None
    dtype = module.fc.weight.dtype
    ref_cache, fused_cache = new_cache(), new_cache()
    g = torch.Generator().manual_seed(0)
    with torch.inference_mode():
        for t in windows:  # a prompt-long window (SDPA), then short ones (matmuls)
            h = torch.randn(t, hidden_size, generator=g).to(dtype)
            e = embed(torch.randint(0, vocab, (t,), generator=g))
            k_buf, v_buf = ref_cache.buffers(module.layers[0].self_attn.kv_index)
            want = module_forward(module, h[None], e[None], k_buf, v_buf, ForwardBatch.one(ref_cache.length, t), 0, ref_cache)[0]
            got = fused(h, e, fused_cache, fused_cache.length)
            ref_cache.advance(t)
            fused_cache.advance(t)
            _close(got, want, f"output of a window of {t}")
        n = ref_cache.length
        _close(fused_cache.k[..., :n, :], ref_cache.k[..., :n, :], "keys")
        _close(fused_cache.v[..., :n, :], ref_cache.v[..., :n, :], "values")


@DTYPES
def test_native_mtp_matches_module(dtype):
    m = _model().to(dtype)
    _compare(m.mtp, m.new_mtp_cache, CFG.hidden_size, CFG.vocab_size, m.embed)


@DTYPES
def test_long_catch_up_in_chunks_matches_module(dtype):
    """A catch-up longer than MASK_CHUNK rows (sparse_attention.py) (a long prompt's pairs) attends chunk by chunk."""
    m = _model(replace(CFG, max_seq_len=1400)).to(dtype)
    _compare(m.mtp, m.new_mtp_cache, CFG.hidden_size, CFG.vocab_size, m.embed, windows=(1100, 1, 3, 200))


@DTYPES
def test_sparse_mtp_matches_module(dtype):
    """A sparse-attention MTP layer folds too: its indexer's projections join the fused product."""
    from mtpspec.models.sparse_attention import SparseAttentionConfig

    sparse = SparseAttentionConfig(block=4, top_k=3, window=8, heads=2, dim=8)
    m = _model(replace(CFG, mtp_sparse_attention=sparse)).to(dtype)
    _compare(m.mtp, m.new_mtp_cache, CFG.hidden_size, CFG.vocab_size, m.embed, windows=(60, 1, 2, 1, 4, 40, 1))


@DTYPES
@pytest.mark.parametrize("kind", ["mtp", "eagle"])
def test_trained_heads_match_module(kind, dtype):
    target = _model(HEAD_TARGET_CFG, 3).to(dtype)
    head = _head(kind).to(dtype)
    from mtpspec.models.heads import AttachedHead

    attached = AttachedHead(target, head)
    _compare(head.mtp, attached.new_mtp_cache, HEAD_TARGET_CFG.hidden_size, HEAD_TARGET_CFG.vocab_size, target.embed)


@DTYPES
def test_demo_model_mtp_matches_module(dtype):
    """The shipped checkpoint (partial rotary, GQA, real norm weights)."""
    m = mtpspec.load("demo", dtype=dtype).module
    _compare(m.mtp, m.new_mtp_cache, m.config.hidden_size, m.vocab_size, m.embed)


def test_rebuilt_when_weights_change():
    m = _model()
    first = fused_mtp(m.mtp)
    assert fused_mtp(m.mtp) is first  # cached
    with torch.no_grad():
        m.mtp.layers[0].mlp.down_proj.weight.mul_(2.0)  # an optimizer step updates in place
    again = fused_mtp(m.mtp)
    assert again is not first
    _compare(m.mtp, m.new_mtp_cache, CFG.hidden_size, CFG.vocab_size, m.embed)


def test_moe_mtp_falls_back_to_the_module():
    """A Qwen3-Next style MoE MTP layer is not folded: the drafter runs the module itself, still lossless."""
    cfg = replace(CFG, num_experts=4, num_experts_per_tok=2, moe_intermediate_size=16, shared_expert_intermediate_size=16)
    m = _model(cfg)
    assert fused_mtp(m.mtp) is None
    d = make_drafter("mtp", m)
    assert d.fused is None
    prompt = [1, 4, 1, 5, 9, 2, 6]  # one prompt: a second one doubled the 9 s
    assert run(m, prompt, "mtp", 2).tokens == run(m, prompt, "none", 1).tokens


def test_unfused_drafter_is_lossless_too():
    from mtpspec.drafters.mtp import MTPDrafter
    from mtpspec.engine import generate_tokens
    from mtpspec.sampling import Sampler, SamplingParams

    m = _model()
    for prompt in ([1, 4, 1, 5, 9, 2, 6], list(range(16))):
        ref = run(m, prompt, "none", 1).tokens
        got = generate_tokens(m, prompt, MTPDrafter(m, fused=False), 3, Sampler(SamplingParams(), 0), 48).tokens
        assert got == ref


def test_bf16_module_is_not_folded():
    """bf16 MTP norms compute in fp32; folded bf16 weights would not, so the module runs as it is."""
    m = _model().to(torch.bfloat16)
    assert fused_mtp(m.mtp) is None


"""What a loaded model holds: rotary tables grown with use (bitwise those of a whole-context table), meta-device
construction that imports nothing heavy. (The GGUF tokenizer's cached merges: test_gguf_loading.py; the whole load's
memory: scripts/memory_gemma.py.)"""

from __future__ import annotations

import subprocess
import sys

import pytest
import torch

from mtpspec.models.attention import rotary_at, scale_inv_freq
from mtpspec.models.batch import ForwardBatch, TreeLayout
from mtpspec.models.common import Rotary, rotaries


def whole_table(rot: Rotary, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """Every position's cos, sin computed at once (how the tables were built before they grew with use)."""
    inv_freq = 1.0 / (rot.theta ** (torch.arange(0, rot.rot_dim, 2, dtype=torch.int64).to(dtype) / rot.rot_dim))
    inv_freq = scale_inv_freq(inv_freq, rot.scaling)
    freqs = torch.outer(torch.arange(rot.max_len).to(dtype), inv_freq)
    emb = torch.cat([freqs, freqs], dim=-1)
    return emb.cos(), emb.sin()


@pytest.mark.parametrize("theta, rot_dim, scaling", [(1e6, 256, None), (1e4, 256, None), (1e4, 64, {"rope_type": "linear", "factor": 4.0}),
                                                     (5e5, 6, None)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_rotary_tables_grow_bitwise_equal_to_the_whole_table(theta, rot_dim, scaling, dtype):
    r = Rotary(rot_dim, 8192, theta, scaling)
    assert r.cos.shape == (0, rot_dim)  # nothing computed up front
    ref_cos, ref_sin = whole_table(r, dtype)
    for n in (1, 5, 300, 301, 1000, 4097, 8192, 9000):  # irregular growth, then past the context (capped)
        cos, sin = r.tables(dtype, n)
        have = cos.shape[0]
        assert min(n, 8192) <= have <= 8192 and sin.shape[0] == have
        assert torch.equal(cos, ref_cos[:have]) and torch.equal(sin, ref_sin[:have])
    assert r.tables(dtype)[0].shape[0] == 8192


def test_rotary_tables_keep_the_dtype_and_reset_empties_them():
    r = Rotary(64, 1024, 1e4).to(torch.bfloat16)
    cos, _ = r.tables(torch.bfloat16, 10)
    assert cos.dtype == torch.bfloat16 and torch.equal(cos, whole_table(r, torch.float32)[0][: cos.shape[0]].bfloat16())
    r.tables(torch.float64, 10)
    r.reset()
    assert r.cos.shape[0] == 0 and r.cos.dtype == torch.float32 and r.fp64 is None


def test_rotary_tables_grown_in_inference_mode_serve_training():
    r = Rotary(8, 512, 1e4)
    with torch.inference_mode():
        r.tables(torch.float32, 10)
        r.tables(torch.float32, 300)  # grown again: the old rows concatenated
    assert not r.cos.is_inference() and not r.sin.is_inference()
    x = torch.randn(1, 1, 4, 8, requires_grad=True)
    cos, sin = rotary_at(r, ForwardBatch.window(1, 4), torch.float32)
    (x * cos + x * sin).sum().backward()  # autograd may save them
    assert x.grad is not None


def test_rotary_at_grows_the_tables_to_the_rows_positions():
    r = Rotary(8, 4096, 1e4)
    ref_cos, _ = whole_table(r, torch.float32)
    cos, _ = rotary_at(r, ForwardBatch.one(700, 3), torch.float32)  # one sequence in order
    assert r.cos.shape[0] >= 703 and torch.equal(cos[0, 0], ref_cos[700:703])
    fb = ForwardBatch.many([5, 2000], [2, 4], 4096)  # a batch: positions as tensors, runs known
    cos, _ = rotary_at(r, fb, torch.float32)
    assert r.cos.shape[0] >= 2004 and torch.equal(cos[1, 0], ref_cos[2000:2004])
    tree = TreeLayout.of(torch.tensor([-1, 0, 0, 1]))  # depths 0, 1, 2, 2, 3
    cos, _ = rotary_at(r, ForwardBatch.one(3000, tree.size, tree), torch.float32)
    assert torch.equal(cos[0, 0], ref_cos[3000 + tree.depth])
    cos, _ = rotary_at(r, ForwardBatch(torch.tensor([[4095]])), torch.float32)  # tensors only: the whole table
    assert r.cos.shape[0] == 4096 and torch.equal(cos[0, 0, 0], ref_cos[4095])


def test_rotaries_finds_the_tables_layers_share():
    from mtpspec.models.dense import DenseConfig, DenseLM

    cfg = DenseConfig(vocab_size=32, hidden_size=16, num_layers=2, num_heads=2, num_kv_heads=1, intermediate_size=32,
                      max_seq_len=64, layer_windows=(4, 0), rope_local_theta=1e4)
    model = DenseLM(cfg)
    found = rotaries(model)
    assert len(found) == 2 and all(r.cos.shape[0] == 0 for r in found)
    assert rotaries(model.model.layers[0]) == [model.local_rotary]  # a layer's shared table, not registered in it


def test_meta_construction_imports_no_compiler():
    """Building a model on the meta device skips the random init whose meta path imports torch._dynamo and sympy."""
    code = ("import sys\nfrom mtpspec.loading.meta import meta_device\nfrom mtpspec.models.dense import DenseConfig, DenseLM\n"
            "cfg = DenseConfig(vocab_size=32, hidden_size=16, num_layers=2, num_heads=2, num_kv_heads=1, intermediate_size=32,"
            " max_seq_len=64)\n"
            "with meta_device():\n    m = DenseLM(cfg)\n"
            "assert m.model.embed_tokens.weight.is_meta and m.lm_head.weight.is_meta\n"
            "print('torch._dynamo' in sys.modules, 'sympy' in sys.modules)\n")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout.split()
    assert out == ["False", "False"]

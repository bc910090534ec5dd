"""llama2.c checkpoints: v0 (fp32), v1 (fp32 with header), v2 (Q8_0 dequantised on load); strict errors."""

import struct

import numpy as np
import pytest
import torch

from mtpspec.errors import ModelLoadError
from mtpspec.loading import load_module
from mtpspec.loading.llama2c import MAGIC, load_llama2c


def test_q80_dequantises_within_half_a_step(assets):
    fp = load_llama2c(assets / "models" / "stories260K.bin")
    q8 = load_llama2c(assets / "models" / "stories260K_q80.bin")
    for (name, a), (_, b) in zip(fp.state_dict().items(), q8.state_dict().items()):
        if a.dim() == 2:
            step = a.abs().view(-1, 32).amax(-1) / 127  # the Q8_0 scale of each group of 32
            err = (a - b).abs().view(-1, 32).amax(-1)
            assert (err <= step / 2 + 1e-7).all(), name
        else:
            assert torch.equal(a, b), name  # norms are stored in fp32


def test_q80_greedy_agrees_with_fp32_for_115_tokens(stories, stories_q80):
    """The asset notes agreement on the first 115 of 256 tokens: BOS + 114 new ones. The split at
    new token 115 is a real preference change (fp32 margin 0.04 logits), not float rounding."""
    a = stories.generate("", max_new_tokens=256).tokens
    b = stories_q80.generate("", max_new_tokens=256).tokens
    first_diff = next(i for i, (x, y) in enumerate(zip(a, b)) if x != y)
    assert 1 + first_diff == 115


def _v1_bytes(v0: bytes) -> bytes:
    """Re-pack the v0 stories260K file as llama2.c's format v1 (header, norms first)."""
    dim, hidden, L, nh, nkv, vocab, seq = struct.unpack_from("<7i", v0, 0)
    f = np.frombuffer(v0, dtype=np.float32, offset=28)
    kv = nkv * (dim // nh)
    sizes = [("emb", vocab * dim), ("att", L * dim), ("wq", L * dim * dim), ("wk", L * kv * dim), ("wv", L * kv * dim),
             ("wo", L * dim * dim), ("ffn", L * dim), ("w1", L * hidden * dim), ("w2", L * dim * hidden),
             ("w3", L * hidden * dim), ("final", dim)]
    parts, off = {}, 0
    for name, n in sizes:
        parts[name], off = f[off : off + n], off + n
    header = struct.pack("<Ii7iB", MAGIC, 1, dim, hidden, L, nh, nkv, abs(vocab), seq, 1).ljust(256, b"\0")
    order = ["att", "ffn", "final", "emb", "wq", "wk", "wv", "wo", "w1", "w2", "w3"]
    return header + b"".join(parts[n].tobytes() for n in order)


def test_v1_format_loads_to_the_same_model(assets, tmp_path):
    v0 = (assets / "models" / "stories260K.bin").read_bytes()
    p = tmp_path / "v1.bin"
    p.write_bytes(_v1_bytes(v0))
    a, b = load_llama2c(assets / "models" / "stories260K.bin"), load_llama2c(p)
    for (k, x), (_, y) in zip(a.state_dict().items(), b.state_dict().items()):
        assert torch.equal(x, y), k


def test_bf16_load(assets):
    m = load_module(assets / "models" / "stories260K.bin", dtype="bf16")
    assert m.dtype == torch.bfloat16
    out = m.forward_tokens(torch.tensor([1, 400, 300]), m.new_cache())
    assert out.logits.dtype == torch.float32 and out.logits.shape == (3, 512)


def test_errors_name_the_problem(assets, tmp_path):
    with pytest.raises(ModelLoadError, match="model not found"):
        load_module(tmp_path / "nope.bin")
    junk = tmp_path / "junk.bin"
    junk.write_bytes(b"hello, this is not a checkpoint at all" * 3)
    with pytest.raises(ModelLoadError, match="not a llama2.c checkpoint"):
        load_module(junk)
    tiny = tmp_path / "tiny.bin"
    tiny.write_bytes(b"abc")
    with pytest.raises(ModelLoadError, match="too small"):
        load_module(tiny)
    trunc = tmp_path / "trunc.bin"
    trunc.write_bytes((assets / "models" / "stories260K.bin").read_bytes()[:50000])
    with pytest.raises(ModelLoadError, match="truncated"):
        load_module(trunc)
    extra = tmp_path / "extra.bin"
    extra.write_bytes((assets / "models" / "stories260K_q80.bin").read_bytes() + b"\0" * 8)
    with pytest.raises(ModelLoadError, match="trailing bytes"):
        load_module(extra)
    with pytest.raises(ModelLoadError, match="unknown dtype"):
        load_module(assets / "models" / "stories260K.bin", dtype="fp8")

"""A Qwen3.5 GGUF (`mtpspec export --format gguf`) loaded back as a HybridLM with its nextn MTP layer
(mtpspec.loading.gguf_hybrid): the demo model and a tiny random hybrid (untied head, 2 value heads per key
head) round-trip through f32 and q8_0 files.

f32: every parameter comes back bit for bit (norms stored as fl(1 + w) give fl(1 + w) - 1, exact by Sterbenz,
and the model's 1.0 + w is then the stored value; A_log is the float32 whose exp is the stored -ssm_a), so the
logits and the MTP drafts are the original's, token for token. q8_0: matrices stay in their blocks
(block Linear); MTP drafting is lossless against the loaded model's own plain decoding.
"""

from __future__ import annotations

from dataclasses import replace

import numpy as np
import pytest
import torch

gguf = pytest.importorskip("gguf")

import mtpspec  # noqa: E402
from mtpspec.errors import ModelLoadError  # noqa: E402
from mtpspec.export_gguf import export_gguf, tiled_order  # noqa: E402
from mtpspec.loading.gguf import read_gguf  # noqa: E402
from mtpspec.loading.gguf_hybrid import a_log_of, grouped_order, load_gguf_hybrid  # noqa: E402
from mtpspec.loading.tokenizer_gguf import load_gguf_tokenizer  # noqa: E402
from mtpspec.models.blocks import BlockEmbedding, holds_blocks  # noqa: E402
from mtpspec.models.common import Linear  # noqa: E402
from mtpspec.models.qwen35 import HybridConfig, HybridLM  # noqa: E402

PROMPT = "def fibonacci(n):\n    if n < 2:\n        return n\n"
NEW = 40


@pytest.fixture(scope="module")
def demo():
    return mtpspec.load("demo", threads=1)


def _tiny(mtp_layers: int = 1) -> HybridLM:
    """4 layers (3 DeltaNet), 2 value heads per key head of 16 (so q8_0's ssm_out columns move in part-blocks),
    an untied head, one MTP layer; the demo's vocabulary size so its tokenizer can be written with it."""
    from qwen35_tiny import randomize

    cfg = HybridConfig(
        vocab_size=4096, hidden_size=32, num_layers=4, num_heads=4, num_kv_heads=2, head_dim=16, intermediate_size=48,
        layer_types=("linear_attention", "full_attention", "linear_attention", "linear_attention"), max_seq_len=256,
        linear_key_head_dim=16, linear_value_head_dim=16, linear_num_key_heads=2, linear_num_value_heads=4, mtp_num_layers=mtp_layers,
    )
    torch.manual_seed(0)
    model = HybridLM(cfg)
    randomize(model, seed=5)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("A_log"):
                p.copy_(torch.linspace(-2.0, 2.5, p.numel()))  # every head its own decay, some exp(A_log) > 1
    return model.eval()


@pytest.fixture(scope="module", params=["demo", "tiny"])
def original(request, demo) -> mtpspec.Model:
    if request.param == "demo":
        return demo
    return mtpspec.Model(module=_tiny(), tokenizer=demo.tokenizer, threads=1)


@pytest.fixture(scope="module")
def files(original, tmp_path_factory) -> dict:
    d = tmp_path_factory.mktemp("gguf_hybrid")
    return {ot: export_gguf(original.module, original.tokenizer, d / f"model-{ot}.gguf", ot) for ot in ("f32", "q8_0")}


def _loaded(path, original, **kw) -> mtpspec.Model:
    return mtpspec.Model(module=load_gguf_hybrid(read_gguf(path), **kw), tokenizer=original.tokenizer, threads=1)


def _zero_centred(name: str) -> bool:
    """Every RMSNorm weight but the DeltaNet's gated norm (a plain one) scales by 1 + w."""
    return name.endswith(("norm.weight", "_norm_embedding.weight", "_norm_hidden.weight")) and ".linear_attn." not in name


def _greedy(model: mtpspec.Model, **kw):
    return model.generate(PROMPT, max_new_tokens=NEW, **kw)


def test_f32_round_trip_is_the_model(original, files):
    loaded = _loaded(files["f32"], original)
    a, b = original.module.state_dict(), loaded.module.state_dict()
    assert a.keys() == b.keys()
    for name, w in a.items():
        if name.endswith("A_log"):  # the float32 whose exp is the stored decay: the decay is what the model uses
            assert torch.equal(w.exp(), b[name].exp()), name
        elif _zero_centred(name):  # w came back as fl(1 + w) - 1: the scale 1 + w the model uses is the same
            assert torch.equal(1.0 + w, 1.0 + b[name]), name
        else:
            assert torch.equal(w, b[name]), name
    assert not any(holds_blocks(m) for m in loaded.module.modules())
    ids = torch.tensor(original.encode(PROMPT))
    ref = original.module.forward_tokens(ids, original.module.new_cache())
    out = loaded.module.forward_tokens(ids, loaded.module.new_cache())
    assert torch.equal(ref.logits, out.logits) and torch.equal(ref.hidden, out.hidden)

    plain, mtp = _greedy(loaded), _greedy(loaded, drafter="mtp", k=3)
    assert mtp.tokens == plain.tokens
    ref_mtp = _greedy(original, drafter="mtp", k=3)
    assert mtp.tokens == ref_mtp.tokens  # the same drafts, accepted alike
    assert mtp.stats.mean_accepted_length == ref_mtp.stats.mean_accepted_length
    assert [(s.draft, s.num_accepted) for s in mtp.steps] == [(s.draft, s.num_accepted) for s in ref_mtp.steps]


def test_q8_0_blocks_draft_losslessly(original, files):
    loaded = _loaded(files["q8_0"], original)
    blocks = [m for m in loaded.module.modules() if holds_blocks(m)]
    assert any(isinstance(m, Linear) for m in blocks) and any(isinstance(m, BlockEmbedding) for m in blocks)
    assert isinstance(loaded.module.mtp.fc, Linear) and holds_blocks(loaded.module.mtp.fc)
    out_proj = loaded.module.model.layers[0].linear_attn.out_proj
    dv = original.module.config.linear_value_head_dim
    assert isinstance(out_proj, Linear) and holds_blocks(out_proj) == (dv % 32 == 0)  # part-block heads: dequantized exactly

    plain, mtp = _greedy(loaded), _greedy(loaded, drafter="mtp", k=3)
    assert mtp.tokens == plain.tokens
    ref = _greedy(original, drafter="mtp", k=3).stats.mean_accepted_length
    assert abs(mtp.stats.mean_accepted_length - ref) <= 0.25 * ref


def test_q8_0_dequantized(original, files):
    """dequantize=True: ordinary layers holding the blocks' exact values (within q8_0's rounding of the original)."""
    loaded = _loaded(files["q8_0"], original, dequantize=True).module
    assert not any(holds_blocks(m) for m in loaded.modules())
    a, b = original.module.state_dict(), loaded.state_dict()
    for name, w in a.items():
        if w.ndim >= 2:
            step = w.abs().amax(-1, keepdim=True) / 127  # q8_0: half a step of its block's (f16) scale, at most
            assert ((w - b[name]).abs() <= step * 0.6).all(), name
    model = mtpspec.Model(loaded, original.tokenizer, threads=1)
    assert _greedy(model, drafter="mtp", k=3).tokens == _greedy(model).tokens


def test_tokenizer_round_trip(demo, tmp_path):
    tok = load_gguf_tokenizer(export_gguf(demo.module, demo.tokenizer, tmp_path / "demo.gguf"))
    assert tok.encode(PROMPT) == demo.encode(PROMPT)


def test_file_without_nextn(demo, tmp_path):
    """A file without nextn blocks: a HybridLM without an MTP module, the same logits."""
    model = _tiny(mtp_layers=0)
    loaded = load_gguf_hybrid(read_gguf(export_gguf(model, demo.tokenizer, tmp_path / "no-mtp.gguf")))
    assert loaded.mtp is None
    ids = torch.tensor(demo.encode(PROMPT))
    assert torch.equal(model.forward_tokens(ids, model.new_cache()).logits, loaded.forward_tokens(ids, loaded.new_cache()).logits)


# ------------------------------------------------------------------------------------------------
# the inverse transforms


def test_grouped_order_inverts_tiled_order():
    for nk, r, size in ((2, 2, 3), (3, 4, 1), (1, 5, 2), (4, 1, 8)):
        t = tiled_order(nk, r, size).numpy()
        assert (t[grouped_order(nk, r, size)] == np.arange(nk * r * size)).all()


def test_a_log_inverts_ssm_a():
    a_log = torch.linspace(-6.0, 6.0, 4001)  # exp expands above |1|: some fp32 steps of A_log skip an exp value
    ssm_a = -a_log.exp()
    back = torch.from_numpy(a_log_of(ssm_a.numpy()))
    assert torch.equal(-back.exp(), ssm_a)
    with pytest.raises(ModelLoadError, match="negative"):
        a_log_of(np.array([-1.0, 0.5], dtype=np.float32))


# ------------------------------------------------------------------------------------------------
# strictness: one ModelLoadError naming the problem


def _edited(path, **edit):
    f = read_gguf(path)
    if "drop" in edit:
        del f.tensors[edit["drop"]]
    if "extra" in edit:
        f.tensors[edit["extra"]] = replace(f.tensors["output_norm.weight"], name=edit["extra"])
    if "shape" in edit:
        name, shape = edit["shape"]
        f.tensors[name] = replace(f.tensors[name], shape=shape)
    f.metadata.update(edit.get("meta", {}))
    return f


def test_refusals(demo, tmp_path):
    path = export_gguf(demo.module, demo.tokenizer, tmp_path / "demo.gguf")
    n = demo.module.config.num_layers  # the nextn block
    cases = [
        (dict(drop=f"blk.{n}.nextn.eh_proj.weight"), f"missing tensor blk.{n}.nextn.eh_proj.weight"),
        (dict(drop="blk.0.ssm_a"), "missing tensor blk.0.ssm_a"),
        (dict(extra="blk.3.ssm_a"), "unexpected tensor blk.3.ssm_a"),
        (dict(extra=f"blk.{n}.nextn.embed_tokens.weight"), f"unexpected tensor blk.{n}.nextn.embed_tokens.weight"),
        (dict(shape=("blk.0.ssm_out.weight", (256, 128))), r"blk.0.ssm_out.weight has shape \[256, 128\], expected \[256, 256\]"),
        (dict(meta={"general.architecture": "qwen3next"}), "qwen3next"),
        (dict(meta={"general.architecture": "qwen35moe"}), "qwen35moe"),
        (dict(meta={"qwen35.nextn_predict_layers": 2}), "2 nextn"),
        (dict(meta={"qwen35.rope.dimension_sections": np.array([2, 2, 2, 0], dtype=np.int32)}), "rotary pair 6"),
        (dict(meta={"qwen35.rope.scaling.type": "yarn", "qwen35.rope.scaling.factor": 4.0}), "rope scaling"),
    ]
    for edit, message in cases:
        with pytest.raises(ModelLoadError, match=message):
            load_gguf_hybrid(_edited(path, **edit))


def test_mtpspec_load(demo, tmp_path):
    """The whole path: mtpspec.load on the file (gguf_model dispatches qwen35 here), tokenizer from the file."""
    model = mtpspec.load(export_gguf(demo.module, demo.tokenizer, tmp_path / "demo.gguf"), threads=1)
    assert isinstance(model.module, HybridLM) and model.module.mtp is not None
    assert _greedy(model, drafter="mtp", k=3).tokens == _greedy(demo).tokens

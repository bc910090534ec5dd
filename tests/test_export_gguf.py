"""`mtpspec export --format gguf`: the file read back with gguf.GGUFReader holds every weight under
llama.cpp's name, shape and layout (checked against expectations recomputed here with their own code:
head orders by explicit loops, llama2.c's q / k straight from the .bin), the metadata llama.cpp's
loaders read, and the tokenizer's arrays. Slow tests load the file in llama.cpp itself (llama-server)
and compare its tokenization and greedy tokens with ours."""

from __future__ import annotations

import json
import struct
from pathlib import Path

import numpy as np
import pytest
import torch

import mtpspec
from mtpspec.bench.harness import Method
from mtpspec.bench.llamacpp import LlamaServer, find_binary, parse_completion, request_body, server_args
from mtpspec.cli import main
from mtpspec.errors import ConfigError
from mtpspec.export_gguf import export_gguf, write_gguf

gguf = pytest.importorskip("gguf")

F32 = gguf.GGMLQuantizationType.F32


def _read(path: Path):
    """(fields {key: value}, tensors {name: ReaderTensor})."""
    r = gguf.GGUFReader(str(path))
    fields = {k: f.contents() for k, f in r.fields.items() if not k.startswith("GGUF.")}
    return fields, {t.name: t for t in r.tensors}


def _values(t) -> np.ndarray:
    """A tensor's values as fp32 in PyTorch's shape (ggml's ne reversed)."""
    data = gguf.quants.dequantize(t.data, t.tensor_type)
    return np.asarray(data, dtype=np.float32).reshape([int(n) for n in reversed(t.shape)])


# ------------------------------------------------------------------------------------------------
# the expected file, recomputed here


def _np(t: torch.Tensor) -> np.ndarray:
    return t.detach().to(torch.float32).numpy()


def _tiled_heads(nk: int, nv: int) -> list[int]:
    """Value head stored at each tiled slot: slot v * nk + k holds grouped head k * r + v."""
    r = nv // nk
    return [k * r + v for v in range(r) for k in range(nk)]


def _rows_by_head(w: np.ndarray, heads: list[int], size: int, axis: int = 0) -> np.ndarray:
    return np.concatenate([np.take(w, range(h * size, (h + 1) * size), axis=axis) for h in heads], axis=axis)


def _expected_hybrid(module) -> dict[str, np.ndarray]:
    """{llama.cpp name: fp32 values} for a HybridLM, from llama.cpp's converter's rules written out anew."""
    c, sd = module.config, module.state_dict()
    w = lambda k: _np(sd[k])  # noqa: E731
    zc = lambda k: _np(1.0 + sd[k].float())  # noqa: E731  zero-centred norm: llama.cpp multiplies by 1 + w
    moe = c.num_experts > 0
    nk, nv, dk, dv = c.linear_num_key_heads, c.linear_num_value_heads, c.linear_key_head_dim, c.linear_value_head_dim
    r = nv // nk
    heads = list(range(nv)) if moe else _tiled_heads(nk, nv)  # qwen3next keeps the grouped order
    exp = {"token_embd.weight": w("model.embed_tokens.weight"), "output_norm.weight": zc("model.norm.weight")}
    if not c.tie_embeddings:
        exp["output.weight"] = w("lm_head.weight")

    def block(p: str, b: int, lt: str) -> None:
        exp[f"blk.{b}.attn_norm.weight"] = zc(p + "input_layernorm.weight")
        exp[f"blk.{b}.post_attention_norm.weight"] = zc(p + "post_attention_layernorm.weight")
        if lt == "linear_attention":
            a = p + "linear_attn."
            qkv = w(a + "in_proj_qkv.weight")
            qk = 2 * nk * dk
            exp[f"blk.{b}.attn_qkv.weight"] = np.concatenate([qkv[:qk], _rows_by_head(qkv[qk:], heads, dv)])
            exp[f"blk.{b}.attn_gate.weight"] = _rows_by_head(w(a + "in_proj_z.weight"), heads, dv)
            conv = w(a + "conv1d.weight")[:, 0, :]  # (C, K)
            exp[f"blk.{b}.ssm_conv1d.weight"] = np.concatenate([conv[:qk], _rows_by_head(conv[qk:], heads, dv)])
            exp[f"blk.{b}.ssm_a"] = _np(-torch.exp(sd[a + "A_log"].float()))[heads]
            exp[f"blk.{b}.ssm_dt.bias"] = w(a + "dt_bias")[heads]
            exp[f"blk.{b}.ssm_norm.weight"] = w(a + "norm.weight")  # the gated norm is a plain RMSNorm
            exp[f"blk.{b}.ssm_out.weight"] = _rows_by_head(w(a + "out_proj.weight"), heads, dv, axis=1)
            wb, wa = w(a + "in_proj_b.weight"), w(a + "in_proj_a.weight")
            if moe:  # per key head: its r beta rows, then its r alpha rows
                exp[f"blk.{b}.ssm_ba.weight"] = np.concatenate(
                    [np.concatenate([wb[k * r:(k + 1) * r], wa[k * r:(k + 1) * r]]) for k in range(nk)])
            else:
                exp[f"blk.{b}.ssm_beta.weight"], exp[f"blk.{b}.ssm_alpha.weight"] = wb[heads], wa[heads]
        else:
            a = p + "self_attn."
            for ours, theirs in (("q_proj", "attn_q"), ("k_proj", "attn_k"), ("v_proj", "attn_v"), ("o_proj", "attn_output")):
                exp[f"blk.{b}.{theirs}.weight"] = w(a + ours + ".weight")
            exp[f"blk.{b}.attn_q_norm.weight"] = zc(a + "q_norm.weight")
            exp[f"blk.{b}.attn_k_norm.weight"] = zc(a + "k_norm.weight")
        m = p + "mlp."
        if moe:
            exp[f"blk.{b}.ffn_gate_inp.weight"] = w(m + "gate.weight")
            for ours, theirs in (("gate_proj", "gate"), ("up_proj", "up"), ("down_proj", "down")):
                exp[f"blk.{b}.ffn_{theirs}_exps.weight"] = np.stack([w(f"{m}experts.{e}.{ours}.weight") for e in range(c.num_experts)])
                exp[f"blk.{b}.ffn_{theirs}_shexp.weight"] = w(f"{m}shared_expert.{ours}.weight")
            exp[f"blk.{b}.ffn_gate_inp_shexp.weight"] = w(m + "shared_expert_gate.weight")
        else:
            for ours, theirs in (("gate_proj", "gate"), ("up_proj", "up"), ("down_proj", "down")):
                exp[f"blk.{b}.ffn_{theirs}.weight"] = w(m + ours + ".weight")

    for i, lt in enumerate(c.layer_types):
        block(f"model.layers.{i}.", i, lt)
    if c.mtp_num_layers:
        b = c.num_layers
        block("mtp.layers.0.", b, "full_attention")
        exp[f"blk.{b}.nextn.eh_proj.weight"] = w("mtp.fc.weight")
        exp[f"blk.{b}.nextn.enorm.weight"] = zc("mtp.pre_fc_norm_embedding.weight")
        exp[f"blk.{b}.nextn.hnorm.weight"] = zc("mtp.pre_fc_norm_hidden.weight")
        exp[f"blk.{b}.nextn.shared_head_norm.weight"] = zc("mtp.norm.weight")
    return exp


def _check_tensors(path: Path, expected: dict[str, np.ndarray]) -> None:
    """Every expected tensor and no other, its shape and exact fp32 values (the export copies values;
    its only arithmetic, 1 + w and -exp(A_log), is the same elementwise fp32 op recomputed above)."""
    _, tensors = _read(path)
    assert sorted(tensors) == sorted(expected)
    for name, want in expected.items():
        t = tensors[name]
        assert t.tensor_type == F32, name
        assert [int(n) for n in t.shape] == list(reversed(want.shape)), name  # ggml's ne: PyTorch's shape reversed
        assert np.array_equal(_values(t), want), name


# ------------------------------------------------------------------------------------------------
# the demo: a Qwen3.5-style hybrid with its MTP layer


@pytest.fixture(scope="module")
def demo():
    return mtpspec.load("demo")


@pytest.fixture(scope="module")
def demo_gguf(demo, tmp_path_factory) -> Path:
    return export_gguf(demo.module, demo.tokenizer, tmp_path_factory.mktemp("gguf") / "demo.gguf")


def test_demo_tensors(demo, demo_gguf):
    _check_tensors(demo_gguf, _expected_hybrid(demo.module))


def test_demo_metadata(demo, demo_gguf):
    c = demo.module.config
    f, tensors = _read(demo_gguf)
    assert f["general.architecture"] == "qwen35"
    n = c.num_layers
    assert f["qwen35.block_count"] == n + 1 and f["qwen35.nextn_predict_layers"] == 1
    assert any(k.startswith(f"blk.{n}.nextn.") for k in tensors)  # the MTP block follows the decoder's
    assert f["qwen35.attention.recurrent_layers"] == [t == "linear_attention" for t in c.layer_types] + [False]
    want = {"context_length": c.max_seq_len, "embedding_length": c.hidden_size, "feed_forward_length": c.intermediate_size,
            "attention.head_count": c.num_heads, "attention.head_count_kv": c.num_kv_heads, "attention.key_length": c.head_dim,
            "attention.value_length": c.head_dim, "rope.dimension_count": int(c.head_dim * c.partial_rotary_factor),
            "ssm.conv_kernel": c.linear_conv_kernel_dim, "ssm.state_size": c.linear_key_head_dim,
            "ssm.group_count": c.linear_num_key_heads, "ssm.time_step_rank": c.linear_num_value_heads,
            "ssm.inner_size": c.linear_num_value_heads * c.linear_value_head_dim, "vocab_size": c.vocab_size}
    assert {k: f[f"qwen35.{k}"] for k in want} == want
    assert f["qwen35.rope.freq_base"] == pytest.approx(c.rope_theta, rel=1e-7)  # stored as fp32
    assert f["qwen35.attention.layer_norm_rms_epsilon"] == pytest.approx(c.norm_eps, rel=1e-7)
    _check_rope_sections(f["qwen35.rope.dimension_sections"], c.rot_dim, c.head_dim)
    assert f["general.file_type"] == 0


def _check_rope_sections(sections: list[int], rot_dim: int, head_dim: int) -> None:
    """Under ggml's interleaved multi-axis rotary, every rotary pair of a text token turns by its
    position: pair i uses axis i % 3 (t, h, w all hold p) while i < 3 * sections[i % 3], else the
    4th axis (0 for text); ggml also asserts sum(sections) <= head_dim."""
    assert len(sections) == 4 and sum(sections) <= head_dim
    period = sum(sections)
    for i in range(rot_dim // 2):
        sector = i % period
        assert sector < 3 * sections[sector % 3], (i, sections)


@pytest.mark.parametrize("rot_dim", [2, 4, 6, 16, 64, 128])
def test_rope_sections(rot_dim):
    from mtpspec.export_gguf import rope_sections

    _check_rope_sections(rope_sections(rot_dim), rot_dim, rot_dim)
    assert rope_sections(64) == [11, 11, 10, 0]  # Qwen3.5's own (head_dim 256, a quarter rotated)


def test_demo_tokenizer(demo, demo_gguf):
    f, _ = _read(demo_gguf)
    hf = demo.tokenizer.tokenizer  # tokenizers.Tokenizer
    spec = json.loads(hf.to_str())
    assert f["tokenizer.ggml.model"] == "gpt2" and f["tokenizer.ggml.pre"] == "gpt-2"
    assert f["tokenizer.ggml.tokens"] == [hf.id_to_token(i) for i in range(demo.module.config.vocab_size)]
    assert f["tokenizer.ggml.merges"] == [" ".join(m) if isinstance(m, list) else m for m in spec["model"]["merges"]]
    specials = {i for i, t in hf.get_added_tokens_decoder().items() if t.special}
    assert specials == {0}
    assert f["tokenizer.ggml.token_type"] == [3 if i in specials else 1 for i in range(len(f["tokenizer.ggml.tokens"]))]
    assert f["tokenizer.ggml.bos_token_id"] == demo.tokenizer.bos_id == demo.encode("x")[0]
    assert f["tokenizer.ggml.eos_token_id"] == demo.tokenizer.stop_ids[0]
    assert f["tokenizer.ggml.add_bos_token"] is True and f["tokenizer.ggml.add_eos_token"] is False


@pytest.mark.parametrize("outtype", ["f16", "bf16", "q8_0"])
def test_demo_outtypes(demo, demo_gguf, tmp_path, outtype):
    """Matrices take the outtype, vectors / norms / the conv kernel stay F32 (llama.cpp's rule), and the
    values are the fp32 ones rounded once: f16 and bf16 to nearest (as torch rounds); q8_0 to within
    half a step of its block (step = max |x| / 127) plus what the scale's own rounding to fp16 (at most
    2^-11 of it) moves the largest code, 127: 0.5 + 127 * 2^-11 = 0.562 steps (measured: 0.555)."""
    path = export_gguf(demo.module, demo.tokenizer, tmp_path / f"demo-{outtype}.gguf", outtype)
    f, tensors = _read(path)
    _, ref = _read(demo_gguf)
    assert f["general.file_type"] == {"f16": 1, "bf16": 32, "q8_0": 7}[outtype]
    qtype = {"f16": gguf.GGMLQuantizationType.F16, "bf16": gguf.GGMLQuantizationType.BF16, "q8_0": gguf.GGMLQuantizationType.Q8_0}[outtype]
    assert sorted(tensors) == sorted(ref)
    for name, t in tensors.items():
        want = _values(ref[name])
        got = _values(t)
        if want.ndim == 1 or name.endswith("_norm.weight") or ".ssm_conv1d." in name or not name.endswith(".weight"):
            assert t.tensor_type == F32, name
            assert np.array_equal(got, want), name
            continue
        assert t.tensor_type == qtype, name
        if outtype == "f16":
            assert np.array_equal(got, want.astype(np.float16).astype(np.float32)), name
        elif outtype == "bf16":
            assert np.array_equal(got, torch.from_numpy(want.copy()).to(torch.bfloat16).float().numpy()), name
        else:
            blocks = want.reshape(-1, 32)
            step = np.abs(blocks).max(axis=1, keepdims=True) / 127
            assert (np.abs(got.reshape(-1, 32) - blocks) <= (0.5 + 127 * 2.0**-11) * step).all(), name


# ------------------------------------------------------------------------------------------------
# stories260K: a llama2.c checkpoint


@pytest.fixture(scope="module")
def stories_gguf(stories, tmp_path_factory) -> Path:
    return export_gguf(stories.module, stories.tokenizer, tmp_path_factory.mktemp("gguf") / "stories.gguf")


def _llama2c_v0(path: Path) -> tuple[list[int], dict[str, np.ndarray]]:
    """The raw tensors of a llama2.c v0 checkpoint, read here on their own (no permutation)."""
    buf = path.read_bytes()
    dim, hidden, n_layers, n_heads, n_kv, vocab, seq = struct.unpack_from("<7i", buf, 0)
    kv = dim // n_heads * n_kv
    off, raw = 28, {}
    for name, shape in (("emb", (abs(vocab), dim)), ("rms_att", (n_layers, dim)), ("wq", (n_layers, dim, dim)),
                        ("wk", (n_layers, kv, dim)), ("wv", (n_layers, kv, dim)), ("wo", (n_layers, dim, dim)),
                        ("rms_ffn", (n_layers, dim)), ("w1", (n_layers, hidden, dim)), ("w2", (n_layers, dim, hidden)),
                        ("w3", (n_layers, hidden, dim)), ("rms_final", (dim,))):
        n = int(np.prod(shape))
        raw[name] = np.frombuffer(buf, np.float32, n, off).reshape(shape)
        off += 4 * n
    return [dim, hidden, n_layers, n_heads, n_kv, vocab, seq], raw


def test_stories_tensors_are_llama2c_layout(assets, stories_gguf):
    """llama.cpp's llama arch rotates adjacent pairs, as llama2.c does: its q / k are the .bin's own
    wq / wk rows, byte for byte (our loader's half-split permutation undone)."""
    (dim, hidden, n_layers, n_heads, n_kv, vocab, seq), raw = _llama2c_v0(assets / "models" / "stories260K.bin")
    exp = {"token_embd.weight": raw["emb"], "output_norm.weight": raw["rms_final"]}  # tied: no output.weight
    for i in range(n_layers):
        for theirs, ours in (("attn_norm", "rms_att"), ("attn_q", "wq"), ("attn_k", "wk"), ("attn_v", "wv"), ("attn_output", "wo"),
                             ("ffn_norm", "rms_ffn"), ("ffn_gate", "w1"), ("ffn_down", "w2"), ("ffn_up", "w3")):
            exp[f"blk.{i}.{theirs}.weight"] = raw[ours][i]
    _check_tensors(stories_gguf, exp)
    f, _ = _read(stories_gguf)
    assert f["general.architecture"] == "llama"
    want = {"block_count": n_layers, "context_length": seq, "embedding_length": dim, "feed_forward_length": hidden,
            "attention.head_count": n_heads, "attention.head_count_kv": n_kv, "rope.dimension_count": dim // n_heads,
            "vocab_size": vocab}
    assert {k: f[f"llama.{k}"] for k in want} == want
    assert f["llama.rope.freq_base"] == 10000.0
    assert f["llama.attention.layer_norm_rms_epsilon"] == pytest.approx(1e-5, rel=1e-7)


def test_stories_tokenizer(stories, stories_gguf):
    """A SentencePiece ("llama") vocabulary: llama2.c's pieces with " " as U+2581, its scores, byte pieces typed."""
    f, _ = _read(stories_gguf)
    tok = stories.tokenizer
    assert f["tokenizer.ggml.model"] == "llama"
    names = {0: "<unk>", 1: "<s>", 2: "</s>"}
    assert f["tokenizer.ggml.tokens"] == [names.get(i) or p.decode().replace(" ", "\u2581") for i, p in enumerate(tok.pieces)]
    assert f["tokenizer.ggml.scores"] == [float(np.float32(s)) for s in tok.scores]
    types = f["tokenizer.ggml.token_type"]
    assert types[:3] == [2, 3, 3] and types[3:259] == [6] * 256 and set(types[259:]) == {1}  # unknown, control, bytes, normal
    assert (f["tokenizer.ggml.bos_token_id"], f["tokenizer.ggml.eos_token_id"]) == (1, 2)
    assert f["tokenizer.ggml.add_bos_token"] is True and f["tokenizer.ggml.add_space_prefix"] is True


def test_q8_0_falls_back_to_f16_for_short_rows(stories, tmp_path):
    """stories260K's ffn_down rows hold 172 values, not a multiple of Q8_0's 32: those are written f16."""
    done = write_gguf(stories.module, stories.tokenizer, tmp_path / "s.gguf", "q8_0")
    _, tensors = _read(done.path)
    assert sorted(done.fallback_f16) == [f"blk.{i}.ffn_down.weight" for i in range(5)]
    assert {tensors[n].tensor_type for n in done.fallback_f16} == {gguf.GGMLQuantizationType.F16}
    assert tensors["blk.0.ffn_up.weight"].tensor_type == gguf.GGMLQuantizationType.Q8_0


# ------------------------------------------------------------------------------------------------
# tiny random hybrids: 3 value heads per key head, untied head, and a mixture of experts


def _tiny_hybrid(moe: bool):
    from qwen35_tiny import randomize

    from mtpspec.models.qwen35 import HybridConfig, HybridLM

    cfg = HybridConfig(
        vocab_size=4096, hidden_size=32, num_layers=4, num_heads=4, num_kv_heads=2, head_dim=16, intermediate_size=48,
        layer_types=("linear_attention", "full_attention", "linear_attention", "linear_attention"), max_seq_len=256,
        linear_key_head_dim=8, linear_value_head_dim=8, linear_num_key_heads=2, linear_num_value_heads=6, mtp_num_layers=1,
        **(dict(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=16, shared_expert_intermediate_size=24) if moe else {}),
    )
    torch.manual_seed(0)
    model = HybridLM(cfg)
    randomize(model, seed=3)
    with torch.no_grad():  # A_log is left alone by randomize: give every head its own
        for name, p in model.named_parameters():
            if name.endswith("A_log"):
                p.copy_(torch.linspace(-1.0, 2.0, p.numel()))
    return model.eval()


@pytest.mark.parametrize("moe", [False, True], ids=["qwen35", "qwen3next"])
def test_tiny_hybrid(demo, tmp_path, moe):
    model = _tiny_hybrid(moe)
    path = export_gguf(model, demo.tokenizer, tmp_path / "tiny.gguf")  # the demo's tokenizer: same vocabulary size
    _check_tensors(path, _expected_hybrid(model))
    f, _ = _read(path)
    arch = "qwen3next" if moe else "qwen35"
    assert f["general.architecture"] == arch
    assert f[f"{arch}.block_count"] == 5 and f[f"{arch}.nextn_predict_layers"] == 1
    assert f[f"{arch}.attention.recurrent_layers"] == [True, False, True, True, False]
    if not moe:  # head_dim 16: Qwen3.5's [11, 11, 10, 0] (sum 32) would fail ggml's sections <= head_dim
        _check_rope_sections(f["qwen35.rope.dimension_sections"], model.config.rot_dim, model.config.head_dim)
    if moe:
        assert (f["qwen3next.expert_count"], f["qwen3next.expert_used_count"]) == (4, 2)
        assert (f["qwen3next.expert_feed_forward_length"], f["qwen3next.expert_shared_feed_forward_length"]) == (16, 24)


# ------------------------------------------------------------------------------------------------
# what it refuses, and the command line


def test_refusals(demo, stories, tmp_path):
    with pytest.raises(ConfigError, match="outtype"):
        export_gguf(demo.module, demo.tokenizer, tmp_path / "x.gguf", "q4_0")
    with pytest.raises(ConfigError, match="is a directory"):
        export_gguf(demo.module, demo.tokenizer, tmp_path)
    with pytest.raises(ConfigError, match="tokenizer"):
        export_gguf(demo.module, None, tmp_path / "x.gguf")
    with pytest.raises(ConfigError, match="tokenizer has 512 tokens"):
        export_gguf(demo.module, stories.tokenizer, tmp_path / "x.gguf")
    from dataclasses import replace

    from mtpspec.models.dense import DenseLM
    from mtpspec.models.qwen35 import HybridLM

    qwen3 = DenseLM(replace(stories.module.config, qk_norm=True))
    with pytest.raises(ConfigError, match="q/k norms"):
        export_gguf(qwen3, stories.tokenizer, tmp_path / "x.gguf")
    mixed = HybridLM(replace(_tiny_hybrid(True).config, mlp_only_layers=(1,)))
    with pytest.raises(ConfigError, match=r"layers \[1\] of this model have a dense MLP"):
        export_gguf(mixed, demo.tokenizer, tmp_path / "x.gguf")
    uneven = HybridLM(replace(_tiny_hybrid(False).config, linear_value_head_dim=16))
    with pytest.raises(ConfigError, match="equal DeltaNet key and value head sizes"):
        export_gguf(uneven, demo.tokenizer, tmp_path / "x.gguf")
    assert not (tmp_path / "x.gguf").exists()


def test_cli(capsys, assets, tmp_path):
    m = assets / "models"
    out = tmp_path / "s.gguf"
    assert main(["export", str(m / "stories260K.bin"), "--tokenizer", str(m / "tok512.bin"), "--format", "gguf",
                 "--out", str(out), "--outtype", "f16"]) == 0
    line = capsys.readouterr().out.strip()
    assert line == f"wrote {out}: GGUF llama, 47 tensors, f16, {out.stat().st_size / 1e6:.1f} MB"
    f, _ = _read(out)
    assert f["general.file_type"] == 1
    model = ["--model", str(m / "stories260K.bin"), "--tokenizer", str(m / "tok512.bin")]
    for argv, msg in (([*model, "--out", str(tmp_path / "hf"), "--outtype", "f16"], "use it with --format gguf"),
                      ([*model, "--format", "gguf", "--out", str(out), "--outtype", "q4"], "--outtype must be one of"),
                      ([*model, "--format", "gguf", "--out", str(tmp_path)], "is a directory")):
        assert main(["export", *argv]) == 2
        assert msg in capsys.readouterr().err
    with pytest.raises(SystemExit):
        main(["export", *model, "--format", "onnx", "--out", str(out)])
    assert "invalid choice" in capsys.readouterr().err


def test_cli_refuses_to_overwrite_and_names_an_unwritable_path(capsys, assets, tmp_path):
    """An existing file (GGUF) or an earlier export's files (hf) are kept unless --force; a path that cannot be
    written is one line, exit 2, no traceback."""
    m = assets / "models"
    model = ["--model", str(m / "stories260K.bin"), "--tokenizer", str(m / "tok512.bin")]
    out = tmp_path / "s.gguf"
    out.write_bytes(b"keep me")
    assert main(["export", *model, "--format", "gguf", "--out", str(out)]) == 2
    err = capsys.readouterr().err
    assert err.startswith("mtpspec: error: ") and str(out) in err and "--force" in err and err.count("\n") == 1
    assert out.read_bytes() == b"keep me"
    assert main(["export", *model, "--format", "gguf", "--out", str(out), "--force"]) == 0
    assert out.read_bytes()[:4] == b"GGUF"
    hf = tmp_path / "hf"
    hf.mkdir()
    (hf / "config.json").write_text("{}")
    assert main(["export", *model, "--out", str(hf), "--no-check"]) == 2
    err = capsys.readouterr().err
    assert str(hf / "config.json") in err and "--force" in err and (hf / "config.json").read_text() == "{}"
    assert main(["export", *model, "--out", str(out), "--no-check"]) == 2  # a file, not a directory
    assert "is a file" in capsys.readouterr().err
    if Path("/proc").is_dir():
        assert main(["export", *model, "--format", "gguf", "--out", "/proc/mtpspec-export-test"]) == 2
        err = capsys.readouterr().err
        assert err.startswith("mtpspec: error: cannot write the GGUF file /proc/mtpspec-export-test") and err.count("\n") == 1


# ------------------------------------------------------------------------------------------------
# llama.cpp itself (slow; skipped without its binaries)

def _llama_server() -> Path:
    """llama.cpp's llama-server ($MTPSPEC_LLAMACPP_BIN_DIR or `make llamacpp`'s build), else skip."""
    try:
        return find_binary("llama-server")
    except ConfigError as e:
        pytest.skip(str(e))


TOKENIZE_TEXTS = ["Once upon a time, there was a little girl named Lily. She loved to play outside.",
                  "def parse_args(argv):\n    \"\"\"Parse the command line.\"\"\"\n    return argv[1:]  # caf\u00e9 \u2713",
                  "  two  spaces,\ttabs\t and\nnew lines\n\n", "1234567 + 89 = ?", "x"]
GREEDY_PROMPTS = {"demo": ["def fibonacci(n):", "import os\n\nclass Config:\n", "for i in range(10):\n    print("],
                  "stories": ["Once upon a time", "Tom had a red ball. One day,", "The cat"]}


def _run_llamacpp(model, path: Path, prompts: list[str], n: int = 64, method: Method = Method("llamacpp", "none", None),
                  tokenize: bool = True) -> tuple[int, int]:
    """llama.cpp's /tokenize and greedy tokens against ours; returns its (drafted, accepted) totals."""
    exe = _llama_server()
    drafted = accepted = 0
    with LlamaServer(lambda port: server_args(exe, path, method, threads=1, ctx_size=1024, port=port)) as server:
        for text in TOKENIZE_TEXTS if tokenize else []:  # llama.cpp's tokenizer on our vocabulary: our ids, BOS included
            got = server.post("/tokenize", {"content": text, "add_special": True})["tokens"]
            assert got == model.encode(text), text
        for prompt in prompts:  # the same function: greedy tokens equal, token for token
            ids = model.encode(prompt)
            ours = model.generate(ids, max_new_tokens=n).tokens
            answer = parse_completion(server.post("/completion", request_body(ids, n)))
            theirs = answer.tokens
            if len(theirs) == len(ours) + 1 and theirs[-1] in model.tokenizer.stop_ids:
                theirs = theirs[:-1]  # llama.cpp keeps the end-of-generation token; we stop before it
            assert theirs == ours, prompt
            drafted += int(answer.draft_n or 0)
            accepted += int(answer.draft_n_accepted or 0)
    return drafted, accepted


@pytest.mark.slow
def test_llamacpp_runs_demo(demo, demo_gguf):
    _run_llamacpp(demo, demo_gguf, GREEDY_PROMPTS["demo"])


@pytest.mark.slow
def test_llamacpp_drafts_with_the_mtp_layer(demo, demo_gguf):
    """`--spec-type draft-mtp` loads blk.8.nextn.* and drafts with it: greedy tokens still ours, and its
    drafts accepted about as often as our MTP drafter's at depth 1 on the same prompts (both greedy,
    exact-match acceptance: a slip in the MTP tensors would leave next to nothing accepted). Measured on
    these prompts: ours 81 of 109 drafts (0.743), llama.cpp 80 of 107 (0.748); the bound leaves room for
    where either side skips a draft."""
    prompts = GREEDY_PROMPTS["demo"]
    drafted, accepted = _run_llamacpp(demo, demo_gguf, prompts, method=Method("llamacpp", "mtp", 1), tokenize=False)
    ours = [demo.generate(demo.encode(p), drafter="mtp", k=1, max_new_tokens=64).stats for p in prompts]
    rate_ours = sum(s.accepted_tokens for s in ours) / sum(s.draft_tokens for s in ours)
    assert drafted > 0
    assert accepted / drafted >= 0.8 * rate_ours


@pytest.mark.slow
def test_llamacpp_runs_stories(stories, stories_gguf):
    _run_llamacpp(stories, stories_gguf, GREEDY_PROMPTS["stories"])

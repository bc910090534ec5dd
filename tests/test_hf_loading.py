"""HF directory loading: strict errors that name every bad tensor, MTP tensors kept, name variants, bf16, tokenizer."""

from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import load_file, save_file

from mtpspec.cli import main
from mtpspec.errors import ConfigError, ModelLoadError
from mtpspec.loading import load_checkpoint
from qwen35_tiny import copy_ckpt, edit_config, save_hf


@pytest.fixture(scope="module")
def base(tmp_path_factory):
    d = tmp_path_factory.mktemp("q35")
    save_hf("qwen35", d, mtp=True)
    return d


def _edit_tensors(d, fn):
    f = d / "model.safetensors"
    state = load_file(str(f))
    fn(state)
    save_file(state, str(f), metadata={"format": "pt"})


def _error(d) -> str:
    with pytest.raises(ModelLoadError) as e:
        load_checkpoint(d)
    msg = str(e.value)
    assert "\n" not in msg
    return msg


def test_mtp_tensors_are_loaded(base):
    model, _ = load_checkpoint(base)
    assert model.mtp is not None and model.config.mtp_num_layers == 1


def test_missing_tensor_is_named(base, tmp_path):
    d = copy_ckpt(base, tmp_path)
    _edit_tensors(d, lambda s: (s.pop("model.layers.2.linear_attn.A_log"), s.pop("mtp.fc.weight")))
    msg = _error(d)
    assert "missing tensors: model.layers.2.linear_attn.A_log, mtp.fc.weight" in msg


def test_extra_tensor_is_named(base, tmp_path):
    d = copy_ckpt(base, tmp_path)
    _edit_tensors(d, lambda s: s.update({"model.layers.0.surprise.weight": torch.zeros(2)}))
    assert "unexpected tensors: model.layers.0.surprise.weight" in _error(d)


def test_wrong_shape_is_named(base, tmp_path):
    d = copy_ckpt(base, tmp_path)
    _edit_tensors(d, lambda s: s.update({"model.norm.weight": torch.zeros(7)}))
    msg = _error(d)
    assert "wrong shapes: model.norm.weight (checkpoint [7], model [32])" in msg and "missing" not in msg


def test_unknown_layer_type(base, tmp_path, capsys):
    d = copy_ckpt(base, tmp_path)
    edit_config(d, layer_types=["linear_attention", "mamba", "linear_attention", "full_attention"])
    assert "unknown layer type(s) 'mamba'" in _error(d)
    assert main(["generate", "w1", "--model", str(d)]) == 2
    err = capsys.readouterr().err
    assert err.startswith("mtpspec: error:") and "mamba" in err and "Traceback" not in err


def test_unsupported_model_type(base, tmp_path):
    d = copy_ckpt(base, tmp_path)
    edit_config(d, model_type="gpt2")
    assert "model type 'gpt2' is not supported" in _error(d)


def test_no_safetensors_and_no_tokenizer(base, tmp_path):
    d = copy_ckpt(base, tmp_path)
    (d / "tokenizer.json").unlink()
    with pytest.raises(ModelLoadError, match="no tokenizer.json"):
        load_checkpoint(d)
    assert load_checkpoint(d, with_tokenizer=False)[1] is None
    (d / "model.safetensors").unlink()
    assert "no .safetensors files" in _error(d)


def test_multimodal_names_and_deepseek_mtp_names(base, tmp_path):
    """Qwen3_5ForConditionalGeneration layout (model.language_model.*, visual tower ignored) and
    DeepSeek-V3-style MTP names (model.layers.{N}.enorm / hnorm / eh_proj / shared_head.norm) load alike."""
    ref, _ = load_checkpoint(base)
    d = copy_ckpt(base, tmp_path)
    cfg = json.loads((d / "config.json").read_text())
    (d / "config.json").write_text(json.dumps({"model_type": "qwen3_5", "architectures": ["Qwen3_5ForConditionalGeneration"],
                                               "text_config": cfg, "tie_word_embeddings": False}))
    n = cfg["num_hidden_layers"]
    ds = {"mtp.pre_fc_norm_embedding.weight": "enorm.weight", "mtp.pre_fc_norm_hidden.weight": "hnorm.weight",
          "mtp.fc.weight": "eh_proj.weight", "mtp.norm.weight": "shared_head.norm.weight"}

    def convert(s):
        for k in list(s):
            v = s.pop(k)
            if k.startswith("mtp."):
                k = f"model.layers.{n}." + ds.get(k, k[len("mtp.layers.0."):])
            s[k.replace("model.", "model.language_model.", 1)] = v
        s["model.visual.blocks.0.attn.qkv.weight"] = torch.zeros(3, 3)
        s["model.language_model.layers.4.shared_head.head.weight"] = s["lm_head.weight"].clone()

    _edit_tensors(d, convert)
    model, _ = load_checkpoint(d)
    for (k, a), (k2, b) in zip(ref.state_dict().items(), model.state_dict().items()):
        assert k == k2 and torch.equal(a, b), k


def test_bf16_load_and_generate(base):
    model, tok = load_checkpoint(base, dtype="bf16")
    assert model.dtype == torch.bfloat16 and model.mtp.fc.weight.dtype == torch.bfloat16
    out = model.forward_tokens(torch.tensor(tok.encode("w3 w4 w5")), model.new_cache())
    assert out.logits.dtype == torch.float32 and torch.isfinite(out.logits).all()


def test_tokenizer_interface(base):
    _, tok = load_checkpoint(base)
    ids = tok.encode("w3 w10 w7")
    assert ids == [3, 10, 7]  # this tokenizer adds no BOS
    assert tok.decode([5, 6], prev=7) == " w5 w6"
    stream = tok.stream(prev=7)
    assert stream.push([5]) + stream.push([6]) + stream.flush() == " w5 w6"
    with pytest.raises(ConfigError, match="adds no BOS"):
        tok.encode("")


def test_mtp_drafter_without_mtp_tensors(tmp_path, capsys):
    save_hf("qwen35", tmp_path, mtp=False)
    assert main(["generate", "w1 w2", "--model", str(tmp_path), "--drafter", "mtp", "--max-new-tokens", "4"]) == 2
    assert "needs a model with an MTP module" in capsys.readouterr().err


def test_qwen3_next_moe_loads_with_mtp(tmp_path):
    save_hf("qwen3next", tmp_path, mtp=True)
    model, _ = load_checkpoint(tmp_path)
    assert model.mtp is not None and model.config.num_experts == 4

"""The project's own checkpoint format: save_checkpoint -> load_checkpoint round trips, strictly."""

from __future__ import annotations

import json

import pytest
import torch

import mtpspec
from mtpspec.errors import ModelLoadError
from mtpspec.loading import load_checkpoint
from mtpspec.loading.native import save_checkpoint
from qwen35_tiny import save_hf


@pytest.fixture(scope="module")
def hybrid(tmp_path_factory):
    d = tmp_path_factory.mktemp("hf")
    save_hf("qwen35", d, mtp=True, tie=True)
    return load_checkpoint(d)


def test_hybrid_round_trip(hybrid, tmp_path):
    model, tok = hybrid
    save_checkpoint(model, tok, tmp_path)
    assert json.loads((tmp_path / "mtpspec.json").read_text())["config"]["arch"] == "qwen35"
    again, tok2 = load_checkpoint(tmp_path)
    assert again.mtp is not None and again.config == model.config
    for (k, a), (_, b) in zip(model.state_dict().items(), again.state_dict().items()):
        assert torch.equal(a, b), k
    a = mtpspec.api.Model(model, tok).generate("w1 w2 w3", drafter="mtp", k=2, max_new_tokens=12)
    b = mtpspec.load(tmp_path).generate("w1 w2 w3", drafter="mtp", k=2, max_new_tokens=12)
    assert a.tokens == b.tokens and a.text == b.text


def test_dense_round_trip_with_llama2c_tokenizer(stories, tmp_path):
    save_checkpoint(stories.module, stories.tokenizer, tmp_path)
    assert (tmp_path / "tokenizer.bin").exists()
    again = mtpspec.load(tmp_path)
    prompt = "Once upon a time"
    assert again.generate(prompt, max_new_tokens=20).text == stories.generate(prompt, max_new_tokens=20).text


def test_bf16_load(hybrid, tmp_path):
    save_checkpoint(*hybrid, tmp_path)
    model, _ = load_checkpoint(tmp_path, dtype="bf16")
    assert model.dtype == torch.bfloat16


@pytest.mark.parametrize("change, message", [
    (lambda m: m["config"].update(arch="rwkv"), "unknown architecture 'rwkv'"),
    (lambda m: m["config"].update(flux_capacitor=1), "unknown config field(s) for qwen35: flux_capacitor"),
    (lambda m: m["config"].update(layer_types=["linear_attention", "mamba", "linear_attention", "full_attention"]), "'mamba'"),
    (lambda m: m.update(version=99), "version 99 is not supported"),
])
def test_bad_config_is_a_clear_error(hybrid, tmp_path, change, message):
    save_checkpoint(*hybrid, tmp_path)
    meta = json.loads((tmp_path / "mtpspec.json").read_text())
    change(meta)
    (tmp_path / "mtpspec.json").write_text(json.dumps(meta))
    with pytest.raises(ModelLoadError, match=None) as e:
        load_checkpoint(tmp_path)
    assert message in str(e.value)


def test_strict_tensors(hybrid, tmp_path):
    from safetensors.torch import load_file, save_file

    save_checkpoint(*hybrid, tmp_path)
    f = tmp_path / "model.safetensors"
    state = load_file(str(f))
    state.pop("mtp.norm.weight")
    save_file(state, str(f))
    with pytest.raises(ModelLoadError, match="missing tensors: mtp.norm.weight"):
        load_checkpoint(tmp_path)

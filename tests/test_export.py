"""`mtpspec export`: a llama2.c checkpoint as a transformers Llama checkpoint, checked by equal logits."""

from __future__ import annotations

import json

import pytest
import torch

from mtpspec.cli import main
from mtpspec.export import check_export, export_hf, load_hf


@pytest.mark.parametrize("name", ["stories260K.bin", "stories260K_q80.bin"])
def test_export_round_trip_logits_equal(tmp_path, assets, name):
    import mtpspec

    model = mtpspec.load(assets / "models" / name, tokenizer=assets / "models" / "tok512.bin")
    d = export_hf(model.module, tmp_path / "hf")
    cfg = json.loads((d / "config.json").read_text())
    assert cfg["model_type"] == "llama" and cfg["tie_word_embeddings"] is True
    assert cfg["max_position_embeddings"] == 512 and cfg["rms_norm_eps"] == 1e-5
    assert cfg["rope_parameters"]["rope_theta"] == 10000.0
    assert (cfg["bos_token_id"], cfg["eos_token_id"]) == (1, 2)
    ids = model.encode("Once upon a time, there was a little dog named Max. He liked to run in the park.")
    hf = load_hf(d)
    chk = check_export(model.module, d, ids, hf_model=hf)
    assert chk.ok and chk.max_abs_diff <= 1e-5, chk
    # and greedy continuation through transformers equals ours
    ours = model.generate(ids, max_new_tokens=24).tokens
    with torch.inference_mode():
        theirs = hf.generate(torch.tensor([ids]), max_new_tokens=24, do_sample=False, eos_token_id=[1, 2], pad_token_id=0)
    assert theirs[0, len(ids) :].tolist()[: len(ours)] == ours


def test_export_cli(tmp_path, assets, capsys):
    m = assets / "models"
    rc = main(["export", str(m / "stories260K.bin"), "--tokenizer", str(m / "tok512.bin"), "--out", str(tmp_path / "x")])
    assert rc == 0
    assert (tmp_path / "x" / "model.safetensors").exists()
    assert "ok" in capsys.readouterr().out


def _tiny_hybrid(tie: bool):
    """A tiny random Qwen3.5-style HybridLM of ours (with an MTP module), weights well away from init."""
    from mtpspec.models.qwen35 import HybridConfig, HybridLM
    from qwen35_tiny import randomize

    cfg = HybridConfig(
        vocab_size=96, hidden_size=32, num_layers=4, layer_types=("linear_attention",) * 3 + ("full_attention",),
        num_heads=4, num_kv_heads=2, head_dim=16, intermediate_size=48, max_seq_len=256, rope_theta=10000.0,
        tie_embeddings=tie, linear_key_head_dim=8, linear_value_head_dim=8, linear_num_key_heads=2,
        linear_num_value_heads=4, mtp_num_layers=1,
    )
    torch.manual_seed(0)
    model = HybridLM(cfg)
    randomize(model, seed=3)
    if tie:
        model.lm_head.weight = model.model.embed_tokens.weight
    return model.eval()


@pytest.mark.parametrize("tie", [False, True], ids=["untied", "tied"])
def test_export_hybrid_as_qwen35_logits_equal(tmp_path, tie):
    """A HybridLM exports as transformers' Qwen3_5ForCausalLM with our logits and greedy tokens; our
    loader reads the folder back, MTP module included."""
    from mtpspec.loading import load_checkpoint

    model = _tiny_hybrid(tie)
    d = export_hf(model, tmp_path / "hf", bos_id=None, eos_id=0)
    cfg = json.loads((d / "config.json").read_text())
    assert cfg["model_type"] == "qwen3_5_text" and cfg["architectures"] == ["Qwen3_5ForCausalLM"]
    assert cfg["rope_parameters"]["partial_rotary_factor"] == 0.25 and cfg["tie_word_embeddings"] is tie
    hf = load_hf(d)
    assert type(hf).__name__ == "Qwen3_5ForCausalLM"
    ids = torch.randint(1, 96, (40,), generator=torch.Generator().manual_seed(1)).tolist()  # > 16: chunked DeltaNet
    chk = check_export(model, d, ids, hf_model=hf)
    assert chk.ok and chk.max_abs_diff <= 1e-4 * max(1.0, chk.max_abs_logit), chk
    from mtpspec.engine import generate_tokens
    from mtpspec.drafters import NoDrafter
    from mtpspec.sampling import Sampler, SamplingParams

    ours = generate_tokens(model, ids[:12], NoDrafter(), 1, Sampler(SamplingParams()), 16).tokens
    with torch.inference_mode():
        theirs = hf.generate(torch.tensor([ids[:12]]), max_new_tokens=16, do_sample=False, eos_token_id=None, pad_token_id=0)
    assert theirs[0, 12:].tolist() == ours
    back, _ = load_checkpoint(d, dtype="fp32", with_tokenizer=False)
    assert back.mtp is not None
    assert all(torch.equal(v, back.state_dict()[k]) for k, v in model.state_dict().items())


def test_export_refuses_mixture_of_experts():
    from mtpspec.errors import ConfigError
    from mtpspec.export import hf_config
    from mtpspec.models.qwen35 import HybridConfig, HybridLM

    cfg = HybridConfig(vocab_size=16, hidden_size=8, num_layers=1, layer_types=("full_attention",), num_heads=2,
                       num_kv_heads=1, head_dim=4, intermediate_size=8, max_seq_len=16, num_experts=2,
                       num_experts_per_tok=1, moe_intermediate_size=4, shared_expert_intermediate_size=4)
    with pytest.raises(ConfigError, match="mixture of experts"):
        hf_config(HybridLM(cfg))

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

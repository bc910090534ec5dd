"""`mtpspec train longctx`: a tiny random hybrid (context 64) raised to 256 and trained a few steps on
96-token windows writes a loadable checkpoint with the new context, generates greedily past the old
context (plain and with its MTP drafter, the same tokens), and refuses bad input with a ConfigError."""

from __future__ import annotations

import functools
import json
from pathlib import Path

import pytest
import torch

import mtpspec
from mtpspec.errors import ConfigError
from mtpspec.loading.native import save_checkpoint
from mtpspec.models.qwen35 import HybridConfig, HybridLM
from mtpspec.train import data as D
from mtpspec.train.longctx import LongCtxConfig, bucket_losses, train_longctx, with_context

OLD, NEW = 64, 256


@functools.cache
def _files() -> tuple[list[str], list[str]]:
    train, held = D.stdlib_files()
    small = [f for f in train if f.name in ("abc.py", "bisect.py", "colorsys.py", "keyword.py", "glob.py")]
    return [str(p) for p in small], [str(f) for f in held if f.name == "textwrap.py"]


@functools.cache
def _tokenizer():
    return D.train_tokenizer(D.read_texts([Path(p) for p in _files()[0]]), 300)


def _tiny(mtp_layers: int = 1) -> HybridConfig:
    return HybridConfig(
        vocab_size=300, hidden_size=32, num_layers=4, layer_types=("linear_attention",) * 3 + ("full_attention",),
        num_heads=2, num_kv_heads=1, head_dim=16, intermediate_size=64, max_seq_len=OLD, tie_embeddings=True,
        linear_key_head_dim=16, linear_value_head_dim=16, linear_num_key_heads=1, linear_num_value_heads=2,
        mtp_num_layers=mtp_layers,
    )


def _checkpoint(path, mtp_layers: int = 1):
    torch.manual_seed(0)
    save_checkpoint(HybridLM(_tiny(mtp_layers)), _tokenizer(), path)
    return path


def _cfg(out, **kw) -> LongCtxConfig:
    train, held = _files()
    base = dict(out=str(out), max_seq_len=NEW, seq_len=96, batch_size=2, steps=4, max_minutes=0.0, warmup_steps=2,
                lr=1e-3, eval_len=200, eval_seqs=2, save_every=2, data_files=train, heldout_files=held)
    return LongCtxConfig(**{**base, **kw})


@pytest.fixture(scope="module")
def raised(tmp_path_factory):
    src = _checkpoint(tmp_path_factory.mktemp("tiny"))
    out = tmp_path_factory.mktemp("long")
    return src, out, train_longctx(src, _cfg(out), progress_bar=False)


def test_checkpoint_has_the_new_context_and_a_complete_report(raised):
    src, out, report = raised
    meta = json.loads((out / "mtpspec.json").read_text())
    assert meta["config"]["max_seq_len"] == NEW
    assert (out / "tokenizer.json").read_bytes() == (src / "tokenizer.json").read_bytes()
    assert report["steps"] == 4 and report["tokens_seen"] == 4 * 2 * 96 and report["old_max_seq_len"] == OLD
    rows = report["loss_by_position"]
    assert [r["positions"] for r in rows] == ["0-198"]  # one bucket: sequences of 200 tokens
    assert rows[0]["tokens"] == 2 * 198
    assert all(r["next_token_after"] < r["next_token_before"] for r in rows)  # a random model learns something in 4 steps
    assert json.loads((out / "report.json").read_text())["steps"] == 4


def test_greedy_generation_past_the_old_context(raised):
    _, out, _ = raised
    model = mtpspec.load(out)
    assert model.max_seq_len == NEW and model.module.mtp is not None
    prompt = model.tokenizer.decode(model.encode("def f(x):\n    return x\n" * 20)[:OLD + 10])
    n = len(model.encode(prompt))
    assert n > OLD  # the prompt alone is already past the old context
    plain = model.generate(prompt, max_new_tokens=40)
    spec = model.generate(prompt, drafter="mtp", k=2, max_new_tokens=40)
    assert len(plain.tokens) == 40 and spec.tokens == plain.tokens


def test_resume_continues_from_the_saved_step(raised):
    _, out, _ = raised
    report = train_longctx(raised[0], _cfg(out, steps=6), progress_bar=False)
    assert report["steps"] == 6 and [h["step"] for h in report["history"]] == [1, 2, 3, 4, 5, 6]


def test_raised_context_keeps_the_losses_within_the_old_one(tmp_path):
    """Raising the context changes no weight: over the old context the losses are those of the original model."""
    src = _checkpoint(tmp_path / "m")
    model = mtpspec.load(src).module
    seqs = torch.randint(0, 300, (1, OLD))
    old = bucket_losses(model, seqs, (0, OLD))
    new = bucket_losses(with_context(model, NEW), seqs, (0, OLD))
    assert old == new


@pytest.mark.parametrize("kw, src_mtp, message", [
    (dict(max_seq_len=32), 1, "smaller than the model's context 64"),
    (dict(seq_len=512), 1, "--seq-len 512 must be between 3 and --max-seq-len 256"),
    (dict(eval_len=1000), 1, "--eval-len 1000"),
    ({}, 0, "needs a hybrid (qwen35) model with an MTP module"),
])
def test_bad_input_is_a_config_error(tmp_path, kw, src_mtp, message):
    src = _checkpoint(tmp_path / "m", mtp_layers=src_mtp)
    with pytest.raises(ConfigError, match=message.replace("(", r"\(").replace(")", r"\)")):
        train_longctx(src, _cfg(tmp_path / "out", **kw), progress_bar=False)
    assert not (tmp_path / "out" / "model.safetensors").exists()


def test_cli_refuses_a_smaller_context(tmp_path, capsys):
    from mtpspec.cli import main

    src = _checkpoint(tmp_path / "m")
    rc = main(["train", "longctx", "--model", str(src), "--out", str(tmp_path / "out"), "--max-seq-len", "16", "--no-progress"])
    assert rc != 0 and "smaller than the model's context" in capsys.readouterr().err

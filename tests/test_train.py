"""`mtpspec train pretrain` smoke test: a few steps on a few stdlib files lower the held-out loss, the
checkpoint round-trips through the loader (with its MTP module drafting losslessly), and a second run
resumes from train_state.pt instead of starting over."""

from __future__ import annotations

import json

import pytest
import torch

import mtpspec
from mtpspec.train import data as D
from mtpspec.train.pretrain import PretrainConfig, losses, pretrain


def _cfg(out, steps: int) -> PretrainConfig:
    train, held = D.stdlib_files()
    small = [f for f in train if f.name in ("abc.py", "bisect.py", "colorsys.py", "keyword.py", "glob.py")]
    return PretrainConfig(
        out=str(out), vocab_size=300, hidden_size=32, num_layers=4, num_heads=2, num_kv_heads=1, head_dim=16,
        intermediate_size=64, linear_key_heads=1, linear_value_heads=2, linear_head_dim=16, max_seq_len=256,
        seq_len=64, batch_size=4, steps=steps, eval_every=10, save_every=10, eval_windows=4, warmup_steps=5, lr=5e-3,
        mtp_depth=2, data_files=[str(p) for p in small], heldout_files=[str(held[0])],
    )


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    out = tmp_path_factory.mktemp("pretrain")
    return out, pretrain(_cfg(out, 30), progress_bar=False)


def test_loss_falls_and_report_is_complete(trained):
    _, report = trained
    hist = report["history"]
    assert hist[-1]["next_token"] < hist[0]["next_token"] - 0.1
    assert hist[-1]["mtp_1"] < hist[0]["mtp_1"]
    assert set(report["heldout_loss"]) == {"next_token", "mtp_1", "mtp_2"}
    assert len(report["mtp_acceptance_by_position_greedy_D4"]) == 4


def test_checkpoint_round_trips_and_drafts_losslessly(trained):
    out, _ = trained
    model = mtpspec.load(out)
    assert model.module.mtp is not None and model.tokenizer.stop_ids == (0,)
    prompt = "def add(a, b):\n    return"
    plain = model.generate(prompt, max_new_tokens=30)
    spec = model.generate(prompt, drafter="mtp", k=3, max_new_tokens=30)
    assert spec.tokens == plain.tokens
    assert plain.text == model.tokenizer.decode(plain.tokens, prev=model.encode(prompt)[-1])


def test_draft_vocab_written_and_eval_table(trained, capsys):
    """pretrain writes draft_vocab.json; `train eval` prints plain + each run (with a draft vocabulary), all identical."""
    from mtpspec.cli import main

    out, _ = trained
    meta = json.loads((out / "draft_vocab.json").read_text())
    assert len(meta["ranked_ids"]) == 300 and 0 < meta["default_size"] <= 300
    assert mtpspec.load(out).module.token_ranking is not None
    assert main(["train", "eval", "--model", str(out), "--runs", "mtp:1,mtp:2:vocab=64,ngram:2", "--n", "1", "--max-new-tokens", "8"]) == 0
    rows = [ln for ln in capsys.readouterr().out.splitlines() if ln.startswith("| ") and "---" not in ln][1:]
    assert [r.split("|")[1].strip() for r in rows] == ["none", "mtp", "mtp (draft vocab 64)", "ngram"]
    assert all(r.rstrip(" |").endswith("yes") for r in rows)


def test_resume_continues_from_the_saved_step(trained, tmp_path):
    out, _ = trained
    report = pretrain(_cfg(out, 40), progress_bar=False)
    assert report["steps"] == 40 and [h["step"] for h in report["history"]][-2:] == [30, 40]


def test_mtp_loss_targets_are_shifted_by_depth():
    """Each depth's training loss is the cross-entropy of t_{i+k+1} given the chained MTP hidden at i.

    Recomputed here another way: the inference layers with real caches, one sequence at a time, and
    the loss taken position by position. Scoring depth 1 against t_{i+1} instead changes it by ~0.7
    (measured). The two sides run the same fp32 ops in other batch shapes: they differed by 2e-6
    (4 ulps of a loss of ~6) here; the tolerance 1e-4 leaves 50x for other CPUs' summation orders.
    """
    from mtpspec.models.qwen35 import HybridLM

    torch.manual_seed(0)
    cfg = _cfg("unused", 1)
    m = HybridLM(cfg.model_config()).eval()
    toks = torch.randint(0, cfg.vocab_size, (2, 16))  # (B, T)
    depth = 3
    want_main, want_mtp, shifted = [], [[] for _ in range(depth)], []
    with torch.no_grad():
        main, mtp = losses(m, toks, depth)
        for seq in toks:
            out = m.forward_tokens(seq, m.new_cache())  # hidden (T, H) post final norm
            want_main.append(-torch.log_softmax(out.logits[:-1], -1)[torch.arange(15), seq[1:]])
            h = out.hidden
            for k in range(1, depth + 1):  # depth k: (h^{k-1}_i, e(t_{i+k})) -> t_{i+k+1}
                h = m.mtp_forward(h[: 16 - k], seq[k:], m.new_mtp_cache(), layer=(k - 1) % cfg.model_config().mtp_num_layers)
                logp = torch.log_softmax(m.head(h[:-1]), -1)  # (T-k-1, V)
                want_mtp[k - 1].append(-logp[torch.arange(15 - k), seq[k + 1 :]])
                if k == 1:  # the off-by-one alternative: depth 1 scored against t_{i+1}
                    shifted.append(-logp[torch.arange(14), seq[1:-1]])
    assert main.item() == pytest.approx(torch.cat(want_main).mean().item(), abs=1e-4)
    assert len(mtp) == depth
    for k in range(depth):
        assert mtp[k].item() == pytest.approx(torch.cat(want_mtp[k]).mean().item(), abs=1e-4), f"depth {k + 1}"
    assert abs(torch.cat(shifted).mean().item() - mtp[0].item()) > 1e-2  # so the check above can fail


def test_cli_parses_train_commands():
    from mtpspec.cli import build_parser

    p = build_parser()
    a = p.parse_args(["train", "pretrain", "--out", "x", "--mtp-lambda", "0.2", "--max-minutes", "5"])
    assert a.mtp_lambda == 0.2 and a.max_minutes == 5.0
    a = p.parse_args(["train", "head", "--model", "m", "--kind", "eagle", "--out", "y"])
    assert a.kind == "eagle" and a.depth == 2


def test_tokenizer_is_byte_level_and_adds_bos():
    tok = D.train_tokenizer(["def f(x):\n    return x + 1\n"] * 20, 300)
    ids = tok.encode("def f(y):  # é\n")
    assert ids[0] == 0 and tok.decode(ids[1:]) == "def f(y):  # é\n"
    json.dumps(tok.tokenizer.to_str())  # serialisable


def test_shipped_demo_model_loads_and_its_mtp_head_is_lossless():
    """models/demo (trained by `mtpspec train pretrain`, see its MODEL_CARD.md) loads and drafts losslessly."""
    from mtpspec.loading import shipped_demo_dir

    if not (shipped_demo_dir() / "mtpspec.json").exists():
        pytest.skip("models/demo not shipped")
    model = mtpspec.load(shipped_demo_dir())
    assert model.module.mtp is not None
    prompt = "def mean(data):\n    \"\"\"Return the sample arithmetic mean of data.\"\"\"\n"
    ref = model.generate(prompt, max_new_tokens=32)
    for k in (1, 3):
        r = model.generate(prompt, drafter="mtp", k=k, max_new_tokens=32)
        assert r.tokens == ref.tokens and r.stats.accepted_tokens > 0


def test_native_mtp_tuning_changes_only_the_mtp_and_lowers_its_loss(trained, tmp_path):
    """`mtpspec train mtp`: self-distillation of the model's own MTP module, the rest frozen."""
    from safetensors.torch import load_file

    from mtpspec.train.native_mtp import MTPTuneConfig, tune_native_mtp

    src, _ = trained
    prompts = tmp_path / "prompts.txt"
    prompts.write_text("\n".join(f"def f{i}(x):" for i in range(12)) + "\n")
    cfg = MTPTuneConfig(out=str(tmp_path / "tuned"), prompts=str(prompts), heldout_prompts=2, train_prompts=10, gen_tokens=24,
                        steps=30, batch_size=4, seq_len=32, lr=3e-3, eval_tokens=16)
    report = tune_native_mtp(src, cfg, progress_bar=False)
    assert report["distill_loss_after"]["ce_1"] < report["distill_loss_before"]["ce_1"]  # fits the model's own distribution better
    assert report["heldout_greedy_after"]["identical_to_plain"] and report["heldout_greedy_before"]["identical_to_plain"]
    old, new = load_file(str(src / "model.safetensors")), load_file(str(tmp_path / "tuned" / "model.safetensors"))
    assert old.keys() == new.keys()
    changed = {k for k in old if not torch.equal(old[k], new[k])}
    assert changed and all(k.startswith("mtp.") for k in changed)
    assert (tmp_path / "tuned" / "draft_vocab.json").exists() and (tmp_path / "tuned" / "mtp_tune_report.json").exists()
    m = mtpspec.load(tmp_path / "tuned")
    ids = m.encode("def g(x):")
    assert m.generate(ids, drafter="mtp", k=2, max_new_tokens=16).tokens == m.generate(ids, max_new_tokens=16).tokens


def test_native_mtp_tuning_needs_an_mtp_module(tmp_path, assets):
    from mtpspec.errors import ConfigError
    from mtpspec.train.native_mtp import MTPTuneConfig, tune_native_mtp

    with pytest.raises(ConfigError, match="no MTP module"):
        tune_native_mtp(assets / "models" / "stories260K.bin", MTPTuneConfig(out=str(tmp_path / "x")), tokenizer=assets / "models" / "tok512.bin")

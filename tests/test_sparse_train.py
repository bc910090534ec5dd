"""`mtpspec train mtp --sparse` (train/sparse_mtp.py): the indexer's distillation, the tuned sparse checkpoint, errors."""

from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import load_file

from mtpspec.errors import ConfigError
from mtpspec.models.qwen35 import HybridConfig, HybridLM
from mtpspec.models.sparse_attention import SparseAttentionConfig
from mtpspec.train.native_mtp import MTPTuneConfig, tune_native_mtp
from mtpspec.train.sparse_mtp import Windows, evaluate_indexer, frozen_hiddens, train_indexer, with_sparse_mtp
from qwen35_tiny import randomize, write_tokenizer

V = 16
BASE = dict(
    vocab_size=V, hidden_size=32, num_layers=4, layer_types=("linear_attention", "full_attention", "linear_attention", "full_attention"),
    num_heads=4, num_kv_heads=2, head_dim=16, intermediate_size=48, max_seq_len=320, linear_key_head_dim=8,
    linear_value_head_dim=8, linear_num_key_heads=2, linear_num_value_heads=4, tie_embeddings=False,
)
FEW = SparseAttentionConfig(block=4, top_k=3, window=8, heads=2, dim=8)  # 12 chosen tokens + an 8-token window
SPARSE = dict(sparse=True, sparse_block=4, sparse_top_k=3, sparse_window=8, sparse_heads=2, sparse_dim=8)


def dense(mtp_layers: int = 1) -> HybridLM:
    torch.manual_seed(0)
    m = HybridLM(HybridConfig(**BASE, mtp_num_layers=mtp_layers))
    randomize(m, 5)
    return m.eval()


def windows(model: HybridLM, n: int, t: int, seed: int) -> Windows:
    """n windows of t tokens of a repetitive random text (a few motifs: attention has something to find)."""
    g = torch.Generator().manual_seed(seed)
    motifs = torch.randint(0, V, (6, 8), generator=g)
    toks = motifs[torch.randint(0, 6, (n, t // 8), generator=g)].flatten(1)  # (n, t)
    return frozen_hiddens(model, toks)


def test_indexer_distillation_lowers_kl_and_raises_recall():
    m = with_sparse_mtp(dense(), FEW, seed=1)
    for p in m.parameters():
        p.requires_grad_(False)
    train, held = windows(m, 4, 96, 1), windows(m, 2, 96, 2)
    before = evaluate_indexer(m, held, FEW)
    assert before.selective_rows > 0 and before.recall_selective < before.oracle_recall_selective
    hist, phase = train_indexer(m, train, FEW, steps=40, lr=2e-2, seed=0)
    after = evaluate_indexer(m, held, FEW)
    first, last = sum(h["kl"] for h in hist[:5]) / 5, sum(h["kl"] for h in hist[-5:]) / 5
    assert last < 0.8 * first, (first, last)
    assert after.kl < before.kl
    assert after.recall_selective > before.recall_selective, (before, after)
    assert after.recall_selective <= after.oracle_recall_selective + 1e-6
    assert phase.steps == 40 and phase.tokens == 40 * 96
    assert not any(p.requires_grad for p in m.parameters())  # frozen again


@pytest.fixture(scope="module")
def source(tmp_path_factory):
    """A tiny dense checkpoint with a word-level tokenizer, a text file of its words and a prompts file."""
    from mtpspec.loading.native import save_checkpoint
    from mtpspec.loading.tokenizer_hf import HFTokenizer

    d = tmp_path_factory.mktemp("sparse_train")
    write_tokenizer(d, vocab=V)
    tok = HFTokenizer.load(d / "tokenizer.json")
    save_checkpoint(dense(), tok, d / "src")
    g = torch.Generator().manual_seed(3)
    motifs = torch.randint(0, V, (6, 8), generator=g)
    words = motifs[torch.randint(0, 6, (200,), generator=g)].flatten().tolist()
    (d / "text.txt").write_text(" ".join(f"w{i}" for i in words) + "\n")
    (d / "prompts.txt").write_text("\n".join(" ".join(f"w{(i * 7 + j) % V}" for j in range(40)) for i in range(4)) + "\n")
    nomtp = HybridLM(HybridConfig(**BASE, mtp_num_layers=0))
    save_checkpoint(nomtp, tok, d / "nomtp")
    return d


def tune_cfg(d, out: str, **kw) -> MTPTuneConfig:
    base = dict(prompts=str(d / "prompts.txt"), heldout_prompts=2, sparse_text=str(d / "text.txt"), window_tokens=96, sparse_windows=3,
                heldout_windows=1, long_prompts=1, indexer_steps=4, steps=3, depth=2, eval_tokens=12, **SPARSE)
    return MTPTuneConfig(out=str(d / out), **{**base, **kw})


def test_sparse_tuning_writes_a_lossless_sparse_checkpoint(source):
    import mtpspec

    report = tune_native_mtp(source / "src", tune_cfg(source, "tuned"), progress_bar=False)
    assert report["sparse_attention"] == FEW.to_dict()
    assert report["phases"]["indexer"]["steps"] == 4 and report["phases"]["tune"]["tokens"] == 3 * 96
    assert report["indexer"]["recall_after"][0]["selective_rows"] > 0
    for key in ("heldout_greedy_before", "heldout_greedy_after"):
        assert report[key]["identical_to_plain"]
    assert report["long_context_greedy"]["sparse_tuned"]["identical_to_plain"]
    saved = json.loads((source / "tuned" / "mtp_tune_report.json").read_text())
    assert saved["sparse_attention"] == FEW.to_dict() and saved["config"]["sparse"]
    old, new = load_file(str(source / "src" / "model.safetensors")), load_file(str(source / "tuned" / "model.safetensors"))
    assert {k for k in new if k not in old} == {f"mtp.layers.0.self_attn.indexer.{n}_proj.weight" for n in "qkw"}
    assert {k for k in old if not torch.equal(old[k], new[k])} and all(k.startswith("mtp.") for k in old if not torch.equal(old[k], new[k]))
    m = mtpspec.load(source / "tuned")
    assert m.module.config.mtp_sparse_attention == FEW
    ids = m.encode(" ".join(f"w{(3 * j) % V}" for j in range(70)))  # longer than window + top_k blocks: really sparse
    for k in (1, 3):
        assert m.generate(ids, drafter="mtp", k=k, max_new_tokens=24).tokens == m.generate(ids, max_new_tokens=24).tokens


def test_zero_step_phases_are_skipped(source):
    report = tune_native_mtp(source / "src", tune_cfg(source, "skip", indexer_steps=0, steps=0, long_prompts=0), progress_bar=False)
    assert report["phases"]["indexer"]["seconds"] < 1 and report["phases"]["tune"]["steps"] == 0
    assert report["indexer"]["recall_after"] == report["indexer"]["recall_before"]


@pytest.mark.parametrize("bad, name", [(dict(sparse_window=2), "window"), (dict(sparse_top_k=0), "top_k"),
                                       (dict(window_tokens=10), "--window-tokens")])
def test_bad_sparse_config_is_named(source, bad, name):
    with pytest.raises(ConfigError, match=name):
        tune_native_mtp(source / "src", tune_cfg(source, "bad", **bad), progress_bar=False)
    assert not (source / "bad").exists()


def test_sparse_needs_an_mtp_module(source):
    with pytest.raises(ConfigError, match="no MTP module"):
        tune_native_mtp(source / "nomtp", tune_cfg(source, "nomtp-out"), progress_bar=False)


def test_a_new_window_or_top_k_keeps_the_indexer_a_new_shape_does_not():
    """with_sparse_mtp on a sparse source: another window or top_k keeps the indexer (its scores do not depend on
    them) and every other weight; other heads or dim start a new one."""
    import dataclasses

    src = with_sparse_mtp(dense(), FEW, seed=1)
    wider = with_sparse_mtp(src, dataclasses.replace(FEW, window=2 * FEW.window, top_k=FEW.top_k + 1), seed=2)
    assert wider.config.mtp_sparse_attention.window == 2 * FEW.window
    a, b = src.state_dict(), wider.state_dict()
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    other = with_sparse_mtp(src, dataclasses.replace(FEW, heads=FEW.heads + 1), seed=2).state_dict()
    moved = [k for k in a if ".indexer." in k]
    assert moved and all(other[k].shape != a[k].shape for k in moved if "k_proj" not in k)

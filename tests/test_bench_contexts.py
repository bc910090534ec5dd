"""`mtpspec bench --contexts ... --sparse-model S`: full-attention vs sparse MTP against context length, end to end
on tiny random hybrid checkpoints (the demo's tokenizer, so the held-out stdlib text encodes); its errors."""

from __future__ import annotations

import json
import re
from dataclasses import replace
from pathlib import Path

import pytest
import torch

from mtpspec.bench.contexts import METHODS, context_prompts
from mtpspec.cli import main
from mtpspec.errors import ConfigError
from mtpspec.loading.native import save_checkpoint
from mtpspec.loading.tokenizer_hf import HFTokenizer
from mtpspec.models.qwen35 import HybridConfig, HybridLM
from mtpspec.models.sparse_attention import SparseAttentionConfig
from qwen35_tiny import randomize

DEMO = Path(__file__).resolve().parents[1] / "models" / "demo"
CFG = HybridConfig(
    vocab_size=4096, hidden_size=32, num_layers=2, layer_types=("linear_attention", "full_attention"), num_heads=4,
    num_kv_heads=2, head_dim=16, intermediate_size=48, max_seq_len=160, linear_key_head_dim=8, linear_value_head_dim=8,
    linear_num_key_heads=2, linear_num_value_heads=4, mtp_num_layers=1, tie_embeddings=True,
)
SPARSE = SparseAttentionConfig(block=4, top_k=4, window=16, heads=2, dim=8)  # 16 chosen + 16 window tokens: sparse at 64


@pytest.fixture(scope="module")
def ckpts(tmp_path_factory) -> dict[str, Path]:
    """full: a full-attention MTP; sparse: the same target with a sparse MTP (random indexer); other: another target."""
    d, tok = tmp_path_factory.mktemp("ctx"), HFTokenizer.load(DEMO / "tokenizer.json", stop_ids=(0,))
    torch.manual_seed(0)
    full = HybridLM(CFG)
    randomize(full, 1)
    sparse = HybridLM(replace(CFG, mtp_sparse_attention=SPARSE))
    missing = sparse.load_state_dict(full.state_dict(), strict=False).missing_keys
    assert missing and all(".indexer." in k for k in missing)
    other = HybridLM(replace(CFG, mtp_sparse_attention=SPARSE))
    other.load_state_dict(sparse.state_dict())
    with torch.no_grad():
        other.get_parameter("model.layers.1.mlp.down_proj.weight").mul_(1.01)  # one target tensor differs
    for name, m in (("full", full), ("sparse", sparse), ("other", other)):
        save_checkpoint(m.eval(), tok, d / name)
    return {name: d / name for name in ("full", "sparse", "other")}


def bench(ckpts, out, *extra, sparse="sparse", contexts="64,128") -> int:
    return main(["bench", "--model", str(ckpts["full"]), "--sparse-model", str(ckpts[sparse]), "--contexts", contexts,
                 "--limit", "1", "--max-new-tokens", "6", "--threads", "1", "--no-progress", "--out", str(out), *extra])


def test_contexts_bench_writes_every_method_and_context(ckpts, tmp_path):
    assert bench(ckpts, tmp_path) == 0
    res = json.loads((tmp_path / "contexts.json").read_text())
    assert res["config"]["k"] == 4 and res["config"]["contexts"] == [64, 128]
    assert res["config"]["target_tensors_equal"] > 0 and res["config"]["sparse_config"] == SPARSE.to_dict()
    assert list(res["summary"]) == ["64", "128"]
    for L, per in res["summary"].items():
        assert list(per) == list(METHODS)
        for m, a in per.items():
            assert a["prompts"] == 1 and a["new_tokens"] == 6 and a["decode_tokens_per_second"] > 0, (L, m)
            assert a["greedy_identical"] == "1/1", (L, m)  # every method's tokens are plain's
            if m == "plain":
                assert a["mean_accepted_length"] == 1.0 and a["mtp_first_ms"] is None
            else:
                assert len(a["acceptance_by_position"]) == 4 and a["mtp_first_ms"] > 0 and a["draft_ms_per_drafted_token"] > 0
    runs = res["runs"]
    assert len(runs) == 2 * len(METHODS) and all(r["identical"] for r in runs)
    assert {len(r["tokens"]) for r in runs} == {6}
    md = (tmp_path / "contexts.md").read_text()
    assert all(f"| {L} | {m} |" in md for L in (64, 128) for m in METHODS) and "Targets" in md
    for name in ("acceptance", "tokens_per_second", "draft_ms"):
        assert (tmp_path / f"bench_contexts_{name}.png").read_bytes()[:4] == b"\x89PNG"


def test_prompts_are_exactly_l_tokens_at_different_offsets():
    stream = list(range(1, 101))
    got = context_prompts(stream, [0], 40, 3)
    assert [o for o, _ in got] == [0, 30, 61]  # spread from the start to the end of the text
    assert all(ids == [0] + stream[o : o + 39] for o, ids in got)
    with pytest.raises(ConfigError, match="holds 100 tokens, fewer than a context of 200"):
        context_prompts(stream, [0], 200, 1)


@pytest.mark.parametrize("extra, sparse, contexts, message", [
    ((), "sparse", "64,200", "--contexts 200 \\+ --max-new-tokens 6 is longer than the models' context of 160 tokens"),
    ((), "other", "64", "are not the same target: 1 of .* target tensors differ \\(model.layers.1.mlp.down_proj.weight\\)"),
    ((), "full", "64", "has no sparse-attention MTP module"),
    (("--k", "2,4"), "sparse", "64", "one fixed draft depth"),
    (("--peers",), "sparse", "64", "--peers: not measured with --contexts"),
    ((), "sparse", "0", "--contexts context lengths \\(tokens\\) must be >= 1"),
])
def test_errors_are_clear(ckpts, tmp_path, capsys, extra, sparse, contexts, message):
    assert bench(ckpts, tmp_path, *extra, sparse=sparse, contexts=contexts) == 2
    err = capsys.readouterr().err
    assert "Traceback" not in err
    assert re.search(message, err), err

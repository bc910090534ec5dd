"""Block-sparse attention (models/sparse_attention.py): its maths, the target's sparse layers staying lossless, and the
MTP drafter's selection reuse taking the last *accepted* token's row."""

from __future__ import annotations

import pytest
import torch

from mtpspec.drafters import make_drafter
from mtpspec.engine import Session, generate_tokens
from mtpspec.errors import ConfigError
from mtpspec.models.qwen35 import HybridConfig, HybridLM
from mtpspec.models.sparse_attention import (
    SparseAttentionConfig, SparseState, block_attention_mass, block_scores, select_blocks,
)
from mtpspec.sampling import Sampler, SamplingParams
from mtpspec.train.pretrain import hybrid_hidden
from qwen35_tiny import randomize

V = 16
BASE = dict(
    vocab_size=V, hidden_size=32, num_layers=4, layer_types=("linear_attention", "full_attention", "linear_attention", "full_attention"),
    num_heads=4, num_kv_heads=2, head_dim=16, intermediate_size=48, max_seq_len=320, linear_key_head_dim=8,
    linear_value_head_dim=8, linear_num_key_heads=2, linear_num_value_heads=4, mtp_num_layers=1, tie_embeddings=False,
)
ALL = SparseAttentionConfig(block=4, top_k=1000, window=8, heads=2, dim=8)  # every block chosen: full attention
FEW = SparseAttentionConfig(block=4, top_k=3, window=8, heads=2, dim=8)  # 12 chosen tokens + an 8-token window


def build(target: SparseAttentionConfig | None, mtp: SparseAttentionConfig | None, dtype=torch.float64) -> HybridLM:
    torch.manual_seed(0)
    m = HybridLM(HybridConfig(**BASE, sparse_attention=target, mtp_sparse_attention=mtp))
    randomize(m, 5)
    return m.to(dtype).eval()


def scale(x: torch.Tensor) -> float:
    return x.abs().max().item()


def test_config_is_checked_and_round_trips():
    with pytest.raises(ConfigError, match="window"):
        SparseAttentionConfig(block=8, window=4)
    with pytest.raises(ConfigError, match="top_k"):
        SparseAttentionConfig(top_k=0)
    with pytest.raises(ConfigError, match="unknown field"):
        SparseAttentionConfig.parse({"blok": 4})
    cfg = HybridConfig(**BASE, mtp_sparse_attention=FEW.to_dict())
    assert cfg.mtp_sparse_attention == FEW and cfg.sparse_attention is None
    d = cfg.to_dict()
    assert d["mtp_sparse_attention"] == FEW.to_dict() and "sparse_attention" not in d
    assert HybridConfig(**{k: v for k, v in d.items() if k != "arch"}) == cfg


def test_every_block_chosen_equals_full_attention():
    """With at most top_k candidate blocks every earlier token is attended: logits equal the dense model's (fp64)."""
    full, sparse = build(None, None), build(ALL, ALL)
    missing = sparse.load_state_dict(full.state_dict(), strict=False).missing_keys
    assert missing and all(".indexer." in k for k in missing)
    toks = torch.randint(0, V, (150,), generator=torch.Generator().manual_seed(1))
    c1, c2 = full.new_cache(), sparse.new_cache()
    a, b = full.forward_tokens(toks[:120], c1).logits, sparse.forward_tokens(toks[:120], c2).logits  # masked path
    assert (a - b).abs().max() <= 1e-12 * scale(a)
    for i in range(120, 150):  # gathered path
        a, b = full.forward_tokens(toks[i : i + 1], c1).logits, sparse.forward_tokens(toks[i : i + 1], c2).logits
        assert (a - b).abs().max() <= 1e-12 * scale(a)


def test_sparse_is_one_function_for_prefill_steps_verify_and_training():
    """A prompt pass (masked), one-token steps and 5-row verify passes (gathered) and training's batched windows
    compute the same function (fp64): plain and speculative decoding see the same sparse attention."""
    m = build(FEW, FEW)
    toks = torch.randint(0, V, (180,), generator=torch.Generator().manual_seed(2))
    ca = m.new_cache()
    whole = m.forward_tokens(toks, ca).logits
    cb = m.new_cache()
    steps = torch.cat([m.forward_tokens(toks[:100], cb).logits] + [m.forward_tokens(toks[i : i + 1], cb).logits for i in range(100, 180)])
    cc = m.new_cache()
    verify = torch.cat([m.forward_tokens(toks[:100], cc).logits] + [m.forward_tokens(toks[i : i + 5], cc).logits for i in range(100, 180, 5)])
    assert (whole - steps).abs().max() <= 1e-11 * scale(steps)
    assert (verify - steps).abs().max() <= 1e-11 * scale(steps)
    f32 = build(FEW, FEW, torch.float32)
    with torch.no_grad():
        h = hybrid_hidden(f32, toks[None])[0]  # training windows: window_sparse_attention
    out = f32.forward_tokens(toks, f32.new_cache())
    assert (h - out.hidden).abs().max() <= 1e-5 * scale(out.hidden)  # fp32: the same ops on the same shapes
    dense = build(None, None)
    dense.load_state_dict(m.state_dict(), strict=False)
    assert (dense.forward_tokens(toks, dense.new_cache()).logits - whole).abs().max() > 1e-3  # really sparse


def test_rollback_refreshes_block_keys():
    """Rejected positions are overwritten by the next pass, and the blocks they touch are recomputed."""
    m = build(FEW, FEW)
    g = torch.Generator().manual_seed(3)
    toks = torch.randint(0, V, (140,), generator=g)
    ref = m.new_cache()
    want = m.forward_tokens(toks, ref).logits[-20:]
    c = m.new_cache()
    m.forward_tokens(toks[:120], c)
    for i in range(120, 140, 4):  # each pass: 3 wrong tokens, rolled back, then the right ones
        start = c.length
        m.forward_tokens(torch.randint(0, V, (3,), generator=g), c)
        c.crop(start)
    got = torch.cat([m.forward_tokens(toks[i : i + 4], c).logits for i in range(120, 140, 4)])
    assert (got - want).abs().max() <= 1e-11 * scale(want)


def test_selection_takes_top_k_candidates_with_stable_ties():
    cfg = SparseAttentionConfig(block=2, top_k=2, window=2, heads=1, dim=1)
    scores = torch.tensor([[0.0, 3.0, 0.0, 5.0, 9.0], [0.0, 0.0, 0.0, 0.0, 0.0], [0.0, 3.0, 0.0, 5.0, 9.0],
                           [1.0, 0.0, 7.0, 1.0, 1.0]])  # (4 rows, 5 blocks)
    blocks, ok = select_blocks(scores, torch.tensor([7, 9, 9, 9]), cfg)  # chosen blocks come in block order
    assert blocks[0].tolist() == [0, 1] and ok[0].all()  # candidates of position 7: blocks starting at <= 5 (0, 1, 2)
    assert blocks[1].tolist() == [0, 1] and ok[1].all()  # all-zero scores: the earliest blocks, whatever nb is
    assert blocks[2].tolist() == [1, 3] and blocks[3].tolist() == [0, 2]  # position 9: blocks 0..3; a tie at the k-th
    blocks, ok = select_blocks(scores[:1], torch.tensor([3]), cfg)  # position 3: one candidate (block 0) for k = 2
    assert blocks.tolist() == [[0, 1]] and ok.tolist() == [[True, False]]
    q, w, bk = torch.randn(3, 2, 4), torch.rand(3, 2), torch.randn(6, 4)
    s = block_scores(q, w, bk)
    ref = torch.stack([sum(w[t, j] * torch.relu(q[t, j] @ bk.t()) for j in range(2)) for t in range(3)]) / 2.0
    assert torch.allclose(s, ref, atol=1e-6)
    probs = torch.softmax(torch.randn(1, 10), -1)  # one row at position 9 over 10 keys, blocks of 2, window 2
    mass = block_attention_mass(probs, torch.tensor([9]), 5, cfg)
    assert torch.allclose(mass[0, :4].sum(), torch.tensor(1.0)) and mass[0, 4] == 0  # block 4 starts in the window
    assert torch.allclose(mass[0, 0] / mass[0, 1], probs[0, :2].sum() / probs[0, 2:4].sum())


def run(model, prompt, drafter, k, n=60, params=SamplingParams(), **opts):
    return generate_tokens(model, prompt, make_drafter(drafter, model, **opts), k, Sampler(params, 0), n)


PROMPTS = [list(range(16)) * 4 + [3, 1, 4], [int(x) for x in torch.randint(0, V, (90,), generator=torch.Generator().manual_seed(4))]]


@pytest.mark.parametrize("select", ["reuse", "recompute", "full"])
def test_sparse_target_and_mtp_greedy_identical_to_plain(select):
    """fp32: a target whose full-attention layers are sparse, drafted by its sparse MTP, emits plain greedy's tokens."""
    m = build(FEW, FEW, torch.float32)
    accepted = 0
    for prompt in PROMPTS:
        ref = run(m, prompt, "none", 1).tokens
        for k in (1, 4):
            r = run(m, prompt, "mtp", k, sparse_select=select)
            assert r.tokens == ref, f"k={k} {select}"
            accepted += r.stats.accepted_tokens
    assert accepted > 0


@pytest.mark.slow  # ~20 s: 400 seeded runs
def test_sparse_mtp_sampling_matches_plain_distribution():
    """Sampling with the sparse MTP drafting keeps the target's distribution: over many seeds the first and the second
    sampled tokens' frequencies match the target's exact probabilities (chi-square; the second token's marginal is
    sum over t1 of p(t1) p(t2 | t1), 16 forwards)."""
    m = build(FEW, FEW, torch.float32)
    prompt = PROMPTS[1][:40]  # past window + top_k blocks (20 tokens): the draft rows attend sparsely
    params = SamplingParams(temperature=1.0)
    with torch.no_grad():
        p1 = torch.softmax(m.forward_tokens(torch.tensor(prompt), m.new_cache()).logits[-1].double(), -1)  # (V,)
        p2 = sum(p1[t] * torch.softmax(m.forward_tokens(torch.tensor(prompt + [t]), m.new_cache()).logits[-1].double(), -1)
                 for t in range(V))
    n = 400
    counts = torch.zeros(2, V, dtype=torch.float64)
    for seed in range(n):
        r = generate_tokens(m, prompt, make_drafter("mtp", m), 3, Sampler(params, seed), 2)
        counts[0, r.tokens[0]] += 1
        counts[1, r.tokens[1]] += 1
    for c, p in zip(counts, (p1, p2)):
        keep = p * n >= 5
        obs = torch.cat([c[keep], c[~keep].sum()[None]])
        exp = torch.cat([p[keep] * n, (p[~keep] * n).sum()[None]])
        chi2 = float(((obs - exp) ** 2 / exp.clamp_min(1e-9)).sum())
        assert chi2 < 40.0, chi2  # df <= 16: p ~ 1e-3 at 40


def test_reused_selection_is_the_last_accepted_tokens():
    """Partial acceptance at every position: the blocks a round reuses are exactly those a fresh drafter, prefilled on
    the accepted tokens alone, chooses for its first draft row (and anchored at that row), never a rejected row's."""
    m = build(FEW, FEW, torch.float32)
    prompt = PROMPTS[1]
    d = make_drafter("mtp", m, sparse_select="reuse")
    session = Session(m, prompt, d, Sampler(SamplingParams()), max_new_tokens=80)
    counts = set()
    checked = 0
    while not session.done:
        session.prefill()
        context = session.context.tolist()
        rec = session.step(4)
        kept = d.cache.sparse.kept
        if not rec.draft:
            continue
        counts.add(rec.num_accepted)
        fresh = make_drafter("mtp", m)
        cache = m.new_cache()
        out = m.forward_tokens(torch.tensor(context[:-1]), cache)
        fresh.prefill(torch.tensor(context), out, Sampler(SamplingParams()))
        fresh._mtp(fresh.pending_h, fresh.pending_t, 0, sparse="record")
        for layer, sel in fresh.cache.sparse.kept.items():
            assert kept[layer].anchor == sel.anchor == len(context) - 2  # the pair (h of t_{L-2}, t_{L-1} the last accepted)
            assert torch.equal(kept[layer].blocks[kept[layer].ok], sel.blocks[sel.ok])
        checked += 1
    assert checked > 5 and {0, 1, 2} <= counts, counts  # rejections at several positions, not only full acceptance


def test_reuse_refused_past_its_reach_and_trees_refused():
    m = build(FEW, FEW, torch.float32)
    with pytest.raises(ConfigError, match="tree"):
        make_drafter("mtp", m, tree=8)
    with pytest.raises(ConfigError, match="sparse_select"):
        make_drafter("mtp", m, sparse_select="sometimes")
    assert isinstance(m.new_mtp_cache().sparse, SparseState) and m.new_cache().kv.sparse is None  # the target never reuses


def test_checkpoint_formats_keep_the_sparse_mtp(tmp_path):
    """Our format and the Hugging Face export keep the config and the indexer tensors; a bad sparse config is named;
    formats that cannot express it refuse (transformers for sparse target layers, llama.cpp for any indexer)."""
    import json

    from pathlib import Path

    import mtpspec
    from mtpspec.export import export_hf
    from mtpspec.loading.tokenizer_hf import HFTokenizer
    from mtpspec.export_gguf import export_gguf
    from mtpspec.errors import ModelLoadError
    from mtpspec.loading import load_module
    from mtpspec.loading.native import save_checkpoint

    m = build(None, FEW, torch.float32)
    for d, write in ((tmp_path / "native", lambda d: save_checkpoint(m, None, d)), (tmp_path / "hf", lambda d: export_hf(m, d))):
        write(d)
        back = load_module(d)
        assert back.config.mtp_sparse_attention == FEW and back.config.sparse_attention is None
        sd, sd2 = m.state_dict(), back.state_dict()
        assert set(sd) == set(sd2) and all(torch.equal(sd[k], sd2[k]) for k in sd)
        assert any(".indexer." in k for k in sd2)
    meta = json.loads((tmp_path / "native" / "mtpspec.json").read_text())
    meta["config"]["mtp_sparse_attention"]["window"] = 2  # smaller than a block
    (tmp_path / "native" / "mtpspec.json").write_text(json.dumps(meta))
    with pytest.raises(ModelLoadError, match="window"):
        load_module(tmp_path / "native")
    with pytest.raises(ConfigError, match="transformers"):
        export_hf(build(FEW, None, torch.float32), tmp_path / "hf2")
    with pytest.raises(ConfigError, match="indexer"):
        export_gguf(m, HFTokenizer.load(Path(mtpspec.__file__).parent.parent / "models" / "demo" / "tokenizer.json"), tmp_path / "m.gguf")


def test_sparse_target_in_a_batch_equals_separate_runs():
    """A batch of sequences on a sparse target (each verified in its own forward) gives each one's separate output."""
    from mtpspec.engine import Engine

    m = build(FEW, FEW, torch.float32)
    prompts = [PROMPTS[0], PROMPTS[1], PROMPTS[1][:30]]
    want = [run(m, p, "none", 1, n=24).tokens for p in prompts]
    engine = Engine(m, max_batch=3)
    ids = [engine.add(p, make_drafter("mtp", m), Sampler(SamplingParams()), k=3, max_new_tokens=24) for p in prompts]
    results = engine.run()
    assert [results[i].tokens for i in ids] == want


def test_sparse_select_needs_a_sparse_mtp():
    with pytest.raises(ConfigError, match="sparse-select"):
        make_drafter("mtp", build(None, None, torch.float32), sparse_select="reuse")


def test_full_select_is_the_dense_module():
    """sparse_select='full' drafts exactly as the same weights without an indexer (a dense MTP) would."""
    sparse, dense = build(FEW, FEW, torch.float64), build(FEW, None, torch.float64)
    dense.load_state_dict(sparse.state_dict(), strict=False)
    prompt = PROMPTS[1]
    for fused in (True, False):
        a = make_drafter("mtp", sparse, sparse_select="full")
        b = make_drafter("mtp", dense)
        a.fused = a.fused if fused else None
        b.fused = b.fused if fused else None
        outs = []
        for d in (a, b):
            out = sparse.forward_tokens(torch.tensor(prompt[:-1]), sparse.new_cache())
            d.prefill(torch.tensor(prompt), out, Sampler(SamplingParams()))
            outs.append(d._mtp(d.pending_h, d.pending_t, 0))
        assert (outs[0] - outs[1]).abs().max() <= 1e-12 * scale(outs[1])


def test_reused_blocks_gathered_once_equal_per_row_gathering():
    """attend_reused (the kept blocks gathered once per round, shared by the rows) computes what gathering them for
    every row computes, and dense_attend what choosing every block computes (fp64)."""
    from mtpspec.models.sparse_attention import IndexKeys, Selection, attend_gathered, attend_reused, dense_attend

    g = torch.Generator().manual_seed(7)
    cfg = SparseAttentionConfig(block=4, top_k=5, window=8, heads=1, dim=2)
    k, v = torch.randn(2, 120, 16, generator=g, dtype=torch.float64), torch.randn(2, 120, 16, generator=g, dtype=torch.float64)
    q = torch.randn(3, 4, 16, generator=g, dtype=torch.float64)
    blocks, ok = torch.tensor([3, 17, 9, 0, 20]), torch.tensor([True, True, True, False, True])
    anchor, pos = 99, torch.arange(100, 103)
    kept = Selection(blocks, ok, anchor)
    scratch = IndexKeys(1, 120, cfg, torch.float64)
    lo = torch.full((3,), anchor - cfg.window + 1)
    want = attend_gathered(q, k, v, blocks.expand(3, -1), ok.expand(3, -1), pos, lo, cfg, 0.25, scratch)
    got = attend_reused(q, k, v, kept, pos, cfg, 0.25, scratch, 0)
    again = attend_reused(q, k, v, kept, pos, cfg, 0.25, scratch, 0)  # the second call reads kept.keys
    assert (got - want).abs().max() <= 1e-13 and torch.equal(got, again)
    every = torch.arange(30).expand(3, -1)  # every block of 120 keys
    want = attend_gathered(q, k, v, every, torch.ones(3, 30, dtype=torch.bool), pos, pos - cfg.window + 1,
                           SparseAttentionConfig(block=4, top_k=30, window=8, heads=1, dim=2), 0.25, scratch)
    assert (dense_attend(q, k, v, 100, 0.25) - want).abs().max() <= 1e-13

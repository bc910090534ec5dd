"""The batched engine: B sequences per target forward, each lossless and each rolled back on its own.

- Greedy: 8 sequences with different prompts, drafters and k, joining and leaving mid-run (4 slots for
  8 requests, different lengths, a cancellation) produce the tokens of 8 separate plain runs: on the
  demo hybrid (MTP), stories260K (draft model, EAGLE / MTP / Medusa heads, prompt lookup).
- Sampling: sequences sampled in one batch (each its own seed) follow the target's distribution.
- Rollback property (fp64, hybrid): random batched forwards with random accepted lengths per sequence
  leave every sequence's logits and state equal to one sequence fed its kept tokens alone.
- Batch invariance in exact mode (fp32, bf16; dense and hybrid): a request's tokens and the target's
  probabilities at each of its positions are bitwise the same alone, with drafts of any depth, and in a
  batch with other requests that carry drafts of their own.
"""

from __future__ import annotations

import math
import random

import pytest
import torch

import mtpspec
from mtpspec.batching import SlotKV, forward_batch, stack_rows
from mtpspec.drafters import make_drafter
from mtpspec.engine import Engine, Session, generate_tokens
from mtpspec.errors import ConfigError
from mtpspec.models.qwen35 import HybridConfig, HybridLM
from mtpspec.sampling import Sampler, SamplingParams
from mtpspec.loading import shipped_demo_dir
from qwen35_tiny import randomize
from test_sampling_exact import PARAMS, PROMPT, chi_square, exact_pairs

HEADS = shipped_demo_dir().parent / "heads"


def greedy() -> Sampler:
    return Sampler(SamplingParams(), 0)


def plain(module, prompt: list[int], n: int) -> list[int]:
    return generate_tokens(module, prompt, make_drafter("none", module), 1, greedy(), n).tokens


@pytest.fixture(scope="module")
def demo():
    return mtpspec.load("demo", threads=1)


def _run_batch(module, requests, max_batch: int, cancel_after: int | None = None):
    """requests: (prompt, drafter, k, n). Returns the engine's results in request order (the last one cancelled
    after `cancel_after` steps, when given)."""
    eng = Engine(module, max_batch=max_batch, prefill_chunk=5)
    ids = [eng.add(p, d, greedy(), k, n) for p, d, k, n in requests]
    steps = 0
    while eng.active:
        eng.step()
        steps += 1
        if cancel_after is not None and steps == cancel_after:
            eng.cancel(ids[-1])
    return [eng.finished[i].result() for i in ids]


def test_demo_batched_greedy_equals_separate_runs_with_joins_and_leaves(demo):
    m = demo.module
    texts = ["def add(a, b):", "import os\nimport sys\n", "class Foo:\n    def __init__(self):", "for i in range(10):",
             "# sort a list", "x = [1, 2, 3]\ny =", "def fib(n):\n    if n < 2:", "print('hello')"]
    setups = [("none", 1, 30), ("ngram", 3, 12), ("mtp", 2, 40), ("mtp", 4, 25), ("none", 1, 7), ("ngram", 2, 33),
              ("mtp", 3, 20), ("mtp", 1, 36)]
    prompts = [demo.encode(t) for t in texts]
    requests = [(p, make_drafter(d, m), k, n) for p, (d, k, n) in zip(prompts, setups)]
    results = _run_batch(m, requests, max_batch=4, cancel_after=9)
    for p, (d, k, n), r in zip(prompts[:-1], setups[:-1], results[:-1]):
        assert r.tokens == plain(m, p, n), (d, k)
    assert results[-1].finish_reason == "cancelled"
    assert results[-1].tokens == plain(m, prompts[-1], 36)[: len(results[-1].tokens)]
    drafted = [r.stats.draft_tokens for r in results[:-1]]
    assert all(x > 0 for (d, _, _), x in zip(setups, drafted) if d != "none")


def test_stories_batched_greedy_every_drafter(stories, stories_q80):
    m = stories.module
    prompts = [stories.encode(t) for t in ("Once upon a time", "The cat sat on the mat. The cat", "Lily and Tom went",
                                           "One day, a little bird", "Tim had a red ball. Tim", "The sun was", "", "Sam")]
    kinds = [("draft", 3), ("eagle", 4), ("mtp", 2), ("medusa", 3), ("ngram", 4), ("draft", 1), ("eagle", 2), ("none", 1)]

    def drafter(name):
        dm = stories_q80.module if name == "draft" else (str(HEADS / f"stories260K-{name}") if name in ("eagle", "mtp", "medusa") else None)
        return make_drafter(name, m, draft_model=dm)

    requests = [(p, drafter(d), k, 24 + 3 * i) for i, (p, (d, k)) in enumerate(zip(prompts, kinds))]
    for r, (p, _, _, n), (d, k) in zip(_run_batch(m, requests, max_batch=8), requests, kinds):
        assert r.tokens == plain(m, p, n), (d, k)


def test_batched_mtp_drafts_like_one_sequence(demo):
    """propose_batch drafts what propose drafts (the batch shares forwards, not decisions): same acceptance."""
    m = demo.module
    prompts = [demo.encode(t) for t in ("def add(a, b):", "import os\n", "class Foo:", "for i in range(3):")]
    alone = [generate_tokens(m, p, make_drafter("mtp", m), 3, greedy(), 32).stats.accepted_tokens for p in prompts]
    batched = [r.stats.accepted_tokens for r in _run_batch(m, [(p, make_drafter("mtp", m), 3, 32) for p in prompts], 4)]
    assert batched == alone


@torch.inference_mode()
@pytest.mark.parametrize("temperature", [0.0, 0.8])
@pytest.mark.parametrize("folded", [True, False])
def test_batched_mtp_drafts_each_sequence_as_alone(demo, temperature, folded):
    """A batch drafts with each product once over every sequence's rows and each attention on the sequence's own
    cache in place, through the folded copy (fused_mtp.py) or the module's own forward: per sequence the same drafts,
    q and MTP cache as its own propose(), from catch-ups of different lengths and to different depths."""
    from mtpspec.drafters.mtp import MTPDrafter

    m = demo.module
    texts = ("def add(a, b):", "import os\nimport sys\n", "class Foo:\n    def __init__(self):")
    contexts = [torch.tensor(demo.encode(t)) for t in texts]

    def ready() -> list[MTPDrafter]:
        ds = []
        for i, c in enumerate(contexts):
            d = MTPDrafter(m, fused=folded)
            out = m.forward_tokens(c[:-1], m.new_cache())
            d.prefill(c, out, Sampler(SamplingParams(temperature=temperature), i))
            d._queue(out.hidden[-1 - i :], c[-1 - i :])  # catch-ups of 1, 2 and 3 pairs more
            ds.append(d)
        return ds

    ks = [3, 1, 4]
    alone = ready()
    want = [d.propose(c, k) for d, c, k in zip(alone, contexts, ks)]
    batch = ready()
    got = MTPDrafter.propose_batch(batch, contexts, ks)
    for a, b, x, y in zip(want, got, alone, batch):
        assert b.tokens.tolist() == a.tokens.tolist()
        assert (a.q is None) == (b.q is None) == (temperature == 0.0)
        if a.q is not None:  # fp32 products over 1 row and over the batch's rows: rounding apart, the same q
            assert (a.q - b.q).abs().max().item() < 1e-5
        assert (y.cache.length, y.committed) == (x.cache.length, x.committed)
        n = x.cache.length
        assert (y.cache.k[:, :, :, :n] - x.cache.k[:, :, :, :n]).abs().max().item() < 1e-5


# Distribution tests of ngram (a point mass; the default suite) and the draft model (a q distribution; make test-slow, 14 s:
# q-drafters' distributions stay in the default suite through mtp's on the hybrid and medusa's) on real weights: both
# draft with their own propose() per sequence, as in a batch of one (only mtp has a propose_batch), and verify() is the
# one a batch of one runs; the single-sequence runs (test_sampling_exact.py, 50 s) are in make test-slow
@pytest.mark.parametrize("drafter", ["ngram", pytest.param("draft", marks=pytest.mark.slow)])
def test_batched_sampling_follows_the_target_distribution(stories, stories_q80, drafter):
    ids = stories.encode(PROMPT)
    exact = exact_pairs(stories, ids)
    n = 1200
    cfg = dict(drafter=drafter, k=2, temperature=PARAMS.temperature, top_p=PARAMS.top_p, max_new_tokens=2)
    dm = stories_q80 if drafter == "draft" else None
    results = stories.generate_batch([ids] * n, max_batch=16, draft_model=dm, seed=1000, **cfg)
    counts: dict[tuple[int, int], int] = {}
    for r in results:
        counts[tuple(r.tokens)] = counts.get(tuple(r.tokens), 0) + 1
    assert sum(r.stats.draft_tokens for r in results) > n // 2  # the drafter really proposed
    stat, df = chi_square(counts, exact, n)
    assert stat < df + 5 * math.sqrt(2 * df), (drafter, stat, df)


TINY = HybridConfig(
    vocab_size=64, hidden_size=32, num_layers=4, layer_types=("linear_attention", "linear_attention", "full_attention", "linear_attention"),
    num_heads=4, num_kv_heads=2, head_dim=16, intermediate_size=48, max_seq_len=96, rope_theta=10000.0,
    linear_key_head_dim=8, linear_value_head_dim=8, linear_num_key_heads=2, linear_num_value_heads=4, mtp_num_layers=1,
)


def tiny_hybrid(dtype) -> HybridLM:
    torch.manual_seed(0)
    m = HybridLM(TINY)
    randomize(m, seed=3)
    return m.to(dtype).eval()


@torch.inference_mode()
def test_per_sequence_rollback_property_fp64():
    """Random batched forwards (widths 1..6 per sequence; two of every four plain steps, width 1 for all: the
    one-position form, the second reading the first one's batched states in place, stack_rows), each sequence keeping a
    random prefix of its rows: every kept row's logits and each sequence's final state equal those of one sequence fed
    its kept tokens alone."""
    m = tiny_hybrid(torch.float64)
    rng = random.Random(0)
    b_n = 3
    caches = [m.new_cache() for _ in range(b_n)]
    storage = SlotKV(caches[0].kv, b_n)
    kept: list[list[int]] = [[rng.randrange(64)] for _ in range(b_n)]
    rows: list[list[torch.Tensor]] = [[] for _ in range(b_n)]
    for b, c in enumerate(caches):
        storage.bind(c.kv, b)
    for step in range(12):
        tokens = [torch.tensor([kept[b][-1]] + [rng.randrange(64) for _ in range(rng.randrange(6) if step % 4 < 2 else 0)])
                  for b in range(b_n)]
        starts = [c.length for c in caches]
        outs = forward_batch(m, storage, caches, tokens)
        for b in range(b_n):
            n = rng.randrange(1, tokens[b].shape[0] + 1)  # rows kept: the forwarded last token + n - 1 drafts
            caches[b].crop(starts[b] + n)
            rows[b].append(outs[b].logits[:n])
            kept[b] += tokens[b][1:n].tolist() + [rng.randrange(64)]  # the next step's first token is new
    for b in range(b_n):
        ref_cache = m.new_cache()
        seq = torch.tensor(kept[b][:-1])
        ref = m.forward_tokens(seq, ref_cache).logits  # (L, V) one sequence alone, one forward
        got = torch.cat(rows[b])
        scale = ref.abs().max()
        assert (got - ref).abs().max() <= 1e-10 * scale, b
        for i in range(caches[b].n_linear):
            s_ref, s_got = ref_cache.state(i), caches[b].state(i)
            assert (s_ref - s_got).abs().max() <= 1e-10 * s_ref.abs().max(), (b, i)


def test_stack_rows_is_a_view_only_of_rows_already_in_order():
    """Rows 0..n-1 of one tensor, in order: a view of it (no copy). Any other rows: a copy, equal to torch.cat."""
    whole = torch.arange(5 * 3 * 4, dtype=torch.float32).view(5, 3, 4)
    in_order = [whole[b : b + 1, :, 1:3] for b in range(4)]
    got = stack_rows(in_order)
    assert got.untyped_storage().data_ptr() == whole.untyped_storage().data_ptr()
    assert torch.equal(got, torch.cat(in_order))
    for rows in ([whole[b : b + 1] for b in (0, 2, 1)], [whole[b : b + 1] for b in (1, 2, 4)], [whole[:1], whole[1:2].clone()]):
        got = stack_rows(rows)  # out of order, a gap, another tensor
        assert got.untyped_storage().data_ptr() != whole.untyped_storage().data_ptr()
        assert torch.equal(got, torch.cat(rows))


def _probs_run(module, prompt, drafter: str, k: int, others: list[tuple[list[int], str, int]], n: int = 20):
    """The request `prompt` in exact mode, alone (others = []) or batched with others; its tokens and p_of_emitted."""
    eng = Engine(module, max_batch=1 + len(others), exact=True)
    sid = eng.add(prompt, make_drafter(drafter, module), greedy(), k, n, trace=True)
    for p, d, kk in others:
        eng.add(p, make_drafter(d, module), greedy(), kk, n + 5)
    r = eng.run()[sid]
    return r.tokens, [x for s in r.steps for x in s.p_of_emitted]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_exact_mode_is_batch_and_depth_invariant_hybrid(dtype):
    m = tiny_hybrid(dtype)
    g = torch.Generator().manual_seed(2)
    prompts = [torch.randint(0, 16, (n,), generator=g).tolist() for n in (9, 5, 14, 3)]
    ref = _probs_run(m, prompts[0], "none", 1, [])
    for drafter, k in (("mtp", 1), ("mtp", 4), ("ngram", 3)):
        assert _probs_run(m, prompts[0], drafter, k, []) == ref, (drafter, k)
        others = [(prompts[1], "mtp", 3), (prompts[2], "ngram", 5), (prompts[3], "none", 1)]
        assert _probs_run(m, prompts[0], drafter, k, others) == ref, (drafter, k, "batched")


@pytest.mark.parametrize("dtype", ["fp32", "bf16"])
def test_exact_mode_is_batch_and_depth_invariant_dense(assets, stories_q80, dtype):
    s = mtpspec.load(assets / "models" / "stories260K.bin", assets / "models" / "tok512.bin", dtype=dtype)
    m = s.module
    prompts = [s.encode(t) for t in ("Once upon a time", "The cat sat on the mat. The cat", "Lily")]
    ref = _probs_run(m, prompts[0], "none", 1, [])
    for drafter, k in (("ngram", 2), ("ngram", 6)):
        assert _probs_run(m, prompts[0], drafter, k, []) == ref, (drafter, k)
        assert _probs_run(m, prompts[0], drafter, k, [(prompts[1], "ngram", 4), (prompts[2], "none", 1)]) == ref, (drafter, k)


def test_exact_plain_equals_default_plain(demo):
    """Exact mode changes only how a multi-position pass is computed: plain decoding is the same function."""
    m = demo.module
    p = demo.encode("def add(a, b):")
    a = generate_tokens(m, p, make_drafter("none", m), 1, greedy(), 24, trace=True)
    b = generate_tokens(m, p, make_drafter("none", m), 1, greedy(), 24, trace=True, exact=True)
    assert a.tokens == b.tokens and [s.p_of_emitted for s in a.steps] == [s.p_of_emitted for s in b.steps]


def test_session_steps_by_hand(demo):
    m = demo.module
    p = demo.encode("import os\n")
    s = Session(m, p, make_drafter("mtp", m), greedy(), k=3, max_new_tokens=12)
    s.prefill()
    depths = [0, 3, 1, 2, 0, 3, 3, 3, 3, 3, 3, 3]
    for d in depths:
        if s.done:
            break
        rec = s.step(d)
        assert len(rec.draft) <= d
    assert s.done and s.finish().tokens == plain(m, p, 12)
    with pytest.raises(ConfigError, match="finished"):
        s.step()


def test_engine_errors(demo):
    m = demo.module
    with pytest.raises(ConfigError, match="max batch"):
        Engine(m, max_batch=0)
    eng = Engine(m, max_batch=2)
    with pytest.raises(ConfigError, match="k"):
        eng.add([1, 2], make_drafter("none", m), greedy(), 0, 4)
    with pytest.raises(ConfigError, match="longer than the model's context"):
        eng.add([1] * (m.max_seq_len + 1), make_drafter("none", m), greedy(), 1, 4)
    with pytest.raises(ConfigError, match="prompts"):
        demo.generate_batch([])


def _random_tree(rng: random.Random, n: int) -> list[int]:
    """Node parents (-1: the root) of a random tree of n nodes, each node after its parent."""
    return [rng.randrange(-1, i) for i in range(n)]


@pytest.mark.parametrize("kind", ["hybrid", "dense-window"])
@torch.inference_mode()
def test_batched_trees_equal_each_sequence_alone_fp64(kind):
    """Token trees and chains of different sizes in one batched forward (ForwardBatch.many with trees): every row's
    logits equal the sequence's own tree forward, and after keeping a random root-to-node path (keep + crop) each
    cache continues exactly as one sequence fed that path alone (fp64, 1e-10 of the scale)."""
    from mtpspec.models.dense import DenseConfig, DenseLM
    from mtpspec.models.batch import TreeLayout
    from mtpspec.tree import kept_rows
    from mtpspec.types import Verdict

    if kind == "hybrid":
        m = tiny_hybrid(torch.float64)
    else:
        torch.manual_seed(0)
        m = DenseLM(DenseConfig(vocab_size=64, hidden_size=32, num_layers=2, num_heads=4, num_kv_heads=2,
                                intermediate_size=48, max_seq_len=96, layer_windows=(5, 0))).to(torch.float64).eval()
    rng = random.Random(1)
    b_n = 4
    caches, alone = [m.new_cache() for _ in range(b_n)], [m.new_cache() for _ in range(b_n)]
    storage = SlotKV(caches[0].kv, b_n)
    for b in range(b_n):
        prompt = torch.tensor([rng.randrange(64) for _ in range(6 + 3 * b)])
        m.forward_tokens(prompt, caches[b], prefill=True)
        m.forward_tokens(prompt, alone[b], prefill=True)
        storage.bind(caches[b].kv, b)
    for step in range(6):
        tokens, layouts, parents = [], [], []
        for b in range(b_n):
            n = rng.randrange(0, 8)
            tree = b % 2 == 0 or step % 3 == 0
            par = _random_tree(rng, n) if tree else list(range(-1, n - 1))
            tokens.append(torch.tensor([rng.randrange(64) for _ in range(n + 1)]))
            parents.append(par)
            layouts.append(TreeLayout.of(torch.tensor(par, dtype=torch.long)) if tree else None)
        starts = [c.length for c in caches]
        outs = forward_batch(m, storage, caches, tokens, layouts)
        for b in range(b_n):
            ref = m.forward_tokens(tokens[b], alone[b], tree=TreeLayout.of(torch.tensor(parents[b], dtype=torch.long)))
            scale = ref.logits.abs().max()
            assert (outs[b].logits - ref.logits).abs().max() <= 1e-10 * scale, (step, b)
            node, path = rng.randrange(-1, len(parents[b])), []  # keep the path to a random node (-1: the root alone)
            while node >= 0:
                path.insert(0, node + 1)
                node = parents[b][node]
            rows = kept_rows(Verdict(len(path), torch.zeros(len(path) + 1, dtype=torch.long), len(parents[b]), tuple(path)))
            for c in (caches[b], alone[b]):
                c.keep(starts[b], rows)
                c.crop(starts[b] + len(rows))
    for b in range(b_n):  # the same continuation after all that
        nxt = torch.tensor([rng.randrange(64) for _ in range(3)])
        got, want = m.forward_tokens(nxt, caches[b]).logits, m.forward_tokens(nxt, alone[b]).logits
        assert (got - want).abs().max() <= 1e-10 * want.abs().max(), b

"""The written-down interfaces: every registered drafter is a Drafter, HybridLM (with an MTP module) and
AttachedHead are MTPSources, drafter options are typed dataclasses, and acceptance is counted in one
place (metrics.Acceptance) with one mean accepted length, which train/evaluate.py and train/heads.py report too."""

from __future__ import annotations

import pytest
import torch

from mtpspec.drafters import (
    OPTION_CLASSES, OPTION_TYPES, OPTIONS, REGISTRY, BatchDrafter, Drafter, EagleOptions, MTPOptions, MTPSource,
    NgramOptions, check_options, for_drafter, make_drafter, options_for,
)
from mtpspec.engine import generate_tokens
from mtpspec.errors import ConfigError
from mtpspec.metrics import Acceptance, Metrics, mean_accepted_length
from mtpspec.models.heads import AttachedHead, DraftHead, DraftHeadConfig
from mtpspec.models.qwen35 import HybridConfig, HybridLM
from mtpspec.sampling import Sampler, SamplingParams
from mtpspec.types import StepRecord
from qwen35_tiny import randomize, tiny_hybrid

V = 16
CFG = HybridConfig(
    vocab_size=V, hidden_size=32, num_layers=2, layer_types=("linear_attention", "full_attention"),
    num_heads=4, num_kv_heads=2, head_dim=16, intermediate_size=48, max_seq_len=128, linear_key_head_dim=8,
    linear_value_head_dim=8, linear_num_key_heads=2, linear_num_value_heads=4, mtp_num_layers=1, tie_embeddings=False,
)
PROMPT = [1, 4, 1, 5, 9, 2, 6, 1, 4, 1]


def _model(mtp_layers: int) -> HybridLM:
    return tiny_hybrid(CFG, mtp_layers, 3)


@pytest.fixture(scope="module")
def target() -> HybridLM:
    return _model(1)


@pytest.fixture(scope="module")
def heads() -> dict[str, DraftHead]:
    out = {}
    for kind in ("mtp", "eagle", "medusa", "eagle3"):
        torch.manual_seed(1)
        h = DraftHead(DraftHeadConfig(kind=kind, hidden_size=32, vocab_size=V, max_seq_len=128, num_heads=2,
                                      num_kv_heads=2, head_dim=16, intermediate_size=32, num_medusa=3,
                                      aux_layers=(0, 1, 1) if kind == "eagle3" else ()))
        randomize(h, 1)
        out[kind] = h.eval()
    return out


# --- protocols --------------------------------------------------------------------------------------


def test_hybrid_with_mtp_and_attached_heads_are_mtp_sources(target, heads):
    assert isinstance(target, MTPSource) and target.mtp is not None
    bare = _model(0)
    for kind in ("mtp", "eagle", "eagle3"):
        src = AttachedHead(bare, heads[kind])
        assert isinstance(src, MTPSource)
        assert src.config.mtp_num_layers == 1 and src.vocab_size == V and src.lm_head is bare.lm_head
    assert not isinstance(heads["mtp"], MTPSource)  # the bare head has no embedding / LM head of its own


def test_every_registered_drafter_is_a_drafter(target, heads):
    draft = _model(0)  # a causal LM as the draft model
    given = {"none": None, "ngram": None, "lookahead": None, "suffix": None, "draft": draft, "mtp": None, "eagle": heads["eagle"],
             "medusa": heads["medusa"], "eagle3": heads["eagle3"]}
    assert set(REGISTRY) == set(given)
    for name in REGISTRY:
        d = make_drafter(name, target, draft_model=given[name])
        assert isinstance(d, Drafter) and d.name == name
        assert isinstance(d, BatchDrafter) == hasattr(type(d), "propose_batch")  # else the engine drafts per sequence
        r = generate_tokens(target, PROMPT, d, 3, Sampler(SamplingParams()), 12)
        assert len(r.tokens) == 12
        assert d.prefill_logits is (name == "lookahead")  # only lookahead's Jacobi pool reads the prompt's logits


def test_the_prefill_runs_the_lm_head_only_for_a_drafter_that_reads_it(target, monkeypatch):
    """A prefill's logits are (T, V) over every prompt row, and only lookahead reads them: for the others the target
    skips its LM head over the prompt (logits None), and the output is unchanged."""
    heads = []
    head = type(target).head
    monkeypatch.setattr(type(target), "head", lambda self, h: heads.append(h.shape[0]) or head(self, h))
    runs, prompt_rows = {}, len(PROMPT) - 1
    for name in ("mtp", "ngram", "lookahead"):
        heads.clear()
        runs[name] = generate_tokens(target, PROMPT, make_drafter(name, target), 3, Sampler(SamplingParams()), 12).tokens
        assert (prompt_rows in heads) is (name == "lookahead"), (name, heads)
    assert runs["mtp"] == runs["ngram"] == runs["lookahead"]


@pytest.mark.parametrize("kind", ["hybrid", "dense"])
def test_forward_tokens_without_logits_keeps_the_hidden_states(kind):
    from mtpspec.models.dense import DenseConfig, DenseLM

    torch.manual_seed(0)
    m = _model(0) if kind == "hybrid" else DenseLM(DenseConfig(vocab_size=V, hidden_size=32, num_layers=2, num_heads=4,
                                                                num_kv_heads=2, intermediate_size=48, max_seq_len=64)).eval()
    toks = torch.tensor(PROMPT)
    a, b = m.new_cache(), m.new_cache()
    full, bare = m.forward_tokens(toks, a, prefill=True), m.forward_tokens(toks, b, logits=False, prefill=True)
    assert bare.logits is None and torch.equal(bare.hidden, full.hidden) and a.length == b.length == len(PROMPT)
    with torch.inference_mode():
        assert torch.equal(m.head(bare.hidden), full.logits)


# --- typed options ----------------------------------------------------------------------------------


def test_options_are_frozen_typed_dataclasses():
    assert OPTION_CLASSES["ngram"] is NgramOptions and OPTIONS["mtp"] == ("draft_vocab", "mtp_prenorm_hidden", "tree", "tree_beam", "sparse_select", "mtp_lookup")
    assert OPTION_TYPES["ngram_max"] == ("--ngram-max", int) and OPTION_TYPES["mtp_prenorm_hidden"][1] is bool
    o = NgramOptions(2, 4)
    with pytest.raises(AttributeError):
        o.n_min = 3  # frozen
    assert options_for("ngram", {"ngram_min": 2, "ngram_max": None}) == NgramOptions(n_min=2, n_max=3)
    assert options_for("mtp", {"mtp_prenorm_hidden": True, "draft_vocab": 0}) == MTPOptions(draft_vocab=0, prenorm_hidden=True)
    assert check_options("eagle", {"draft_vocab": 64, "ngram_min": None}) == {"draft_vocab": 64}
    assert for_drafter({"drafter": "ngram", "draft_vocab": 64, "ngram_max": 2, "draft_model": "x", "k": 3}) == {
        "drafter": "ngram", "ngram_max": 2, "k": 3}


@pytest.mark.parametrize("make, message", [
    (lambda: NgramOptions(n_min="2"), "--ngram-min must be an integer, got '2'"),
    (lambda: NgramOptions(n_max=2.0), "--ngram-max must be an integer, got 2.0"),
    (lambda: NgramOptions(n_max=True), "--ngram-max must be an integer, got True"),
    (lambda: NgramOptions(3, 2), "1 <= n_min <= n_max"),
    (lambda: MTPOptions(prenorm_hidden=1), "mtp_prenorm_hidden must be true or false, got 1"),
    (lambda: EagleOptions(draft_vocab="64"), "--draft-vocab must be an integer"),
    (lambda: options_for("ngram", {"ngram_mx": 3}), "unknown drafter option 'ngram_mx' (did you mean 'ngram_max'?)"),
    (lambda: options_for("none", {"draft_vocab": 8}), "--draft-vocab is not used by --drafter none"),
    (lambda: options_for("eagle", {"mtp_prenorm_hidden": True}), "mtp_prenorm_hidden is not used by --drafter eagle"),
])
def test_options_errors_name_the_flag(make, message):
    with pytest.raises(ConfigError) as e:
        make()
    assert message in str(e.value)


def test_make_drafter_takes_an_options_object(target):
    d = make_drafter("ngram", target, options=NgramOptions(n_min=2, n_max=5))
    assert (d.n_min, d.n_max) == (2, 5)
    assert make_drafter("mtp", target, options=MTPOptions(prenorm_hidden=True)).prenorm
    assert make_drafter("ngram", target, options=NgramOptions(2, 2), ngram_max=None).n_max == 2  # unset keywords are fine
    with pytest.raises(ConfigError, match="--drafter mtp takes MTPOptions, got NgramOptions"):
        make_drafter("mtp", target, options=NgramOptions())
    with pytest.raises(ConfigError, match="drafter options given twice"):
        make_drafter("ngram", target, options=NgramOptions(), ngram_max=4)
    with pytest.raises(ConfigError, match="did you mean 'ngram_min'"):
        make_drafter("ngram", target, options=NgramOptions(), ngram_mn=None)


# --- acceptance: one counter, one mean accepted length -----------------------------------------------


def _step(drafted: int, accepted: int) -> StepRecord:
    return StepRecord(draft=list(range(drafted)), num_accepted=accepted, emitted=[0] * (accepted + 1),
                      draft_seconds=0.0, verify_seconds=0.0)


def test_acceptance_by_position_and_mean_accepted_length():
    # (drafted, accepted): checked positions are 1..min(accepted + 1, drafted)
    steps = [(3, 3), (3, 0), (3, 1), (0, 0), (2, 2), (4, 1)]
    a = Acceptance.from_steps(_step(d, n) for d, n in steps)
    assert (a.forwards, a.drafted, a.accepted) == (6, 15, 7)
    assert a.reached == [5, 4, 1, 0] and a.passed == [4, 2, 1, 0]
    assert a.by_position() == [4 / 5, 2 / 4, 1.0, None]  # position 4: drafted once, never reached
    assert a.by_position(2) == [4 / 5, 2 / 4] and a.by_position(5)[3:] == [None, None]
    assert a.mean_accepted_length == mean_accepted_length(7, 6) == 1 + 7 / 6
    assert a.draft_acceptance == 7 / 15
    b = Acceptance()
    for d, n in steps[:3]:
        b.observe(d, n)
    c = Acceptance.from_steps(_step(d, n) for d, n in steps[3:])
    assert b + c == a and sum([b, c], Acceptance()) == a
    assert Acceptance().mean_accepted_length == 0.0 and Acceptance().by_position(2) == [None, None]
    with pytest.raises(ValueError):
        b.observe(2, 3)


def test_metrics_reports_the_counter():
    m = Metrics(4)
    for d, n in [(3, 3), (3, 0), (3, 1), (0, 0)]:
        m.observe(d, n, 0.0, 0.0)
    s = m.finish(9)
    assert (s.target_forwards, s.draft_tokens, s.accepted_tokens) == (4, 9, 4)
    assert s.mean_accepted_length == 2.0
    assert s.acceptance_by_position == [2 / 3, 1 / 2, 1.0, 0.0]  # sized k; never reached reads 0.0


def test_generation_stats_match_the_steps(stories):
    """A stop token cuts the last step: mean accepted length still counts what verification kept."""
    r = stories.generate("Lily and Tom", drafter="ngram", k=3, max_new_tokens=256)
    assert r.finish_reason == "stop" and r.stats.accepted_tokens > 0
    a = Acceptance.from_steps(r.steps)
    assert a.mean_accepted_length == r.stats.mean_accepted_length > len(r.tokens) / r.stats.target_forwards
    assert [0.0 if x is None else x for x in a.by_position(3)] == r.stats.acceptance_by_position
    assert (a.forwards, a.drafted, a.accepted) == (r.stats.target_forwards, r.stats.draft_tokens, r.stats.accepted_tokens)


def test_train_measurements_use_the_same_definition(stories):
    """train/evaluate.py's table and train/heads.py's measure report metrics' mean accepted length for the same runs."""
    from mtpspec.train.evaluate import measure_table
    from mtpspec.train.heads import measure

    prompts = ["The little dog", "Lily and Tom"]
    n = 256  # both stop early: emitted / forwards is lower than 1 + accepted / forwards
    rows = measure_table(stories, prompts, [("ngram", 3, None)], max_new_tokens=n)
    runs = [stories.generate(p, drafter="ngram", k=3, max_new_tokens=n) for p in prompts]
    total = sum((Acceptance.from_steps(r.steps) for r in runs), Acceptance())
    fwd, acc = sum(r.stats.target_forwards for r in runs), sum(r.stats.accepted_tokens for r in runs)
    assert sum(len(r.tokens) for r in runs) / fwd < mean_accepted_length(acc, fwd)
    assert rows[1].mean_accepted_length == pytest.approx(mean_accepted_length(acc, fwd)) == pytest.approx(total.mean_accepted_length)
    assert rows[1].acceptance_by_position == total.by_position(3)
    assert rows[0].mean_accepted_length == 1.0 and rows[0].acceptance_by_position == []
    n = 64  # measure runs without stop tokens: 64 tokens give every position an acceptance rate
    m = measure(stories.module, stories.tokenizer, None, prompts, 3, n, drafter="ngram")
    runs = [generate_tokens(stories.module, stories.tokenizer.encode(p), make_drafter("ngram", stories.module), 3,
                            Sampler(SamplingParams()), n) for p in prompts]
    total = sum((Acceptance.from_steps(r.steps) for r in runs), Acceptance())
    assert m["mean_accepted_length"] == round(total.mean_accepted_length, 3)
    assert m["acceptance_by_position"] == [None if x is None else round(x, 3) for x in total.by_position(3)]

"""--mtp-lookup N: the MTP drafter takes a prompt-lookup draft where the context's last N tokens recur, and its
module's state waits as after a plain step. Lossless like every drafter: greedy token-identical to plain (one and
two MTP layers, alone and in a batch, on the tiny hybrid and the demo), sampled output the target's distribution."""

from __future__ import annotations

import pytest
import torch

import mtpspec
from mtpspec.bench.cli import drafter_specs
from mtpspec.drafters import make_drafter
from mtpspec.engine import Engine, generate_tokens
from mtpspec.errors import ConfigError
from mtpspec.models.qwen35 import HybridLM
from mtpspec.sampling import Sampler, SamplingParams
from qwen35_tiny import tiny_hybrid
from test_mtp_lossless import CFG, PROMPTS, V, _chi_square_ok, _exact_two_token_distribution

N = 48


def _model(layers: int) -> HybridLM:
    return tiny_hybrid(CFG, layers, 5)


@pytest.fixture(scope="module")
def models():
    return {1: _model(1), 2: _model(2)}


def counted(drafter):
    """The drafter, counting its rounds: [lookup drafts, module drafts]."""
    rounds = [0, 0]
    looked_up, propose = drafter._looked_up, drafter.propose

    def lookup(context, k):
        d = looked_up(context, k)
        rounds[0] += d is not None
        return d

    def propose_counted(context, k):
        before = rounds[0]
        d = propose(context, k)
        rounds[1] += rounds[0] == before and d.size > 0
        return d

    drafter._looked_up, drafter.propose = lookup, propose_counted
    return drafter, rounds


@pytest.mark.parametrize("layers, lookup, k", [(1, 2, 3), (1, 3, 1), (1, 2, 6), (2, 2, 3)])
def test_greedy_identical_to_plain_with_both_kinds_of_round(models, layers, lookup, k):
    model, totals = models[layers], [0, 0]
    for prompt in PROMPTS:
        ref = generate_tokens(model, prompt, make_drafter("none", model), 1, Sampler(SamplingParams()), N).tokens
        d, rounds = counted(make_drafter("mtp", model, mtp_lookup=lookup))
        r = generate_tokens(model, prompt, d, k, Sampler(SamplingParams()), N)
        assert r.tokens == ref, f"mtp_lookup={lookup} k={k} differs on prompt {prompt}"
        totals = [a + b for a, b in zip(totals, rounds)]
    assert totals[0] > 0 and totals[1] > 0  # lookup rounds and module rounds both ran, one after the other


def test_a_batch_mixing_lookup_and_module_rounds_equals_plain(models):
    model = models[1]
    refs = [generate_tokens(model, p, make_drafter("none", model), 1, Sampler(SamplingParams()), N).tokens for p in PROMPTS]
    engine = Engine(model, max_batch=len(PROMPTS))
    ids = [engine.add(p, make_drafter("mtp", model, mtp_lookup=2 if i % 2 else 0), Sampler(SamplingParams()), k=3,
                      max_new_tokens=N) for i, p in enumerate(PROMPTS)]
    out = engine.run()
    assert [out[i].tokens for i in ids] == refs


@pytest.mark.slow  # 16 s; the MTP drafter's distribution stays in the default suite (test_mtp_lossless.py)
def test_sampling_distribution_is_the_targets(models):
    model = models[1]
    params = SamplingParams(temperature=0.9, top_p=0.9)
    prompt = [2, 9, 4, 2, 9]  # "2 9" recurs: the first round drafts "4 2 9" by lookup
    joint = _exact_two_token_distribution(model, prompt, params)
    n_runs = 1000
    counts = torch.zeros(V, V)
    for seed in range(n_runs):
        r = generate_tokens(model, prompt, make_drafter("mtp", model, mtp_lookup=2), 2, Sampler(params, seed), 2)
        counts[r.tokens[0], r.tokens[1]] += 1
    ok, stat, df = _chi_square_ok(counts, joint, n_runs)
    assert ok, f"chi-square {stat:.1f} with {df} degrees of freedom"


def test_demo_greedy_identical_and_lookup_used():
    """Real weights: two Python prompts, D = 5, lookup of 4 tokens, alone and batched (the batched MTP forward serves
    the sequences that do not look up)."""
    model = mtpspec.load("demo", threads=1)
    prompts = ["def add(a, b):\n    return a + b\n\n\ndef sub(a, b):\n    return a - b\n\n\ndef mul(a, b):\n",
               "import os\n\n\nclass Path:\n    def __init__(self, path):\n        self.path = path\n\n    def join(self, other):\n"]
    refs = [model.generate(p, drafter="none", max_new_tokens=48).tokens for p in prompts]
    for p, ref in zip(prompts, refs):
        r = model.generate(p, drafter="mtp", k=5, max_new_tokens=48, mtp_lookup=4)
        assert r.tokens == ref
    batch = model.generate_batch(prompts, drafter="mtp", k=5, max_new_tokens=48, mtp_lookup=4)
    assert [r.tokens for r in batch] == refs
    d, rounds = counted(make_drafter("mtp", model.module, mtp_lookup=4))
    ids = model.encode(prompts[0])
    r = generate_tokens(model.module, ids, d, 5, Sampler(SamplingParams()), 48, tuple(model.tokenizer.stop_ids))
    assert r.tokens == refs[0] and rounds[0] > 0 and rounds[1] > 0


@pytest.mark.parametrize("value, message", [(1, "N >= 2"), (-2, "N >= 2"), (True, "must be an integer"), ("4", "must be an integer")])
def test_bad_lookup_is_a_clear_error(models, value, message):
    with pytest.raises(ConfigError, match=message):
        make_drafter("mtp", models[1], mtp_lookup=value)


def test_lookup_with_a_tree_or_another_drafter_is_refused(models):
    with pytest.raises(ConfigError, match="cannot be combined with --tree"):
        make_drafter("mtp", models[1], mtp_lookup=4, tree=8)
    with pytest.raises(ConfigError, match="--mtp-lookup is not used by --drafter ngram"):
        make_drafter("ngram", models[1], mtp_lookup=4)


def test_bench_drafter_specs():
    assert drafter_specs(["none", "mtp", "mtp+mtp_lookup=4", "mtp+mtp_lookup=3+draft_vocab=0"]) == [
        ("none", ()), ("mtp", ()), ("mtp", (("mtp_lookup", 4),)), ("mtp", (("mtp_lookup", 3), ("draft_vocab", 0)))]
    with pytest.raises(ConfigError, match="KEY=VALUE"):
        drafter_specs(["mtp+mtp_lookup"])
    with pytest.raises(ConfigError, match="did you mean 'mtp_lookup'"):
        drafter_specs(["mtp+mtp_lokup=4"])
    with pytest.raises(ConfigError, match="not used by --drafter ngram"):
        drafter_specs(["ngram+mtp_lookup=4"])


@pytest.mark.slow  # 25 s of graph compiles; test_compiled.py keeps the compiled paths in the default suite
def test_compiled_catch_ups_stay_within_the_compiled_widths():
    """With the compiled step (traced by dynamo's eager backend here), a round drafts with the module whenever one more
    lookup round would make its catch-up wider than the graphs: every module call stays compiled, output unchanged."""
    import torch._dynamo

    from mtpspec.models.compiled import compile_model

    torch._dynamo.reset()
    model = _model(1)
    ref = [generate_tokens(model, p, make_drafter("none", model), 1, Sampler(SamplingParams()), N).tokens for p in PROMPTS[1:4]]
    compile_model(model, max_width=5, backend="eager")
    widths, rounds = [], [0, 0]
    for prompt, want in zip(PROMPTS[1:4], ref):
        d, counts = counted(make_drafter("mtp", model, mtp_lookup=2))
        mtp, propose, calls = d._mtp, d.propose, []
        d.propose = lambda c, k, propose=propose, calls=calls: calls.append(k) or propose(c, k)
        # the module's calls after the first round (the prompt's own catch-up is as long as the prompt)
        d._mtp = lambda h, t, layer, *more, mtp=mtp, calls=calls, **kw: (len(calls) > 1 and widths.append(t.shape[0])) or mtp(h, t, layer, *more, **kw)
        assert generate_tokens(model, prompt, d, 3, Sampler(SamplingParams()), N).tokens == want
        rounds = [a + b for a, b in zip(rounds, counts)]
    assert rounds[0] > 0 and rounds[1] > 0 and widths and max(widths) <= 5
    d = make_drafter("mtp", model, mtp_lookup=2)  # the rule itself: pending pairs + the round's rows against 5
    ctx = torch.tensor([1, 2, 3, 1, 2])
    d.prefill(ctx, None, Sampler(SamplingParams()))
    h = torch.zeros(2, CFG.hidden_size)
    d.pending_h, d.pending_t = h[:1], torch.tensor([2])
    assert d._looked_up(ctx, 3).tokens.tolist() == [3, 1, 2]  # 1 pending + 4 rows: the lookup drafts
    d.pending_h, d.pending_t = h, torch.tensor([1, 2])
    assert d._looked_up(ctx, 3) is None  # 2 + 4 rows > 5: the module drafts (and catches up) this round

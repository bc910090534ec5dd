"""Sampling controls (repetition / frequency / presence penalties, min_p, logit_bias, banned ids, min_tokens) stay
lossless under every drafter: each verify row and each draft step is transformed with its own context.

- Greedy: ngram, mtp (chain and token tree) and the batched engine (3 sequences) give exactly plain greedy's
  tokens under each control, on the tiny hybrid of test_mtp_lossless.py; the control changes plain's output.
- Sampling: the first two tokens of mtp runs follow the exact joint distribution of plain sampling under each
  control (chi-square and total variation, as test_mtp_lossless.py's distribution test).
- The params are checked strictly; the transform itself matches a hand computation.
"""

from __future__ import annotations

import json

import pytest
import torch

from mtpspec.cli import main
from mtpspec.drafters import make_drafter
from mtpspec.engine import Engine, generate_tokens
from mtpspec.errors import ConfigError
from mtpspec.sampling import Sampler, SamplingParams
from test_mtp_lossless import V, OracleDrafter, _chi_square_ok, _exact_two_token_distribution, tiny_hybrid
from test_trees import RandomTree

PROMPTS = [[2, 9, 4, 2, 9, 4, 2, 9], [1, 4, 1, 5, 9, 2, 6], [7, 7, 7, 7]]
N = 24
STOP = 4  # a token plain greedy emits early after PROMPTS[0] (checked): min_tokens holds it back
CONTROLS = {
    "repetition": dict(repetition_penalty=1.8),
    "frequency": dict(frequency_penalty=1.5),
    "presence": dict(presence_penalty=2.0),
    "min_p": dict(min_p=0.3),
    "logit_bias": dict(logit_bias={3: 3.0, 9: -4.0, 11: 1.5}),
    "banned": dict(banned_ids=(2, 9)),
    "min_tokens": dict(min_tokens=12),
}


@pytest.fixture(scope="module")
def model():
    return tiny_hybrid()


def run(model, prompt, drafter, k, params, seed=0, n=N, stop=(STOP,), **opts):
    return generate_tokens(model, prompt, make_drafter(drafter, model, **opts), k, Sampler(params, seed), n, stop)


@pytest.mark.parametrize("control", list(CONTROLS))
def test_greedy_equals_plain_greedy_under_the_control(model, control):
    """ngram, mtp (chain, tree), and oracle chains and trees, alone and 3 to a batch (speculation_equals)."""
    params = SamplingParams(**CONTROLS[control])
    wants = [run(model, p, "none", 1, params).tokens for p in PROMPTS]
    if control != "min_p":  # (min_p never changes an argmax)
        assert wants[0] != run(model, PROMPTS[0], "none", 1, SamplingParams()).tokens, control
    speculation_equals(model, params, wants, control, (("ngram", 3, {}), ("mtp", 3, {}), ("mtp", 4, {"tree": 6}), ("mtp", 1, {})))


def speculation_equals(model, params: SamplingParams, wants: list[list[int]], label, chains) -> None:
    """Under `params`, each of PROMPTS gives `wants` with every drafter in `chains` ((name, k, options)), with oracle
    chains and random trees (the true continuation corrupted at random: every accept count occurs, so every row's context
    is read), and 3 to a batch."""
    oracles = lambda p, want, seed: [OracleDrafter(len(p), want + [0] * 8, seed), RandomTree(want + [0] * 8, len(p), V, seed)]  # noqa: E731
    accepted = 0
    for prompt, want in zip(PROMPTS, wants):
        for drafter, k, opts in chains:
            assert run(model, prompt, drafter, k, params, **opts).tokens == want, (label, drafter, opts, prompt)
        for seed in range(2):
            for d in oracles(prompt, want, seed):
                got = generate_tokens(model, prompt, d, 4, Sampler(params), N, (STOP,))
                assert got.tokens == want, (label, d.name, seed, prompt)
                accepted += got.stats.accepted_tokens
    assert accepted > sum(map(len, wants)) // 2  # the oracles' drafts were accepted: rows past the first were read
    eng = Engine(model, max_batch=3, prefill_chunk=4)
    drafters = [make_drafter("mtp", model), *oracles(PROMPTS[1], wants[1], 0)[:1], oracles(PROMPTS[2], wants[2], 1)[1]]
    ids = [eng.add(p, d, Sampler(params), 3, N, (STOP,)) for p, d in zip(PROMPTS, drafters)]
    res = eng.run()
    assert [res[i].tokens for i in ids] == wants, label


def test_min_tokens_holds_back_the_stop_token(model):
    free = run(model, PROMPTS[0], "none", 1, SamplingParams())
    assert free.finish_reason == "stop" and len(free.tokens) < 12
    held = run(model, PROMPTS[0], "mtp", 3, SamplingParams(min_tokens=12))
    assert len(held.tokens) >= 12 and STOP not in held.tokens[:12]


SAMPLED = {  # each control at T = 0.9 with top-p 0.95 (min_p alone: at 0.1 it drops about half the outcomes)
    **{c: {**kw, "temperature": 0.9, "top_p": 0.95} for c, kw in CONTROLS.items()},
    "min_p": dict(min_p=0.1, temperature=0.9),
    "min_tokens": dict(min_tokens=2, temperature=0.9),
}


def _distribution_ok(model, params, drafter, k, n_runs, **opts):
    prompt = [2, 9, 4, 2, 9]
    stop = (STOP,) if params.min_tokens >= 2 else ()  # (a stop token can come first only without min_tokens)
    joint = _exact_two_token_distribution(model, prompt, params, stop)
    counts = torch.zeros(V, V)
    for seed in range(n_runs):
        r = run(model, prompt, drafter, k, params, seed=seed, n=2, stop=stop, **opts)
        counts[r.tokens[0], r.tokens[1]] += 1
    ok, stat, df = _chi_square_ok(counts, joint, n_runs)
    assert ok, f"chi-square {stat:.1f} with {df} degrees of freedom"
    tv = 0.5 * (counts.double() / n_runs - joint).abs().sum().item()
    noise = 0.5 * (2 * joint * (1 - joint) / (torch.pi * n_runs)).sqrt().sum().item()  # E[TV] of exact sampling
    assert tv < 1.5 * noise, f"total variation {tv:.3f}, sampling noise alone gives ~{noise:.3f}"
    return joint


# the default suite keeps one control's distribution (a count penalty, which reads each row's own path); all seven run in
# make test-slow
@pytest.mark.parametrize("control", [c if c == "frequency" else pytest.param(c, marks=pytest.mark.slow)
                                     for c in SAMPLED])
def test_sampling_distribution_under_the_control(model, control):
    params = SamplingParams(**SAMPLED[control])
    joint = _distribution_ok(model, params, "mtp", 2, 600)
    plain = _exact_two_token_distribution(model, [2, 9, 4, 2, 9], SamplingParams(temperature=params.temperature, top_p=params.top_p))
    assert (joint - plain).abs().sum() > 0.05, "the control should change the distribution"


ALL = dict(repetition_penalty=1.4, frequency_penalty=0.7, presence_penalty=0.5, min_p=0.05, logit_bias={3: 2.0},
           banned_ids=(11,), min_tokens=2, temperature=1.0)


@pytest.mark.slow
@pytest.mark.parametrize("drafter, k, opts", [("ngram", 2, {}), ("mtp", 3, {"tree": 5})])
def test_sampling_distribution_with_every_control(model, drafter, k, opts):
    _distribution_ok(model, SamplingParams(**ALL), drafter, k, 1500, **opts)


def test_controlled_logits_by_hand():
    params = SamplingParams(temperature=1.0, repetition_penalty=2.0, frequency_penalty=0.5, presence_penalty=0.25,
                            logit_bias={1: 1.0}, banned_ids=(3,), min_tokens=2)
    s = Sampler(params).bind([1], stop_ids=(0,), vocab_size=4)
    s.advance([2])  # generated: one 2
    logits = torch.tensor([[1.0, 2.0, -1.0, 0.5], [1.0, 2.0, -1.0, 0.5]])
    got = s.logits(logits, [[], [2]])  # row 1 after one more 2: two generated, stops allowed
    inf = float("-inf")
    want = torch.tensor([[inf, 1.5, -2.0 - 0.75, inf], [1.0, 1.5, -2.0 - 1.0 - 0.25, inf]])
    assert torch.equal(got, want)
    assert torch.equal(s.logits(logits, torch.tensor([2])), want)  # a chain: row i after d[:i]
    with pytest.raises(ConfigError, match="leave no token"):
        Sampler(SamplingParams(banned_ids=(0, 1, 2, 3))).bind([1], (), 4).logits(logits)


def test_min_p_drops_the_unlikely():
    probs = Sampler(SamplingParams(temperature=1.0, min_p=0.5)).probs(torch.log(torch.tensor([0.5, 0.3, 0.2])))
    assert torch.allclose(probs, torch.tensor([0.625, 0.375, 0.0]))


def test_no_controls_is_the_same_sampler():
    s = Sampler(SamplingParams(temperature=0.7, top_k=3))
    assert s.bind([1, 2], (0,), 8) is s and not s.reads_context


@pytest.mark.parametrize("kw, msg", [
    (dict(repetition_penalty=0), "repetition penalty"), (dict(repetition_penalty=True), "repetition penalty must be a number"),
    (dict(frequency_penalty=2.5), r"frequency penalty must be in \[-2, 2\]"), (dict(presence_penalty=-3), "presence penalty"),
    (dict(min_p=1.5), r"min-p must be in \[0, 1\]"), (dict(min_p="0.1"), "min-p must be a number"),
    (dict(logit_bias={1: 200}), r"\[-100, 100\]"), (dict(logit_bias={-1: 1.0}), "logit bias token ids"),
    (dict(logit_bias={"1": 1.0}), "logit bias token ids"), (dict(logit_bias=[1, 2]), "logit bias must map"),
    (dict(banned_ids=(1.5,)), "banned token ids"), (dict(banned_ids=3), "banned ids must be a list"),
    (dict(min_tokens=-1), "min-tokens"), (dict(min_tokens=1.0), "min-tokens"),
])
def test_bad_params_are_one_clear_error(kw, msg):
    with pytest.raises(ConfigError, match=msg):
        SamplingParams(**kw)


def test_ids_outside_the_vocabulary(model):
    with pytest.raises(ConfigError, match=f"banned token id {V} is outside the model's vocabulary"):
        run(model, PROMPTS[0], "mtp", 2, SamplingParams(banned_ids=(V,)))
    with pytest.raises(ConfigError, match="logit bias token id 99"):
        run(model, PROMPTS[0], "none", 1, SamplingParams(logit_bias={99: 1.0}))


STORY = dict(repetition_penalty=1.3, frequency_penalty=0.8, presence_penalty=0.4, logit_bias={263: -3.0, 265: 2.0},
             banned_ids=(267,), min_tokens=30)


@pytest.mark.parametrize("drafter, opts", [("draft", {}), ("medusa", {}), ("eagle", {}), ("mtp", {"tree": 8}),
                                           ("draft", {"tree": 6}), ("medusa", {"tree": 8}), ("lookahead", {})])
def test_every_drafter_on_real_weights(stories, stories_q80, drafter, opts):
    """stories260K with its trained heads, its Q8_0 copy as the draft model: greedy equals plain greedy under every
    control at once; sampled runs are seeded (the same seed, the same tokens)."""
    dm = stories_q80.module if drafter == "draft" else (f"models/heads/stories260K-{drafter}" if drafter != "lookahead" else None)
    prompt = "Once upon a time, there was a little girl"
    want = stories.generate(prompt, max_new_tokens=40, **STORY)
    assert want.tokens != stories.generate(prompt, max_new_tokens=40).tokens
    got = stories.generate(prompt, max_new_tokens=40, drafter=drafter, draft_model=dm, k=4, **STORY, **opts)
    assert got.tokens == want.tokens and got.stats.accepted_tokens > 0
    sampled = [stories.generate(prompt, max_new_tokens=20, drafter=drafter, draft_model=dm, k=3, temperature=0.8, min_p=0.05,
                                seed=7, **STORY, **opts).tokens for _ in range(2)]
    assert sampled[0] == sampled[1] and 267 not in sampled[0]


def test_traces_read_the_controlled_rows(model):
    """A traced greedy step's target choices are the controlled argmaxes: the emitted tokens, row by row."""
    params = SamplingParams(**CONTROLS["frequency"])
    for opts in ({}, {"tree": 6}):
        res = generate_tokens(model, PROMPTS[0], make_drafter("mtp", model, **opts), 3, Sampler(params), N, (STOP,), trace=True)
        for s in res.steps:
            assert s.target_choice[: len(s.emitted)] == s.emitted


@pytest.mark.parametrize("flags, message", [
    (["--frequency-penalty", "3"], "frequency penalty must be in [-2, 2], got 3.0"),
    (["--repetition-penalty", "0"], "repetition penalty must be a finite number > 0"),
    (["--min-p", "2"], "min-p must be in [0, 1], got 2.0"),
    (["--logit-bias", "3=500"], "logit bias of token 3 must be in [-100, 100], got 500.0"),
    (["--logit-bias", "3"], "--logit-bias takes ID=BIAS pairs"),
    (["--ban", "1,x"], "--ban takes token ids"),
    (["--ban", "512"], "banned token id 512 is outside the model's vocabulary [0, 512)"),
    (["--min-tokens", "-2"], "min-tokens must be an integer >= 0"),
])
def test_cli_flags_are_checked(capsys, assets, flags, message):
    m = assets / "models"
    try:
        rc = main(["generate", "hi", "--model", str(m / "stories260K.bin"), "--tokenizer", str(m / "tok512.bin"), *flags])
    except SystemExit as e:  # argparse's own errors
        rc = e.code
    err = capsys.readouterr().err
    assert rc == 2 and message in err and "Traceback" not in err


def test_cli_runs_with_the_controls(capsys, assets, stories):
    m = assets / "models"
    flags = ["--repetition-penalty", "1.3", "--frequency-penalty", "0.8", "--presence-penalty", "0.4", "--logit-bias",
             "263=-3,265=2", "--ban", "267", "--min-tokens", "30"]
    assert main(["generate", "Once upon a time, there was a little girl", "--model", str(m / "stories260K.bin"), "--tokenizer",
                 str(m / "tok512.bin"), "--drafter", "ngram", "--max-new-tokens", "40", "--json", *flags]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["tokens"] == stories.generate("Once upon a time, there was a little girl", max_new_tokens=40, **STORY).tokens


def test_penalties_touch_only_the_tokens_present_bitwise_the_dense_rule():
    """The penalties change the gathered logits of the tokens present (prompt, generated, each row's path) and leave
    the rest: bitwise the whole-vocabulary rule, on random rows with chains and tree paths."""
    from mtpspec.sampling import History, controlled_logits

    g = torch.Generator().manual_seed(5)
    v = 5000
    prompt, generated = torch.randint(0, v, (40,), generator=g).tolist(), torch.randint(0, 300, (25,), generator=g).tolist()
    history = History(prompt, v)
    history.add(generated)
    logits = torch.randn(4, v, generator=g) * 3
    chain, tree = torch.tensor([7, 7, 4999]), [[], [7], [7, 12], [7, 12, 12]]
    for kw in (dict(repetition_penalty=1.3), dict(frequency_penalty=0.7, presence_penalty=-0.4),
               dict(repetition_penalty=0.8, frequency_penalty=-1.1, presence_penalty=1.5)):
        params = SamplingParams(**kw)
        for paths in (None, chain, tree):
            rows = [[] for _ in range(4)] if paths is None else ([chain[:i].tolist() for i in range(4)] if torch.is_tensor(paths) else paths)
            extra = torch.zeros(4, v)
            for r, p in enumerate(rows):
                for t in p:
                    extra[r, t] += 1
            want = logits.clone()
            if params.repetition_penalty != 1.0:
                present = torch.zeros(v, dtype=torch.bool)
                present[prompt + generated] = True
                rp = params.repetition_penalty
                want = torch.where(present | (extra > 0), torch.where(want > 0, want / rp, want * rp), want)
            counts = history.counts + extra
            want = want - params.frequency_penalty * counts - params.presence_penalty * (counts > 0).float()
            got = controlled_logits(logits, params, history, (), paths)
            assert torch.equal(got, want), (kw, paths)


def test_the_default_depth_is_4_greedy_and_auto_when_sampling(capsys, assets):
    from mtpspec.config import DEFAULT_K, GenerationConfig

    assert GenerationConfig().depth() == DEFAULT_K == 4
    assert GenerationConfig(temperature=0.8).depth() == "auto"
    assert GenerationConfig(temperature=0.8, k=3).depth() == 3 and GenerationConfig(k="auto").depth() == "auto"
    m = assets / "models"
    for temperature, depth in (("0", "D=4"), ("0.8", "D=auto")):
        assert main(["generate", "Once upon a time", "--model", str(m / "stories260K.bin"), "--tokenizer", str(m / "tok512.bin"),
                     "--drafter", "ngram", "--max-new-tokens", "20", "--temperature", temperature]) == 0
        assert f"ngram {depth}," in capsys.readouterr().err

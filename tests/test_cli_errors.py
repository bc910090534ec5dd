"""Bad input: one clear line on stderr, a non-zero exit, never a traceback."""

import pytest

import mtpspec

from mtpspec.cli import main


def run(capsys, *argv):
    try:
        rc = main(list(argv))
    except SystemExit as e:  # argparse usage errors
        rc = e.code
    err = capsys.readouterr().err
    return rc, err


@pytest.fixture
def model_args(assets):
    m = assets / "models"
    return ["--model", str(m / "stories260K.bin"), "--tokenizer", str(m / "tok512.bin")]


def test_missing_model(capsys, tmp_path):
    rc, err = run(capsys, "generate", "hi", "--model", str(tmp_path / "missing.bin"))
    assert rc == 2 and "model not found" in err and "Traceback" not in err


def test_wrong_format(capsys, tmp_path, assets):
    f = tmp_path / "model.bin"
    f.write_text("definitely not weights\n" * 10)
    rc, err = run(capsys, "generate", "hi", "--model", str(f), "--tokenizer", str(assets / "models" / "tok512.bin"))
    assert rc == 2 and "not a llama2.c checkpoint" in err


def test_tokenizer_in_place_of_model(capsys, assets):
    m = assets / "models"
    rc, err = run(capsys, "generate", "hi", "--model", str(m / "tok512.bin"), "--tokenizer", str(m / "tok512.bin"))
    assert rc == 2 and "error" in err and "Traceback" not in err


def test_missing_tokenizer(capsys, tmp_path, assets):
    f = tmp_path / "m.bin"
    f.write_bytes((assets / "models" / "stories260K.bin").read_bytes())
    rc, err = run(capsys, "generate", "hi", "--model", str(f))
    assert rc == 2 and "--tokenizer" in err


@pytest.mark.parametrize(
    "flags, message",
    [
        (["--drafter", "magic"], "unknown drafter 'magic'"),
        (["--drafter", "draft"], "needs a draft model"),
        (["--k", "0"], "k (draft length) must be >= 1"),
        (["--k", "-3"], "k (draft length) must be >= 1"),
        (["--temperature", "-0.5"], "temperature must be >= 0"),
        (["--top-p", "0"], "top-p must be in (0, 1]"),
        (["--top-p", "1.5"], "top-p must be in (0, 1]"),
        (["--top-k", "-1"], "top-k must be >= 0"),
        (["--max-new-tokens", "-1"], "max-new-tokens must be >= 0"),
        (["--dtype", "int4"], "unknown dtype"),
    ],
)
def test_bad_settings(capsys, model_args, flags, message):
    rc, err = run(capsys, "generate", "hi", *model_args, *flags)
    assert rc == 2 and message in err and "Traceback" not in err
    assert len(err.strip().splitlines()) == 1


def test_bad_k_text(capsys, model_args):
    rc, err = run(capsys, "generate", "hi", *model_args, "--k", "many")
    assert rc == 2 and "k must be an integer" in err


def test_prompt_longer_than_context(capsys, model_args):
    rc, err = run(capsys, "generate", "word " * 600, *model_args)
    assert rc == 2 and "longer than the model's context of 512" in err


def test_draft_model_with_other_vocabulary(capsys, model_args, tmp_path, assets):
    import struct

    raw = bytearray((assets / "models" / "stories260K.bin").read_bytes())
    # a consistent checkpoint with a smaller vocabulary: cut the embedding rows
    dim, hidden, L, nh, nkv, vocab, seq = struct.unpack_from("<7i", raw, 0)
    struct.pack_into("<i", raw, 20, 256)
    del raw[28 + 256 * dim * 4 : 28 + 512 * dim * 4]
    small = tmp_path / "small.bin"
    small.write_bytes(bytes(raw))
    rc, err = run(capsys, "generate", "hi", *model_args, "--drafter", "draft", "--draft-model", str(small))
    assert rc == 2 and "vocabulary (256) differs from the target's (512)" in err


@pytest.mark.parametrize("cmd", [["generate", "hi"], ["trace", "--out", "t.html"], ["train", "eval", "--runs", "mtp:1"]])
def test_threads_below_one(capsys, model_args, cmd):
    rc, err = run(capsys, *cmd, *model_args, "--threads", "0")
    assert rc == 2 and "--threads must be >= 1, got 0" in err and "Traceback" not in err


# --- crashes found by the hunt of issue 12 (each was a traceback) -------------------------------------

HEADS = __import__("pathlib").Path(__file__).resolve().parents[1] / "models" / "heads"


def run_out(capsys, *argv):
    try:
        rc = main(list(argv))
    except SystemExit as e:
        rc = e.code
    cap = capsys.readouterr()
    return rc, cap.out, cap.err


@pytest.mark.parametrize("n", [1, 64, 511])
def test_draft_vocab_with_a_head_folder_needs_a_ranking(capsys, model_args, n):
    """A head shares the target's LM head; stories260K has no token ranking, so a subset is a clear error."""
    rc, out, err = run_out(capsys, "generate", "hi", *model_args, "--drafter", "mtp", "--draft-model",
                           str(HEADS / "stories260K-mtp"), "--draft-vocab", str(n))
    assert rc == 2 and "needs the model's token ranking" in err and out == ""


@pytest.mark.parametrize("n", [0, 512, 4096])
def test_draft_vocab_full_with_a_head_folder_runs(stories, n):
    ref = stories.generate("Once upon a time", max_new_tokens=12).tokens
    for kind in ("mtp", "eagle"):
        r = stories.generate("Once upon a time", drafter=kind, draft_model=str(HEADS / f"stories260K-{kind}"), k=3,
                             draft_vocab=n, max_new_tokens=12)
        assert r.tokens == ref


@pytest.mark.parametrize("drafter", ["none", "ngram", "draft", "mtp", "eagle", "medusa"])
@pytest.mark.parametrize("t", [1e-38, 1e-320, 1e39, float("inf")])
def test_extreme_temperatures_run(stories, stories_q80, drafter, t):
    dm = {"draft": stories_q80, "mtp": str(HEADS / "stories260K-mtp"), "eagle": str(HEADS / "stories260K-eagle"),
          "medusa": str(HEADS / "stories260K-medusa")}.get(drafter)
    # seeded: Gumbel-max, one text for every drafter (seed 5 draws no end-of-text in 12 uniform tokens at T = inf)
    r = stories.generate("Once upon a time", drafter=drafter, draft_model=dm, k=3, temperature=t, seed=5, max_new_tokens=12)
    assert len(r.tokens) == 12 and all(0 <= x < 512 for x in r.tokens)
    if t < 1e-30:  # the limit T -> 0: stories260K has no exact ties, so this is greedy decoding
        assert r.tokens == stories.generate("Once upon a time", max_new_tokens=12).tokens


def test_temperature_limits_are_distributions():
    """T -> 0: uniform over the tied argmaxes; T = inf or beyond float32: uniform over the allowed tokens
    (-inf outside a draft vocabulary, top-k); top-p keeps the most likely tokens by logit order."""
    import torch

    from mtpspec.sampling import SamplingParams, logits_to_probs

    x = torch.tensor([[1.0, 3.0, 3.0, -2.0, float("-inf")], [-50.0, -40.0, -60.0, -45.0, -70.0]])
    tiny = logits_to_probs(x, SamplingParams(temperature=1e-38))
    assert torch.equal(tiny, torch.tensor([[0, 0.5, 0.5, 0, 0], [0, 1.0, 0, 0, 0]]))
    for t in (1e39, float("inf")):
        huge = logits_to_probs(x, SamplingParams(temperature=t))
        assert torch.equal(huge[0], torch.tensor([0.25, 0.25, 0.25, 0.25, 0.0])) and torch.equal(huge[1], torch.full((5,), 0.2))
        top2 = logits_to_probs(x, SamplingParams(temperature=t, top_k=2))
        assert torch.equal(top2[1], torch.tensor([0, 0.5, 0, 0.5, 0]))
        topp = logits_to_probs(x, SamplingParams(temperature=t, top_p=0.3))
        assert torch.equal(topp[1], torch.tensor([0, 0.5, 0, 0.5, 0]))  # mass 0.2 + 0.2 >= 0.3: the two most likely
    normal = logits_to_probs(x, SamplingParams(temperature=0.7))  # unchanged where logits / T is representable
    assert torch.allclose(normal, torch.softmax(x / 0.7, dim=-1), rtol=0, atol=1e-7)


@pytest.mark.parametrize("seed, ok", [("0", True), (str(2**64 - 1), True), (str(2**64), False), ("-1", False)])
def test_seed_range(capsys, model_args, seed, ok):
    rc, out, err = run_out(capsys, "generate", "hi", *model_args, "--temperature", "1", "--seed", seed, "--max-new-tokens", "3")
    if ok:
        assert rc == 0
    else:
        assert rc == 2 and "seed must be in [0, 2**64)" in err and out == ""


def test_max_new_tokens_beyond_the_context(stories):
    ids = [1] + [50 + i % 40 for i in range(505)]
    r = stories.generate(ids, max_new_tokens=10**12)
    assert r.finish_reason == "context" and len(ids) + len(r.tokens) == 513


def test_huge_k_is_capped_by_the_context(stories):
    ref = stories.generate("Once upon a time", max_new_tokens=16).tokens
    assert stories.generate("Once upon a time", drafter="ngram", k=10**12, max_new_tokens=16).tokens == ref


@pytest.mark.parametrize("kw, message", [
    (dict(max_new_tokens=2.5), "max-new-tokens must be an integer, got 2.5"),
    (dict(max_new_tokens=None), "max-new-tokens must be an integer, got None"),
    (dict(temperature="1"), "temperature must be a number, got '1'"),
    (dict(top_k=2.5), "top-k must be an integer, got 2.5"),
    (dict(top_p=None), "top-p must be a number"),
    (dict(seed=1.5), "seed must be an integer"),
    (dict(k=2.5), "k (draft length) must be an integer"),
    (dict(drafter="ngram", ngram_mx=3), "unknown drafter option 'ngram_mx' (did you mean 'ngram_max'?)"),
    (dict(drafter="ngram", ngram_max="3"), "--ngram-max must be an integer"),
    (dict(drafter="ngram", draft_vocab=64), "--draft-vocab is not used by --drafter ngram"),
    (dict(drafter="medusa", draft_vocab=64, draft_model=str(HEADS / "stories260K-medusa")), "--draft-vocab is not used by --drafter medusa"),
    (dict(drafter="ngram", draft_model="/nonexistent"), "--draft-model is not used by --drafter ngram"),
    (dict(drafter="none", draft_model="/nonexistent"), "--draft-model is not used by --drafter none"),
    (dict(drafter="draft", draft_model=str(HEADS / "stories260K-mtp")), "is a trained head"),
    (dict(on_text="print"), "on_text must be a function"),
])
def test_api_settings_are_checked(stories, kw, message):
    with pytest.raises(mtpspec.MtpspecError) as e:
        stories.generate("hi", **kw)
    assert message in str(e.value)


@pytest.mark.parametrize("prompt, message", [
    ([1, 512], "prompt token id 512 is outside the model's vocabulary [0, 512)"),
    ([1, -1], "prompt token id -1 is outside"),
    ([1, 2.0], "prompt token ids must be integers"),
    ([], "the prompt holds no token"),
    (3, "prompt must be text or a list of token ids"),
    ("a\udcffb", "lone surrogate"),
])
def test_api_bad_prompts(stories, prompt, message):
    with pytest.raises(mtpspec.MtpspecError) as e:
        stories.generate(prompt, max_new_tokens=2)
    assert message in str(e.value)


@pytest.mark.parametrize("drafter", ["mtp", "eagle", "medusa"])
def test_loaded_model_is_not_a_head(stories, stories_q80, drafter):
    with pytest.raises(mtpspec.MtpspecError, match="takes a trained head"):
        stories.generate("hi", drafter=drafter, draft_model=stories_q80, max_new_tokens=2)


@pytest.mark.parametrize("flags, message", [
    (["--drafter", "ngram", "--draft-model", "/nonexistent"], "--draft-model is not used by --drafter ngram"),
    (["--drafter", "eagle", "--draft-model", str(HEADS / "stories260K-eagle"), "--draft-vocab", "64"], "token ranking"),
    (["--drafter", "mtp", "--ngram-max", "4"], "--ngram-max is not used by --drafter mtp"),
    (["--drafter", "ngram", "--temperature", "1", "--seed", "18446744073709551616"], "seed must be in [0, 2**64)"),
])
def test_cli_refuses_before_echoing_the_prompt(capsys, model_args, flags, message):
    rc, out, err = run_out(capsys, "generate", "Once upon a time", *model_args, *flags)
    assert rc == 2 and message in err and out == ""  # nothing printed: validated before the prompt is echoed


@pytest.mark.parametrize("kind", ["mtp", "eagle", "medusa"])
def test_head_for_another_model(capsys, kind):
    rc, out, err = run_out(capsys, "generate", "def f():", "--model", "demo", "--drafter", kind,
                           "--draft-model", str(HEADS / f"stories260K-{kind}"), "--max-new-tokens", "4")
    assert rc == 2 and "head was trained for hidden 64 / vocabulary 512" in err and out == ""


def test_demo_as_draft_model_for_stories(capsys, model_args):
    rc, out, err = run_out(capsys, "generate", "hi", *model_args, "--drafter", "draft", "--draft-model", "demo")
    assert rc == 2 and "vocabulary (4096) differs from the target's (512)" in err and out == ""


def test_prompt_echoed_when_nothing_is_generated(capsys, model_args):
    rc, out, err = run_out(capsys, "generate", "Once upon a time", *model_args, "--max-new-tokens", "0")
    assert rc == 0 and out == "Once upon a time\n"


@pytest.mark.parametrize("cmd, message", [
    (["bench", "--prompts", "tinystories", "--limit", "-1", "--out", "OUT"], "--limit must be >= 1, got -1"),
    (["bench", "--prompts", "PROMPTS_DIR", "--limit", "1", "--out", "OUT"], "cannot read prompts from it (IsADirectoryError"),
    (["train", "eval", "--runs", "ngram:2", "--n", "0"], "--n and --repeats must be >= 1, got 0 and 1"),
    (["train", "eval", "--runs", "ngram:2", "--repeats", "0"], "--n and --repeats must be >= 1, got 8 and 0"),
    (["train", "eval", "--runs", "mtp:2:vocab=x"], "vocab=N needs an integer N >= 0"),
    (["train", "eval", "--runs", "ngram:2", "--prompts", "PROMPTS_DIR"], "cannot read prompts from it"),
    (["trace", "hi", "--drafters", "ngram", "--draft-model", "/nonexistent", "--out", "OUT/t.html"], "--draft-model is not used by --drafter ngram"),
])
def test_tools_refuse_bad_settings(capsys, model_args, tmp_path, cmd, message):
    cmd = [c.replace("PROMPTS_DIR", str(tmp_path)).replace("OUT", str(tmp_path / "out")) for c in cmd]
    rc, out, err = run_out(capsys, *cmd, *model_args)
    assert rc == 2 and message in err and "Traceback" not in err


def test_trace_takes_a_head_folder(capsys, model_args, tmp_path):
    rc, out, err = run_out(capsys, "trace", "Once upon a time", *model_args, "--drafter", "mtp", "--draft-model",
                           str(HEADS / "stories260K-mtp"), "--ks", "2", "--max-new-tokens", "8", "--out", str(tmp_path / "t.html"))
    assert rc == 0 and "identical: yes" in err


def test_a_reader_that_goes_away_is_no_traceback(assets, monkeypatch, capsys):
    """`mtpspec generate ... | head -c 10`: a closed pipe ends the run quietly (exit 141), no traceback.
    Here stdout is a pipe whose reader is already closed, so the first write fails as `head` makes it."""
    import os

    m = assets / "models"
    r, w = os.pipe()
    os.close(r)
    with open(w, "w") as closed_pipe:
        monkeypatch.setattr("sys.stdout", closed_pipe)
        rc = main(["generate", "Once upon a time", "--model", str(m / "stories260K.bin"), "--tokenizer", str(m / "tok512.bin"),
                   "--max-new-tokens", "8"])
    assert rc == 141 and "Traceback" not in capsys.readouterr().err


def test_version_and_every_subcommand_described(capsys):
    from mtpspec.cli import COMMANDS, HELP

    with pytest.raises(SystemExit) as e:
        main(["--version"])
    assert e.value.code == 0 and capsys.readouterr().out == f"mtpspec {mtpspec.__version__}\n"
    with pytest.raises(SystemExit):
        main(["--help"])
    out = capsys.readouterr().out
    assert set(COMMANDS) >= {"generate", "serve", "export", "demo", "bench", "trace", "train", "loadtest"}
    for name in COMMANDS:  # each listed with its one line (argparse may wrap it: compare the first words)
        assert HELP.get(name), name
        assert f"{name}  " in out and " ".join(HELP[name].split()[:3]) in " ".join(out.split()), name


def test_generate_and_serve_default_to_the_same_drafter(capsys, model_args, stories):
    """One rule (cli.auto_drafter): the model's own MTP module, else prompt lookup; generate's default speculates, and
    its greedy text is plain decoding's."""
    import json

    from mtpspec.cli import auto_drafter, build_parser
    from mtpspec.server.options import ServeOptions

    demo = mtpspec.load("demo")
    assert auto_drafter(demo.module) == "mtp" and auto_drafter(stories.module) == "ngram"
    assert build_parser().parse_args(["generate", "x", "--model", "m"]).drafter == "auto" == ServeOptions().drafter
    rc, out, err = run_out(capsys, "generate", "Once upon a time", *model_args, "--max-new-tokens", "40", "--json")
    res = json.loads(out)
    assert rc == 0 and res["stats"]["draft_tokens"] > 0
    assert res["tokens"] == stories.generate("Once upon a time", max_new_tokens=40).tokens
    rc, out, err = run_out(capsys, "generate", "def f():", "--model", "demo", "--max-new-tokens", "8", "--json",
                           "--mtp-lookup", "4")
    assert rc == 0 and json.loads(out)["tokens"] == demo.generate("def f():", max_new_tokens=8).tokens
    rc, out, err = run_out(capsys, "generate", "hi", *model_args, "--max-new-tokens", "4", "--mtp-lookup", "4")
    assert rc == 0  # auto chose prompt lookup: the MTP drafter's option is moot, as serve takes it
    rc, out, err = run_out(capsys, "generate", "hi", *model_args, "--draft-model", str(HEADS / "stories260K-mtp"))
    assert rc == 2 and "--draft-model needs --drafter" in err and out == ""

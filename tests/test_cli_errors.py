"""Bad input: one clear line on stderr, a non-zero exit, never a traceback."""

import pytest

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

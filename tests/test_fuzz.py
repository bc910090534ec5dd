"""Property-based fuzzing of the CLI and the Python API (hypothesis, pinned in pyproject.toml).

Whatever the flags, prompts or files: `mtpspec.cli.main` returns 0 or 2 (or argparse exits with 2), with
no traceback, and the Python API returns a valid result or raises MtpspecError. Never a hang: every run is
bounded (max-new-tokens <= 12 on the tiny stories260K model, few examples, no deadline).
"""

from __future__ import annotations

import io
import json
import shutil
import struct
from contextlib import redirect_stderr, redirect_stdout
from pathlib import Path

import pytest
from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st

import mtpspec
from mtpspec.cli import main
from mtpspec.errors import MtpspecError

HEADS = Path(__file__).resolve().parents[1] / "models" / "heads"
FUZZ = settings(max_examples=60, deadline=None, derandomize=True, database=None,
                suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow])


def run_cli(argv: list[str]) -> tuple[int, str]:
    out, err = io.StringIO(), io.StringIO()
    with redirect_stdout(out), redirect_stderr(err):
        try:
            rc = main(argv)
        except SystemExit as e:  # argparse: a usage error
            rc = e.code
    return rc, err.getvalue()


def assert_clean(rc, err: str) -> None:
    assert rc in (0, 2), (rc, err)
    assert "Traceback" not in err
    if rc == 2:
        last = err.strip().splitlines()[-1]
        assert last.startswith("mtpspec: error: ") or "error:" in last, err  # ours, or argparse's usage error


# --- prompts ---------------------------------------------------------------------------------------

SPECIAL = ["<s>", "</s>", "<unk>", "<|endoftext|>", "<|im_start|>", "<|im_end|>", "\x00", "\ufeff"]
SURROGATES = ["\ud800", "\udcff", "\udfff"]


@st.composite
def prompts(draw) -> str:
    kind = draw(st.sampled_from(["empty", "special", "unicode", "surrogate", "long", "text", "story", "story"]))
    if kind == "story":
        return draw(st.sampled_from(["Once upon a time", "The cat sat on the mat. The cat", "Lily and Ben"]))
    if kind == "empty":
        return ""
    if kind == "special":
        return "".join(draw(st.lists(st.sampled_from(SPECIAL), min_size=1, max_size=6)))
    if kind == "unicode":
        return draw(st.text(alphabet=st.characters(min_codepoint=0x80, max_codepoint=0x10FFFF), max_size=40))
    if kind == "surrogate":
        return draw(st.text(max_size=10)) + draw(st.sampled_from(SURROGATES)) + draw(st.text(max_size=10))
    if kind == "long":  # around and past the 512-token context
        return "Once upon a time " * draw(st.integers(100, 400))
    return draw(st.text(max_size=60))


# --- CLI flags -------------------------------------------------------------------------------------

def _num_text():
    return st.one_of(
        st.floats(allow_nan=True, allow_infinity=True).map(repr),
        st.sampled_from(["0", "1e-38", "1e-320", "1e39", "inf", "-inf", "nan", "1", "x", ""]),
    )


def _int_text(lo: int, hi: int):
    return st.one_of(st.integers(lo, hi).map(str), st.sampled_from([str(2**64), str(-(2**63) - 1), "1.5", "x", ""]))


DRAFT_MODELS = ["", "/nonexistent", "{heads}/stories260K-mtp", "{heads}/stories260K-eagle", "{heads}/stories260K-medusa",
                "{models}/stories260K_q80.bin", "{models}/tok512.bin", "demo"]


GOOD = {  # plausible values (each flag's garbage comes from _num_text / _int_text)
    "--temperature": st.sampled_from(["0", "0.7", "1", "1e-38", "1e-320", "1e39", "inf"]),
    "--top-p": st.sampled_from(["1", "0.9", "0.5", "1e-9"]), "--top-k": st.integers(0, 600).map(str),
    "--seed": st.integers(0, 2**64 - 1).map(str), "--max-new-tokens": st.integers(0, 12).map(str),
    "--draft-vocab": st.sampled_from(["0", "512", "600", "64"]), "--ngram-min": st.integers(1, 3).map(str),
    "--ngram-max": st.integers(3, 5).map(str), "--dtype": st.sampled_from(["fp32", "bf16"]),
}
BAD = {
    "--temperature": _num_text(), "--top-p": _num_text(), "--top-k": _int_text(-3, 1000), "--seed": _int_text(-5, 2**64 + 5),
    "--max-new-tokens": _int_text(-2, 12), "--draft-vocab": _int_text(-2, 700), "--ngram-min": _int_text(-1, 5),
    "--ngram-max": _int_text(-1, 5), "--dtype": st.sampled_from(["int4", "", "fp16"]),
}
OWN_DRAFT_MODEL = {"draft": "{models}/stories260K_q80.bin", "mtp": "{heads}/stories260K-mtp",
                   "eagle": "{heads}/stories260K-eagle", "medusa": "{heads}/stories260K-medusa"}


@st.composite
def cli_flags(draw) -> list[str]:
    """Mostly plausible flags (so most runs generate), each one garbage with probability 1/6."""
    flags: list[str] = []
    drafter = draw(st.sampled_from(["none", "ngram", "draft", "mtp", "eagle", "medusa"] * 3 + ["bogus"]))
    flags += ["--drafter", drafter]
    if drafter in OWN_DRAFT_MODEL and draw(st.integers(0, 5)):
        flags += ["--draft-model", OWN_DRAFT_MODEL[drafter]]
    elif draw(st.integers(0, 3)) == 0:
        flags += ["--draft-model", draw(st.sampled_from(DRAFT_MODELS))]
    exact = draw(st.booleans())
    if exact:
        flags.append("--exact")
    k_hi = 40 if exact else 10**6  # --exact pads every forward to k+1 rows: bounded to keep the run short
    how_k = draw(st.integers(0, 9))
    if how_k:
        flags += ["--k", "auto" if how_k == 1 else draw(_int_text(-3, 0)) if how_k == 2 else str(draw(st.integers(1, k_hi)))]
    for flag in GOOD:
        own = {"--draft-vocab": ("mtp", "eagle"), "--ngram-min": ("ngram",), "--ngram-max": ("ngram",)}.get(flag)
        if draw(st.integers(0, 2 if own is None or drafter in own else 12)) == 0:
            flags += [flag, draw(GOOD[flag] if draw(st.integers(0, 5)) else BAD[flag])]
    if "--max-new-tokens" not in flags:
        flags += ["--max-new-tokens", "6"]
    return flags


@pytest.fixture(scope="module")
def stories_args(assets) -> list[str]:
    m = assets / "models"
    return ["--model", str(m / "stories260K.bin"), "--tokenizer", str(m / "tok512.bin")]


@FUZZ
@given(flags=cli_flags(), prompt=prompts(), json_out=st.booleans())
def test_cli_flags_and_prompts(stories_args, assets, flags, prompt, json_out):
    flags = [f.format(heads=HEADS, models=assets / "models") for f in flags]
    argv = ["generate", prompt, *stories_args, *flags] + (["--json"] if json_out else [])
    rc, err = run_cli(argv)
    assert_clean(rc, err)
    event(f"exit {rc}" + (": " + err.strip().splitlines()[-1].split(":")[2][:30] if rc == 2 and err.count(":") >= 2 else ""))


# --- Python API ------------------------------------------------------------------------------------

ANY = st.one_of(st.none(), st.booleans(), st.integers(-3, 12), st.floats(allow_nan=True), st.text(max_size=3))


@FUZZ
@given(
    prompt=st.one_of(prompts(), st.lists(st.integers(-3, 600), max_size=8), st.lists(ANY, max_size=3), ANY),
    kw=st.fixed_dictionaries({}, optional={
        "drafter": st.sampled_from(["none", "ngram", "mtp", "draft", 3, None]),
        "k": st.one_of(ANY, st.just("auto"), st.integers(1, 40)),
        "temperature": st.one_of(ANY, st.floats(min_value=0, allow_infinity=True)),
        "top_k": ANY, "top_p": ANY, "seed": st.one_of(ANY, st.integers()), "max_new_tokens": ANY,
        "draft_vocab": ANY, "ngram_min": ANY, "ngram_max": ANY, "ngram_mx": ANY, "draft_model": st.sampled_from([None, 5, "/nonexistent"]),
    }),
)
def test_api_arguments(stories, prompt, kw):
    try:
        res = stories.generate(prompt, **kw)
    except MtpspecError:
        event("MtpspecError")
        return
    event("generated")
    assert all(0 <= t < stories.module.vocab_size for t in res.tokens)
    assert res.finish_reason in ("stop", "length", "context")


def test_api_loaded_model_as_head(stories, stories_q80):
    for drafter in ("mtp", "eagle", "medusa"):
        with pytest.raises(MtpspecError, match="takes a trained head"):
            stories.generate("hi", drafter=drafter, draft_model=stories_q80, max_new_tokens=2)


# --- corrupt files ---------------------------------------------------------------------------------

def _load_and_run(model_args: tuple, tokenizer=None) -> None:
    """Load, and if it loads and is small, generate a few tokens: only MtpspecError may escape."""
    try:
        m = mtpspec.load(*model_args) if tokenizer is None else mtpspec.load(model_args[0], tokenizer)
    except MtpspecError:
        return
    if m.max_seq_len <= 1 << 16:  # a corrupt context length would size the KV cache: loading it is the check
        for params in ({}, {"temperature": 1.0}):
            try:
                m.generate("Once upon a time", max_new_tokens=3, **params)
            except MtpspecError:
                pass


@st.composite
def byte_edits(draw, size: int, header: int):
    """A corruption of a file of `size` bytes: truncate, overwrite an int32 in the header, flip bytes, append."""
    how = draw(st.sampled_from(["truncate", "header", "flip", "append"]))
    if how == "truncate":
        return how, draw(st.integers(0, size - 1)), None
    if how == "header":
        return how, 4 * draw(st.integers(0, header // 4 - 1)), draw(st.integers(-(2**31), 2**31 - 1))
    if how == "flip":
        return how, draw(st.integers(0, size - 1)), draw(st.integers(1, 255))
    return how, draw(st.integers(1, 64)), None


def _apply(data: bytes, edit) -> bytes:
    how, a, b = edit
    if how == "truncate":
        return data[:a]
    if how == "header":
        return data[:a] + struct.pack("<i", b) + data[a + 4 :]
    if how == "flip":
        return data[:a] + bytes([data[a] ^ b]) + data[a + 1 :]
    return data + b"\x00" * a


@settings(FUZZ, max_examples=40)
@given(edit=byte_edits(1056540, 28), q80=st.booleans(), which=st.sampled_from(["model", "tokenizer"]))
def test_corrupt_llama2c_files(tmp_path_factory, assets, edit, q80, which):
    d = tmp_path_factory.mktemp("llama2c")
    m = assets / "models"
    src = m / ("stories260K_q80.bin" if q80 else "stories260K.bin")
    model, tok = d / "model.bin", d / "tok.bin"
    model.write_bytes(src.read_bytes())
    tok.write_bytes((m / "tok512.bin").read_bytes())
    target = model if which == "model" else tok
    data = target.read_bytes()
    if edit[0] == "header" and q80 and which == "model":
        edit = ("header", edit[1] + 4, edit[2])  # past the magic: the version and the dimensions
    target.write_bytes(_apply(data, (edit[0], min(edit[1], len(data) - 1), edit[2])))
    _load_and_run((model,), tok)
    rc, err = run_cli(["generate", "hi", "--model", str(model), "--tokenizer", str(tok), "--max-new-tokens", "2"])
    assert_clean(rc, err)


HF_LLAMA = {"model_type": "llama", "architectures": ["LlamaForCausalLM"], "vocab_size": 96, "hidden_size": 32,
            "intermediate_size": 64, "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2,
            "max_position_embeddings": 256, "rms_norm_eps": 1e-6, "rope_theta": 10000.0, "tie_word_embeddings": False}


@pytest.fixture(scope="module")
def hf_dir(tmp_path_factory) -> Path:
    """A tiny random Llama in Hugging Face layout, written without transformers (whose import is slow)."""
    import torch
    from safetensors.torch import save_file

    from mtpspec.models.dense import DenseConfig, DenseLM
    from qwen35_tiny import write_tokenizer

    d = tmp_path_factory.mktemp("hf") / "llama"
    d.mkdir()
    torch.manual_seed(5)
    c = HF_LLAMA
    model = DenseLM(DenseConfig(vocab_size=c["vocab_size"], hidden_size=c["hidden_size"], num_layers=c["num_hidden_layers"],
                                num_heads=c["num_attention_heads"], num_kv_heads=c["num_key_value_heads"],
                                intermediate_size=c["intermediate_size"], max_seq_len=256, norm_eps=1e-6, tie_embeddings=False))
    save_file({k: v.contiguous() for k, v in model.state_dict().items()}, str(d / "model.safetensors"), metadata={"format": "pt"})
    (d / "config.json").write_text(json.dumps(c))
    write_tokenizer(d)
    assert mtpspec.load(d).generate("w1 w2", max_new_tokens=2).tokens  # the intact directory loads and runs
    return d


def _safetensors_edit(data: bytes, how: str, value: int) -> bytes:
    n = struct.unpack_from("<Q", data, 0)[0]
    header = data[8 : 8 + n]
    if how == "length":
        return struct.pack("<Q", value) + data[8:]
    if how == "json":  # a byte of the JSON header flipped
        i = value % len(header)
        return data[:8] + header[:i] + bytes([header[i] ^ 0x5A]) + header[i + 1 :] + data[8 + n :]
    if how == "offsets":  # a tensor's data offsets pointing past the file
        meta = json.loads(header)
        name = sorted(k for k in meta if k != "__metadata__")[value % (len(meta) - 1)]
        meta[name]["data_offsets"] = [0, 10**9]
        new = json.dumps(meta).encode()
        new += b" " * (-len(new) % 8)
        return struct.pack("<Q", len(new)) + new + data[8 + n :]
    if how == "dtype":
        meta = json.loads(header)
        name = sorted(k for k in meta if k != "__metadata__")[value % (len(meta) - 1)]
        meta[name]["dtype"] = "I8"
        new = json.dumps(meta).encode()
        new += b" " * (-len(new) % 8)
        return struct.pack("<Q", len(new)) + new + data[8 + n :]
    return data[: value % len(data)]  # truncated


CONFIG_EDITS = st.sampled_from([
    ("raw", "{not json"), ("raw", ""), ("raw", "[]"), ("raw", "null"), ("set", "hidden_size", -32), ("set", "hidden_size", "32"),
    ("set", "num_attention_heads", 0), ("set", "vocab_size", 97), ("set", "max_position_embeddings", -1),
    ("set", "num_hidden_layers", 1.5), ("set", "rms_norm_eps", "x"), ("set", "architectures", 3), ("del", "hidden_size"),
    ("set", "num_key_value_heads", 3), ("set", "tie_word_embeddings", "yes"), ("set", "head_dim", 7),
])


@settings(FUZZ, max_examples=40)
@given(what=st.sampled_from(["safetensors", "config", "tokenizer"]),
       how=st.sampled_from(["length", "json", "offsets", "dtype", "truncate"]), value=st.integers(0, 2**63),
       cfg_edit=CONFIG_EDITS)
def test_corrupt_hf_directory(tmp_path_factory, hf_dir, what, how, value, cfg_edit):
    d = tmp_path_factory.mktemp("hfbad") / "m"
    shutil.copytree(hf_dir, d)
    if what == "safetensors":
        f = d / "model.safetensors"
        f.write_bytes(_safetensors_edit(f.read_bytes(), how, value))
    elif what == "config":
        f = d / "config.json"
        if cfg_edit[0] == "raw":
            f.write_text(cfg_edit[1])
        else:
            cfg = json.loads(f.read_text())
            if cfg_edit[0] == "del":
                cfg.pop(cfg_edit[1])
            else:
                cfg[cfg_edit[1]] = cfg_edit[2]
            f.write_text(json.dumps(cfg))
    else:
        f = d / "tokenizer.json"
        data = f.read_bytes()
        f.write_bytes(data[: value % len(data)] if how != "json" else data.replace(b'"', b"'", 1 + value % 5))
    _load_and_run((d,))
    rc, err = run_cli(["generate", "w1 w2", "--model", str(d), "--max-new-tokens", "2"])
    assert_clean(rc, err)


@settings(FUZZ, max_examples=25)
@given(kind=st.sampled_from(["mtp", "eagle", "medusa"]), what=st.sampled_from(["json", "safetensors"]),
       how=st.sampled_from(["length", "json", "offsets", "dtype", "truncate", "badjson", "config"]), value=st.integers(0, 2**63))
def test_corrupt_head_folder(tmp_path_factory, stories_args, kind, what, how, value):
    d = tmp_path_factory.mktemp("head") / kind
    shutil.copytree(HEADS / f"stories260K-{kind}", d)
    if what == "safetensors" and how not in ("badjson", "config"):
        f = d / "head.safetensors"
        f.write_bytes(_safetensors_edit(f.read_bytes(), how, value))
    elif how == "config":
        meta = json.loads((d / "head.json").read_text())
        key = sorted(meta["config"])[value % len(meta["config"])]
        meta["config"][key] = [-1, 0, "x", None, 3][value % 5]
        (d / "head.json").write_text(json.dumps(meta))
    else:
        (d / "head.json").write_text((d / "head.json").read_text()[: value % 200])
    rc, err = run_cli(["generate", "hi", *stories_args, "--drafter", kind, "--draft-model", str(d), "--max-new-tokens", "3"])
    assert_clean(rc, err)


@settings(FUZZ, max_examples=25)
@given(how=st.sampled_from(["meta", "truncate_meta", "config", "weights"]), value=st.integers(0, 2**63))
def test_corrupt_native_checkpoint(tmp_path_factory, stories, how, value):
    from mtpspec.loading.native import save_checkpoint

    d = tmp_path_factory.mktemp("native") / "m"
    save_checkpoint(stories.module, stories.tokenizer, d)
    meta_path = d / "mtpspec.json"
    meta = json.loads(meta_path.read_text())
    if how == "meta":
        key = ["format", "version", "config", "tokenizer", "stop_ids"][value % 5]
        meta[key] = [None, 7, "x", [1, "a"], {"a": 1}][value % 5]
        meta_path.write_text(json.dumps(meta))
    elif how == "truncate_meta":
        meta_path.write_text(meta_path.read_text()[: value % 100])
    elif how == "config":
        key = sorted(meta["config"])[value % len(meta["config"])]
        meta["config"][key] = [-1, 0, "x", None, 1.5, 10**12][value % 6]
        meta_path.write_text(json.dumps(meta))
    else:
        f = d / "model.safetensors"
        f.write_bytes(_safetensors_edit(f.read_bytes(), ["length", "json", "offsets", "dtype", "truncate"][value % 5], value))
    _load_and_run((d,))


@pytest.mark.parametrize("field, value", [("vocab_size", 10**12), ("max_position_embeddings", 10**12)])
def test_hf_config_sizes_beyond_the_weights(tmp_path, hf_dir, field, value):
    d = tmp_path / "m"
    shutil.copytree(hf_dir, d)
    cfg = json.loads((d / "config.json").read_text())
    cfg[field] = value
    (d / "config.json").write_text(json.dumps(cfg))
    _load_and_run((d,))  # refused, or (a context the KV cache need not fill) loaded and run: never allocated


@FUZZ
@given(
    logits=st.lists(st.one_of(st.floats(-1e30, 1e30), st.just(float("-inf"))), min_size=2, max_size=12)
    .filter(lambda xs: any(x > float("-inf") for x in xs)),
    t=st.one_of(st.floats(min_value=0, exclude_min=True, allow_infinity=True), st.sampled_from([1e-45, 1e-320, 1e39, 5e-324])),
    top_k=st.integers(0, 12), top_p=st.floats(min_value=0, max_value=1, exclude_min=True),
)
def test_sampling_transform_is_a_distribution(logits, t, top_k, top_p):
    """For any finite logits (-inf = not allowed) and any T > 0: a distribution on the allowed tokens, never NaN."""
    import torch

    from mtpspec.sampling import SamplingParams, logits_to_probs

    x = torch.tensor(logits)
    p = logits_to_probs(x, SamplingParams(temperature=t, top_k=top_k, top_p=top_p))
    assert bool(torch.isfinite(p).all()) and bool((p >= 0).all())
    assert abs(float(p.double().sum()) - 1.0) < 1e-5  # float32 rounding of a sum of <= 12 terms
    assert bool((p[x == float("-inf")] == 0).all())
    assert float(p[x.argmax()]) > 0  # the most likely token always survives

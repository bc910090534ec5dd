"""The llama2.c tokenizer: encoding as run.c does it, decoding with its BOS and byte rules."""

import random

import pytest

from mtpspec.errors import ModelLoadError
from mtpspec.loading.tokenizer_llama2c import BOS, Llama2cTokenizer


@pytest.fixture(scope="module")
def tok(assets):
    return Llama2cTokenizer.load(assets / "models" / "tok512.bin")


def run_c_encode(tok, text):
    """run.c's encode, literally: rescan all pairs after every merge, take the first best score."""
    ids = [tok.lookup[b" "]] if text else []
    for ch in text:
        b = ch.encode()
        ids += [tok.lookup[b]] if b in tok.lookup else [x + 3 for x in b]
    while True:
        best, bi, bid = -1e10, -1, -1
        for i in range(len(ids) - 1):
            t = tok.lookup.get(tok.pieces[ids[i]] + tok.pieces[ids[i + 1]])
            if t is not None and tok.scores[t] > best:
                best, bi, bid = tok.scores[t], i, t
        if bi < 0:
            return [BOS] + ids
        ids[bi : bi + 2] = [bid]


def test_encode_matches_run_c(tok, assets):
    text = (assets / "prompts" / "tinystories_val_prefix.txt").read_text()[:6000]
    rng = random.Random(0)
    samples = ["", "a", "Once upon a time", "  two  spaces", "héllo wörld ✓ 😀", "\n\nnew\tlines"]
    samples += [text[i : i + rng.randint(1, 300)] for i in (rng.randrange(len(text)) for _ in range(40))]
    for s in samples:
        assert tok.encode(s) == run_c_encode(tok, s), repr(s)


def test_empty_prompt_is_bos_alone(tok):
    assert tok.encode("") == [BOS]


def test_roundtrip_including_byte_fallback(tok):
    for s in ["Once upon a time, there was a cat.", "naïve café — 日本語 😀", "x" * 50]:
        ids = tok.encode(s)
        assert tok.decode(ids[1:]) == s  # after BOS the dummy-prefix space is dropped


def test_stream_decodes_multibyte_across_tokens(tok):
    ids = tok.encode("日本😀")[1:]
    st = tok.stream()
    text = "".join(st.push([t]) for t in ids) + st.flush()
    assert text == "日本😀"


def test_bad_tokenizer_files(tmp_path, assets):
    with pytest.raises(ModelLoadError, match="cannot read tokenizer"):
        Llama2cTokenizer.load(tmp_path / "missing.bin")
    bad = tmp_path / "bad.bin"
    bad.write_bytes(b"\x07\x00\x00\x00" + b"\xff" * 100)
    with pytest.raises(ModelLoadError, match="not a llama2.c tokenizer"):
        Llama2cTokenizer.load(bad)
    with pytest.raises(ModelLoadError, match="vocabulary is 1000"):
        Llama2cTokenizer.load(assets / "models" / "tok512.bin", vocab_size=1000)

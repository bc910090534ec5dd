"""Gemma's GGUF tokenizer on SentencePiece (mtpspec.loading.tokenizer_spm) against the `tokenizers` one built from the
same file (tokenizer_gguf.build_tokenizer, itself checked against transformers in test_gguf_loading.py): the same ids,
the same text from any ids (byte pieces, specials, streaming), the cached model, and the fallbacks."""

from __future__ import annotations

import random
import sys

import pytest

pytest.importorskip("gguf")
pytest.importorskip("sentencepiece")

from test_gguf_loading import TEXTS, write_tiny  # noqa: E402

from mtpspec.loading.gguf import read_gguf  # noqa: E402
from mtpspec.loading.tokenizer_gguf import build_tokenizer, load_gguf_tokenizer  # noqa: E402
from mtpspec.loading.tokenizer_hf import HFTokenizer  # noqa: E402
from mtpspec.loading.tokenizer_spm import SPMTokenizer  # noqa: E402

MORE = ["<unk>", "a<unk>b<unk>", "<bos>the<eos>", "<start_of_turn>user\nthe cat<end_of_turn>\n", "  the   cat  ", "\n\n\nthe\n",
        "é 猫 😀", "\x00\x7f", "\u2581the\u2581", "<mask><pad>"]


@pytest.fixture
def pair(tmp_path, monkeypatch):
    """(SentencePiece tokenizer, `tokenizers` one) of a small Gemma-style file."""
    monkeypatch.setenv("MTPSPEC_MODEL_CACHE", str(tmp_path / "cache"))
    path = write_tiny(tmp_path / "tok.gguf", arch="gemma3")
    mine = load_gguf_tokenizer(path)
    assert isinstance(mine, SPMTokenizer)
    ref = HFTokenizer(build_tokenizer(read_gguf(path)), mine.stop_ids)
    ref.chat_template = mine.chat_template
    return mine, ref


def _ids(rng: random.Random, n: int) -> list[int]:
    pools = [range(0, 12), range(11, 11 + 256), range(n), range(n, n + 3)]  # specials, bytes, any, past the vocabulary
    return [rng.choice(rng.choice(pools)) for _ in range(rng.randint(0, 9))]


def test_encodes_as_the_tokenizers_one(pair):
    mine, ref = pair
    for text in TEXTS + MORE:
        assert mine.encode(text) == ref.encode(text), text
    assert (mine.bos_id, mine.stop_ids, mine.vocab_size) == (ref.bos_id, ref.stop_ids, ref.vocab_size)
    assert mine._special_ids == ref._special_ids
    assert mine.hf_tokenizer_config() == ref.hf_tokenizer_config()


def test_decodes_and_streams_as_the_tokenizers_one(pair):
    mine, ref = pair
    rng = random.Random(0)
    for _ in range(3000):
        ids = _ids(rng, ref.vocab_size)
        prev = rng.choice([None, 2, 5, 20, 300, 11])
        assert mine.decode(ids, prev) == ref.decode(ids, prev), (ids, prev)
        a, b = mine.stream(prev), ref.stream(prev)
        for k in range(0, len(ids), 2):
            assert a.push(ids[k:k + 2]) == b.push(ids[k:k + 2]), (ids, prev)
        assert a.flush() == b.flush()
    for text in TEXTS + MORE:
        assert mine.decode(mine.encode(text)) == ref.decode(ref.encode(text))


def test_tokenizers_form_is_built_on_first_use(pair):
    mine, ref = pair
    assert mine._hf is None
    assert mine.tokenizer.to_str() == ref.tokenizer.to_str() and mine.to_hf() is mine.tokenizer


def test_cached_model_is_read_and_a_damaged_one_rebuilt(tmp_path, monkeypatch):
    monkeypatch.setenv("MTPSPEC_MODEL_CACHE", str(tmp_path / "cache"))
    path = write_tiny(tmp_path / "tok.gguf", arch="gemma3")
    first = load_gguf_tokenizer(path)
    (entry,) = (tmp_path / "cache" / "tokenizers").glob("*.spm.model")
    blob = entry.read_bytes()
    again = load_gguf_tokenizer(path)  # from the cache
    assert isinstance(again, SPMTokenizer) and all(again.encode(t) == first.encode(t) for t in TEXTS + MORE)
    entry.write_bytes(b"not a model")
    damaged = load_gguf_tokenizer(path)
    assert isinstance(damaged, SPMTokenizer) and all(damaged.encode(t) == first.encode(t) for t in TEXTS + MORE)
    assert entry.read_bytes() == blob  # written again


def test_other_vocabularies_and_failed_checks_use_tokenizers(tmp_path, monkeypatch):
    from mtpspec.loading import tokenizer_spm

    monkeypatch.setenv("MTPSPEC_MODEL_CACHE", str(tmp_path / "cache"))
    for arch, kind in (("llama", "llama"), ("qwen2", "gpt2")):
        tok = load_gguf_tokenizer(write_tiny(tmp_path / f"{arch}.gguf", arch=arch, tokenizer=kind))
        assert type(tok) is HFTokenizer
    path = write_tiny(tmp_path / "gemma.gguf", arch="gemma3")
    want = [load_gguf_tokenizer(path).encode(t) for t in TEXTS + MORE]
    monkeypatch.setattr(tokenizer_spm, "_processor", lambda sentencepiece, blob: None)  # SentencePiece refuses it
    tok = load_gguf_tokenizer(path)
    assert type(tok) is HFTokenizer and [tok.encode(t) for t in TEXTS + MORE] == want
    monkeypatch.undo()
    monkeypatch.setenv("MTPSPEC_MODEL_CACHE", str(tmp_path / "cache"))
    monkeypatch.setitem(sys.modules, "sentencepiece", None)  # not installed
    tok = load_gguf_tokenizer(path)
    assert type(tok) is HFTokenizer and [tok.encode(t) for t in TEXTS + MORE] == want


def test_byte_flips_raise_only_the_one_error(tmp_path, monkeypatch):
    """A damaged Gemma-style header: a tokenizer (either kind) or ModelLoadError, never another exception."""
    from mtpspec.errors import ModelLoadError

    monkeypatch.setenv("MTPSPEC_MODEL_CACHE", str(tmp_path / "cache"))
    data = write_tiny(tmp_path / "tok.gguf", arch="gemma3").read_bytes()
    header = read_gguf(tmp_path / "tok.gguf").data_offset
    rng = random.Random(7)
    bad = tmp_path / "flip.gguf"
    for _ in range(150):
        b = bytearray(data)
        for _ in range(rng.choice((1, 2))):
            b[rng.randrange(0, header)] ^= rng.randrange(1, 256)
        bad.write_bytes(bytes(b))
        try:
            load_gguf_tokenizer(bad)
        except ModelLoadError as e:
            assert "\n" not in str(e)

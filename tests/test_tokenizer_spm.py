"""Gemma's GGUF tokenizer (mtpspec.loading.tokenizer_spm, run by tokenizer_bpe.CompactBPE) against the `tokenizers` one
built from the same file (tokenizer_gguf.build_tokenizer, itself checked against transformers in test_gguf_loading.py):
the same ids, the same text from any ids (byte pieces, specials, streaming), and the fallbacks; and CompactBPE against
`sentencepiece.SentencePieceProcessor` over the same ModelProto (tokenizer_spm.model_proto): the same ids and text on
random strings, over the small file's vocabulary and a random one full of overlapping pieces."""

from __future__ import annotations

import random
import sys

import numpy as np
import pytest

pytest.importorskip("gguf")

from test_gguf_loading import TEXTS, write_tiny  # noqa: E402

from mtpspec.loading import tokenizer_spm  # noqa: E402
from mtpspec.loading.gguf import read_gguf  # noqa: E402
from mtpspec.loading.tokenizer_bpe import CompactBPE  # noqa: E402
from mtpspec.loading.tokenizer_gguf import build_tokenizer, load_gguf_tokenizer  # noqa: E402
from mtpspec.loading.tokenizer_hf import HFTokenizer  # noqa: E402
from mtpspec.loading.tokenizer_spm import SPMTokenizer  # noqa: E402

MORE = ["<unk>", "a<unk>b<unk>", "<bos>the<eos>", "<start_of_turn>user\nthe cat<end_of_turn>\n", "  the   cat  ", "\n\n\nthe\n",
        "é 猫 😀", "\x00\x7f", "\u2581the\u2581", "<mask><pad>"]


@pytest.fixture
def pair(tmp_path, monkeypatch):
    """(SPMTokenizer, `tokenizers` one) of a small Gemma-style file."""
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


def test_other_vocabularies_and_failed_checks_use_tokenizers(tmp_path, monkeypatch):
    monkeypatch.setenv("MTPSPEC_MODEL_CACHE", str(tmp_path / "cache"))
    for arch, kind in (("llama", "llama"), ("qwen2", "gpt2")):
        tok = load_gguf_tokenizer(write_tiny(tmp_path / f"{arch}.gguf", arch=arch, tokenizer=kind))
        assert type(tok) is HFTokenizer
    path = write_tiny(tmp_path / "gemma.gguf", arch="gemma3")
    want = [load_gguf_tokenizer(path).encode(t) for t in TEXTS + MORE]
    monkeypatch.setattr(tokenizer_spm, "CompactBPE", _refuse)  # a vocabulary SentencePiece would refuse
    tok = load_gguf_tokenizer(path)
    assert type(tok) is HFTokenizer and [tok.encode(t) for t in TEXTS + MORE] == want
    monkeypatch.undo()
    monkeypatch.setenv("MTPSPEC_MODEL_CACHE", str(tmp_path / "cache"))
    monkeypatch.setitem(sys.modules, "sentencepiece", None)  # not installed: not needed
    tok = load_gguf_tokenizer(path)
    assert type(tok) is SPMTokenizer and [tok.encode(t) for t in TEXTS + MORE] == want


def _refuse(*args):
    raise ValueError("refused")


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


# -- CompactBPE against SentencePiece ------------------------------------------------------------------------------------

def _random_text(rng: random.Random, pieces: list[str], extra: list[str]) -> str:
    """Pieces (spaces for U+2581), user-defined ones glued to text, whitespace runs, characters outside the vocabulary."""
    parts = []
    for _ in range(rng.randint(0, 14)):
        r = rng.random()
        if r < 0.4:
            parts.append(rng.choice(pieces).replace("\u2581", " "))
        elif r < 0.8:
            parts.append(rng.choice(extra))
        else:
            parts.append(chr(rng.choice((rng.randint(32, 0x7FF), rng.randint(0x800, 0xD7FF), rng.randint(0xE000, 0x2FFFF)))))
    return "".join(parts)


def _check_against_sentencepiece(tokens, types, added, unk, texts, rng):
    sentencepiece = pytest.importorskip("sentencepiece")
    ref = sentencepiece.SentencePieceProcessor(model_proto=tokenizer_spm.model_proto(tokens, types, added, unk))
    mine = CompactBPE(tokens, tokenizer_spm.piece_types(types, added, unk), unk)
    assert mine.get_piece_size() == ref.get_piece_size() == len(tokens)
    for text in texts:
        assert mine.encode(text) == ref.encode(text), text
    for i in range(len(tokens)):
        assert mine.id_to_piece(i) == ref.id_to_piece(i) and mine.piece_to_id(tokens[i]) == ref.piece_to_id(tokens[i]) == i
    for piece in ("", "nope", "\u2581\u2581\u2581\u2581\u2581x", "<0x100>"):
        assert mine.piece_to_id(piece) == ref.piece_to_id(piece) == unk
    for _ in range(500):
        ids = [rng.randrange(len(tokens)) for _ in range(rng.randint(0, 9))]
        assert mine.decode(ids) == ref.decode(ids), ids


def test_compact_bpe_is_sentencepiece_on_the_small_vocabulary(tmp_path):
    tokens, types, added, special, _, _ = tokenizer_spm._plan(read_gguf(write_tiny(tmp_path / "tok.gguf", arch="gemma3")))
    rng = random.Random(3)
    extra = [" ", "  ", "   ", "\n", "\n\n\n", "\t", "\u2581", "é", "猫", "😀", "\x00", "<", "<start_of", "turn>", "<unk>", "ｱ"]
    texts = TEXTS + MORE + [_random_text(rng, tokens, extra) for _ in range(400)]
    _check_against_sentencepiece(tokens, types, added, special["unknown"], texts, rng)


def test_compact_bpe_is_sentencepiece_on_overlapping_pieces():
    """A random vocabulary over a few letters: pieces that are each other's prefixes and concatenations, user-defined
    pieces that merges also form."""
    rng = random.Random(5)
    letters = "ab<>\n\u2581"
    tokens = ["<unk>"] + [f"<0x{b:02X}>" for b in range(256)] + list(letters) + ["é"]
    types = [2] + [6] * (len(tokens) - 1 - len(letters) - 1) + [1] * (len(letters) + 1)
    seen = set(tokens)
    while len(tokens) < 600:
        t = "".join(rng.choice(letters) for _ in range(rng.randint(2, 6)))
        if t not in seen:
            seen.add(t)
            tokens.append(t)
            types.append(4 if rng.random() < 0.05 and "\u2581" not in t else 1)
    types = np.array(types, dtype=np.int32)
    added = types == 4
    texts = ["".join(rng.choice(letters + " é😀x") for _ in range(rng.randint(0, 40))) for _ in range(400)]
    _check_against_sentencepiece(tokens, types, added, 0, texts, rng)


def test_compact_bpe_refuses_what_sentencepiece_refuses():
    sentencepiece = pytest.importorskip("sentencepiece")
    bytes_ = [f"<0x{b:02X}>" for b in range(256)]
    for tokens in (["<unk>", *bytes_, "a", "a"], ["<unk>", *bytes_, "a", ""], ["<unk>", *bytes_[1:], "a", "b"]):
        types = np.array([2] + [6] * (len(tokens) - 3) + [1, 1], dtype=np.int32)
        added = np.zeros(len(tokens), bool)
        with pytest.raises(ValueError, match="repeated|empty|byte pieces"):
            CompactBPE(tokens, tokenizer_spm.piece_types(types, added, 0), 0)
        with pytest.raises(RuntimeError):
            sentencepiece.SentencePieceProcessor(model_proto=tokenizer_spm.model_proto(tokens, types, added, 0))

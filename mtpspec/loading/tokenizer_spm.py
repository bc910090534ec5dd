"""A Gemma GGUF file's tokenizer as a SentencePiece BPE model run by CompactBPE: the ids of transformers' GGUF tokenizer.

transformers turns Gemma's SentencePiece vocabulary into a `tokenizers` BPE whose merges rank each token by its file
position (tokenizer_gguf.py builds the same; 262k tokens, 515k merges: 86 MB resident). SentencePiece's BPE over the
same pieces, scored by file position, merges the same pairs, so it encodes the same ids; tokenizer_bpe.CompactBPE runs
that algorithm over the vocabulary held as arrays (about 7 MB; sentencepiece's processor of the model held 46 MB, and
is now only the tests' reference, over `model_proto`). The model mirrors transformers' tokenizer:

- pieces: normal tokens scored -position; whitespace-only tokens holding a space respelled as that many U+2581;
  control and user-defined tokens (transformers' added tokens, matched in raw text) USER_DEFINED, so they are matched
  in the text too and decode as their text; the named unknown token UNKNOWN (SentencePiece matches no UNKNOWN piece in
  text, so `encode` splits the text on it first); `<0xNN>` byte pieces BYTE.
- normalizer: none (identity), no dummy prefix, spaces kept and written as U+2581; byte fallback.
- decoding: runs of byte pieces decode as `tokenizers`' ByteFallback does (a run that is not UTF-8 is one U+FFFD per
  byte), ids outside the vocabulary are skipped.

`load_spm_tokenizer` answers None where the file is not such a vocabulary or a check fails; the caller then builds the
`tokenizers` one. The `tokenizers.Tokenizer` itself (`.tokenizer`, `to_hf`, `save`: export, grammars, training) is
built from the file on first use.
"""

from __future__ import annotations

import itertools
import re
import struct
import threading
from collections.abc import Callable
from pathlib import Path

import numpy as np

from ..errors import ConfigError
from .gguf import GGUFFile
from .tokenizer_bpe import BYTE, CONTROL, NORMAL, UNKNOWN, USER_DEFINED, CompactBPE  # types: llama.cpp's are SentencePiece's
from .tokenizer_hf import HFTokenizer

GEMMA_ARCHS = ("gemma", "gemma2", "gemma3")  # SentencePiece vocabularies run as transformers' Gemma tokenizer

_BYTE_PIECE = re.compile(r"<0x[0-9A-F]{2}>")  # SentencePiece's byte pieces


class SPMTokenizer(HFTokenizer):
    """HFTokenizer's interface over a CompactBPE (SentencePiece's BPE; `sp`, named as the processor it stands in for)."""

    def __init__(self, sp, path: Path, *, bos: int | None, eos: int | None, unk: int, special_ids, byte_ids: dict[int, int],
                 stop_ids: tuple[int, ...] = (), build_hf: Callable[[], object] | None = None) -> None:
        self.sp = sp
        self.path = path  # the GGUF file: the `tokenizers` form is built from it on first use, by build_hf
        self._build_hf = build_hf
        self.stop_ids = tuple(stop_ids)
        self.chat_template: str | None = None
        self.bos_id, self._eos, self._unk = bos, eos, unk  # _eos: appended by encode (the file's add_eos_token)
        self._unk_text = sp.id_to_piece(unk)
        self._special_ids = frozenset(special_ids)
        self._bytes = byte_ids  # id -> byte of the <0xNN> pieces
        self._byte_set = frozenset(byte_ids)
        self._n = sp.get_piece_size()
        self._hf = None
        self._lock = threading.Lock()

    @property
    def tokenizer(self):
        """The same tokenizer as a `tokenizers.Tokenizer` (built from the file on first use: seconds, 86 MB)."""
        if self._hf is None:
            with self._lock:
                if self._hf is None:
                    if self._build_hf is None:
                        raise ConfigError(f"{self.path}: no `tokenizers` form of this SentencePiece tokenizer was given")
                    self._hf = self._build_hf()
        return self._hf

    @property
    def vocab_size(self) -> int:
        return self._n

    def token_id(self, piece: str) -> int | None:
        i = self.sp.piece_to_id(piece)
        return i if self.sp.id_to_piece(i) == piece else None

    def hf_tokenizer_config(self) -> dict:
        name = lambda i: None if i is None else self.sp.id_to_piece(i)  # noqa: E731
        eos = name(self.stop_ids[0]) if self.stop_ids else None
        cfg = {"tokenizer_class": "PreTrainedTokenizerFast", "bos_token": name(self.bos_id), "eos_token": eos,
               "unk_token": "<unk>" if self.token_id("<unk>") is not None else None, "pad_token": eos,
               "add_bos_token": self.bos_id is not None, "add_eos_token": False, "clean_up_tokenization_spaces": False}
        if self.chat_template:
            cfg["chat_template"] = self.chat_template
        return cfg

    def piece_bytes(self) -> tuple[list[bytes], frozenset[int], frozenset[int]]:
        """Each id's bytes as its text decodes (a byte piece its byte, U+2581 a space, an added token its name), the ids
        of transformers' added tokens (control, user-defined, the named ones) and of its special ones (control, named)."""
        kinds = self.sp.kinds()
        out = []
        for i in range(self._n):
            b = self._bytes.get(i)
            out.append(bytes([b]) if b is not None else self.sp.id_to_piece(i).replace("\u2581", " ").encode("utf-8"))
        added = frozenset(np.flatnonzero(kinds == USER_DEFINED).tolist()) | self._special_ids
        return out, added, self._special_ids

    def encode_plain(self, text: str) -> list[int]:
        """`text`'s ids without BOS / EOS (added tokens in the text are matched, as transformers matches them)."""
        if self._unk_text not in text:
            return self.sp.encode(text)
        parts = text.split(self._unk_text)
        out = self.sp.encode(parts[0])
        for part in parts[1:]:
            out.append(self._unk)
            out += self.sp.encode(part)
        return out

    def encode(self, text: str) -> list[int]:
        ids = self.encode_plain(text)
        if self.bos_id is not None:
            ids.insert(0, self.bos_id)
        if self._eos is not None:
            ids.append(self._eos)
        if not ids:
            raise ConfigError("the prompt is empty and this tokenizer adds no BOS token: give a prompt")
        return ids

    def _decode(self, ids: list[int]) -> str:
        ids = [i for i in ids if 0 <= i < self._n]
        if self._byte_set.isdisjoint(ids):
            return self.sp.decode(ids)
        out = []
        for is_byte, run in itertools.groupby(ids, self._byte_set.__contains__):
            run = list(run)
            if not is_byte:
                out.append(self.sp.decode(run))
                continue
            raw = bytes(self._bytes[i] for i in run)
            try:
                out.append(raw.decode("utf-8"))
            except UnicodeDecodeError:
                out.append("\ufffd" * len(raw))
        return "".join(out)


def load_spm_tokenizer(f: GGUFFile, build_hf: Callable[[], object] | None = None) -> SPMTokenizer | None:
    """The file's tokenizer on CompactBPE, or None where it is not a Gemma SentencePiece vocabulary that SentencePiece's
    BPE runs as transformers does (then the `tokenizers` one is built). build_hf: makes the same tokenizer as a
    `tokenizers.Tokenizer` (grammars, export), called on first use."""
    plan = _plan(f)
    if plan is None:
        return None
    tokens, types, added, special, add_bos, add_eos = plan
    try:
        sp = CompactBPE(tokens, piece_types(types, added, special["unknown"]), special["unknown"])
    except ValueError:
        return None  # a vocabulary SentencePiece would refuse
    if any(sp.encode(tokens[i]) != [i] for i in np.flatnonzero(added).tolist() if i != special["unknown"]):
        return None  # each added token must come out of the text as itself, as transformers splits it out
    byte_ids = {i: int(tokens[i][3:5], 16) for i in np.flatnonzero(types == BYTE).tolist()}
    special_ids = set(np.flatnonzero(types == CONTROL).tolist()) | set(special.values())
    return SPMTokenizer(sp, f.path, bos=special.get("bos") if add_bos else None, eos=special.get("eos") if add_eos else None,
                        unk=special["unknown"], special_ids=special_ids, byte_ids=byte_ids, build_hf=build_hf)


def _plan(f: GGUFFile):
    """(tokens as SentencePiece spells them, llama.cpp types, which are transformers' added tokens, named special ids,
    add BOS, add EOS), or None."""
    md = f.metadata
    if md.get("tokenizer.ggml.model") != "llama" or f.architecture not in GEMMA_ARCHS or "tokenizer.ggml.merges" in md:
        return None
    tokens, types = md.get("tokenizer.ggml.tokens"), md.get("tokenizer.ggml.token_type")
    if not isinstance(tokens, list) or not tokens or not all(isinstance(t, str) for t in tokens):
        return None
    if types is None or not hasattr(types, "dtype") or len(types) != len(tokens):
        return None
    n = len(tokens)
    special = {}
    for key in ("bos", "eos", "unknown", "padding"):
        v = md.get(f"tokenizer.ggml.{key}_token_id")
        if v is not None:
            if isinstance(v, bool) or not isinstance(v, int) or not 0 <= v < n:
                return None  # the `tokenizers` builder names the bad key
            special[key] = v
    if "unknown" not in special:
        return None
    if types.dtype.kind not in "iu" or types.min() < NORMAL or types.max() > BYTE:
        return None
    respelled = [i for i, t in enumerate(tokens) if " " in t and not t.strip()]  # transformers' vocabulary spells them
    added = (types == CONTROL) | (types == USER_DEFINED)  # as U+2581 runs: not added tokens then (their name is no token)
    added[respelled] = types[respelled] == CONTROL  # a special one would be added as a new token: refused below
    added[list(special.values())] = True
    unk = tokens[special["unknown"]]
    for i in np.flatnonzero(added).tolist():
        t = tokens[i]
        if not t or " " in t or "\u2581" in t or (i != special["unknown"] and unk in t):
            return None  # matched in raw text by transformers, in normalized text by SentencePiece: could differ
    if any(_BYTE_PIECE.fullmatch(tokens[i]) is None for i in np.flatnonzero(types == BYTE).tolist()):
        return None
    spelled = list(tokens)
    for i in respelled:
        spelled[i] = "\u2581" * len(tokens[i])
    add_bos = bool(md.get("tokenizer.ggml.add_bos_token", True)) and "bos" in special
    add_eos = bool(md.get("tokenizer.ggml.add_eos_token", False)) and "eos" in special
    return spelled, types, added, special, add_bos, add_eos


def piece_types(types: np.ndarray, added: np.ndarray, unk: int) -> np.ndarray:
    """SentencePiece's type of each piece (uint8): `added` (transformers' added tokens) USER_DEFINED, `unk` UNKNOWN,
    byte pieces BYTE, the rest NORMAL (transformers' BPE vocabulary)."""
    out = np.where(added, USER_DEFINED, np.where(types == BYTE, BYTE, NORMAL)).astype(np.uint8)
    out[unk] = UNKNOWN
    return out


def model_proto(tokens: list[str], types: np.ndarray, added: np.ndarray, unk: int) -> bytes:
    """The model CompactBPE runs as a serialized sentencepiece ModelProto (the reference its tests hold it to): BPE
    over `tokens` scored by position, typed as piece_types; identity normalizer, no dummy prefix, byte fallback."""
    parts = []
    for t, typ in zip(tokens, piece_types(types, added, unk).tolist()):
        body = _bytes(1, t.encode("utf-8")) + _key(2, 5) + struct.pack("<f", -float(len(parts)))  # piece, score
        body += b"" if typ == NORMAL else _int(3, typ)  # type (NORMAL: the default, left out)
        parts.append(_bytes(1, body))
    unk_text = tokens[unk].encode("utf-8")
    trainer = (_int(3, 2) + _int(4, len(tokens)) + _int(35, 1)  # model_type BPE, vocab_size, byte_fallback
               + _int(40, unk) + _int(41, -1) + _int(42, -1) + _int(43, -1)  # unk id; BOS / EOS / PAD added by us
               + _bytes(44, unk_text) + _bytes(45, unk_text))  # unk_surface (decodes as transformers'), unk_piece
    normalizer = _bytes(1, b"identity") + _int(3, 0) + _int(4, 0) + _int(5, 1)  # no dummy prefix, spaces kept, as U+2581
    parts += [_bytes(2, trainer), _bytes(3, normalizer)]
    return b"".join(parts)


def _varint(n: int) -> bytes:
    n &= (1 << 64) - 1  # negative int32: ten bytes, as protobuf writes them
    out = bytearray()
    while n >= 0x80:
        out.append(n & 0x7F | 0x80)
        n >>= 7
    out.append(n)
    return bytes(out)


def _key(field: int, wire: int) -> bytes:
    return _varint(field << 3 | wire)


def _int(field: int, v: int) -> bytes:
    return _key(field, 0) + _varint(v)


def _bytes(field: int, b: bytes) -> bytes:
    return _key(field, 2) + _varint(len(b)) + b

"""The llama2.c tokenizer format (tokenizer.bin), encoding and decoding exactly as llama2.c's run.c.

File: int32 max_token_length, then per id: float32 score, int32 byte length, the bytes.
Encode: prepend BOS; for non-empty text add the dummy-prefix " " token; one token per UTF-8
character (byte fallback <0xNN> -> id byte + 3 when the character is not in the vocabulary); then
repeatedly merge the adjacent pair whose merged piece has the highest score (earliest on ties).
Decode: a piece following BOS loses its leading space; <0xNN> pieces are raw bytes.
"""

from __future__ import annotations

import codecs
import heapq
import re
import struct
from pathlib import Path

from ..errors import ConfigError, ModelLoadError

BOS, EOS = 1, 2
_BYTE_PIECE = re.compile(rb"^<0x([0-9A-Fa-f]{2})>$")


class Llama2cTokenizer:
    def __init__(self, pieces: list[bytes], scores: list[float]) -> None:
        self.pieces = pieces
        self.scores = scores
        self.lookup: dict[bytes, int] = {}
        for i, p in enumerate(pieces):
            self.lookup.setdefault(p, i)
        self.bos_id, self.eos_id = BOS, EOS
        # run.c stops when the model emits BOS (the TinyStories story separator); EOS stops too.
        self.stop_ids = (BOS, EOS)
        self._bytes = [self._piece_bytes(p) for p in pieces]

    @property
    def vocab_size(self) -> int:
        return len(self.pieces)

    @classmethod
    def load(cls, path: str | Path, vocab_size: int | None = None) -> "Llama2cTokenizer":
        path = Path(path)
        try:
            data = path.read_bytes()
        except OSError as e:
            raise ModelLoadError(f"cannot read tokenizer file {path}: {e.strerror}") from None
        pieces, scores, off = [], [], 4
        if len(data) < 4:
            raise ModelLoadError(f"{path}: not a llama2.c tokenizer (too small)")
        max_len = struct.unpack_from("<i", data, 0)[0]
        try:
            while off < len(data):
                score, n = struct.unpack_from("<fi", data, off)
                if n < 0 or n > max(max_len, 0) + 16 or off + 8 + n > len(data):
                    raise struct.error
                pieces.append(data[off + 8 : off + 8 + n])
                scores.append(score)
                off += 8 + n
        except struct.error:
            raise ModelLoadError(f"{path}: not a llama2.c tokenizer (bad entry {len(pieces)} at byte {off})") from None
        if len(pieces) < 259:
            raise ModelLoadError(f"{path}: not a llama2.c tokenizer ({len(pieces)} entries, expected >= 259)")
        if vocab_size is not None and len(pieces) != vocab_size:
            raise ModelLoadError(f"{path}: tokenizer has {len(pieces)} tokens but the model's vocabulary is {vocab_size}")
        return cls(pieces, scores)

    def encode(self, text: str, bos: bool = True) -> list[int]:
        tokens: list[int] = []
        if text:
            tokens.append(self.lookup[b" "])  # dummy prefix, as sentencepiece's add_dummy_prefix
        for ch in text:
            b = ch.encode("utf-8")
            tid = self.lookup.get(b)
            if tid is not None:
                tokens.append(tid)
            else:
                tokens.extend(byte + 3 for byte in b)  # byte fallback
        return ([BOS] if bos else []) + self._merge(tokens)

    def _merge(self, tokens: list[int]) -> list[int]:
        """Repeatedly merge the adjacent pair with the highest merged score, the earliest on ties: run.c's result in
        O(n log n) (a heap keyed by (-score, position), a linked list of live tokens, stale entries skipped)."""
        n = len(tokens)
        tok, nxt, prv, alive = list(tokens), list(range(1, n + 1)), list(range(-1, n - 1)), [True] * n
        heap: list[tuple[float, int, int, int]] = []

        def push(i: int) -> None:
            j = nxt[i] if 0 <= i < n else n
            if 0 <= i and j < n:
                mid = self.lookup.get(self.pieces[tok[i]] + self.pieces[tok[j]])
                if mid is not None:
                    heapq.heappush(heap, (-self.scores[mid], i, tok[i], tok[j]))

        for i in range(n - 1):
            push(i)
        while heap:
            _, i, left, right = heapq.heappop(heap)
            j = nxt[i] if alive[i] else n
            if j >= n or tok[i] != left or tok[j] != right:
                continue  # stale: one side was merged away since this pair was pushed
            tok[i] = self.lookup[self.pieces[left] + self.pieces[right]]
            alive[j] = False
            nxt[i] = nxt[j]
            if nxt[j] < n:
                prv[nxt[j]] = i
            push(prv[i])
            push(i)
        return [t for t, a in zip(tok, alive) if a]

    @staticmethod
    def _piece_bytes(piece: bytes) -> bytes:
        m = _BYTE_PIECE.match(piece)
        return bytes([int(m.group(1), 16)]) if m else piece

    def token_bytes(self, prev: int, token: int) -> bytes:
        b = self._bytes[token]
        if prev == BOS and b.startswith(b" "):
            b = b[1:]
        return b

    def decode(self, tokens: list[int], prev: int = BOS) -> str:
        out = bytearray()
        for t in tokens:
            out += self.token_bytes(prev, t)
            prev = t
        return out.decode("utf-8", errors="replace")

    def stream(self, prev: int = BOS) -> "TextStream":
        return TextStream(self, prev)

    # Names of the special ids in a Hugging Face tokenizer (the .bin file stores "\n<s>\n" for BOS).
    HF_SPECIALS = {0: "<unk>", BOS: "<s>", EOS: "</s>"}

    def to_hf(self):
        """A `tokenizers.Tokenizer` (byte-fallback BPE, Llama's layout) that encodes as `encode`: the pieces with " "
        as U+2581, ids unchanged; merges ranked by the merged piece's score (run.c's order); U+2581 prepended to
        non-empty text; decoding drops the first leading space, as after BOS."""
        from tokenizers import AddedToken, Tokenizer, decoders, normalizers, processors
        from tokenizers.models import BPE

        names = self._hf_names()
        vocab = {name: i for i, name in enumerate(names)}
        merges = self._hf_merges(names, vocab)
        tok = Tokenizer(BPE(vocab=vocab, merges=merges, unk_token=names[0], fuse_unk=True, byte_fallback=True))
        tok.normalizer = normalizers.Sequence([normalizers.Prepend("\u2581"), normalizers.Replace(" ", "\u2581")])
        tok.decoder = decoders.Sequence(
            [decoders.Replace("\u2581", " "), decoders.ByteFallback(), decoders.Fuse(), decoders.Strip(" ", 1, 0)]
        )
        tok.add_special_tokens([AddedToken(names[i], special=True, normalized=False) for i in sorted(self.HF_SPECIALS)])
        tok.post_processor = processors.TemplateProcessing(
            single=f"{names[BOS]} $A", pair=f"{names[BOS]} $A {names[BOS]} $B", special_tokens=[(names[BOS], BOS)]
        )
        return tok

    def hf_tokenizer_config(self) -> dict:
        """tokenizer_config.json fields for `to_hf`'s tokenizer (BOS added, as `encode` does)."""
        n = self.HF_SPECIALS
        return {"tokenizer_class": "PreTrainedTokenizerFast", "bos_token": n[BOS], "eos_token": n[EOS], "unk_token": n[0],
                "pad_token": n[0], "add_bos_token": True, "add_eos_token": False, "clean_up_tokenization_spaces": False}

    def _hf_names(self) -> list[str]:
        """Token strings: specials renamed, " " -> U+2581; refuses pieces that are not UTF-8 or collide."""
        names = []
        for i, p in enumerate(self.pieces):
            if i in self.HF_SPECIALS:
                names.append(self.HF_SPECIALS[i])
                continue
            try:
                text = p.decode("utf-8")
            except UnicodeDecodeError:
                raise ConfigError(f"tokenizer piece {i} ({p!r}) is not UTF-8: it has no Hugging Face form") from None
            if "\u2581" in text:
                raise ConfigError(f"tokenizer piece {i} ({text!r}) contains U+2581, the Hugging Face space marker")
            names.append(text.replace(" ", "\u2581"))
        if len(set(names)) != len(names):
            raise ConfigError("tokenizer pieces repeat: a Hugging Face vocabulary needs distinct tokens")
        return names

    def _hf_merges(self, names: list[str], vocab: dict[str, int]) -> list[tuple[str, str]]:
        """(left, right) for every split of a non-special piece into two pieces, best merged score first."""
        ranked = []
        for i, name in enumerate(names):
            if i in self.HF_SPECIALS:
                continue
            for cut in range(1, len(name)):
                left, right = name[:cut], name[cut:]
                if left in vocab and right in vocab:
                    ranked.append((-self.scores[i], i, vocab[left], (left, right)))
        ranked.sort()
        return [m for *_, m in ranked]


class TextStream:
    """Incremental decoder: feed tokens as they are emitted, get complete UTF-8 text back."""

    def __init__(self, tok: Llama2cTokenizer, prev: int) -> None:
        self.tok, self.prev = tok, prev
        self.dec = codecs.getincrementaldecoder("utf-8")(errors="replace")

    def push(self, tokens: list[int]) -> str:
        out = bytearray()
        for t in tokens:
            out += self.tok.token_bytes(self.prev, t)
            self.prev = t
        return self.dec.decode(bytes(out))

    def flush(self) -> str:
        return self.dec.decode(b"", final=True)

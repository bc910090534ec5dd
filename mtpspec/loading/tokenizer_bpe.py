"""SentencePiece's BPE model run in Python and numpy, over a vocabulary held as arrays instead of Python objects.

`CompactBPE` encodes and decodes as `sentencepiece.SentencePieceProcessor` does a BPE ModelProto whose pieces are scored
by -position, with an identity normalizer, no dummy prefix, spaces kept and escaped to U+2581, and byte fallback (the
model tokenizer_spm.model_proto writes). Gemma's 262k pieces take about 7 MB here, against 46 MB in SentencePiece:

- storage: every piece's UTF-8 in one bytes blob with int32 offsets; the pieces' `hash()` sorted, with their ids
  beside them (a lookup bisects the hashes and checks the candidate's bytes in the blob, so a collision cannot match);
  piece types as uint8.
- encoding (bpe_model.cc Model::Encode, no sampling): the text split into characters, except that a user-defined
  piece is matched at each position, longest first (SentencePiece's PrefixMatcher; here one regex of their trie) and
  kept whole, never merged; between them, a heap of adjacent pairs whose concatenation is a NORMAL or USER_DEFINED
  piece, best score (lowest id) first, then leftmost; popped pairs whose symbols changed since are skipped; each
  merge pushes its new neighbour pairs. A final symbol that is no piece (a character outside the vocabulary) becomes
  its UTF-8 bytes' `<0xNN>` pieces (SentencePiece, like this class, takes byte fallback only with all 256).
  Where no piece holds two adjacent characters side by side (a filter of the pieces' character pairs says so, 128 KB),
  no merge can join them: the text is cut there into chunks merged apart, each distinct chunk once (words, mostly).
- decoding: U+2581 as a space (all but the unknown piece, which is its own text), control pieces as nothing, a run of
  byte pieces as UTF-8 with each invalid byte one U+FFFD.
"""

from __future__ import annotations

import heapq
import re
from bisect import bisect_left, bisect_right

import numpy as np

NORMAL, UNKNOWN, CONTROL, USER_DEFINED, UNUSED, BYTE = 1, 2, 3, 4, 5, 6  # SentencePiece's piece types
_MERGEABLE = (NORMAL, USER_DEFINED, UNUSED)  # SentencePiece's `pieces_`: the others are reserved, never merged into
_BYTE_PIECE = re.compile(r"<0x([0-9A-F]{2})>")
_ESCAPED = re.compile("[\udc80-\udcff]")  # surrogateescape's stand-ins for bytes that are not UTF-8
_PAIR_BITS = 20  # the filter of the pieces' adjacent characters: 2**20 bits


class CompactBPE:
    """SentencePiece's BPE encode / decode over `pieces` (spelled as SentencePiece holds them, U+2581 for a space)
    of SentencePiece types `kinds`, scored by -position, `unk` the unknown piece's id. The method names are
    SentencePieceProcessor's. ValueError where SentencePiece refuses such a model (an empty or repeated piece, a byte
    piece not named <0xNN>, other than 256 of them)."""

    def __init__(self, pieces: list[str], kinds: np.ndarray, unk: int) -> None:
        n = len(pieces)
        kinds = np.asarray(kinds, dtype=np.uint8)
        if n == 0 or kinds.shape != (n,) or not 0 <= unk < n or kinds[unk] != UNKNOWN:
            raise ValueError("the vocabulary is empty or its types do not name its unknown piece")
        chars = np.zeros(n + 1, dtype=np.int64)  # piece i: characters chars[i]:chars[i + 1] of them all
        np.cumsum(np.fromiter(map(len, pieces), dtype=np.int64, count=n), out=chars[1:])
        if (chars[1:] == chars[:-1]).any():
            raise ValueError(f"piece {int(np.argmax(chars[1:] == chars[:-1]))} is empty")
        text = "".join(pieces)
        self._blob = text.encode("utf-8")  # every piece's UTF-8, in id order
        points = np.frombuffer(text.encode("utf-32-le"), dtype=np.uint32)
        del text
        within = np.ones(max(len(points) - 1, 0), dtype=bool)  # adjacent characters of one piece
        within[chars[1:-1] - 1] = False
        held = np.zeros(1 << _PAIR_BITS, dtype=bool)
        held[_pair_keys(points[:-1][within], points[1:][within])] = True
        self._pairs = np.packbits(held)  # bit k: some piece holds two adjacent characters of key k (or one colliding)
        del within, held
        width = np.ones(len(points), dtype=np.uint8)  # each character's UTF-8 bytes
        for edge in (0x80, 0x800, 0x10000):
            width += points >= edge
        del points
        self._offsets = np.zeros(n + 1, dtype=np.int32 if len(self._blob) < 2**31 else np.int64)
        np.cumsum(np.add.reduceat(width, chars[:-1], dtype=np.int64), out=self._offsets[1:])  # piece i: blob[o[i]:o[i + 1]]
        del width, chars
        hashes = np.fromiter(map(hash, pieces), dtype=np.int64, count=n)
        order = np.argsort(hashes, kind="stable")
        self._hashes = hashes[order]  # sorted; ids[k] is the piece of hashes[k]
        self._ids = order.astype(np.int32)
        del hashes, order
        same = self._hashes[1:] == self._hashes[:-1]  # a piece twice (or, rarely, two pieces of one hash)
        suspects = np.unique(np.concatenate([np.flatnonzero(same), np.flatnonzero(same) + 1]))
        repeated = [pieces[i] for i in self._ids[suspects].tolist()]
        if len(set(repeated)) != len(repeated):
            raise ValueError("a piece is repeated in the vocabulary")
        self._kinds = kinds
        self._n, self._unk = n, unk
        self._byte_of: dict[int, int] = {}  # the <0xNN> piece's id -> its byte
        for i in np.flatnonzero(kinds == BYTE).tolist():
            m = _BYTE_PIECE.fullmatch(pieces[i])
            if m is None:
                raise ValueError(f"byte piece {i} is not named <0xNN>")
            self._byte_of[i] = int(m.group(1), 16)
        if len(self._byte_of) != 256:
            raise ValueError(f"{len(self._byte_of)} byte pieces, not 256")
        self._byte_ids = [0] * 256  # byte -> its <0xNN> piece
        for i, b in self._byte_of.items():
            self._byte_ids[b] = i
        user = [pieces[i] for i in np.flatnonzero(kinds == USER_DEFINED).tolist()]
        try:
            self._user_re = re.compile(_trie_pattern(user)) if user else None  # the user-defined pieces, longest first
        except (RecursionError, re.error) as e:
            raise ValueError(f"the user-defined pieces make no pattern: {e}") from None
        # scalar views: indexing them is a Python int, as fast as a list's
        self._hv, self._idv, self._offv, self._kindv = (memoryview(self._hashes), memoryview(self._ids),
                                                       memoryview(self._offsets), memoryview(self._kinds))

    def get_piece_size(self) -> int:
        return self._n

    def id_to_piece(self, i: int) -> str:
        if not 0 <= i < self._n:
            raise IndexError(f"piece id {i} is out of range [0, {self._n})")
        return self._blob[self._offv[i]:self._offv[i + 1]].decode("utf-8")

    def kinds(self) -> np.ndarray:
        """Each piece's SentencePiece type (NORMAL, UNKNOWN, CONTROL, USER_DEFINED, UNUSED, BYTE), (n,) uint8."""
        return self._kinds

    def piece_to_id(self, piece: str) -> int:
        """The piece's id, the unknown piece's where there is none (as SentencePiece)."""
        i = self._find(piece)
        return self._unk if i < 0 else i

    def _find(self, piece: str) -> int:
        """The id of `piece` (any type), -1 where it is no piece."""
        h = hash(piece)
        hv, n = self._hv, self._n
        k = bisect_left(hv, h)
        b = None
        while k < n and hv[k] == h:
            i = self._idv[k]
            if b is None:
                b = piece.encode("utf-8")
            if self._blob[self._offv[i]:self._offv[i + 1]] == b:
                return i
            k += 1
        return -1

    def _merge_id(self, piece: str) -> int:
        """The id of `piece` if a merge may form it (SentencePiece's NORMAL, USER_DEFINED, UNUSED), else -1."""
        i = self._find(piece)
        return i if i >= 0 and self._kindv[i] in _MERGEABLE else -1

    def _find_many(self, pieces: list[str]) -> list[int]:
        """_find of each piece, the misses settled by one vectorized search of their hashes."""
        h = np.fromiter(map(hash, pieces), dtype=np.int64, count=len(pieces))
        k = np.minimum(np.searchsorted(self._hashes, h), self._n - 1)
        out = [-1] * len(pieces)
        for j in np.flatnonzero(self._hashes[k] == h).tolist():
            out[j] = self._find(pieces[j])
        return out

    def encode(self, text: str) -> list[int]:
        """The text's ids, as SentencePieceProcessor.encode."""
        text = text.replace(" ", "\u2581")  # the normalizer: identity, spaces escaped
        merge_ids: dict[str, int] = {}  # piece -> the id a merge forms (-1: none); filled in as pieces are met
        char_ids: dict[str, int] = {}  # character -> its piece (any type), -1 for none
        cuts: list[int] = []  # positions inside no piece: no piece holds the characters either side of them together
        if len(text) > 32:  # the pairs of characters, and the characters, looked up at once
            kind = self._kindv
            pairs = list({text[i:i + 2] for i in range(len(text) - 1)})
            merge_ids.update((p, i if i >= 0 and kind[i] in _MERGEABLE else -1) for p, i in zip(pairs, self._find_many(pairs)))
            chars = list(set(text))
            char_ids.update(zip(chars, self._find_many(chars)))
            points = np.frombuffer(text.encode("utf-32-le"), dtype=np.uint32)
            k = _pair_keys(points[:-1], points[1:])
            cuts = (np.flatnonzero(((self._pairs[k >> 3] >> (7 - (k & 7))) & 1) == 0) + 1).tolist()
        done: dict[str, list[int]] = {}  # chunk -> its ids
        out: list[int] = []
        start = 0
        for i, length in [*self._user_matches(text), (len(text), 0)]:
            a = start
            for c in [*cuts[bisect_right(cuts, start):bisect_left(cuts, i)], i]:  # merges never cross a cut: chunks apart
                if c > a:
                    chunk = text[a:c]
                    ids = done.get(chunk)
                    if ids is None:
                        ids = done[chunk] = []
                        self._merge(chunk, ids, merge_ids, char_ids)
                    out += ids
                a = c
            if length:
                out.append(self._find(text[i:i + length]))
            start = i + length
        return out

    def _user_matches(self, text: str):
        """(start, length) of the user-defined pieces SentencePiece's PrefixMatcher finds: left to right, the longest
        at each position, none overlapping."""
        if self._user_re is not None:
            for m in self._user_re.finditer(text):
                yield m.start(), m.end() - m.start()

    def _merge(self, seg: str, out: list[int], merge_ids: dict[str, int], char_ids: dict[str, int]) -> None:
        """Appends the ids of `seg` (text with no user-defined piece in it) after SentencePiece's BPE merges.
        merge_ids, char_ids: encode's lookups, filled in here as pieces are met."""
        known = merge_ids.get
        n = len(seg)
        sym = list(seg)  # symbol i's text; "" once merged into its left neighbour
        ids = [-1] * n  # symbol i's id once formed by a merge
        prev, nxt = list(range(-1, n - 1)), list(range(1, n + 1))
        nxt[-1] = -1
        heap = []  # (id of the concatenation: lower scores higher, left, right, its length)
        for i in range(n - 1):
            c = seg[i:i + 2]
            pid = known(c)
            if pid is None:
                pid = merge_ids[c] = self._merge_id(c)
            if pid >= 0:
                heap.append((pid, i, i + 1, 2))
        heapq.heapify(heap)
        pop, push = heapq.heappop, heapq.heappush
        while heap:
            pid, left, right, size = pop(heap)
            a, b = sym[left], sym[right]
            if not a or not b or len(a) + len(b) != size:
                continue  # a symbol of this pair has merged since
            s = sym[left] = a + b
            sym[right] = ""
            ids[left] = pid
            r = nxt[left] = nxt[right]
            if r >= 0:
                prev[r] = left
            p = prev[left]
            if p >= 0:
                c = sym[p] + s
                cid = known(c)
                if cid is None:
                    cid = merge_ids[c] = self._merge_id(c)
                if cid >= 0:
                    push(heap, (cid, p, left, len(c)))
            if r >= 0:
                c = s + sym[r]
                cid = known(c)
                if cid is None:
                    cid = merge_ids[c] = self._merge_id(c)
                if cid >= 0:
                    push(heap, (cid, left, r, len(c)))
        i = 0
        while i >= 0:
            if ids[i] >= 0:
                out.append(ids[i])
            else:  # a single character: its piece, else its bytes' pieces (byte fallback)
                c = sym[i]
                cid = char_ids.get(c)
                if cid is None:
                    cid = char_ids[c] = self._find(c)
                if cid >= 0 and cid != self._unk:
                    out.append(cid)
                else:
                    out += [self._byte_ids[x] for x in c.encode("utf-8")]
            i = nxt[i]

    def decode(self, ids: list[int]) -> str:
        """The text of `ids`, as SentencePieceProcessor.decode."""
        out: list[str] = []
        run = bytearray()  # consecutive byte pieces' bytes
        for i in ids:
            if not 0 <= i < self._n:
                raise IndexError(f"piece id {i} is out of range [0, {self._n})")
            k = self._kindv[i]
            if k == BYTE:
                run.append(self._byte_of[i])
                continue
            if run:
                out.append(_ESCAPED.sub("\ufffd", run.decode("utf-8", "surrogateescape")))
                run.clear()
            if k == CONTROL:
                continue
            piece = self._blob[self._offv[i]:self._offv[i + 1]].decode("utf-8")
            out.append(piece if k == UNKNOWN else piece.replace("\u2581", " "))
        if run:
            out.append(_ESCAPED.sub("\ufffd", run.decode("utf-8", "surrogateescape")))
        return "".join(out)


def _trie_pattern(words: list[str]) -> str:
    """A regex matching the longest of `words` that starts where it is tried: their trie, each word's end an optional
    group that tries the longer words first (a group per node: matching costs the text's length, not the words')."""
    trie: dict = {}
    for w in words:
        node = trie
        for c in w:
            node = node.setdefault(c, {})
        node[""] = {}

    def emit(node: dict) -> str:
        alts = [re.escape(c) + emit(child) for c, child in sorted(node.items()) if c]
        body = "" if not alts else alts[0] if len(alts) == 1 else "(?:" + "|".join(alts) + ")"
        return f"(?:{body})?" if "" in node and body else body

    return emit(trie)


def _pair_keys(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    """Each pair of code points hashed to a bit of the pair filter."""
    key = (a.astype(np.uint64) << np.uint64(21)) | b
    return ((key * np.uint64(0x9E3779B97F4A7C15)) >> np.uint64(64 - _PAIR_BITS)).astype(np.int64)

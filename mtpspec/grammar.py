"""Structured output: the generated text matches a JSON schema, a regular expression or a Lark grammar.

Built on llguidance: it runs on CPU, computes a token mask in tens of microseconds, compiles JSON schemas, regexes and
Lark grammars, and rolls a matcher back by any number of consumed tokens. Speculation needs that last one: every verify
row and every draft step is masked after its own path of draft tokens, so a sequence's matcher steps forward along a
path and back again many times a step.

A grammar is one more context control of sampling.py: a sequence's `GrammarState` follows its committed tokens
(`advance`) and masks row r of a window to the tokens allowed after the committed tokens plus path r (`mask`). The same
mask goes into p and q, so greedy output is the constrained target's greedy output and rejection sampling draws exactly
from the constrained target's distribution. A path with a token the grammar rejects, or a stop token, is never accepted
past it: its later rows get the mask after its last valid prefix. The sequence's stop ids are allowed exactly where the
grammar accepts, and once it is complete (no further token possible) only they are, so generation ends there ("stop").
Text the grammar forces (a JSON key, an enum's rest) is allowed only in the tokenizer's canonical tokens (llguidance's
rule); the mask stays a function of the path alone, so plain and speculative decoding see the same one.
"""

from __future__ import annotations

import json
import threading
import weakref
from dataclasses import dataclass
from collections.abc import Sequence

import numpy as np
import torch
from torch import Tensor

from .errors import ConfigError

KINDS = ("json_schema", "regex", "lark")
# JSON as json.dumps writes it: no free whitespace, which a small model could otherwise emit without end
JSON_OPTIONS = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}


@dataclass(frozen=True)
class Grammar:
    """What the output must match, independent of any tokenizer: `Grammar.json_schema(schema)`, `json_object()`,
    `regex(pattern)` or `lark(text)`. `compile(tokenizer, vocab_size)` gives the form sampling uses."""

    kind: str  # json_schema | regex | lark
    source: str  # the schema as JSON text, the regular expression, or the Lark grammar

    def __post_init__(self) -> None:
        if self.kind not in KINDS:
            raise ConfigError(f"grammar kind must be one of {', '.join(KINDS)}, got {self.kind!r}")
        if not isinstance(self.source, str):
            raise ConfigError(f"the {self.kind} grammar must be text, got {type(self.source).__name__}")

    @classmethod
    def json_schema(cls, schema: dict | str) -> "Grammar":
        """A JSON value valid under `schema` (a dict, or its JSON text), written compactly (JSON_OPTIONS; the schema's
        own "x-guidance" options override them)."""
        if isinstance(schema, str):
            try:
                schema = json.loads(schema)
            except json.JSONDecodeError as e:
                raise ConfigError(f"the JSON schema is not valid JSON ({e.msg} at line {e.lineno} column {e.colno})") from None
        if not isinstance(schema, (dict, bool)):
            raise ConfigError(f"a JSON schema must be an object, got {type(schema).__name__}")
        return cls("json_schema", json.dumps(schema))

    @classmethod
    def json_object(cls) -> "Grammar":
        """Any JSON object (OpenAI's response_format json_object)."""
        return cls.json_schema({"type": "object"})

    @classmethod
    def regex(cls, pattern: str) -> "Grammar":
        """Text matching the regular expression as a whole (Rust regex syntax)."""
        return cls("regex", pattern)

    @classmethod
    def lark(cls, text: str) -> "Grammar":
        """Text of llguidance's Lark dialect (its rule `start`)."""
        return cls("lark", text)

    def llguidance(self) -> str:
        """The grammar in llguidance's own form."""
        from llguidance import LLMatcher

        if self.kind == "json_schema":
            try:
                return LLMatcher.grammar_from_json_schema(self.source, defaults=JSON_OPTIONS)
            except ValueError as e:  # source that is not a JSON object (Grammar built by hand)
                raise ConfigError(f"invalid JSON schema: {_one_line(str(e))}") from None
        if self.kind == "regex":
            return LLMatcher.grammar_from_regex(self.source)
        return LLMatcher.grammar_from_lark(self.source)

    def compile(self, tokenizer, vocab_size: int) -> "CompiledGrammar":
        """Checked against a model's tokenizer and vocabulary (an invalid grammar is a ConfigError naming the problem)."""
        from llguidance import LLMatcher

        ll = ll_tokenizer(tokenizer, vocab_size)
        text = self.llguidance()
        error = LLMatcher.validate_grammar(text, ll)
        if error:
            what = {"json_schema": "JSON schema", "regex": "regular expression", "lark": "Lark grammar"}[self.kind]
            raise ConfigError(f"invalid {what}: {_one_line(error)}")
        return CompiledGrammar(self, text, ll, vocab_size)


def _one_line(message: str) -> str:
    """llguidance's message without its source excerpts and carets, on one line."""
    lines = [ln.strip() for ln in message.splitlines()]
    keep = [ln for ln in lines if ln and not ln.startswith(("^", "|")) and not ln.split("|")[0].strip().isdigit()]
    return " ".join(keep)[:400]


@dataclass(frozen=True, eq=False)
class CompiledGrammar:
    """A grammar checked against one tokenizer and vocabulary: SamplingParams.grammar. `start(stop_ids)` gives one
    sequence's state."""

    grammar: Grammar
    text: str  # llguidance's form
    tokenizer: object  # llguidance.LLTokenizer
    vocab_size: int  # the model's (the logits' width)

    def start(self, stop_ids: Sequence[int], vocab_size: int) -> "GrammarState":
        if vocab_size != self.vocab_size:
            raise ConfigError(f"the grammar was compiled for a vocabulary of {self.vocab_size} tokens, the model has {vocab_size}")
        if not stop_ids:
            raise ConfigError("a grammar needs a stop token to end the sequence where it is complete (this one has none)")
        return GrammarState(self, stop_ids)


class GrammarState:
    """One sequence's matcher, at its committed tokens."""

    def __init__(self, grammar: CompiledGrammar, stop_ids: Sequence[int]) -> None:
        from llguidance import LLMatcher

        self.matcher = LLMatcher(grammar.tokenizer, grammar.text, log_level=0)
        if self.matcher.is_error():
            raise ConfigError(f"invalid grammar: {_one_line(self.matcher.get_error())}")
        self.vocab_size = grammar.vocab_size
        self.eos = int(grammar.tokenizer.eos_token)  # the matcher's end: allowed where the grammar accepts
        self.stop_ids = tuple(int(t) for t in stop_ids)
        self.stops = frozenset(self.stop_ids) | {self.eos}  # a path ends at any of them
        self.words = (self.vocab_size + 31) // 32  # int32 words of one row's bitmask
        self.ended = False  # a stop token was committed: the sequence is over

    def advance(self, tokens: Sequence[int]) -> None:
        """The sequence committed `tokens` (each one allowed by the mask it was drawn under); a stop token ends it."""
        for t in tokens:
            if self.ended or t in self.stops:
                self.ended = True
                return
            if not self.matcher.consume_token(int(t)):
                raise RuntimeError(f"the grammar rejects committed token {t}: a step bypassed its mask ({self.matcher.get_error()[:200]})")

    def valid_prefix(self, tokens: Sequence[int]) -> int:
        """How many of `tokens`, after the committed ones, the grammar allows in a row (a stop token counts, and ends
        them: where the grammar may end, verification decides). A draft is cut there before verification: the rows
        after its first disallowed token could never be accepted."""
        if self.ended:
            return 0
        toks = [int(t) for t in tokens]
        end = next((i for i, t in enumerate(toks) if t in self.stops), len(toks))
        n = self.matcher.try_consume_tokens(toks[:end]) if end and not self.matcher.is_stopped() else 0
        if n:
            self.matcher.rollback(n)
        return n + 1 if n == end < len(toks) else n

    def allowed(self, rows: list[list[int]]) -> tuple[Tensor, Tensor]:
        """Per row (after the committed tokens plus its path): the allowed tokens (R, V) bool, and whether the grammar is
        complete there (R,) bool (only a stop token may follow)."""
        m = self.matcher
        bits = torch.empty(len(rows), self.words, dtype=torch.int32)  # (R, W) one bit per token
        complete = torch.zeros(len(rows), dtype=torch.bool)  # (R,)
        cur: list[int] = []  # path tokens consumed beyond the committed ones
        last: list[int] | None = None  # `cur` when the previous row's mask was computed
        for r, path in enumerate(rows):
            path = list(path)
            end = next((i for i, t in enumerate(path) if t in self.stops), len(path))
            path = path[:end]  # nothing after a stop token is ever emitted
            common = 0
            while common < min(len(cur), len(path)) and cur[common] == path[common]:
                common += 1
            if common < len(cur):
                m.rollback(len(cur) - common)
                del cur[common:]
            if len(path) > common and not m.is_stopped():
                n = m.try_consume_tokens(path[common:])  # stops before a token the grammar rejects
                cur += path[common : common + n]
            if cur == last:  # the same state as the previous row (a path cut at a rejected token)
                bits[r], complete[r] = bits[r - 1], complete[r - 1]
                continue
            # llguidance.torch's fill_next_token_bitmask, called directly: importing that module compiles a function
            # with torch.compile, which imports torch._dynamo (2-3 s on a process's first grammar)
            m.unsafe_compute_mask_ptr(bits[r].data_ptr(), self.words * 4)
            complete[r] = m.is_stopped()
            last = list(cur)
        if cur:
            m.rollback(len(cur))
        unpacked = np.unpackbits(bits.numpy().view(np.uint8), axis=-1, bitorder="little")  # (R, 32 W) token t = bit t
        allowed = torch.from_numpy(unpacked).view(torch.bool)[:, : self.vocab_size]  # (R, V)
        accepting = allowed[:, self.eos].clone()  # (R,) the grammar may end here
        allowed[:, self.eos] = False
        allowed[:, list(self.stop_ids)] = accepting.unsqueeze(-1)  # the sequence's own stop ids, exactly where it may end
        return allowed, complete

    def mask(self, x: Tensor, rows: list[list[int]], raw: Tensor) -> tuple[Tensor, Tensor]:
        """x (R, V) logits -> the grammar's rows, and where it is complete (R,) bool. raw: the logits before any control.

        A drafter's row over a restricted vocabulary (raw has -inf: a draft vocabulary) that holds no allowed token keeps
        its logits: its guess is rejected by verification, lossless for any q. A target row always holds an allowed token
        (it sees the whole vocabulary); where the other controls leave it none, the caller names the conflict."""
        allowed, complete = self.allowed(rows)
        out = x.masked_fill(~allowed, float("-inf"))
        empty = ~(allowed & (x > float("-inf"))).any(-1)  # (R,)
        if bool(empty.any()):
            empty &= (raw == float("-inf")).any(-1)
            out[empty] = x[empty]
        return out, complete


_TOKENIZERS: "weakref.WeakKeyDictionary[object, dict[int, object]]" = weakref.WeakKeyDictionary()
_BUILDING = threading.Lock()  # one build at a time (the server compiles on worker threads)


def ll_tokenizer(tokenizer, vocab_size: int):
    """llguidance's tokenizer for one of ours (built once per tokenizer and vocabulary): a Gemma GGUF's SentencePiece one
    from its pieces, a Hugging Face `tokenizers` one (HF folders, other GGUF files, the demo model) from its JSON, a
    llama2.c one from its token bytes. Its EOS is our first stop id. Building one for a large vocabulary takes time
    (Gemma's 262k tokens: about 1 s), once per process."""
    with _BUILDING:
        cached = _TOKENIZERS.setdefault(tokenizer, {})
        if vocab_size not in cached:
            cached[vocab_size] = _build_tokenizer(tokenizer, vocab_size)
        return cached[vocab_size]


def _build_tokenizer(tokenizer, vocab_size: int):
    from llguidance import LLTokenizer

    stop = tuple(getattr(tokenizer, "stop_ids", ()))
    eos = stop[0] if stop else None
    own = getattr(tokenizer, "vocab_size", None)
    if own is not None and own > vocab_size:
        raise ConfigError(f"the tokenizer has {own} tokens, more than the model's vocabulary of {vocab_size}: no grammar mask fits")
    if hasattr(tokenizer, "piece_bytes"):  # mtpspec.loading.tokenizer_spm.SPMTokenizer (a Gemma GGUF's)
        from llguidance._tokenizer import TokenizerWrapper

        ll = LLTokenizer(TokenizerWrapper(_SentencePieceBytes(tokenizer, eos)), n_vocab=vocab_size, eos_token=eos)
        return ll
    hf = getattr(tokenizer, "tokenizer", None)
    if hf is not None and hasattr(hf, "to_str"):  # mtpspec.loading.tokenizer_hf.HFTokenizer
        ll = LLTokenizer(hf.to_str(), n_vocab=vocab_size, eos_token=eos)
    elif hasattr(tokenizer, "pieces") and hasattr(tokenizer, "token_bytes"):  # mtpspec.loading.tokenizer_llama2c
        from llguidance._tokenizer import TokenizerWrapper

        ll = LLTokenizer(TokenizerWrapper(_Llama2cBytes(tokenizer)), n_vocab=vocab_size, eos_token=eos)
    else:
        raise ConfigError(f"grammars need a Hugging Face or llama2.c tokenizer, this model has a {type(tokenizer).__name__}")
    return ll


class _SentencePieceBytes:
    """What llguidance's TokenizerWrapper reads of a Gemma SentencePiece tokenizer, from its pieces: a second for 262k
    tokens, where writing its `tokenizers` JSON and llguidance parsing it take 3-4 s (and the `tokenizers` form 86 MB).
    Special: what llguidance makes special when it reads that JSON (its special added tokens, the added tokens spelled
    <...>, and the byte 0xFF, llguidance's special-token marker), so every mask is the JSON path's
    (tests/test_gemma3_real.py compares them)."""

    def __init__(self, tok, eos: int | None) -> None:
        self.tok = tok
        self.tokens, added, special = tok.piece_bytes()
        marked = {i for i in added if self.tokens[i][:1] == b"<" and self.tokens[i][-1:] == b">"}
        self.special_token_ids = sorted(special | marked | {i for i, b in enumerate(self.tokens) if b == b"\xff"})
        self.bos_token_id, self.eos_token_id = tok.bos_id, eos

    def __call__(self, text: str) -> list[int]:
        if not isinstance(text, str):
            raise TypeError("text, not bytes")  # TokenizerWrapper probes with bytes: it then passes text
        return self.tok.encode_plain(text)


class _Llama2cBytes:
    """What llguidance's TokenizerWrapper reads of a tokenizer: each id's bytes (byte pieces as their byte; a piece
    after BOS keeps its leading space: a continuation rarely follows BOS), BOS / EOS / specials, and encode."""

    def __init__(self, tok) -> None:
        self.tok = tok
        self.tokens = [tok.token_bytes(-1, i) for i in range(tok.vocab_size)]
        self.bos_token_id, self.eos_token_id = tok.bos_id, tok.eos_id
        self.special_token_ids = sorted(tok.HF_SPECIALS)

    def __call__(self, text: str) -> list[int]:
        """`text` as a continuation: encode's pieces without its BOS and dummy-prefix space (llguidance tokenizes forced
        text with it)."""
        ids: list[int] = []
        for ch in text:
            b = ch.encode("utf-8")
            tid = self.tok.lookup.get(b)
            ids.extend([tid] if tid is not None else [byte + 3 for byte in b])  # byte fallback, as encode
        return self.tok._merge(ids)

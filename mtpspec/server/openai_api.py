"""The OpenAI-compatible API: /v1/completions, /v1/chat/completions, /v1/models, /health.

Requests and responses follow OpenAI's shapes, so its client libraries work unchanged. Sampling,
length, stops, seed, logprobs, `n` choices (one prefill of the prompt, choice i seeded seed + i) and
`echo` are the request's; the drafter is the server's, and how deep it drafts is the request's choice
in the extension field `mtpspec` ({"speculation": "off" | "auto" | D}; omitted: the server's --k).
Each response reports what speculation did in its own `mtpspec` field. Every request joins its model's
running batch (scheduler.Scheduler); `stream: true` answers with server-sent events. A client that
disconnects cancels its sequences. Errors are OpenAI's shape (app.error_body).
Structured output: `response_format` json_object / json_schema, or `regex` / a Lark `grammar` in the extension
field `mtpspec` (grammar.py); speculation stays lossless under it, as under every sampling control.
"""

from __future__ import annotations

import asyncio
import json
import time
import uuid
from dataclasses import dataclass, field, replace
from itertools import accumulate
from typing import Annotated, Literal

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse, StreamingResponse
from pydantic import AfterValidator, BaseModel, ConfigDict, Field, StringConstraints, model_validator

from ..api import Model
from ..engine import TokenLogprob
from ..errors import ConfigError
from ..grammar import Grammar
from ..metrics import Acceptance
from ..sampling import SamplingParams, pick_sampler
from ..chat import ChatTemplate
from .options import ServeOptions
from .scheduler import Chunk, Failed, Finished, GenRequest, Handle, QueueFull, RequestSpec, Scheduler
from .verify_page import FieldError

MAX_STOPS = 16
MAX_STOP_CHARS = 200
MAX_LOGPROBS = 20
MAX_LOGIT_BIAS = 1024  # entries of logit_bias
MAX_MESSAGES = 1024
MAX_GRAMMAR_CHARS = 100_000  # of a regular expression or a Lark grammar
DISCONNECT_POLL_S = 0.25  # how often a request in flight checks that its client is still connected


def unicode_text(text: str) -> str:
    """Reject text that is not valid Unicode (a lone surrogate, from a JSON escape like "\\ud800")."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        raise ValueError("not valid Unicode text (a lone surrogate)") from None
    return text


Text = Annotated[str, AfterValidator(unicode_text)]
Stop = Annotated[str, StringConstraints(min_length=1, max_length=MAX_STOP_CHARS), AfterValidator(unicode_text)]


class Body(BaseModel):
    """Strict JSON types (no "8" for 8, no true for 1, no 1 for true); unknown fields are errors (a misspelt
    `max_token` is not silently ignored)."""

    model_config = ConfigDict(extra="forbid", strict=True)


class StreamOptions(Body):
    include_usage: bool = False


class JsonSchemaFormat(Body):
    """response_format's json_schema (OpenAI): the output is JSON valid under `schema` (strict or not, it is enforced)."""

    name: Annotated[str, StringConstraints(min_length=1, max_length=200)]
    description: Annotated[str, StringConstraints(max_length=4000)] | None = None
    schema_: dict | None = Field(None, alias="schema")
    strict: bool | None = None


class ResponseFormat(Body):
    type: Literal["text", "json_object", "json_schema"]
    json_schema: JsonSchemaFormat | None = None


class Extension(Body):
    """The request's extension field `mtpspec`: how it speculates (the server's drafter, at a depth it chooses), and a
    regular expression or a Lark grammar the output must match."""

    speculation: Literal["off", "auto"] | Annotated[int, Field(ge=1)] | None = Field(
        None, description='"off": plain decoding; "auto": the cost model\'s depth per step; D: always D drafts; omitted: the server\'s --k')
    regex: Annotated[str, StringConstraints(min_length=1, max_length=MAX_GRAMMAR_CHARS)] | None = None
    grammar: Annotated[str, StringConstraints(min_length=1, max_length=MAX_GRAMMAR_CHARS)] | None = None


def grammar_of(req: "Sampling") -> Grammar | None:
    """The constraint a request asks for (response_format, or the extension's regex / Lark grammar), or None."""
    asked: list[tuple[str, Grammar]] = []
    fmt = req.response_format
    if fmt is not None:
        if fmt.json_schema is not None and fmt.type != "json_schema":
            raise FieldError("response_format", f'json_schema goes with type "json_schema", not {fmt.type!r}')
        if fmt.type == "json_object":
            asked.append(("response_format", Grammar.json_object()))
        elif fmt.type == "json_schema":
            if fmt.json_schema is None:
                raise FieldError("response_format", 'type "json_schema" needs json_schema: {"name": ..., "schema": {...}}')
            schema = fmt.json_schema.schema_
            asked.append(("response_format", Grammar.json_object() if schema is None else Grammar.json_schema(schema)))
    ext = req.mtpspec
    if ext is not None:
        if ext.regex is not None:
            asked.append(("mtpspec", Grammar.regex(ext.regex)))
        if ext.grammar is not None:
            asked.append(("mtpspec", Grammar.lark(ext.grammar)))
    if len(asked) > 1:
        raise FieldError(asked[-1][0], "one constraint per request: response_format json_object / json_schema, "
                         "mtpspec.regex or mtpspec.grammar")
    return asked[0][1] if asked else None


NOT_NULLABLE = ("model", "prompt", "messages")  # required by OpenAI (model too), so a null there is a client's bug


class Sampling(Body):
    """The fields both endpoints share. An explicit null is "not given" (OpenAI's rule), except in NOT_NULLABLE."""

    model: Annotated[str, StringConstraints(max_length=200)] = Field(None, description="a served model (GET /v1/models); omitted: the first")
    max_tokens: int | None = Field(None, ge=1, description="new tokens at most (default: the server's, clipped by the context)")
    temperature: float = Field(1.0, ge=0.0, le=2.0, description="0 = greedy (equals `mtpspec generate`)")
    top_p: float = Field(1.0, gt=0.0, le=1.0)
    top_k: int = Field(0, ge=-1, description="extension: keep the k most likely tokens (0 or -1 = off)")
    n: int = Field(1, ge=1, description="choices, at most the server's --max-batch: one prefill, choice i seeded seed + i")
    mtpspec: Extension | None = Field(None, description='extension: {"speculation": "off" | "auto" | D, "regex" or "grammar"}')
    stream: bool = False
    stream_options: StreamOptions | None = None
    stop: Stop | Annotated[list[Stop], Field(max_length=MAX_STOPS)] | None = None
    stop_token_ids: Annotated[list[int], Field(max_length=MAX_STOPS)] | None = Field(None, description="extension: token ids that end the text")
    seed: int | None = Field(None, ge=0, lt=2**63)
    presence_penalty: float = Field(0.0, ge=-2.0, le=2.0, description="minus this from the logit of each token generated before")
    frequency_penalty: float = Field(0.0, ge=-2.0, le=2.0, description="minus this times the count of each token generated before")
    logit_bias: Annotated[dict[str, float], Field(max_length=MAX_LOGIT_BIAS)] | None = Field(
        None, description='{"token id": bias in [-100, 100]} added to the logits')
    min_p: float = Field(0.0, ge=0.0, le=1.0, description="extension (vLLM): drop tokens less likely than min_p x the most likely")
    repetition_penalty: float = Field(1.0, gt=0.0, allow_inf_nan=False,
                                      description="extension (vLLM): logits of prompt and generated tokens divided (> 0) or multiplied (< 0) by it")
    min_tokens: int = Field(0, ge=0, description="extension (vLLM): no end-of-text or stop_token_ids token before this many")
    sampler: Literal["auto", "gumbel", "rejection"] = Field(
        "auto", description="extension: gumbel, one text per seed whatever speculates; auto: gumbel when seeded and sampling")
    response_format: ResponseFormat | None = Field(None, description="text, json_object or json_schema: the output matches it")
    user: Annotated[str, StringConstraints(max_length=256)] | None = None

    @model_validator(mode="before")
    @classmethod
    def _null_is_not_given(cls, data):
        if isinstance(data, dict):
            return {k: v for k, v in data.items() if v is not None or k in NOT_NULLABLE}
        return data


class CompletionRequest(Sampling):
    prompt: Text | Annotated[list[int], Field(min_length=1)] | Annotated[list[Text], Field(min_length=1, max_length=1)]
    logprobs: int | None = Field(None, ge=0, le=MAX_LOGPROBS, description="log p of each token and of the n most likely")
    echo: bool = Field(False, description="the prompt in front of each choice's text (with logprobs: its tokens' too)")
    best_of: int | None = Field(None, ge=1, description="only equal to n (choices are not ranked)")
    suffix: None = None


class Message(Body):
    role: Literal["system", "user", "assistant", "tool", "developer"]
    content: Text | list[dict] | None = None
    name: Annotated[str, StringConstraints(max_length=200)] | None = None
    tool_calls: Annotated[list[dict], Field(max_length=64)] | None = None  # given to the template as they are
    tool_call_id: Annotated[str, StringConstraints(max_length=200)] | None = None


class ChatRequest(Sampling):
    messages: Annotated[list[Message], Field(min_length=1, max_length=MAX_MESSAGES)]
    max_completion_tokens: int | None = Field(None, ge=1)
    logprobs: bool = False
    top_logprobs: int | None = Field(None, ge=0, le=MAX_LOGPROBS)


# What a request's field must be, in plain words, for the 400 that names it (app.validation_message): the
# validation library's own wording (union branches, "should be <= 0") is not the client's vocabulary.
_SHARED_RULES = {
    "model": "must be a served model's name, a string (GET /v1/models lists them); omit it for the server's first",
    "max_tokens": "must be an integer >= 1",
    "temperature": "must be a number in [0, 2]",
    "top_p": "must be a number in (0, 1]",
    "top_k": "must be an integer >= -1 (0 or -1: off)",
    "stream": "must be true or false",
    "stream_options": 'must be an object {"include_usage": true or false}',
    "include_usage": "must be true or false",
    "stop": f"must be a non-empty string of at most {MAX_STOP_CHARS} characters, or a list of at most {MAX_STOPS} such strings",
    "stop_token_ids": f"must be a list of at most {MAX_STOPS} token ids (integers)",
    "seed": "must be an integer in [0, 2**63)",
    "user": "must be a string of at most 256 characters",
    "n": "must be an integer >= 1 (and at most the server's --max-batch)",
    "speculation": 'must be "off", "auto" or a draft depth D (an integer >= 1)',
    "presence_penalty": "must be a number in [-2, 2]",
    "frequency_penalty": "must be a number in [-2, 2]",
    "logit_bias": f'must be an object {{"token id": bias}} of at most {MAX_LOGIT_BIAS} entries, each bias a number in [-100, 100]',
    "min_p": "must be a number in [0, 1]",
    "repetition_penalty": "must be a finite number > 0 (1: off)",
    "min_tokens": "must be an integer >= 0",
    "sampler": 'must be "auto", "gumbel" or "rejection"',
    "response_format": 'must be {"type": "text"}, {"type": "json_object"} or {"type": "json_schema", "json_schema": '
                       '{"name": ..., "schema": {...}, "strict": true}}',
    "type": "must be text, json_object or json_schema",
    "json_schema": 'must be an object {"name": ..., "schema": {...}, "strict": true or false}',
    "schema": "must be a JSON schema (an object)",
    "strict": "must be true or false",
    "description": "must be a string",
    "mtpspec": 'must be an object with "speculation" ("off" | "auto" | D) and at most one of "regex" and "grammar"',
    "regex": f"must be a regular expression, a string of 1 to {MAX_GRAMMAR_CHARS} characters",
    "grammar": f"must be a Lark grammar, a string of 1 to {MAX_GRAMMAR_CHARS} characters",
}
RULES = {  # route -> field -> "must be ..." (said after the field's name) or a whole message (it starts with the name)
    "/v1/completions": {
        **_SHARED_RULES,
        "prompt": "must be a string, a list of token ids (integers) or a list holding one string",
        "logprobs": f"must be an integer in [0, {MAX_LOGPROBS}]",
        "echo": "must be true or false",
        "best_of": "must be an integer >= 1, equal to n",
        "suffix": "suffix is not supported; omit it",
    },
    "/v1/chat/completions": {
        **_SHARED_RULES,
        "messages": f"must be a list of 1 to {MAX_MESSAGES} messages, each an object {{role, content}}",
        "role": "must be one of system, user, assistant, tool, developer",
        "content": 'must be a string, a list of {"type": "text", "text": ...} parts, or null',
        "name": "must be a string of at most 200 characters",
        "tool_call_id": "must be a string of at most 200 characters",
        "tool_calls": "must be a list of at most 64 objects",
        "max_completion_tokens": "must be an integer >= 1",
        "logprobs": "must be true or false",
        "top_logprobs": f"must be an integer in [0, {MAX_LOGPROBS}]",
    },
}


@dataclass
class Output:
    """What the HTTP side has made of a request's tokens so far: text (stops applied), tokens, logprobs."""

    model: Model
    prompt: list[int]
    stops: tuple[str, ...]
    want_logprobs: bool
    text: str = ""
    tokens: list[int] = field(default_factory=list)
    logprobs: list[tuple[TokenLogprob | None, str, int]] = field(default_factory=list)  # (log-probs, token text, text offset)
    held: str = ""  # decoded text not yet sent: it may be the start of a stop string
    stopped: bool = False
    started: bool = False  # an event of this choice has come (the echo goes in front of its first)

    def __post_init__(self) -> None:
        self.stream = self.model.tokenizer.stream(prev=self.prompt[-1])
        self.hold = max((len(s) for s in self.stops), default=1) - 1
        self.prev = self.prompt[-1]

    def echo(self, echo: "Echo", lps: list[TokenLogprob] | None) -> str:
        """The prompt in front of the text (before any token): returns it. With logprobs, the prompt tokens' rows
        first, each at its offset in the echoed text; the first token's log p is null (nothing comes before it)."""
        self.text = echo.text
        if self.want_logprobs:
            offsets = list(accumulate((len(p) for p in echo.pieces[:-1]), initial=0))
            rows = [None, *(lps or [])]
            self.logprobs = [(lp, piece, off) for lp, piece, off in zip(rows, echo.pieces, offsets)]
        return echo.text

    def push(self, chunk: Chunk) -> str:
        """The chunk's tokens in; returns the text that may be sent now (never part of a stop string)."""
        for i, t in enumerate(chunk.tokens):
            if self.stopped:
                break
            self.tokens.append(t)
            if self.want_logprobs:
                self.logprobs.append((chunk.logprobs[i], self.model.tokenizer.decode([t], prev=self.prev), len(self.text) + len(self.held)))
            self.prev = t
            self.held += self.stream.push([t])
            self._scan()
        return self._release()

    def flush(self) -> str:
        if not self.stopped:
            self.held += self.stream.flush()
            self._scan()
        if not self.stopped:
            out, self.held = self.held, ""
            self.text += out
            return out
        return self._release()

    def _scan(self) -> None:
        cut = min((i for i in (self.held.find(s) for s in self.stops) if i >= 0), default=-1)
        if cut >= 0:
            self.held, self.stopped = self.held[:cut], True

    def _release(self) -> str:
        keep = 0 if self.stopped else min(self.hold, len(self.held))
        out = self.held[: len(self.held) - keep]
        self.held = self.held[len(out):]
        self.text += out
        return out

    def rows(self, final: bool) -> int:
        """Log-prob rows of the text released so far: the tokens whose text starts in it (a held-back token may
        turn out to be part of a stop string; then it is never sent), and at the end without a stop, all."""
        if final and not self.stopped:
            return len(self.logprobs)
        return sum(1 for _, _, offset in self.logprobs if offset < len(self.text))  # offsets never decrease


@dataclass(frozen=True)
class Echo:
    """What `echo: true` puts in front of each choice: the prompt's text, and each prompt token's text (logprobs rows)."""

    text: str
    pieces: list[str]

    @classmethod
    def of(cls, model: Model, prompt, ids: list[int]) -> "Echo":
        """The prompt as sent (text), or its ids decoded; a leading BOS is no text. Each token decoded after the one
        before it, as generated tokens are."""
        tok = model.tokenizer
        pieces = ["" if ids[0] == getattr(tok, "bos_id", None) else tok.decode([ids[0]], prev=None)]
        pieces += [tok.decode([t], prev=p) for p, t in zip(ids, ids[1:])]
        return cls(prompt if isinstance(prompt, str) else "".join(pieces), pieces)


@dataclass
class Answer:
    """One request's answer in the making: an Output per choice, its echo, its speculation and its ids."""

    outs: list[Output]
    echo: Echo | None
    spec: RequestSpec
    rid: str
    created: int
    name: str
    chat: bool

    def start(self, event: Chunk | Finished) -> str | None:
        """Before the event is read: on its choice's first event, with echo, the prompt goes in front (returned)."""
        out = self.outs[event.index]
        if out.started:
            return None
        out.started = True
        return None if self.echo is None else out.echo(self.echo, event.prompt_logprobs)


def _stops(stop) -> tuple[str, ...]:
    if stop is None:
        return ()
    return (stop,) if isinstance(stop, str) else tuple(stop)


def _counts(acc: Acceptance) -> dict:
    return {"target_forwards": acc.forwards, "drafted": acc.drafted, "accepted": acc.accepted,
            "mean_accepted_length": round(acc.mean_accepted_length, 4) if acc.forwards else None,
            "acceptance_by_position": [None if a is None else round(a, 4) for a in acc.by_position()]}


def stats_field(results: list, spec: RequestSpec) -> dict:
    """The extension field `mtpspec`: the request's speculation and what it did. n > 1: the counts summed over the
    choices, and `choices`, each one's own counts and engine finish reason."""
    accs = [Acceptance.from_steps(r.steps) for r in results]
    total = sum(accs[1:], accs[0])
    if len(results) == 1:
        return {**spec.describe(), **_counts(total), "engine_finish_reason": results[0].finish_reason}
    return {**spec.describe(), **_counts(total),
            "choices": [{"index": i, **_counts(a), "engine_finish_reason": r.finish_reason} for i, (a, r) in enumerate(zip(accs, results))]}


def _finish_reason(out: Output, reason: str) -> str:
    return "stop" if out.stopped or reason == "stop" else "length"


def _completion_logprobs(out: Output, start: int, end: int) -> dict | None:
    if not out.want_logprobs:
        return None
    rows = out.logprobs[start:end]
    tok = out.model.tokenizer
    return {"tokens": [text for _, text, _ in rows], "token_logprobs": [None if lp is None else lp.logprob for lp, _, _ in rows],
            "top_logprobs": [None if lp is None else {tok.decode([i], prev=None): v for i, v in lp.top} for lp, _, _ in rows],
            "text_offset": [off for _, _, off in rows]}


def _chat_logprobs(out: Output, start: int, end: int) -> dict | None:
    if not out.want_logprobs:
        return None
    rows = out.logprobs[start:end]
    tok = out.model.tokenizer

    def entry(text: str, lp: float) -> dict:
        return {"token": text, "logprob": lp, "bytes": list(text.encode("utf-8"))}

    return {"content": [{**entry(text, lp.logprob), "top_logprobs": [entry(tok.decode([i], prev=None), v) for i, v in lp.top]}
                        for lp, text, _ in rows]}


def _usage(outs: list[Output], first: Finished) -> dict:
    """The prompt counted once (one prefill serves every choice), the completions summed; cached_tokens: the prompt
    positions the first choice's prefill copied from a kept prefix (prefix.py) instead of computing them."""
    prompt, completion = len(outs[0].prompt), sum(len(o.tokens) for o in outs)
    cached = first.result.stats.cached_tokens
    return {"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion,
            "prompt_tokens_details": {"cached_tokens": cached}}


def _sse(obj) -> bytes:
    return f"data: {json.dumps(obj, ensure_ascii=False)}\n\n".encode("utf-8")


def create_router(served, schedulers: dict[str, Scheduler], options: ServeOptions) -> APIRouter:
    router = APIRouter()
    templates = {name: ChatTemplate.for_tokenizer(m.tokenizer) for name, m in served.models.items()}  # a broken one stops start-up

    def model_of(name: str | None) -> tuple[str, Model, Scheduler]:
        name, model = served.model(name)
        return name, model, schedulers[name]

    async def constrained(gen: GenRequest, req: Sampling, model: Model) -> GenRequest:
        """gen with the request's constraint compiled against the model's tokenizer, off the event loop (a large
        vocabulary's first grammar builds llguidance's tokenizer: seconds). Called after every cheap check, so a
        request that fails one is answered without waiting for a compile."""
        grammar = grammar_of(req)
        if grammar is None:
            return gen
        try:
            compiled = await asyncio.to_thread(grammar.compile, model.tokenizer, model.module.vocab_size)
        except ConfigError as e:
            raise FieldError("response_format" if req.response_format is not None else "mtpspec", str(e)) from None
        return replace(gen, params=replace(gen.params, grammar=compiled))

    def request_of(req: Sampling, model: Model, sched: Scheduler, prompt: list[int], logprobs: int | None, max_tokens: int | None,
                   prompt_logprobs: int | None = None) -> GenRequest:
        ctx = model.max_seq_len
        if len(prompt) >= ctx:
            raise FieldError("prompt" if isinstance(req, CompletionRequest) else "messages",
                             f"{len(prompt)} tokens, the model's context is {ctx}: no room for a new token", status=400)
        vocab = model.module.vocab_size
        for t in req.stop_token_ids or ():
            if not 0 <= t < vocab:
                raise FieldError("stop_token_ids", f"token id {t} is outside the vocabulary [0, {vocab})")
        top_k = max(req.top_k, 0)
        bias = {}
        for key, b in (req.logit_bias or {}).items():
            if not (key.isascii() and key.isdigit()) or not 0 <= int(key) < vocab:
                raise FieldError("logit_bias", f"key {key[:40]!r} is not a token id in the vocabulary [0, {vocab})")
            if not -100.0 <= b <= 100.0:
                raise FieldError("logit_bias", f"the bias of token {key} must be a number in [-100, 100], got {b:g}")
            bias[int(key)] = b
        if max_tokens is not None and req.min_tokens > max_tokens:
            raise FieldError("min_tokens", f"{req.min_tokens} is more than the max_tokens asked for ({max_tokens})")
        params = SamplingParams(temperature=float(req.temperature), top_k=top_k, top_p=float(req.top_p), min_p=float(req.min_p),
                                repetition_penalty=float(req.repetition_penalty), frequency_penalty=float(req.frequency_penalty),
                                presence_penalty=float(req.presence_penalty), logit_bias=bias, min_tokens=req.min_tokens,
                                sampler=pick_sampler(req.sampler, float(req.temperature), seeded=req.seed is not None))
        if req.n > options.max_batch:
            raise FieldError("n", f"{req.n} choices; the server runs at most {options.max_batch} sequences together (its --max-batch)")
        asked = req.mtpspec.speculation if req.mtpspec is not None else None
        if isinstance(asked, int):
            if sched.max_k == 0:
                raise FieldError("mtpspec", f'speculation: model {sched.name!r} is served without a drafter (--drafter none): '
                                 'send "off" or "auto", or omit it')
            if asked > sched.max_k:
                raise FieldError("mtpspec", f'speculation: D = {asked} is deeper than the served drafter allows here ({sched.max_k}); '
                                 f'send 1..{sched.max_k}, "auto" or "off"')
        want = max_tokens if max_tokens is not None else options.max_tokens_default
        return GenRequest(prompt, params, min(want, ctx + 1 - len(prompt)), req.seed, tuple(req.stop_token_ids or ()), logprobs,
                          req.n, asked, prompt_logprobs)

    async def run(request: Request, req: Sampling, name: str, model: Model, sched: Scheduler, gen: GenRequest, chat: bool,
                  echo: Echo | None = None):
        if req.stream_options is not None and not req.stream:
            raise FieldError("stream_options", "only with stream: true (send stream: true, or omit stream_options)")
        gen = await constrained(gen, req, model)
        try:
            handle = sched.submit(gen)
        except QueueFull as e:
            raise Busy(str(e)) from None
        answer = Answer([Output(model, gen.prompt, _stops(req.stop), gen.logprobs is not None) for _ in range(gen.n)], echo,
                        sched.request_spec(gen.speculation), ("chatcmpl-" if chat else "cmpl-") + uuid.uuid4().hex[:24],
                        int(time.time()), name, chat)
        if req.stream:
            return StreamingResponse(_stream(request, handle, answer, req),
                                     media_type="text/event-stream", headers={"cache-control": "no-cache"})
        return await _whole(request, handle, answer)

    @router.post("/v1/completions")
    async def completions(request: Request, req: CompletionRequest):
        name, model, sched = model_of(req.model)
        prompt = req.prompt[0] if isinstance(req.prompt, list) and req.prompt and isinstance(req.prompt[0], str) else req.prompt
        if isinstance(prompt, str):
            if len(prompt) > options.max_prompt_chars:
                raise FieldError("prompt", f"{len(prompt)} characters, the server's limit is {options.max_prompt_chars}", status=400)
            ids = model.encode(prompt)
        else:
            vocab = model.module.vocab_size
            bad = [t for t in prompt if not 0 <= t < vocab]
            if bad:
                raise FieldError("prompt", f"token id {bad[0]} is outside the vocabulary [0, {vocab})")
            ids = list(prompt)
        if not ids:
            raise FieldError("prompt", "holds no token")
        if req.best_of is not None and req.best_of != req.n:
            raise FieldError("best_of", f"{req.best_of} is not n ({req.n}): choices are not ranked, every one is returned; "
                             "send best_of equal to n, or omit it")
        echo = Echo.of(model, prompt, ids) if req.echo else None
        gen = request_of(req, model, sched, ids, req.logprobs, req.max_tokens, req.logprobs if req.echo else None)
        return await run(request, req, name, model, sched, gen, chat=False, echo=echo)

    @router.post("/v1/chat/completions")
    async def chat(request: Request, req: ChatRequest):
        name, model, sched = model_of(req.model)
        messages = [m.model_dump(exclude_none=True) for m in req.messages]
        chars = sum(len(m.get("content") or "") if isinstance(m.get("content"), str) else len(json.dumps(m.get("content"))) for m in messages)
        if chars > options.max_prompt_chars:
            raise FieldError("messages", f"{chars} characters, the server's limit is {options.max_prompt_chars}", status=400)
        try:
            ids = templates[name].prompt_ids(model, messages)
        except ConfigError as e:
            raise FieldError("messages", str(e).removeprefix("messages: ")) from None
        top = (req.top_logprobs or 0) if req.logprobs else None
        if req.top_logprobs and not req.logprobs:
            raise FieldError("top_logprobs", "needs logprobs: true")
        max_tokens = req.max_completion_tokens if req.max_completion_tokens is not None else req.max_tokens
        gen = request_of(req, model, sched, ids, top, max_tokens)
        return await run(request, req, name, model, sched, gen, chat=True)

    @router.get("/v1/models")
    async def models() -> dict:
        created = int(time.time())
        return {"object": "list", "data": [{"id": n, "object": "model", "created": created, "owned_by": "mtpspec",
                                             "max_model_len": m.max_seq_len,
                                             "mtpspec": {**schedulers[n].spec.describe(), "max_depth": schedulers[n].max_k}}
                                            for n, m in served.models.items()]}

    @router.api_route("/health", methods=["GET", "HEAD"])
    async def health() -> dict:
        return {"status": "ok", "models": {n: {"running": len(s.engine.running), "waiting": s.queue_length()} for n, s in schedulers.items()}}

    async def _events(request: Request, handle: Handle, n: int):
        """The request's events, until each of its n choices has finished (or it failed); a disconnected client cancels
        its sequences. The connection is checked every DISCONNECT_POLL_S whether events come or not: a long answer
        emits a chunk every step, never a quiet moment."""
        loop = asyncio.get_running_loop()
        check_at = loop.time() + DISCONNECT_POLL_S
        left = n
        while True:
            try:
                event = await asyncio.wait_for(handle.events.get(), timeout=DISCONNECT_POLL_S)
            except asyncio.TimeoutError:
                event = None
            if loop.time() >= check_at:
                if await request.is_disconnected():
                    handle.cancel()
                    return
                check_at = loop.time() + DISCONNECT_POLL_S
            if event is None:
                continue
            yield event
            left -= isinstance(event, Finished)
            if isinstance(event, Failed) or left == 0:
                return

    async def _whole(request, handle, answer: Answer):
        results: dict[int, Finished] = {}
        n = len(answer.outs)
        try:
            async for event in _events(request, handle, n):
                if isinstance(event, Failed):
                    return JSONResponse(error_body(f"generation failed: {event.message}", "server_error"), status_code=500)
                answer.start(event)
                out = answer.outs[event.index]
                if isinstance(event, Chunk):
                    out.push(event)
                    if out.stopped:
                        handle.cancel(event.index)
                else:
                    results[event.index] = event
        finally:
            if len(results) < n:
                handle.cancel()
        if len(results) < n:  # the client went away: nobody reads this
            return JSONResponse(error_body("client disconnected", "invalid_request_error"), status_code=499)
        choices = []
        for i, out in enumerate(answer.outs):
            out.flush()
            reason = _finish_reason(out, results[i].reason)
            if answer.chat:
                choices.append({"index": i, "message": {"role": "assistant", "content": out.text},
                                "logprobs": _chat_logprobs(out, 0, out.rows(True)), "finish_reason": reason})
            else:
                choices.append({"index": i, "text": out.text, "logprobs": _completion_logprobs(out, 0, out.rows(True)), "finish_reason": reason})
        body = {"id": answer.rid, "created": answer.created, "model": answer.name, "usage": _usage(answer.outs, results[0]),
                "mtpspec": stats_field([results[i].result for i in range(n)], answer.spec)}
        return {"object": "chat.completion" if answer.chat else "text_completion", **body, "choices": choices}

    async def _stream(request, handle, answer: Answer, req):
        chat, outs = answer.chat, answer.outs
        head = {"id": answer.rid, "object": "chat.completion.chunk" if chat else "text_completion", "created": answer.created,
                "model": answer.name}

        def chunk(i: int, text: str, start: int, end: int, reason=None, extra=None) -> bytes:
            if chat:
                choice = {"index": i, "delta": {"content": text} if text or reason is None else {},
                          "logprobs": _chat_logprobs(outs[i], start, end), "finish_reason": reason}
            else:
                choice = {"index": i, "text": text, "logprobs": _completion_logprobs(outs[i], start, end), "finish_reason": reason}
            return _sse({**head, "choices": [choice], **(extra or {})})

        include_usage = bool(req.stream_options and req.stream_options.include_usage)
        done = False
        try:
            if chat:
                for i in range(len(outs)):
                    yield _sse({**head, "choices": [{"index": i, "delta": {"role": "assistant", "content": ""}, "logprobs": None,
                                                     "finish_reason": None}]})
            sent = [0] * len(outs)  # each choice's logprob rows already sent
            results: dict[int, Finished] = {}
            async for event in _events(request, handle, len(outs)):
                if isinstance(event, Failed):
                    yield _sse(error_body(f"generation failed: {event.message}", "server_error"))
                    done = True
                    return
                i = event.index
                echoed = answer.start(event)
                if echoed is not None:  # the prompt first (echo), its rows with it
                    sent[i] = outs[i].rows(False)
                    yield chunk(i, echoed, 0, sent[i])
                out = outs[i]
                if isinstance(event, Chunk):
                    text = out.push(event)
                    if out.stopped:
                        handle.cancel(i)
                    if text:  # the rows of the text sent, no more: the whole answer's rows, chunk by chunk
                        end = out.rows(False)
                        yield chunk(i, text, sent[i], end)
                        sent[i] = end
                    continue
                results[i] = event
                text = out.flush()
                extra = None
                if len(results) == len(outs):  # the last choice to end: the request's usage and speculation
                    extra = {"mtpspec": stats_field([results[j].result for j in range(len(outs))], answer.spec)}
                    if not include_usage:
                        extra["usage"] = _usage(outs, results[0])
                yield chunk(i, text, sent[i], out.rows(True), _finish_reason(out, event.reason), extra)
                if extra is not None:
                    if include_usage:
                        yield _sse({**head, "choices": [], "usage": _usage(outs, results[0])})
                    yield b"data: [DONE]\n\n"
                    done = True
        finally:
            if not done:  # the client went away mid-stream (the generator is closed): free the slots
                handle.cancel()

    return router


class Busy(Exception):
    """The model's queue is full: 429 with Retry-After."""


def error_body(message: str, kind: str = "invalid_request_error", param: str | None = None, code: str | None = None) -> dict:
    """OpenAI's error shape."""
    text = message.encode("utf-8", "backslashreplace").decode("utf-8")
    if len(text) > 500:
        text = text[:497] + "..."
    return {"error": {"message": text, "type": kind, "param": param, "code": code}}

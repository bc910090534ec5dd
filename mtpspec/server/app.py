"""The HTTP server (FastAPI): an OpenAI-compatible API and the live verify page, over the models it was started with.

    POST /v1/completions, /v1/chat/completions   generation on the batched engine (openai_api.py)
    GET  /v1/models, /health, /metrics           the served models, liveness, Prometheus metrics
    GET  /                 the verify page (one self-contained HTML file, no network)
    GET  /api/health       {"ok": true}
    GET  /api/models       the served models and draft models, by name
    POST /api/load         {"model"?: NAME} -> vocab, context, the drafters offered (nothing is loaded: all was at start-up)
    POST /api/verify       one greedy verification round of a typed or proposed draft (or a proposed token tree)
    POST /api/step         a real speculative run, every round laid out (for the step-through; a token tree's nodes too)

Requests name models by NAME only; no request makes the server open a path. Every bad input answers
4xx in OpenAI's error shape {"error": {"message": "FIELD: ...", "type", "param", "code"}}; the server
keeps running. See docs/serving.md and docs/visualize.md.
"""

from __future__ import annotations

import asyncio
import hmac
import json
import re
from contextlib import asynccontextmanager
from importlib import resources
from typing import Annotated

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import HTMLResponse, JSONResponse, Response
from pydantic import AfterValidator, BaseModel, ConfigDict, Field, StringConstraints
from starlette.exceptions import HTTPException as StarletteHTTPException

from ..cli import auto_drafter
from ..drafters import KNOWN
from ..errors import ConfigError, MtpspecError
from .metrics import ServerMetrics
from .openai_api import RULES, Busy, create_router, error_body, unicode_text as _unicode
from .options import ServeOptions
from .registry import Served
from .scheduler import Scheduler, Speculation
from ..tree import MAX_BEAM
from .verify_page import MAX_DRAFT, MAX_NEW_TOKENS, MAX_TOP_K, MAX_TREE, FieldError, step_through, verify_draft

MAX_BODY = 1 << 20  # bytes in a request body
MAX_PREFIX_CHARS = 50_000  # then tokenised and checked against the model's context
MAX_DRAFT_CHARS = 2_000  # a draft is at most MAX_DRAFT tokens
RETRY_AFTER_S = 1  # seconds a refused (429) client is told to wait


def _text(max_chars: int):
    return Annotated[str, StringConstraints(max_length=max_chars), AfterValidator(_unicode)]


Name = _text(200)


class Body(BaseModel):
    """Strict JSON bodies: wrong types and unknown fields are 422 errors naming the field."""

    model_config = ConfigDict(extra="forbid", strict=True)


class ModelRef(Body):
    model: Name | None = Field(None, description="a served model's name (GET /api/models); default: the server's first")


class VerifyRequest(ModelRef):
    prefix: _text(MAX_PREFIX_CHARS) = Field(..., description="text the model continues (BOS is added)")
    draft: _text(MAX_DRAFT_CHARS) | None = Field(None, description="typed continuation, tokenised after the prefix")
    draft_ids: Annotated[list[int], Field(max_length=MAX_DRAFT)] | None = Field(None, description="draft as token ids (takes precedence over draft)")
    drafter: Name | None = Field(None, description="let a drafter propose when no draft is given: ngram | draft | mtp | eagle | medusa")
    k: int = Field(4, ge=1, le=MAX_DRAFT, description="draft length D for a proposing drafter")
    draft_model: Name | None = Field(None, description="a served draft model's (or head's) name")
    top_k: int = Field(10, ge=1, le=MAX_TOP_K, description=f"entries of each position's distribution returned (1..{MAX_TOP_K})")
    tree: int = Field(0, ge=0, le=MAX_TREE, description="a proposing drafter's token tree of at most this many nodes (0 = a chain)")
    tree_beam: int = Field(1, ge=1, le=MAX_BEAM, description="a tree's nodes expanded per level (mtp, eagle, draft)")


class StepRequest(ModelRef):
    prefix: _text(MAX_PREFIX_CHARS)
    drafter: Name = "ngram"
    k: int = Field(4, ge=1, le=MAX_DRAFT)
    draft_model: Name | None = None
    max_new_tokens: int = Field(32, ge=1, le=MAX_NEW_TOKENS)
    tree: int = Field(0, ge=0, le=MAX_TREE, description=f"a token tree of at most this many nodes (0..{MAX_TREE}; 0 = a chain)")
    tree_beam: int = Field(1, ge=1, le=MAX_BEAM, description="a tree's nodes expanded per level (mtp, eagle, draft)")


def create_app(served: Served, options: ServeOptions | None = None) -> FastAPI:
    """The app over `served` (registry.load_served): one engine thread per model (scheduler.Scheduler) serving the
    OpenAI API in continuous batches, and the verify page's work run on the same thread between steps."""
    options = options or ServeOptions()
    metrics = ServerMetrics()
    schedulers = {name: Scheduler(name, model, speculation(served, name, options), options.max_batch, options.max_queue,
                                  options.prefill_chunk, metrics, exact=options.exact, prefix_cache=options.prefix_cache)
                  for name, model in served.models.items()}

    @asynccontextmanager
    async def lifespan(app: FastAPI):
        yield
        for s in schedulers.values():
            s.close()

    app = FastAPI(title="mtpspec", description="Lossless speculative decoding: an OpenAI-compatible API and the verify page.",
                  lifespan=lifespan)
    app.state.schedulers, app.state.metrics, app.state.options = schedulers, metrics, options
    # outermost last: every answer is counted (401, 413 and 415 too), the size is checked before the key, the key
    # before the content type
    app.add_middleware(JsonOnly)
    app.add_middleware(ApiKey, key=options.api_key)
    app.add_middleware(BodyLimit, limit=MAX_BODY)
    app.add_middleware(RequestCounter, metrics=metrics)
    _error_handlers(app)
    app.include_router(create_router(served, schedulers, options))

    async def on_worker(name: str, fn):
        """fn() on model `name`'s engine thread, between two decode steps."""
        return await asyncio.wrap_future(schedulers[name].run_job(fn))

    @app.api_route("/", methods=["GET", "HEAD"], response_class=HTMLResponse)
    async def page() -> HTMLResponse:
        return HTMLResponse(resources.files("mtpspec.server").joinpath("static/verify.html").read_text(encoding="utf-8"))

    @app.api_route("/api/health", methods=["GET", "HEAD"])
    async def health() -> dict:
        return {"ok": True}

    @app.get("/metrics")
    async def prometheus() -> Response:
        metrics.queue(sum(s.queue_length() for s in schedulers.values()))  # gauges read at scrape time, over every model
        metrics.running(sum(len(s.engine.running) for s in schedulers.values()))
        body, kind = metrics.render()
        return Response(body, media_type=kind)

    @app.get("/api/models")
    async def models() -> dict:
        return {
            "models": [{"name": n, "vocab_size": m.module.vocab_size, "max_seq_len": m.module.max_seq_len} for n, m in served.models.items()],
            "draft_models": [{"name": e.name, "kind": e.kind} for e in served.drafts.values()],
            "default": served.default, "max_draft": MAX_DRAFT, "max_top_k": MAX_TOP_K, "max_new_tokens": MAX_NEW_TOKENS,
            "max_tree": MAX_TREE,
        }

    @app.post("/api/load")
    async def model_info(req: ModelRef) -> dict:
        name, model = served.model(req.model)
        return {"model": name, "vocab_size": model.module.vocab_size, "max_seq_len": model.module.max_seq_len,
                "drafters": served.menus[name], "max_draft": MAX_DRAFT}

    @app.post("/api/verify")
    async def verify(req: VerifyRequest) -> dict:
        name, model = served.model(req.model)
        proposing = req.draft_ids is None and not req.draft and req.drafter
        if req.draft_model is not None and not proposing:
            raise FieldError("draft_model", "is used only when a drafter proposes the draft (no draft, no draft_ids)")

        def work():
            dm = served.draft_for(name, req.drafter, req.draft_model) if proposing else None
            return verify_draft(model, req.prefix, draft=req.draft, draft_ids=req.draft_ids, drafter=req.drafter or None,
                                k=req.k, draft_model=dm, top_k=req.top_k, tree=req.tree, tree_beam=req.tree_beam)

        return await on_worker(name, work)

    @app.post("/api/step")
    async def step(req: StepRequest) -> dict:
        name, model = served.model(req.model)

        def work():
            dm = served.draft_for(name, req.drafter, req.draft_model)
            return step_through(model, req.prefix, req.drafter, req.k, req.max_new_tokens, draft_model=dm, tree=req.tree,
                                tree_beam=req.tree_beam)

        return await on_worker(name, work)

    return app


def speculation(served: Served, name: str, options: ServeOptions) -> Speculation:
    """What model `name` drafts with: --drafter (auto: cli.auto_drafter, its own MTP head, else n-gram lookup) and the first
    served draft model or head that fits it; a drafter that fits no served draft model is a start-up error."""
    drafter = options.drafter
    if drafter not in KNOWN + ("auto",):
        raise ConfigError(f"--drafter: unknown drafter {drafter!r} (choose from: auto, {', '.join(KNOWN)})")
    if options.mtp_lookup and drafter not in ("mtp", "auto"):
        raise ConfigError(f"--mtp-lookup is an option of --drafter mtp (or auto), not of --drafter {drafter}")
    menu = {d["name"]: d for d in served.menus[name]}
    if drafter == "auto":  # the one rule, shared with `mtpspec generate`
        drafter = auto_drafter(served.models[name].module)
    opts = (("mtp_lookup", options.mtp_lookup),) if options.mtp_lookup and drafter == "mtp" else ()  # (auto's n-gram: no)
    if drafter in ("none", "ngram") or menu[drafter]["own"]:
        return Speculation(drafter, None, options.k, opts)
    fits = menu[drafter]["draft_models"]
    if not fits:
        raise ConfigError(f"--drafter {drafter}: model {name!r}: {menu[drafter]['reason']}")
    return Speculation(drafter, served.drafts[fits[0]].obj, options.k, opts)


def _one_line(text: str, limit: int = 500) -> str:
    """An error message safe to put in JSON (no lone surrogates) and short."""
    text = text.encode("utf-8", "backslashreplace").decode("utf-8")
    return text if len(text) <= limit else text[: limit - 3] + "..."


_KIND = {400: "invalid_request_error", 401: "authentication_error", 404: "not_found_error", 405: "invalid_request_error",
         413: "invalid_request_error", 415: "invalid_request_error", 422: "invalid_request_error", 429: "rate_limit_error"}


def _error(message: str, status: int, headers: dict | None = None, param: str | None = None) -> JSONResponse:
    """Every error, on every route: OpenAI's shape {"error": {"message", "type", "param", "code"}}."""
    return JSONResponse(error_body(message, _KIND.get(status, "server_error"), param, str(status)), status_code=status, headers=headers)


def _error_handlers(app: FastAPI) -> None:
    @app.exception_handler(MtpspecError)
    async def _bad_input(request: Request, exc: MtpspecError) -> JSONResponse:
        if isinstance(exc, FieldError):
            return _error(str(exc), exc.status, param=exc.field)
        return _error(str(exc), 400)

    @app.exception_handler(Busy)
    async def _busy(request: Request, exc: Busy) -> JSONResponse:
        return _error(f"server busy: {exc}; retry later", 429, headers={"retry-after": str(RETRY_AFTER_S)})

    @app.exception_handler(RequestValidationError)
    async def _bad_request(request: Request, exc: RequestValidationError) -> JSONResponse:
        message, param = validation_message(exc.errors(), exc.body, RULES.get(request.url.path, {}))
        return _error(message, 400, param=param)

    @app.exception_handler(StarletteHTTPException)
    async def _http(request: Request, exc: StarletteHTTPException) -> JSONResponse:
        if exc.status_code not in (404, 405):  # FastAPI could not read the body (e.g. not UTF-8)
            return _error(f"body: {exc.detail}", exc.status_code)
        what = "no such route" if exc.status_code == 404 else "method not allowed"
        return _error(f"{what}: {request.method} {request.url.path}", exc.status_code, getattr(exc, "headers", None))

    @app.exception_handler(Exception)
    async def _internal(request: Request, exc: Exception) -> JSONResponse:  # a bug, never bad input
        return _error(f"internal error: {type(exc).__name__}: {exc}", 500)


_BRANCH = re.compile(r"^(str|int|float|bool|list|dict|none)$|[^a-z0-9_]")  # a union branch's tag in a loc, not a field


def validation_message(errors: list[dict], body, rules: dict[str, str]) -> tuple[str, str | None]:
    """(message, param) of a 400 from pydantic's errors, in the client's words: param is the top-level field as
    sent; the message, one per field, "FIELD: [where] must be ..., got VALUE" from `rules` (field -> "must be ...",
    or a whole message that starts with the field's name: an unsupported parameter), else pydantic's sentence
    without its union branches and character offsets."""
    fields: dict[object, list[dict]] = {}
    for e in errors:
        if e.get("type") == "json_invalid":
            return f"body: invalid JSON ({e.get('ctx', {}).get('error', 'decode error')})", None
        loc = tuple(e.get("loc", ()))[1:]  # loc[0] is "body"
        fields.setdefault(loc[0] if loc else None, []).append(e)
    parts = []
    for field, errs in fields.items():
        if field is None:
            parts.append("body: required: send a JSON object" if errs[0].get("type") == "missing" else "body: must be a JSON object")
            continue
        whole = rules.get(field, "")
        if whole.startswith((f"{field} ", f"{field}:")):
            parts.append(whole)
            continue
        e = next((e for e in errs if e.get("type") == "value_error"), errs[0])  # our own validators' words first
        path = tuple(x for x in tuple(e.get("loc", ()))[2:] if isinstance(x, int) or not _BRANCH.search(str(x)))
        where = "".join(f"[{x}]" if isinstance(x, int) else f".{x}" for x in path).lstrip(".")
        rule = rules.get(([field] + [x for x in path if isinstance(x, str)])[-1])
        kind = e.get("type")
        if kind == "extra_forbidden":
            what = "is an unknown field" if path else "unknown parameter"
        elif kind == "missing":
            what = "is required" if path else "required"
        elif kind == "value_error":
            what = str(e.get("msg", "")).removeprefix("Value error, ")
        else:
            what = f"{rule or _plain(e.get('msg', 'invalid'))}, got {_shown(_at(body, (field, *path)))}"
        parts.append(f"{field}: {where + ' ' if where else ''}{what}")
    return "; ".join(parts) or "invalid request", next((f for f in fields if f is not None), None)


def _plain(msg: str) -> str:
    """pydantic's sentence with its subject dropped: 'Input should be a valid integer' -> 'must be a valid integer',
    'List should have at most 8 items after validation, not 9' -> 'must have at most 8 items, not 9'."""
    return re.sub(r"^(Input|Value|String|List|Dictionary|Object|Tuple|Set) should", "must", msg).replace(" after validation", "")


def _at(body, path: tuple):
    """The value at `path` in the request body (what the client sent), or a marker when it is not there."""
    for key in path:
        try:
            body = body[key]
        except (KeyError, IndexError, TypeError):
            return _MISSING
    return body


_MISSING = object()


def _shown(value) -> str:
    """A short JSON rendering of a value the client sent (its type shows: "8" is a string, 8 a number)."""
    if value is _MISSING:
        return "something else"
    try:
        text = json.dumps(value, ensure_ascii=True)
    except (TypeError, ValueError):
        text = repr(value)
    return text if len(text) <= 60 else text[:57] + "..."


class BodyLimit:
    """ASGI middleware: a request body over `limit` bytes answers 413 {"error"} before the app reads it."""

    def __init__(self, app, limit: int) -> None:
        self.app, self.limit = app, limit

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        length = dict(scope.get("headers", [])).get(b"content-length", b"0")
        if length.isdigit() and int(length) > self.limit:
            return await self._too_large(scope, receive, send)
        chunks, size = [], 0
        while True:  # read the whole (small) body, counting, then replay it to the app
            message = await receive()
            if message["type"] != "http.request":
                return  # the client went away
            chunks.append(message.get("body", b""))
            size += len(chunks[-1])
            if size > self.limit:
                return await self._too_large(scope, receive, send)
            if not message.get("more_body", False):
                break
        body, sent = b"".join(chunks), False

        async def replay():
            nonlocal sent
            if not sent:
                sent = True
                return {"type": "http.request", "body": body, "more_body": False}
            return await receive()

        await self.app(scope, replay, send)

    async def _too_large(self, scope, receive, send) -> None:
        await _error(f"body: larger than {self.limit} bytes", 413)(scope, receive, send)


class ApiKey:
    """ASGI middleware: with a key set, every request but the static page needs `Authorization: Bearer KEY` (401)."""

    def __init__(self, app, key: str | None) -> None:
        self.app, self.key = app, key

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] != "http" or self.key is None or (scope["path"] == "/" and scope["method"] in ("GET", "HEAD")):
            return await self.app(scope, receive, send)
        auth = dict(scope.get("headers", [])).get(b"authorization", b"")
        scheme, _, given = auth.partition(b" ")
        if scheme.lower() != b"bearer" or not hmac.compare_digest(given.strip(), self.key.encode("utf-8")):
            what = "no API key given" if not auth else "wrong API key"
            return await _error(f"{what}: send the server's key as 'Authorization: Bearer KEY'", 401,
                                headers={"www-authenticate": "Bearer"})(scope, receive, send)
        await self.app(scope, receive, send)


class JsonOnly:
    """ASGI middleware: a POST body on an API route must say `Content-Type: application/json`, else 415.

    415 rather than parsing whatever came: the header is the client's word on what it sent, and reading a form body
    (what `curl -d` sends) as JSON would hide that mistake from the next client that sends a real form."""

    def __init__(self, app) -> None:
        self.app = app

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] != "http" or scope["method"] != "POST" or scope["path"] not in POST_ROUTES:
            return await self.app(scope, receive, send)
        given = dict(scope.get("headers", [])).get(b"content-type", b"").decode("latin-1")
        if given.split(";")[0].strip().lower() != "application/json":
            got = f"got {given[:80]!r}" if given else "no Content-Type was given"
            return await _error(f"body: send a JSON object with the header 'Content-Type: application/json' ({got}; "
                                "curl: --json BODY, or -H 'Content-Type: application/json' -d BODY)", 415)(scope, receive, send)
        await self.app(scope, receive, send)


class RequestCounter:
    """ASGI middleware, the outermost: every answer counted by route and status (mtpspec_requests_total), the
    middlewares' own (401, 413, 415) and an unhandled error's 500 included."""

    def __init__(self, app, metrics: ServerMetrics) -> None:
        self.app, self.metrics = app, metrics

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        path = scope["path"]
        route = path if path in ROUTES else "other"
        started = False

        async def counted(message):
            nonlocal started
            if message["type"] == "http.response.start":
                started = True
                self.metrics.request(route, message["status"])
            await send(message)

        try:
            await self.app(scope, receive, counted)
        except Exception:
            if not started:  # Starlette's outermost handler answers it 500 (the `Exception` handler above)
                self.metrics.request(route, 500)
            raise


ROUTES = ("/", "/health", "/metrics", "/v1/models", "/v1/completions", "/v1/chat/completions",
          "/api/health", "/api/models", "/api/load", "/api/verify", "/api/step")
POST_ROUTES = ("/v1/completions", "/v1/chat/completions", "/api/load", "/api/verify", "/api/step")

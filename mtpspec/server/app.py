"""The HTTP server: the live verify page and its JSON API (FastAPI).

    GET  /                 the verify page (one self-contained HTML file, no network)
    GET  /api/health       {"ok": true}
    GET  /api/models       {"loaded": [...], "suggested": ["demo", paths...]}
    POST /api/load         {"model", "tokenizer"?, "dtype"?} -> vocab, context, drafters offered
    POST /api/verify       one greedy verification round of a typed or proposed draft
    POST /api/step         a real speculative run, every round laid out (for the step-through)

Bad input answers 4xx with {"error": "..."}; the server keeps running. See docs/visualize.md.
"""

from __future__ import annotations

import html
from importlib import resources

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import HTMLResponse, JSONResponse
from pydantic import BaseModel, Field

from ..errors import ConfigError, ModelLoadError, MtpspecError
from .verify_page import MAX_DRAFT, MAX_TOP_K, ModelStore, available_drafters, step_through, suggested_models, verify_draft


class ModelRef(BaseModel):
    model: str | None = Field(None, description="llama2.c .bin, model directory, project checkpoint, or 'demo'; default: the server's model")
    tokenizer: str | None = Field(None, description="tokenizer file when the model does not carry one")
    dtype: str = "fp32"


class VerifyRequest(ModelRef):
    prefix: str = Field(..., description="text the model continues (BOS is added)")
    draft: str | None = Field(None, description="typed continuation, tokenised after the prefix")
    draft_ids: list[int] | None = Field(None, description="draft as token ids (takes precedence over draft)")
    drafter: str | None = Field(None, description="let a drafter propose when no draft is given: ngram | draft | mtp")
    k: int = Field(4, description="draft length D for a proposing drafter")
    draft_model: str | None = Field(None, description="draft model path (drafter 'draft')")
    top_k: int = Field(10, description=f"entries of each position's distribution returned (1..{MAX_TOP_K})")


class StepRequest(ModelRef):
    prefix: str
    drafter: str = "ngram"
    k: int = 4
    draft_model: str | None = None
    max_new_tokens: int = 32


def create_app(default_model: str = "demo", default_tokenizer: str | None = None) -> FastAPI:
    """The app; models load lazily on first use and stay cached (at most a few at a time)."""
    app = FastAPI(title="mtpspec verify page", description="Greedy verification of drafts, one target forward each.")
    store = ModelStore()

    def _model_of(req) -> tuple[str, str | None]:
        """The request's model and tokenizer; a request that names none uses the server's own."""
        if req.model is None:
            return default_model, req.tokenizer or default_tokenizer
        return req.model, req.tokenizer

    @app.exception_handler(MtpspecError)
    async def _bad_input(request: Request, exc: MtpspecError) -> JSONResponse:
        status = 404 if isinstance(exc, ModelLoadError) and "not found" in str(exc) else 400
        return JSONResponse({"error": str(exc)}, status_code=status)

    @app.exception_handler(RequestValidationError)
    async def _bad_request(request: Request, exc: RequestValidationError) -> JSONResponse:
        msgs = [f"{'.'.join(str(x) for x in e.get('loc', ())[1:]) or 'body'}: {e.get('msg')}" for e in exc.errors()]
        return JSONResponse({"error": "; ".join(msgs) or "invalid request"}, status_code=422)

    @app.exception_handler(Exception)
    async def _internal(request: Request, exc: Exception) -> JSONResponse:
        return JSONResponse({"error": f"internal error: {type(exc).__name__}: {exc}"}, status_code=500)

    @app.get("/", response_class=HTMLResponse)
    def page() -> HTMLResponse:
        text = resources.files("mtpspec.server").joinpath("static/verify.html").read_text(encoding="utf-8")
        text = text.replace("__DEFAULT_MODEL__", html.escape(default_model)).replace("__DEFAULT_TOKENIZER__", html.escape(default_tokenizer or ""))
        return HTMLResponse(text)

    @app.get("/api/health")
    def health() -> dict:
        return {"ok": True}

    @app.get("/api/models")
    def models() -> dict:
        return {"loaded": [{"model": m, "tokenizer": t or None, "dtype": d} for (m, t, d) in store.models],
                "suggested": suggested_models(), "default": default_model}

    @app.post("/api/load")
    def load_model(req: ModelRef) -> dict:
        with store.lock:
            model = store.get(*_model_of(req), req.dtype)
            return {"model": _model_of(req)[0], "vocab_size": model.module.vocab_size, "max_seq_len": model.module.max_seq_len,
                    "drafters": available_drafters(model), "max_draft": MAX_DRAFT}

    @app.post("/api/verify")
    def verify(req: VerifyRequest) -> dict:
        with store.lock:
            model = store.get(*_model_of(req), req.dtype)
            dm = _draft_model(store, req)
            return verify_draft(model, req.prefix, draft=req.draft, draft_ids=req.draft_ids, drafter=req.drafter,
                                k=req.k, draft_model=dm, top_k=req.top_k)

    @app.post("/api/step")
    def step(req: StepRequest) -> dict:
        with store.lock:
            model = store.get(*_model_of(req), req.dtype)
            return step_through(model, req.prefix, req.drafter, req.k, req.max_new_tokens, draft_model=_draft_model(store, req))

    return app


def _draft_model(store: ModelStore, req):
    if req.drafter != "draft":
        return None
    if not req.draft_model:
        raise ConfigError("the 'draft' drafter needs a draft model path (e.g. stories260K_q80.bin)")
    return store.get(req.draft_model, req.tokenizer, req.dtype)

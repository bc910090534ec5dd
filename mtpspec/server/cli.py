"""`mtpspec serve`: the HTTP server (an OpenAI-compatible API under /v1, the live verify page at /, /metrics).

Every model is loaded, and the speculation for each is checked, before the server listens: a missing or
bad file, or a drafter that fits no served model, is `mtpspec: error: ...`, exit 2.
"""

from __future__ import annotations

import argparse
import os
import socket

from ..cli import AUTO_DRAFTER, add_compile_arg, add_device_arg, add_quant_args, add_threads_arg, command, use_device, use_threads
from ..errors import ConfigError
from ..heap import frozen_heap


def _serve_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", action="append", metavar="[NAME=]PATH",
                   help="a model to serve (repeatable; default: demo): a llama2.c .bin, a model directory, a project "
                        "checkpoint or 'demo'; NAME defaults to the file's stem or the directory's name")
    p.add_argument("--tokenizer", action="append", metavar="[NAME=]PATH",
                   help="tokenizer file for model NAME when it does not carry one (repeatable; a bare PATH when one model is served)")
    p.add_argument("--draft-model", action="append", metavar="[NAME=]PATH",
                   help="a draft model (drafter 'draft') or a trained head folder (mtp / eagle / medusa) to serve (repeatable): "
                        "the verify page offers each; --drafter uses the first that fits each model")
    p.add_argument("--drafter", default="auto",
                   help=f"what generation drafts with: auto (default, as `mtpspec generate`: {AUTO_DRAFTER}), none (no "
                        "speculation), ngram, mtp, draft, eagle or medusa (these three need a fitting --draft-model)")
    p.add_argument("--k", default="auto", metavar="N|auto",
                   help="draft length D, or auto (default): chosen per sequence from acceptance and the whole batch's "
                        "measured cost, so speculation steps aside as the batch fills")
    p.add_argument("--mtp-lookup", type=int, default=0, metavar="N",
                   help="with the MTP drafter (--drafter mtp, or auto on a model with its own MTP head): where the last N "
                        "tokens (N >= 2; 4 on code) occurred before, draft what followed them instead of running the head "
                        "(default 0: off)")
    p.add_argument("--max-batch", type=int, default=16, help="sequences sharing one target forward (default 16)")
    p.add_argument("--max-queue", type=int, default=64,
                   help="requests waiting for a free slot, per model (default 64); more are answered 429 with Retry-After")
    p.add_argument("--prefill-chunk", type=int, default=512,
                   help="prompt positions prefilled per engine step, so running sequences keep decoding (default 512)")
    p.add_argument("--prefix-cache", type=int, default=4096, metavar="N",
                   help="positions of finished requests' KV kept per model for later prompts that start the same way (a "
                        "chat's earlier turns, a shared system prompt), on models where a copy is bitwise a prefill (dense "
                        "GGUF files: llama, qwen2, qwen3, gemma3); 0: off (default 4096)")
    p.add_argument("--max-prompt-chars", type=int, default=200_000, help="characters of one prompt or chat (default 200000)")
    p.add_argument("--max-tokens-default", type=int, default=256, help="max_tokens of a request that gives none (default 256)")
    p.add_argument("--api-key", default=None,
                   help="require 'Authorization: Bearer KEY' on every endpoint but the static page (default: $MTPSPEC_API_KEY, "
                        "else no key)")
    p.add_argument("--dtype", default="fp32", help="fp32 (default) or bf16, for every model")
    add_quant_args(p)
    add_compile_arg(p)
    p.add_argument("--host", default="127.0.0.1", help="address to listen on (default 127.0.0.1: this machine only)")
    p.add_argument("--port", type=int, default=8000, help="port (default 8000; 0 = any free port)")
    add_threads_arg(p)
    add_device_arg(p)
    p.add_argument("--exact", action="store_true", help="exact mode: verify with width-one calls, so every sequence's tokens are "
                   "bitwise plain decoding's whatever shares its forward (on a GPU too; slower: each sequence its own forward)")


@command("serve", help="serve models over HTTP: an OpenAI-compatible API with speculative decoding, the live verify "
                       "page, Prometheus metrics")(_serve_args)
def run_serve(args: argparse.Namespace) -> int:
    import uvicorn

    from .app import create_app
    from .registry import load_served

    from .options import ServeOptions

    device = use_device(args)
    use_threads(args.threads)
    k = args.k if args.k == "auto" else _int_k(args.k)
    options = ServeOptions(drafter=args.drafter, k=k, max_batch=args.max_batch, max_queue=args.max_queue,
                           prefill_chunk=args.prefill_chunk, prefix_cache=args.prefix_cache, max_prompt_chars=args.max_prompt_chars,
                           max_tokens_default=args.max_tokens_default, mtp_lookup=args.mtp_lookup, exact=args.exact,
                           api_key=args.api_key if args.api_key is not None else os.environ.get("MTPSPEC_API_KEY") or None)
    if not 0 <= args.port <= 65535:
        raise ConfigError(f"--port must be in 0..65535, got {args.port}")
    from ..loading import parse_dtype

    from ..models.compiled import check_compilable, compile_model
    from ..quant import check_quant, quantize
    from ..models.placement import place
    from ..threads import resolve_threads

    qcfg = check_quant(args.quant, parse_dtype(args.dtype))  # an unknown dtype / quant is named before any model loads
    if args.compile and device.type != "cpu":
        raise ConfigError(f"--compile builds CPU graphs on mtpspec's kernels; it is not available on {device}")
    if args.compile:
        check_compilable(None, parse_dtype(args.dtype))
    served = load_served(args.model, args.tokenizer, args.draft_model, args.dtype)
    for entry in served.drafts.values():  # draft LMs beside their targets (heads are placed by the drafter that reads them)
        if entry.kind == "model":
            place(entry.obj, device)
    for model in served.models.values():  # each generate() sets its model's threads: --threads, else the rule at load
        if qcfg is not None:
            quantize(model.module, qcfg.kind)
        if device.type != "cpu":
            place(model.module, device)
            continue
        model.threads = resolve_threads(args.threads, model.module, compiled=args.compile)
        if args.compile:
            compile_model(model.module)
    app = create_app(served, options)  # checks each model's speculation before binding
    sock = _listen(args.host, args.port)
    host, port = sock.getsockname()[:2]
    spec = ", ".join(f"{n}: {s.spec.drafter} k={s.spec.k}{', prefix reuse' if s.engine.prefixes is not None else ''}"
                     for n, s in app.state.schedulers.items())
    print(f"mtpspec: serving {', '.join(served.models)} on http://{args.host}:{port}/  (OpenAI API under /v1, verify page at /; "
          f"{spec}; Ctrl-C to stop)", flush=True)
    server = uvicorn.Server(uvicorn.Config(app, log_level="warning"))
    with frozen_heap():  # what the server keeps for its life: a full collection walking it is a pause in some request
        server.run(sockets=[sock])
    return 0


def _listen(host: str, port: int) -> socket.socket:
    """A bound, listening socket, or a one-line error (address in use, unknown host)."""
    try:
        family, kind, proto, _, addr = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)[0]
        sock = socket.socket(family, kind, proto)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind(addr)
        sock.listen(128)
    except OSError as e:
        raise ConfigError(f"cannot listen on {host}:{port}: {e.strerror or e}") from None
    return sock


def _int_k(text: str) -> int:
    try:
        return int(text)
    except ValueError:
        raise ConfigError(f"--k must be an integer >= 1 or 'auto', got {text!r}") from None

"""`mtpspec serve`: the HTTP server (live verify page at /, JSON API under /api).

Every model is loaded before the server listens: a missing or bad file is `mtpspec: error: ...`, exit 2.
"""

from __future__ import annotations

import argparse
import socket

from ..cli import add_compile_arg, add_quant_args, add_threads_arg, command, use_threads
from ..errors import ConfigError


def _serve_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", action="append", metavar="[NAME=]PATH",
                   help="a model to serve (repeatable; default: demo): a llama2.c .bin, a model directory, a project "
                        "checkpoint or 'demo'; NAME defaults to the file's stem or the directory's name")
    p.add_argument("--tokenizer", action="append", metavar="[NAME=]PATH",
                   help="tokenizer file for model NAME when it does not carry one (repeatable; a bare PATH when one model is served)")
    p.add_argument("--draft-model", action="append", metavar="[NAME=]PATH",
                   help="a draft model (drafter 'draft') or a trained head folder (mtp / eagle / medusa) to offer (repeatable)")
    p.add_argument("--dtype", default="fp32", help="fp32 (default) or bf16, for every model")
    add_quant_args(p)
    add_compile_arg(p)
    p.add_argument("--host", default="127.0.0.1", help="address to listen on (default 127.0.0.1: this machine only)")
    p.add_argument("--port", type=int, default=8000, help="port (default 8000; 0 = any free port)")
    add_threads_arg(p)


@command("serve")(_serve_args)
def run_serve(args: argparse.Namespace) -> int:
    import uvicorn

    from .app import create_app
    from .registry import load_served

    use_threads(args.threads)
    if not 0 <= args.port <= 65535:
        raise ConfigError(f"--port must be in 0..65535, got {args.port}")
    from ..loading import parse_dtype

    from ..compiled import check_compilable, compile_model
    from ..quant import check_quant, quantize
    from ..threads import resolve_threads

    qcfg = check_quant(args.quant, args.quant_group_size, parse_dtype(args.dtype))  # an unknown dtype / quant is named before any model loads
    if args.compile:
        check_compilable(None, parse_dtype(args.dtype), args.quant)
    served = load_served(args.model, args.tokenizer, args.draft_model, args.dtype)
    for model in served.models.values():  # each generate() sets its model's threads: --threads, else the rule at load
        if qcfg is not None:
            quantize(model.module, qcfg.kind, qcfg.group_size)
        model.threads = resolve_threads(args.threads, model.module)
        if args.compile:
            compile_model(model.module)
    sock = _listen(args.host, args.port)
    host, port = sock.getsockname()[:2]
    print(f"mtpspec: serving {', '.join(served.models)} on http://{args.host}:{port}/  (JSON API under /api, Ctrl-C to stop)",
          flush=True)
    server = uvicorn.Server(uvicorn.Config(create_app(served), log_level="warning"))
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

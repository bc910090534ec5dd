"""`mtpspec serve`: the HTTP server (live verify page at /, JSON API under /api)."""

from __future__ import annotations

import argparse

from ..cli import add_threads_arg, command, use_threads


def _serve_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", default="demo", help="model the page opens with (any path the project loads, or 'demo')")
    p.add_argument("--tokenizer", help="tokenizer file for --model when it does not carry one")
    p.add_argument("--host", default="127.0.0.1", help="address to listen on (default 127.0.0.1: this machine only)")
    p.add_argument("--port", type=int, default=8000)
    add_threads_arg(p)


@command("serve")(_serve_args)
def run_serve(args: argparse.Namespace) -> int:
    import uvicorn

    from .app import create_app

    use_threads(args.threads)
    print(f"mtpspec: verify page on http://{args.host}:{args.port}/  (JSON API under /api, Ctrl-C to stop)")
    uvicorn.run(create_app(args.model, args.tokenizer), host=args.host, port=args.port, log_level="warning")
    return 0

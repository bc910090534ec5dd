"""`mtpspec serve`: the HTTP server (live verify page at /, JSON API under /api)."""

from __future__ import annotations

import argparse

from ..cli import command


def _serve_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", default="demo", help="model the page opens with (any path the project loads, or 'demo')")
    p.add_argument("--tokenizer", help="tokenizer file for --model when it does not carry one")
    p.add_argument("--host", default="127.0.0.1", help="address to listen on (default 127.0.0.1: this machine only)")
    p.add_argument("--port", type=int, default=8000)
    p.add_argument("--threads", type=int, default=1, help="torch threads (1 is fastest for small models on few cores)")


@command("serve")(_serve_args)
def run_serve(args: argparse.Namespace) -> int:
    import torch
    import uvicorn

    from .app import create_app

    torch.set_num_threads(max(args.threads, 1))
    print(f"mtpspec: verify page on http://{args.host}:{args.port}/  (JSON API under /api, Ctrl-C to stop)")
    uvicorn.run(create_app(args.model, args.tokenizer), host=args.host, port=args.port, log_level="warning")
    return 0

"""`mtpspec trace`: plain vs speculative decoding on the same prompt(s), as an HTML timeline + PNG."""

from __future__ import annotations

import argparse
import sys

from ..cli import (add_device_arg, add_generation_args, add_model_args, add_threads_arg, command, generation_kwargs, load_kwargs,
                   use_device, use_threads)
from ..config import DEFAULT_K
from ..errors import ConfigError


def _int_list(text: str) -> list[int]:
    try:
        ks = [int(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a comma-separated list of integers, got {text!r}") from None
    if not ks or min(ks) < 1:
        raise argparse.ArgumentTypeError(f"every D must be >= 1, got {text!r}")
    return ks


def _trace_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("prompt", nargs="*", default=[], help="prompt text; several prompts give several sections (e.g. easy vs hard text)")
    add_model_args(p)
    add_generation_args(p)
    p.set_defaults(max_new_tokens=64, drafter="ngram")
    p.add_argument("--ks", type=_int_list, help="compare several draft lengths, e.g. 1,2,4 (overrides --k)")
    p.add_argument("--drafters", help="compare several drafters, e.g. ngram,draft (overrides --drafter)")
    p.add_argument("--out", required=True, help="output HTML file; the PNG goes beside it (same name, .png)")
    p.add_argument("--png", help="PNG path (default: --out with .png)")
    p.add_argument("--repeat", type=int, default=1, help="run each config N times and draw the run of median wall time")
    add_threads_arg(p)
    add_device_arg(p)


def _check_used(drafters: list[str], kw: dict) -> None:
    """Every drafter option and --draft-model given must be read by at least one of the drafters
    (each run gets only its own: drafters.for_drafter)."""
    from ..drafters import OPTION_TYPES, OPTIONS, USES_DRAFT_MODEL

    given = {k: v for k, v in kw.items() if k in OPTION_TYPES and v is not None}
    if kw.get("draft_model") is not None:
        given["draft_model"] = kw["draft_model"]
    for opt in given:
        users = USES_DRAFT_MODEL if opt == "draft_model" else [d for d, o in OPTIONS.items() if opt in o]
        if not any(d in users for d in drafters):
            flag = OPTION_TYPES[opt][0] if opt in OPTION_TYPES else "--draft-model"
            raise ConfigError(f"{flag} is not used by --drafter {', '.join(drafters)}")


@command("trace")(_trace_args)
def run_trace(args: argparse.Namespace) -> int:
    from ..api import load
    from .trace import trace_prompts, write_trace

    use_device(args)
    use_threads(args.threads)

    kw = generation_kwargs(args)
    drafters = [d.strip() for d in args.drafters.split(",") if d.strip()] if args.drafters else [kw.pop("drafter")]
    kw.pop("drafter", None)
    if args.ks:
        ks = args.ks
    elif args.k is None or isinstance(args.k, int):
        ks = [DEFAULT_K if args.k is None else args.k]
    else:
        raise ConfigError("mtpspec trace needs a fixed D: use --k N or --ks 1,2,4")
    kw.pop("k")
    configs = [(d, k) for d in drafters if d != "none" for k in ks]
    _check_used(drafters, kw)
    if not configs:
        raise ConfigError("nothing to compare: choose a drafter other than 'none' (--drafter ngram, draft, ...)")
    if args.repeat < 1:
        raise ConfigError(f"--repeat must be >= 1, got {args.repeat}")
    model = load(args.model, args.tokenizer, args.dtype, **load_kwargs(args))
    draft_model = kw.pop("draft_model")
    prompts = args.prompt or [""]
    groups = trace_prompts(model, prompts, configs, draft_model=draft_model, repeat=args.repeat, **kw)
    meta = (f"model {args.model}, {args.dtype}, temperature {args.temperature}, seed {args.seed}, "
            f"max {args.max_new_tokens} new tokens, median of {args.repeat} run(s); drafters {', '.join(drafters)}; D in {ks}")
    html_path, png_path = write_trace(groups, args.out, args.png, meta=meta)
    for g in groups:
        for r in g.runs:
            s = r.summary()
            print(f"{g.prompt[:30]!r:<34}{s['label']:<22}{s['target_forwards']:>5} forwards {s['tokens_per_forward']:>5.2f} tok/fwd "
                  f"{s['speedup']:>5.2f}x  identical: {'yes' if s['identical_to_plain'] else 'NO'}", file=sys.stderr)
    print(f"wrote {html_path} and {png_path}")
    return 0

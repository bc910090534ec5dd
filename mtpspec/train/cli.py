"""`mtpspec train pretrain | head | mtp | longctx | eval`: thin argparse wrappers over train.pretrain, train.heads,
train.native_mtp, train.longctx and train.evaluate."""

from __future__ import annotations

import argparse
import dataclasses
import json

from ..cli import add_quant_args, add_threads_arg, command, load_kwargs, use_threads
from ..errors import ConfigError


def _add_dataclass_args(p: argparse.ArgumentParser, cls, skip: tuple[str, ...] = ()) -> None:
    for f in dataclasses.fields(cls):
        if f.name in skip or f.type in ("list[str]",):
            continue
        default = f.default if f.default is not dataclasses.MISSING else None
        flag = "--" + f.name.replace("_", "-")
        if f.name == "out":
            p.add_argument(flag, required=True, help="output folder")
        elif str(f.type) == "bool":  # --sparse / --no-sparse
            p.add_argument(flag, action=argparse.BooleanOptionalAction, default=default, help=f"default {'on' if default else 'off'}")
        else:
            typ = {"int": int, "float": float, "str": str, "bool": int}.get(str(f.type), str)
            p.add_argument(flag, type=typ, default=default, help=f"default {default}")


def _train_args(p: argparse.ArgumentParser) -> None:
    from .heads import HeadConfig
    from .longctx import LongCtxConfig
    from .native_mtp import MTPTuneConfig
    from .pretrain import PretrainConfig

    sub = p.add_subparsers(dest="train_command", required=True)
    for name, cls, about, model in (
        ("pretrain", PretrainConfig, "a hybrid (Gated DeltaNet + attention) model with the next-token + MTP objective", None),
        ("head", HeadConfig, "an MTP / Medusa / EAGLE draft head for a frozen target (self-distillation)",
         dict(required=True, help="the frozen target (llama2.c .bin, project checkpoint, 'demo')")),
        ("mtp", MTPTuneConfig, "fine-tune a model's own MTP module by self-distillation (the model frozen)",
         dict(required=True, help="a model with an MTP module (project checkpoint, HF directory, 'demo')")),
        ("longctx", LongCtxConfig, "continue training a model with an MTP module at a longer context (pretraining's objective)",
         dict(default="demo", help="a hybrid model with an MTP module (project checkpoint, HF directory, 'demo')")),
    ):
        q = sub.add_parser(name, help=about)
        if model is not None:
            q.add_argument("--model", **model)
            q.add_argument("--tokenizer")
        _add_dataclass_args(q, cls)
        q.add_argument("--no-progress", action="store_true")
    ev = sub.add_parser("eval", help="side-by-side table: plain and drafter x D on held-out prompts (greedy)")
    ev.add_argument("--model", required=True)
    ev.add_argument("--tokenizer")
    ev.add_argument("--runs", required=True, help="comma list of DRAFTER:D[:HEAD_PATH | :vocab=N], e.g. mtp:1,mtp:1:vocab=0,mtp:2,ngram:4")
    ev.add_argument("--prompts", default="stdlib", help="stdlib (held-out modules) | tinystories (the first N) | a text file")
    ev.add_argument("--n", type=int, default=8, help="number of prompts")
    ev.add_argument("--max-new-tokens", type=int, default=128)
    ev.add_argument("--repeats", type=int, default=1)
    add_threads_arg(ev)
    add_quant_args(ev)


@command("train")(_train_args)
def run_train(args: argparse.Namespace) -> int:
    from .distributed import World

    world = World.current()
    if world.distributed and args.train_command not in ("head", "mtp", "pretrain"):
        raise ConfigError(f"train {args.train_command} runs in one process; under torchrun (here {world.size} processes) "
                          "run train head, mtp or pretrain")
    if args.train_command == "eval":
        return _run_eval(args)
    from .heads import HeadConfig, train_head
    from .longctx import LongCtxConfig, loss_table, train_longctx
    from .native_mtp import MTPTuneConfig, tune_native_mtp
    from .pretrain import PretrainConfig, pretrain

    cls, run = {"pretrain": (PretrainConfig, None), "longctx": (LongCtxConfig, train_longctx),
                "mtp": (MTPTuneConfig, tune_native_mtp), "head": (HeadConfig, train_head)}[args.train_command]
    names = {f.name for f in dataclasses.fields(cls)}
    cfg = cls(**{k: v for k, v in vars(args).items() if k in names and v is not None})
    if run is None:
        report = pretrain(cfg, progress_bar=not args.no_progress)
    else:
        report = run(args.model, cfg, tokenizer=args.tokenizer, progress_bar=not args.no_progress)
    if not world.main:  # rank 0 reports
        return 0
    if args.train_command == "longctx":
        print(json.dumps({k: v for k, v in report.items() if k not in ("history", "loss_by_position", "config")}, indent=2))
        print(loss_table(report))
        return 0
    print(json.dumps({k: v for k, v in report.items() if k != "history"}, indent=2))
    return 0


def _run_eval(args: argparse.Namespace) -> int:
    from ..api import load
    from .evaluate import HEADER, measure_table

    use_threads(args.threads)
    if args.n < 1 or args.repeats < 1:
        raise ConfigError(f"--n and --repeats must be >= 1, got {args.n} and {args.repeats}")
    model = load(args.model, args.tokenizer, **load_kwargs(args))
    if args.prompts == "stdlib":
        from .data import code_prompts, stdlib_files

        prompts = code_prompts(stdlib_files()[1], args.n)
    elif args.prompts == "tinystories":
        from ..prompts import tinystories_prompts

        prompts = tinystories_prompts(args.n)
    else:
        from pathlib import Path

        try:
            prompts = [ln for ln in Path(args.prompts).read_text(encoding="utf-8").splitlines() if ln.strip()][: args.n]
        except (OSError, UnicodeDecodeError) as e:
            raise ConfigError(f"--prompts {args.prompts}: cannot read prompts from it ({e.__class__.__name__}: {e})") from None
        if not prompts:
            raise ConfigError(f"--prompts {args.prompts}: no prompts in it")
    runs = []
    for item in args.runs.split(","):
        parts = item.split(":", 2)
        if len(parts) < 2 or not parts[1].isdigit() or int(parts[1]) < 1:
            raise ConfigError(f"--runs items are DRAFTER:D[:HEAD_PATH | :vocab=N] with D >= 1, got {item!r}")
        extra = parts[2] if len(parts) > 2 else None
        if extra is not None and extra.startswith("vocab="):
            if not extra[6:].isdigit():
                raise ConfigError(f"--runs: vocab=N needs an integer N >= 0, got {item!r}")
            runs.append((parts[0], int(parts[1]), None, {"draft_vocab": int(extra[6:])}))
        else:
            runs.append((parts[0], int(parts[1]), extra))
    rows = measure_table(model, prompts, runs, args.max_new_tokens, args.repeats)
    print(f"{len(prompts)} prompts ({args.prompts}) x {args.max_new_tokens} new tokens, greedy, {model.threads} thread(s)\n")
    print(HEADER)
    for r in rows:
        print(r.markdown())
    return 0

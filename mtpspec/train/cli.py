"""`mtpspec train pretrain | head`: thin argparse wrappers over train.pretrain and train.heads."""

from __future__ import annotations

import argparse
import dataclasses
import json

from ..cli import command


def _add_dataclass_args(p: argparse.ArgumentParser, cls, skip: tuple[str, ...] = ()) -> None:
    for f in dataclasses.fields(cls):
        if f.name in skip or f.type in ("list[str]",):
            continue
        default = f.default if f.default is not dataclasses.MISSING else None
        flag = "--" + f.name.replace("_", "-")
        if f.name == "out":
            p.add_argument(flag, required=True, help="output folder")
        else:
            typ = {"int": int, "float": float, "str": str, "bool": int}.get(str(f.type), str)
            p.add_argument(flag, type=typ, default=default, help=f"default {default}")


def _train_args(p: argparse.ArgumentParser) -> None:
    from .heads import HeadConfig
    from .pretrain import PretrainConfig

    sub = p.add_subparsers(dest="train_command", required=True)
    pre = sub.add_parser("pretrain", help="a hybrid (Gated DeltaNet + attention) model with the next-token + MTP objective")
    _add_dataclass_args(pre, PretrainConfig)
    pre.add_argument("--no-progress", action="store_true")
    head = sub.add_parser("head", help="an MTP / Medusa / EAGLE draft head for a frozen target (self-distillation)")
    head.add_argument("--model", required=True, help="the frozen target (llama2.c .bin, project checkpoint, 'demo')")
    head.add_argument("--tokenizer")
    _add_dataclass_args(head, HeadConfig)
    head.add_argument("--no-progress", action="store_true")


@command("train")(_train_args)
def run_train(args: argparse.Namespace) -> int:
    if args.train_command == "pretrain":
        from .pretrain import PretrainConfig, pretrain

        names = {f.name for f in dataclasses.fields(PretrainConfig)}
        cfg = PretrainConfig(**{k: v for k, v in vars(args).items() if k in names and v is not None})
        report = pretrain(cfg, progress_bar=not args.no_progress)
    else:
        from .heads import HeadConfig, train_head

        names = {f.name for f in dataclasses.fields(HeadConfig)}
        cfg = HeadConfig(**{k: v for k, v in vars(args).items() if k in names and v is not None})
        report = train_head(args.model, cfg, tokenizer=args.tokenizer, progress_bar=not args.no_progress)
    print(json.dumps({k: v for k, v in report.items() if k != "history"}, indent=2))
    return 0

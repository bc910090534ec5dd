"""Drafter registry: one name per drafter, all on the same lossless verify path."""

from __future__ import annotations

from pathlib import Path
from typing import Callable

from ..errors import ConfigError
from .base import Drafter, NoDrafter
from .draft_model import DraftModelDrafter
from .ngram import NgramDrafter

# name -> factory(target_model, draft_model, options) ; later drafters register themselves here.
REGISTRY: dict[str, Callable[..., Drafter]] = {}


def register(name: str):
    def deco(factory):
        REGISTRY[name] = factory
        return factory

    return deco


@register("none")
def _none(target, draft_model=None, **opts) -> Drafter:
    return NoDrafter()


@register("ngram")
def _ngram(target, draft_model=None, ngram_min: int = 1, ngram_max: int = 3, **opts) -> Drafter:
    return NgramDrafter(n_min=ngram_min, n_max=ngram_max)


@register("draft")
def _draft(target, draft_model=None, **opts) -> Drafter:
    if draft_model is None:
        raise ConfigError("--drafter draft needs a draft model (--draft-model PATH)")
    if isinstance(draft_model, (str, Path)):
        from ..loading import load_module

        draft_model = load_module(draft_model, dtype=target.dtype)
    return DraftModelDrafter(draft_model, target.vocab_size)


@register("mtp")
def _mtp(target, draft_model=None, mtp_prenorm_hidden: bool = False, draft_vocab: int | None = None, **opts) -> Drafter:
    """The target's own MTP module, or (draft_model = a head folder) one trained by `mtpspec train head`.

    draft_vocab: size of the drafter's LM head vocabulary (None = the checkpoint's default, 0 = full)."""
    from .mtp import MTPDrafter

    if draft_model is not None:
        return MTPDrafter(_attached(target, draft_model, "mtp"), draft_vocab=draft_vocab)
    return MTPDrafter(target, prenorm_hidden=mtp_prenorm_hidden, draft_vocab=draft_vocab)


def _head(draft_model, kind: str, target):
    from ..models.heads import DraftHead, load_head

    if draft_model is None:
        raise ConfigError(f"--drafter {kind} needs a trained head (--draft-model HEAD_FOLDER, from `mtpspec train head`)")
    head = draft_model if isinstance(draft_model, DraftHead) else load_head(draft_model, target.dtype)
    if head.config.kind != kind:
        raise ConfigError(f"--drafter {kind} was given a {head.config.kind} head")
    return head


def _attached(target, draft_model, kind: str):
    from ..models.heads import AttachedHead

    return AttachedHead(target, _head(draft_model, kind, target))


@register("eagle")
def _eagle(target, draft_model=None, **opts) -> Drafter:
    """An EAGLE head: the MTP drafter's bookkeeping, on a head that predicts the target's next feature."""
    from .mtp import MTPDrafter

    d = MTPDrafter(_attached(target, draft_model, "eagle"))
    d.name = "eagle"
    return d


@register("medusa")
def _medusa(target, draft_model=None, **opts) -> Drafter:
    from .medusa import MedusaDrafter

    return MedusaDrafter(target, _head(draft_model, "medusa", target))


KNOWN = ("none", "ngram", "draft", "mtp", "medusa", "eagle")


def make_drafter(name: str, target, draft_model=None, **opts) -> Drafter:
    factory = REGISTRY.get(name)
    if factory is None:
        if name in KNOWN:
            raise ConfigError(f"drafter '{name}' is not available for this model")
        raise ConfigError(f"unknown drafter '{name}' (choose from: {', '.join(sorted(REGISTRY))})")
    return factory(target, draft_model=draft_model, **opts)


__all__ = ["Drafter", "NoDrafter", "NgramDrafter", "DraftModelDrafter", "make_drafter", "register", "REGISTRY"]

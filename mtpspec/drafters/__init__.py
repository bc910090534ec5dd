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
def _mtp(target, draft_model=None, mtp_prenorm_hidden: bool = False, **opts) -> Drafter:
    """The target's own MTP module (draft_model: a separate MTP head checkpoint, not supported yet)."""
    from .mtp import MTPDrafter

    if draft_model is not None:
        raise ConfigError("--drafter mtp with a separate --draft-model head is not supported yet; omit --draft-model")
    return MTPDrafter(target, prenorm_hidden=mtp_prenorm_hidden)


KNOWN = ("none", "ngram", "draft", "mtp", "medusa", "eagle")


def make_drafter(name: str, target, draft_model=None, **opts) -> Drafter:
    factory = REGISTRY.get(name)
    if factory is None:
        if name in KNOWN:
            raise ConfigError(f"drafter '{name}' is not available for this model")
        raise ConfigError(f"unknown drafter '{name}' (choose from: {', '.join(sorted(REGISTRY))})")
    return factory(target, draft_model=draft_model, **opts)


__all__ = ["Drafter", "NoDrafter", "NgramDrafter", "DraftModelDrafter", "make_drafter", "register", "REGISTRY"]

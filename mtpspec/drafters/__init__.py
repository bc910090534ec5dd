"""Drafter registry: one name per drafter, all on the same lossless verify path.

Each drafter declares the options it reads (OPTIONS); make_drafter refuses an unknown option, an
option another drafter reads, or a draft model a drafter does not use, naming it, before any
generation starts. An option set to None counts as not given (callers pass the CLI's unset flags).
"""

from __future__ import annotations

import difflib
from pathlib import Path
from typing import Callable

from ..errors import ConfigError
from .base import Drafter, NoDrafter
from .draft_model import DraftModelDrafter
from .ngram import NgramDrafter

# name -> factory(target_model, draft_model, options) ; later drafters register themselves here.
REGISTRY: dict[str, Callable[..., Drafter]] = {}

# option name -> (the CLI flag that sets it, its type); and which drafters read which options.
OPTION_TYPES: dict[str, tuple[str, type]] = {
    "ngram_min": ("--ngram-min", int),
    "ngram_max": ("--ngram-max", int),
    "draft_vocab": ("--draft-vocab", int),
    "mtp_prenorm_hidden": ("mtp_prenorm_hidden", bool),
}
OPTIONS: dict[str, tuple[str, ...]] = {
    "none": (), "ngram": ("ngram_min", "ngram_max"), "draft": (), "mtp": ("draft_vocab", "mtp_prenorm_hidden"),
    "eagle": ("draft_vocab",), "medusa": (),
}
USES_DRAFT_MODEL = ("draft", "mtp", "eagle", "medusa")  # mtp: optional (a trained head for a target without one)


def register(name: str):
    def deco(factory):
        REGISTRY[name] = factory
        return factory

    return deco


def _no_draft_model(name: str, draft_model) -> None:
    if draft_model is not None:
        raise ConfigError(f"--draft-model is not used by --drafter {name}")


@register("none")
def _none(target, draft_model=None) -> Drafter:
    _no_draft_model("none", draft_model)
    return NoDrafter()


@register("ngram")
def _ngram(target, draft_model=None, ngram_min: int | None = None, ngram_max: int | None = None) -> Drafter:
    _no_draft_model("ngram", draft_model)
    return NgramDrafter(n_min=1 if ngram_min is None else ngram_min, n_max=3 if ngram_max is None else ngram_max)


def _is_path(x) -> bool:
    return isinstance(x, (str, Path))


@register("draft")
def _draft(target, draft_model=None) -> Drafter:
    if draft_model is None:
        raise ConfigError("--drafter draft needs a draft model (--draft-model PATH)")
    if _is_path(draft_model):
        from ..loading import load_module
        from ..models.heads import is_head_dir

        if is_head_dir(draft_model):
            raise ConfigError(f"--drafter draft needs a full model; {draft_model} is a trained head (use it with --drafter mtp, eagle or medusa)")
        draft_model = load_module(draft_model, dtype=target.dtype)
    if not callable(getattr(draft_model, "forward_tokens", None)) or not hasattr(draft_model, "new_cache"):
        raise ConfigError(f"--drafter draft needs a causal LM as its draft model, got {type(draft_model).__name__}")
    return DraftModelDrafter(draft_model, target.vocab_size)


@register("mtp")
def _mtp(target, draft_model=None, mtp_prenorm_hidden: bool | None = None, draft_vocab: int | None = None) -> Drafter:
    """The target's own MTP module, or (draft_model = a head folder) one trained by `mtpspec train head`.

    draft_vocab: size of the drafter's LM head vocabulary (None = the checkpoint's default, 0 = full)."""
    from .mtp import MTPDrafter

    prenorm = bool(mtp_prenorm_hidden)
    if draft_model is not None:
        return MTPDrafter(_attached(target, draft_model, "mtp"), prenorm_hidden=prenorm, draft_vocab=draft_vocab)
    return MTPDrafter(target, prenorm_hidden=prenorm, draft_vocab=draft_vocab)


def _head(draft_model, kind: str, target):
    from ..models.heads import DraftHead, load_head

    if draft_model is None:
        raise ConfigError(f"--drafter {kind} needs a trained head (--draft-model HEAD_FOLDER, from `mtpspec train head`)")
    if isinstance(draft_model, DraftHead):
        head = draft_model if _dtype(draft_model) == target.dtype else _cast(draft_model, target.dtype)
    elif _is_path(draft_model):
        head = load_head(draft_model, target.dtype)
    else:
        raise ConfigError(
            f"--drafter {kind} takes a trained head (a folder from `mtpspec train head`) as its draft model, "
            f"not a {type(draft_model).__name__}"
        )
    if head.config.kind != kind:
        raise ConfigError(f"--drafter {kind} was given a {head.config.kind} head")
    return head


def _dtype(module):
    return next(module.parameters()).dtype


def _cast(head, dtype):
    import copy

    return copy.deepcopy(head).to(dtype)  # the caller's head keeps its dtype


def _attached(target, draft_model, kind: str):
    from ..models.heads import AttachedHead

    return AttachedHead(target, _head(draft_model, kind, target))


@register("eagle")
def _eagle(target, draft_model=None, draft_vocab: int | None = None) -> Drafter:
    """An EAGLE head: the MTP drafter's bookkeeping, on a head that predicts the target's next feature."""
    from .mtp import MTPDrafter

    d = MTPDrafter(_attached(target, draft_model, "eagle"), draft_vocab=draft_vocab)
    d.name = "eagle"
    return d


@register("medusa")
def _medusa(target, draft_model=None) -> Drafter:
    from .medusa import MedusaDrafter

    return MedusaDrafter(target, _head(draft_model, "medusa", target))


KNOWN = ("none", "ngram", "draft", "mtp", "medusa", "eagle")


def check_options(name: str, opts: dict) -> dict:
    """The options drafter `name` reads, type-checked; an unknown option or one it does not read is an error."""
    own = OPTIONS.get(name, ())
    out = {}
    for key, value in opts.items():
        if key not in OPTION_TYPES:
            near = difflib.get_close_matches(key, list(OPTION_TYPES), n=1)
            hint = f" (did you mean '{near[0]}'?)" if near else f" (options: {', '.join(OPTION_TYPES)})"
            raise ConfigError(f"unknown drafter option '{key}'{hint}")
        if value is None:
            continue
        flag, typ = OPTION_TYPES[key]
        if key not in own:
            raise ConfigError(f"{flag} is not used by --drafter {name}")
        if isinstance(value, bool) is not (typ is bool) or not isinstance(value, typ):
            raise ConfigError(f"{flag} must be {'true or false' if typ is bool else 'an integer'}, got {value!r}")
        out[key] = value
    return out


def for_drafter(kwargs: dict) -> dict:
    """Model.generate keyword arguments with the draft model and drafter options that kwargs['drafter']
    does not read dropped (for tools that run several drafters with one set of flags)."""
    name = kwargs.get("drafter", "none")
    own = OPTIONS.get(name, tuple(OPTION_TYPES))
    out = {k: v for k, v in kwargs.items() if k not in OPTION_TYPES or k in own}
    if name not in USES_DRAFT_MODEL:
        out.pop("draft_model", None)
    return out


def make_drafter(name: str, target, draft_model=None, **opts) -> Drafter:
    if not isinstance(name, str):
        raise ConfigError(f"drafter must be a name (one of: {', '.join(sorted(REGISTRY))}), got {name!r}")
    factory = REGISTRY.get(name)
    if factory is None:
        if name in KNOWN:
            raise ConfigError(f"drafter '{name}' is not available for this model")
        raise ConfigError(f"unknown drafter '{name}' (choose from: {', '.join(sorted(REGISTRY))})")
    return factory(target, draft_model=draft_model, **check_options(name, opts))


__all__ = ["Drafter", "NoDrafter", "NgramDrafter", "DraftModelDrafter", "make_drafter", "register", "REGISTRY",
           "OPTIONS", "check_options", "for_drafter"]

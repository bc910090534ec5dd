"""Drafter registry: one name per drafter, all on the same lossless verify path.

Each drafter declares its options as a frozen dataclass (a DrafterOptions: NgramOptions, MTPOptions,
EagleOptions, and empty ones for none / draft / medusa), type-checked on construction. make_drafter
builds it from keywords (the names of Model.generate's arguments) and refuses an unknown option, an
option another drafter reads, or a draft model a drafter does not use, naming it, before any
generation starts. An option set to None counts as not given (callers pass the CLI's unset flags).
"""

from __future__ import annotations

import difflib
import weakref
from dataclasses import dataclass
from functools import lru_cache
from pathlib import Path
from typing import Any, Callable

import torch

from ..device import of as device_of, on
from ..errors import ConfigError
from ..models.blocks import holds_blocks
from ..models.mtp_source import MTPSource
from ..models.placement import place
from .base import BatchDrafter, Drafter, DrafterOptions, NoDrafter, option
from .draft_model import DraftModelDrafter
from .lookahead import LookaheadDrafter, LookaheadOptions
from .ngram import NgramDrafter, NgramOptions
from .suffix import SuffixDrafter, SuffixOptions, shared_pool


@dataclass(frozen=True)
class NoDrafterOptions(DrafterOptions):
    """--drafter none reads no option."""


@dataclass(frozen=True)
class DraftModelOptions(DrafterOptions):
    """--drafter draft: its draft model is the draft_model argument; --tree N drafts a token tree of N nodes."""

    tree: int | str | None = option("tree", "--tree", None)  # a node budget (tree.py); None = a chain
    tree_beam: int = option("tree_beam", "--tree-beam", 1)  # a tree: nodes expanded per level (tree.py)


@dataclass(frozen=True)
class MedusaOptions(DrafterOptions):
    """--drafter medusa: K comes with the head; --tree N drafts a token tree of N nodes from the heads' top guesses."""

    tree: int | str | None = option("tree", "--tree", None)  # a node budget (tree.py); None = a chain


@dataclass(frozen=True)
class MTPOptions(DrafterOptions):
    draft_vocab: int | None = option("draft_vocab", "--draft-vocab", None)  # None = the checkpoint's default, 0 = full
    prenorm_hidden: bool = option("mtp_prenorm_hidden", "mtp_prenorm_hidden", False)  # feed the pre-final-norm hidden
    tree: int | str | None = option("tree", "--tree", None)  # a node budget: a dynamic token tree (tree.py); None = a chain
    tree_beam: int = option("tree_beam", "--tree-beam", 1)  # a tree: nodes expanded per level (tree.py)
    sparse_select: str | None = option("sparse_select", "--sparse-select", None)  # a sparse MTP: reuse (default) | recompute | full
    lookup: int = option("mtp_lookup", "--mtp-lookup", 0)  # N >= 2: draft by prompt lookup where the last N tokens recur; 0 = off


@dataclass(frozen=True)
class EagleOptions(DrafterOptions):
    draft_vocab: int | None = option("draft_vocab", "--draft-vocab", None)  # None = the checkpoint's default, 0 = full
    tree: int | str | None = option("tree", "--tree", None)  # a node budget: a dynamic token tree (tree.py); None = a chain
    tree_beam: int = option("tree_beam", "--tree-beam", 1)  # a tree: nodes expanded per level (tree.py)


@dataclass(frozen=True)
class Eagle3Options(DrafterOptions):
    """--drafter eagle3: its draft vocabulary comes with the head (d2t), so --draft-vocab is not one of its options."""

    tree: int | str | None = option("tree", "--tree", None)  # a node budget: a dynamic token tree (tree.py); None = a chain
    tree_beam: int = option("tree_beam", "--tree-beam", 1)  # a tree: nodes expanded per level (tree.py)


# name -> factory(target_model, draft_model, options) and the class of its options
REGISTRY: dict[str, Callable[[Any, Any, DrafterOptions], Drafter]] = {}
OPTION_CLASSES: dict[str, type[DrafterOptions]] = {}
USES_DRAFT_MODEL = ("draft", "mtp", "eagle", "eagle3", "medusa")  # mtp: optional (a trained head for a target without one)


def register(name: str, options: type[DrafterOptions]):
    def deco(factory):
        REGISTRY[name] = factory
        OPTION_CLASSES[name] = options
        return factory

    return deco


def _no_draft_model(name: str, draft_model) -> None:
    if draft_model is not None:
        raise ConfigError(f"--draft-model is not used by --drafter {name}")


@register("none", NoDrafterOptions)
def _none(target, draft_model, options: NoDrafterOptions) -> Drafter:
    _no_draft_model("none", draft_model)
    return NoDrafter()


@register("ngram", NgramOptions)
def _ngram(target, draft_model, options: NgramOptions) -> Drafter:
    _no_draft_model("ngram", draft_model)
    return NgramDrafter(n_min=options.n_min, n_max=options.n_max, tree=options.tree)


@register("lookahead", LookaheadOptions)
def _lookahead(target, draft_model, options: LookaheadOptions) -> Drafter:
    _no_draft_model("lookahead", draft_model)
    return LookaheadDrafter(n=options.n, jacobi=options.jacobi)


@register("suffix", SuffixOptions)
def _suffix(target, draft_model, options: SuffixOptions) -> Drafter:
    _no_draft_model("suffix", draft_model)
    return SuffixDrafter(depth=options.depth, pool=shared_pool(target, options.depth) if options.shared else None)


def _is_path(x) -> bool:
    return isinstance(x, (str, Path))


@register("draft", DraftModelOptions)
def _draft(target, draft_model, options: DraftModelOptions) -> Drafter:
    if draft_model is None:
        raise ConfigError("--drafter draft needs a draft model (--draft-model PATH)")
    if _is_path(draft_model):
        from ..loading import load_module
        from ..models.heads import is_head_dir

        if is_head_dir(draft_model):
            raise ConfigError(f"--drafter draft needs a full model; {draft_model} is a trained head (use it with --drafter mtp, eagle, eagle3 or medusa)")
        with torch.device("cpu"):  # loaded as on the CPU, then placed beside the target
            draft_model = place(load_module(draft_model, dtype=target.dtype), device_of(target))
    if not callable(getattr(draft_model, "forward_tokens", None)) or not hasattr(draft_model, "new_cache"):
        raise ConfigError(f"--drafter draft needs a causal LM as its draft model, got {type(draft_model).__name__}")
    _same_device(draft_model, target, "draft model")
    return DraftModelDrafter(draft_model, target.vocab_size, tree=options.tree, tree_beam=options.tree_beam)


@register("mtp", MTPOptions)
def _mtp(target, draft_model, options: MTPOptions) -> Drafter:
    """The target's own MTP module, or (draft_model = a head folder) one trained by `mtpspec train head`: by default the
    head shipped for the target's file when it has no module of its own (Gemma 3 270M's, models/gemma3-270m-mtp)."""
    from .mtp import MTPDrafter

    if draft_model is None and getattr(target, "mtp", None) is None:
        draft_model = getattr(target, "default_head", None)
    source = target if draft_model is None else _attached(target, draft_model, "mtp")
    if options.sparse_select is not None and getattr(source.config, "mtp_sparse_attention", None) is None:
        raise ConfigError("--sparse-select needs a sparse-attention MTP module (mtp_sparse_attention in the model's config, "
                          "from `mtpspec train mtp --sparse`); this model's MTP attends to its whole context")
    return MTPDrafter(source, prenorm_hidden=options.prenorm_hidden, draft_vocab=options.draft_vocab, tree=options.tree,
                      tree_beam=options.tree_beam, sparse_select=options.sparse_select or "reuse", lookup=options.lookup)


def _head(draft_model, kind: str, target):
    from ..models.heads import DraftHead

    if draft_model is None:
        raise ConfigError(f"--drafter {kind} needs a trained head (--draft-model HEAD_FOLDER, from `mtpspec train head`)")
    if isinstance(draft_model, DraftHead):
        head = draft_model if _dtype(draft_model) == target.dtype else _cast(draft_model, target.dtype)
    elif _is_path(draft_model):
        from ..loading import resolve_name

        path = Path(resolve_name(draft_model))
        meta = path / "head.json"
        with torch.device("cpu"):  # read as on the CPU; moved beside the target below
            if meta.exists():
                head = _read_head(str(path.resolve()), meta.stat().st_mtime, target.dtype)
            else:
                from ..models.eagle3_io import read_head

                head = read_head(path, target.dtype)  # an exported EAGLE-3 head (HF / GGUF), or names what is missing
    else:
        raise ConfigError(
            f"--drafter {kind} takes a trained head (a folder from `mtpspec train head`) as its draft model, "
            f"not a {type(draft_model).__name__}"
        )
    if head.config.kind != kind:
        raise ConfigError(f"--drafter {kind} was given a {head.config.kind} head")
    if device_of(head) != device_of(target):
        head = _on_device(head, device_of(target))
    return _on_blocks(head) if holds_blocks(target.lm_head) else head


_DEVICE_HEADS: "weakref.WeakKeyDictionary" = weakref.WeakKeyDictionary()  # a head -> {device: its copy there}


def _on_device(head, device):
    """A head's copy on the target's device (the caller's head stays where it is), made once per head and device."""
    import copy

    copies = _DEVICE_HEADS.setdefault(head, {})
    if device not in copies:
        copies[device] = place(copy.deepcopy(head), device)
    return copies[device]


def _same_device(module, target, what: str) -> None:
    if device_of(module) != device_of(target):
        raise ConfigError(f"the {what} is on {device_of(module)} and the target on {device_of(target)}: "
                          "load both on the same device")


_BLOCK_HEADS: "weakref.WeakKeyDictionary" = weakref.WeakKeyDictionary()  # a head -> its copy on Q8_0 blocks


def _on_blocks(head):
    """A head on a GGUF-block target drafts on the block kernel too (models.heads.on_blocks), built once per head."""
    from ..models.heads import on_blocks

    if head not in _BLOCK_HEADS:
        _BLOCK_HEADS[head] = on_blocks(head)
    return _BLOCK_HEADS[head]


@lru_cache(maxsize=8)
def _read_head(path: str, mtime: float, dtype):
    """A head folder read once per (path, its time of change, dtype): a server's requests share it."""
    from ..models.heads import load_head

    return load_head(path, dtype)


def _dtype(module):
    return next(module.parameters()).dtype


def _cast(head, dtype):
    import copy

    return copy.deepcopy(head).to(dtype)  # the caller's head keeps its dtype


def _attached(target, draft_model, kind: str) -> MTPSource:
    from ..models.heads import attach

    return attach(target, _head(draft_model, kind, target))


@register("eagle", EagleOptions)
def _eagle(target, draft_model, options: EagleOptions) -> Drafter:
    """An EAGLE head: the MTP drafter's bookkeeping, on a head that predicts the target's next feature."""
    from .mtp import MTPDrafter

    d = MTPDrafter(_attached(target, draft_model, "eagle"), draft_vocab=options.draft_vocab, tree=options.tree,
                    tree_beam=options.tree_beam)
    d.name = "eagle"
    return d


@register("eagle3", Eagle3Options)
def _eagle3(target, draft_model, options: Eagle3Options) -> Drafter:
    """An EAGLE-3 head (models/eagle3.py): the MTP drafter's bookkeeping, its pairs' hidden states fused from the
    target's layer inputs, its drafts from its own draft-vocabulary LM head."""
    from .mtp import MTPDrafter

    d = MTPDrafter(_attached(target, draft_model, "eagle3"), tree=options.tree, tree_beam=options.tree_beam)
    d.name = "eagle3"
    return d


@register("medusa", MedusaOptions)
def _medusa(target, draft_model, options: MedusaOptions) -> Drafter:
    from .medusa import MedusaDrafter

    return MedusaDrafter(target, _head(draft_model, "medusa", target), tree=options.tree)


KNOWN = ("none", "ngram", "draft", "mtp", "medusa", "eagle", "eagle3", "lookahead", "suffix")

# keyword -> (the flag its errors name, its type); drafter -> the keywords it reads (derived from the classes)
OPTION_TYPES: dict[str, tuple[str, type]] = {
    key: (cls.flags()[key], typ) for cls in OPTION_CLASSES.values() for key, typ in cls.types().items()
}
OPTIONS: dict[str, tuple[str, ...]] = {name: tuple(cls.keys()) for name, cls in OPTION_CLASSES.items()}


def options_for(name: str, opts: dict) -> DrafterOptions:
    """Drafter `name`'s options object from keywords; an unknown option or one it does not read is an error."""
    cls = OPTION_CLASSES.get(name, NoDrafterOptions)
    own = cls.keys()  # keyword -> field
    given = {}
    for key, value in opts.items():
        if key not in OPTION_TYPES:
            near = difflib.get_close_matches(key, list(OPTION_TYPES), n=1)
            hint = f" (did you mean '{near[0]}'?)" if near else f" (options: {', '.join(OPTION_TYPES)})"
            raise ConfigError(f"unknown drafter option '{key}'{hint}")
        if value is None:
            continue
        if key not in own:
            raise ConfigError(f"{OPTION_TYPES[key][0]} is not used by --drafter {name}")
        given[own[key]] = value
    return cls(**given)  # type-checked here


def check_options(name: str, opts: dict) -> dict:
    """The options drafter `name` reads (the given, not-None keywords), checked as options_for checks them."""
    options_for(name, opts)
    return {k: v for k, v in opts.items() if v is not None}


def for_drafter(kwargs: dict) -> dict:
    """Model.generate keyword arguments with the draft model and drafter options that kwargs['drafter']
    does not read dropped (for tools that run several drafters with one set of flags)."""
    name = kwargs.get("drafter", "none")
    own = OPTIONS.get(name, tuple(OPTION_TYPES))
    out = {k: v for k, v in kwargs.items() if k not in OPTION_TYPES or k in own}
    if name not in USES_DRAFT_MODEL:
        out.pop("draft_model", None)
    return out


def make_drafter(name: str, target, draft_model=None, options: DrafterOptions | None = None, **opts) -> Drafter:
    """A fresh drafter `name` for `target`; its options either as `options` (the drafter's DrafterOptions)
    or as keywords (ngram_min=2, draft_vocab=64, ...), not both."""
    if not isinstance(name, str):
        raise ConfigError(f"drafter must be a name (one of: {', '.join(sorted(REGISTRY))}), got {name!r}")
    factory = REGISTRY.get(name)
    if factory is None:
        if name in KNOWN:
            raise ConfigError(f"drafter '{name}' is not available for this model")
        raise ConfigError(f"unknown drafter '{name}' (choose from: {', '.join(sorted(REGISTRY))})")
    from_keywords = options_for(name, opts)
    if options is None:
        options = from_keywords
    elif type(options) is not OPTION_CLASSES[name]:
        raise ConfigError(f"--drafter {name} takes {OPTION_CLASSES[name].__name__}, got {type(options).__name__}")
    elif any(v is not None for v in opts.values()):
        raise ConfigError(f"drafter options given twice: as options= and as {', '.join(k for k, v in opts.items() if v is not None)}")
    with on(device_of(target)):  # what a drafter builds (folded copies, its tables) is made on the target's device
        return factory(target, draft_model, options)


__all__ = ["Drafter", "BatchDrafter", "MTPSource", "NoDrafter", "NgramDrafter", "DraftModelDrafter", "make_drafter",
           "register", "REGISTRY", "OPTIONS", "OPTION_TYPES", "OPTION_CLASSES", "USES_DRAFT_MODEL", "DrafterOptions",
           "NoDrafterOptions", "NgramOptions", "DraftModelOptions", "MTPOptions", "EagleOptions", "Eagle3Options", "MedusaOptions",
           "options_for", "check_options", "for_drafter"]

"""The models a server serves: loaded once at start-up, named, and looked up by name only.

`mtpspec serve --model [NAME=]PATH ... --draft-model [NAME=]PATH ...` loads every model before the
server binds, so a missing or bad file is a start-up error. Requests name a model (or a draft model)
by NAME; no request ever makes the server open a path.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from pathlib import Path

from ..api import Model, load
from ..drafters import KNOWN, USES_DRAFT_MODEL, make_drafter
from ..errors import ConfigError, ModelLoadError, MtpspecError
from .verify_page import FieldError

NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,63}")
DRAFTERS = [n for n in KNOWN if n != "none"]  # the drafters a request may name
SELF_DRAFTING = tuple(n for n in DRAFTERS if n not in USES_DRAFT_MODEL)  # draft from the text alone: no draft model, no head


@dataclass
class DraftEntry:
    """A --draft-model: a draft LM (kind 'model', for drafter 'draft') or a trained head (kind mtp | eagle | medusa)."""

    name: str
    kind: str
    obj: object  # the draft model's module, or a DraftHead


@dataclass
class Served:
    """The server's models by name, the draft models by name, and each model's drafter menu."""

    models: dict[str, Model]
    drafts: dict[str, DraftEntry] = field(default_factory=dict)
    default: str = ""
    menus: dict[str, list[dict]] = field(default_factory=dict)  # model name -> available_drafters()

    def __post_init__(self) -> None:
        if not self.models:
            raise ConfigError("serve needs at least one model")
        self.default = self.default or next(iter(self.models))
        for name, model in self.models.items():  # each model may also draft for another (drafter 'draft')
            self.drafts.setdefault(name, DraftEntry(name, "model", model.module))
        self.menus = {name: self._menu(name) for name in self.models}

    def model(self, name: str | None) -> tuple[str, Model]:
        """The model a request names (None = the default); an unknown name is a 404 that lists the served ones."""
        name = self.default if name is None else name
        if name not in self.models:
            raise FieldError("model", f"no served model named {name!r} (served: {', '.join(self.models)})", status=404)
        return name, self.models[name]

    def draft_for(self, model_name: str, drafter: str, draft_name: str | None):
        """The draft object for `drafter` on model `model_name`, checked by building the drafter once."""
        if drafter not in KNOWN:
            raise FieldError("drafter", f"unknown drafter {drafter!r} (choose from: {', '.join(DRAFTERS)})")
        if drafter == "none":
            raise FieldError("drafter", "'none' proposes no draft: choose a drafter (ngram, draft, mtp, ...)")
        obj = None
        if draft_name is not None:
            if drafter in SELF_DRAFTING:
                raise FieldError("draft_model", f"the {drafter!r} drafter takes no draft model")
            entry = self.drafts.get(draft_name)
            if entry is None:
                raise FieldError("draft_model", f"no served draft model named {draft_name!r} (served: {', '.join(self.drafts)})", status=404)
            want = "model" if drafter == "draft" else drafter
            if entry.kind != want:
                what = "a draft model" if want == "model" else f"a trained {want} head"
                raise FieldError("draft_model", f"{draft_name!r} is {_kind_text(entry.kind)}; drafter {drafter!r} needs {what}")
            obj = entry.obj
        elif not (item := next(d for d in self.menus[model_name] if d["name"] == drafter))["own"]:
            names = item["draft_models"]
            need = "a draft model" if drafter == "draft" else f"a trained {drafter} head"
            raise FieldError("draft_model", f"drafter {drafter!r} needs {need} (served for this model: {', '.join(names) or 'none'})")
        try:
            make_drafter(drafter, self.models[model_name].module, draft_model=obj)
        except MtpspecError as e:
            raise FieldError("draft_model" if obj is not None else "drafter", str(e)) from None
        return obj

    def _menu(self, name: str) -> list[dict]:
        """Every drafter for this model: available or not (with the reason), and the draft models that fit it."""
        module = self.models[name].module
        menu = []
        for drafter in DRAFTERS:
            fits = [e.name for e in self.drafts.values() if e.name != name and _fits(module, drafter, e)]
            own = drafter in SELF_DRAFTING or (drafter == "mtp" and _builds(module, "mtp", None) is None)
            item = {"name": drafter, "available": own or bool(fits), "own": own, "draft_models": fits,
                    "uses_draft_model": drafter not in SELF_DRAFTING}
            if not item["available"]:
                need = "draft model" if drafter == "draft" else f"{drafter} head"
                item["reason"] = f"no served {need} fits this model (serve one with --draft-model NAME=PATH)"
            menu.append(item)
        return menu


def _kind_text(kind: str) -> str:
    return "a draft model" if kind == "model" else f"a trained {kind} head"


def _fits(module, drafter: str, entry: DraftEntry) -> bool:
    want = "model" if drafter == "draft" else drafter
    return drafter not in SELF_DRAFTING and entry.kind == want and _builds(module, drafter, entry.obj) is None


def _builds(module, drafter: str, obj) -> str | None:
    """None when the drafter builds for this model, else why not (one line)."""
    try:
        make_drafter(drafter, module, draft_model=obj)
        return None
    except MtpspecError as e:
        return str(e)


def parse_spec(text: str, flag: str) -> tuple[str | None, str]:
    """'NAME=PATH' -> (NAME, PATH); a bare PATH (or 'demo') -> (None, PATH)."""
    name, sep, path = text.partition("=")
    if sep and NAME.fullmatch(name):
        if not path:
            raise ConfigError(f"{flag} {text!r}: no path after '='")
        return name, path
    if not text:
        raise ConfigError(f"{flag}: empty value")
    return None, text


def derive_name(path: str, flag: str) -> str:
    """A model's name from its path: 'demo', a file's stem, a directory's name."""
    p = Path(path)
    name = p.name if p.is_dir() else p.stem
    if path == "demo":
        name = "demo"
    if not NAME.fullmatch(name):
        raise ConfigError(f"{flag} {path!r}: cannot derive a name from the path; give one as NAME=PATH")
    return name


def _named(specs: list[str], flag: str) -> dict[str, str]:
    out: dict[str, str] = {}
    for text in specs:
        name, path = parse_spec(text, flag)
        name = name or derive_name(path, flag)
        if name in out:
            raise ConfigError(f"{flag}: the name {name!r} is given twice (name them: {flag} NAME=PATH)")
        out[name] = path
    return out


def load_served(models: list[str] | None = None, tokenizers: list[str] | None = None,
                draft_models: list[str] | None = None, dtype: str = "fp32") -> Served:
    """Load every model named on the command line (default: demo); any failure is a one-line error."""
    paths = _named(models or ["demo"], "--model")
    toks = _tokenizers(tokenizers or [], list(paths))
    drafts = _named(draft_models or [], "--draft-model")
    clash = sorted(set(paths) & set(drafts))
    if clash:
        raise ConfigError(f"--draft-model: the name {clash[0]!r} is also a --model; name it differently (NAME=PATH)")
    loaded = {name: _load(name, path, toks.get(name), dtype) for name, path in paths.items()}
    entries = {name: _load_draft(name, path, dtype) for name, path in drafts.items()}
    return Served(loaded, entries)


def _tokenizers(specs: list[str], names: list[str]) -> dict[str, str]:
    """--tokenizer NAME=PATH per model; a bare PATH only when one model is served."""
    out: dict[str, str] = {}
    for text in specs:
        name, path = parse_spec(text, "--tokenizer")
        if name is None:
            if len(names) != 1:
                raise ConfigError(f"--tokenizer {text!r}: several models are served; say which: --tokenizer NAME=PATH")
            name = names[0]
        if name not in names:
            raise ConfigError(f"--tokenizer {text!r}: no --model named {name!r} (models: {', '.join(names)})")
        if name in out:
            raise ConfigError(f"--tokenizer: model {name!r} is given two tokenizers")
        out[name] = path
    return out


def _load(name: str, path: str, tokenizer: str | None, dtype: str) -> Model:
    try:
        return load(path, tokenizer, dtype)
    except MtpspecError as e:
        raise type(e)(f"--model {name}: {e}") from None
    except (OSError, ValueError, RuntimeError) as e:  # a file the loaders did not foresee: still one line
        raise ModelLoadError(f"--model {name}: cannot load {path}: {type(e).__name__}: {e}") from None


def _load_draft(name: str, path: str, dtype: str) -> DraftEntry:
    from ..loading import load_module, parse_dtype
    from ..models.heads import load_head

    try:
        if Path(path).is_dir() and (Path(path) / "head.json").exists():
            head = load_head(path, parse_dtype(dtype))
            return DraftEntry(name, head.config.kind, head)
        return DraftEntry(name, "model", load_module(path, dtype))
    except MtpspecError as e:
        raise type(e)(f"--draft-model {name}: {e}") from None
    except (OSError, ValueError, RuntimeError) as e:
        raise ModelLoadError(f"--draft-model {name}: cannot load {path}: {type(e).__name__}: {e}") from None

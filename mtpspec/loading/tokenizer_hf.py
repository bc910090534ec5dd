"""Hugging Face tokenizers (tokenizer.json via the `tokenizers` library), with the llama2.c tokenizer's interface.

encode(text) -> prompt ids (BOS only if the tokenizer's own post-processor adds one);
decode(ids, prev) -> text of a continuation that follows token `prev`; stream(prev) -> an incremental
decoder; stop_ids -> EOS ids (generation_config.json, else config.json, else the tokenizer's own).
"""

from __future__ import annotations

import json
from pathlib import Path

from ..errors import ConfigError, ModelLoadError


class HFTokenizer:
    def __init__(self, tok, stop_ids: tuple[int, ...] = ()) -> None:
        self.tokenizer = tok  # tokenizers.Tokenizer
        self.stop_ids = tuple(stop_ids)
        self.chat_template: str | None = None  # from the source folder's tokenizer_config.json, if any
        self._special_ids = frozenset(i for i, t in tok.get_added_tokens_decoder().items() if t.special)
        self.bos_id = None
        probe = tok.encode("", add_special_tokens=True).ids
        if probe:
            self.bos_id = probe[0]

    @classmethod
    def load(cls, path: str | Path, stop_ids: tuple[int, ...] = ()) -> "HFTokenizer":
        from tokenizers import Tokenizer

        path = Path(path)
        try:
            tok = Tokenizer.from_file(str(path))
        except Exception as e:  # noqa: BLE001 - any parse failure is a bad file
            raise ModelLoadError(f"{path}: not a readable tokenizer.json ({str(e).splitlines()[0] if str(e) else type(e).__name__})") from None
        if not stop_ids:
            stop_ids = _tokenizer_eos(path.parent, tok)
        out = cls(tok, stop_ids)
        out.chat_template = _chat_template(path.parent)
        return out

    @property
    def vocab_size(self) -> int:
        return self.tokenizer.get_vocab_size(with_added_tokens=True)

    def save(self, path: str | Path) -> None:
        self.tokenizer.save(str(path))

    def to_hf(self):
        """The `tokenizers.Tokenizer` itself (already Hugging Face's format)."""
        return self.tokenizer

    def hf_tokenizer_config(self) -> dict:
        """tokenizer_config.json fields: the special tokens by name, BOS added as `encode` adds it."""
        name = lambda i: None if i is None else self.tokenizer.id_to_token(i)  # noqa: E731
        unk = getattr(self.tokenizer.model, "unk_token", None)
        eos = name(self.stop_ids[0]) if self.stop_ids else None
        cfg = {"tokenizer_class": "PreTrainedTokenizerFast", "bos_token": name(self.bos_id), "eos_token": eos,
               "unk_token": unk if unk and self.tokenizer.token_to_id(unk) is not None else None, "pad_token": eos,
               "add_bos_token": self.bos_id is not None, "add_eos_token": False, "clean_up_tokenization_spaces": False}
        if self.chat_template:
            cfg["chat_template"] = self.chat_template
        return cfg

    def encode(self, text: str) -> list[int]:
        ids = self.tokenizer.encode(text, add_special_tokens=True).ids
        if not ids:
            raise ConfigError("the prompt is empty and this tokenizer adds no BOS token: give a prompt")
        return ids

    def _decode(self, ids: list[int]) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=False)

    def decode(self, tokens: list[int], prev: int | None = None) -> str:
        """Text of `tokens` as a continuation of `prev` (so leading spaces / merged bytes come out right)."""
        if prev is None or prev in self._special_ids:  # after BOS: as transformers decodes prompt + continuation
            return self._decode(list(tokens))
        head = self._decode([prev])
        full = self._decode([prev, *tokens])
        return full[len(head):] if full.startswith(head) else self._decode(list(tokens))

    def stream(self, prev: int | None = None) -> "HFTextStream":
        return HFTextStream(self, prev)


class HFTextStream:
    """Incremental decoder: text is emitted once it is complete (no trailing partial UTF-8 character)."""

    def __init__(self, tok: HFTokenizer, prev: int | None) -> None:
        self.tok, self.prev = tok, prev
        self.ids: list[int] = []
        self.emitted = 0  # characters of decode(ids) already returned

    def push(self, tokens: list[int]) -> str:
        self.ids += list(tokens)
        text = self.tok.decode(self.ids, prev=self.prev)
        end = len(text)
        while end > self.emitted and text[end - 1] == "\ufffd":  # an unfinished multi-byte character
            end -= 1
        out = text[self.emitted:end]
        self.emitted = end
        return out

    def flush(self) -> str:
        text = self.tok.decode(self.ids, prev=self.prev)
        out = text[self.emitted:]
        self.emitted = len(text)
        return out


def _ids(value) -> tuple[int, ...]:
    if value is None:
        return ()
    if isinstance(value, int):
        return (value,)
    return tuple(int(v) for v in value)


def stop_ids_from_configs(directory: Path) -> tuple[int, ...]:
    """EOS ids from generation_config.json, else config.json (or its text_config)."""
    for name in ("generation_config.json", "config.json"):
        p = directory / name
        if not p.exists():
            continue
        try:
            cfg = json.loads(p.read_text())
        except (OSError, json.JSONDecodeError):
            continue
        ids = _ids(cfg.get("eos_token_id")) or _ids((cfg.get("text_config") or {}).get("eos_token_id"))
        if ids:
            return ids
    return ()


def _tokenizer_eos(directory: Path, tok) -> tuple[int, ...]:
    p = directory / "tokenizer_config.json"
    if p.exists():
        try:
            eos = json.loads(p.read_text()).get("eos_token")
            if isinstance(eos, dict):
                eos = eos.get("content")
            if isinstance(eos, str) and tok.token_to_id(eos) is not None:
                return (tok.token_to_id(eos),)
        except (OSError, json.JSONDecodeError):
            pass
    return ()


def _chat_template(directory: Path) -> str | None:
    """The chat template of a Hugging Face folder: chat_template.jinja, else tokenizer_config.json's."""
    try:
        if (directory / "chat_template.jinja").is_file():
            return (directory / "chat_template.jinja").read_text()
        if (directory / "tokenizer_config.json").is_file():
            value = json.loads((directory / "tokenizer_config.json").read_text()).get("chat_template")
            return value if isinstance(value, str) else None
    except (OSError, UnicodeDecodeError, json.JSONDecodeError, AttributeError):
        return None
    return None


def load_hf_tokenizer(directory: Path, explicit: str | Path | None = None) -> HFTokenizer:
    path = Path(explicit) if explicit else directory / "tokenizer.json"
    if path.is_dir():
        path = path / "tokenizer.json"
    if not path.exists():
        raise ModelLoadError(f"{directory}: no tokenizer.json (give one with --tokenizer PATH)")
    return HFTokenizer.load(path, stop_ids_from_configs(directory))

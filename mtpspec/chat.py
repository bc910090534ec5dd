"""Chat prompts for POST /v1/chat/completions: messages -> the text (and ids) the model continues.

The template is the tokenizer's own `chat_template` (Hugging Face's tokenizer_config.json or
chat_template.jinja), rendered as the ecosystem renders it: a sandboxed, immutable Jinja environment
(trim_blocks, lstrip_blocks, loop controls), `raise_exception(msg)`, `strftime_now(fmt)`, a `tojson`
filter that keeps non-ASCII text, and the variables messages, add_generation_prompt, bos_token,
eos_token, tools (None). A tokenizer without one (llama2.c's, the demo's) gets PLAIN_TEMPLATE.

Messages are normalised before rendering: role in ROLES, content a string (a list of
{"type": "text", "text": ...} parts is joined with newlines, as vLLM joins them; null is ""). Every
failure, the client's or the template's, is a ConfigError whose one-line message starts "messages: ".
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from datetime import datetime

import jinja2
from jinja2.exceptions import SecurityError
from jinja2.ext import Extension, loopcontrols
from jinja2.sandbox import ImmutableSandboxedEnvironment

from .errors import ConfigError

ROLES = ("system", "user", "assistant", "tool", "developer")

# The fallback for tokenizers without a chat template: one "Role: content" line per message, then
# "Assistant:" for the model to continue. system and developer both read "System".
PLAIN_TEMPLATE = (
    "{% for m in messages %}"
    "{{ {'system': 'System', 'developer': 'System', 'user': 'User', 'assistant': 'Assistant', 'tool': 'Tool'}[m.role] }}"
    ": {{ m.content }}\n"
    "{% endfor %}"
    "{% if add_generation_prompt %}Assistant:{% endif %}"
)

# Message fields a template may read besides role and content (passed through unchanged).
_EXTRA_FIELDS = ("name", "tool_calls", "tool_call_id", "reasoning_content")


class _GenerationTag(Extension):
    """`{% generation %}...{% endgeneration %}` (transformers marks assistant spans with it): renders its body."""

    tags = {"generation"}

    def parse(self, parser):
        lineno = next(parser.stream).lineno
        body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
        return jinja2.nodes.Scope(body, lineno=lineno)


def _raise_exception(message) -> None:
    raise jinja2.exceptions.TemplateError(str(message))


def _strftime_now(fmt: str) -> str:
    return datetime.now().strftime(fmt)


def _tojson(value, ensure_ascii: bool = False, indent=None, separators=None, sort_keys: bool = False) -> str:
    return json.dumps(value, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)


class _Sandbox(ImmutableSandboxedEnvironment):
    """Jinja's immutable sandbox, refusing an unsafe attribute at once (Jinja's renders a bare one as "")."""

    def unsafe_undefined(self, obj, attribute):
        raise SecurityError(f"access to attribute {attribute!r} of {type(obj).__name__!r} object is unsafe")


def _environment() -> ImmutableSandboxedEnvironment:
    env = _Sandbox(trim_blocks=True, lstrip_blocks=True, extensions=[loopcontrols, _GenerationTag])
    env.filters["tojson"] = _tojson
    env.globals["raise_exception"] = _raise_exception
    env.globals["strftime_now"] = _strftime_now
    return env


def _one_line(text: str) -> str:
    return " ".join(str(text).split())


def _special_names(tokenizer) -> tuple[str, str]:
    """(bos_token, eos_token) as text, "" where the tokenizer has none.

    Both tokenizers name their specials in `hf_tokenizer_config()` (BOS as `encode` adds it, EOS the
    first stop id), the names a Hugging Face chat template expects.
    """
    names = getattr(tokenizer, "hf_tokenizer_config", None)
    cfg = names() if callable(names) else {}
    return cfg.get("bos_token") or "", cfg.get("eos_token") or ""


def _text(value, where: str) -> str:
    try:
        value.encode("utf-8")
    except UnicodeEncodeError as e:
        raise ConfigError(f"messages: {where} is not valid text: lone surrogate {value[e.start]!r} at character {e.start}") from None
    return value


def _content(content, where: str) -> str:
    """A message's content as one string: text, null, or a list of text parts joined by newlines."""
    if content is None:
        return ""
    if isinstance(content, str):
        return _text(content, where)
    if not isinstance(content, list):
        raise ConfigError(f"messages: {where} must be a string or a list of parts, got {type(content).__name__}")
    texts = []
    for j, part in enumerate(content):
        at = f"{where}[{j}]"
        if not isinstance(part, dict):
            raise ConfigError(f"messages: {at} must be an object, got {type(part).__name__}")
        kind = part.get("type")
        if kind != "text":
            raise ConfigError(f"messages: {at} has type {kind!r}: only 'text' parts are supported")
        if not isinstance(part.get("text"), str):
            raise ConfigError(f"messages: {at} needs a string 'text'")
        texts.append(_text(part["text"], f"{at}.text"))
    return "\n".join(texts)


def normalize_messages(messages) -> list[dict]:
    """Checked copies of the messages: role in ROLES, content a string, known extra fields kept."""
    if not isinstance(messages, list) or not messages:
        raise ConfigError("messages: must be a non-empty list of {role, content} objects")
    out = []
    for i, m in enumerate(messages):
        if not isinstance(m, dict):
            raise ConfigError(f"messages: [{i}] must be an object, got {type(m).__name__}")
        role = m.get("role")
        if role not in ROLES:
            raise ConfigError(f"messages: [{i}].role {_one_line(repr(role))[:60]} is not one of {', '.join(ROLES)}")
        msg = {"role": role, "content": _content(m.get("content"), f"[{i}].content")}
        for k in _EXTRA_FIELDS:
            if k in m:
                msg[k] = m[k]
        out.append(msg)
    return out


@dataclass
class ChatTemplate:
    """A compiled chat template with the tokenizer's BOS / EOS text and id; build with `for_tokenizer`."""

    template: jinja2.Template
    source: str  # "tokenizer" (its chat_template) or "plain" (PLAIN_TEMPLATE)
    bos_token: str  # "" when the tokenizer has no BOS
    eos_token: str  # "" when it has no EOS
    bos_id: int | None

    @classmethod
    def for_tokenizer(cls, tokenizer) -> "ChatTemplate":
        """The tokenizer's chat template, else the plain one; a template that does not compile is a ConfigError."""
        text = getattr(tokenizer, "chat_template", None)
        source = "tokenizer" if isinstance(text, str) and text.strip() else "plain"
        try:
            template = _environment().from_string(text if source == "tokenizer" else PLAIN_TEMPLATE)
        except jinja2.TemplateSyntaxError as e:
            raise ConfigError(f"the tokenizer's chat template does not compile: line {e.lineno}: {_one_line(e.message)}") from None
        bos, eos = _special_names(tokenizer)
        return cls(template=template, source=source, bos_token=bos, eos_token=eos, bos_id=getattr(tokenizer, "bos_id", None))

    def render(self, messages: list[dict], add_generation_prompt: bool = True) -> str:
        """The prompt text for `messages` (see normalize_messages); any failure is a ConfigError "messages: ..."."""
        msgs = normalize_messages(messages)
        try:
            return self.template.render(messages=msgs, add_generation_prompt=bool(add_generation_prompt),
                                        bos_token=self.bos_token, eos_token=self.eos_token, tools=None)
        except SecurityError as e:
            raise ConfigError(f"messages: the chat template was refused an unsafe operation ({_one_line(e)})") from None
        except jinja2.TemplateError as e:  # raise_exception, undefined values, other runtime errors
            raise ConfigError(f"messages: {_one_line(e) or type(e).__name__}") from None
        except (TypeError, ValueError, KeyError, IndexError, AttributeError, ZeroDivisionError, RecursionError) as e:
            raise ConfigError(f"messages: the chat template failed: {type(e).__name__}: {_one_line(e)}") from None

    def prompt_ids(self, model, messages: list[dict], add_generation_prompt: bool = True) -> list[int]:
        """Token ids of the rendered prompt via `model.encode`, with one BOS where the template also wrote it.

        A template that starts with bos_token and a tokenizer whose encode prepends the BOS id would
        give two BOS ids; the one encode added is dropped.
        """
        text = self.render(messages, add_generation_prompt)
        ids = model.encode(text)
        bos = self.bos_id
        if bos is not None and self.bos_token and text.startswith(self.bos_token) and ids[:2] == [bos, bos]:
            ids = ids[1:]
        return ids

"""Prompt sets from the assets folder (real text made by others, never downloaded at run time)."""

from __future__ import annotations

import gzip
import json
from dataclasses import dataclass
from pathlib import Path

from .errors import ConfigError
from .loading import assets_dir


def tinystories_prompts(n: int = 20, words: int = 12, path: str | Path | None = None) -> list[str]:
    """The opening `words` words of the first n stories of the TinyStories validation prefix (paragraphs opening
    "Once upon a time" / "One day"; the first paragraph is a cut story's tail)."""
    path = Path(path) if path else assets_dir() / "prompts" / "tinystories_val_prefix.txt"
    if not path.exists():
        raise ConfigError(f"prompt file not found: {path}")
    paragraphs = [p.strip() for p in path.read_text(encoding="utf-8").split("\n\n") if p.strip()]
    openers = [p for p in paragraphs[1:] if p.startswith(("Once upon a time", "One day"))]
    return [" ".join(p.split()[:words]) for p in openers[:n]]


# Spec-Bench's six categories; its first 80 rows carry MT-bench's own sub-categories.
SPEC_BENCH_CATEGORIES = ("mt_bench", "translation", "summarization", "qa", "math_reasoning", "rag")
_MT_BENCH_SUB = {"writing", "roleplay", "reasoning", "math", "coding", "extraction", "stem", "humanities"}

NAMED_SETS = {  # --prompts NAME -> file in the assets' prompts/ folder
    "spec_bench": "spec_bench_question.jsonl",
    "mt_bench": "mt_bench_question.jsonl",
    "humaneval": "HumanEval.jsonl.gz",
    "tinystories": "tinystories_val_prefix.txt",
}


@dataclass(frozen=True)
class Prompt:
    """One benchmark prompt: where it came from, its category, and its text."""

    id: str
    category: str
    text: str


def _jsonl_rows(path: Path) -> list:
    opener = gzip.open if path.suffix == ".gz" else open
    rows = []
    with opener(path, "rt", encoding="utf-8") as f:
        for n, line in enumerate(f, 1):
            if line.strip():
                try:
                    rows.append(json.loads(line))
                except json.JSONDecodeError as e:
                    raise ConfigError(f"{path}:{n}: not valid JSON ({e.msg})") from None
    return rows


def _row_prompt(row, n: int, path: Path) -> Prompt:
    """A JSONL row: Spec-Bench / MT-bench ({question_id, category, turns}), HumanEval ({task_id,
    prompt}), or the user's own ({prompt} / {text} / {turns}, optional {id, category}), or a string."""
    if isinstance(row, str):
        return Prompt(str(n), "default", row)
    if not isinstance(row, dict):
        raise ConfigError(f"{path}: row {n} is neither an object nor a string")
    if "turns" in row:  # Spec-Bench / MT-bench: the first turn is the prompt
        text = row["turns"][0] if row["turns"] else ""
        cat = str(row.get("category", "default"))
        if cat in _MT_BENCH_SUB:
            cat = "mt_bench"
        return Prompt(str(row.get("question_id", n)), cat, text)
    for key in ("prompt", "text", "question", "input"):
        if isinstance(row.get(key), str):
            cat = row.get("category") or ("humaneval" if "task_id" in row else "default")
            return Prompt(str(row.get("task_id", row.get("id", n))), str(cat), row[key])
    raise ConfigError(f"{path}: row {n} has no prompt text (expected a 'prompt', 'text' or 'turns' field)")


def _text_prompts(path: Path) -> list[Prompt]:
    """Plain text: one prompt per blank-line-separated paragraph, or per line when there are none."""
    text = path.read_text(encoding="utf-8")
    parts = [p.strip() for p in text.split("\n\n")] if "\n\n" in text.strip() else [ln.strip() for ln in text.splitlines()]
    return [Prompt(str(i), "default", p) for i, p in enumerate(x for x in parts if x)]


def _spread(prompts: list[Prompt], limit: int | None) -> list[Prompt]:
    """The first `limit` prompts taken round-robin over categories, so every category is represented."""
    if limit is None or limit >= len(prompts):
        return prompts
    by_cat: dict[str, list[Prompt]] = {}
    for p in prompts:
        by_cat.setdefault(p.category, []).append(p)
    out: list[Prompt] = []
    i = 0
    while len(out) < limit:
        for rows in by_cat.values():
            if i < len(rows) and len(out) < limit:
                out.append(rows[i])
        i += 1
    order = {id(p): n for n, p in enumerate(prompts)}
    return sorted(out, key=lambda p: order[id(p)])


def load_prompts(source: str | Path, limit: int | None = None) -> list[Prompt]:
    """A prompt set by name (spec_bench, mt_bench, humaneval, tinystories) or file (.jsonl / .jsonl.gz rows, .txt
    paragraphs or lines); `limit` takes prompts round-robin over categories, so every category is covered."""
    name = str(source)
    path = assets_dir() / "prompts" / NAMED_SETS[name] if name in NAMED_SETS else Path(source)
    if not path.exists():
        raise ConfigError(f"prompt file not found: {path} (or name one of: {', '.join(NAMED_SETS)})")
    if path.name == "tinystories_val_prefix.txt":
        texts = tinystories_prompts(limit or 1_000_000, path=path)
        prompts = [Prompt(str(i), "tinystories", t) for i, t in enumerate(texts)]
    elif path.name.endswith((".jsonl", ".jsonl.gz", ".json")):
        prompts = [_row_prompt(r, n, path) for n, r in enumerate(_jsonl_rows(path))]
    else:
        prompts = _text_prompts(path)
    if not prompts:
        raise ConfigError(f"{path}: no prompts found")
    return _spread(prompts, limit)


def fit_prompt(ids: list[int], max_prompt_tokens: int) -> list[int]:
    """Keep BOS and the last max_prompt_tokens - 1 tokens (the text nearest the generation point)."""
    if len(ids) <= max_prompt_tokens:
        return ids
    return ids[:1] + ids[len(ids) - (max_prompt_tokens - 1) :]

"""What the bench commands share below bench/cli.py: a comma-separated list of counts parsed strictly, and a
progress bar. bench/cli.py runs bench/batch.py and bench/contexts.py; they take these from here, not from it."""

from __future__ import annotations

import sys
from contextlib import contextmanager

from ..errors import ConfigError


def parse_counts(text: str, flag: str, what: str, example: str = "1,2,4,8") -> list[int]:
    """"1,4,16" -> [1, 4, 16] (sorted, each once): positive integers for `flag`; anything else is a ConfigError naming it."""
    parts = [x.strip() for x in str(text).split(",") if x.strip()]
    if not parts:
        raise ConfigError(f"{flag} needs {what} separated by commas, e.g. {example}; got {text!r}")
    out = []
    for x in parts:
        try:
            n = int(x)
        except ValueError:
            raise ConfigError(f"{flag} takes integer {what} >= 1 separated by commas (e.g. {example}), got {x!r}") from None
        if n < 1:
            raise ConfigError(f"{flag} {what} must be >= 1, got {n}")
        out.append(n)
    return sorted(set(out))


@contextmanager
def progress_bar(on: bool, total: int, desc: str, unit: str):
    """Yields tick(label), which advances a tqdm bar on stderr (None when `on` is false)."""
    if not on:
        yield None
        return
    from tqdm import tqdm

    with tqdm(total=total, desc=desc, unit=unit, file=sys.stderr) as bar:
        yield lambda label: (bar.set_postfix_str(label), bar.update(1))

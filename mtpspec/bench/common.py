"""What the bench commands share: quantiles and timing rounds, strict count lists, a progress bar, jobs run in turn a
few milliseconds at a time (Lockstep), and the markdown / plot helpers of every report."""

from __future__ import annotations

import random
import statistics
import sys
from contextlib import contextmanager
from pathlib import Path
from time import perf_counter, process_time
from typing import Callable, Iterator

from greenlet import getcurrent, greenlet

from ..errors import ConfigError

SLICE_SECONDS = 0.005


def quantile(xs, q: float) -> float | None:
    """The q-quantile of xs (the element at rank q * n), None when empty."""
    xs = sorted(xs)
    return xs[min(int(q * len(xs)), len(xs) - 1)] if xs else None


def median(xs) -> float | None:
    """The median of the values that are not None (None when there are none)."""
    xs = [x for x in xs if x is not None]
    return statistics.median(xs) if xs else None


def rounds(estimate: Callable[[], list[float]], repeat: int, min_repeat: int, tol: float, budget_s: float,
           every: int = 2) -> Iterator[int]:
    """Round numbers 0, 1, ... of a timing loop: at most `repeat`; after `min_repeat`, checked every `every` rounds,
    it stops once no estimate moved by more than `tol` (relative) since the last check or `budget_s` seconds are spent."""
    start, prev = perf_counter(), None
    for r in range(repeat):
        yield r
        if r + 1 >= min_repeat and (r + 1 - min_repeat) % every == 0:
            cur = estimate()
            if prev is not None and all(abs(c - p) <= tol * p for p, c in zip(prev, cur)) or perf_counter() - start > budget_s:
                return
            prev = cur


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


class Turn:
    """A job's view of a Lockstep rotation: call `step_done` after every engine step; `waited` = seconds away."""

    def __init__(self, rotation: "Lockstep") -> None:
        self._rotation = rotation
        self.waited = self.waited_cpu = 0.0  # wall and process CPU seconds spent by the other jobs meanwhile
        self._since = perf_counter()  # start of the current slice

    def step_done(self, _tokens: object = None) -> None:
        """Hand the turn on once this job's slice is used up; return when the turn comes back."""
        now = perf_counter()
        if now - self._since < self._rotation.slice_seconds:
            return
        cpu = process_time()
        self._rotation._hub.switch()
        self._since = perf_counter()
        self.waited_cpu += process_time() - cpu
        self.waited += self._since - now


class Lockstep:
    """Jobs (`job(turn) -> result`) run in turn, a slice at a time, so the machine's drift falls on each alike.

    Each job is a greenlet in the caller's thread (OS threads migrate between cores and malloc arenas); each pass over
    the jobs after the first runs them in a fresh seeded order. Run it inside torch.inference_mode(): a job leaving the
    mode would switch it off for the others. One torch thread only: a waiting job's OpenMP pool would spin."""

    def __init__(self, slice_seconds: float = SLICE_SECONDS, seed: int | str = 0) -> None:
        self.slice_seconds, self.rng = slice_seconds, random.Random(seed)

    def run(self, jobs: list[Callable[[Turn], object]]) -> list:
        self._hub = getcurrent()
        results: list = [None] * len(jobs)
        live = [greenlet(lambda i=i: results.__setitem__(i, jobs[i](Turn(self)))) for i in range(len(jobs))]
        order = list(live)
        while live:  # an exception in a job propagates here, the others are dropped
            for g in order:
                g.switch()
            live = [g for g in live if not g.dead]
            order = self.rng.sample(live, len(live))
        return results


# --- reports ---------------------------------------------------------------------------------


def fmt(x, spec: str = "{:.2f}") -> str:
    return "-" if x is None else spec.format(x)


def section(title: str | None, header: list, rows: list[list]) -> list[str]:
    """A markdown table after a blank line (and its title), as lines: the first column left-aligned, the rest right."""
    row = lambda r: "| " + " | ".join(map(str, r)) + " |"  # noqa: E731
    return (["", title, ""] if title else [""]) + [row(header), "|---" + "|---:" * (len(header) - 1) + "|"] + [row(r) for r in rows]


def target(name: str, measured: float, goal: float, detail: str = "") -> dict:
    """One benchmark target, with its measured number and whether it is met."""
    return {"target": name, "measured": round(measured, 3), "goal": goal, "met": measured >= goal, "detail": detail}


def targets_md(targets: list[dict]) -> list[str]:
    rows = [[t["target"] + (f" ({t['detail']})" if t.get("detail") else ""), t["measured"], t["goal"], "yes" if t["met"] else "**no**"]
            for t in targets]
    return section("Targets:", ["target", "measured", "goal", "met"], rows) if rows else ["", "Targets: none measured here."]


def pyplot():
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def save(fig, path: Path) -> Path:
    fig.tight_layout()
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    pyplot().close(fig)
    return Path(path)


def log2_axis(ax, xs: list[int], xlabel: str, ylabel: str = "") -> None:
    """A log2 x axis ticked at xs (batch sizes, concurrencies, context lengths)."""
    ax.set_xscale("log", base=2)
    ax.set_xticks(xs, [str(x) for x in xs])
    ax.set(xlabel=xlabel, ylabel=ylabel)

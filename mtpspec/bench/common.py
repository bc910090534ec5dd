"""What the bench commands share: quantiles and timing rounds, strict count lists, a progress bar, jobs run in turn a
few milliseconds at a time (Lockstep), a server subprocess, and the markdown / plot helpers of every report."""

from __future__ import annotations

import json
import os
import random
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
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


class ServerProcess:
    """A server on a free loopback port (`argv_for_port(port)`, its output to a log): ready once GET /health answers 200,
    stopped on exit; on Linux it gets SIGTERM when this process dies, however it dies."""

    name = "the server"

    def __init__(self, argv_for_port: Callable[[int], list[str]], timeout: float = 120.0) -> None:
        self.argv_for_port, self.timeout, self.proc = argv_for_port, timeout, None
        self.log = tempfile.NamedTemporaryFile(prefix="mtpspec-server-", suffix=".log", delete=False)

    def __enter__(self):
        self.start()
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def log_tail(self, n: int = 15) -> str:
        return "\n".join(Path(self.log.name).read_text(errors="replace").splitlines()[-n:])

    def start(self) -> None:
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            self.port = s.getsockname()[1]
        self.args, self.url, t0 = self.argv_for_port(self.port), f"http://127.0.0.1:{self.port}/", time.monotonic()
        self.proc = subprocess.Popen(self.args, stdin=subprocess.DEVNULL, stdout=self.log, stderr=subprocess.STDOUT,
                                     env=dict(os.environ, PYTHONUNBUFFERED="1"), preexec_fn=_die_with_parent)
        while time.monotonic() - t0 < self.timeout:
            if self.proc.poll() is not None:
                self._fail(f"exited with status {self.proc.returncode} at start")
            try:
                with urllib.request.urlopen(self.url + "health", timeout=2) as r:
                    if r.status == 200:
                        self.startup_seconds = time.monotonic() - t0
                        return
            except (urllib.error.URLError, ConnectionError, TimeoutError):
                pass  # not listening yet, or 503 while loading
            time.sleep(0.05)
        self._fail(f"not ready after {self.timeout:.0f} s")

    def _fail(self, what: str) -> None:
        tail = self.log_tail()
        self.close()
        raise ConfigError(f"{self.name} {what} ({' '.join(map(str, self.args))}); its output ends:\n{tail}")

    def post(self, path: str, body: dict | None = None, timeout: float = 600.0) -> dict:
        """POST `body` as JSON to an endpoint (GET without a body) -> the JSON answer."""
        data = None if body is None else json.dumps(body).encode()
        req = urllib.request.Request(self.url + path.lstrip("/"), data=data, headers={"Content-Type": "application/json"})
        try:
            with urllib.request.urlopen(req, timeout=timeout) as r:
                return json.loads(r.read())
        except urllib.error.HTTPError as e:
            raise ConfigError(f"{self.name} {path}: HTTP {e.code}: {e.read()[:300]!r}") from None
        except (urllib.error.URLError, ConnectionError) as e:
            raise ConfigError(f"{self.name} {path} failed ({e}):\n{self.log_tail()}") from None

    def close(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        Path(self.log.name).unlink(missing_ok=True)


def _die_with_parent() -> None:
    if sys.platform.startswith("linux"):
        import ctypes

        ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG


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

"""`mtpspec loadtest`: a bounded load test of `mtpspec serve` on loopback (docs/serving.md, "Load test").

Per speculation config a real server subprocess (always killed at the end); per concurrency C, C workers stream
POST /v1/completions (greedy) over a fixed number of requests after an uncounted warm-up, within a time limit. Per
request: TTFT, inter-token latencies and tokens; every response is checked against a greedy reference computed in this
process, and every request is counted: ok, mismatch, error, cut (in flight at the time limit) or not_started.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import re
import signal
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

from ..cli import add_threads_arg, command
from ..errors import ConfigError

TARGET_SCALE = 4.0  # at C = 16 total tokens/s >= 4x the same config's C = 1
TARGET_AUTO_VS_BEST = 0.97  # auto >= 0.97x the better of off and every fixed config, at each C
TARGET_AUTO_ITL = 1.3  # auto's p50 ITL at C = 1 >= 1.3x better (smaller) than off's


# --- configuration ----------------------------------------------------------------------------


@dataclass(frozen=True)
class SpecConfig:
    """One speculation config of the server: `--spec` item -> `mtpspec serve` flags."""

    label: str  # as given: off | fixed:D | auto | DRAFTER:K
    drafter: str  # --drafter: none | auto (the model's own drafter) | ngram | mtp | ...
    k: int | str | None  # --k: D or "auto"; None for off (no speculation, no --k)

    def serve_args(self) -> list[str]:
        return ["--drafter", self.drafter] + ([] if self.k is None else ["--k", str(self.k)])


def parse_spec(text: str) -> SpecConfig:
    """off | fixed:D | auto | DRAFTER:K (K an integer >= 1 or auto) -> SpecConfig; anything else a ConfigError."""
    s = text.strip()
    if s == "off":
        return SpecConfig(s, "none", None)
    if s == "auto":
        return SpecConfig(s, "auto", "auto")
    name, sep, k = s.partition(":")
    if not sep or not name or not k:
        raise ConfigError(f"--spec items are off, auto, fixed:D or DRAFTER:K (e.g. fixed:3, ngram:2, mtp:auto), got {s!r}")
    if k != "auto":
        try:
            k = int(k)
        except ValueError:
            raise ConfigError(f"--spec {s!r}: the draft length must be an integer >= 1 or 'auto', got {k!r}") from None
        if k < 1:
            raise ConfigError(f"--spec {s!r}: the draft length must be >= 1, got {k}")
    if name == "fixed":
        if k == "auto":
            raise ConfigError(f"--spec {s!r}: fixed takes a draft length D >= 1 (use 'auto' for the adaptive depth)")
        return SpecConfig(s, "auto", k)
    return SpecConfig(s, name, k)


def parse_specs(text: str) -> list[SpecConfig]:
    specs = [parse_spec(x) for x in str(text).split(",") if x.strip()]
    if not specs:
        raise ConfigError(f"--spec needs configs separated by commas, e.g. off,fixed:3,auto; got {text!r}")
    labels = [s.label for s in specs]
    if len(set(labels)) != len(labels):
        raise ConfigError(f"--spec names a config twice: {text!r}")
    return specs


def parse_concurrency(text: str) -> list[int]:
    """--concurrency "1,4,16" -> [1, 4, 16] (sorted, each once)."""
    from .common import parse_counts

    return parse_counts(text, "--concurrency", "concurrencies", "1,4,16")


# --- the stream: SSE lines -> chunks -> per-token latencies -----------------------------------


def parse_sse_line(line: str):
    """One line of an SSE stream -> its JSON object, "[DONE]", or None (blank line, comment, other field).

    A `data:` line that is not JSON is a ValueError naming it (a broken stream is an error, not skipped)."""
    if not line.startswith("data:"):
        return None
    payload = line[5:].strip()
    if payload == "[DONE]":
        return "[DONE]"
    try:
        return json.loads(payload)
    except json.JSONDecodeError:
        raise ValueError(f"SSE data line is not JSON: {payload[:120]!r}") from None


@dataclass
class Chunk:
    """One SSE chunk of a completion, as it arrived."""

    t: float  # seconds since the request was sent
    text: str
    tokens: int | None  # tokens it carries, when the stream says; None = not given


def chunk_tokens(obj: dict) -> int | None:
    """Tokens a chunk carries, when the chunk says (the length of its logprobs.tokens); None when it does not."""
    choices = obj.get("choices") or []
    lp = choices[0].get("logprobs") if choices and isinstance(choices[0], dict) else None
    if isinstance(lp, dict) and isinstance(lp.get("tokens"), list):
        return len(lp["tokens"])
    return None


def align_counts(chunk_texts: list[str], token_text_lens: list[int]) -> list[int]:
    """Tokens per chunk from text alone: token_text_lens[i] = characters the reference's i-th token adds.

    A chunk gets the tokens whose text ends within the text received up to and including it; tokens
    past the end of the last chunk's text (no text of their own) are given to the last chunk."""
    ends, total = [], 0
    for n in token_text_lens:
        total += n
        ends.append(total)
    counts, done, seen = [], 0, 0
    for text in chunk_texts:
        seen += len(text)
        upto = done
        while upto < len(ends) and ends[upto] <= seen:
            upto += 1
        counts.append(upto - done)
        done = upto
    if counts and done < len(ends):
        counts[-1] += len(ends) - done
    return counts


def latencies(times: list[float], counts: list[int]) -> tuple[float | None, list[float]]:
    """(TTFT, per-token ITLs) from chunk arrival times and the tokens each carries.

    TTFT is the first chunk with a token; each later chunk with n tokens, g seconds after the previous
    chunk with tokens, gives n ITLs of g / n (chunks with no tokens are skipped)."""
    ttft, prev, itl = None, None, []
    for t, n in zip(times, counts):
        if n <= 0:
            continue
        if prev is None:
            ttft = t
        else:
            itl.extend([(t - prev) / n] * n)
        prev = t
    return ttft, itl


def percentile(values: list[float], q: float) -> float | None:
    """The q-th percentile (0..100), linear between the two nearest ranks (numpy's default); None when empty."""
    if not values:
        return None
    xs = sorted(values)
    pos = (len(xs) - 1) * q / 100.0
    lo = int(pos)
    hi = min(lo + 1, len(xs) - 1)
    return xs[lo] + (xs[hi] - xs[lo]) * (pos - lo)


# --- one request --------------------------------------------------------------------------------


@dataclass
class Reference:
    """The greedy answer to one prompt, computed in this process with no drafter."""

    prompt_id: str
    prompt: str
    text: str
    tokens: int
    finish_reason: str
    token_text_lens: list[int]  # characters each token adds to the streamed text


@dataclass
class RequestRecord:
    """One request of a run and what became of it."""

    index: int
    prompt_id: str
    round: int = 0  # with --rounds: which pass over the configs
    status: str = "running"  # ok | mismatch | error | cut | not_started (running only while in flight)
    error: str | None = None
    ttft: float | None = None  # seconds
    itl: list[float] = field(default_factory=list)  # seconds, one per token after the first chunk's
    tokens: int = 0  # completion tokens (usage, else the counted chunks)
    seconds: float | None = None  # from sending to [DONE]
    sent_at: float | None = None  # perf_counter when sent
    ended_at: float | None = None
    finish_reason: str | None = None
    token_counts: str = "none"  # stream (the chunks said) | aligned (from text) | none
    text: str | None = None  # kept for a mismatch only (with the reference's)
    expected: str | None = None
    stats: dict | None = None  # the last chunk's `mtpspec` extension


def finish_record(rec: RequestRecord, chunks: list[Chunk], last: dict | None, ref: Reference) -> None:
    """Fill rec from a completed stream (last: its `usage` and `mtpspec` fields): token counts, latencies, the check."""
    text = "".join(c.text for c in chunks)
    usage = (last or {}).get("usage") or {}
    counts = [c.tokens for c in chunks]
    if counts and all(n is not None for n in counts):
        rec.token_counts = "stream"
    else:
        counts = align_counts([c.text for c in chunks], ref.token_text_lens)
        rec.token_counts = "aligned"
    rec.ttft, rec.itl = latencies([c.t for c in chunks], counts)
    first_text = next((c.t for c in chunks if c.text), None)
    if first_text is not None:  # TTFT is the first chunk with text, as a user sees it
        rec.ttft = first_text
    rec.tokens = int(usage.get("completion_tokens", sum(counts)))
    rec.stats = (last or {}).get("mtpspec") if isinstance((last or {}).get("mtpspec"), dict) else None
    if text == ref.text:
        rec.status = "ok"
    else:
        rec.status, rec.text, rec.expected = "mismatch", text, ref.text


async def one_request(client, url: str, model: str, ref: Reference, max_tokens: int, rec: RequestRecord) -> None:
    """Stream one completion into rec; any failure is recorded in it (status error), never raised."""
    body = {"model": model, "prompt": ref.prompt, "max_tokens": max_tokens, "temperature": 0, "stream": True,
            "stream_options": {"include_usage": True}}
    chunks: list[Chunk] = []
    last: dict = {}  # usage and the `mtpspec` extension, from whichever chunks carry them
    done = False
    rec.sent_at = t0 = time.perf_counter()
    try:
        async with client.stream("POST", url + "v1/completions", json=body) as r:
            if r.status_code != 200:
                raw = (await r.aread()).decode("utf-8", "replace")
                rec.status, rec.error = "error", f"HTTP {r.status_code}: {raw[:300]}"
                return
            async for line in r.aiter_lines():
                now = time.perf_counter() - t0
                obj = parse_sse_line(line)
                if obj is None:
                    continue
                if obj == "[DONE]":
                    done = True
                    break
                if "error" in obj:
                    rec.status, rec.error = "error", f"error event: {json.dumps(obj['error'])[:300]}"
                    return
                choices = obj.get("choices") or []
                text = "".join(c.get("text") or "" for c in choices)
                if choices and choices[0].get("finish_reason"):
                    rec.finish_reason = choices[0]["finish_reason"]
                n = chunk_tokens(obj)
                if text or n:
                    chunks.append(Chunk(now, text, n))
                for key in ("usage", "mtpspec"):  # the last chunk's (usage may come alone, after it)
                    if isinstance(obj.get(key), dict):
                        last[key] = obj[key]
    except asyncio.CancelledError:
        rec.status, rec.ended_at = "cut", time.perf_counter()
        raise
    except Exception as e:  # a refused connection, a reset, a bad SSE line: recorded, never lost
        rec.status, rec.error = "error", f"{type(e).__name__}: {e}"[:300]
        return
    finally:
        if rec.ended_at is None:
            rec.ended_at = time.perf_counter()
    rec.seconds = rec.ended_at - t0
    if not done:
        rec.status, rec.error = "error", "the stream ended without data: [DONE]"
        return
    finish_record(rec, chunks, last, ref)


# --- one run: a config at one concurrency --------------------------------------------------------


@dataclass
class CellResult:
    """One speculation config at one concurrency."""

    spec: str
    concurrency: int
    requests: int  # planned
    counts: dict  # status -> requests
    tokens: int  # completion tokens of the finished requests (ok + mismatch)
    wall_seconds: float  # first request sent -> last one ended
    tokens_per_second: float
    ttft_p50: float | None
    ttft_p99: float | None
    itl_p50: float | None
    itl_p99: float | None
    itl_mean: float | None
    token_counts: dict  # how tokens per chunk were known: stream / aligned -> requests
    target_forwards: int  # summed over the finished requests' `mtpspec` fields (0 when the server gives none)
    drafted: int
    accepted: int
    warmup_errors: int
    time_limited: bool  # the time limit stopped the run before every request finished
    round_tokens_per_second: list[float] = field(default_factory=list)  # each round's (tokens_per_second: their median)
    load1: list[float] = field(default_factory=list)  # the 1-minute load average at the end of each round's run
    records: list[RequestRecord] = field(repr=False, default_factory=list)

    @property
    def ok(self) -> int:
        return self.counts.get("ok", 0)

    @property
    def tokens_per_forward(self) -> float | None:
        """Tokens each target forward gave a request (1 without speculation)."""
        return self.tokens / self.target_forwards if self.target_forwards else None

    def to_json(self) -> dict:
        d = asdict(self)
        d["records"] = [_record_json(r) for r in self.records]
        d["tokens_per_forward"] = self.tokens_per_forward
        return d


def _record_json(r: RequestRecord) -> dict:
    d = asdict(r)
    d["itl"] = [round(x, 6) for x in r.itl]
    for k in ("sent_at", "ended_at"):
        d.pop(k)
    return d


def summarize_cell(spec: str, concurrency: int, records: list[RequestRecord], warmup_errors: int = 0,
                   time_limited: bool = False) -> CellResult:
    """Aggregate one run's records (pure: tested without a server)."""
    counts: dict[str, int] = {}
    for r in records:
        counts[r.status] = counts.get(r.status, 0) + 1
    done = [r for r in records if r.status in ("ok", "mismatch")]
    sent = [r for r in records if r.sent_at is not None]
    wall = (max(r.ended_at for r in done) - min(r.sent_at for r in sent)) if done else 0.0
    tokens = sum(r.tokens for r in done)
    ttfts = [r.ttft for r in done if r.ttft is not None]
    itls = [x for r in done for x in r.itl]
    how: dict[str, int] = {}
    for r in done:
        how[r.token_counts] = how.get(r.token_counts, 0) + 1
    stats = [r.stats or {} for r in done]
    total = {k: sum(int(x.get(k) or 0) for x in stats) for k in ("target_forwards", "drafted", "accepted")}
    tps = tokens / wall if wall > 0 else 0.0
    return CellResult(
        spec=spec, concurrency=concurrency, requests=len(records), counts=counts, tokens=tokens, wall_seconds=wall,
        tokens_per_second=tps, round_tokens_per_second=[tps],
        ttft_p50=percentile(ttfts, 50), ttft_p99=percentile(ttfts, 99),
        itl_p50=percentile(itls, 50), itl_p99=percentile(itls, 99), itl_mean=sum(itls) / len(itls) if itls else None,
        token_counts=how, **total, warmup_errors=warmup_errors, time_limited=time_limited, records=records,
    )


def merge_rounds(runs: list[CellResult]) -> CellResult:
    """One config at one C over several rounds: tokens/s the rounds' median, latencies and counts over all their requests."""
    if len(runs) == 1:
        return runs[0]
    records = [r for run in runs for r in run.records]
    cell = summarize_cell(runs[0].spec, runs[0].concurrency, records, sum(r.warmup_errors for r in runs),
                          any(r.time_limited for r in runs))
    rates = [r.tokens_per_second for r in runs]
    cell.round_tokens_per_second = rates
    cell.tokens_per_second = percentile(rates, 50)
    cell.wall_seconds = sum(r.wall_seconds for r in runs)
    cell.load1 = [x for r in runs for x in r.load1]
    return cell


async def _drive(client, url: str, model: str, refs: list[Reference], max_tokens: int, concurrency: int,
                 records: list[RequestRecord], time_limit: float) -> bool:
    """C workers take the records in turn until all are sent or time is up; True when the time limit cut the run."""
    deadline = time.perf_counter() + time_limit
    queue = iter(records)

    async def worker() -> None:
        for rec in queue:  # one shared iterator: each record is taken by exactly one worker
            if time.perf_counter() >= deadline:
                rec.status = "not_started"
                continue
            await one_request(client, url, model, refs[rec.index % len(refs)], max_tokens, rec)

    tasks = [asyncio.ensure_future(worker()) for _ in range(concurrency)]
    _, pending = await asyncio.wait(tasks, timeout=max(0.0, deadline - time.perf_counter()))
    for t in pending:
        t.cancel()
    await asyncio.gather(*tasks, return_exceptions=True)
    for rec in records:  # in flight when cancelled (cut), or never taken by a worker
        if rec.status == "running":
            rec.status = "cut" if rec.sent_at is not None else "not_started"
    return bool(pending)


async def run_cell(url: str, model: str, refs: list[Reference], spec: str, concurrency: int, requests: int,
                   max_tokens: int, time_limit: float, warmup: int, warmup_tokens: int, round_no: int = 0) -> CellResult:
    """Warm up (not counted), then `requests` streamed completions by `concurrency` workers, within `time_limit` seconds."""
    import httpx

    limits = httpx.Limits(max_connections=concurrency + 4, max_keepalive_connections=concurrency + 4)
    timeout = httpx.Timeout(time_limit + 30.0, connect=30.0)
    async with httpx.AsyncClient(limits=limits, timeout=timeout, trust_env=False) as client:
        warm = [RequestRecord(i, refs[i % len(refs)].prompt_id) for i in range(warmup)]
        if warm:  # shorter than the references: their text is not checked, only that they finish
            await _drive(client, url, model, refs, warmup_tokens, concurrency, warm, time_limit)
        records = [RequestRecord(i, refs[i % len(refs)].prompt_id, round_no) for i in range(requests)]
        cut = await _drive(client, url, model, refs, max_tokens, concurrency, records, time_limit)
    warm_bad = sum(r.status in ("error", "cut") for r in warm)
    cell = summarize_cell(spec, concurrency, records, warm_bad, cut)
    cell.load1 = [os.getloadavg()[0]]
    return cell


# --- the server subprocess ----------------------------------------------------------------------


class ServerProcess:
    """`python -m mtpspec serve ... --port 0` as a context manager: started, URL read, /health awaited, always killed."""

    def __init__(self, argv: list[str], startup_timeout: float = 300.0) -> None:
        self.argv = argv
        self.startup_timeout = startup_timeout
        self.proc: subprocess.Popen | None = None
        self.url: str | None = None
        self.startup_seconds: float | None = None
        self._stderr = tempfile.TemporaryFile(mode="w+b")
        self._lines: list[str] = []

    def __enter__(self) -> "ServerProcess":
        t0 = time.perf_counter()
        env = dict(os.environ, PYTHONUNBUFFERED="1")
        self.proc = subprocess.Popen(self.argv, stdout=subprocess.PIPE, stderr=self._stderr, stdin=subprocess.DEVNULL,
                                     env=env, text=True, encoding="utf-8", errors="replace", preexec_fn=_die_with_parent)
        try:
            found = threading.Event()
            threading.Thread(target=self._drain, args=(found,), daemon=True).start()
            if not found.wait(self.startup_timeout) or self.url is None:
                try:  # its output ended: it is exiting
                    self.proc.wait(5)
                except subprocess.TimeoutExpired:
                    pass
                said = f" (stdout: {''.join(self._lines)[-300:]!r})" if self._lines else ""
                self._fail(("printed no URL" if self.proc.returncode is None else f"exited with status {self.proc.returncode}") + said)
            self._wait_health(t0)
        except BaseException:
            self.close()
            raise
        self.startup_seconds = time.perf_counter() - t0
        return self

    def _drain(self, found: threading.Event) -> None:
        """Read the server's stdout (so it never blocks on a full pipe); its first line with a URL says where it listens."""
        for line in self.proc.stdout:
            self._lines.append(line)
            m = re.search(r"https?://[^\s/]+", line)
            if m and self.url is None:
                self.url = m.group(0) + "/"
                found.set()
        found.set()  # end of output: no URL

    def _wait_health(self, t0: float) -> None:
        import httpx

        while True:
            if self.proc.poll() is not None:
                self._fail(f"exited with status {self.proc.returncode}")
            try:
                if httpx.get(self.url + "health", timeout=5.0, trust_env=False).status_code == 200:
                    return
            except httpx.HTTPError:
                pass
            if time.perf_counter() - t0 > self.startup_timeout:
                self._fail(f"GET /health did not answer 200 within {self.startup_timeout:.0f} s")
            time.sleep(0.1)

    def stderr_tail(self, chars: int = 2000) -> str:
        self._stderr.flush()
        self._stderr.seek(0)
        return self._stderr.read().decode("utf-8", "replace")[-chars:]

    def _fail(self, what: str) -> None:
        self.close()
        raise ConfigError(f"the server ({' '.join(self.argv[1:])}) {what}; its stderr ends:\n{self.stderr_tail()}")

    def close(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(10)

    def __exit__(self, *exc) -> None:
        self.close()


def _die_with_parent() -> None:
    """In the server's process, before exec: on Linux, SIGTERM it when the load test dies (even by SIGKILL)."""
    if sys.platform.startswith("linux"):
        import ctypes

        ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG


def serve_argv(model: str, spec: SpecConfig, max_batch: int, threads: int | None, tokenizer: str | None) -> list[str]:
    argv = [sys.executable, "-m", "mtpspec", "serve", "--model", model, "--host", "127.0.0.1", "--port", "0",
            *spec.serve_args(), "--max-batch", str(max_batch)]
    if tokenizer:
        argv += ["--tokenizer", tokenizer]
    if threads is not None:
        argv += ["--threads", str(threads)]
    return argv


# --- references and prompts ---------------------------------------------------------------------


def make_references(model, prompts, n: int, max_tokens: int) -> tuple[list[Reference], int]:
    """Greedy answers (no drafter) to the first n prompts that fit the context with max_tokens; (refs, prompts skipped)."""
    refs, skipped = [], 0
    for p in prompts:
        if len(refs) >= n:
            break
        if not p.text.strip():
            skipped += 1
            continue
        ids = model.encode(p.text)
        if len(ids) + max_tokens > model.max_seq_len:
            skipped += 1
            continue
        res = model.generate(p.text, max_new_tokens=max_tokens)
        stream = model.tokenizer.stream(prev=ids[-1]) if ids else None
        lens = [len(stream.push([t])) for t in res.tokens]
        if lens:
            lens[-1] += len(stream.flush())
        refs.append(Reference(p.id, p.text, res.text, len(res.tokens), res.finish_reason, lens))
    if not refs:
        raise ConfigError(f"no prompt of the set fits the model's context ({model.max_seq_len}) with --max-tokens {max_tokens}")
    return refs, skipped


# --- checks and reports -------------------------------------------------------------------------


def _cell_map(cells: list[dict]) -> dict[tuple[str, int], dict]:
    return {(c["spec"], c["concurrency"]): c for c in cells}


def check_targets(cells: list[dict]) -> list[dict]:
    """The load test's targets, each {name, value, target, passed} (only those the measured configs allow)."""
    m = _cell_map(cells)
    specs = list(dict.fromkeys(c["spec"] for c in cells))
    cs = sorted({c["concurrency"] for c in cells})
    out = []
    if 1 in cs and 16 in cs:
        for s in specs:
            base, top = m[(s, 1)]["tokens_per_second"], m[(s, 16)]["tokens_per_second"]
            ratio = top / base if base > 0 else 0.0
            out.append({"name": f"{s}: tok/s at C=16 vs C=1", "value": ratio, "target": f">= {TARGET_SCALE}x",
                        "passed": ratio >= TARGET_SCALE})
    others = [s for s in specs if s == "off" or s.startswith("fixed:")]
    if "auto" in specs and others:
        for c in cs:
            best = max(m[(s, c)]["tokens_per_second"] for s in others)
            ratio = m[("auto", c)]["tokens_per_second"] / best if best > 0 else 0.0
            out.append({"name": f"auto at C={c} vs best of {','.join(others)}", "value": ratio,
                        "target": f">= {TARGET_AUTO_VS_BEST}x", "passed": ratio >= TARGET_AUTO_VS_BEST})
    if "auto" in specs and "off" in specs and 1 in cs:
        a, o = m[("auto", 1)]["itl_p50"], m[("off", 1)]["itl_p50"]
        ratio = o / a if a and o else 0.0
        out.append({"name": "p50 ITL at C=1: off / auto", "value": ratio, "target": f">= {TARGET_AUTO_ITL}x",
                    "passed": ratio >= TARGET_AUTO_ITL})
    return out


def _ms(x: float | None) -> str:
    return "-" if x is None else f"{x * 1000:.1f}"


def markdown_table(cells: list[dict]) -> str:
    """Rows: spec config x concurrency; tok/s, x vs C=1 of the same config, p50/p99 TTFT and ITL (ms), ok/total,
    then tokens per target forward, each round's tok/s (with --rounds) and the load average at the end of each run."""
    m = _cell_map(cells)
    rounds = max(len(c.get("round_tokens_per_second") or [0]) for c in cells) > 1
    head = "| spec | C | tok/s | x vs C=1 | TTFT p50 ms | TTFT p99 ms | ITL p50 ms | ITL p99 ms | ok/total | tok/fwd |"
    head += " tok/s by round |" if rounds else ""
    lines = [head + " load |", "|---|" + "---:|" * (head.count("|") - 1)]
    for c in cells:
        base = m.get((c["spec"], 1))
        x = f"{c['tokens_per_second'] / base['tokens_per_second']:.2f}" if base and base["tokens_per_second"] > 0 else "-"
        ok = c["counts"].get("ok", 0)
        fwd = f"{c['tokens_per_forward']:.2f}" if c.get("tokens_per_forward") else "-"
        row = (f"| {c['spec']} | {c['concurrency']} | {c['tokens_per_second']:.1f} | {x} | {_ms(c['ttft_p50'])} | "
               f"{_ms(c['ttft_p99'])} | {_ms(c['itl_p50'])} | {_ms(c['itl_p99'])} | {ok}/{c['requests']} | {fwd} |")
        if rounds:
            row += " " + ", ".join(f"{x:.0f}" for x in c.get("round_tokens_per_second") or []) + " |"
        lines.append(row + " " + ", ".join(f"{x:.1f}" for x in c.get("load1") or []) + " |")
    return "\n".join(lines)


def problems(cells: list[dict]) -> list[str]:
    """One line per run with anything but ok: mismatches, errors, cut or unsent requests."""
    out = []
    for c in cells:
        bad = {k: v for k, v in c["counts"].items() if k != "ok"}
        if bad or c.get("warmup_errors"):
            what = ", ".join(f"{v} {k}" for k, v in sorted(bad.items()))
            if c.get("warmup_errors"):
                what += (", " if what else "") + f"{c['warmup_errors']} warm-up errors"
            out.append(f"{c['spec']} at C={c['concurrency']}: {what}")
    return out


def check_lines(targets: list[dict]) -> list[str]:
    return [f"[{'PASS' if t['passed'] else 'FAIL'}] {t['name']}: {t['value']:.2f}x (target {t['target']})" for t in targets]


def markdown_report(result: dict) -> str:
    cfg = result["config"]
    parts = [markdown_table(result["cells"]), ""]
    bad = problems(result["cells"])
    parts.append("Every response checked: " + ("all ok." if not bad else "; ".join(bad) + "."))
    parts += ["", "Targets:", ""] + [f"- {x}" for x in check_lines(result["targets"])]
    parts += ["", f"Command: `{cfg['command']}` ({cfg['elapsed_seconds']:.0f} s; load average before "
              f"{cfg['load_before'][0]:.2f}, after {cfg['load_after'][0]:.2f}; {cfg['cpus']} CPUs)."]
    return "\n".join(parts) + "\n"


def write_plot(result: dict, path: str | Path) -> Path:
    """Throughput against concurrency per config, and p50 ITL against concurrency per config."""
    from .common import log2_axis, pyplot, save

    cells, cs, cfg = result["cells"], result["config"]["concurrency"], result["config"]
    m = _cell_map(cells)
    fig, (a, b) = pyplot().subplots(1, 2, figsize=(11, 4))
    for s in dict.fromkeys(c["spec"] for c in cells):
        a.plot(cs, [m[(s, c)]["tokens_per_second"] for c in cs], marker="o", label=s)
        b.plot(cs, [(m[(s, c)]["itl_p50"] or 0.0) * 1000 for c in cs], marker="o", label=s)
    for ax, yl in ((a, "completion tokens/s (all requests, wall)"), (b, "p50 inter-token latency (ms)")):
        log2_axis(ax, cs, "concurrent clients C", yl)
        ax.legend(fontsize=8)
    rounds = f", {cfg['rounds']} rounds (tok/s: their median)" if cfg.get("rounds", 1) > 1 else ""
    fig.suptitle(f"mtpspec serve, {cfg['model']}: {cfg['requests']} requests x {cfg['max_tokens']} tokens per run{rounds}")
    return save(fig, Path(path))


# --- the whole load test ------------------------------------------------------------------------


def run_loadtest(model: str = "demo", concurrency: list[int] = (1, 4, 16), specs: list[SpecConfig] | None = None,
                 requests: int = 32, time_limit: float = 120.0, max_tokens: int = 64, prompts: str = "humaneval",
                 threads: int | None = 1, tokenizer: str | None = None, warmup: int | None = None, warmup_tokens: int = 16,
                 max_batch: int | None = None, startup_timeout: float = 300.0, rounds: int = 1, log=print,
                 command_line: str = "") -> dict:
    """Every spec config x concurrency against a fresh server per config; the result (config, cells, targets) as a dict.

    rounds > 1 repeats the whole pass, the configs' order rotated each round (a slow spell of the machine
    falls on different configs); each cell's tokens/s is then the rounds' median."""
    from ..api import load
    from ..prompts import load_prompts

    specs = list(specs) if specs is not None else parse_specs("off,fixed:3,auto")
    concurrency = sorted(set(concurrency))
    for name, v in (("--requests", requests), ("--max-tokens", max_tokens), ("--warmup-tokens", warmup_tokens), ("--rounds", rounds)):
        if not isinstance(v, int) or v < 1:
            raise ConfigError(f"{name} must be an integer >= 1, got {v!r}")
    if not time_limit > 0:
        raise ConfigError(f"--time-limit must be > 0 seconds, got {time_limit!r}")
    if warmup is not None and warmup < 0:
        raise ConfigError(f"--warmup must be >= 0, got {warmup}")
    max_batch = max_batch or max(concurrency)
    load_before = os.getloadavg()
    t_start = time.perf_counter()
    ref_model = load(model, tokenizer, threads=threads)
    refs, skipped = make_references(ref_model, load_prompts(prompts), requests, max_tokens)
    ref_seconds = time.perf_counter() - t_start
    log(f"loadtest: {len(refs)} references ({skipped} prompts skipped: too long or empty) in {ref_seconds:.1f} s")
    del ref_model
    runs: dict[tuple[str, int], list[CellResult]] = {(s.label, c): [] for s in specs for c in concurrency}
    servers: dict[str, dict] = {}
    for r in range(rounds):
        for spec in specs[r % len(specs):] + specs[:r % len(specs)]:
            argv = serve_argv(model, spec, max_batch, threads, tokenizer)
            with ServerProcess(argv, startup_timeout) as server:
                import httpx

                models = httpx.get(server.url + "v1/models", timeout=10.0, trust_env=False).json()
                name = models["data"][0]["id"]
                info = servers.setdefault(spec.label, {"argv": argv[1:], "served_model": name, "startup_seconds": []})
                info["startup_seconds"].append(server.startup_seconds)
                log(f"loadtest: round {r + 1}/{rounds} {spec.label}: serving {name} at {server.url} ({server.startup_seconds:.1f} s to start)")
                for c in concurrency:
                    cell = asyncio.run(run_cell(server.url, name, refs, spec.label, c, requests, max_tokens, time_limit,
                                                c if warmup is None else warmup, warmup_tokens, r))
                    runs[(spec.label, c)].append(cell)
                    log(f"loadtest: {spec.label} C={c}: {cell.tokens_per_second:.1f} tok/s, ITL p50 {_ms(cell.itl_p50)} ms, "
                        f"TTFT p50 {_ms(cell.ttft_p50)} ms, {cell.ok}/{cell.requests} ok, load {cell.load1[0]:.2f}"
                        + (" (time limit)" if cell.time_limited else ""))
    cell_json = [merge_rounds(runs[(s.label, c)]).to_json() for s in specs for c in concurrency]
    result = {
        "config": {
            "command": command_line, "model": model, "tokenizer": tokenizer, "concurrency": concurrency,
            "spec": [asdict(s) for s in specs], "requests": requests, "time_limit": time_limit, "max_tokens": max_tokens,
            "prompts": prompts, "prompts_used": len(refs), "prompts_skipped": skipped, "threads": threads,
            "max_batch": max_batch, "warmup": warmup, "warmup_tokens": warmup_tokens, "rounds": rounds,
            "reference": "in-process mtpspec.load(model).generate(prompt, max_new_tokens=M), greedy, no drafter",
            "reference_seconds": ref_seconds, "servers": servers, "elapsed_seconds": time.perf_counter() - t_start,
            "load_before": list(load_before), "load_after": list(os.getloadavg()), "cpus": os.cpu_count(),
        },
        "references": [asdict(r) for r in refs],
        "cells": cell_json,
    }
    result["targets"] = check_targets(cell_json)
    result["problems"] = problems(cell_json)
    return result


def _args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", default="demo", help="the model to serve (a path or 'demo'; default demo)")
    p.add_argument("--tokenizer", help="tokenizer file when the model does not carry one")
    p.add_argument("--concurrency", default="1,4,16", help="concurrent clients, comma-separated (default 1,4,16)")
    p.add_argument("--spec", default="off,fixed:3,auto",
                   help="speculation configs, comma-separated: off (--drafter none), fixed:D (the model's own drafter, "
                        "--k D), auto (--k auto), or DRAFTER:K, e.g. ngram:2 (default off,fixed:3,auto)")
    p.add_argument("--requests", type=int, default=32, help="requests per (config, concurrency) run (default 32)")
    p.add_argument("--time-limit", type=float, default=120.0,
                   help="seconds per (config, concurrency) run: then requests in flight are cut and the rest not sent (default 120)")
    p.add_argument("--max-tokens", type=int, default=64, help="max_tokens of every request (default 64)")
    p.add_argument("--prompts", default="humaneval", help="spec_bench | mt_bench | humaneval | tinystories, or a file (default humaneval)")
    p.add_argument("--warmup", type=int, default=None, help="warm-up requests before each run, not counted (default: C)")
    p.add_argument("--warmup-tokens", type=int, default=16, help="max_tokens of a warm-up request (default 16)")
    p.add_argument("--max-batch", type=int, default=None, help="the server's --max-batch (default: the largest concurrency)")
    p.add_argument("--startup-timeout", type=float, default=300.0, help="seconds for a server to start (default 300)")
    p.add_argument("--rounds", type=int, default=1,
                   help="passes over every config (order rotated each round); tokens/s = the rounds' median, latencies over all (default 1)")
    p.add_argument("--out", default="build/serve_load.json", help="JSON with every number (default build/serve_load.json)")
    p.add_argument("--md", help="also write the markdown table and checks here")
    p.add_argument("--png", help="also write the plot here (throughput and p50 ITL against concurrency)")
    add_threads_arg(p, default=1)


@command("loadtest")(_args)
def run_loadtest_cli(args: argparse.Namespace) -> int:
    """Exit 0 when every request finished with the reference's text (targets are printed, not enforced), else 1."""
    from ..threads import check_threads

    check_threads(args.threads, "--threads")
    signal.signal(signal.SIGTERM, _interrupt)  # `kill` too stops the servers (through the same path as Ctrl-C)
    cmd = "mtpspec loadtest " + " ".join(_quote(a) for a in sys.argv[2:]) if len(sys.argv) > 1 else "mtpspec loadtest"
    result = run_loadtest(
        model=args.model, concurrency=parse_concurrency(args.concurrency), specs=parse_specs(args.spec), requests=args.requests,
        time_limit=args.time_limit, max_tokens=args.max_tokens, prompts=args.prompts, threads=args.threads,
        tokenizer=args.tokenizer, warmup=args.warmup, warmup_tokens=args.warmup_tokens, max_batch=args.max_batch,
        startup_timeout=args.startup_timeout, rounds=args.rounds, log=lambda s: print(s, file=sys.stderr, flush=True), command_line=cmd,
    )
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=1))
    print(markdown_table(result["cells"]))
    for line in result["problems"]:
        print(f"problem: {line}")
    for line in check_lines(result["targets"]):
        print(line)
    if args.md:
        Path(args.md).parent.mkdir(parents=True, exist_ok=True)
        Path(args.md).write_text(markdown_report(result))
    if args.png:
        write_plot(result, args.png)
    print(f"wrote {out}" + (f", {args.md}" if args.md else "") + (f", {args.png}" if args.png else "") +
          f" ({result['config']['elapsed_seconds']:.0f} s)", file=sys.stderr)
    bad = sum(c["counts"].get(k, 0) for c in result["cells"] for k in ("mismatch", "error"))
    return 1 if bad else 0


def _interrupt(signum, frame) -> None:
    raise KeyboardInterrupt


def _quote(a: str) -> str:
    return a if re.fullmatch(r"[\w@%+=:,./-]+", a) else "'" + a.replace("'", "'\\''") + "'"

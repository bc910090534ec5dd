"""`mtpspec loadtest`: a bounded load test of `mtpspec serve` on loopback (docs/serving.md, "Load test").

Per speculation config a real server subprocess; per concurrency C, C workers stream greedy POST /v1/completions over
a fixed number of requests after an uncounted warm-up, within a time limit. The prompts repeat (warm-up, runs, rounds):
no server reuses a prompt's KV (ours `--prefix-cache 0`, llama.cpp `cache_prompt: false`), each prefills every request. Every response is checked against a greedy
reference computed in this process, and every request is counted: ok, mismatch, error, cut or not_started.

llama.cpp's llama-server is the peer (`--spec llamacpp`, `llamacpp:ngram:K`): the same GGUF (the model's own file, else
it exported as f32), one slot per client of the largest concurrency (its continuous batching), the same threads, no
prompt cache. Its text is other floating-point arithmetic than ours: a response that differs from our reference is
counted "differs" (finished, not a failure); each chunk it streams is one token.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import shlex
import signal
import statistics
import sys
import time
from bisect import bisect_right
from collections import Counter
from dataclasses import asdict, dataclass, field
from functools import partial
from itertools import accumulate
from pathlib import Path

from ..cli import add_threads_arg, command
from ..errors import ConfigError
from .common import ServerProcess, parse_counts
from .harness import Method
from .llamacpp import LlamaServer, find_binary, peer_gguf, server_args

TARGET_SCALE = 4.0  # at C = 16 total tokens/s >= 4x the same config's C = 1
TARGET_AUTO_VS_BEST = 0.97  # auto >= 0.97x the better of off and every fixed config, at each C
TARGET_AUTO_ITL = 1.3  # auto's p50 ITL at C = 1 >= 1.3x better (smaller) than off's
DONE = ("ok", "mismatch", "differs")  # the requests that finished ("differs": the peer's text is not ours)


@dataclass(frozen=True)
class SpecConfig:
    """One `--spec` item: off | fixed:D | auto | DRAFTER:K, and the `mtpspec serve` flags it stands for; or llama.cpp's
    server: llamacpp | llamacpp:DRAFTER:K (its n-gram or MTP speculation, llamacpp.spec_args)."""

    label: str
    drafter: str  # --drafter: none | auto (the model's own drafter) | ngram | mtp | ...
    k: int | str | None  # --k: D or "auto"; None for off
    peer: bool = False  # llama-server, not ours

    def serve_args(self) -> list[str]:
        return ["--drafter", self.drafter] + ([] if self.k is None else ["--k", str(self.k)])


def _spec(s: str) -> SpecConfig:
    if s in ("off", "auto", "llamacpp"):
        return {"off": SpecConfig(s, "none", None), "auto": SpecConfig(s, "auto", "auto"), "llamacpp": SpecConfig(s, "none", None, True)}[s]
    if s.startswith("llamacpp:"):
        drafter, _, k = s.removeprefix("llamacpp:").partition(":")
        if drafter not in ("ngram", "mtp") or not k.isdigit() or int(k) < 1:
            raise ConfigError(f"--spec {s!r}: llama.cpp's configs are llamacpp, llamacpp:ngram:K and llamacpp:mtp:K (K >= 1)")
        return SpecConfig(s, drafter, int(k), True)
    name, _, k = s.partition(":")
    if not name or not k:
        raise ConfigError(f"--spec items are off, auto, fixed:D or DRAFTER:K (e.g. fixed:3, ngram:2, mtp:auto), got {s!r}")
    if k != "auto":
        if not k.isdigit() or int(k) < 1:
            raise ConfigError(f"--spec {s!r}: the draft length must be an integer >= 1 or 'auto', got {k!r}")
        k = int(k)
    elif name == "fixed":
        raise ConfigError(f"--spec {s!r}: fixed takes a draft length D >= 1 (use 'auto' for the adaptive depth)")
    return SpecConfig(s, "auto" if name == "fixed" else name, k)


def parse_specs(text: str) -> list[SpecConfig]:
    specs = [_spec(x.strip()) for x in str(text).split(",") if x.strip()]
    if not specs:
        raise ConfigError(f"--spec needs configs separated by commas, e.g. off,fixed:3,auto; got {text!r}")
    if len({s.label for s in specs}) != len(specs):
        raise ConfigError(f"--spec names a config twice: {text!r}")
    return specs


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
    round: int = 0
    status: str = "running"  # ok | mismatch | error | cut | not_started (running only while in flight)
    error: str | None = None
    ttft: float | None = None  # seconds to the first chunk with text
    itl: list[float] = field(default_factory=list)  # seconds, one per token after the first chunk's
    tokens: int = 0  # completion tokens (usage, else the counted chunks)
    seconds: float | None = None  # from sending to the end of the stream
    sent_at: float | None = None  # perf_counter when sent
    ended_at: float | None = None
    finish_reason: str | None = None
    token_counts: str = "none"  # how tokens per chunk were known: stream (logprobs) | aligned (from text) | none
    text: str | None = None  # kept for a mismatch only, with the reference's
    expected: str | None = None
    stats: dict | None = None  # the last chunk's `mtpspec` extension
    retried: bool = False  # sent again: the first connection closed before any response


def read_stream(events: list[tuple[float, str]], ref: Reference, rec: RequestRecord, peer: bool = False) -> RequestRecord:
    """Fill `rec` from a completed SSE stream, [(seconds since sent, line)]: status against `ref`, TTFT, ITLs, tokens.

    A chunk's tokens come from its logprobs when every chunk has them, else from aligning the text received so far with
    the reference's tokens; a peer's chunk is one token (its text need not be the reference's). A chunk of n tokens
    g seconds after the previous chunk with tokens gives n ITLs of g / n. A peer's text other than ours: "differs"."""
    chunks, last = [], {}  # (t, text, tokens or None); the last `usage` and `mtpspec` fields
    for t, line in events:
        if not line.startswith("data:"):
            continue
        payload = line[5:].strip()
        if payload == "[DONE]":
            break
        try:
            obj = json.loads(payload)
        except json.JSONDecodeError:
            return _failed(rec, f"SSE data line is not JSON: {payload[:120]!r}")
        if "error" in obj:
            return _failed(rec, f"error event: {json.dumps(obj['error'])[:300]}")
        choices = obj.get("choices") or [{}]
        text, lp = "".join(c.get("text") or "" for c in choices), choices[0].get("logprobs")
        n = len(lp["tokens"]) if isinstance(lp, dict) and isinstance(lp.get("tokens"), list) else None
        rec.finish_reason = choices[0].get("finish_reason") or rec.finish_reason
        if text or n:
            chunks.append((t, text, n))
        last |= {k: obj[k] for k in ("usage", "mtpspec") if isinstance(obj.get(k), dict)}
    else:
        return _failed(rec, "the stream ended without data: [DONE]")
    counts = [n for _, _, n in chunks]
    rec.token_counts = "stream" if counts and None not in counts else "chunks" if peer else "aligned"
    if rec.token_counts == "chunks":
        counts = [1] * len(chunks)
    elif rec.token_counts == "aligned":
        ends, seen, counts = list(accumulate(ref.token_text_lens)), 0, []
        for _, text, _ in chunks:  # a chunk gets the tokens whose text ends within the text received up to it
            seen += len(text)
            counts.append(bisect_right(ends, seen) - sum(counts))
        if counts:  # tokens past the last chunk's text go to it
            counts[-1] += len(ends) - sum(counts)
    prev = None
    for (t, _, _), n in zip(chunks, counts):
        if n > 0:
            rec.itl += [(t - prev) / n] * n if prev is not None else []
            prev = t
    rec.ttft = next((t for t, text, _ in chunks if text), chunks[0][0] if chunks else None)
    rec.tokens = int(last.get("usage", {}).get("completion_tokens", sum(counts)))
    rec.stats = last.get("mtpspec")
    text = "".join(x for _, x, _ in chunks)
    rec.status, rec.text, rec.expected = ("ok", None, None) if text == ref.text else ("differs" if peer else "mismatch", text, ref.text)
    return rec


def _failed(rec: RequestRecord, error: str) -> RequestRecord:
    rec.status, rec.error = "error", error
    return rec


async def _request(client, url: str, model: str, ref: Reference, max_tokens: int, rec: RequestRecord, peer: bool) -> None:
    """Stream one completion into rec; a failure is recorded in it (error; cut when cancelled), never lost. A kept-alive
    connection the server closed as the request went out (no response at all) is retried once on a new one, as HTTP
    clients do (`retried`)."""
    import httpx

    body = {"model": model, "prompt": ref.prompt, "max_tokens": max_tokens, "temperature": 0, "stream": True,
            "stream_options": {"include_usage": True}} | ({"cache_prompt": False} if peer else {})
    for attempt in (0, 1):
        events: list[tuple[float, str]] = []
        rec.sent_at = t0 = time.perf_counter()
        answered = False
        try:
            async with client.stream("POST", url + "v1/completions", json=body) as r:
                answered = True
                if r.status_code != 200:
                    raw = (await r.aread()).decode("utf-8", "replace")
                    return _failed(rec, f"HTTP {r.status_code}: {raw[:300]}")
                async for line in r.aiter_lines():
                    events.append((time.perf_counter() - t0, line))
        except asyncio.CancelledError:
            rec.status = "cut"
            raise
        except Exception as e:  # a refused connection, a reset: recorded
            if attempt == 0 and not answered and isinstance(e, httpx.RemoteProtocolError):
                rec.retried = True
                continue
            return _failed(rec, f"{type(e).__name__}: {e}"[:300])
        finally:
            rec.ended_at = time.perf_counter()
            rec.seconds = rec.ended_at - t0
        break
    read_stream(events, ref, rec, peer)


async def _drive(client, url, model, refs, max_tokens: int, concurrency: int, records, time_limit: float, peer: bool) -> bool:
    """C workers take the records in turn until all are sent or time is up; True when the time limit cut the run."""
    deadline, queue = time.perf_counter() + time_limit, iter(records)

    async def worker() -> None:
        for rec in queue:  # one shared iterator: each record is taken by exactly one worker
            if time.perf_counter() < deadline:
                await _request(client, url, model, refs[rec.index % len(refs)], max_tokens, rec, peer)

    tasks = [asyncio.ensure_future(worker()) for _ in range(concurrency)]
    _, pending = await asyncio.wait(tasks, timeout=max(0.0, deadline - time.perf_counter()))
    for t in pending:
        t.cancel()
    await asyncio.gather(*tasks, return_exceptions=True)
    for rec in records:  # never sent, or in flight when cancelled
        rec.status = "not_started" if rec.sent_at is None else "cut" if rec.status == "running" else rec.status
    return bool(pending)


async def _run_cell(url, model, refs, concurrency: int, requests: int, max_tokens: int, time_limit: float, warmup: int,
                    warmup_tokens: int, round_no: int, peer: bool) -> tuple[list[RequestRecord], int, bool]:
    """Warm-up requests (only checked to finish), then the counted ones: (records, warm-up failures, time-limited)."""
    import httpx

    n = concurrency + 4
    async with httpx.AsyncClient(limits=httpx.Limits(max_connections=n, max_keepalive_connections=n), trust_env=False,
                                 timeout=httpx.Timeout(time_limit + 30.0, connect=30.0)) as client:
        warm = [RequestRecord(i, refs[i % len(refs)].prompt_id) for i in range(warmup)]
        await _drive(client, url, model, refs, warmup_tokens, concurrency, warm, time_limit, peer)
        records = [RequestRecord(i, refs[i % len(refs)].prompt_id, round_no) for i in range(requests)]
        cut = await _drive(client, url, model, refs, max_tokens, concurrency, records, time_limit, peer)
    return records, sum(r.status in ("error", "cut") for r in warm), cut


def summarize(spec: str, concurrency: int, rounds: list[list[RequestRecord]], warmup_errors: int = 0,
              time_limited: bool = False, load1: list[float] = ()) -> dict:
    """One config at one C: tok/s the median of the rounds' (completion tokens of the finished requests / first sent
    to last finished), latency percentiles over every round's requests (ITLs pooled), every request counted."""
    def rate(rs: list[RequestRecord]) -> tuple[float, float]:
        done = [r for r in rs if r.status in DONE]
        wall = max(r.ended_at for r in done) - min(r.sent_at for r in rs if r.sent_at is not None) if done else 0.0
        return (sum(r.tokens for r in done) / wall if wall > 0 else 0.0), wall

    records = [r for rs in rounds for r in rs]
    done, rates = [r for r in records if r.status in DONE], [rate(rs) for rs in rounds]
    ttfts, itls = [r.ttft for r in done if r.ttft is not None], [x for r in done for x in r.itl]
    stats = {k: sum(int((r.stats or {}).get(k) or 0) for r in done) for k in ("target_forwards", "drafted", "accepted")}
    tokens = sum(r.tokens for r in done)
    pct = lambda xs, q: float(__import__("numpy").percentile(xs, q)) if xs else None  # noqa: E731 (linear, numpy's default)
    return {
        "spec": spec, "concurrency": concurrency, "requests": len(records), "counts": dict(Counter(r.status for r in records)),
        "tokens": tokens, "wall_seconds": sum(w for _, w in rates), "tokens_per_second": statistics.median(x for x, _ in rates),
        "round_tokens_per_second": [x for x, _ in rates], "ttft_p50": pct(ttfts, 50), "ttft_p99": pct(ttfts, 99),
        "itl_p50": pct(itls, 50), "itl_p99": pct(itls, 99), "itl_mean": statistics.fmean(itls) if itls else None,
        "token_counts": dict(Counter(r.token_counts for r in done)), **stats,
        "tokens_per_forward": tokens / stats["target_forwards"] if stats["target_forwards"] else None,
        "warmup_errors": warmup_errors, "time_limited": time_limited, "load1": list(load1),
        "records": [{k: v for k, v in asdict(r).items() if k not in ("sent_at", "ended_at")} | {"itl": [round(x, 6) for x in r.itl]}
                    for r in records],
    }


def targets(cells: list[dict]) -> list[dict]:
    """The load test's targets, each {name, value, target, passed}, those the measured configs allow."""
    m = {(c["spec"], c["concurrency"]): c for c in cells}
    specs, cs = list(dict.fromkeys(c["spec"] for c in cells if not _peer(c))), sorted({c["concurrency"] for c in cells})
    out = []

    def check(name: str, value: float, goal: float) -> None:
        out.append({"name": name, "value": value, "target": f">= {goal}x", "passed": value >= goal})

    tps = lambda s, c: m[(s, c)]["tokens_per_second"]  # noqa: E731
    for s in specs if 1 in cs and 16 in cs else ():
        check(f"{s}: tok/s at C=16 vs C=1", tps(s, 16) / tps(s, 1) if tps(s, 1) > 0 else 0.0, TARGET_SCALE)
    rivals = [s for s in specs if s == "off" or s.startswith("fixed:")]
    for c in cs if "auto" in specs and rivals else ():
        best = max(tps(s, c) for s in rivals)
        check(f"auto at C={c} vs best of {','.join(rivals)}", tps("auto", c) / best if best > 0 else 0.0, TARGET_AUTO_VS_BEST)
    if "auto" in specs and "off" in specs and 1 in cs:
        a, o = m[("auto", 1)]["itl_p50"], m[("off", 1)]["itl_p50"]
        check("p50 ITL at C=1: off / auto", o / a if a and o else 0.0, TARGET_AUTO_ITL)
    return out


def _peer(cell: dict) -> bool:
    return cell["spec"].startswith("llamacpp")


def versus_peer(cells: list[dict]) -> list[dict]:
    """At each C where both ran: our best config's tok/s over llama.cpp's best config's."""
    out = []
    for c in sorted({x["concurrency"] for x in cells}):
        ours = [x for x in cells if x["concurrency"] == c and not _peer(x)]
        peers = [x for x in cells if x["concurrency"] == c and _peer(x)]
        if ours and peers:
            a, b = (max(xs, key=lambda x: x["tokens_per_second"]) for xs in (ours, peers))
            out.append({"concurrency": c, "ours": a["spec"], "peer": b["spec"],
                        "ratio": a["tokens_per_second"] / b["tokens_per_second"] if b["tokens_per_second"] > 0 else None})
    return out


def peer_consistency(cells: list[dict], refs: list[Reference]) -> list[dict]:
    """For each peer config at each C above its smallest: how many requests' text equals its own text for that prompt
    at the smallest C (ours equals the reference at every C; a server whose text moves with the batch is not batch-invariant)."""
    ref_text, out = {r.prompt_id: r.text for r in refs}, []
    text = lambda r: r["text"] if r["text"] is not None else ref_text[r["prompt_id"]]  # noqa: E731 (kept for a difference only)
    for spec in dict.fromkeys(c["spec"] for c in cells if _peer(c)):
        mine = sorted((c for c in cells if c["spec"] == spec), key=lambda c: c["concurrency"])
        base = {r["prompt_id"]: text(r) for r in mine[0]["records"] if r["status"] in DONE}
        for c in mine[1:]:
            done = [r for r in c["records"] if r["status"] in DONE and r["prompt_id"] in base]
            out.append({"spec": spec, "concurrency": c["concurrency"], "base_concurrency": mine[0]["concurrency"],
                        "same": sum(text(r) == base[r["prompt_id"]] for r in done), "total": len(done)})
    return out


def _problems(cells: list[dict]) -> list[str]:
    """One line per run with anything but ok: mismatches, errors, cut or unsent requests, warm-up errors (a peer's text
    that differs from ours is not one)."""
    out = []
    for c in cells:
        bad = [f"{v} {k}" for k, v in sorted(c["counts"].items()) if k not in ("ok", "differs")]
        bad += [f"{c['warmup_errors']} warm-up errors"] if c["warmup_errors"] else []
        out += [f"{c['spec']} at C={c['concurrency']}: {', '.join(bad)}"] if bad else []
    return out


def report(result: dict) -> str:
    """Markdown: per config x C, tok/s, x vs C=1, p50/p99 TTFT and ITL (ms), ok/total, tokens per target forward (each
    round's tok/s with --rounds) and the load average after each run; then the problems, the targets and the command."""
    cells, cfg = result["cells"], result["config"]
    ms = lambda x: "-" if x is None else f"{x * 1000:.1f}"  # noqa: E731
    rounds = any(len(c["round_tokens_per_second"]) > 1 for c in cells)
    head = ("| spec | C | tok/s | x vs C=1 | TTFT p50 ms | TTFT p99 ms | ITL p50 ms | ITL p99 ms | ok/total | tok/fwd |"
            + " tok/s by round |" * rounds + " load |")
    lines = [head, "|---|" + "---:|" * (head.count("|") - 2)]
    base = {c["spec"]: c["tokens_per_second"] for c in cells if c["concurrency"] == 1}
    for c in cells:
        x = f"{c['tokens_per_second'] / base[c['spec']]:.2f}" if base.get(c["spec"]) else "-"
        fwd = f"{c['tokens_per_forward']:.2f}" if c["tokens_per_forward"] else "-"
        by_round = " " + ", ".join(f"{v:.0f}" for v in c["round_tokens_per_second"]) + " |"
        lines.append(f"| {c['spec']} | {c['concurrency']} | {c['tokens_per_second']:.1f} | {x} | {ms(c['ttft_p50'])} | "
                     f"{ms(c['ttft_p99'])} | {ms(c['itl_p50'])} | {ms(c['itl_p99'])} | {c['counts'].get('ok', 0)}/{c['requests']} | "
                     f"{fwd} |" + by_round * rounds + " " + ", ".join(f"{v:.1f}" for v in c["load1"]) + " |")
    bad = _problems(cells)
    lines += ["", "Every response checked: " + ("; ".join(bad) + "." if bad else "all ok.")]
    if any(_peer(c) for c in cells):
        versus = [f"C={v['concurrency']} {v['ours']} / {v['peer']} {v['ratio']:.2f}x" for v in result.get("versus_peer", []) if v["ratio"]]
        same = [f"{v['spec']} at C={v['concurrency']} {v['same']}/{v['total']}" for v in result.get("peer_consistency", [])]
        lines += ["", "llama.cpp's rows: ok = its text equal to our greedy reference (the others differ: another arithmetic)."
                  + (f" Our best against its best, tok/s: {'; '.join(versus)}." if versus else "")
                  + (f" Its text equal to its own at C={result['peer_consistency'][0]['base_concurrency']}: {'; '.join(same)}." if same else "")]
    lines += ["", "Targets:", ""]
    lines += [f"- [{'PASS' if t['passed'] else 'FAIL'}] {t['name']}: {t['value']:.2f}x (target {t['target']})"
              for t in result["targets"]]
    return "\n".join(lines + ["", f"Command: `{cfg['command']}` ({cfg['elapsed_seconds']:.0f} s; load average before "
                                  f"{cfg['load_before'][0]:.2f}, after {cfg['load_after'][0]:.2f}; {cfg['cpus']} CPUs)."]) + "\n"


def write_plot(result: dict, path: str | Path) -> Path:
    """Throughput and p50 ITL against concurrency, a line per config."""
    from .common import log2_axis, pyplot, save

    cfg, cs = result["config"], result["config"]["concurrency"]
    m = {(c["spec"], c["concurrency"]): c for c in result["cells"]}
    fig, (a, b) = pyplot().subplots(1, 2, figsize=(11, 4))
    for s in dict.fromkeys(c["spec"] for c in result["cells"]):
        a.plot(cs, [m[(s, c)]["tokens_per_second"] for c in cs], marker="o", label=s)
        b.plot(cs, [(m[(s, c)]["itl_p50"] or 0.0) * 1000 for c in cs], marker="o", label=s)
    for ax, yl in ((a, "completion tokens/s (all requests, wall)"), (b, "p50 inter-token latency (ms)")):
        log2_axis(ax, cs, "concurrent clients C", yl)
        ax.legend(fontsize=8)
    rounds = f", {cfg['rounds']} rounds (tok/s: their median)" if cfg["rounds"] > 1 else ""
    fig.suptitle(f"mtpspec serve, {cfg['model']}: {cfg['requests']} requests x {cfg['max_tokens']} tokens per run{rounds}")
    return save(fig, Path(path))


def make_references(model, prompts, n: int, max_tokens: int) -> tuple[list[Reference], int]:
    """Greedy answers (no drafter) to the first n prompts that fit the context with max_tokens; (refs, prompts skipped)."""
    refs, skipped = [], 0
    for p in prompts:
        if len(refs) >= n:
            break
        ids = model.encode(p.text) if p.text.strip() else []
        if not ids or len(ids) + max_tokens > model.max_seq_len:
            skipped += 1
            continue
        res = model.generate(p.text, max_new_tokens=max_tokens)
        stream = model.tokenizer.stream(prev=ids[-1])
        lens = [len(stream.push([t])) for t in res.tokens]
        lens[-1:] = [lens[-1] + len(stream.flush())] if lens else []
        refs.append(Reference(p.id, p.text, res.text, len(res.tokens), res.finish_reason, lens))
    if not refs:
        raise ConfigError(f"no prompt of the set fits the model's context ({model.max_seq_len}) with --max-tokens {max_tokens}")
    return refs, skipped


def run_loadtest(args: argparse.Namespace, log=print) -> dict:
    """Every spec config x concurrency, a fresh server per config and round (the configs' order rotated each round);
    the result (config, references, cells, targets, problems) as a dict."""
    from ..api import load
    from ..prompts import load_prompts
    from ..threads import check_threads

    specs, cs = parse_specs(args.spec), parse_counts(args.concurrency, "--concurrency", "concurrencies", "1,4,16")
    for name in ("requests", "max_tokens", "warmup_tokens", "rounds"):
        if getattr(args, name) < 1:
            raise ConfigError(f"--{name.replace('_', '-')} must be an integer >= 1, got {getattr(args, name)}")
    if not args.time_limit > 0 or (args.warmup or 0) < 0:
        raise ConfigError(f"--time-limit must be > 0 seconds and --warmup >= 0, got {args.time_limit} and {args.warmup}")
    threads, max_batch = check_threads(args.threads, "--threads"), args.max_batch or max(cs)
    exe = find_binary("llama-server") if any(s.peer for s in specs) else None  # named before anything loads
    load_before, t_start = os.getloadavg(), time.perf_counter()
    model = load(args.model, args.tokenizer, threads=threads)
    refs, skipped = make_references(model, load_prompts(args.prompts), args.requests, args.max_tokens)
    ref_seconds = time.perf_counter() - t_start
    log(f"loadtest: {len(refs)} references ({skipped} prompts skipped: too long or empty) in {ref_seconds:.1f} s")
    if exe is not None:
        gguf = peer_gguf(model, Path(args.out).parent / "gguf", Path(args.model).stem)
        slot_ctx = max(len(model.encode(r.prompt)) for r in refs) + args.max_tokens + 16  # every request fits its slot

    def argv(spec: SpecConfig, port: int) -> list[str]:
        if spec.peer:
            return server_args(exe, gguf, Method("llamacpp", spec.drafter, spec.k), threads, slot_ctx, port, slots=max_batch)
        return [sys.executable, "-m", "mtpspec", "serve", "--model", args.model, "--host", "127.0.0.1", "--port", str(port),
                *spec.serve_args(), "--max-batch", str(max_batch), "--prefix-cache", "0"] + \
            (["--tokenizer", args.tokenizer] if args.tokenizer else []) + (["--threads", str(threads)] if threads else [])

    runs = {(s.label, c): [] for s in specs for c in cs}  # (records, warm-up failures, time-limited, load average)
    servers: dict[str, dict] = {}
    for r in range(args.rounds):
        for spec in specs[r % len(specs):] + specs[:r % len(specs)]:
            with (LlamaServer if spec.peer else ServerProcess)(partial(argv, spec), args.startup_timeout) as server:
                name = server.post("v1/models", timeout=10.0)["data"][0]["id"]
                info = servers.setdefault(spec.label, {"argv": server.args[1:], "served_model": name, "startup_seconds": []})
                info["startup_seconds"].append(server.startup_seconds)
                log(f"loadtest: round {r + 1}/{args.rounds} {spec.label}: serving {name} at {server.url} "
                    f"({server.startup_seconds:.1f} s to start)")
                for c in cs:
                    got = asyncio.run(_run_cell(server.url, name, refs, c, args.requests, args.max_tokens, args.time_limit,
                                                c if args.warmup is None else args.warmup, args.warmup_tokens, r, spec.peer))
                    runs[(spec.label, c)].append((*got, os.getloadavg()[0]))
                    ok = sum(x.status == "ok" for x in got[0])
                    log(f"loadtest: {spec.label} C={c}: {ok}/{args.requests} ok" + " (time limit)" * got[2])
    cells = [summarize(s, c, [x[0] for x in rs], sum(x[1] for x in rs), any(x[2] for x in rs), [x[3] for x in rs])
             for (s, c), rs in runs.items()]
    peer = {"gguf": str(gguf), "slot_context": slot_ctx, "binary": str(exe)} if exe is not None else None
    config = {k: v for k, v in vars(args).items() if k not in ("command", "out", "md", "png", "func")}
    return {"config": config | {
                "command": shlex.join(["mtpspec", "loadtest", *sys.argv[2:]]), "concurrency": cs, "threads": threads,
                "spec": [asdict(s) for s in specs], "max_batch": max_batch, "prompts_used": len(refs), "prompts_skipped": skipped,
                "reference": "in-process mtpspec.load(model).generate(prompt, max_new_tokens=M), greedy, no drafter",
                "reference_seconds": ref_seconds, "servers": servers, "elapsed_seconds": time.perf_counter() - t_start,
                "load_before": list(load_before), "load_after": list(os.getloadavg()), "cpus": os.cpu_count()},
            "references": [asdict(r) for r in refs], "cells": cells, "targets": targets(cells), "problems": _problems(cells),
            "peer": peer, "versus_peer": versus_peer(cells), "peer_consistency": peer_consistency(cells, refs)}


def _args(p: argparse.ArgumentParser) -> None:
    a = p.add_argument
    a("--model", default="demo", help="the model to serve (a path or 'demo'; default demo)")
    a("--tokenizer", help="tokenizer file when the model does not carry one")
    a("--concurrency", default="1,4,16", help="concurrent clients, comma-separated (default 1,4,16)")
    a("--spec", default="off,fixed:3,auto", help="speculation configs, comma-separated: off (--drafter none), fixed:D (the "
      "model's own drafter, --k D), auto (--k auto), or DRAFTER:K, e.g. ngram:2 (default off,fixed:3,auto); llama.cpp's "
      "llama-server on the same GGUF (after `make llamacpp`): llamacpp, llamacpp:ngram:K, llamacpp:mtp:K")
    a("--requests", type=int, default=32, help="requests per (config, concurrency) run (default 32)")
    a("--time-limit", type=float, default=120.0, help="seconds per run: then requests in flight are cut, the rest not sent")
    a("--max-tokens", type=int, default=64, help="max_tokens of every request (default 64)")
    a("--prompts", default="humaneval", help="spec_bench | mt_bench | humaneval | tinystories, or a file (default humaneval)")
    a("--warmup", type=int, default=None, help="warm-up requests before each run, not counted (default: C)")
    a("--warmup-tokens", type=int, default=16, help="max_tokens of a warm-up request (default 16)")
    a("--max-batch", type=int, default=None, help="the server's --max-batch (default: the largest concurrency)")
    a("--startup-timeout", type=float, default=300.0, help="seconds for a server to start (default 300)")
    a("--rounds", type=int, default=1, help="passes over every config (order rotated each round); tok/s = their median")
    a("--out", default="build/serve_load.json", help="JSON with every number (default build/serve_load.json)")
    a("--md", help="also write the markdown report here")
    a("--png", help="also write the plot here (throughput and p50 ITL against concurrency)")
    add_threads_arg(p, default=1)


@command("loadtest")(_args)
def run_loadtest_cli(args: argparse.Namespace) -> int:
    """Exit 0 when every request finished with the reference's text (targets are printed, not enforced), else 1."""
    signal.signal(signal.SIGTERM, _interrupt)  # `kill` stops the servers too (through the same path as Ctrl-C)
    result = run_loadtest(args, log=lambda s: print(s, file=sys.stderr, flush=True))
    md = report(result)
    print(md)
    for path, write in ((args.out, lambda p: p.write_text(json.dumps(result, indent=1))), (args.md, lambda p: p.write_text(md)),
                        (args.png, lambda p: write_plot(result, p))):
        if path:
            Path(path).parent.mkdir(parents=True, exist_ok=True)
            write(Path(path))
    print(f"wrote {', '.join(x for x in (args.out, args.md, args.png) if x)} ({result['config']['elapsed_seconds']:.0f} s)",
          file=sys.stderr)
    return 1 if any(c["counts"].get(k) for c in result["cells"] for k in ("mismatch", "error")) else 0


def _interrupt(signum, frame) -> None:
    raise KeyboardInterrupt

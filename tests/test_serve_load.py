"""`mtpspec loadtest` (mtpspec.bench.serve_load): SSE parsing, latency accounting, reports; one run against a real server."""

from __future__ import annotations

import argparse
import json

import pytest

from mtpspec.bench.serve_load import (
    Chunk,
    Reference,
    RequestRecord,
    SpecConfig,
    _args,
    align_counts,
    check_lines,
    check_targets,
    chunk_tokens,
    finish_record,
    latencies,
    markdown_report,
    markdown_table,
    parse_concurrency,
    parse_spec,
    parse_specs,
    parse_sse_line,
    percentile,
    problems,
    serve_argv,
    summarize_cell,
    write_plot,
)
from mtpspec.errors import ConfigError


# --- configs -----------------------------------------------------------------------------------


@pytest.mark.parametrize("text, drafter, k, flags", [
    ("off", "none", None, ["--drafter", "none"]),
    ("auto", "auto", "auto", ["--drafter", "auto", "--k", "auto"]),
    ("fixed:3", "auto", 3, ["--drafter", "auto", "--k", "3"]),
    ("ngram:2", "ngram", 2, ["--drafter", "ngram", "--k", "2"]),
    ("mtp:auto", "mtp", "auto", ["--drafter", "mtp", "--k", "auto"]),
])
def test_parse_spec(text, drafter, k, flags):
    s = parse_spec(text)
    assert (s.label, s.drafter, s.k) == (text, drafter, k)
    assert s.serve_args() == flags


@pytest.mark.parametrize("text, words", [
    ("fixed", "off, auto, fixed:D"), ("fixed:0", ">= 1"), ("fixed:x", "integer"), ("fixed:auto", "adaptive"),
    (":3", "DRAFTER:K"), ("ngram:", "DRAFTER:K"),
])
def test_parse_spec_bad(text, words):
    with pytest.raises(ConfigError, match=words):
        parse_spec(text)


def test_parse_lists():
    assert [s.label for s in parse_specs("off, fixed:3,auto")] == ["off", "fixed:3", "auto"]
    with pytest.raises(ConfigError, match="twice"):
        parse_specs("off,off")
    with pytest.raises(ConfigError, match="needs"):
        parse_specs(" , ")
    assert parse_concurrency("16,1,4,4") == [1, 4, 16]
    for bad, words in (("0", ">= 1"), ("a", "integer"), ("", "needs concurrencies")):
        with pytest.raises(ConfigError, match=words):
            parse_concurrency(bad)


def test_serve_argv_starts_a_loopback_server_on_any_port():
    argv = serve_argv("demo", SpecConfig("fixed:3", "auto", 3), 16, 1, None)
    assert argv[1:5] == ["-m", "mtpspec", "serve", "--model"]
    i = argv.index
    assert argv[i("--port") + 1] == "0" and argv[i("--host") + 1] == "127.0.0.1"
    assert argv[i("--max-batch") + 1] == "16" and argv[i("--threads") + 1] == "1" and argv[i("--k") + 1] == "3"
    assert "--tokenizer" not in argv and "--threads" not in serve_argv("demo", parse_spec("off"), 4, None, None)


def test_cli_arguments_parse():
    p = argparse.ArgumentParser()
    _args(p)
    a = p.parse_args(["--concurrency", "1,2", "--spec", "off,ngram:2", "--requests", "4", "--time-limit", "60"])
    assert (a.model, a.threads, a.max_tokens, a.prompts, a.out) == ("demo", 1, 64, "humaneval", "build/serve_load.json")
    assert (a.concurrency, a.spec, a.requests, a.time_limit) == ("1,2", "off,ngram:2", 4, 60.0)


# --- SSE and latency accounting ------------------------------------------------------------------


def test_parse_sse_line():
    assert parse_sse_line('data: {"a": 1}') == {"a": 1}
    assert parse_sse_line('data:{"a": 1}') == {"a": 1}
    assert parse_sse_line("data: [DONE]") == "[DONE]"
    for other in ("", ": keep-alive", "event: message", "id: 3"):
        assert parse_sse_line(other) is None
    with pytest.raises(ValueError, match="not JSON"):
        parse_sse_line("data: {broken")


def test_chunk_tokens_from_logprobs_only():
    assert chunk_tokens({"choices": [{"text": "ab", "logprobs": {"tokens": ["a", "b"]}}]}) == 2
    assert chunk_tokens({"choices": [{"text": "ab", "logprobs": None}]}) is None
    assert chunk_tokens({"choices": []}) is None


def test_align_counts():
    # tokens add "Hel", "lo", " wor", "ld", "" (a byte held back), "!"
    lens = [3, 2, 4, 2, 0, 1]
    assert align_counts(["Hello", " world", "!"], lens) == [2, 3, 1]  # the empty token ends with " world"
    assert align_counts(["He", "llo world!"], lens) == [0, 6]
    assert align_counts(["Hello world!"], lens) == [6]
    assert align_counts(["Hello"], lens) == [6]  # a short text: the rest goes to the last chunk
    assert align_counts([], lens) == []


def test_latencies_share_a_chunks_gap_among_its_tokens():
    ttft, itl = latencies([0.5, 0.6, 0.9, 1.0], [1, 1, 3, 0])
    assert ttft == 0.5
    assert itl == pytest.approx([0.1, 0.1, 0.1, 0.1])
    ttft, itl = latencies([0.2, 0.3, 0.5], [0, 2, 1])  # a chunk with no tokens does not start the clock
    assert ttft == 0.3 and itl == pytest.approx([0.2])
    assert latencies([], []) == (None, [])


def test_percentile_matches_linear_interpolation():
    xs = [5.0, 1.0, 3.0, 2.0, 4.0]
    assert percentile(xs, 50) == 3.0
    assert percentile(xs, 0) == 1.0 and percentile(xs, 100) == 5.0
    assert percentile(xs, 99) == pytest.approx(4.96)
    assert percentile([7.0], 99) == 7.0
    assert percentile([], 50) is None


def _ref(text="Hello world!", lens=(3, 2, 4, 2, 0, 1)):
    return Reference("p0", "Say hi", text, len(lens), "length", list(lens))


def test_finish_record_checks_the_text_and_counts_tokens():
    chunks = [Chunk(0.5, "Hello", None), Chunk(0.7, " world", None), Chunk(0.8, "!", None)]
    rec = RequestRecord(0, "p0")
    finish_record(rec, chunks, {"usage": {"completion_tokens": 6}, "mtpspec": {"accepted": 3}}, _ref())
    assert rec.status == "ok" and rec.token_counts == "aligned" and rec.tokens == 6
    assert rec.ttft == 0.5 and rec.itl == pytest.approx([0.2 / 3] * 3 + [0.1])
    assert rec.stats == {"accepted": 3} and rec.text is None

    rec = RequestRecord(1, "p0")
    finish_record(rec, [Chunk(0.4, "Hello", 2), Chunk(0.6, " there", 4)], None, _ref())
    assert rec.status == "mismatch" and rec.text == "Hello there" and rec.expected == "Hello world!"
    assert rec.token_counts == "stream" and rec.tokens == 6 and rec.itl == pytest.approx([0.05] * 4)


def _rec(i, status, sent, ended, tokens, ttft, itl):
    stats = {"target_forwards": tokens // 2, "drafted": tokens, "accepted": tokens // 2}
    return RequestRecord(i, f"p{i}", status=status, sent_at=sent, ended_at=ended, tokens=tokens, ttft=ttft, itl=itl,
                         token_counts="stream", stats=stats)


def test_summarize_cell_counts_every_request():
    recs = [_rec(0, "ok", 10.0, 11.0, 8, 0.1, [0.01, 0.03]), _rec(1, "mismatch", 10.5, 12.0, 4, 0.3, [0.02]),
            _rec(2, "error", 10.2, 10.3, 0, None, []), _rec(3, "cut", 11.0, 14.0, 0, None, []),
            RequestRecord(4, "p4", status="not_started")]
    c = summarize_cell("off", 2, recs, warmup_errors=1, time_limited=True)
    assert c.counts == {"ok": 1, "mismatch": 1, "error": 1, "cut": 1, "not_started": 1} and c.requests == 5
    assert (c.target_forwards, c.drafted, c.accepted, c.tokens_per_forward) == (6, 12, 6, 2.0)
    assert c.tokens == 12 and c.wall_seconds == pytest.approx(2.0) and c.tokens_per_second == pytest.approx(6.0)
    assert c.ttft_p50 == pytest.approx(0.2) and c.itl_p50 == pytest.approx(0.02) and c.itl_mean == pytest.approx(0.02)
    j = json.loads(json.dumps(c.to_json()))
    assert len(j["records"]) == 5 and "sent_at" not in j["records"][0]
    assert problems([j]) == ["off at C=2: 1 cut, 1 error, 1 mismatch, 1 not_started, 1 warm-up errors"]
    empty = summarize_cell("off", 1, [RequestRecord(0, "p0", status="error", sent_at=1.0, ended_at=1.1)])
    assert empty.tokens_per_second == 0.0 and empty.ttft_p50 is None


def test_merge_rounds_takes_the_median_rate_and_pools_latencies():
    from mtpspec.bench.serve_load import merge_rounds

    runs = []
    for r, (wall, itl) in enumerate(((2.0, 0.01), (1.0, 0.02), (4.0, 0.03))):
        rec = _rec(0, "ok", 10.0, 10.0 + wall, 8, 0.1 * (r + 1), [itl] * 7)
        rec.round = r
        cell = summarize_cell("auto", 1, [rec])
        cell.load1 = [float(r)]
        runs.append(cell)
    merged = merge_rounds(runs)
    assert merged.round_tokens_per_second == [4.0, 8.0, 2.0] and merged.tokens_per_second == 4.0
    assert merged.requests == 3 and merged.counts == {"ok": 3} and merged.tokens == 24 and merged.wall_seconds == 7.0
    assert merged.itl_p50 == pytest.approx(0.02) and merged.ttft_p50 == pytest.approx(0.2) and merged.load1 == [0.0, 1.0, 2.0]
    assert merge_rounds(runs[:1]) is runs[0]


# --- reports ------------------------------------------------------------------------------------


def _cell(spec, c, tps, itl50, ok=8, total=8):
    return {"spec": spec, "concurrency": c, "tokens_per_second": tps, "ttft_p50": 0.05, "ttft_p99": 0.2, "itl_p50": itl50,
            "itl_p99": itl50 * 3, "requests": total, "counts": {"ok": ok, **({"error": total - ok} if ok < total else {})},
            "warmup_errors": 0, "load1": [1.2]}


CELLS = [_cell("off", 1, 50.0, 0.020), _cell("off", 16, 220.0, 0.060),
         _cell("fixed:3", 1, 80.0, 0.012), _cell("fixed:3", 16, 180.0, 0.080),
         _cell("auto", 1, 78.0, 0.013), _cell("auto", 16, 215.0, 0.065, ok=7)]


def test_check_targets():
    t = {x["name"]: x for x in check_targets(CELLS)}
    assert t["off: tok/s at C=16 vs C=1"]["value"] == pytest.approx(4.4) and t["off: tok/s at C=16 vs C=1"]["passed"]
    assert not t["fixed:3: tok/s at C=16 vs C=1"]["passed"]
    assert t["auto at C=1 vs best of off,fixed:3"]["value"] == pytest.approx(78 / 80) and t["auto at C=1 vs best of off,fixed:3"]["passed"]
    assert t["auto at C=16 vs best of off,fixed:3"]["value"] == pytest.approx(215 / 220)
    assert t["p50 ITL at C=1: off / auto"]["value"] == pytest.approx(20 / 13) and t["p50 ITL at C=1: off / auto"]["passed"]
    lines = check_lines(check_targets(CELLS))
    assert "[FAIL] fixed:3: tok/s at C=16 vs C=1: 2.25x (target >= 4.0x)" in lines
    # without C=16 or without auto / off, the targets that cannot be judged are left out
    assert check_targets([_cell("ngram:2", 1, 10.0, 0.1), _cell("ngram:2", 2, 15.0, 0.1)]) == []


def test_markdown_table_and_report():
    table = markdown_table(CELLS)
    rows = table.splitlines()
    assert rows[0].startswith("| spec | C | tok/s | x vs C=1 |") and len(rows) == 2 + len(CELLS)
    assert rows[0].endswith("| ok/total | tok/fwd | load |") and rows[1].count("|") == rows[0].count("|")
    assert rows[3] == "| off | 16 | 220.0 | 4.40 | 50.0 | 200.0 | 60.0 | 180.0 | 8/8 | - | 1.2 |"
    assert rows[7].endswith("| 7/8 | - | 1.2 |")
    rounds = [dict(c, round_tokens_per_second=[c["tokens_per_second"], 1.0], tokens_per_forward=2.5) for c in CELLS]
    rows = markdown_table(rounds).splitlines()
    assert rows[0].endswith("| tok/fwd | tok/s by round | load |")
    assert rows[3].endswith("| 8/8 | 2.50 | 220, 1 | 1.2 |")
    cfg = {"command": "mtpspec loadtest --requests 8", "elapsed_seconds": 61.2, "load_before": [0.5, 0.4, 0.3],
           "load_after": [1.2, 0.8, 0.5], "cpus": 2, "concurrency": [1, 16], "model": "demo", "requests": 8, "max_tokens": 64}
    md = markdown_report({"config": cfg, "cells": CELLS, "targets": check_targets(CELLS)})
    assert "auto at C=16: 1 error" in md and "`mtpspec loadtest --requests 8` (61 s; load average before 0.50" in md


def test_write_plot(tmp_path):
    cfg = {"concurrency": [1, 16], "model": "demo", "requests": 8, "max_tokens": 64}
    path = write_plot({"config": cfg, "cells": CELLS}, tmp_path / "img" / "serve_load.png")
    assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


# --- against a real server ----------------------------------------------------------------------


def test_server_process_is_killed_and_a_bad_start_is_named(assets):
    import httpx

    from mtpspec.bench.serve_load import ServerProcess

    argv = serve_argv(str(assets / "models" / "stories260K.bin"), parse_spec("off"), 2, 1, None)
    with ServerProcess(argv, startup_timeout=60) as server:
        assert server.url.startswith("http://127.0.0.1:")
        assert httpx.get(server.url + "health", trust_env=False).status_code == 200
    assert server.proc.returncode is not None  # gone after the block
    bad = serve_argv(str(assets / "models" / "no_such_model.bin"), parse_spec("off"), 2, 1, None)
    with pytest.raises(ConfigError, match=r"exited with status 2(.|\n)*model not found: .*no_such_model.bin"):
        with ServerProcess(bad, startup_timeout=60):
            pass


def test_loadtest_end_to_end(assets, tmp_path, monkeypatch):
    """Two configs x two concurrencies on stories260K: every request finishes with the reference's text."""
    from mtpspec.bench.serve_load import run_loadtest_cli

    p = argparse.ArgumentParser()
    _args(p)
    out, md, png = tmp_path / "load.json", tmp_path / "load.md", tmp_path / "load.png"
    args = p.parse_args(["--model", str(assets / "models" / "stories260K.bin"), "--concurrency", "1,2", "--spec", "off,ngram:2",
                         "--requests", "4", "--max-tokens", "16", "--time-limit", "60", "--prompts", "humaneval", "--threads", "1",
                         "--out", str(out), "--md", str(md), "--png", str(png)])
    assert run_loadtest_cli(args) == 0
    result = json.loads(out.read_text())
    cells = result["cells"]
    assert [(c["spec"], c["concurrency"]) for c in cells] == [("off", 1), ("off", 2), ("ngram:2", 1), ("ngram:2", 2)]
    refs = {r["prompt_id"]: r for r in result["references"]}
    for c in cells:
        assert c["counts"] == {"ok": 4} and not c["time_limited"] and c["warmup_errors"] == 0
        assert c["tokens"] == sum(refs[r["prompt_id"]]["tokens"] for r in c["records"]) and c["tokens_per_second"] > 0
        for r in c["records"]:
            assert r["ttft"] > 0 and len(r["itl"]) <= r["tokens"] - 1 and r["stats"]["drafter"] == c["spec"].split(":")[0].replace("off", "none")
    assert result["problems"] == [] and result["config"]["servers"]["ngram:2"]["served_model"] == "stories260K"
    assert "| ngram:2 | 2 |" in md.read_text() and png.read_bytes()[:4] == b"\x89PNG"

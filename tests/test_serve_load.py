"""`mtpspec loadtest`: its flags, the SSE accounting of one request, the numbers of a run, the report; one real run."""

from __future__ import annotations

import json
import sys

import pytest

from mtpspec.bench.serve_load import (Reference, RequestRecord, parse_specs, peer_consistency, read_stream, report, summarize,
                                      targets, versus_peer)
from mtpspec.cli import main
from mtpspec.errors import ConfigError


# --- flags -------------------------------------------------------------------------------------


def test_spec_items_and_their_server_flags():
    specs = parse_specs("off, auto,fixed:3,ngram:2,mtp:auto")
    assert [(s.label, s.drafter, s.k) for s in specs] == [
        ("off", "none", None), ("auto", "auto", "auto"), ("fixed:3", "auto", 3), ("ngram:2", "ngram", 2), ("mtp:auto", "mtp", "auto")]
    assert [s.serve_args() for s in specs] == [["--drafter", "none"], ["--drafter", "auto", "--k", "auto"], ["--drafter", "auto", "--k", "3"],
                                               ["--drafter", "ngram", "--k", "2"], ["--drafter", "mtp", "--k", "auto"]]


def test_llamacpp_spec_items():
    specs = parse_specs("llamacpp,llamacpp:ngram:4,llamacpp:mtp:3")
    assert [(s.label, s.drafter, s.k, s.peer) for s in specs] == [
        ("llamacpp", "none", None, True), ("llamacpp:ngram:4", "ngram", 4, True), ("llamacpp:mtp:3", "mtp", 3, True)]
    assert not any(s.peer for s in parse_specs("off,auto,ngram:2"))


def test_a_missing_llama_server_is_named_before_the_model_loads(tmp_path, capsys, monkeypatch):
    monkeypatch.setenv("MTPSPEC_LLAMACPP_BIN_DIR", str(tmp_path))
    assert main(["loadtest", "--model", str(tmp_path / "never_loaded.bin"), "--spec", "off,llamacpp", "--out", str(tmp_path / "x.json")]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "no executable llama-server there" in err and "never_loaded" not in err


@pytest.mark.parametrize("flags, words", [
    (["--spec", "llamacpp:auto:3"], "llamacpp:ngram:K"), (["--spec", "llamacpp:ngram:0"], "K >= 1"),
    (["--spec", "llamacpp:ngram"], "llamacpp:mtp:K"), (["--spec", "fixed"], "off, auto, fixed:D"), (["--spec", "fixed:0"], ">= 1"), (["--spec", "fixed:x"], "integer"),
    (["--spec", "fixed:auto"], "adaptive"), (["--spec", ":3"], "DRAFTER:K"), (["--spec", "ngram:"], "DRAFTER:K"),
    (["--spec", "off,off"], "twice"), (["--spec", " , "], "needs configs"), (["--concurrency", "0"], ">= 1"),
    (["--concurrency", "a"], "integer"), (["--concurrency", ""], "needs concurrencies"), (["--requests", "0"], "--requests"),
    (["--rounds", "0"], "--rounds"), (["--time-limit", "0"], "--time-limit"), (["--threads", "0"], "--threads"),
])
def test_bad_flags_are_one_line_errors_before_anything_loads(flags, words, capsys, tmp_path):
    assert main(["loadtest", "--model", str(tmp_path / "never_loaded.bin"), *flags, "--out", str(tmp_path / "x.json")]) == 2
    err = capsys.readouterr().err
    assert err.startswith("mtpspec: error:") and words in err and "Traceback" not in err and not (tmp_path / "x.json").exists()


# --- one request: SSE lines -> status, TTFT, ITLs, tokens ---------------------------------------------


REF = Reference("p0", "Say hi", "Hello world!", 6, "length", [3, 2, 4, 2, 0, 1])  # "Hel" "lo" " wor" "ld" "" (a held byte) "!"


def _data(text=None, tokens=None, **extra):
    choice = {"text": text, "logprobs": {"tokens": tokens} if tokens is not None else None}
    return "data: " + json.dumps({"choices": [choice] if text is not None else [], **extra})


def test_a_stream_checked_against_the_reference_with_tokens_aligned_from_text():
    events = [(0.1, ": keep-alive"), (0.5, _data("Hello")), (0.5, ""), (0.7, "data:" + _data(" world")[5:]), (0.75, "event: x"),
              (0.8, _data("!", mtpspec={"accepted": 3})), (0.8, _data(usage={"completion_tokens": 6})), (0.9, "data: [DONE]")]
    rec = read_stream(events, REF, RequestRecord(0, "p0"))
    assert rec.status == "ok" and rec.token_counts == "aligned" and rec.tokens == 6 and rec.error is None
    # chunks carry 2, 3 ("ld" and the empty token end with " world"), 1 tokens; each gap shared among its tokens
    assert rec.ttft == 0.5 and rec.itl == pytest.approx([0.2 / 3] * 3 + [0.1])
    assert rec.stats == {"accepted": 3} and rec.text is None and rec.expected is None


@pytest.mark.parametrize("texts, itl", [
    (["He", "llo", " world!"], [0.15] * 4),  # the first chunk ends inside a token: it carries none, the clock starts at the second
    (["Hello world!"], []), (["Hello"], []),  # one chunk: all tokens (a short text: the rest goes to the last chunk)
])
def test_aligned_counts_start_the_clock_at_the_first_chunk_with_tokens(texts, itl):
    events = [(0.5 + 0.6 * i, _data(t)) for i, t in enumerate(texts)] + [(2.0, "data: [DONE]")]
    rec = read_stream(events, REF, RequestRecord(0, "p0"))
    assert rec.ttft == 0.5 and rec.itl == pytest.approx(itl) and rec.tokens == 6 and rec.status == ("ok" if texts[-1] != "Hello" else "mismatch")


def test_token_counts_from_the_stream_and_a_mismatch_keeps_both_texts():
    events = [(0.4, _data("Hello", ["Hel", "lo"])), (0.6, _data(" there", ["a", "b", "c", "d"])), (0.7, "data: [DONE]")]
    rec = read_stream(events, REF, RequestRecord(1, "p0"))
    assert rec.status == "mismatch" and rec.text == "Hello there" and rec.expected == "Hello world!"
    assert rec.token_counts == "stream" and rec.tokens == 6 and rec.itl == pytest.approx([0.05] * 4)


@pytest.mark.parametrize("events, words", [
    ([(0.1, "data: {broken")], "not JSON"), ([(0.1, _data("He")), (0.2, 'data: {"error": {"message": "boom"}}')], "error event"),
    ([(0.1, _data("Hello world!"))], "without data: [DONE]"), ([], "without data: [DONE]"),
])
def test_a_broken_stream_is_an_error(events, words):
    rec = read_stream(events, REF, RequestRecord(0, "p0"))
    assert rec.status == "error" and words in rec.error


def test_a_peer_streams_one_token_a_chunk_and_its_own_text_differs():
    """llama-server's text need not be ours: it is not aligned with our tokens, each chunk is one token, and a text
    other than the reference is "differs" (finished), never "mismatch"."""
    events = [(0.5, _data("Hello")), (0.7, _data(" there")), (0.8, _data("!")), (0.8, _data(usage={"completion_tokens": 3})),
              (0.9, "data: [DONE]")]
    rec = read_stream(events, REF, RequestRecord(0, "p0"), peer=True)
    assert rec.status == "differs" and rec.text == "Hello there!" and rec.token_counts == "chunks" and rec.tokens == 3
    assert rec.ttft == 0.5 and rec.itl == pytest.approx([0.2, 0.1])
    same = read_stream([(0.5, _data("Hello world!")), (0.6, "data: [DONE]")], REF, RequestRecord(0, "p0"), peer=True)
    assert same.status == "ok" and same.tokens == 1


@pytest.mark.parametrize("failures, status", [(1, "ok"), (2, "error")])
def test_a_connection_closed_before_any_response_is_retried_once(failures, status):
    """A kept-alive connection the server closes as a request goes out: sent again once on a new one; twice is an error."""
    import asyncio

    import httpx

    from mtpspec.bench.serve_load import _request

    calls = []

    def handler(request: httpx.Request) -> httpx.Response:
        calls.append(json.loads(request.content))
        if len(calls) <= failures:
            raise httpx.RemoteProtocolError("Server disconnected without sending a response.", request=request)
        return httpx.Response(200, text=_data("Hello world!") + "\n\ndata: [DONE]\n\n")

    async def go(rec):
        async with httpx.AsyncClient(transport=httpx.MockTransport(handler)) as client:
            await _request(client, "http://x/", "m", REF, 6, rec, peer=True)
        return rec

    rec = asyncio.run(go(RequestRecord(0, "p0")))
    assert rec.status == status and rec.retried and len(calls) == 2 and calls[0]["cache_prompt"] is False
    assert (rec.error is None) == (status == "ok") and rec.seconds is not None


# --- one run: every request counted; rounds --------------------------------------------------------------


def _rec(i, status, sent, ended, tokens, ttft, itl, r=0):
    stats = {"target_forwards": tokens // 2, "drafted": tokens, "accepted": tokens // 2}
    return RequestRecord(i, f"p{i}", r, status=status, sent_at=sent, ended_at=ended, tokens=tokens, ttft=ttft, itl=itl,
                         token_counts="stream", stats=stats)


def test_a_run_counts_every_request_and_rates_the_finished_ones():
    recs = [_rec(0, "ok", 10.0, 11.0, 8, 0.1, [0.01, 0.03]), _rec(1, "mismatch", 10.5, 12.0, 4, 0.3, [0.02]),
            _rec(2, "error", 10.2, 10.3, 0, None, []), _rec(3, "cut", 11.0, 14.0, 0, None, []), RequestRecord(4, "p4", status="not_started")]
    c = json.loads(json.dumps(summarize("off", 2, [recs], warmup_errors=1, time_limited=True, load1=[0.5])))
    assert c["counts"] == {"ok": 1, "mismatch": 1, "error": 1, "cut": 1, "not_started": 1} and c["requests"] == 5
    assert (c["target_forwards"], c["drafted"], c["accepted"], c["tokens_per_forward"]) == (6, 12, 6, 2.0)
    # 12 tokens from the first request sent (10.0) to the last finished (12.0); the cut one ends later but is not finished
    assert c["tokens"] == 12 and c["wall_seconds"] == pytest.approx(2.0) and c["tokens_per_second"] == pytest.approx(6.0)
    assert c["ttft_p50"] == pytest.approx(0.2) and c["itl_p50"] == pytest.approx(0.02) and c["itl_mean"] == pytest.approx(0.02)
    assert c["itl_p99"] == pytest.approx(0.0298)  # linear between the nearest ranks (numpy's default)
    assert c["time_limited"] and c["token_counts"] == {"stream": 2} and len(c["records"]) == 5 and "sent_at" not in c["records"][0]
    empty = summarize("off", 1, [[RequestRecord(0, "p0", status="error", sent_at=1.0, ended_at=1.1)]])
    assert empty["tokens_per_second"] == 0.0 and empty["ttft_p50"] is None and empty["tokens_per_forward"] is None


def test_rounds_take_the_median_rate_and_pool_latencies():
    rounds = [[_rec(0, "ok", 10.0, 10.0 + wall, 8, 0.1 * (r + 1), [itl] * 7, r)] for r, (wall, itl) in enumerate(((2.0, 0.01), (1.0, 0.02), (4.0, 0.03)))]
    c = summarize("auto", 1, rounds, load1=[0.0, 1.0, 2.0])
    assert c["round_tokens_per_second"] == [4.0, 8.0, 2.0] and c["tokens_per_second"] == 4.0
    assert c["requests"] == 3 and c["counts"] == {"ok": 3} and c["tokens"] == 24 and c["wall_seconds"] == 7.0
    assert c["itl_p50"] == pytest.approx(0.02) and c["ttft_p50"] == pytest.approx(0.2) and c["load1"] == [0.0, 1.0, 2.0]


# --- targets and the report -------------------------------------------------------------------------------


def _cell(spec, c, tps, itl50, ok=8, total=8, rounds=None, fwd=None):
    return {"spec": spec, "concurrency": c, "tokens_per_second": tps, "ttft_p50": 0.05, "ttft_p99": 0.2, "itl_p50": itl50,
            "itl_p99": itl50 * 3, "requests": total, "counts": {"ok": ok, **({"error": total - ok} if ok < total else {})},
            "warmup_errors": 0, "load1": [1.2], "round_tokens_per_second": rounds or [tps], "tokens_per_forward": fwd}


CELLS = [_cell("off", 1, 50.0, 0.020), _cell("off", 16, 220.0, 0.060), _cell("fixed:3", 1, 80.0, 0.012),
         _cell("fixed:3", 16, 180.0, 0.080), _cell("auto", 1, 78.0, 0.013), _cell("auto", 16, 215.0, 0.065, ok=7)]


def test_targets():
    t = {x["name"]: (pytest.approx(x["value"]), x["passed"]) for x in targets(CELLS)}
    assert t == {"off: tok/s at C=16 vs C=1": (4.4, True), "fixed:3: tok/s at C=16 vs C=1": (2.25, False),
                 "auto: tok/s at C=16 vs C=1": (215 / 78, False), "auto at C=1 vs best of off,fixed:3": (78 / 80, True),
                 "auto at C=16 vs best of off,fixed:3": (215 / 220, True), "p50 ITL at C=1: off / auto": (20 / 13, True)}
    # without C=16, or without auto and off, the targets that cannot be judged are left out
    assert targets([_cell("ngram:2", 1, 10.0, 0.1), _cell("ngram:2", 2, 15.0, 0.1)]) == []


def test_report():
    cfg = {"command": "mtpspec loadtest --requests 8", "elapsed_seconds": 61.2, "load_before": [0.5, 0.4, 0.3],
           "load_after": [1.2, 0.8, 0.5], "cpus": 2}
    md = report({"config": cfg, "cells": CELLS, "targets": targets(CELLS)})
    rows = md.splitlines()
    assert rows[0] == "| spec | C | tok/s | x vs C=1 | TTFT p50 ms | TTFT p99 ms | ITL p50 ms | ITL p99 ms | ok/total | tok/fwd | load |"
    assert rows[1].count("|") == rows[0].count("|") and rows[3] == "| off | 16 | 220.0 | 4.40 | 50.0 | 200.0 | 60.0 | 180.0 | 8/8 | - | 1.2 |"
    assert rows[7].endswith("| 7/8 | - | 1.2 |") and "Every response checked: auto at C=16: 1 error." in md
    assert "- [FAIL] fixed:3: tok/s at C=16 vs C=1: 2.25x (target >= 4.0x)" in rows
    assert "`mtpspec loadtest --requests 8` (61 s; load average before 0.50, after 1.20; 2 CPUs)" in md
    rounds = [dict(c, round_tokens_per_second=[c["tokens_per_second"], 1.0], tokens_per_forward=2.5) for c in CELLS]
    rows = report({"config": cfg, "cells": rounds, "targets": []}).splitlines()
    assert rows[0].endswith("| tok/fwd | tok/s by round | load |") and rows[3].endswith("| 8/8 | 2.50 | 220, 1 | 1.2 |")
    assert "Every response checked: all ok." in report({"config": cfg, "cells": CELLS[:2], "targets": []})


def _peer_cell(spec, c, tps, texts):
    records = [{"prompt_id": p, "status": "ok" if t is None else "differs", "text": t} for p, t in texts]
    return _cell(spec, c, tps, 0.03) | {"records": records, "counts": {"ok": sum(t is None for _, t in texts),
                                                                        "differs": sum(t is not None for _, t in texts)}}


def test_against_the_peer_best_against_best_and_its_text_across_concurrency():
    refs = [Reference(p, "prompt", f"ours {p}", 4, "length", [1] * 4) for p in ("a", "b", "c")]
    cells = [_cell("off", 1, 50.0, 0.02), _cell("auto", 1, 60.0, 0.02), _cell("off", 4, 150.0, 0.03), _cell("auto", 4, 120.0, 0.03),
             _peer_cell("llamacpp", 1, 40.0, [("a", None), ("b", "theirs b"), ("c", "theirs c")]),
             _peer_cell("llamacpp", 4, 50.0, [("a", "theirs a"), ("b", "theirs b"), ("c", None)]),
             _peer_cell("llamacpp:ngram:4", 1, 45.0, [("a", None), ("b", None), ("c", None)]),
             _peer_cell("llamacpp:ngram:4", 4, 30.0, [("a", None), ("b", None), ("c", None)])]
    assert versus_peer(cells) == [{"concurrency": 1, "ours": "auto", "peer": "llamacpp:ngram:4", "ratio": pytest.approx(60 / 45)},
                                  {"concurrency": 4, "ours": "off", "peer": "llamacpp", "ratio": pytest.approx(3.0)}]
    # llamacpp at C=4: "a" moved off its C=1 text (ours), "b" kept its own, "c" moved onto ours
    same = peer_consistency(cells, refs)
    assert same == [{"spec": "llamacpp", "concurrency": 4, "base_concurrency": 1, "same": 1, "total": 3},
                    {"spec": "llamacpp:ngram:4", "concurrency": 4, "base_concurrency": 1, "same": 3, "total": 3}]
    assert targets(cells) and all("llamacpp" not in t["name"] for t in targets(cells))  # the targets are ours
    cfg = {"command": "mtpspec loadtest", "elapsed_seconds": 1.0, "load_before": [0.0], "load_after": [0.0], "cpus": 2}
    md = report({"config": cfg, "cells": cells, "targets": [], "versus_peer": versus_peer(cells), "peer_consistency": same})
    assert "Every response checked: all ok." in md  # a peer's own text is not a problem
    assert "| llamacpp | 4 | 50.0 | 1.25 |" in md and ("tok/s: C=1 auto / llamacpp:ngram:4 1.33x; C=4 off / llamacpp 3.00x. Its text "
                                                      "equal to its own at C=1: llamacpp at C=4 1/3; llamacpp:ngram:4 at C=4 3/3.") in md


# --- against real servers ----------------------------------------------------------------------------------


def test_a_server_that_cannot_start_is_named(assets):
    from mtpspec.bench.common import ServerProcess

    bad = lambda port: [sys.executable, "-m", "mtpspec", "serve", "--model", str(assets / "models" / "no_such_model.bin"), "--port", str(port)]  # noqa: E731
    with pytest.raises(ConfigError, match=r"exited with status 2(.|\n)*model not found: .*no_such_model.bin"):
        with ServerProcess(bad, timeout=60):
            pass


def test_loadtest_end_to_end(assets, tmp_path, capsys):
    """Two configs x two concurrencies on stories260K: every request finishes with the reference's text."""
    out, md, png = tmp_path / "load.json", tmp_path / "load.md", tmp_path / "img" / "load.png"
    assert main(["loadtest", "--model", str(assets / "models" / "stories260K.bin"), "--concurrency", "2,1", "--spec", "off,ngram:2",
                 "--requests", "4", "--max-tokens", "16", "--time-limit", "60", "--prompts", "humaneval", "--threads", "1",
                 "--out", str(out), "--md", str(md), "--png", str(png)]) == 0
    result = json.loads(out.read_text())
    cells, servers = result["cells"], result["config"]["servers"]
    assert [(c["spec"], c["concurrency"]) for c in cells] == [("off", 1), ("off", 2), ("ngram:2", 1), ("ngram:2", 2)]
    refs = {r["prompt_id"]: r for r in result["references"]}
    for c in cells:
        assert c["counts"] == {"ok": 4} and not c["time_limited"] and c["warmup_errors"] == 0 and c["token_counts"] == {"aligned": 4}
        assert c["tokens"] == sum(refs[r["prompt_id"]]["tokens"] for r in c["records"]) and c["tokens_per_second"] > 0
        for r in c["records"]:
            assert r["ttft"] > 0 and len(r["itl"]) <= r["tokens"] - 1 and r["stats"]["drafter"] == c["spec"].split(":")[0].replace("off", "none")
    assert result["problems"] == [] and servers["ngram:2"]["served_model"] == "stories260K"
    argv = servers["ngram:2"]["argv"]  # a loopback server on a free port, with the config's flags
    assert argv[:3] == ["-m", "mtpspec", "serve"] and argv[argv.index("--host") + 1] == "127.0.0.1" and int(argv[argv.index("--port") + 1]) > 0
    assert " ".join(argv).endswith("--drafter ngram --k 2 --max-batch 2 --prefix-cache 0 --threads 1")
    text = md.read_text()
    assert "| ngram:2 | 2 |" in text and "Every response checked: all ok." in text and "- [" not in text  # no C = 16: no targets
    assert text in capsys.readouterr().out and png.read_bytes()[:4] == b"\x89PNG"


def test_loadtest_against_llama_server(assets, tmp_path):
    """llama.cpp's llama-server as the peer (skipped without its binaries): the model exported as a GGUF, one slot per
    client, every request finished; on stories260K in fp32 its greedy text is ours."""
    from mtpspec.bench.llamacpp import find_binary

    try:
        find_binary("llama-server")
    except ConfigError as e:
        pytest.skip(str(e))
    out = tmp_path / "load.json"
    assert main(["loadtest", "--model", str(assets / "models" / "stories260K.bin"), "--concurrency", "1,2", "--spec", "off,llamacpp",
                 "--requests", "4", "--max-tokens", "16", "--prompts", "tinystories", "--threads", "1", "--out", str(out)]) == 0
    result = json.loads(out.read_text())
    peer = {c["concurrency"]: c for c in result["cells"] if c["spec"] == "llamacpp"}
    assert result["problems"] == [] and result["peer"]["gguf"] == str(tmp_path / "gguf" / "stories260K.gguf")
    assert all(sum(c["counts"].get(k, 0) for k in ("ok", "differs")) == 4 and c["token_counts"] == {"chunks": 4} for c in peer.values())
    argv = result["config"]["servers"]["llamacpp"]["argv"]
    assert argv[argv.index("-np") + 1] == "2" and argv[argv.index("-t") + 1] == "1"
    assert [v["concurrency"] for v in result["versus_peer"]] == [1, 2] and result["peer_consistency"][0]["total"] == 4

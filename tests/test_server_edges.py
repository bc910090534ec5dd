"""The server's edges, each as a client hits it on a real server (uvicorn on loopback): a dropped whole-answer
request is cancelled, streamed logprobs equal the whole answer's with a stop string, strict JSON types (null is
"not given"), 415 for a body that is not JSON, errors in the client's words, every status counted in /metrics, and
a queue bound that counts waiting requests only."""

from __future__ import annotations

import asyncio
import json
import socket
import threading
import time

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

from mtpspec.errors import ConfigError
from mtpspec.server.options import ServeOptions
from test_openai_server import PROMPTS, running, served  # noqa: F401 (served: the stories260K fixture, shared)

KEY = {"authorization": "Bearer sekret"}
JSON = {**KEY, "content-type": "application/json"}


@pytest.fixture(scope="module")
def server(served):
    with running(served, ServeOptions(drafter="ngram", k=3, max_batch=4, api_key="sekret")) as (url, app):
        yield url, app


def post(url: str, path: str, body, headers=JSON) -> httpx.Response:
    return httpx.post(url + path, content=json.dumps(body), headers=headers, timeout=60)


def test_a_dropped_whole_answer_request_is_cancelled(served):
    """A non-streaming request whose client hangs up is cancelled, though its chunks arrive every step (never a
    quiet moment to notice the disconnect in)."""
    with running(served, ServeOptions(drafter="none", max_batch=2)) as (url, app):
        sched = app.state.schedulers["stories"]
        engine, step, cancel = sched.engine, sched.engine.step, sched.engine.cancel
        cancelled = []
        engine.step = lambda: (time.sleep(0.02), step())[1]  # ~25 steps a second: ~500 tokens take 10 s
        engine.cancel = lambda sid: (cancelled.append(sid), cancel(sid))[1]
        body = json.dumps({"prompt": PROMPTS[0], "max_tokens": 100000, "temperature": 0.7, "seed": 0}).encode()
        host, port = url.removeprefix("http://").split(":")
        with socket.create_connection((host, int(port))) as s:
            s.sendall(b"POST /v1/completions HTTP/1.1\r\nhost: x\r\ncontent-type: application/json\r\n"
                      b"content-length: %d\r\n\r\n%s" % (len(body), body))
            for _ in range(200):
                if engine.running:
                    break
                time.sleep(0.01)
            time.sleep(0.5)
            assert len(engine.running) == 1  # still generating when the client goes
        gone = time.perf_counter()
        while (engine.running or sched.handles) and time.perf_counter() - gone < 5:
            time.sleep(0.02)
        assert not engine.running and not sched.handles and len(cancelled) == 1
        assert time.perf_counter() - gone < 5  # the whole answer would have taken ~10 s
        r = httpx.post(url + "/v1/completions", json={"prompt": PROMPTS[1], "max_tokens": 4, "temperature": 0}, timeout=30)
        assert r.status_code == 200


def _rows(lp: dict) -> list[tuple]:
    return list(zip(lp["tokens"], lp["token_logprobs"], lp["top_logprobs"], lp["text_offset"]))


def _stream(url: str, path: str, body: dict) -> list[dict]:
    with httpx.stream("POST", url + path, content=json.dumps({**body, "stream": True}), headers=JSON, timeout=60) as r:
        assert r.status_code == 200
        lines = [line[6:] for line in r.iter_lines() if line.startswith("data: ")]
    assert lines[-1] == "[DONE]"
    return [json.loads(x) for x in lines[:-1]]


def test_streamed_logprobs_equal_the_whole_answers_with_a_stop_string(server, stories):
    """Tokens of held-back text that turns out to be the stop string are never sent: the streamed rows are the
    whole answer's rows, exactly, for completions and chat."""
    url = server[0]
    ref = stories.generate(PROMPTS[0], max_new_tokens=60).text
    for stop in (ref[20:24], ref[21:27], [ref[30:33], "zzzz"]):
        body = {"prompt": PROMPTS[0], "max_tokens": 60, "temperature": 0, "logprobs": 2, "stop": stop}
        whole = post(url, "/v1/completions", body).json()["choices"][0]
        assert whole["finish_reason"] == "stop"
        chunks = _stream(url, "/v1/completions", body)
        streamed = [row for c in chunks for row in _rows(c["choices"][0]["logprobs"])]
        assert "".join(c["choices"][0]["text"] for c in chunks) == whole["text"]
        assert streamed == _rows(whole["logprobs"]), stop
    chat = {"messages": [{"role": "user", "content": "Tell a story"}], "max_tokens": 40, "temperature": 0,
            "logprobs": True, "top_logprobs": 2}
    text = post(url, "/v1/chat/completions", chat).json()["choices"][0]["message"]["content"]
    chat["stop"] = text[10:14]
    whole = post(url, "/v1/chat/completions", chat).json()["choices"][0]
    streamed = [row for c in _stream(url, "/v1/chat/completions", chat)[1:] if c["choices"] and c["choices"][0]["logprobs"]
                for row in c["choices"][0]["logprobs"]["content"]]
    assert whole["finish_reason"] == "stop" and streamed == whole["logprobs"]["content"]


WRONG_TYPES = [
    ({"max_tokens": "8"}, "max_tokens"),
    ({"max_tokens": True}, "max_tokens"),
    ({"max_tokens": 8.0}, "max_tokens"),
    ({"temperature": "0"}, "temperature"),
    ({"stream": "true"}, "stream"),
    ({"stream": 1}, "stream"),
    ({"prompt": [True]}, "prompt"),
    ({"prompt": [1, "a"]}, "prompt"),
    ({"model": None}, "model"),
    ({"prompt": None}, "prompt"),
    ({"seed": "7"}, "seed"),
    ({"logprobs": True}, "logprobs"),
    ({"stop": 5}, "stop"),
    ({"stream_options": {"include_usage": True}}, "stream_options"),  # without stream
    ({"stream": False, "stream_options": {"include_usage": True}}, "stream_options"),
    ({"stream": True, "stream_options": {"include_usage": 1}}, "stream_options"),
]


@pytest.mark.parametrize("extra, param", WRONG_TYPES, ids=[f"{i}-{p}" for i, (_, p) in enumerate(WRONG_TYPES)])
def test_wrong_json_types_are_400_naming_the_field(server, extra, param):
    r = post(server[0], "/v1/completions", {"prompt": "Once", "max_tokens": 4, **extra})
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["param"] == param and err["message"].startswith(param), err
    assert err["type"] == "invalid_request_error" and err["code"] == "400"


def test_null_is_not_given(server, stories):
    nulls = {k: None for k in ("temperature", "top_p", "top_k", "n", "stream", "stream_options", "stop", "stop_token_ids",
                               "seed", "presence_penalty", "frequency_penalty", "logit_bias", "user", "logprobs", "echo",
                               "best_of", "suffix")}
    r = post(server[0], "/v1/completions", {"prompt": PROMPTS[1], "max_tokens": 6, **nulls, "temperature": 0})
    assert r.status_code == 200, r.text
    assert r.json()["choices"][0]["text"] == stories.generate(PROMPTS[1], max_new_tokens=6).text
    r = post(server[0], "/v1/completions", {"prompt": PROMPTS[1], "max_tokens": None, **{**nulls, "temperature": 0}})
    assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] >= 1
    chat = {"messages": [{"role": "user", "content": "Hi"}], "max_tokens": 3, "max_completion_tokens": None,
            "logprobs": None, "top_logprobs": None, "temperature": None}
    assert post(server[0], "/v1/chat/completions", chat).status_code == 200


@pytest.mark.parametrize("headers, body", [
    ({"content-type": "text/plain"}, b'{"prompt": "Once", "max_tokens": 2}'),
    ({"content-type": "application/x-www-form-urlencoded"}, b'{"prompt": "Once", "max_tokens": 2}'),  # curl -d
    ({}, b'{"prompt": "Once", "max_tokens": 2}'),
    ({"content-type": "multipart/form-data; boundary=x"}, b"--x--"),
])
def test_a_body_that_is_not_json_is_415(server, headers, body):
    for path in ("/v1/completions", "/v1/chat/completions", "/api/verify"):
        r = httpx.post(server[0] + path, content=body, headers={**KEY, **headers})
        assert r.status_code == 415, r.text
        err = r.json()["error"]
        assert set(err) == {"message", "type", "param", "code"} and err["code"] == "415"
        assert "application/json" in err["message"] and err["type"] == "invalid_request_error"


def test_json_with_a_charset_is_json(server):
    r = httpx.post(server[0] + "/v1/completions", content=b'{"prompt": "Once", "max_tokens": 2}',
                   headers={**KEY, "content-type": "Application/JSON; charset=utf-8"})
    assert r.status_code == 200, r.text


PLAIN = [
    ("/v1/completions", {"prompt": "\ud800 x"}, "prompt", "prompt: not valid Unicode text (a lone surrogate)"),
    ("/v1/completions", {"prompt": [True]}, "prompt", "prompt: must be a string, a list of token ids"),
    ("/v1/completions", {"prompt": "x", "frequency_penalty": 2.5}, "frequency_penalty",
     "frequency_penalty: must be a number in [-2, 2], got 2.5"),
    ("/v1/completions", {"prompt": "x", "presence_penalty": -3}, "presence_penalty", "presence_penalty: must be a number in [-2, 2], got -3"),
    ("/v1/completions", {"prompt": "x", "presence_penalty": "1"}, "presence_penalty", "presence_penalty: must be a number in [-2, 2]"),
    ("/v1/completions", {"prompt": "x", "logit_bias": {"5": 500}}, "logit_bias",
     "logit_bias: the bias of token 5 must be a number in [-100, 100], got 500"),
    ("/v1/completions", {"prompt": "x", "logit_bias": {"5": float("nan")}}, "logit_bias",
     "logit_bias: the bias of token 5 must be a number in [-100, 100], got nan"),
    ("/v1/completions", {"prompt": "x", "logit_bias": [5]}, "logit_bias", 'logit_bias: must be an object {"token id": bias}'),
    ("/v1/completions", {"prompt": "x", "logit_bias": {"five": 1}}, "logit_bias",
     "logit_bias: key 'five' is not a token id in the vocabulary [0, 512)"),
    ("/v1/completions", {"prompt": "x", "logit_bias": {"512": 1}}, "logit_bias",
     "logit_bias: key '512' is not a token id in the vocabulary [0, 512)"),
    ("/v1/completions", {"prompt": "x", "min_p": 1.5}, "min_p", "min_p: must be a number in [0, 1], got 1.5"),
    ("/v1/completions", {"prompt": "x", "repetition_penalty": 0}, "repetition_penalty",
     "repetition_penalty: must be a finite number > 0 (1: off), got 0"),
    ("/v1/completions", {"prompt": "x", "min_tokens": -1}, "min_tokens", "min_tokens: must be an integer >= 0, got -1"),
    ("/v1/completions", {"prompt": "x", "min_tokens": 9, "max_tokens": 4}, "min_tokens",
     "min_tokens: 9 is more than the max_tokens asked for (4)"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "x"}], "min_tokens": 1.5}, "min_tokens",
     "min_tokens: must be an integer >= 0, got 1.5"),
    ("/v1/completions", {"prompt": "x", "n": 5}, "n", "n: 5 choices; the server runs at most 4 sequences together (its --max-batch)"),
    ("/v1/completions", {"prompt": "x", "n": 1.0}, "n", "n: must be an integer >= 1 (and at most the server's --max-batch), got 1.0"),
    ("/v1/completions", {"prompt": "x", "echo": 1}, "echo", "echo: must be true or false, got 1"),
    ("/v1/completions", {"prompt": "x", "mtpspec": {"speculation": 4.5}}, "mtpspec",
     'mtpspec: speculation must be "off", "auto" or a draft depth D (an integer >= 1), got 4.5'),
    ("/v1/completions", {"prompt": "x", "temperature": 3}, "temperature", "temperature: must be a number in [0, 2], got 3"),
    ("/v1/completions", {"prompt": "x", "max_tokens": "8"}, "max_tokens", 'max_tokens: must be an integer >= 1, got "8"'),
    ("/v1/completions", {"prompt": "x", "stop": ["a", ""]}, "stop", "stop: must be a non-empty string"),
    ("/v1/completions", {"prompt": "x", "max_token": 5}, "max_token", "max_token: unknown parameter"),
    ("/v1/completions", b'{"prompt": "x",}', None, "body: invalid JSON"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "x"}, {"role": "wizard", "content": "y"}]}, "messages",
     "messages: [1].role must be one of system, user, assistant, tool, developer"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "\udfff"}]}, "messages",
     "messages: [0].content not valid Unicode text"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "x"}], "logprobs": 2}, "logprobs",
     "logprobs: must be true or false, got 2"),
]


@pytest.mark.parametrize("path, body, param, message", PLAIN, ids=[f"{i}-{p}" for i, (_, _, p, _) in enumerate(PLAIN)])
def test_errors_speak_the_clients_words(server, path, body, param, message):
    content = body if isinstance(body, bytes) else json.dumps(body)
    r = httpx.post(server[0] + path, content=content, headers=JSON)
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["param"] == param and err["message"].startswith(message), err
    for library in ("function-after", "unicode_text", "should be", "Input should", "items", "constrained", "list[int]"):
        assert library not in err["message"], err


CONTROLS = [  # the sampling controls: a greedy answer is plain greedy's under them (the server drafts with ngram, k=3)
    {"frequency_penalty": 1.5}, {"presence_penalty": 2}, {"repetition_penalty": 1.6}, {"min_p": 0.2},
    {"logit_bias": {"5": 100}}, {"logit_bias": {"444": -100, "335": 8.5}}, {"min_tokens": 40, "frequency_penalty": -1},
]


@pytest.mark.parametrize("fields", CONTROLS, ids=[",".join(c) for c in CONTROLS])
def test_sampling_controls_are_plain_greedys(server, stories, fields):
    kw = {k: ({int(t): b for t, b in v.items()} if k == "logit_bias" else v) for k, v in fields.items()}
    want = stories.generate(PROMPTS[1], max_new_tokens=40, **kw)
    r = post(server[0], "/v1/completions", {"prompt": PROMPTS[1], "max_tokens": 40, "temperature": 0, **fields})
    assert r.status_code == 200, r.text
    assert r.json()["choices"][0]["text"] == want.text
    assert want.tokens != stories.generate(PROMPTS[1], max_new_tokens=40).tokens or "min_p" in fields  # the control acted
    if "logit_bias" in fields and fields["logit_bias"].get("5") == 100:
        assert set(want.tokens) == {5}


def test_sampling_controls_in_a_chat_and_sampled(server):
    chat = {"messages": [{"role": "user", "content": "Hi"}], "max_tokens": 8, "temperature": 0.8, "seed": 3,
            "frequency_penalty": 0.5, "presence_penalty": -0.5, "logit_bias": {"7": -2}, "min_p": 0.05,
            "repetition_penalty": 1.2, "min_tokens": 2}
    r = post(server[0], "/v1/chat/completions", chat)
    assert r.status_code == 200, r.text
    assert r.json()["usage"]["completion_tokens"] >= 2
    assert post(server[0], "/v1/chat/completions", chat).json()["choices"] == r.json()["choices"]  # seeded: reproducible


def _requests_counted(url: str) -> dict[str, float]:
    text = httpx.get(url + "/metrics", headers=KEY).text
    fam = next(f for f in text_string_to_metric_families(text) if f.name == "mtpspec_requests")
    out: dict[str, float] = {}
    for s in fam.samples:
        if s.name.endswith("_total"):
            out[s.labels["status"]] = out.get(s.labels["status"], 0) + s.value
    return out


def test_metrics_count_every_status(server):
    url = server[0]
    before = _requests_counted(url)
    assert httpx.post(url + "/v1/completions", json={"prompt": "x"}).status_code == 401
    assert httpx.post(url + "/v1/completions", content=b"x" * (2 << 20), headers=JSON).status_code == 413
    assert httpx.post(url + "/v1/completions", content=b"{}", headers={**KEY, "content-type": "text/plain"}).status_code == 415
    assert post(url, "/v1/completions", {"prompt": "x", "n": 99}).status_code == 400
    assert httpx.get(url + "/v1/nothing", headers=KEY).status_code == 404
    after = _requests_counted(url)
    for status in ("401", "413", "415", "400", "404"):
        assert after.get(status, 0) - before.get(status, 0) == 1, (status, before, after)


def test_the_queue_counts_waiting_requests_only(served):
    """--max-batch 2 --max-queue 2, 8 requests at once: 2 take the free slots, 2 wait, 4 are 429 (the engine held
    still while they arrive, so nothing finishes early and the split is exact)."""
    with running(served, ServeOptions(drafter="none", max_batch=2, max_queue=2)) as (url, app):
        sched = app.state.schedulers["stories"]
        gate = threading.Event()
        held = sched.run_job(lambda: gate.wait(60))  # the engine thread waits here: no request is taken in or answered

        async def main():
            async with httpx.AsyncClient(base_url=url, timeout=60) as ac:
                tasks = [asyncio.create_task(ac.post("/v1/completions", json={"prompt": p, "max_tokens": 6, "temperature": 0}))
                         for p in PROMPTS[:8]]
                for _ in range(600):
                    if sum(t.done() for t in tasks) >= 4:
                        break
                    await asyncio.sleep(0.05)
                early = sorted(t.result().status_code for t in tasks if t.done())
                assert sched.queue_length() == 2
                gate.set()
                return early, await asyncio.gather(*tasks)

        try:
            early, rs = asyncio.run(main())
        finally:
            gate.set()
        held.result(timeout=10)
    assert early == [429] * 4
    assert sorted(r.status_code for r in rs) == [200] * 4 + [429] * 4
    assert all(r.json()["usage"]["completion_tokens"] == 6 for r in rs if r.status_code == 200)


@pytest.mark.parametrize("bad", [-1, 1.5, True, "8"])
def test_the_prefix_cache_option_is_checked(bad):
    with pytest.raises(ConfigError, match=r"--prefix-cache must be an integer >= 0, got "):
        ServeOptions(prefix_cache=bad)

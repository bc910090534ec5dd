"""The OpenAI-compatible API on a real server (uvicorn on loopback), driven by the `openai` client library.

Greedy output equals `Model.generate` (what `mtpspec generate` runs) whatever shares the batch; every bad
request is a 4xx JSON error in OpenAI's shape; a client that goes away frees its slot.
"""

from __future__ import annotations

import asyncio
import json
import math
import threading
import time
from contextlib import contextmanager

import httpx
import openai
import pytest
import torch
import uvicorn

from mtpspec.errors import ConfigError
from mtpspec.server import create_app
from mtpspec.server.cli import _listen
from mtpspec.server.options import ServeOptions
from mtpspec.server.registry import load_served

PROMPTS = ["Once upon a time, there was a little girl named Lily. She loved to", "One day, a big dog", "The sun was hot and",
           "Tom and his mom went to the park.", "Once upon a time", "The little bird", "Sam had a red ball.",
           "There was a tree", "Mia wanted to play", "The cat sat", "It was a rainy day.", "Ben liked cake",
           "A boy found a box", "The girl saw a star", "Lucy and Tim", "The fish swam"]


@contextmanager
def running(served, options: ServeOptions):
    """A real server on 127.0.0.1 (any free port) in a thread; stopped at the end."""
    app = create_app(served, options)
    sock = _listen("127.0.0.1", 0)
    server = uvicorn.Server(uvicorn.Config(app, log_level="warning"))
    thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, daemon=True)
    thread.start()
    while not server.started:
        time.sleep(0.01)
    try:
        yield f"http://127.0.0.1:{sock.getsockname()[1]}", app
    finally:
        server.should_exit = True
        thread.join(timeout=10)


@pytest.fixture(scope="module")
def served(assets):
    return load_served([f"stories={assets / 'models' / 'stories260K.bin'}"])


@pytest.fixture(scope="module")
def server(served):
    with running(served, ServeOptions(drafter="ngram", k=3, max_batch=8, api_key="sekret")) as (url, app):
        yield url, app


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=server[0] + "/v1", api_key="sekret", max_retries=0)


def plain(model, prompt, n):
    return model.generate(prompt, max_new_tokens=n)


def test_completion_equals_generate(client, stories):
    r = client.completions.create(model="stories", prompt=PROMPTS[0], max_tokens=40, temperature=0)
    ref = plain(stories, PROMPTS[0], 40)
    assert r.choices[0].text == ref.text and r.choices[0].finish_reason == "length"
    assert r.usage.completion_tokens == 40 and r.usage.prompt_tokens == len(ref.prompt_tokens)
    stats = r.model_extra["mtpspec"]
    assert stats["drafter"] == "ngram" and stats["k"] == 3 and stats["target_forwards"] <= 40
    assert stats["accepted"] == 40 - stats["target_forwards"]  # every forward emits its accepted drafts + one


def test_token_id_prompt_and_models(client, stories):
    ids = stories.encode(PROMPTS[1])
    r = client.completions.create(model="stories", prompt=ids, max_tokens=12, temperature=0)
    assert r.choices[0].text == plain(stories, PROMPTS[1], 12).text
    models = client.models.list()
    assert [m.id for m in models.data] == ["stories"]


def test_streaming_equals_the_whole_answer(client, stories):
    chunks = list(client.completions.create(model="stories", prompt=PROMPTS[2], max_tokens=30, temperature=0, stream=True))
    text = "".join(c.choices[0].text for c in chunks if c.choices)
    assert text == plain(stories, PROMPTS[2], 30).text
    assert chunks[-1].choices[0].finish_reason == "length" and all(c.choices[0].finish_reason is None for c in chunks[:-1])
    chat = list(client.chat.completions.create(model="stories", messages=[{"role": "user", "content": "Tell a story"}],
                                               max_tokens=20, temperature=0, stream=True, stream_options={"include_usage": True}))
    assert chat[0].choices[0].delta.role == "assistant" and chat[-1].usage.completion_tokens == 20 and not chat[-1].choices
    whole = client.chat.completions.create(model="stories", messages=[{"role": "user", "content": "Tell a story"}],
                                           max_tokens=20, temperature=0)
    assert "".join(c.choices[0].delta.content or "" for c in chat if c.choices) == whole.choices[0].message.content


def test_chat_uses_the_template_and_equals_generate(client, stories):
    from mtpspec.chat import ChatTemplate

    messages = [{"role": "system", "content": "You tell stories."}, {"role": "user", "content": "A story about a cat"}]
    r = client.chat.completions.create(model="stories", messages=messages, max_tokens=24, temperature=0)
    ids = ChatTemplate.for_tokenizer(stories.tokenizer).prompt_ids(stories, messages)
    assert r.choices[0].message.content == plain(stories, ids, 24).text and r.choices[0].message.role == "assistant"


def test_stop_strings_and_token_ids(client, stories):
    ref = plain(stories, PROMPTS[0], 60).text
    stop = ref[20:24]
    r = client.completions.create(model="stories", prompt=PROMPTS[0], max_tokens=60, temperature=0, stop=[stop, "zzzz"])
    assert r.choices[0].text == ref[: ref.index(stop)] and r.choices[0].finish_reason == "stop"
    streamed = "".join(c.choices[0].text for c in client.completions.create(
        model="stories", prompt=PROMPTS[0], max_tokens=60, temperature=0, stop=stop, stream=True) if c.choices)
    assert streamed == ref[: ref.index(stop)]
    toks = plain(stories, PROMPTS[0], 60).tokens
    r = client.completions.create(model="stories", prompt=PROMPTS[0], max_tokens=60, temperature=0,
                                  extra_body={"stop_token_ids": [toks[7]]})
    cut = toks.index(toks[7])
    assert r.choices[0].finish_reason == "stop" and r.usage.completion_tokens == cut


def test_seeded_sampling_repeats(client):
    kw = dict(model="stories", prompt=PROMPTS[3], max_tokens=30, temperature=0.9, top_p=0.95)
    a = client.completions.create(seed=7, **kw).choices[0].text
    b = client.completions.create(seed=7, **kw).choices[0].text
    c = [client.completions.create(seed=s, **kw).choices[0].text for s in (8, 9, 10)]
    assert a == b and any(x != a for x in c)


def test_logprobs_are_the_targets(client, stories):
    r = client.completions.create(model="stories", prompt=PROMPTS[4], max_tokens=10, temperature=0, logprobs=3)
    lp = r.choices[0].logprobs
    ids = stories.encode(PROMPTS[4]) + plain(stories, PROMPTS[4], 10).tokens
    cache = stories.module.new_cache()
    with torch.inference_mode():
        logits = stories.module.forward_tokens(torch.tensor(ids[:-1]), cache).logits.double()  # (n-1, V)
    ref = torch.log_softmax(logits, -1)[len(ids) - 11:]  # the 10 generated positions
    want = ref[torch.arange(10), torch.tensor(ids[-10:])].tolist()
    # a verify pass computes a position as a batched forward does: fp32 rounding, log p of order 1 -> 1e-4 is ample
    assert all(math.isclose(a, b, abs_tol=1e-4) for a, b in zip(lp.token_logprobs, want))
    assert "".join(lp.tokens) == r.choices[0].text and len(lp.top_logprobs) == 10
    assert all(max(t.values()) == pytest.approx(v, abs=1e-6) for t, v in zip(lp.top_logprobs, lp.token_logprobs))  # greedy: top-1
    chat = client.chat.completions.create(model="stories", messages=[{"role": "user", "content": "Hi"}], max_tokens=5,
                                          temperature=0, logprobs=True, top_logprobs=2)
    content = chat.choices[0].logprobs.content
    assert len(content) == 5 and all(len(c.top_logprobs) == 2 and c.bytes == list(c.token.encode()) for c in content)


def test_16_concurrent_greedy_requests_equal_separate_runs(client, stories):
    async def one(ac, prompt):
        r = await ac.completions.create(model="stories", prompt=prompt, max_tokens=32, temperature=0)
        return r.choices[0].text

    async def main():
        ac = openai.AsyncOpenAI(base_url=client.base_url, api_key="sekret", max_retries=0)
        return await asyncio.gather(*(one(ac, p) for p in PROMPTS))

    got = asyncio.run(main())
    assert got == [plain(stories, p, 32).text for p in PROMPTS]


def greedy_together(url: str, prompts: list[str], max_tokens: int) -> list[dict]:
    """Greedy completions of every prompt, sent at once (they share the server's batch)."""
    async def main():
        async with httpx.AsyncClient(base_url=url, timeout=120) as ac:
            rs = await asyncio.gather(*(ac.post("/v1/completions", json={"prompt": p, "max_tokens": max_tokens, "temperature": 0})
                                        for p in prompts))
        return [r.json() for r in rs]

    return asyncio.run(main())


def test_demo_mtp_auto_batch_equals_separate_runs():
    import mtpspec

    served = load_served(["demo"])
    demo = served.models["demo"]
    prompts = ["def add(a, b):\n", "import os\n", "class Stack:\n", "def fib(n):\n    ", "for i in range(10):\n", "# sort a list\n"]
    with running(served, ServeOptions(max_batch=4)) as (url, app):
        assert app.state.schedulers["demo"].spec.describe() == {"drafter": "mtp", "k": "auto"}
        got = greedy_together(url, prompts, 24)
    assert [g["choices"][0]["text"] for g in got] == [demo.generate(p, max_new_tokens=24).text for p in prompts]
    assert sum(g["mtpspec"]["accepted"] for g in got) > 0 and isinstance(mtpspec.load, object)


def test_demo_mtp_lookup_equals_generate():
    """--mtp-lookup: the server's MTP drafter takes the prompt-lookup shortcut; greedy output is still generate's."""
    served = load_served(["demo"])
    demo = served.models["demo"]
    prompts = ["def add(a, b):\n    return a + b\n\n\ndef sub(a, b):\n    return a - b\n\n\ndef mul(a, b):\n",
               "import os\n", "class Stack:\n    def push(self, x):\n        self.items.append(x)\n\n    def pop(self):\n"]
    with running(served, ServeOptions(max_batch=4, mtp_lookup=4)) as (url, app):
        assert app.state.schedulers["demo"].spec.describe() == {"drafter": "mtp", "k": "auto", "mtp_lookup": 4}
        got = greedy_together(url, prompts, 32)
    assert [g["choices"][0]["text"] for g in got] == [demo.generate(p, max_new_tokens=32).text for p in prompts]
    with pytest.raises(ConfigError, match="N >= 2"):
        ServeOptions(mtp_lookup=1)
    with pytest.raises(ConfigError, match="--mtp-lookup is an option of --drafter mtp"):
        create_app(served, ServeOptions(drafter="ngram", mtp_lookup=4))


BAD = [
    ({"prompt": "x", "model": "/etc/passwd"}, 404, "model"),
    ({"prompt": "x", "model": "../../etc/passwd"}, 404, "model"),
    ({"prompt": "\ud800 lone"}, 400, "prompt"),
    ({"prompt": "x", "n": 9}, 400, "n"),
    ({"prompt": "x", "best_of": 2}, 400, "best_of"),
    ({"prompt": "x", "temperature": -1}, 400, "temperature"),
    ({"prompt": "x", "temperature": "hot"}, 400, "temperature"),
    ({"prompt": "x", "max_tokens": 0}, 400, "max_tokens"),
    ({"prompt": "x", "top_p": 0}, 400, "top_p"),
    ({"prompt": "x", "max_token": 5}, 400, "max_token"),
    ({"prompt": "x", "stop": [""]}, 400, "stop"),
    ({"prompt": "x", "logprobs": 99}, 400, "logprobs"),
    ({"prompt": "x", "echo": "yes"}, 400, "echo"),
    ({"prompt": "x", "mtpspec": {"speculation": "fast"}}, 400, "mtpspec"),
    ({"prompt": "x", "presence_penalty": 2.5}, 400, "presence_penalty"),
    ({"prompt": "x", "stop_token_ids": [99999]}, 400, "stop_token_ids"),
    ({"prompt": [1, 99999]}, 400, "prompt"),
    ({"prompt": []}, 400, "prompt"),
    ({"prompt": "Once " * 600}, 400, "prompt"),
    ({}, 400, "prompt"),
]


@pytest.mark.parametrize("body,status,param", BAD)
def test_bad_completion_requests_are_openai_errors(server, body, status, param):
    r = httpx.post(server[0] + "/v1/completions", content=json.dumps(body),  # ASCII JSON: a lone surrogate as "\ud800"
                   headers={"authorization": "Bearer sekret", "content-type": "application/json"})
    assert r.status_code == status, r.text
    err = r.json()["error"]
    assert set(err) == {"message", "type", "param", "code"} and err["param"].startswith(param)
    assert "Traceback" not in r.text and "root:" not in r.text


def test_bad_chat_requests_and_raw_bodies(server):
    url, h = server[0], {"authorization": "Bearer sekret"}
    for body, param in [({"messages": []}, "messages"), ({"messages": [{"role": "wizard", "content": "x"}]}, "messages"),
                        ({"messages": [{"role": "user", "content": "x\udfff"}]}, "messages"),
                        ({"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "file:///etc/passwd"}}]}]}, "messages"),
                        ({"messages": [{"role": "user", "content": "x"}], "top_logprobs": 2}, "top_logprobs")]:
        r = httpx.post(url + "/v1/chat/completions", content=json.dumps(body), headers={**h, "content-type": "application/json"})
        assert r.status_code == 400 and r.json()["error"]["param"].startswith(param), r.text
        assert "root:" not in r.text
    raw = httpx.post(url + "/v1/completions", content=b'{"prompt": "x"', headers={**h, "content-type": "application/json"})
    assert raw.status_code == 400 and "invalid JSON" in raw.json()["error"]["message"]
    big = httpx.post(url + "/v1/completions", content=b"x" * (2 << 20), headers=h)
    assert big.status_code == 413 and big.json()["error"]["type"] == "invalid_request_error"
    assert httpx.get(url + "/v1/nothing", headers=h).status_code == 404


def test_api_key_on_every_endpoint(server):
    url = server[0]
    for method, path in [("GET", "/health"), ("GET", "/metrics"), ("GET", "/v1/models"), ("POST", "/v1/completions"),
                         ("GET", "/api/models"), ("POST", "/api/verify")]:
        for headers in ({}, {"authorization": "Bearer wrong"}, {"authorization": "sekret"}):
            r = httpx.request(method, url + path, json={"prompt": "x"}, headers=headers)
            assert r.status_code == 401 and r.json()["error"]["type"] == "authentication_error", (path, headers)
    assert httpx.get(url + "/").status_code == 200  # the static page holds no data; its API calls send the key
    assert httpx.get(url + "/health", headers={"authorization": "Bearer sekret"}).json()["status"] == "ok"


def test_a_full_queue_answers_429_with_retry_after(served):
    with running(served, ServeOptions(drafter="none", max_batch=1, max_queue=1)) as (url, app):
        async def main():
            async with httpx.AsyncClient(base_url=url, timeout=60) as ac:
                return await asyncio.gather(*(ac.post("/v1/completions", json={"prompt": p, "max_tokens": 200, "temperature": 0})
                                              for p in PROMPTS[:6]))

        rs = asyncio.run(main())
    codes = sorted(r.status_code for r in rs)
    assert codes.count(200) >= 1 and 429 in codes and set(codes) <= {200, 429}
    assert all(r.json()["usage"]["completion_tokens"] == 200 for r in rs if r.status_code == 200)  # the admitted ones finish
    busy = next(r for r in rs if r.status_code == 429)
    assert busy.headers["retry-after"] == "1" and busy.json()["error"]["type"] == "rate_limit_error"


def test_a_disconnect_mid_stream_frees_the_slot(served):
    with running(served, ServeOptions(drafter="ngram", k=2, max_batch=2)) as (url, app):
        sched = app.state.schedulers["stories"]
        with httpx.Client(base_url=url, timeout=30) as c:
            with c.stream("POST", "/v1/completions", json={"prompt": PROMPTS[0], "max_tokens": 100000, "temperature": 0.7, "seed": 0,
                                                            "stream": True}) as r:
                first = next(r.iter_lines())
                assert first.startswith("data: ") and json.loads(first[6:])["object"] == "text_completion"
                assert len(sched.engine.running) == 1
        for _ in range(200):  # the stream was closed: the sequence must be cancelled within a few steps
            if not sched.engine.running and not sched.handles:
                break
            time.sleep(0.05)
        assert not sched.engine.running and not sched.handles
        r = httpx.post(url + "/v1/completions", json={"prompt": PROMPTS[1], "max_tokens": 8, "temperature": 0})
        assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 8
        metrics = httpx.get(url + "/metrics").text
    assert "mtpspec_requests_total" in metrics


def test_metrics_count_tokens_and_acceptance(server, client):
    client.completions.create(model="stories", prompt=PROMPTS[0], max_tokens=20, temperature=0)
    from prometheus_client.parser import text_string_to_metric_families

    text = httpx.get(server[0] + "/metrics", headers={"authorization": "Bearer sekret"}).text
    fams = {f.name: f for f in text_string_to_metric_families(text)}
    value = lambda name: sum(s.value for s in fams[name].samples if s.name.endswith("_total"))  # noqa: E731
    assert value("mtpspec_generated_tokens") >= 20 and value("mtpspec_requests") >= 1
    names = set(fams)
    for want in ("mtpspec_draft_tokens", "mtpspec_accepted_tokens", "mtpspec_drafted_by_position", "mtpspec_batch_size",
                 "mtpspec_queue_length", "mtpspec_running", "mtpspec_time_to_first_token_seconds", "mtpspec_inter_token_latency_seconds"):
        assert any(n.startswith(want) for n in names), (want, sorted(names))


def test_an_engine_failure_is_a_500_and_the_next_request_is_served(served):
    with running(served, ServeOptions(drafter="none", max_batch=2)) as (url, app):
        sched = app.state.schedulers["stories"]
        broken = sched.engine

        def boom():
            raise RuntimeError("a bug in a step")

        broken.step = boom  # this engine fails its next step; the scheduler replaces it
        r = httpx.post(url + "/v1/completions", json={"prompt": PROMPTS[0], "max_tokens": 8, "temperature": 0}, timeout=30)
        assert r.status_code == 500 and r.json()["error"]["type"] == "server_error" and "a bug in a step" in r.json()["error"]["message"]
        assert sched.engine is not broken
        r = httpx.post(url + "/v1/completions", json={"prompt": PROMPTS[0], "max_tokens": 8, "temperature": 0}, timeout=30)
        assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 8

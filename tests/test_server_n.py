"""n choices, echo and speculation chosen per request, on a real server (uvicorn on loopback) over the demo model.

n choices share one prefill (the engine copies the prompt's cache to each choice's sequence); greedy choices are
plain greedy's, seeded choice i is the n = 1 answer with seed + i; usage counts the prompt once. echo puts the prompt
(and with logprobs its tokens' log p, from the prefill) in front of each choice. A request's `mtpspec.speculation`
("off", a depth D, "auto") keeps greedy text identical to plain decoding, in one batch with other choices, and the
response's `mtpspec` block reports it. Bad values are 400s in OpenAI's error shape.
"""

from __future__ import annotations

import asyncio
import json
import math

import httpx
import pytest
import torch

from mtpspec.drafters import make_drafter
from mtpspec.engine import Engine
from mtpspec.sampling import Sampler, SamplingParams
from mtpspec.server.options import ServeOptions
from mtpspec.server.registry import load_served
from mtpspec.server.scheduler import choice_seed
from test_openai_server import running

MAX_BATCH = 4
PROMPT = "def add(a, b):\n"


@pytest.fixture(scope="module")
def demo_served():
    return load_served(["demo"])


@pytest.fixture(scope="module")
def demo(demo_served):
    return demo_served.models["demo"]


@pytest.fixture(scope="module")
def url(demo_served):
    with running(demo_served, ServeOptions(max_batch=MAX_BATCH)) as (url, app):  # the demo's MTP head, --k auto
        yield url


def post(url: str, body: dict, path: str = "/v1/completions") -> httpx.Response:
    return httpx.post(url + path, content=json.dumps(body), headers={"content-type": "application/json"}, timeout=120)


def ok(url: str, body: dict, path: str = "/v1/completions") -> dict:
    r = post(url, body, path)
    assert r.status_code == 200, r.text
    return r.json()


def stream(url: str, body: dict, path: str = "/v1/completions") -> list[dict]:
    with httpx.Client(timeout=120) as c, c.stream("POST", url + path, json={**body, "stream": True}) as r:
        assert r.status_code == 200
        lines = [ln[6:] for ln in r.iter_lines() if ln.startswith("data: ")]
    assert lines[-1] == "[DONE]"
    return [json.loads(x) for x in lines[:-1]]


def test_copies_of_one_prefill_equal_separate_prefills(demo, monkeypatch):
    """The engine: sequences added with prefill_from take the first one's prefilled cache (a hybrid's recurrent state
    too) and decode as a prefill of their own would; if the first leaves before its prefill ends, the next prefills."""
    ids = demo.encode(PROMPT)
    prefills = []
    forward = demo.module.forward_tokens

    def counted(tokens, cache, *args, **kw):
        if kw.get("prefill"):
            prefills.append(tokens.shape[0])
        return forward(tokens, cache, *args, **kw)

    monkeypatch.setattr(demo.module, "forward_tokens", counted)

    def run(copy: bool, cancel_first: bool = False) -> list[list[int]]:
        prefills.clear()
        engine = Engine(demo.module, 3, prefill_chunk=4)  # chunks: the first prefill takes several steps
        sids = []
        for i in range(3):
            sids.append(engine.add(ids, make_drafter("mtp", demo.module), Sampler(SamplingParams(temperature=0.0), i), 3, 12,
                                   prefill_from=sids[0] if copy and i else None))
        if cancel_first:
            engine.step()
            engine.cancel(sids[0])
        out = engine.run()
        return [out[s].tokens for s in sids]

    alone = demo.generate(PROMPT, max_new_tokens=12).tokens
    assert run(copy=False) == [alone] * 3 and sum(prefills) == 3 * (len(ids) - 1)
    assert run(copy=True) == [alone] * 3 and sum(prefills) == len(ids) - 1  # one prefill for the three
    got = run(copy=True, cancel_first=True)  # the first leaves half-way: the second prefills, the third copies it
    assert got[1:] == [alone] * 2 and got[0] == [] and sum(prefills) == 4 + len(ids) - 1


def test_n_greedy_choices_equal_one_and_plain(url, demo):
    one = ok(url, {"prompt": PROMPT, "max_tokens": 16, "temperature": 0})
    three = ok(url, {"prompt": PROMPT, "max_tokens": 16, "temperature": 0, "n": 3, "best_of": 3})
    want = demo.generate(PROMPT, max_new_tokens=16).text
    assert one["choices"][0]["text"] == want
    assert [c["index"] for c in three["choices"]] == [0, 1, 2] and all(c["text"] == want for c in three["choices"])
    usage = three["usage"]
    assert usage["prompt_tokens"] == one["usage"]["prompt_tokens"] == len(demo.encode(PROMPT))
    assert usage["completion_tokens"] == 3 * 16 and usage["total_tokens"] == usage["prompt_tokens"] + 48
    stats = three["mtpspec"]
    assert [c["index"] for c in stats["choices"]] == [0, 1, 2] and stats["speculation"] == "auto"
    assert stats["target_forwards"] == sum(c["target_forwards"] for c in stats["choices"])


def test_n_seeded_choices_are_seed_plus_i(url):
    body = {"prompt": PROMPT, "max_tokens": 16, "temperature": 0.9, "top_p": 0.95, "seed": 2**63 - 2,
            "mtpspec": {"speculation": 2}}
    three = [c["text"] for c in ok(url, {**body, "n": 3})["choices"]]
    assert three == [c["text"] for c in ok(url, {**body, "n": 3})["choices"]]  # reproducible
    assert [choice_seed(body["seed"], i) for i in range(3)] == [2**63 - 2, 2**63 - 1, 0]  # wraps into [0, 2**63)
    alone = [ok(url, {**body, "seed": choice_seed(body["seed"], i)})["choices"][0]["text"] for i in range(3)]
    assert three == alone and len(set(three)) > 1  # independent samples


def test_a_seeded_request_is_one_text_whatever_speculates(url, demo):
    """Seeded sampling defaults to Gumbel-max: the same text with speculation off, at D = 1 and 3, and auto, equal to
    the library's plain sampling with that seed; `sampler: "rejection"` is the opt-out and is named in a bad request."""
    body = {"prompt": PROMPT, "max_tokens": 16, "temperature": 0.9, "seed": 11}
    texts = {str(c): ok(url, {**body, "mtpspec": {"speculation": c}})["choices"][0]["text"] for c in ("off", 1, 3, "auto")}
    plain = demo.generate(PROMPT, max_new_tokens=16, temperature=0.9, seed=11, drafter="none").text
    assert set(texts.values()) == {plain}, texts
    assert ok(url, {**body, "sampler": "rejection", "mtpspec": {"speculation": "off"}})["choices"][0]["text"]
    r = post(url, {**body, "sampler": "fast"})
    assert r.status_code == 400 and r.json()["error"]["param"] == "sampler" and "gumbel" in r.json()["error"]["message"]


def test_streaming_n2_chunks_carry_their_index(url, demo):
    body = {"prompt": PROMPT, "max_tokens": 12, "temperature": 0, "n": 2}
    chunks = stream(url, body)
    want = demo.generate(PROMPT, max_new_tokens=12).text
    for i in (0, 1):
        mine = [c["choices"][0] for c in chunks if c["choices"] and c["choices"][0]["index"] == i]
        assert "".join(c["text"] for c in mine) == want
        assert [c["finish_reason"] for c in mine].count("length") == 1 and mine[-1]["finish_reason"] == "length"
    assert chunks[-1]["usage"]["completion_tokens"] == 24 and "choices" in chunks[-1]["mtpspec"]
    assert sum("usage" in c for c in chunks) == 1  # the last choice to end carries the request's usage
    chat = stream(url, {"messages": [{"role": "user", "content": "Hi"}], "max_tokens": 6, "temperature": 0, "n": 2,
                        "stream_options": {"include_usage": True}}, "/v1/chat/completions")
    roles = [c["choices"][0]["index"] for c in chat if c["choices"] and c["choices"][0]["delta"].get("role")]
    assert roles == [0, 1] and chat[-1]["choices"] == [] and chat[-1]["usage"]["completion_tokens"] == 12
    whole = ok(url, {"messages": [{"role": "user", "content": "Hi"}], "max_tokens": 6, "temperature": 0, "n": 2},
               "/v1/chat/completions")
    for i in (0, 1):
        text = "".join(c["choices"][0]["delta"].get("content", "") for c in chat if c["choices"] and c["choices"][0]["index"] == i)
        assert text == whole["choices"][i]["message"]["content"]


def test_echo_puts_the_prompt_and_its_logprobs_in_front(url, demo):
    want = demo.generate(PROMPT, max_new_tokens=8).text
    r = ok(url, {"prompt": PROMPT, "max_tokens": 8, "temperature": 0, "echo": True, "n": 2})
    assert [c["text"] for c in r["choices"]] == [PROMPT + want] * 2
    ids = demo.encode(PROMPT)
    by_ids = ok(url, {"prompt": ids, "max_tokens": 8, "temperature": 0, "echo": True})["choices"][0]["text"]
    assert by_ids == PROMPT + want  # token ids: decoded (a leading BOS is no text)
    lp = ok(url, {"prompt": PROMPT, "max_tokens": 8, "temperature": 0, "echo": True, "logprobs": 2})["choices"][0]["logprobs"]
    assert len(lp["tokens"]) == len(ids) + 8 and "".join(lp["tokens"]) == PROMPT + want
    assert lp["token_logprobs"][0] is None and lp["top_logprobs"][0] is None
    assert lp["text_offset"][len(ids)] == len(PROMPT) and lp["text_offset"] == sorted(lp["text_offset"])
    with torch.inference_mode():  # the prompt's rows: the target's own log-softmax over the prompt
        logits = demo.module.forward_tokens(torch.tensor(ids[:-1]), demo.module.new_cache()).logits.double()  # (L-1, V)
    ref = torch.log_softmax(logits, -1)[torch.arange(len(ids) - 1), torch.tensor(ids[1:])].tolist()
    assert all(math.isclose(a, b, abs_tol=1e-4) for a, b in zip(lp["token_logprobs"][1 : len(ids)], ref))
    assert all(len(t) == 2 for t in lp["top_logprobs"][1:])
    chunks = stream(url, {"prompt": PROMPT, "max_tokens": 8, "temperature": 0, "echo": True, "logprobs": 1})
    assert chunks[0]["choices"][0]["text"] == PROMPT and "".join(c["choices"][0]["text"] for c in chunks) == PROMPT + want
    rows = [t for c in chunks for t in c["choices"][0]["logprobs"]["tokens"]]
    assert rows == lp["tokens"]


@pytest.mark.parametrize("choice", ["off", 2, "auto"])
def test_speculation_per_request_is_lossless_and_reported(url, demo, choice):
    r = ok(url, {"prompt": PROMPT, "max_tokens": 16, "temperature": 0, "mtpspec": {"speculation": choice}})
    assert r["choices"][0]["text"] == demo.generate(PROMPT, max_new_tokens=16).text
    stats = r["mtpspec"]
    assert stats["speculation"] == choice
    if choice == "off":
        assert stats["drafter"] == "none" and stats["k"] == 0 and stats["drafted"] == 0 and stats["target_forwards"] == 16
    else:
        assert stats["drafter"] == "mtp" and stats["k"] == choice
    if choice == 2:
        assert stats["drafted"] > 0 and len(stats["acceptance_by_position"]) <= 2


def test_different_speculation_shares_a_batch(url, demo):
    prompts = ["import os\n", "class Stack:\n", "def fib(n):\n    ", "# sort a list\n"]
    choices = ["off", 1, 3, "auto"]

    async def main():
        async with httpx.AsyncClient(base_url=url, timeout=120) as ac:
            return await asyncio.gather(*(ac.post("/v1/completions", json={"prompt": p, "max_tokens": 16, "temperature": 0,
                                                                         "mtpspec": {"speculation": c}})
                                          for p, c in zip(prompts, choices)))

    rs = [r.json() for r in asyncio.run(main())]
    assert [r["choices"][0]["text"] for r in rs] == [demo.generate(p, max_new_tokens=16).text for p in prompts]
    assert [r["mtpspec"]["speculation"] for r in rs] == choices
    assert rs[0]["mtpspec"]["drafted"] == 0 and len(rs[1]["mtpspec"]["acceptance_by_position"]) <= 1


BAD = [
    ({"n": MAX_BATCH + 1}, "n", f"n: {MAX_BATCH + 1} choices; the server runs at most {MAX_BATCH}"),
    ({"n": 0}, "n", "n: must be an integer >= 1"),
    ({"n": 2, "best_of": 3}, "best_of", "best_of: 3 is not n (2)"),
    ({"echo": 1}, "echo", "echo: must be true or false, got 1"),
    ({"mtpspec": {"speculation": "fast"}}, "mtpspec", 'mtpspec: speculation must be "off", "auto" or a draft depth D'),
    ({"mtpspec": {"speculation": 99}}, "mtpspec", "mtpspec: speculation: D = 99 is deeper than the served drafter allows here (8)"),
    ({"mtpspec": {"speculation": 0}}, "mtpspec", 'mtpspec: speculation must be "off", "auto" or a draft depth D'),
    ({"mtpspec": {"speculation": True}}, "mtpspec", 'mtpspec: speculation must be "off", "auto" or a draft depth D'),
    ({"mtpspec": {"speculation": "2"}}, "mtpspec", 'mtpspec: speculation must be "off", "auto" or a draft depth D'),
    ({"mtpspec": {"speculation": 2, "drafter": "ngram"}}, "mtpspec", "mtpspec: drafter is an unknown field"),
    ({"mtpspec": "off"}, "mtpspec", 'mtpspec: must be an object with "speculation"'),
]


@pytest.mark.parametrize("extra, param, message", BAD, ids=[f"{i}-{p}" for i, (_, p, _) in enumerate(BAD)])
def test_bad_n_echo_and_speculation_are_400(url, extra, param, message):
    r = post(url, {"prompt": "x", "max_tokens": 2, **extra})
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert set(err) == {"message", "type", "param", "code"} and err["type"] == "invalid_request_error"
    assert err["param"] == param and err["message"].startswith(message), err
    assert "Traceback" not in r.text and "literal" not in err["message"]


def test_chat_has_no_echo_and_models_report_the_max_depth(url):
    r = post(url, {"messages": [{"role": "user", "content": "x"}], "echo": True}, "/v1/chat/completions")
    assert r.status_code == 400 and r.json()["error"]["param"] == "echo"
    spec = httpx.get(url + "/v1/models").json()["data"][0]["mtpspec"]
    assert spec == {"drafter": "mtp", "k": "auto", "max_depth": 8}


def test_n_counts_against_the_queue(demo_served):
    """n sequences take n of the --max-batch + --max-queue places: 2 + 1 places, a request of n = 2 waits behind one."""
    with running(demo_served, ServeOptions(drafter="none", max_batch=2, max_queue=1)) as (url, app):
        sched = app.state.schedulers["demo"]
        assert sched.max_k == 0
        r = post(url, {"prompt": "x", "mtpspec": {"speculation": 2}})
        assert r.status_code == 400 and "served without a drafter" in r.json()["error"]["message"]
        off = ok(url, {"prompt": PROMPT, "max_tokens": 4, "temperature": 0, "mtpspec": {"speculation": "auto"}})
        assert off["mtpspec"]["speculation"] == "off"

        async def main():
            async with httpx.AsyncClient(base_url=url, timeout=120) as ac:
                body = {"prompt": PROMPT, "max_tokens": 200, "temperature": 0, "n": 2}
                return await asyncio.gather(*(ac.post("/v1/completions", json=body) for _ in range(3)))

        codes = sorted(r.status_code for r in asyncio.run(main()))
    assert codes.count(200) >= 1 and 429 in codes and set(codes) <= {200, 429}

"""The live verify page's JSON API (FastAPI TestClient, no sockets): verification, step-through, errors.

The server serves only the models it was started with, by name; every bad request is a 4xx JSON
error naming the field, never a 500, and no request makes it open a path.
"""

from __future__ import annotations

import sys

import pytest
from fastapi.testclient import TestClient

from mtpspec.cli import main
from mtpspec.server import create_app
from mtpspec.server.registry import Served, load_served
from mtpspec.server.verify_page import MAX_DRAFT, FieldError, check_tree, tokenize_draft

PREFIX = "Once upon a time, there was a little girl named Lily. She loved to"
HEADS = "models/heads/stories260K-"


@pytest.fixture(scope="module")
def served(assets):
    m = assets / "models"
    return load_served([f"stories={m / 'stories260K.bin'}"], None,
                       [str(m / "stories260K_q80.bin")] + [HEADS + kind for kind in ("mtp", "eagle", "medusa")])


@pytest.fixture(scope="module")
def client(served):
    return TestClient(create_app(served))


def test_page_models_and_info_name_only_the_served_models(client, assets):
    page = client.get("/")
    assert page.status_code == 200 and "Greedy verification" in page.text and '<select id="model">' in page.text
    r = client.get("/api/models")
    m = r.json()
    assert [x["name"] for x in m["models"]] == ["stories"] and m["default"] == "stories"
    assert {x["name"]: x["kind"] for x in m["draft_models"]} == {
        "stories260K_q80": "model", "stories260K-mtp": "mtp", "stories260K-eagle": "eagle", "stories260K-medusa": "medusa",
        "stories": "model"}
    assert str(assets) not in r.text and "/" not in r.text  # names, never paths
    info = client.post("/api/load", json={}).json()
    assert info["model"] == "stories" and info["vocab_size"] == 512 and info["max_seq_len"] == 512
    menu = {d["name"]: d for d in info["drafters"]}
    assert menu["ngram"]["available"] and menu["ngram"]["own"]
    assert all(menu[d]["own"] and not menu[d]["uses_draft_model"] for d in ("ngram", "lookahead", "suffix")) and menu["draft"]["uses_draft_model"]
    assert menu["draft"]["draft_models"] == ["stories260K_q80"]  # a model never drafts for itself
    for kind in ("mtp", "eagle", "medusa"):
        assert menu[kind]["available"] and not menu[kind]["own"] and menu[kind]["draft_models"] == [f"stories260K-{kind}"]


def test_verify_typed_draft_matches_plain_greedy(client, stories):
    plain = stories.generate(PREFIX, max_new_tokens=12)
    right = stories.tokenizer.decode(plain.tokens[:4], prev=plain.prompt_tokens[-1])
    r = client.post("/api/verify", json={"model": "stories", "prefix": PREFIX, "draft": right + " zebra zebra", "top_k": 5}).json()
    assert r["verification"] == "greedy" and r["target_forwards"] == 1
    assert r["draft"]["ids"][:4] == plain.tokens[:4]
    n, d = r["num_accepted"], r["num_drafted"]
    assert n >= 4 and [t["id"] for t in r["emitted"]] == plain.tokens[: n + 1]  # accepted + correction = plain greedy
    assert [p["status"] for p in r["positions"]] == ["accepted"] * n + ["rejected"] + ["discarded"] * (d - n - 1) + ["unused"]
    assert r["correction"]["id"] == plain.tokens[n] and r["correction"]["position"] == n and r["bonus"] is None
    assert [t["id"] for t in r["discarded"]] == r["draft"]["ids"][n + 1 :]
    for pos in r["positions"]:
        top = pos["top"]
        assert len(top) == 5 and top[0]["id"] == pos["target"]["id"]
        # probabilities of one softmax row: each top-5 sum is at most 1 up to fp32 rounding (1e-4 >> 5 * 2^-24)
        assert all(a["p"] >= b["p"] for a, b in zip(top, top[1:])) and 0 < sum(t["p"] for t in top) <= 1.0001


def test_verify_full_acceptance_gives_bonus(client, stories):
    plain = stories.generate(PREFIX, max_new_tokens=6)
    r = client.post("/api/verify", json={"prefix": PREFIX, "draft_ids": plain.tokens[:5]}).json()
    assert r["num_accepted"] == 5 and r["bonus"]["id"] == plain.tokens[5] and r["correction"] is None
    assert r["positions"][-1]["status"] == "bonus"
    r = client.post("/api/verify", json={"prefix": PREFIX, "draft_ids": []}).json()  # D = 0: the target's own token
    assert r["num_drafted"] == 0 and r["bonus"]["id"] == plain.tokens[0]


@pytest.mark.parametrize("drafter, draft_model", [("ngram", None), ("draft", "stories260K_q80"), ("mtp", "stories260K-mtp"),
                                                  ("eagle", "stories260K-eagle"), ("medusa", "stories260K-medusa")])
def test_verify_drafter_proposes_with_a_served_draft_model(client, stories, drafter, draft_model):
    prefix = "The cat sat. The cat sat. The cat" if drafter == "ngram" else PREFIX
    r = client.post("/api/verify", json={"prefix": prefix, "drafter": drafter, "k": 4, "draft_model": draft_model}).json()
    assert r["draft"]["source"] == drafter and 1 <= r["num_drafted"] <= 4
    plain = stories.generate(prefix, max_new_tokens=r["num_accepted"] + 1)
    assert [t["id"] for t in r["emitted"]] == plain.tokens  # greedy verification emits plain greedy's tokens


def test_tokenize_draft_as_continuation(stories):
    ids = stories.encode("Once upon a ti")
    assert stories.tokenizer.decode(tokenize_draft(stories, ids, "Once upon a ti", "me"), prev=ids[-1]) == "me"
    ids = stories.encode("Once upon a time")
    d = tokenize_draft(stories, ids, "Once upon a time", ", there was")
    assert stories.encode("Once upon a time, there was") == ids + d
    assert stories.tokenizer.decode(d, prev=ids[-1]) == ", there was"


@pytest.mark.parametrize("drafter, draft_model", [("ngram", None), ("draft", "stories260K_q80"), ("eagle", "stories260K-eagle"),
                                                  ("lookahead", None), ("suffix", None)])
def test_step_through(client, stories, drafter, draft_model):
    r = client.post("/api/step", json={"prefix": PREFIX, "drafter": drafter, "draft_model": draft_model, "k": 3, "max_new_tokens": 20}).json()
    assert r["identical_to_plain"] and r["stats"]["target_forwards"] == len(r["steps"])
    emitted = [t["id"] for s in r["steps"] for t in s["emitted"]]
    assert emitted == stories.generate(PREFIX, max_new_tokens=20).tokens
    for s in r["steps"]:
        n, d = s["num_accepted"], s["num_drafted"]
        assert len(s["target_choice"]) == d + 1
        assert [t["id"] for t in s["emitted"]][: n] == [t["id"] for t in s["draft"]][:n]
        assert s["emitted"][n]["id"] == s["target_choice"][n]["id"] if len(s["emitted"]) > n else True
        assert [t["id"] for t in s["discarded"]] == [t["id"] for t in s["draft"]][n + 1 :]
        tree = s["tree"]  # a chain is the degenerate tree: node i's parent is i - 1
        assert not tree["is_tree"] and [x["parent"] for x in tree["nodes"]] == list(range(-1, d - 1)) and tree["path"] == list(range(n))
        assert [x["status"] for x in tree["nodes"]] == (["accepted"] * n + ["rejected"] + ["discarded"] * d)[:d]
        assert tree["target"]["kind"] == s["last_kind"] and tree["target"]["id"] == s["target_choice"][n]["id"]
        assert s["cost_seconds"] == pytest.approx(s["draft_seconds"] + s["verify_seconds"])
        assert s["plain_cost_seconds"] == pytest.approx(r["plain_step_seconds"] * len(s["emitted"]))


def check_tree_step(s: dict) -> tuple[str, ...]:
    """One tree step of /api/step is a well-formed tree with the verdicts greedy verification gives; its statuses."""
    tree, n = s["tree"], s["num_accepted"]
    nodes, path = tree["nodes"], tree["path"]
    assert [x["index"] for x in nodes] == list(range(len(nodes))) == list(range(s["num_drafted"]))
    assert [x["id"] for x in nodes] == [t["id"] for t in s["draft"]]
    for x in nodes:  # parents first; depth 1 right after the last token
        assert -1 <= x["parent"] < x["index"]
        assert x["depth"] == (1 if x["parent"] < 0 else nodes[x["parent"]]["depth"] + 1)
    assert len(path) == n and [nodes[j]["parent"] for j in path] == ([-1] + path)[:n]  # a path down from the root
    emitted = [t["id"] for t in s["emitted"]]
    assert [nodes[j]["id"] for j in path] == emitted[:n]  # the accepted path is what was emitted
    choice = [t["id"] for t in s["target_choice"]]  # the target's argmax at the root and at each accepted node
    assert len(choice) == n + 1
    reached = {-1: choice[0], **{j: choice[i + 1] for i, j in enumerate(path)}}
    for x in nodes:
        if x["index"] in path:
            assert x["status"] == "accepted" and x["id"] == reached[x["parent"]] == x["target"]["id"]
        elif x["parent"] in reached:  # checked against the target's choice after its parent, and refused
            assert x["status"] == "rejected" and x["id"] != reached[x["parent"]] == x["target"]["id"]
        else:  # under a refused node: never checked
            assert x["status"] == "discarded" and x["target"] is None and nodes[x["parent"]]["status"] in ("rejected", "discarded")
        assert 0.0 <= x["p"] <= 1.0
    end = path[-1] if path else -1
    target = tree["target"]
    assert target["id"] == choice[n] and target["parent"] == end and target["depth"] == n + 1
    assert target["kind"] == ("recovered" if any(x["parent"] == end for x in nodes) else "bonus") == s["last_kind"]
    assert emitted[n:] == ([choice[n]] if target["emitted"] else [])
    assert sorted(t["id"] for t in s["discarded"]) == sorted(x["id"] for x in nodes if x["status"] == "discarded")
    return tuple(x["status"] for x in nodes)


@pytest.mark.parametrize("drafter, draft_model, prefix", [
    ("draft", "stories260K_q80", PREFIX), ("eagle", "stories260K-eagle", PREFIX), ("mtp", "stories260K-mtp", PREFIX),
    ("medusa", "stories260K-medusa", PREFIX), ("ngram", None, "The cat sat on the mat. The dog sat on the log. The cat sat on the")])
def test_step_through_a_token_tree(client, stories, drafter, draft_model, prefix):
    """tree=N: every round's draft is a tree (nodes, parents, depths, statuses) whose accepted path is the tokens
    emitted, and the whole output is plain greedy's."""
    # the Q8_0 draft model is right ~95% of the time: a beam of 1 rarely leaves its best path, a beam of 4 branches
    beam = {"tree_beam": 4} if drafter == "draft" else {}
    r = client.post("/api/step", json={"prefix": prefix, "drafter": drafter, "draft_model": draft_model, "k": 4, "tree": 8,
                                       "max_new_tokens": 24, **beam})
    assert r.status_code == 200, r.text
    r = r.json()
    assert r["tree"] == 8 and r["identical_to_plain"]
    assert [t["id"] for s in r["steps"] for t in s["emitted"]] == stories.generate(prefix, max_new_tokens=24).tokens
    trees = [s for s in r["steps"] if s["tree"]["is_tree"]]
    assert trees and all(len(s["tree"]["nodes"]) <= 8 and s["tree"]["depth"] <= 4 for s in trees)
    seen = {st for s in trees for st in check_tree_step(s)}
    if drafter != "ngram":  # a model's tree branches where it is unsure: some guesses are refused, some never checked
        assert seen == {"accepted", "rejected", "discarded"}


@pytest.mark.parametrize("drafter, draft_model", [("draft", "stories260K_q80"), ("eagle", "stories260K-eagle")])
def test_verify_a_proposed_token_tree(client, stories, drafter, draft_model):
    """/api/verify with tree=N: the drafter's tree in one forward; positions follow the accepted path (each with the
    children refused there), and what is emitted is plain greedy's."""
    r = client.post("/api/verify", json={"prefix": PREFIX, "drafter": drafter, "draft_model": draft_model, "k": 4, "tree": 8,
                                         "top_k": 3})
    assert r.status_code == 200, r.text
    r = r.json()
    tree, n = r["tree"], r["num_accepted"]
    assert tree["is_tree"] and r["num_drafted"] == len(tree["nodes"]) <= 8 and r["target_forwards"] == 1
    emitted = [t["id"] for t in r["emitted"]]
    assert emitted == stories.generate(PREFIX, max_new_tokens=n + 1).tokens
    step = {"tree": tree, "num_accepted": n, "num_drafted": r["num_drafted"], "draft": r["draft"]["tokens"], "emitted": r["emitted"],
            "target_choice": [p["target"] for p in r["positions"]], "last_kind": "bonus" if r["bonus"] else "recovered",
            "discarded": r["discarded"]}
    assert "rejected" in check_tree_step(step)
    pos = r["positions"]
    assert len(pos) == n + 1 and [p["node"] for p in pos] == tree["path"] + [None]
    assert [p["status"] for p in pos] == ["accepted"] * n + ["rejected" if r["correction"] else "bonus"]
    rows = [-1] + tree["path"]
    for p, row in zip(pos, rows):
        refused = [x["index"] for x in tree["nodes"] if x["parent"] == row and x["status"] == "rejected"]
        assert sorted(x["node"] for x in p["refused"]) == refused
        assert p["top"][0]["id"] == p["target"]["id"] and len(p["top"]) == 3
    assert (r["correction"] or r["bonus"])["id"] == emitted[n]
    r = client.post("/api/verify", json={"prefix": PREFIX, "draft": " play", "tree": 8})  # a typed draft is a chain
    assert r.status_code == 400 and r.json()["error"]["message"].startswith("tree: ")


def test_tree_nodes_only_for_drafters_that_grow_trees():
    assert check_tree("eagle", 0) is None and check_tree("ngram", 63) == 63
    for drafter, tree in [("lookahead", 4), ("suffix", 1), ("eagle", 64), ("eagle", -1), ("eagle", True)]:
        with pytest.raises(FieldError) as e:
            check_tree(drafter, tree)
        assert e.value.field == "tree" and str(e.value).startswith("tree: ")


def test_prefix_at_the_context_edge(client, stories):
    """A prefix one token short of the context still verifies and steps; one that fills it is a `prefix` error."""
    words = ("Once upon a time, there was a little girl named Lily. " * 60).split(" ")
    text = lambda i: " ".join(words[:i])  # noqa: E731
    lo, hi = 1, len(words)  # the fewest words whose tokens fill the context (token count grows with words)
    while lo < hi:
        mid = (lo + hi) // 2
        lo, hi = (mid + 1, hi) if len(stories.encode(text(mid))) < 512 else (lo, mid)
    short, full = text(lo - 1), text(lo)
    assert 500 < len(stories.encode(short)) < 512 <= len(stories.encode(full))
    assert client.post("/api/verify", json={"prefix": short, "drafter": "draft", "draft_model": "stories260K_q80", "k": 8}).status_code == 200
    r = client.post("/api/step", json={"prefix": short, "drafter": "ngram", "k": 8, "max_new_tokens": 64})
    assert r.status_code == 200 and r.json()["identical_to_plain"]
    for path, body in [("/api/verify", {"prefix": full, "draft": " a"}), ("/api/step", {"prefix": full})]:
        r = client.post(path, json=body)
        assert r.status_code == 400 and r.json()["error"]["message"].startswith("prefix: ")


BIG = 10**30
BAD = [  # (path, body, status, the field the error names); "raw:" bodies are sent as bytes
    ("/api/verify", {"prefix": "", "draft": " hi"}, 400, "prefix"),
    ("/api/verify", {"prefix": "   ", "draft": " hi"}, 400, "prefix"),
    ("/api/verify", {"prefix": "Once upon a time. " * 200, "draft": " hi"}, 400, "prefix"),
    ("/api/verify", {"prefix": "a" * 50_001, "draft": " hi"}, 400, "prefix"),
    ("/api/verify", {"draft": " a"}, 400, "prefix"),
    ("/api/verify", {"prefix": 5, "draft": " a"}, 400, "prefix"),
    ("/api/verify", {"prefix": None, "draft": " a"}, 400, "prefix"),
    ("/api/verify", {"prefix": "Hi", "draft": " a" * 600}, 400, "draft"),
    ("/api/verify", {"prefix": "Hi", "draft": "a" * 2001}, 400, "draft"),
    ("/api/verify", {"prefix": "Hi", "draft": ["a"]}, 400, "draft"),
    ("/api/verify", {"prefix": "Hi"}, 400, "draft"),
    ("/api/verify", {"prefix": "Hi", "draft_ids": [1] * (MAX_DRAFT + 1)}, 400, "draft_ids"),
    ("/api/verify", {"prefix": "Hi", "draft_ids": [9999]}, 400, "draft_ids"),
    ("/api/verify", {"prefix": "Hi", "draft_ids": [-1]}, 400, "draft_ids"),
    ("/api/verify", {"prefix": "Hi", "draft_ids": [BIG]}, 400, "draft_ids"),
    ("/api/verify", {"prefix": "Hi", "draft_ids": ["a"]}, 400, "draft_ids"),
    ("/api/verify", {"prefix": "Hi", "draft_ids": [1.5]}, 400, "draft_ids"),
    ("/api/verify", {"prefix": "Hi", "draft_ids": 3}, 400, "draft_ids"),
    ("/api/verify", {"model": "/no/such/model.bin", "prefix": "Hi", "draft": " a"}, 404, "model"),
    ("/api/verify", {"model": "", "prefix": "Hi", "draft": " a"}, 404, "model"),
    ("/api/verify", {"model": 3, "prefix": "Hi", "draft": " a"}, 400, "model"),
    ("/api/verify", {"prefix": "Hi", "drafter": "nope"}, 400, "drafter"),
    ("/api/verify", {"prefix": "Hi", "drafter": "none"}, 400, "drafter"),
    ("/api/verify", {"prefix": "Hi", "drafter": "mtp"}, 400, "draft_model"),  # stories260K has no MTP module of its own
    ("/api/verify", {"prefix": "Hi", "drafter": 7}, 400, "drafter"),
    ("/api/verify", {"prefix": "Hi", "drafter": "draft"}, 400, "draft_model"),
    ("/api/verify", {"prefix": "Hi", "drafter": "medusa"}, 400, "draft_model"),
    ("/api/verify", {"prefix": "Hi", "drafter": "draft", "draft_model": "nope"}, 404, "draft_model"),
    ("/api/verify", {"prefix": "Hi", "drafter": "draft", "draft_model": "stories260K-medusa"}, 400, "draft_model"),
    ("/api/verify", {"prefix": "Hi", "drafter": "mtp", "draft_model": "stories260K-eagle"}, 400, "draft_model"),
    ("/api/verify", {"prefix": "Hi", "drafter": "eagle", "draft_model": "stories260K_q80"}, 400, "draft_model"),
    ("/api/verify", {"prefix": "Hi", "drafter": "ngram", "draft_model": "stories260K_q80"}, 400, "draft_model"),
    ("/api/verify", {"prefix": "Hi", "draft": " a", "draft_model": "stories260K_q80"}, 400, "draft_model"),
    ("/api/verify", {"prefix": "Hi", "drafter": "ngram", "k": 0}, 400, "k"),
    ("/api/verify", {"prefix": "Hi", "drafter": "ngram", "k": -3}, 400, "k"),
    ("/api/verify", {"prefix": "Hi", "drafter": "ngram", "k": MAX_DRAFT + 1}, 400, "k"),
    ("/api/verify", {"prefix": "Hi", "drafter": "ngram", "k": BIG}, 400, "k"),
    ("/api/verify", {"prefix": "Hi", "drafter": "ngram", "k": 2.5}, 400, "k"),
    ("/api/verify", {"prefix": "Hi", "drafter": "ngram", "k": "4"}, 400, "k"),
    ("/api/verify", {"prefix": "Hi", "drafter": "ngram", "k": True}, 400, "k"),
    ("/api/verify", {"prefix": "Hi", "drafter": "ngram", "k": None}, 400, "k"),
    ("/api/verify", {"prefix": "Hi", "draft": " a", "top_k": 0}, 400, "top_k"),
    ("/api/verify", {"prefix": "Hi", "draft": " a", "top_k": 51}, 400, "top_k"),
    ("/api/verify", {"prefix": "Hi", "draft": " a", "top_k": 2.5}, 400, "top_k"),
    ("/api/verify", {"prefix": "Hi", "draft": " a", "temperature": 1.0}, 400, "temperature"),  # greedy only: no such field
    ("/api/verify", {"prefix": "Hi", "draft": " a", "tokenizer": "/etc/passwd"}, 400, "tokenizer"),
    ("/api/verify", "raw:" + '{"prefix": "Hi", "draft": " a", "top_k": NaN}', 400, "top_k"),
    ("/api/verify", "raw:" + '{"prefix": "Hi", "draft": " a", "top_k": Infinity}', 400, "top_k"),
    ("/api/verify", "raw:" + '{"prefix": "Hi", "draft": " a", "temperature": -Infinity}', 400, "temperature"),
    ("/api/verify", "raw:" + '{"prefix": "\\ud800", "draft": " a"}', 400, "prefix"),
    ("/api/verify", "raw:" + '{"prefix": "Hi", "draft": "x\\udfff"}', 400, "draft"),
    ("/api/verify", "raw:" + '{"prefix": "Hi", "drafter": "\\ud83d"}', 400, "drafter"),
    ("/api/verify", "raw:" + '{"model": "\\udc00", "prefix": "Hi", "draft": " a"}', 400, "model"),
    ("/api/verify", "raw:" + '{"\\ud800": 1, "prefix": "Hi", "draft": " a"}', 400, "body"),
    ("/api/verify", "raw:" + "{not json", 400, "body"),
    ("/api/verify", "raw:" + "", 400, "body"),
    ("/api/verify", "raw:" + "[1, 2]", 400, "body"),
    ("/api/verify", "raw:" + '"prefix"', 400, "body"),
    ("/api/verify", "raw:" + '{"prefix": "' + "a" * (1 << 20) + '"}', 413, "body"),
    ("/api/verify", '{"prefix": "caf\xe9", "draft": " a"}'.encode("latin-1"), 400, "body"),  # not UTF-8
    ("/api/load", {"model": "nope"}, 404, "model"),
    ("/api/load", {"model": "/etc/passwd"}, 404, "model"),
    ("/api/load", {"model": "stories", "dtype": "bf16"}, 400, "dtype"),
    ("/api/step", {"prefix": "", "drafter": "ngram"}, 400, "prefix"),
    ("/api/step", {"prefix": "Once upon a time. " * 200, "drafter": "ngram"}, 400, "prefix"),
    ("/api/step", {"prefix": "Hi", "drafter": "ngram", "k": 0}, 400, "k"),
    ("/api/step", {"prefix": "Hi", "drafter": "ngram", "k": BIG}, 400, "k"),
    ("/api/step", {"prefix": "Hi", "drafter": "ngram", "max_new_tokens": 0}, 400, "max_new_tokens"),
    ("/api/step", {"prefix": "Hi", "drafter": "ngram", "max_new_tokens": -5}, 400, "max_new_tokens"),
    ("/api/step", {"prefix": "Hi", "drafter": "ngram", "max_new_tokens": 10**12}, 400, "max_new_tokens"),
    ("/api/step", {"prefix": "Hi", "drafter": "ngram", "max_new_tokens": "32"}, 400, "max_new_tokens"),
    ("/api/step", {"prefix": "Hi", "drafter": "none"}, 400, "drafter"),
    ("/api/step", {"prefix": "Hi", "drafter": "nope"}, 400, "drafter"),
    ("/api/step", {"prefix": "Hi", "drafter": "medusa"}, 400, "draft_model"),
    ("/api/step", {"prefix": "Hi", "drafter": "draft", "draft_model": "/etc/passwd"}, 404, "draft_model"),
    ("/api/step", {"prefix": "Hi", "drafter": "ngram", "seed": 2**64}, 400, "seed"),
    ("/api/verify", {"prefix": "Hi", "drafter": "ngram", "tree": 64}, 400, "tree"),
    ("/api/verify", {"prefix": "Hi", "draft_ids": [5], "tree": 4}, 400, "tree"),
    ("/api/step", {"prefix": "Hi", "drafter": "ngram", "tree": 64}, 400, "tree"),
    ("/api/step", {"prefix": "Hi", "drafter": "ngram", "tree": -1}, 400, "tree"),
    ("/api/step", {"prefix": "Hi", "drafter": "ngram", "tree": "8"}, 400, "tree"),
    ("/api/step", {"prefix": "Hi", "drafter": "ngram", "tree": 8.0}, 400, "tree"),
    ("/api/step", {"prefix": "Hi", "drafter": "ngram", "tree": None}, 400, "tree"),
    ("/api/step", {"prefix": "Hi", "drafter": "ngram", "tree": 8, "tree_beam": 2}, 400, "tree_beam"),
    ("/api/step", {"prefix": "Hi", "drafter": "mtp", "draft_model": "stories260K-mtp", "tree": 8, "tree_beam": 9}, 400, "tree_beam"),
    ("/api/verify", {"prefix": "Hi", "drafter": "mtp", "draft_model": "stories260K-mtp", "tree_beam": 4}, 400, "tree_beam"),
]


@pytest.mark.parametrize("path, body, status, field", BAD, ids=[f"{i}-{c[3]}" for i, c in enumerate(BAD)])
def test_bad_input_is_a_4xx_json_error_naming_the_field(client, path, body, status, field):
    if isinstance(body, (str, bytes)):
        raw = body if isinstance(body, bytes) else body[4:].encode()
        r = client.post(path, content=raw, headers={"Content-Type": "application/json"})
    else:
        r = client.post(path, json=body)
    assert r.status_code == status, r.text
    assert r.json()["error"]["message"].startswith(f"{field}: "), r.text
    assert r.json()["error"]["param"] == (None if field == "body" else field), r.text  # the top-level field as sent
    assert client.post("/api/verify", json={"prefix": "Hi", "draft": " there"}).status_code == 200  # still serving


def test_an_oversized_body_without_a_length_is_413(client):
    """A chunked body (no Content-Length) is counted as it arrives: over 1 MiB is a 413 before the app parses it."""
    chunks = (b"x" * 100_000 for _ in range(12))
    r = client.post("/api/verify", content=chunks, headers={"Content-Type": "application/json"})
    assert r.status_code == 413 and r.json()["error"]["message"].startswith("body: ")


def test_a_named_path_is_never_opened(client, tmp_path):
    """A readable file named as a model or a draft model: 404 by name, its bytes never read (audit hook on open)."""
    secret = tmp_path / "secret.bin"
    secret.write_bytes(b"TOP-SECRET-BYTES" + bytes(range(256)))
    opened: list[str] = []
    watching = [True]
    sys.addaudithook(lambda event, args: opened.append(str(args[0])) if watching[0] and event == "open" and args else None)
    try:
        answers = [client.post("/api/load", json={"model": str(secret)}),
                   client.post("/api/verify", json={"model": str(secret), "prefix": "Hi", "draft": " a"}),
                   client.post("/api/verify", json={"prefix": "Hi", "drafter": "draft", "draft_model": str(secret)}),
                   client.post("/api/step", json={"prefix": "Hi", "drafter": "eagle", "draft_model": str(tmp_path)})]
    finally:
        watching[0] = False
    assert [r.status_code for r in answers] == [404] * 4
    assert not [p for p in opened if str(tmp_path) in p]
    first = int.from_bytes(b"TOP-", "little")  # what a loader reading the header would have echoed
    for r in answers:
        assert "TOP-SECRET" not in r.text and str(first) not in r.text
        assert "stories" in r.json()["error"]["message"]  # the error lists the names that are served


@pytest.mark.parametrize("method, path, status", [("get", "/nope", 404), ("post", "/api/nope", 404), ("get", "/api/verify", 405),
                                                  ("delete", "/api/models", 405), ("post", "/api/health", 405)])
def test_unknown_routes_and_methods_answer_error_json(client, method, path, status):
    r = client.request(method.upper(), path)
    assert r.status_code == status and set(r.json()) == {"error"} and path in r.json()["error"]["message"]


def test_a_failing_request_leaves_the_server_working(served, monkeypatch):
    """An internal failure mid-forward is a 500 {"error"}; the lock is released and the next answer is unchanged."""
    client = TestClient(create_app(served), raise_server_exceptions=False)
    body = {"prefix": PREFIX, "draft": " play in the park", "top_k": 3}
    before = client.post("/api/verify", json=body).json()
    module = served.models["stories"].module

    def broken(*args, **kwargs):
        raise RuntimeError("injected failure")

    monkeypatch.setattr(module, "forward_tokens", broken)
    r = client.post("/api/verify", json=body)
    assert r.status_code == 500 and "injected failure" in r.json()["error"]["message"]
    monkeypatch.undo()
    assert client.post("/api/verify", json=body).json() == before


def test_serve_refuses_a_missing_or_bad_model_before_binding(capsys, tmp_path, assets):
    bad = tmp_path / "bad.bin"
    bad.write_bytes(b"\x00" * 10)
    story = str(assets / "models" / "stories260K.bin")
    cases = [
        (["--model", "/nonexistent"], "--model nonexistent: model not found: /nonexistent"),
        (["--model", f"x={bad}"], "--model x: "),
        (["--model", story, "--draft-model", "/nonexistent/head"], "--draft-model head: model not found"),
        (["--model", story, "--model", story], "the name 'stories260K' is given twice"),
        (["--model", story, "--model", "demo", "--tokenizer", "tok512.bin"], "say which: --tokenizer NAME=PATH"),
        (["--model", story, "--tokenizer", "other=tok512.bin"], "no --model named 'other'"),
        (["--model", f"a={story}", "--draft-model", f"a={story}"], "the name 'a' is also a --model"),
        (["--model", story, "--port", "70000"], "--port must be in 0..65535"),
        (["--model", story, "--dtype", "fp16"], "unknown dtype 'fp16'"),
        (["--model", story, "--threads", "0"], "--threads must be >= 1"),
    ]
    import socket

    with socket.socket() as taken:  # a port already in use: a one-line error, not uvicorn's exit 1
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        cases.append((["--model", story, "--port", str(taken.getsockname()[1])], "cannot listen on 127.0.0.1:"))
        for args, words in cases:
            assert main(["serve", *args]) == 2, args
            err = capsys.readouterr().err
            assert err.startswith("mtpspec: error: ") and words in err and err.count("\n") == 1, err


class CharTokenizer:
    """A toy tokenizer for a 16-token model: BOS = 1, every character one id in 3..15."""

    stop_ids = ()

    def encode(self, text, bos=True):
        return ([1] if bos else []) + [3 + ord(c) % 13 for c in text]

    def decode(self, ids, prev=1):
        return "".join(chr(ord("a") + i) for i in ids)


def test_mtp_head_is_offered_and_proposes_when_the_model_has_one():
    import torch

    from mtpspec.api import Model
    from mtpspec.models.qwen35 import HybridConfig, HybridLM
    from mtpspec.server.verify_page import verify_draft

    cfg = HybridConfig(
        vocab_size=16, hidden_size=32, num_layers=2, layer_types=("linear_attention", "full_attention"), num_heads=4,
        num_kv_heads=2, head_dim=16, intermediate_size=48, max_seq_len=64, linear_key_head_dim=8, linear_value_head_dim=8,
        linear_num_key_heads=2, linear_num_value_heads=4, mtp_num_layers=1, tie_embeddings=False,
    )
    torch.manual_seed(0)
    model = Model(module=HybridLM(cfg).eval(), tokenizer=CharTokenizer())
    menu = {d["name"]: d for d in Served({"tiny": model}).menus["tiny"]}
    assert menu["mtp"]["available"] and menu["mtp"]["own"] and not menu["medusa"]["available"]
    r = verify_draft(model, "abcabcabc", drafter="mtp", k=3, top_k=4)
    assert r["draft"]["source"] == "mtp" and r["num_drafted"] == 3 and len(r["positions"]) == 4
    assert [t["id"] for t in r["emitted"]][: r["num_accepted"]] == r["draft"]["ids"][: r["num_accepted"]]


def test_demo_verify_windows_up_to_max_draft():
    """The demo (a hybrid with an MTP module): D = 17 and MAX_DRAFT in one verify forward give plain greedy's tokens."""
    served = load_served(["demo"])
    client = TestClient(create_app(served))
    prefix = "def parse_args(argv):"
    plain = served.models["demo"].generate(prefix, max_new_tokens=MAX_DRAFT + 1).tokens
    for k in (17, MAX_DRAFT):
        r = client.post("/api/verify", json={"prefix": prefix, "drafter": "mtp", "k": k})
        assert r.status_code == 200, r.text
        r = r.json()
        assert r["num_drafted"] == k and [t["id"] for t in r["emitted"]] == plain[: r["num_accepted"] + 1]
        r = client.post("/api/verify", json={"prefix": prefix, "draft_ids": plain[:k]}).json()
        assert r["num_accepted"] == k and r["bonus"]["id"] == plain[k]
    r = client.post("/api/step", json={"prefix": prefix, "drafter": "mtp", "k": 17, "max_new_tokens": 40})
    assert r.status_code == 200 and r.json()["identical_to_plain"]
    r = client.post("/api/step", json={"prefix": prefix, "drafter": "mtp", "k": 4, "tree": 8, "max_new_tokens": 40})
    assert r.status_code == 200 and r.json()["identical_to_plain"]  # a token tree on the hybrid: each node's own state
    assert [t["id"] for s in r.json()["steps"] for t in s["emitted"]] == plain[:40]
    assert {st for s in r.json()["steps"] for st in check_tree_step(s)} == {"accepted", "rejected", "discarded"}


def test_serve_sets_its_loaded_heap_aside_from_the_garbage_collector(assets, monkeypatch):
    """A full collection walking the models' objects is a pause inside some request; serve freezes them first."""
    import gc

    import uvicorn

    frozen = []
    monkeypatch.setattr(uvicorn.Server, "run", lambda self, sockets=None: frozen.append(gc.get_freeze_count()))
    try:
        assert main(["serve", "--model", str(assets / "models" / "stories260K.bin"), "--port", "0"]) == 0
    finally:
        gc.unfreeze()
    assert frozen and frozen[0] > 10_000


def test_mtpspec_serve_command_runs_a_real_server(assets):
    """`mtpspec serve` as a user runs it: a subprocess on 127.0.0.1, bad requests, then a good one; always stopped."""
    import socket
    import subprocess
    import time

    import httpx

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    m = assets / "models"
    proc = subprocess.Popen([sys.executable, "-c", "import sys; from mtpspec.cli import main; sys.exit(main())", "serve",
                             "--model", f"stories={m / 'stories260K.bin'}", "--tokenizer", f"stories={m / 'tok512.bin'}",
                             "--draft-model", str(m / "stories260K_q80.bin"), "--port", str(port)],
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 60
        while True:
            try:
                if httpx.get(url + "/api/health", timeout=1).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            assert proc.poll() is None, proc.stdout.read().decode()
            assert time.monotonic() < deadline, "mtpspec serve did not answer within 60 s"
            time.sleep(0.2)
        assert [x["name"] for x in httpx.get(url + "/api/models", timeout=10).json()["models"]] == ["stories"]
        r = httpx.post(url + "/api/verify", json={"model": str(m / "stories260K.bin"), "prefix": "a", "draft": " b"}, timeout=30)
        assert r.status_code == 404 and r.json()["error"]["message"].startswith("model: ")
        assert httpx.post(url + "/api/verify", json={"prefix": "", "draft": " b"}, timeout=30).status_code == 400
        assert httpx.get(url + "/nope", timeout=10).json()["error"]["message"].startswith("no such route")
        r = httpx.post(url + "/api/verify", json={"model": "stories", "prefix": "Once upon a time", "draft": ", there was"}, timeout=30)
        assert r.status_code == 200 and r.json()["num_accepted"] == 3
        r = httpx.post(url + "/api/verify", json={"prefix": PREFIX, "drafter": "draft", "draft_model": "stories260K_q80"}, timeout=30)
        assert r.status_code == 200 and r.json()["draft"]["source"] == "draft"
    finally:
        proc.terminate()
        try:
            proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(timeout=10)


def test_hf_directory_with_mtp_head_on_the_page(tmp_path):
    """A Hugging Face directory (tiny Qwen3.5 with mtp.* weights, no-BOS tokenizer), served by name: mtp offered and used."""
    from qwen35_tiny import save_hf

    save_hf("qwen35", tmp_path / "tiny", mtp=True)
    client = TestClient(create_app(load_served([str(tmp_path / "tiny")])))
    info = client.post("/api/load", json={"model": "tiny"}).json()
    assert {d["name"]: d["available"] for d in info["drafters"]}["mtp"]
    r = client.post("/api/verify", json={"model": "tiny", "prefix": "w3 w4 w5", "drafter": "mtp", "k": 3}).json()
    assert r["draft"]["source"] == "mtp" and r["num_drafted"] == 3 and len(r["positions"]) == 4
    assert [t["id"] for t in r["prefix"]["tokens"]] == r["prefix"]["ids"] == [3, 4, 5]  # no BOS to hide
    r = client.post("/api/verify", json={"prefix": "w3 w4 w5", "draft": " w6 w7"}).json()
    assert r["draft"]["ids"] == [6, 7] and r["draft"]["text"] == " w6 w7"


def test_fuzzed_bodies_never_a_500(client):
    """Random bodies (right and wrong types, huge and negative numbers, NaN, lone surrogates, unknown fields):
    every answer is 200 or a 4xx {"error": "FIELD: ..."}; bounded and derandomized, so it runs the same everywhere."""
    import json

    from hypothesis import HealthCheck, given, settings
    from hypothesis import strategies as st

    junk = st.one_of(st.none(), st.booleans(), st.integers(-(2**70), 2**70), st.floats(allow_nan=True, allow_infinity=True),
                     st.text(max_size=20), st.lists(st.integers(-5, 600), max_size=5), st.just("\ud800"), st.just({}))

    plausible = {  # values a page or a script would send, right or wrong
        "prefix": st.one_of(st.sampled_from(["Once upon a time", "The cat sat. The cat", "", " ", "\x00", "é中🙂", "<s></s>"]),
                            st.text(min_size=1, max_size=40)),
        "model": st.sampled_from(["stories", "stories", "/etc/passwd", ""]),
        "draft": st.one_of(st.sampled_from([" there was", " ", "x\ud83d"]), st.text(max_size=20)),
        "draft_ids": st.lists(st.integers(-3, 520), max_size=8),
        "drafter": st.sampled_from(["ngram", "draft", "mtp", "eagle", "medusa", "none", "heads"]),
        "draft_model": st.sampled_from(["stories260K_q80", "stories260K-mtp", "stories260K-eagle", "stories260K-medusa", "stories"]),
        "k": st.integers(-1, 8), "top_k": st.integers(-1, 12), "max_new_tokens": st.integers(-1, 8), "tree": st.integers(-1, 9),
    }
    fields = dict(plausible, temperature=junk, seed=junk)
    own = {"/api/verify": ["model", "draft", "draft_ids", "drafter", "draft_model", "k", "top_k", "tree"],
           "/api/step": ["model", "drafter", "draft_model", "k", "max_new_tokens", "tree"], "/api/load": ["model"]}

    def bodies(path):
        first = {} if path == "/api/load" else {"prefix": plausible["prefix"]}
        good = st.fixed_dictionaries(first, optional={k: plausible[k] for k in own[path]})  # the endpoint's own fields
        bad = st.fixed_dictionaries({}, optional={k: st.one_of(v, junk) for k, v in fields.items()})
        return st.tuples(st.just(path), st.integers(0, 4).flatmap(lambda i: bad if i == 0 else good))  # 1 in 5 junk

    @settings(max_examples=120, deadline=None, derandomize=True, database=None, suppress_health_check=list(HealthCheck))
    @given(case=st.sampled_from(sorted(own)).flatmap(bodies))
    def check(case):
        path, body = case
        r = client.post(path, content=json.dumps(body, allow_nan=True).encode(), headers={"Content-Type": "application/json"})
        assert r.status_code in (200, 400, 404, 413, 422), (body, r.text)
        if r.status_code != 200:
            error = r.json()["error"]["message"]
            assert error.split(":")[0] in set(fields) | {"body"} or error.split(".")[0] in fields, (body, error)

    check()

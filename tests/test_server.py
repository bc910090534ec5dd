"""The live verify page's JSON API (FastAPI TestClient, no sockets): verification, step-through, errors."""

from __future__ import annotations

import pytest
from fastapi.testclient import TestClient

from mtpspec.server import create_app
from mtpspec.server.verify_page import tokenize_draft

PREFIX = "Once upon a time, there was a little girl named Lily. She loved to"


@pytest.fixture(scope="module")
def client(assets):
    return TestClient(create_app(str(assets / "models" / "stories260K.bin")))


@pytest.fixture(scope="module")
def model_path(assets):
    return str(assets / "models" / "stories260K.bin")


def test_page_and_load(client, model_path):
    page = client.get("/")
    assert page.status_code == 200 and "Greedy verification" in page.text and model_path in page.text
    info = client.post("/api/load", json={"model": model_path}).json()
    assert info["vocab_size"] == 512 and info["max_seq_len"] == 512
    names = {d["name"]: d for d in info["drafters"]}
    assert names["ngram"]["available"] and names["draft"]["needs"] == "draft_model"
    assert model_path in client.get("/api/models").json()["suggested"]


def test_verify_typed_draft_matches_plain_greedy(client, model_path, stories):
    plain = stories.generate(PREFIX, max_new_tokens=12)
    right = stories.tokenizer.decode(plain.tokens[:4], prev=plain.prompt_tokens[-1])
    r = client.post("/api/verify", json={"model": model_path, "prefix": PREFIX, "draft": right + " zebra zebra", "top_k": 5}).json()
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
        assert all(a["p"] >= b["p"] for a, b in zip(top, top[1:])) and 0 < sum(t["p"] for t in top) <= 1.0001


def test_verify_full_acceptance_gives_bonus(client, stories):
    plain = stories.generate(PREFIX, max_new_tokens=6)
    r = client.post("/api/verify", json={"prefix": PREFIX, "draft_ids": plain.tokens[:5]}).json()
    assert r["num_accepted"] == 5 and r["bonus"]["id"] == plain.tokens[5] and r["correction"] is None
    assert r["positions"][-1]["status"] == "bonus"


def test_verify_drafter_proposes(client, assets):
    r = client.post("/api/verify", json={"prefix": "The cat sat. The cat sat. The cat", "drafter": "ngram", "k": 3}).json()
    assert r["draft"]["source"] == "ngram" and 1 <= r["num_drafted"] <= 3
    r = client.post("/api/verify", json={"prefix": PREFIX, "drafter": "draft", "k": 4,
                                         "draft_model": str(assets / "models" / "stories260K_q80.bin")}).json()
    assert r["draft"]["source"] == "draft" and r["num_drafted"] == 4 and r["num_accepted"] >= 2


def test_tokenize_draft_as_continuation(stories):
    ids = stories.encode("Once upon a ti")
    assert stories.tokenizer.decode(tokenize_draft(stories, ids, "Once upon a ti", "me"), prev=ids[-1]) == "me"
    ids = stories.encode("Once upon a time")
    d = tokenize_draft(stories, ids, "Once upon a time", ", there was")
    assert stories.encode("Once upon a time, there was") == ids + d
    assert stories.tokenizer.decode(d, prev=ids[-1]) == ", there was"


def test_step_through(client, stories):
    r = client.post("/api/step", json={"prefix": PREFIX, "drafter": "ngram", "k": 3, "max_new_tokens": 20}).json()
    assert r["identical_to_plain"] and r["stats"]["target_forwards"] == len(r["steps"])
    emitted = [t["id"] for s in r["steps"] for t in s["emitted"]]
    assert emitted == stories.generate(PREFIX, max_new_tokens=20).tokens
    for s in r["steps"]:
        n, d = s["num_accepted"], s["num_drafted"]
        assert len(s["target_choice"]) == d + 1
        assert [t["id"] for t in s["emitted"]][: n] == [t["id"] for t in s["draft"]][:n]
        assert s["emitted"][n]["id"] == s["target_choice"][n]["id"] if len(s["emitted"]) > n else True
        assert [t["id"] for t in s["discarded"]] == [t["id"] for t in s["draft"]][n + 1 :]
        assert s["cost_seconds"] == pytest.approx(s["draft_seconds"] + s["verify_seconds"])
        assert s["plain_cost_seconds"] == pytest.approx(r["plain_step_seconds"] * len(s["emitted"]))


@pytest.mark.parametrize(
    "path, body, status, words",
    [
        ("/api/verify", {"prefix": "", "draft": " hi"}, 400, "prefix is empty"),
        ("/api/verify", {"prefix": "   ", "draft": " hi"}, 400, "prefix is empty"),
        ("/api/verify", {"prefix": "Hi", "draft": " a" * 600}, 400, "longer than the model's context"),
        ("/api/verify", {"prefix": "Hi", "draft_ids": [1] * 70}, 400, "at most 64"),
        ("/api/verify", {"prefix": "Hi", "draft_ids": [9999]}, 400, "out of range"),
        ("/api/verify", {"model": "/no/such/model.bin", "prefix": "Hi", "draft": " a"}, 404, "model not found"),
        ("/api/verify", {"model": "", "prefix": "Hi", "draft": " a"}, 400, "no model given"),
        ("/api/verify", {"prefix": "Hi"}, 400, "no draft"),
        ("/api/verify", {"prefix": "Hi", "drafter": "nope"}, 400, "unknown drafter"),
        ("/api/verify", {"prefix": "Hi", "drafter": "draft"}, 400, "needs a draft model"),
        ("/api/verify", {"prefix": "Hi", "draft": " a", "top_k": 0}, 400, "top_k"),
        ("/api/verify", {"draft": " a"}, 422, "prefix"),
        ("/api/load", {"model": "/no/such/model.bin"}, 404, "model not found"),
        ("/api/step", {"prefix": "", "drafter": "ngram"}, 400, "prefix is empty"),
        ("/api/step", {"prefix": "Hi", "drafter": "ngram", "k": 0}, 400, "D (draft length)"),
    ],
)
def test_bad_input_is_a_clear_4xx_and_the_server_keeps_running(client, path, body, status, words):
    r = client.post(path, json=body)
    assert r.status_code == status
    assert words in r.json()["error"]
    assert client.post("/api/verify", json={"prefix": "Hi", "draft": " there"}).status_code == 200


def test_malformed_json(client):
    r = client.post("/api/verify", content=b"{not json", headers={"Content-Type": "application/json"})
    assert r.status_code == 422 and r.json()["error"]


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
    from mtpspec.server.verify_page import available_drafters, verify_draft

    cfg = HybridConfig(
        vocab_size=16, hidden_size=32, num_layers=2, layer_types=("linear_attention", "full_attention"), num_heads=4,
        num_kv_heads=2, head_dim=16, intermediate_size=48, max_seq_len=64, linear_key_head_dim=8, linear_value_head_dim=8,
        linear_num_key_heads=2, linear_num_value_heads=4, mtp_num_layers=1, tie_embeddings=False,
    )
    torch.manual_seed(0)
    model = Model(module=HybridLM(cfg).eval(), tokenizer=CharTokenizer())
    assert {d["name"]: d["available"] for d in available_drafters(model)}["mtp"]
    r = verify_draft(model, "abcabcabc", drafter="mtp", k=3, top_k=4)
    assert r["draft"]["source"] == "mtp" and r["num_drafted"] == 3 and len(r["positions"]) == 4
    assert [t["id"] for t in r["emitted"]][: r["num_accepted"]] == r["draft"]["ids"][: r["num_accepted"]]


def test_mtpspec_serve_command_runs_a_real_server(assets):
    """`mtpspec serve` as a user runs it: a subprocess on 127.0.0.1, bad requests, then a good one; always stopped."""
    import socket
    import subprocess
    import sys
    import time

    import httpx

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    model = str(assets / "models" / "stories260K.bin")
    proc = subprocess.Popen([sys.executable, "-c", "import sys; from mtpspec.cli import main; sys.exit(main())", "serve", "--model", model, "--port", str(port)],
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
        assert httpx.post(url + "/api/verify", json={"model": "/no/such.bin", "prefix": "a", "draft": " b"}, timeout=30).status_code == 404
        assert httpx.post(url + "/api/verify", json={"model": model, "prefix": "", "draft": " b"}, timeout=30).status_code == 400
        r = httpx.post(url + "/api/verify", json={"model": model, "prefix": "Once upon a time", "draft": ", there was"}, timeout=30)
        assert r.status_code == 200 and r.json()["num_accepted"] == 3
        assert model in httpx.get(url + "/", timeout=10).text
    finally:
        proc.terminate()
        try:
            proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(timeout=10)


def test_hf_directory_with_mtp_head_on_the_page(client, tmp_path):
    """A Hugging Face directory (tiny Qwen3.5 with mtp.* weights, no-BOS tokenizer): loaded by path, mtp offered and used."""
    from qwen35_tiny import save_hf

    save_hf("qwen35", tmp_path, mtp=True)
    info = client.post("/api/load", json={"model": str(tmp_path)}).json()
    assert {d["name"]: d["available"] for d in info["drafters"]}["mtp"]
    r = client.post("/api/verify", json={"model": str(tmp_path), "prefix": "w3 w4 w5", "drafter": "mtp", "k": 3}).json()
    assert r["draft"]["source"] == "mtp" and r["num_drafted"] == 3 and len(r["positions"]) == 4
    assert [t["id"] for t in r["prefix"]["tokens"]] == r["prefix"]["ids"] == [3, 4, 5]  # no BOS to hide
    r = client.post("/api/verify", json={"model": str(tmp_path), "prefix": "w3 w4 w5", "draft": " w6 w7"}).json()
    assert r["draft"]["ids"] == [6, 7] and r["draft"]["text"] == " w6 w7"

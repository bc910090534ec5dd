"""Our native models against transformers 5.24 on tiny random checkpoints (fp32): logits and greedy text."""

from __future__ import annotations

import json

import pytest
import torch

from mtpspec.cli import main
from mtpspec.loading import load_checkpoint
from qwen35_tiny import save_hf

KINDS = [("qwen35", False), ("qwen35", True), ("qwen3next", False), ("llama", False), ("llama", True), ("qwen3", False)]
TOL = 1e-4


@pytest.fixture(scope="module", params=KINDS, ids=[f"{k}{'-tied' if t else ''}" for k, t in KINDS])
def ckpt(request, tmp_path_factory):
    kind, tie = request.param
    d = tmp_path_factory.mktemp(kind)
    ref = save_hf(kind, d, mtp=True, tie=tie)
    ours, tok = load_checkpoint(d, dtype="fp32")
    return kind, d, ref, ours, tok


def _hf_step(ref, ids, cache):
    with torch.no_grad():
        out = ref(ids[None], cache=cache, use_cache=True)
    return out.logits[0], out.past_key_values if getattr(out, "past_key_values", None) is not None else out.cache


def test_prefill_and_cached_decode_match_transformers(ckpt):
    kind, _, ref, ours, _ = ckpt
    g = torch.Generator().manual_seed(0)
    prompt = torch.randint(0, ours.vocab_size, (40,), generator=g)  # > 16: the chunked DeltaNet path
    cache = ours.new_cache()
    want, hf_cache = _hf_step(ref, prompt, None)
    got = ours.forward_tokens(prompt, cache).logits
    assert (got - want).abs().max().item() < TOL, f"{kind} prefill"
    for t in (1, 1, 5, 1, 3):  # one-token decode steps and short (recurrent-path) windows
        ids = torch.randint(0, ours.vocab_size, (t,), generator=g)
        want, hf_cache = _hf_step(ref, ids, hf_cache)
        got = ours.forward_tokens(ids, cache).logits
        assert (got - want).abs().max().item() < TOL, f"{kind} decode of {t}"


def _generate_json(capsys, d, *extra):
    assert main(["generate", "w3 w5 w7 w9 w11", "--model", str(d), "--max-new-tokens", "24", "--json", *extra]) == 0
    return json.loads(capsys.readouterr().out)


def test_cli_greedy_equals_transformers_generate(ckpt, capsys):
    kind, d, ref, _, tok = ckpt
    res = _generate_json(capsys, d)
    ids = torch.tensor([tok.encode("w3 w5 w7 w9 w11")])
    assert res["prompt_tokens"] == ids[0].tolist()
    with torch.no_grad():
        hf = ref.generate(ids, max_new_tokens=24, do_sample=False, pad_token_id=0, eos_token_id=None)
    assert res["tokens"] == hf[0, ids.shape[1]:].tolist()
    assert res["text"] == tok.decode(res["tokens"], prev=ids[0, -1].item())
    drafters = ["ngram"] + (["mtp"] if kind in ("qwen35", "qwen3next") else [])
    for drafter in drafters:
        assert _generate_json(capsys, d, "--drafter", drafter, "--k", "3")["tokens"] == res["tokens"], drafter

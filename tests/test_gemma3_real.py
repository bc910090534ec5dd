"""Gemma 3 270M from its public Q4_K_M GGUF: the function is transformers', speculation on it is lossless.

Two models come from the one file:
- the quantized model (the default, fp32 activations): every matrix stays in its block type and runs on the block
  kernel, which rounds activations to 8 bits per 32 inputs, as llama.cpp's CPU kernels do. Each row of a product
  is computed as its one-row product is, so speculation is exactly lossless against this model: every drafter's
  greedy output equals its own plain greedy output, alone and in a batch.
- the dequantized model (dequantize=True, or fp64): the file's weights dequantized exactly, ordinary layers. This is
  the function transformers computes when it loads the file: equal to it in fp64 (1e-10 of the logits' scale), and
  the same greedy text in fp32.
"""

from __future__ import annotations

import pytest
import torch

import mtpspec
from conftest_gemma import gemma_path
from mtpspec.hf_reference import hf_fp64_copy
from mtpspec.loading.gguf_model import load_gguf_model
from mtpspec.prompts import load_prompts

N_NEW = 24


@pytest.fixture(scope="module")
def gemma():
    """The quantized model (block kernels) with its tokenizer, as `mtpspec.load` gives it."""
    return mtpspec.load(str(gemma_path()))


@pytest.fixture(scope="module")
def prompts(gemma):
    """Held-out prompts of the three kinds the benchmarks use: code, chat, summaries (short, so tests stay fast)."""
    out = []
    for name in ("humaneval", "mt_bench", "spec_bench"):
        ps = [p for p in load_prompts(name, limit=40) if name != "spec_bench" or p.category == "summarization"]
        text = ps[0].text if name != "spec_bench" else ps[0].text[-600:]
        out.append(gemma.tokenizer.encode(text)[-160:])
    return out


@pytest.fixture(scope="module")
def hf_gguf():
    """transformers' own load of the file (its GGUF path, dequantized to fp32)."""
    transformers = pytest.importorskip("transformers")
    pytest.importorskip("accelerate")
    path = gemma_path()
    transformers.logging.set_verbosity_error()
    return transformers.AutoModelForCausalLM.from_pretrained(str(path.parent), gguf_file=path.name, dtype=torch.float32).eval()


def _plain(gemma, ids, **kw):
    return gemma.generate(list(ids), drafter="none", max_new_tokens=N_NEW, **kw).tokens


def test_the_quantized_model_keeps_its_blocks(gemma):
    """Every matrix stays in its GGUF block type: resident weights about the file's size, not 4x it."""
    from mtpspec.models.blocks import BlockEmbedding, holds_blocks

    m = gemma.module
    blocks = [x for x in m.modules() if holds_blocks(x)]
    assert isinstance(m.model.embed_tokens, BlockEmbedding) and m.lm_head.qweight is m.model.embed_tokens.qweight
    assert len(blocks) == 1 + 1 + 18 * 7  # embedding, tied head, 7 matrices a layer
    held = sum(x.qweight.nbytes for x in blocks if x is not m.lm_head)
    held += sum(p.numel() * p.element_size() for p in m.parameters())
    assert held < 1.05 * gemma_path().stat().st_size


def test_greedy_text(gemma):
    """A golden continuation of a held-out code prompt from the quantized model (the block kernel's own rounding)."""
    res = gemma.generate("def fibonacci(n):\n", drafter="none", max_new_tokens=16)
    assert res.text.startswith("    if n == 0:\n        return 0\n")


@pytest.mark.parametrize("drafter,k,extra", [
    ("lookahead", 3, {}), ("suffix", 4, {}), ("ngram", 3, {"tree": 6}),
    ("mtp", 3, {}),  # the shipped head (models/heads/gemma3-270m-mtp); its trees and lookup shortcut in make test-slow
    pytest.param("ngram", 4, {}, marks=pytest.mark.slow), pytest.param("ngram", 4, {"exact": True}, marks=pytest.mark.slow),
    pytest.param("mtp", 3, {"tree": 8}, marks=pytest.mark.slow), pytest.param("mtp", 2, {"mtp_lookup": 3}, marks=pytest.mark.slow),
])
def test_every_drafter_is_lossless_on_gemma(gemma, prompts, drafter, k, extra):
    for ids in prompts:
        want = _plain(gemma, ids)
        res = gemma.generate(list(ids), drafter=drafter, k=k, max_new_tokens=N_NEW, **extra)
        assert res.tokens == want, (drafter, extra)


def test_a_batch_equals_each_prompt_alone(gemma, prompts):
    alone = [_plain(gemma, ids) for ids in prompts]
    for drafter in ("none", "ngram", "mtp"):
        batch = gemma.generate_batch([list(p) for p in prompts], drafter=drafter, k=3, max_new_tokens=N_NEW)
        assert [r.tokens for r in batch] == alone, drafter


def test_the_shipped_head_drafts_by_default_and_accepts(gemma, prompts):
    """`--drafter mtp` on the Gemma file drafts with the head trained for it (its MODEL_CARD: mean accepted length 1.59
    at D = 3 on the held-out prompts); on a held-out code prompt it gains tokens per step. `auto` (the default) drafts
    with prompt lookup: the file has no MTP module of its own."""
    from mtpspec.cli import auto_drafter

    assert gemma.module.default_head is not None and auto_drafter(gemma.module) == "ngram"
    res = gemma.generate(list(prompts[0]), drafter="mtp", k=3, max_new_tokens=48)
    assert res.tokens == gemma.generate(list(prompts[0]), drafter="none", max_new_tokens=48).tokens
    assert res.stats.mean_accepted_length > 1.25, res.stats


def test_sampling_with_the_head_is_the_targets_distribution(gemma):
    """Rejection sampling against the trained head on the real model: the first two tokens after a prompt, sampled
    with top-k 3 (9 outcomes), are distributed as plain sampling's exact joint distribution (chi-square)."""
    from mtpspec.sampling import Sampler, SamplingParams
    from test_mtp_lossless import _chi_square_ok

    m, params = gemma.module, SamplingParams(temperature=1.0, top_k=3)
    ids = gemma.tokenizer.encode("def add(a, b):\n    return")
    s = Sampler(params)
    with torch.inference_mode():
        p1 = s.probs(m.forward_tokens(torch.tensor(ids), m.new_cache()).logits[-1])  # (V,)
        firsts = p1.nonzero().flatten().tolist()
        joint = {(a, b): float(p1[a]) * float(q) for a in firsts
                 for b, q in enumerate(s.probs(m.forward_tokens(torch.tensor(ids + [a]), m.new_cache()).logits[-1]).tolist()) if q > 0}
    keys = sorted(joint)
    counts, n, drafted = torch.zeros(len(keys)), 64, 0
    for seed in range(n):
        r = gemma.generate(list(ids), drafter="mtp", k=2, max_new_tokens=2, temperature=1.0, top_k=3, seed=seed)
        counts[keys.index(tuple(r.tokens))] += 1
        drafted += r.stats.draft_tokens
    assert drafted > 0
    ok, stat, df = _chi_square_ok(counts, torch.tensor([joint[k] for k in keys], dtype=torch.float64), n)
    assert ok, f"chi-square {stat:.1f} with {df} degrees of freedom"


def test_seeded_sampling_text_is_plains_with_every_control(gemma, prompts):
    """Seeded sampling (Gumbel-max: the text a function of the seed) over the 262k-token vocabulary, through top-p's
    prefix nucleus, top-k's leading tokens, min-p and the penalties: n-gram speculation and the head emit plain's
    text, and a 3-sequence batch each sequence's own."""
    kw = dict(temperature=0.8, top_p=0.9, top_k=50, min_p=0.02, repetition_penalty=1.1, presence_penalty=0.3, seed=5,
              max_new_tokens=N_NEW)
    want = [gemma.generate(list(ids), drafter="none", **kw).tokens for ids in prompts]
    for drafter, k in (("ngram", 4), ("mtp", 3)):
        assert [gemma.generate(list(ids), drafter=drafter, k=k, **kw).tokens for ids in prompts] == want, drafter
    batch = gemma.generate_batch([list(ids) for ids in prompts], drafter="ngram", k=4, **{**kw, "seed": 5})
    assert batch[0].tokens == want[0]  # (sequence i of a batch samples with seed + i)


def test_verify_rows_equal_plain_steps_bitwise(gemma, prompts):
    """A verify window's logits, row by row, are the one-token steps' logits: the row-invariance losslessness rests on."""
    m = gemma.module
    ids = torch.tensor(prompts[0])
    window = torch.tensor(prompts[1][:5])
    a, b = m.new_cache(), m.new_cache()
    m.forward_tokens(ids, a, logits=False)
    m.forward_tokens(ids, b, logits=False)
    together = m.forward_tokens(window, a).logits  # (5, V)
    alone = torch.cat([m.forward_tokens(window[i : i + 1], b).logits for i in range(5)])
    assert torch.equal(together, alone)


@pytest.mark.slow  # 14 s beside the fp64 parity below (the same function to 1e-10)
def test_dequantized_greedy_equals_transformers(hf_gguf, prompts):
    """The file dequantized (fp32): the same greedy text as transformers' own load of the file."""
    ours = load_gguf_model(gemma_path(), dequantize=True)
    for ids in prompts[:2]:
        x = torch.tensor([ids])
        with torch.no_grad():
            want = hf_gguf.generate(x, max_new_tokens=12, do_sample=False, attention_mask=torch.ones_like(x))[0, len(ids):]
        cache, got = ours.new_cache(), []
        out = ours.forward_tokens(torch.tensor(ids), cache)
        for _ in range(12):
            got.append(int(out.logits[-1].argmax()))
            out = ours.forward_tokens(torch.tensor(got[-1:]), cache)
        assert got == want.tolist()


# ~90 s (transformers' own GGUF load ~60 s, two fp64 forwards of 560 tokens): in `make test-slow`, to keep the default
# suite under its 15 minutes; the default suite keeps the same check on small gemma3 GGUF files written as llama.cpp's
# converter writes them (test_gguf_dense.py::test_fp64_equals_transformers, past the sliding window too)
@pytest.mark.slow
def test_dequantized_fp64_equals_transformers_fp64(hf_gguf, prompts):
    """In fp64 the dequantized model is transformers' function to 1e-10 of the scale: the final hidden states of a
    549-token prefill, a plain step and windows of 5 and 5 (the context crossing the 512-token sliding window), and the
    logits of the last 11 positions."""
    twin = hf_fp64_copy(hf_gguf)
    ours = load_gguf_model(gemma_path(), dtype=torch.float64)
    ids = torch.tensor(((prompts[0] + prompts[1] + prompts[2]) * 8)[:560])
    with torch.no_grad():
        h_want = twin.model(input_ids=ids[None]).last_hidden_state[0]  # (T, H) after the final norm
        want = twin.lm_head(h_want[549:])  # (11, V)
    cache = ours.new_cache()
    outs = [ours.forward_tokens(ids[:549], cache, logits=False)] + [
        ours.forward_tokens(ids[a:b], cache) for a, b in ((549, 550), (550, 555), (555, 560))]
    hidden = torch.cat([o.hidden for o in outs])
    logits = torch.cat([o.logits for o in outs[1:]])
    assert ((hidden - h_want).abs().max() / h_want.abs().max()).item() < 1e-10
    assert ((logits - want).abs().max() / want.abs().max()).item() < 1e-10


def test_chat_turns_in_gemmas_format(gemma):
    """The file has no chat template: Gemma's turn format stands in, and <end_of_turn> stops a reply."""
    import jinja2.sandbox

    tok = gemma.tokenizer
    text = jinja2.sandbox.ImmutableSandboxedEnvironment().from_string(tok.chat_template).render(
        messages=[{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"},
                  {"role": "assistant", "content": "Hello!"}, {"role": "user", "content": "A fruit?"}],
        add_generation_prompt=True, bos_token="<bos>")
    assert text == ("<bos><start_of_turn>user\nBe brief.\n\nHi<end_of_turn>\n<start_of_turn>model\nHello!<end_of_turn>\n"
                    "<start_of_turn>user\nA fruit?<end_of_turn>\n<start_of_turn>model\n")
    assert tok.stop_ids == (1, 106)


def test_a_chats_next_turn_reuses_the_earlier_turns(gemma):
    """The server keeps finished requests' KV (--prefix-cache): a chat's second turn copies the first turn's
    context instead of prefilling it (usage.prompt_tokens_details.cached_tokens), with plain's text."""
    import httpx

    from mtpspec.chat import ChatTemplate
    from mtpspec.server.options import ServeOptions
    from mtpspec.server.registry import load_served
    from test_openai_server import running

    served = load_served([f"gemma={gemma_path()}"])
    chat = ChatTemplate.for_tokenizer(gemma.tokenizer)
    messages = [{"role": "user", "content": "Write a Python function that returns the n-th Fibonacci number."}]
    with running(served, ServeOptions(drafter="ngram", k=3, max_batch=2)) as (url, _):
        body = {"model": "gemma", "max_tokens": 20, "temperature": 0}
        first = httpx.post(url + "/v1/chat/completions", json=body | {"messages": messages}, timeout=120).json()
        messages += [first["choices"][0]["message"], {"role": "user", "content": "Now make it iterative."}]
        second = httpx.post(url + "/v1/chat/completions", json=body | {"messages": messages}, timeout=120).json()
        metrics = httpx.get(url + "/metrics").text
    assert first["usage"]["prompt_tokens_details"]["cached_tokens"] == 0
    ids = chat.prompt_ids(gemma, messages)
    cached = second["usage"]["prompt_tokens_details"]["cached_tokens"]
    assert second["usage"]["prompt_tokens"] == len(ids) and first["usage"]["prompt_tokens"] + 15 < cached < len(ids)
    assert second["choices"][0]["message"]["content"] == gemma.tokenizer.decode(_plain(gemma, ids)[:20], prev=ids[-1])
    counts = {line.split()[0]: float(line.split()[1]) for line in metrics.splitlines() if line.startswith("mtpspec_prompt_tokens")}
    assert counts == {"mtpspec_prompt_tokens_total": first["usage"]["prompt_tokens"] + len(ids),
                      "mtpspec_prompt_tokens_cached_total": cached} | {k: v for k, v in counts.items() if k.endswith("_created")}


def test_the_grammar_tokenizer_from_pieces_is_the_json_ones(gemma):
    """llguidance's tokenizer for Gemma is built from the SentencePiece pieces (grammar._SentencePieceBytes), not from
    the `tokenizers` JSON: the same special tokens, the same bytes, and the same mask at every state of a JSON object,
    a regex and a Lark grammar (a markup token, special to llguidance, refused by both)."""
    from llguidance import LLMatcher, LLTokenizer

    from mtpspec import Grammar
    from mtpspec.grammar import ll_tokenizer

    tok, n = gemma.tokenizer, gemma.module.vocab_size
    ours = ll_tokenizer(tok, n)
    ref = LLTokenizer(tok.tokenizer.to_str(), n_vocab=n, eos_token=tok.stop_ids[0])
    assert [i for i in range(n) if ours.is_special_token(i)] == [i for i in range(n) if ref.is_special_token(i)]
    assert all(ours.decode_bytes([i]) == ref.decode_bytes([i]) for i in range(0, n, 97))
    # (grammar, text, the token index both refuse: a markup token, special to llguidance; None: every token taken)
    cases = [(Grammar.json_object(), '{"name": "Bob the builder", "n": [1, 2.5e3], "ok": true, "t": "a\\tb"}', None),
             (Grammar.json_object(), '{"html": "a <b>bold</b> word"}', 6),
             (Grammar.regex(r"[a-z <>/]+\."), "see <table> here.", 2),
             (Grammar.lark('start: "def " /[a-z_]+/ "(" ")" ":"'), "def my_func():", None)]
    for grammar, text, refused in cases:
        matchers = [LLMatcher(t, grammar.llguidance(), log_level=0) for t in (ours, ref)]
        ids = tok.encode_plain(text)
        for step, token in enumerate(ids + [None]):
            masks = []
            for m in matchers:
                bits = torch.zeros((n + 31) // 32, dtype=torch.int32)
                m.unsafe_compute_mask_ptr(bits.data_ptr(), bits.numel() * 4)
                masks.append(bits)
            assert torch.equal(*masks), (text, step)
            if token is None:
                break
            took = [m.consume_token(token) for m in matchers]
            assert took == [step != refused] * 2, (text, step)
            if step == refused:
                break
        assert step == (len(ids) if refused is None else refused), text


def test_a_conversations_turns_reuse_the_earlier_ones(gemma, capsys, monkeypatch):
    """Model.chat with a PrefixStore (and `mtpspec chat`): each turn copies the conversation so far instead of
    prefilling it, with the text a fresh prefill gives."""
    import io

    from mtpspec import PrefixStore
    from mtpspec.cli import main

    turns = ["Write a Python function that adds two numbers.", "Now one that multiplies them."]
    store, messages, replies = PrefixStore(4096), [], []
    for i, text in enumerate(turns):
        messages.append({"role": "user", "content": text})
        kept = gemma.chat(messages, drafter="ngram", k=3, max_new_tokens=16, prefixes=store)
        fresh = gemma.chat(messages, drafter="ngram", k=3, max_new_tokens=16)
        assert kept.tokens == fresh.tokens and (kept.stats.cached_tokens > 16) == (i > 0) and fresh.stats.cached_tokens == 0
        messages.append({"role": "assistant", "content": kept.text})
        replies.append(kept.text)
    monkeypatch.setattr("sys.stdin", io.StringIO("".join(t + "\n" for t in turns)))
    assert main(["chat", "--model", str(gemma_path()), "--drafter", "ngram", "--k", "3", "--max-new-tokens", "16", "--threads", "1"]) == 0
    out, err = capsys.readouterr()
    assert out == "".join(r + "\n" for r in replies) and "prompt positions reused" in err.splitlines()[-1]

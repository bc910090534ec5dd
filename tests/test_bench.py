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
    c = CostModel(t1=1.0, ratio=[1.0, 1.0, 1.0, 1.0, 1.0], draft_steps={"draft": [1.0, 2.0, 3.0]})
    assert c.predict_speedup("ngram", 8, [3, 3]) == pytest.approx(4.0)  # not measured: free; 8 tokens in 2 steps of T(4) = T(1)
    assert c.predict_speedup("draft", 8, [3, 3]) == pytest.approx(1.0)  # drafts cost a step each
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
    assert len(res["cost_model"]["ratio"]) == 9 and res["cost_model"]["threads"] == 1  # T(1..9): verify of up to k_max = 8 drafts
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
    with pytest.raises(ConfigError, match="--keep mean, median or best"):  # refused before anything loads
        run_benchmark("nowhere", "tinystories", ["none"], [2], tmp_path, keep="middle")


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
    assert len(steps) == 8  # k_max of --k auto: the policy may choose any depth up to it
    assert set(res["config"]["phase_seconds"]) == {"load", "cost_model", "warm_up", "runs"}
    with pytest.raises(ConfigError, match="eagle head"):
        run_benchmark(str(m / "stories260K.bin"), "spec_bench", ["draft"], [2], tmp_path, tokenizer=str(m / "tok512.bin"),
                      draft_model=str(head), limit=1, max_new_tokens=4, threads=1, cost_model=False, progress=False)
    with pytest.raises(ConfigError, match="does not include eagle"):
        run_benchmark(str(m / "stories260K.bin"), "spec_bench", ["medusa"], [2], tmp_path, tokenizer=str(m / "tok512.bin"),
                      draft_model=str(head), limit=1, max_new_tokens=4, threads=1, cost_model=False, progress=False)


@pytest.mark.slow  # 25 s, most of it the cost model's timing loops; the default suite has its parts: the stateful peer's
# refusal and a hybrid's drafter cost (the two tests below), the demo's export run by transformers (test_export.py)
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
    assert len(cm["draft_steps"]["mtp"]) == 8 and "mtp" in cm["prefill_ratio"]
    assert len(cm["verify_steps"]["mtp"]) == len(cm["draft_steps"]["mtp"]) + 1  # d = 0 (plain) .. 8
    assert json.loads((tmp_path / "hf" / "target" / "config.json").read_text())["model_type"] == "qwen3_5_text"


def test_hf_peer_names_why_it_runs_no_assisted_generation_on_a_hybrid(tmp_path):
    """transformers crops no recurrent state: on a (tiny) Qwen3.5 directory the peer runs plain decoding only,
    and says why it skips prompt lookup and draft models."""
    import mtpspec
    from mtpspec.bench.peers import HFRunner, peer_model
    from qwen35_tiny import save_hf

    save_hf("qwen35", tmp_path / "hf", mtp=True, seed=3)
    model = mtpspec.load(tmp_path / "hf")
    runner = HFRunner(peer_model(model, tmp_path, "target"), None, model.tokenizer.stop_ids)
    assert runner.unsupported(Method("transformers", "none", None)) is None
    for drafter in ("ngram", "draft"):
        assert "stateful" in runner.unsupported(Method("transformers", drafter, 2))


def test_drafter_cost_on_the_demo_hybrid():
    """The steady-state timing on a hybrid target (its Gated DeltaNet state rolled back between repeats): one
    draft-step time per depth, verify times for d = 0 .. k_max."""
    import mtpspec
    from mtpspec.bench.drafter_cost import time_drafter
    from mtpspec.drafters import make_drafter

    demo = mtpspec.load("demo")
    dc = time_drafter(demo.module, lambda: make_drafter("mtp", demo.module), k_max=3, context=64,
                      tokens=demo.encode("def add(a, b):\n    return a + b\n"), repeat=3, min_repeat=2)
    assert len(dc.steps) == 3 and 2 <= dc.samples <= 3
    assert len(dc.verify) == 4  # d = 0 (plain steps) .. 3


@pytest.mark.parametrize("kind", ["mtp", "medusa"])
def test_drafter_cost_on_trained_heads(stories, kind):
    """The generic steady-state timing runs every drafter through propose + commit, heads included
    (what it computes from the clock is tested with a fake clock below)."""
    from mtpspec.bench.drafter_cost import time_drafter
    from mtpspec.drafters import make_drafter
    from mtpspec.models.heads import load_head

    head = load_head(Path(__file__).resolve().parents[1] / "models" / "heads" / f"stories260K-{kind}")
    dc = time_drafter(stories.module, lambda: make_drafter(kind, stories.module, draft_model=head), k_max=3, context=64,
                      tokens=stories.encode("Once upon a time, there was a cat."), repeat=3, min_repeat=2)
    assert len(dc.steps) == 3 and 2 <= dc.samples <= 3
    assert len(dc.verify) == 4  # d = 0 (plain steps) .. 3


def test_drafter_cost_counts_propose_and_commit_as_draft_time(stories, monkeypatch):
    """With a clock that moves only by the work done: a step's draft time is exactly propose + commit,
    its verify time the target forward over d + 1 tokens, and the prefill ratio the first step's
    catch-up over the target's prefill."""
    from mtpspec import engine
    from mtpspec.bench import drafter_cost
    from mtpspec.types import Draft

    clock = FakeClock()
    monkeypatch.setattr(drafter_cost, "perf_counter", clock)
    monkeypatch.setattr(engine, "perf_counter", clock)  # the step's own timings (StepRecord)
    target = stories.module

    class Timed:  # the real target; each forward costs 10 ms + 1 ms per token
        max_seq_len, vocab_size = target.max_seq_len, target.vocab_size

        def new_cache(self):
            return target.new_cache()

        def forward_tokens(self, tokens, cache, exact=False, logits=True, tree=None, prefill=False, taps=()):
            clock.work(0.010 + 0.001 * tokens.shape[0])
            return target.forward_tokens(tokens, cache, exact, logits, tree, prefill, taps)

    class Drafter:  # propose(d) costs 2 ms per draft (+ 4 ms of catch-up the first time), commit 0.5 ms
        prefill_logits = False
        prefill_hidden = False
        taps = ()

        def prefill(self, context, out, sampler):
            self.fresh = True

        def propose(self, context, d):
            clock.work(0.002 * d + (0.004 if self.fresh else 0.0))
            self.fresh = False
            return Draft(tokens=context[-1:].repeat(d))

        def commit(self, verdict, out):
            clock.work(0.0005)

    dc = drafter_cost.time_drafter(Timed(), Drafter, k_max=3, context=40, repeat=4, min_repeat=2, window=16)
    assert dc.steps == [pytest.approx(0.002 * d + 0.0005, abs=1e-9) for d in (1, 2, 3)]
    assert dc.verify == [pytest.approx(0.010 + 0.001 * (d + 1), abs=1e-9) for d in (0, 1, 2, 3)]
    prefill = 0.010 + 0.001 * (40 - 16 // 2 - 1)  # the window starts at context - window / 2; all but the last token
    assert dc.prefill_ratio == pytest.approx(0.004 / prefill, rel=1e-6)


class FakeClock:
    """A clock that moves only when the code under test says work was done: timing logic is tested
    for what it computes, not for how fast or busy the machine is."""

    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now

    def work(self, seconds: float) -> None:
        self.now += seconds


def test_lockstep_takes_turns_and_does_not_count_time_away(monkeypatch):
    from mtpspec.bench import common
    from mtpspec.bench.common import Lockstep

    clock = FakeClock()
    monkeypatch.setattr(common, "perf_counter", clock)
    log = []

    def job(name, steps, work):
        def f(turn):
            t0 = clock()
            for _ in range(steps):
                clock.work(work)
                log.append(name)
                turn.step_done()
            return clock() - t0 - turn.waited

        return f

    own = Lockstep(slice_seconds=0.0).run([job("a", 3, 0.002), job("b", 5, 0.003)])
    assert log[:2] == ["a", "b"] and log[-2:] == ["b", "b"]  # one step of each per pass (the first in job order), then b alone
    assert all(sorted(log[i : i + 2]) == ["a", "b"] for i in (2, 4))
    assert own == [pytest.approx(3 * 0.002, abs=1e-12), pytest.approx(5 * 0.003, abs=1e-12)]  # own work only
    log.clear()
    own = Lockstep(slice_seconds=0.005).run([job("a", 4, 0.002), job("b", 2, 0.003)])  # a slice holds 3 of a's steps, 2 of b's
    assert log == ["a", "a", "a", "b", "b", "a"]
    assert own == [pytest.approx(0.008, abs=1e-12), pytest.approx(0.006, abs=1e-12)]
    log.clear()
    Lockstep(slice_seconds=10.0).run([job("a", 2, 0.001), job("b", 2, 0.001)])  # a long slice: each runs to the end
    assert log == ["a", "a", "b", "b"]

    def bad(turn):
        turn.step_done()
        raise ValueError("boom")

    with pytest.raises(ValueError, match="boom"):
        Lockstep(slice_seconds=0.0).run([job("a", 2, 0.001), bad])


def test_rounds_are_averaged_or_the_fastest_kept():
    from mtpspec.bench.harness import PLAIN, Run, run_bench

    class Fake:  # plain takes 1, 3, 2 seconds in rounds 0, 1, 2 (mean 2, median 2: 1, 6, 2 below tells them apart)
        def __init__(self, times=(1.0, 3.0, 2.0)):
            self.n, self.times = 0, times

        def run(self, m, p, ids, max_new_tokens, temperature, seed, turn=None):
            self.n += 1
            return Run(m.label, p.id, p.category, len(ids), [5, 6], wall_seconds=self.times[(self.n - 1) % 3],
                       prefill_seconds=0.1, cpu_seconds=None)

    from mtpspec.prompts import Prompt

    p = [Prompt(id="a", category="c", text="x")]
    mean = run_bench([PLAIN], p, [[1, 2]], {"mtpspec": Fake()}, 2, repeat=3, interleave="run")
    assert mean[0].wall_seconds == pytest.approx(2.0) and mean[0].prefill_seconds == pytest.approx(0.1)
    assert mean[0].cpu_seconds is None and mean[0].lossless
    best = run_bench([PLAIN], p, [[1, 2]], {"mtpspec": Fake()}, 2, repeat=3, interleave="run", keep="best")
    assert best[0].wall_seconds == pytest.approx(1.0)
    median = run_bench([PLAIN], p, [[1, 2]], {"mtpspec": Fake((1.0, 6.0, 2.0))}, 2, repeat=3, interleave="run", keep="median")
    assert median[0].wall_seconds == pytest.approx(2.0) and median[0].prefill_seconds == pytest.approx(0.1)


def test_alternate_runs_every_config_on_every_prompt_in_shuffled_orders():
    from mtpspec.alternate import alternate

    log = []
    res = alternate(["a", "b", "c"], ["p", "q"], lambda c, p: log.append((c, p)) or f"{c}{p}{len(log)}", rounds=3, seed=1)
    assert [[[r[:2] for r in tries] for tries in by_prompt] for by_prompt in res] == [
        [[c + p] * 3 for p in "pq"] for c in "abc"]  # [config][prompt][round]
    assert [p for _, p in log] == list("pppqqq" * 3)  # every config on a prompt before the next prompt, round after round
    orders = ["".join(c for c, _ in log[i : i + 3]) for i in range(0, len(log), 3)]
    assert len(set(orders)) > 1 and all(sorted(o) == list("abc") for o in orders)  # a fresh order per (round, prompt)
    assert alternate(["a", "b"], ["p"], None, rounds=1, seed=1, together=lambda cs, p: [c.upper() for c in cs]) == [[["A"]], [["B"]]]


def test_a_peers_split_from_our_text_is_located_and_weighed(stories):
    """Where a peer's greedy text leaves ours: the first differing token (an early stop counts), and our logit
    margin there, which is >= 0 against any other token at our greedy choice."""
    import torch

    from mtpspec.bench.harness import logit_margin, split_at
    from mtpspec.bench.report import markdown

    assert split_at([1, 2, 3], [1, 2, 3]) is None
    assert split_at([1, 2, 3], [1, 5, 3]) == 1 and split_at([1, 2, 3], [1, 2]) == 2
    ids = stories.encode("Once upon a time")
    ours = stories.generate(ids, max_new_tokens=6, drafter="none").tokens
    m = stories.module
    lg = m.forward_tokens(torch.tensor(ids + ours[:3]), m.new_cache()).logits[-1].double()
    other = int(torch.topk(lg, 2).indices[1])
    margin = logit_margin(stories.module, ids + ours[:3], ours[3], other)
    assert margin == pytest.approx(float(lg[ours[3]] - lg[other]), abs=1e-9) and margin >= 0
    runs = [{"method": f"llamacpp:{m}", "prompt_id": "p0", "split": 3, "split_margin": margin} for m in ("plain", "ngram@3")]
    md = markdown({"summary": {"overall": {}, "by_category": {}}, "runs": runs,
                   "config": {"model_name": "m", "prompts_name": "p", "num_prompts": 1, "max_new_tokens": 6, "temperature": 0,
                              "threads": 1, "max_prompt_tokens": 8, "elapsed_seconds": 1.0}})
    assert "Where a peer's greedy text leaves ours" in md and f"| llamacpp:plain and 1 more | p0 | 3 | {margin:.3f} |" in md

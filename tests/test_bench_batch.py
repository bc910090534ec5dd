"""`mtpspec bench --batch`: B sequences decoding together, end to end on stories260K; its CLI errors."""

from __future__ import annotations

import json

import pytest

from mtpspec.bench.batch import parse_batches
from mtpspec.cli import main
from mtpspec.errors import ConfigError


def test_batch_bench_writes_json_markdown_png(tmp_path, assets):
    m = assets / "models"
    out = tmp_path / "b"
    rc = main([
        "bench", "--model", str(m / "stories260K.bin"), "--tokenizer", str(m / "tok512.bin"), "--prompts", "tinystories",
        "--limit", "2", "--max-new-tokens", "8", "--drafters", "ngram", "--k", "2,auto", "--batch", "1,2",
        "--rounds", "2", "--threads", "1", "--no-progress", "--out", str(out),
    ])
    assert rc == 0
    res = json.loads((out / "batch.json").read_text())
    assert set(res) >= {"config", "summary", "runs", "targets", "files"}
    assert res["config"]["batches"] == [1, 2] and res["config"]["methods"] == ["plain", "ngram@2", "ngram@auto"]
    table = res["summary"]["table"]
    for lab in ("plain", "ngram@2", "ngram@auto"):
        for b in ("1", "2"):
            cell = table[lab][b]
            assert cell["tokens_per_second"] > 0 and cell["cpu_tokens_per_second"] > 0 and cell["seconds_per_token"] > 0, (lab, b)
            assert cell["p50_token_latency"] <= cell["p99_token_latency"] and cell["full_tokens_per_second"] > 0
            assert cell["identical"] == "2/2", (lab, b)  # every B decodes both prompts; greedy: every method's tokens are plain's
    assert res["summary"]["mismatches"] == []
    assert res["summary"]["agreement_across_batch"] == {"1": "2/2", "2": "2/2"}
    assert res["summary"]["plain_scaling"]["1"] == pytest.approx(1.0)
    beside = res["summary"]["plain_scaling_beside"]  # plain at B = 2 over one sequence stepped beside it, per round
    assert beside["1"] == 1.0 and beside["2"] > 0 and set(res["summary"]["cpu"]["plain_scaling_beside"]) == {"1", "2"}
    ones = [r for r in res["runs"] if r["method"] == "plain@B=1 beside"]
    assert [(r["batch"], r["round"]) for r in ones] == [(2, 0), (2, 1)] and all(r["decode_tokens"] > 0 for r in ones)
    assert set(res["summary"]["auto"]["ngram@auto"]["2"]) == {"best", "ratio_to_best", "ratio_to_plain", "ratio_of_medians",
                                                              "ratio_to_held_out"}
    assert res["summary"]["full"]["ngram@auto"]["2"]["ratio_to_best"] > 0  # every slot busy: beside, not a target
    assert len(res["runs"]) == 2 * 2 * 3 + 2  # batch sizes x rounds x methods, and the one beside plain at B = 2
    assert all(r["decode_tokens"] > 0 for r in res["runs"])
    assert any("0.97x" in t["target"] for t in res["targets"])
    md = (out / "batch.md").read_text()
    assert "| plain |" in md and "| ngram@auto |" in md and "Targets:" in md and "every slot busy" in md
    assert (out / "bench_batch.png").read_bytes()[:4] == b"\x89PNG"


def test_the_prompt_set_is_cycled_up_to_the_batch_size():
    from mtpspec.bench.batch import cycled

    ids = [[1], [2], [3], [4], [5]]
    assert cycled(ids, 1) == cycled(ids, 5) == ids
    assert cycled(ids, 8) == [[1], [2], [3], [4], [5], [1], [2], [3]]


def test_a_run_keeps_b_sequences_decoding_while_prompts_wait(assets):
    """Continuous batching: 5 prompts queued in one engine of 2 slots; while any prompt waits, every step decodes 2
    sequences (a freed slot is taken in the next step, which also prefills and is not timed), and every prompt
    finishes with the tokens it gets alone."""
    from mtpspec.api import load
    from mtpspec.bench.batch import BatchMethod, _Run

    m = load(assets / "models" / "stories260K.bin", tokenizer=assets / "models" / "tok512.bin")
    ids = [m.encode(t) for t in ("Once upon a time", "The cat sat", "A little girl", "Tom", "The sun")]
    run, sizes = _Run(m, BatchMethod("ngram", 2), ids, 2, 6, {}, 0.0, 0), []
    step = run.engine.step
    run.engine.step = lambda: sizes.append((len(run.engine.waiting), len(run.engine.running), step())) or sizes[-1][2]
    while run.active:
        run.step()
    waited = [(len(rec.seqs), min(2, queued + running)) for queued, running, rec in sizes if queued]
    assert len(waited) >= 3 and all(n == full for n, full in waited)  # (both slots taken while 2 or more were there)
    alone = [_Run(m, BatchMethod("none", 1), [x], 1, 6, {}, 0.0, 0) for x in ids]
    for a in alone:
        while a.active:
            a.step()
    r = run.result(0)
    assert r.tokens == [a.result(0).tokens[0] for a in alone] and r.decode_tokens > 0 and None not in run.start
    # every slot busy: all but the queue's end, where the fifth prompt decodes alone; alone, every step
    assert 0 < r.full_tokens < r.decode_tokens and 0 < r.full_seconds < r.decode_seconds
    assert all(x.full_tokens == x.decode_tokens and x.full_seconds == x.decode_seconds for x in (a.result(0) for a in alone))


def test_an_auto_method_keeps_one_policy_across_prompts_and_rounds(assets):
    """A round over 3 prompts one at a time: one engine per method, its auto policy the caller's, learning throughout."""
    from mtpspec.api import load
    from mtpspec.bench.batch import BatchMethod, run_round

    m = load(assets / "models" / "stories260K.bin", tokenizer=assets / "models" / "tok512.bin")
    ids = [m.encode(t) for t in ("Once upon a time", "The cat sat", "A little girl")]
    methods, policies = [BatchMethod("none", 1), BatchMethod("ngram", "auto")], {}
    runs = run_round(m, methods, ids, 6, {}, batch=1, policies=policies)
    policy = policies["ngram@auto"]
    assert [len(r.tokens) for r in runs] == [3, 3] and runs[0].tokens == runs[1].tokens
    seen = policy.policy(1).T.n
    run_round(m, methods, ids, 6, {}, round_=1, batch=1, policies=policies)
    assert policies["ngram@auto"] is policy and policy.policy(1).T.n > seen > 0


def test_the_sequence_beside_plain_stops_with_it(assets):
    """The one-sequence plain run stepped beside plain at B = 2 is returned last, labelled BESIDE; it stops when plain
    does, which can be midway through a prompt: its result counts the steps it ran and the sequences it finished."""
    from mtpspec.api import load
    from mtpspec.bench.batch import BESIDE, BatchMethod, _Run, run_round

    m = load(assets / "models" / "stories260K.bin", tokenizer=assets / "models" / "tok512.bin")
    ids = [m.encode(t) for t in ("Once upon a time", "The cat sat", "A little girl", "Tom")]
    runs = run_round(m, [BatchMethod("none", 1), BatchMethod("ngram", 2)], ids, 6, {}, batch=2, beside=True)
    assert [r.method for r in runs] == ["plain", "ngram@2", BESIDE] and runs[-1].batch == 2 and runs[-1].tokens_per_second > 0
    assert run_round(m, [BatchMethod("none", 1)], ids, 6, {}, batch=1, beside=True)[-1].method == "plain"  # none at B = 1
    one = _Run(m, BatchMethod("none", 1), ids, 1, 6, {}, 0.0, 0)
    for _ in range(4):  # the first prompt's prefill and 3 of its 5 decode steps
        one.step()
    r = one.result(0)
    assert r.decode_tokens == 3 and r.steps == 3 and r.tokens == []


def _run(method, rnd, tps, batch=2):
    """A BatchRun of `tps` tokens in one second."""
    from mtpspec.bench.batch import BatchRun

    return BatchRun(method=method, batch=batch, round=rnd, decode_tokens=int(tps), decode_seconds=1.0, decode_cpu_seconds=1.0,
                    prefill_seconds=0.0, seconds_per_token=1.0, p50_token_latency=None, p99_token_latency=None,
                    mean_depth=1.0, tokens_per_forward=1.0, steps=1, tokens=[])


def test_ratios_pair_the_methods_round_by_round():
    """auto against its rival is the median over rounds of the ratio within a round (they ran side by side), not the
    ratio of their medians, which here pairs auto's round 1 with the rival's round 2."""
    from mtpspec.bench.batch import BESIDE, BatchMethod, summarize

    speed = [100, 120, 80]  # the machine's speed in each round: every method alike
    runs = [_run("plain", r, 2 * v) for r, v in enumerate(speed)] + [_run("ngram@2", r, 3 * v) for r, v in enumerate(speed)]
    runs += [_run("ngram@auto", r, v) for r, v in enumerate([290, 360, 245])] + [_run(BESIDE, r, v / 2) for r, v in enumerate(speed)]
    methods = [BatchMethod("none", 1), BatchMethod("ngram", 2), BatchMethod("ngram", "auto")]
    s = summarize(runs, methods, [2], greedy=False)
    auto = s["auto"]["ngram@auto"]["2"]
    assert auto["best"] == "ngram@2" and auto["ratio_of_medians"] == pytest.approx(290 / 300)
    assert auto["ratio_to_best"] == pytest.approx(1.0)  # per round: 290/300, 360/360, 245/240
    assert auto["ratio_to_plain"] == pytest.approx(1.5) and s["plain_scaling_beside"] == {"2": pytest.approx(4.0)}


def test_the_held_out_rival_is_picked_on_the_other_rounds():
    """Two rivals that tie, each lucky in one round: the best by median is the one lucky where auto is judged against
    it, so auto ties both and reads 0.99 of it; picked on the other rounds, each round's rival is judged on its own
    luck (1.00)."""
    from mtpspec.bench.batch import BatchMethod, summarize

    rows = {"plain": [50, 50, 50], "ngram@2": [106, 100, 101], "ngram@3": [100, 106, 100], "ngram@auto": [100, 100, 100]}
    runs = [_run(lab, r, v) for lab, vs in rows.items() for r, v in enumerate(vs)]
    methods = [BatchMethod("none", 1), BatchMethod("ngram", 2), BatchMethod("ngram", 3), BatchMethod("ngram", "auto")]
    auto = summarize(runs, methods, [2], greedy=False)["auto"]["ngram@auto"]["2"]
    # in-sample: ngram@2 (median 101); per round 100/106, 100/100, 100/101
    assert auto["best"] == "ngram@2" and auto["ratio_to_best"] == pytest.approx(100 / 101)
    # held out: round 0 judged against ngram@3 (103 in rounds 1-2), round 1 against ngram@2 (103.5), round 2 a tie
    # (103 each: the first listed, ngram@2): 100/100, 100/100, 100/101
    assert auto["ratio_to_held_out"] == pytest.approx(1.0)
    one = summarize([x for x in runs if x.round == 0], methods, [2], greedy=False)["auto"]["ngram@auto"]["2"]
    assert one["ratio_to_held_out"] is None  # one round: no other round to pick on


@pytest.mark.parametrize("value, message", [("0", "must be >= 1, got 0"), ("-1", "must be >= 1, got -1"), ("x", "got 'x'"),
                                            ("1,,y", "got 'y'"), (",", "needs batch sizes")])
def test_parse_batches_errors(value, message):
    with pytest.raises(ConfigError, match=message):
        parse_batches(value)


def test_parse_batches_sorted_once():
    assert parse_batches("4, 1,2,4") == [1, 2, 4]


@pytest.mark.parametrize("extra", [["--batch", "0"], ["--batch", "-1"], ["--batch=-1"], ["--batch", "x"], ["--batch", "1", "--peers"],
                                   ["--batch", "1", "--repeat", "2"], ["--batch", "1", "--rounds", "0"]])
def test_batch_cli_errors_are_one_line(tmp_path, assets, capsys, extra):
    m = assets / "models"
    base = ["bench", "--model", str(m / "stories260K.bin"), "--tokenizer", str(m / "tok512.bin"), "--prompts", "tinystories",
            "--limit", "1", "--max-new-tokens", "4", "--threads", "1", "--no-progress", "--out", str(tmp_path)]
    assert main(base + extra) == 2
    err = capsys.readouterr().err
    assert "mtpspec: error:" in err and "Traceback" not in err


def test_summary_reports_a_mismatch_with_plain():
    """The identity check names the method, batch, round, sequence and first differing token."""
    from mtpspec.bench.batch import BatchMethod, BatchRun, summarize

    def run(method, tokens, rnd=0):
        return BatchRun(method=method, batch=2, round=rnd, decode_tokens=6, decode_seconds=1.0, decode_cpu_seconds=1.0, prefill_seconds=0.1,
                        seconds_per_token=0.3, p50_token_latency=0.3, p99_token_latency=0.4, mean_depth=1.0, tokens_per_forward=1.0, steps=3, tokens=tokens)

    runs = [run("plain", [[1, 2, 3], [4, 5, 6]]), run("ngram@2", [[1, 2, 3], [4, 9, 6]])]
    s = summarize(runs, [BatchMethod("none", 1), BatchMethod("ngram", 2)], [2], greedy=True)
    assert s["table"]["ngram@2"]["2"]["identical"] == "1/2" and s["table"]["plain"]["2"]["identical"] == "2/2"
    assert s["mismatches"] == [{"method": "ngram@2", "batch": 2, "round": 0, "sequence": 1, "first_difference": 1}]
    assert s["table"]["ngram@2"]["2"]["speedup"] == pytest.approx(1.0) and s["plain_scaling"] == {}  # no B = 1 measured
    assert s["plain_scaling_beside"] == {}  # nor a sequence beside plain

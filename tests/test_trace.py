"""`mtpspec trace`: the engine's opt-in step trace, the cells of a step, and the HTML/SVG/PNG it writes."""

from __future__ import annotations

import json
import re
import xml.etree.ElementTree as ET
from html.parser import HTMLParser

import pytest
import torch

from mtpspec.cli import main
from mtpspec.types import StepRecord
from mtpspec.viz.trace import render_html, step_cells, trace_prompts, write_trace

PROMPT = "Once upon a time, there was a little girl named Lily."


class Tok:
    """Token id -> 't<id>' (enough to check which cells a step gets)."""

    def decode(self, ids, prev=1):
        return "".join(f"t{i}" for i in ids)


@pytest.mark.parametrize(
    "draft, n, emitted, kinds",
    [
        ([], 0, [7], ["target"]),  # a plain step
        ([5, 6, 7], 3, [5, 6, 7, 8], ["accepted"] * 3 + ["bonus"]),
        ([5, 6, 7], 1, [5, 9], ["accepted", "recovered", "rejected", "discarded"]),
        ([5, 6], 0, [9], ["recovered", "rejected", "discarded"]),
        ([5, 6, 7], 2, [5], ["accepted", "rejected"]),  # emitted cut at the budget / EOS: only what was kept
    ],
)
def test_step_cells(draft, n, emitted, kinds):
    rec = StepRecord(draft=draft, num_accepted=n, emitted=emitted, draft_seconds=0.0, verify_seconds=0.0)
    cells = step_cells(rec, 1, Tok())
    assert [c.kind for c in cells] == kinds
    assert [c.token for c in cells if c.kind not in ("rejected", "discarded")] == emitted
    assert [c.token for c in cells if c.kind in ("rejected", "discarded")] == draft[n:]


def test_trace_flag_records_probabilities_and_changes_nothing(stories):
    ref = stories.generate(PROMPT, drafter="ngram", k=3, max_new_tokens=24)
    res = stories.generate(PROMPT, drafter="ngram", k=3, max_new_tokens=24, trace=True)
    assert res.tokens == ref.tokens
    assert all(s.p_of_emitted == [] and s.target_choice == [] for s in ref.steps)  # off by default
    ctx = list(res.prompt_tokens)
    starts = [s.start_seconds for s in res.steps]
    assert starts == sorted(starts) and starts[0] >= res.stats.prefill_seconds * 0.5
    for s in res.steps:
        assert len(s.target_choice) == len(s.draft) + 1 and len(s.p_of_draft) == len(s.draft)
        assert len(s.p_of_emitted) == len(s.emitted)
        assert s.emitted[s.num_accepted :] == s.target_choice[s.num_accepted : len(s.emitted)]  # greedy: argmax
        # p of the first emitted token, recomputed from scratch over the context so far
        with torch.inference_mode():
            cache = stories.module.new_cache()
            logits = stories.module.forward_tokens(torch.tensor(ctx), cache).logits[-1]
        assert s.p_of_emitted[0] == pytest.approx(float(torch.softmax(logits, -1)[s.emitted[0]]), abs=1e-4)
        ctx += s.emitted


class _Collect(HTMLParser):
    def __init__(self):
        super().__init__()
        self.svgs: list[dict] = []
        self.stack: list[str] = []

    def handle_starttag(self, tag, attrs):
        a = dict(attrs)
        if tag == "svg":
            self.svgs.append({"attrs": a, "rects": []})
        elif tag == "rect" and self.svgs:
            self.svgs[-1]["rects"].append(a)


@pytest.fixture(scope="module")
def groups(stories, stories_q80):
    return trace_prompts(stories, [PROMPT], [("ngram", 2), ("draft", 3)], draft_model=stories_q80, max_new_tokens=24)


def test_trace_html_has_one_svg_per_run_matching_metrics(groups, tmp_path):
    html_path, png_path = write_trace(groups, tmp_path / "t.html")
    text = html_path.read_text()
    assert text.startswith("<!DOCTYPE html>") and text.rstrip().endswith("</html>")
    assert "http://" not in text.replace('xmlns="http://www.w3.org/2000/svg"', "")  # self-contained: no links out
    assert "<script src" not in text and "<link" not in text
    runs = [r for g in groups for r in g.runs]
    assert [r.label for r in runs] == ["plain decoding", "ngram, D=2", "draft, D=3"]
    for svg in re.findall(r"<svg .*?</svg>", text, flags=re.S):
        ET.fromstring(svg)  # each timeline is well-formed SVG
    p = _Collect()
    p.feed(text)
    assert len(p.svgs) == len(runs)
    plain = runs[0]
    for svg, run in zip(p.svgs, runs):
        a, s = svg["attrs"], run.result.stats
        assert a["class"] == "timeline" and a["data-label"] == run.label
        assert int(a["data-target-forwards"]) == s.target_forwards
        assert int(a["data-new-tokens"]) == len(run.result.tokens)
        assert float(a["data-tokens-per-forward"]) == pytest.approx(s.mean_accepted_length, rel=1e-5)
        assert float(a["data-speedup"]) == pytest.approx(s.tokens_per_second / plain.result.stats.tokens_per_second, rel=1e-5)
        forwards = [r for r in svg["rects"] if r.get("class") == "forward"]
        assert len(forwards) == s.target_forwards  # one box per target forward
        cells = [r["class"].split()[1] for r in svg["rects"] if r.get("class", "").startswith("cell ")]
        emitted = [c for c in cells if c in ("target", "accepted", "recovered", "bonus")]
        assert len(emitted) == len(run.result.tokens)
        assert cells.count("accepted") == s.accepted_tokens
        assert cells.count("rejected") + cells.count("discarded") == s.draft_tokens - s.accepted_tokens
        # boxes are as wide as the forwards took: one scale fits every box (widths are printed to 0.01 px,
        # so each box allows the scales in [(w - 0.005) / s, (w + 0.005) / s]; they must overlap)
        boxes = [(float(r["width"]), st.record.verify_seconds) for r, st in zip(forwards, run.steps) if float(r["width"]) > 0.8]
        assert boxes and max((w - 0.005) / s for w, s in boxes) <= min((w + 0.005) / s for w, s in boxes) * (1 + 1e-9)
    assert runs[2].result.tokens == plain.result.tokens and runs[2].result.stats.mean_accepted_length > 1.5
    data = json.loads(re.search(r'<script type="application/json" id="trace-data">(.*?)</script>', text, re.S).group(1))
    assert data[0]["runs"][1]["target_forwards"] == runs[1].result.stats.target_forwards
    assert png_path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_render_html_several_prompts_share_one_axis(groups):
    text = render_html(groups + groups)
    assert text.count('<svg class="timeline"') == 6
    assert len(set(re.findall(r'<svg class="timeline" width="(\d+)"', text))) == 1


def test_trace_cli(tmp_path, assets, capsys):
    out = tmp_path / "cli.html"
    rc = main(["trace", "Tom and Tom and Tom and", "--model", str(assets / "models" / "stories260K.bin"), "--drafter", "ngram",
               "--ks", "1,2", "--max-new-tokens", "12", "--out", str(out)])
    assert rc == 0
    assert out.exists() and out.with_suffix(".png").exists()
    assert out.read_text().count('<svg class="timeline"') == 3


def test_trace_cli_bad_input(tmp_path, capsys):
    assert main(["trace", "--model", "/no/such/model.bin", "--out", str(tmp_path / "x.html")]) == 2
    assert "model not found" in capsys.readouterr().err
    assert main(["trace", "--model", "demo", "--drafter", "none", "--out", str(tmp_path / "x.html")]) == 2


def test_trace_refuses_an_option_no_drafter_reads():
    """Every drafter option (drafters.OPTION_TYPES, not a hand-kept list) must be read by one of the traced drafters."""
    from mtpspec.errors import ConfigError
    from mtpspec.viz.cli import _check_used

    _check_used(["mtp"], {"draft_vocab": 100, "mtp_prenorm_hidden": True, "ngram_min": None})
    with pytest.raises(ConfigError, match="--ngram-max is not used by --drafter mtp, draft"):
        _check_used(["mtp", "draft"], {"ngram_max": 3})
    with pytest.raises(ConfigError, match="mtp_prenorm_hidden is not used by --drafter ngram"):
        _check_used(["ngram"], {"mtp_prenorm_hidden": True})

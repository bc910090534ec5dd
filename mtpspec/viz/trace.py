"""Timeline traces of real runs: plain and speculative decoding on one time axis.

Every target forward is a box exactly as wide as it took (StepRecord.verify_seconds), drafting is
its own box before it, and under each forward the tokens it produced are stacked as cells:

- **accepted** draft tokens (green), the **recovered** token at the first mismatch (amber), the
  **bonus** token when every draft survived (blue), a plain step's own token (grey);
- the **rejected** draft (red) and the drafts **discarded** after it (light red) sit in the same
  column: a wrong guess costs a row in the pass, never a wider pass.

Data comes from `Model.generate(..., trace=True)`; nothing is simulated. Output: one self-contained
HTML page (inline SVG, inline CSS, no network) and a PNG of the same timelines (matplotlib).
"""

from __future__ import annotations

import html
import json
import math
from dataclasses import dataclass, field, replace
from pathlib import Path

from ..types import GenerationResult, StepRecord

KIND_COLOURS = {
    "target": "#9aa5b1",  # a plain step's token (no draft): the target's own
    "accepted": "#2e9e5b",
    "recovered": "#e8a23a",
    "bonus": "#3a7be8",
    "rejected": "#d9363e",
    "discarded": "#f2a7aa",
}
KIND_HELP = {
    "target": "plain step: the target's own token",
    "accepted": "accepted draft token",
    "recovered": "recovered token (target's choice at the first mismatch)",
    "bonus": "bonus token (all drafts accepted)",
    "rejected": "rejected draft token (first mismatch)",
    "discarded": "discarded draft token (after the first mismatch, never checked)",
}
BOX_COLOURS = {"prefill": "#cfd6de", "draft": "#f4c06b", "verify": "#4a6fa5"}


@dataclass(frozen=True)
class Cell:
    """One token produced (or thrown away) by a step."""

    token: int
    text: str  # decoded in context (a piece after BOS loses its leading space)
    kind: str  # a key of KIND_COLOURS
    p: float | None  # the target's probability of this token at its position (softmax of logits)


@dataclass(frozen=True)
class TraceStep:
    record: StepRecord
    cells: list[Cell]  # emitted tokens in order, then the rejected / discarded drafts

    @property
    def draft_start(self) -> float:
        return self.record.start_seconds

    @property
    def verify_start(self) -> float:
        return self.record.start_seconds + self.record.draft_seconds

    @property
    def end(self) -> float:
        return self.verify_start + self.record.verify_seconds


@dataclass
class TraceRun:
    """One measured generation, ready to draw."""

    label: str
    drafter: str
    k: int
    result: GenerationResult
    steps: list[TraceStep]
    speedup: float = 1.0  # tokens/s relative to the plain run on the same prompt
    identical: bool = True  # same tokens as the plain run

    @property
    def end(self) -> float:
        return max([s.end for s in self.steps] + [self.result.stats.prefill_seconds])

    def summary(self) -> dict:
        s = self.result.stats
        return {
            "label": self.label, "drafter": self.drafter, "k": self.k, "new_tokens": len(self.result.tokens),
            "target_forwards": s.target_forwards, "tokens_per_forward": s.mean_accepted_length,
            "accepted_tokens": s.accepted_tokens, "draft_tokens": s.draft_tokens,
            "wall_seconds": s.wall_seconds, "tokens_per_second": s.tokens_per_second,
            "speedup": self.speedup, "identical_to_plain": self.identical,
        }


@dataclass
class TraceGroup:
    """All runs on one prompt; runs[0] is plain decoding."""

    prompt: str
    runs: list[TraceRun] = field(default_factory=list)


def step_cells(step: StepRecord, prev: int, tokenizer) -> list[Cell]:
    """The cells of one step; `prev` is the last committed token before it (for decoding spaces)."""
    d, n, emitted = len(step.draft), step.num_accepted, step.emitted
    p_em = step.p_of_emitted or [None] * len(emitted)
    p_dr = step.p_of_draft or [None] * d
    cells: list[Cell] = []
    last = prev
    for i, t in enumerate(emitted):
        kind = "accepted" if i < n else ("target" if d == 0 else "bonus" if n == d else "recovered")
        cells.append(Cell(t, tokenizer.decode([t], prev=last), kind, p_em[i]))
        last = t
    if step.path is not None:  # a token tree
        return _tree_cells(step, cells, p_dr, prev, tokenizer)
    last = step.draft[n - 1] if n else prev
    for i in range(n, d):  # the first mismatch and everything after it
        t = step.draft[i]
        cells.append(Cell(t, tokenizer.decode([t], prev=last), "rejected" if i == n else "discarded", p_dr[i]))
        last = t
    return cells


def _tree_cells(step: StepRecord, cells: list[Cell], p_dr: list, prev: int, tokenizer) -> list[Cell]:
    """A tree step: the accepted path and the target's token (bonus when the path ended at a leaf), then the nodes
    that were checked and refused (children of a reached node: rejected) and those never reached (discarded)."""
    parents, path = step.draft_parents, step.path
    reached = {-1, *path}
    if cells and len(cells) == len(path) + 1:
        last_row = path[-1] if path else -1
        cells[-1] = replace(cells[-1], kind="recovered" if any(p == last_row for p in parents) else "bonus")
    for i, t in enumerate(step.draft):
        if i in path:
            continue
        before = step.draft[parents[i]] if parents[i] >= 0 else prev
        cells.append(Cell(t, tokenizer.decode([t], prev=before), "rejected" if parents[i] in reached else "discarded", p_dr[i]))
    return cells


def build_run(label: str, drafter: str, k: int, result: GenerationResult, tokenizer) -> TraceRun:
    prev = result.prompt_tokens[-1] if result.prompt_tokens else 1
    steps = []
    for rec in result.steps:
        steps.append(TraceStep(rec, step_cells(rec, prev, tokenizer)))
        if rec.emitted:
            prev = rec.emitted[-1]
    return TraceRun(label, drafter, k, result, steps)


def trace_prompts(
    model, prompts: list[str], configs: list[tuple[str, int]], *, draft_model=None, warmup: bool = True, repeat: int = 1, **gen
) -> list[TraceGroup]:
    """Run plain decoding and every (drafter, D) config on each prompt, with trace=True.

    Each config is run once untimed first on each prompt (warm-up: allocation, lazy loads). With repeat > 1
    the configs alternate (mtpspec.alternate) that many rounds (so a busy machine slows all of them alike) and,
    per config, the run of median wall time is drawn: a real run, not an average.
    `gen` are the other Model.generate keyword arguments (temperature, seed, max_new_tokens, ...).
    """
    from ..api import load
    from ..alternate import alternate
    from ..drafters import for_drafter
    from ..models.heads import is_head_dir

    if isinstance(draft_model, (str, Path)) and not is_head_dir(draft_model):  # a head folder goes to its drafter as is
        draft_model = load(draft_model, dtype=getattr(model.module, "dtype", "fp32"))
    runs = [("none", 1)] + list(configs)
    kws = [for_drafter(dict(gen, drafter=drafter, k=k, draft_model=draft_model)) for drafter, k in runs]  # each its own options
    if warmup:
        for prompt in prompts:
            for kw in kws:
                model.generate(prompt, **dict(kw, max_new_tokens=min(8, gen.get("max_new_tokens", 8))))
    results = alternate(kws, prompts, lambda kw, prompt: model.generate(prompt, trace=True, **kw), max(repeat, 1))
    groups = []
    for j, prompt in enumerate(prompts):
        group = TraceGroup(prompt)
        for (drafter, k), kw, by_prompt in zip(runs, kws, results):
            res = sorted(by_prompt[j], key=lambda r: r.stats.wall_seconds)[len(by_prompt[j]) // 2]
            tree = f", tree of {kw['tree']}" if kw.get("tree") else ""
            label = "plain decoding" if drafter == "none" else f"{drafter}, D={k}{tree}"
            group.runs.append(build_run(label, drafter, k, res, model.tokenizer))
        base = group.runs[0]
        for run in group.runs:
            tps0 = base.result.stats.tokens_per_second
            run.speedup = run.result.stats.tokens_per_second / tps0 if tps0 > 0 else 0.0
            run.identical = run.result.tokens == base.result.tokens
        groups.append(group)
    return groups


# --------------------------------------------------------------------------------------------- SVG

BOX_H, CELL_H, AXIS_H, LEFT, RIGHT = 22, 10, 26, 22, 24  # pixels; a cell row is CELL_H high, a 1-pixel gap included


def _boxes(run: TraceRun):
    """Every box of a run's timeline, as (class, start s, width s, top row, rows high, colour, tooltip, attributes):
    row 0-2 the prefill / draft / forward band (2 rows of BOX_H / 2 each, a draft inset), rows 3.. a forward's cells."""
    pre = run.result.stats.prefill_seconds
    yield "prefill", 0.0, pre, 0, 2, BOX_COLOURS["prefill"], f"prefill: {pre * 1e3:.2f} ms", ""
    for i, st in enumerate(run.steps):
        r = st.record
        if r.draft:
            yield ("draft", st.draft_start, r.draft_seconds, 0.35, 1.3, BOX_COLOURS["draft"],
                   f"step {i}: drafting {len(r.draft)} tokens, {r.draft_seconds * 1e3:.3f} ms", "")
        yield ("forward", st.verify_start, r.verify_seconds, 0, 2, BOX_COLOURS["verify"],
               f"step {i}: target forward over {len(r.draft) + 1} positions, {r.verify_seconds * 1e3:.3f} ms; drafted "
               f"{len(r.draft)}, accepted {r.num_accepted}, emitted {len(r.emitted)}", f' data-step="{i}"')
        for j, c in enumerate(st.cells):
            yield (f"cell {c.kind}", st.verify_start, r.verify_seconds, 2.3 + 1.1 * j, 1, KIND_COLOURS[c.kind],
                   f"{c.text!r} (id {c.token}): {c.kind}, target p = {_p(c.p)}", f' data-token="{c.token}"')


def _p(p: float | None) -> str:
    return "n/a" if p is None else f"{p:.3f}"


def render_svg(run: TraceRun, t_max: float, width: int = 1100) -> str:
    """One run's timeline as an <svg class="timeline"> on a time axis of [0, t_max] seconds."""
    scale, row = (width - LEFT - RIGHT) / t_max if t_max > 0 else 1.0, BOX_H / 2
    height = int(BOX_H + 6 + 1.1 * row * max([len(st.cells) for st in run.steps] + [1]) + AXIS_H)
    s = run.summary()
    attrs = {"class": "timeline", "width": width, "height": height, "viewBox": f"0 0 {width} {height}", "role": "img",
             "xmlns": "http://www.w3.org/2000/svg", "data-label": run.label, "data-drafter": run.drafter, "data-k": run.k,
             "data-new-tokens": s["new_tokens"], "data-target-forwards": s["target_forwards"], "data-steps": len(run.steps),
             "data-tokens-per-forward": f"{s['tokens_per_forward']:.6f}", "data-wall-seconds": f"{s['wall_seconds']:.6f}",
             "data-speedup": f"{s['speedup']:.6f}"}
    out = ["<svg " + " ".join(f'{k}="{html.escape(str(v))}"' for k, v in attrs.items()) + f"><title>{html.escape(run.label)}</title>"]
    for cls, t, w, top, rows, colour, tip, extra in _boxes(run):
        out.append(f'<rect class="{cls}" x="{LEFT + t * scale:.2f}" y="{6 + top * row:.2f}" width="{max(w * scale, 0.5):.2f}" '
                   f'height="{rows * row - (cls.startswith("cell")):.0f}" fill="{colour}"{extra}><title>{html.escape(tip)}</title></rect>')
    axis = height - AXIS_H + 6
    out.append(f'<line x1="{LEFT}" y1="{axis}" x2="{width - RIGHT}" y2="{axis}" stroke="#555" stroke-width="0.8"/>')
    for t in _ticks(t_max):
        x = LEFT + t * scale
        out.append(f'<line x1="{x:.2f}" y1="{axis}" x2="{x:.2f}" y2="{axis + 4}" stroke="#555"/><text x="{x:.2f}" y="{axis + 15}" '
                   f'font-size="10" text-anchor="middle" fill="#333">{t * 1e3:g} ms</text>')
    return "\n".join(out + ["</svg>"])


def _ticks(t_max: float, n: int = 10) -> list[float]:
    if t_max <= 0:
        return [0.0]
    raw = t_max / n
    mag = 10 ** math.floor(math.log10(raw))  # power of ten at or below raw
    step = next(m * mag for m in (1, 2, 5, 10) if m * mag >= raw)
    return [round(i * step, 9) for i in range(int(t_max / step) + 1)]


# -------------------------------------------------------------------------------------------- HTML

CSS = """
body{font:14px/1.45 system-ui,sans-serif;margin:24px;color:#222;max-width:1160px}
h1{font-size:20px} h2{font-size:16px;margin-top:28px} h3{font-size:14px;margin:14px 0 2px}
table{border-collapse:collapse;margin:8px 0} td,th{border:1px solid #ccd;padding:3px 8px;text-align:right}
th{background:#f1f3f6} td:first-child,th:first-child{text-align:left}
.legend span{display:inline-block;margin-right:14px} .sw{display:inline-block;width:12px;height:12px;
vertical-align:middle;margin-right:4px;border:1px solid #0002}
.tokens{font-family:ui-monospace,monospace;font-size:12px;white-space:pre-wrap;background:#fafbfc;
border:1px solid #e3e6ea;padding:6px;margin:4px 0 8px}
.tokens span{border-radius:2px} .tokens s{color:#d9363e;font-size:10px;vertical-align:super}
svg.timeline{display:block;margin:2px 0}
.note{color:#555;font-size:12px}
"""


def _token_strip(run: TraceRun, prompt: str) -> str:
    parts = [f'<span style="color:#888">{html.escape(prompt)}</span>']
    for st in run.steps:
        rejected = "".join(c.text for c in st.cells if c.kind in ("rejected", "discarded"))
        for c in st.cells:
            if c.kind in ("rejected", "discarded"):
                continue
            if c.kind in ("recovered",) and rejected:
                parts.append(f'<s title="rejected draft">{html.escape(rejected)}</s>')
            bg = "" if c.kind == "target" else f"background:{KIND_COLOURS[c.kind]}33"
            parts.append(f'<span style="{bg}" title="{c.kind}, id {c.token}, p = {_p(c.p)}">{html.escape(c.text)}</span>')
    return f'<div class="tokens">{"".join(parts)}</div>'


def render_html(groups: list[TraceGroup], title: str = "mtpspec trace", meta: str = "") -> str:
    """A self-contained page: legend, then per prompt a summary table and one timeline per run."""
    t_max = max(run.end for g in groups for run in g.runs) * 1.01
    legend = "".join(
        f'<span><i class="sw" style="background:{c}"></i>{html.escape(KIND_HELP[k])}</span>' for k, c in KIND_COLOURS.items()
    )
    boxes = "".join(
        f'<span><i class="sw" style="background:{c}"></i>{n}</span>'
        for n, c in (("prefill", BOX_COLOURS["prefill"]), ("drafting (propose + commit)", BOX_COLOURS["draft"]), ("target forward (verify)", BOX_COLOURS["verify"]))
    )
    body = [f"<h1>{html.escape(title)}</h1>"]
    if meta:
        body.append(f'<p class="note">{html.escape(meta)}</p>')
    body.append(
        '<p class="note">Measured, not simulated: each box is as wide as that step really took (one shared time axis '
        "for every row on the page). Under each target forward, its tokens: emitted ones first, then the rejected "
        "draft guesses, which add rows to the pass but never widen it. Hover any box or cell for details.</p>"
    )
    body.append(f'<p class="legend">{boxes}</p><p class="legend">{legend}</p>')
    for gi, g in enumerate(groups):
        body.append(f"<h2>Prompt {gi + 1}: {html.escape(repr(g.prompt))}</h2>")
        rows = "".join(
            f"<tr><td>{html.escape(r['label'])}</td><td>{r['new_tokens']}</td><td>{r['target_forwards']}</td>"
            f"<td>{r['tokens_per_forward']:.2f}</td><td>{r['wall_seconds'] * 1e3:.1f}</td><td>{r['tokens_per_second']:.0f}</td>"
            f"<td>{r['speedup']:.2f}x</td><td>{'yes' if r['identical_to_plain'] else 'NO'}</td></tr>"
            for r in (run.summary() for run in g.runs)
        )
        body.append(
            "<table class='summary'><tr><th>run</th><th>new tokens</th><th>target forwards</th><th>tokens / forward</th>"
            f"<th>wall ms</th><th>tok/s</th><th>speedup</th><th>identical to plain</th></tr>{rows}</table>"
        )
        for run in g.runs:
            s = run.summary()
            body.append(
                f"<h3>{html.escape(run.label)}: {s['target_forwards']} forwards, {s['tokens_per_forward']:.2f} tokens / "
                f"forward, {s['speedup']:.2f}x</h3>"
            )
            body.append(render_svg(run, t_max))
            body.append(_token_strip(run, g.prompt))
    data = json.dumps([{"prompt": g.prompt, "runs": [r.summary() for r in g.runs]} for g in groups])
    body.append(f'<script type="application/json" id="trace-data">{html.escape(data, quote=False)}</script>')
    return (
        f'<!DOCTYPE html>\n<html lang="en"><head><meta charset="utf-8"><title>{html.escape(title)}</title>'
        f"<style>{CSS}</style></head><body>\n" + "\n".join(body) + "\n</body></html>\n"
    )


# --------------------------------------------------------------------------------------------- PNG

def render_png(groups: list[TraceGroup], path: str | Path, width_in: float = 12.0) -> None:
    """The same timelines (the same boxes) as a PNG: one row per run, one shared time axis in ms."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.collections import PatchCollection
    from matplotlib.patches import Patch, Rectangle

    runs = [(g, r) for g in groups for r in g.runs]
    heights = [1.2 + 0.18 * max([len(s.cells) for s in r.steps] + [1]) for _, r in runs]
    fig, axes = plt.subplots(len(runs), 1, figsize=(width_in, sum(heights) * 0.62 + 1.0), sharex=True,
                             gridspec_kw={"height_ratios": heights}, squeeze=False)
    for ax, (g, run) in zip(axes[:, 0], runs):
        boxes = list(_boxes(run))
        ax.add_collection(PatchCollection([Rectangle((t * 1e3, -top), max(w * 1e3, 1e-3), -rows) for _, t, w, top, rows, *_ in boxes],
                                          facecolor=[b[5] for b in boxes], edgecolor="white", linewidth=0.15))
        ax.set_ylim(-max(top + rows for _, _, _, top, rows, *_ in boxes) - 0.2, 0.2)
        ax.set_yticks([])
        s, prompt = run.summary(), g.prompt if len(g.prompt) <= 40 else g.prompt[:37] + "..."
        ax.set_title(f"{run.label}  [{prompt!r}]: {s['new_tokens']} tokens in {s['target_forwards']} forwards "
                     f"({s['tokens_per_forward']:.2f}/forward), {s['tokens_per_second']:.0f} tok/s, {s['speedup']:.2f}x",
                     fontsize=9, loc="left")
        for side in ("top", "right", "left"):
            ax.spines[side].set_visible(False)
    axes[-1, 0].set_xlim(0, max(r.end for _, r in runs) * 1.01e3)
    axes[-1, 0].set_xlabel("time since start (ms), measured")
    handles = [Patch(color=BOX_COLOURS[k], label=n) for k, n in (("draft", "drafting"), ("verify", "target forward"))]
    fig.legend(handles=handles + [Patch(color=c, label=k) for k, c in KIND_COLOURS.items()], loc="lower center",
               ncol=len(handles) + len(KIND_COLOURS), fontsize=8, frameon=False)
    fig.tight_layout(rect=(0, 0.04, 1, 1))
    fig.savefig(path, dpi=90)
    plt.close(fig)


def write_trace(groups: list[TraceGroup], out: str | Path, png: str | Path | None = None, meta: str = "") -> tuple[Path, Path]:
    """Write FILE.html and its PNG (default: the same name with .png); returns both paths."""
    out = Path(out)
    png = Path(png) if png else out.with_suffix(".png")
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(render_html(groups, meta=meta), encoding="utf-8")
    render_png(groups, png)
    return out, png

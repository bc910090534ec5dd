"""Aggregate benchmark runs, check the targets, write JSON, a markdown report and PNG plots."""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path

from ..metrics import Acceptance
from .costmodel import CostModel
from .harness import PLAIN, Method, Run


@dataclass
class Aggregate:
    """One method over a group of prompts (a category or all of them)."""

    method: str
    prompts: int
    new_tokens: int
    wall_seconds: float
    tokens_per_second: float
    speedup: float  # tokens/s over ours:plain on the same prompts in the same run
    cpu_speedup: float | None  # the same from process CPU time (insensitive to other jobs on the machine)
    lossless: str  # "n/n" prompts whose greedy output equals ours:plain ("-" when sampling)
    mean_accepted_length: float | None = None  # tokens per target forward (ours only)
    acceptance_by_position: list[float] = field(default_factory=list)
    time_split: dict[str, float] = field(default_factory=dict)  # seconds per new token: prefill/draft/verify/overhead
    mean_depth: float | None = None  # drafted tokens per step
    predicted_speedup: float | None = None  # cost model from this run's steps
    efficiency: float | None = None  # speedup / predicted_speedup
    decode_tokens_per_second: float | None = None  # tokens decoded / (wall - prefill): prefill excluded (None: not timed apart)
    draft_acceptance: float | None = None  # accepted / drafted tokens, for any engine that counts them


def _drafter_of(label: str) -> str:
    name = label.split(":", 1)[1]
    return "none" if name == "plain" else name.split("@", 1)[0]


def aggregate(runs: list[Run], label: str, plain_tps: float, cost: CostModel | None, plain_prefill: dict[str, float] | None = None,
              plain_cpu: float | None = None) -> Aggregate:
    """plain_cpu: CPU seconds per token of ours:plain on the same prompts (for cpu_speedup)."""
    rs = [r for r in runs if r.method == label]
    toks = sum(r.new_tokens for r in rs)
    wall = sum(r.wall_seconds for r in rs)
    tps = toks / wall if wall > 0 else 0.0
    flags = [r.lossless for r in rs if r.lossless is not None]
    cpu = sum(r.cpu_seconds or 0.0 for r in rs)
    agg = Aggregate(
        method=label, prompts=len(rs), new_tokens=toks, wall_seconds=wall, tokens_per_second=tps,
        speedup=tps / plain_tps if plain_tps > 0 else 0.0,
        cpu_speedup=(plain_cpu / (cpu / toks)) if (plain_cpu and cpu > 0 and toks) else None,
        lossless=f"{sum(flags)}/{len(flags)}" if flags else "-",
    )
    if rs and all(r.prefill_seconds is not None for r in rs):
        dec = sum(r.wall_seconds - r.prefill_seconds for r in rs)
        agg.decode_tokens_per_second = sum(r.new_tokens if r.decode_tokens is None else r.decode_tokens for r in rs) / dec if dec > 0 else None
    acc = sum((Acceptance(forwards=r.target_forwards or 0, drafted=r.draft_tokens or 0, accepted=r.accepted_tokens or 0,
                          reached=r.reached, passed=r.passed) for r in rs), Acceptance())
    agg.draft_acceptance = acc.draft_acceptance
    if rs and rs[0].target_forwards is not None:  # our engine: counters and time split
        agg.mean_accepted_length = acc.mean_accepted_length
        agg.acceptance_by_position = [0.0 if x is None else x for x in acc.by_position()]
        t = max(toks, 1)
        agg.time_split = {k: sum(getattr(r, f"{k}_seconds") for r in rs) / t for k in ("prefill", "draft", "verify", "overhead")}
        steps = [d for r in rs for d in r.drafts_per_step]
        agg.mean_depth = sum(steps) / len(steps) if steps else 0.0
        if cost is not None:
            pre = plain_prefill or {}
            dr = _drafter_of(label)
            plain_s = sum(r.new_tokens * cost.plain_seconds(dr) + pre.get(r.prompt_id, 0.0) for r in rs)
            spec_s = sum(cost.run_seconds(dr, r.drafts_per_step, pre.get(r.prompt_id, 0.0)) for r in rs)
            agg.predicted_speedup = plain_s / spec_s if spec_s > 0 else None
            agg.efficiency = agg.speedup / agg.predicted_speedup if agg.predicted_speedup else None
    return agg


def summarize(runs: list[Run], methods: list[Method], cost: CostModel | None) -> dict:
    labels = [PLAIN.label] + [m.label for m in methods if m.label != PLAIN.label]
    cats = list(dict.fromkeys(r.category for r in runs))
    out = {"categories": cats, "methods": labels, "overall": {}, "by_category": {}}
    for group, rs in [("overall", runs)] + [(c, [r for r in runs if r.category == c]) for c in cats]:
        base = aggregate(rs, PLAIN.label, 0.0, None)
        pre = {r.prompt_id: r.prefill_seconds or 0.0 for r in rs if r.method == PLAIN.label}
        pr = [r for r in rs if r.method == PLAIN.label]
        pcpu = sum(r.cpu_seconds or 0.0 for r in pr) / max(sum(r.new_tokens for r in pr), 1) or None
        aggs = {lab: aggregate(rs, lab, base.tokens_per_second, cost, pre, pcpu).__dict__ for lab in labels}
        if group == "overall":
            out["overall"] = aggs
        else:
            out["by_category"][group] = aggs
    return out


def check_targets(summary: dict, elapsed_seconds: float | None = None) -> list[dict]:
    """The issue's targets, each with its measured number and pass / miss."""
    ov, cats = summary["overall"], summary["by_category"]
    tps = {k: v["tokens_per_second"] for k, v in ov.items()}
    out = []

    def add(name: str, value: float, goal: float, detail: str = "") -> None:
        out.append({"target": name, "measured": round(value, 3), "goal": goal, "met": value >= goal, "detail": detail})

    if "hf:plain" in tps:
        add("ours:plain / hf:plain tokens/s", tps["ours:plain"] / tps["hf:plain"], 1.0)
    for lab in tps:
        if lab.startswith("hf:ngram") and "ours:" + lab[3:] in tps:
            add(f"ours:{lab[3:]} / {lab} tokens/s", tps["ours:" + lab[3:]] / tps[lab], 1.2)
    if "hf:ngram" in " ".join(tps):
        best_ours = max((v, k) for k, v in tps.items() if k.startswith("ours:ngram"))
        best_hf = max((v, k) for k, v in tps.items() if k.startswith("hf:ngram"))
        add("best ours:ngram / best hf:ngram tokens/s", best_ours[0] / best_hf[0], 1.2, f"{best_ours[1]} vs {best_hf[1]}")
    if "hf:draft" in tps:
        best = max((v, k) for k, v in tps.items() if k.startswith("ours:draft"))
        add("best ours:draft / hf:draft (assisted) tokens/s", best[0] / tps["hf:draft"], 1.0, best[1])
    dec = {k: v.get("decode_tokens_per_second") for k, v in ov.items()}
    lc = {k: v for k, v in dec.items() if k.startswith("llamacpp:") and v}
    if lc and dec.get("ours:plain"):
        add("ours:plain / llamacpp:plain decode tok/s", dec["ours:plain"] / lc["llamacpp:plain"], 0.5)
        best_ours = max((v, k) for k, v in dec.items() if k.startswith("ours:") and v)
        best_lc = max((v, k) for k, v in lc.items())
        add("best ours / best llamacpp decode tok/s", best_ours[0] / best_lc[0], 1.0, f"{best_ours[1]} vs {best_lc[1]}")
    for lab, a in ov.items():
        if a.get("efficiency") is not None and lab != "ours:plain":
            add(f"{lab}: measured / predicted speedup", a["efficiency"], 0.9)
    for lab in ov:
        if not (lab.startswith("ours:") and lab.endswith("@auto")) or not cats:
            continue
        drafter = lab[5:-5]
        fixed = [k for k in ov if k.startswith(f"ours:{drafter}@") and not k.endswith("@auto")]
        worst = min(cats, key=lambda c: cats[c][lab]["speedup"])
        pw, cw = cats[worst][lab].get("predicted_speedup"), cats[worst][lab].get("cpu_speedup")
        worst_cpu = min(cats, key=lambda c: cats[c][lab].get("cpu_speedup") or 9.9)
        det = worst + (f"; cost model predicts {pw:.2f}" if pw else "")
        if cw:
            det += f"; worst from CPU time: {worst_cpu} {cats[worst_cpu][lab]['cpu_speedup']:.2f}"
        add(f"{lab}: speedup on its worst category", cats[worst][lab]["speedup"], 0.97, det)
        if fixed:
            best_cat = max(cats, key=lambda c: max(cats[c][f]["speedup"] for f in fixed))
            best_f = max(fixed, key=lambda f: cats[best_cat][f]["speedup"])
            ratio = cats[best_cat][lab]["speedup"] / cats[best_cat][best_f]["speedup"]
            pa, pf = cats[best_cat][lab].get("predicted_speedup"), cats[best_cat][best_f].get("predicted_speedup")
            det = f"{best_cat}: {best_f}" + (f"; cost model predicts {pa / pf:.2f}" if pa and pf else "")
            ca, cf = cats[best_cat][lab].get("cpu_speedup"), cats[best_cat][best_f].get("cpu_speedup")
            det += f"; from CPU time {ca / cf:.2f}" if ca and cf else ""
            add(f"{lab} / best fixed D on the best category", ratio, 0.9, det)
    if elapsed_seconds is not None:
        out.append({"target": "benchmark wall time (s)", "measured": round(elapsed_seconds, 1), "goal": 300, "met": elapsed_seconds < 300, "detail": "whole run incl. cost model and peers"})
    return out


# --- markdown --------------------------------------------------------------------------------


def _f(x, fmt: str = "{:.2f}") -> str:
    return "-" if x is None else fmt.format(x)


def markdown(result: dict, images: list[str] | None = None) -> str:
    s, meta, cost = result["summary"], result["config"], result.get("cost_model")
    ov, cats = s["overall"], s["by_category"]
    lines = [
        f"## {meta['model_name']} on {meta['prompts_name']}",
        "",
        f"{meta['num_prompts']} prompts x {meta['max_new_tokens']} new tokens, temperature {meta['temperature']}, "
        f"torch threads {meta['threads']}, " + ("our steps compiled (--compile), " if meta.get("compile") else "")
        + (f"{'mean' if meta.get('keep', 'best') == 'mean' else 'best'} of {meta.get('repeat', 1)} alternating rounds"
           if meta.get("repeat", 1) > 1 else "one round")
        + (", our methods of each prompt interleaved every 5 ms" if meta.get("interleave") == "step" else "")
        + f", prompts cut to {meta['max_prompt_tokens']} tokens; "
        f"wall time {meta['elapsed_seconds']:.0f} s. Speedup = tokens/s over ours:plain on the same prompts in the same run.",
        "",
        "| method | tok/s | decode tok/s | speedup | speedup (CPU time) | predicted | measured/predicted | mean accepted length | drafts/step | lossless |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    for lab, a in ov.items():
        lines.append(
            f"| {lab} | {a['tokens_per_second']:.0f} | {_f(a.get('decode_tokens_per_second'), '{:.0f}')} | {a['speedup']:.2f}x | "
            f"{_f(a['cpu_speedup'], '{:.2f}x')} | {_f(a['predicted_speedup'], '{:.2f}x')} | "
            f"{_f(a['efficiency'])} | {_f(a['mean_accepted_length'])} | {_f(a['mean_depth'])} | {a['lossless']} |"
        )
    lines += ["", "Speedup by category (mean accepted length in brackets):", ""]
    lines.append("| method | " + " | ".join(cats) + " |")
    lines.append("|---" * (len(cats) + 1) + "|")
    for lab in ov:
        cells = []
        for c in cats:
            a = cats[c][lab]
            mal = f" ({a['mean_accepted_length']:.2f})" if a.get("mean_accepted_length") is not None else ""
            cells.append(f"{a['speedup']:.2f}x{mal}")
        lines.append(f"| {lab} | " + " | ".join(cells) + " |")
    if any(cats[c][lab].get("cpu_speedup") for c in cats for lab in ov):
        lines += ["", "Speedup by category from process CPU time (blind to time other jobs took the core):", ""]
        lines.append("| method | " + " | ".join(cats) + " |")
        lines.append("|---" * (len(cats) + 1) + "|")
        for lab in ov:
            lines.append(f"| {lab} | " + " | ".join(_f(cats[c][lab].get("cpu_speedup"), "{:.2f}x") for c in cats) + " |")
    ours = [lab for lab in ov if lab.startswith("ours:") and ov[lab]["acceptance_by_position"]]
    if ours:
        n = max(len(ov[lab]["acceptance_by_position"]) for lab in ours)
        lines += ["", "Acceptance by position (P(draft i accepted | drafts before it accepted)), all prompts:", ""]
        lines.append("| method | " + " | ".join(str(i + 1) for i in range(n)) + " |")
        lines.append("|---" * (n + 1) + "|")
        for lab in ours:
            acc = ov[lab]["acceptance_by_position"]
            lines.append(f"| {lab} | " + " | ".join(f"{acc[i]:.2f}" if i < len(acc) else "" for i in range(n)) + " |")
    lines += ["", "Time split, milliseconds per generated token:", "", "| method | prefill | draft | verify | overhead | total |", "|---|---|---|---|---|---|"]
    for lab in ov:
        t = ov[lab]["time_split"]
        if t:
            lines.append(f"| {lab} | " + " | ".join(f"{1000 * t[k]:.3f}" for k in ("prefill", "draft", "verify", "overhead")) + f" | {1000 * sum(t.values()):.3f} |")
    peers = [lab for lab in ov if lab.startswith("hf:")]
    if peers:
        lines += ["", "Ours vs transformers on the same weights (tokens/s; the last column from process CPU time):", "",
                  "| method | ours | transformers | ours / theirs | ours / theirs (CPU time) |", "|---|---|---|---|---|"]
        for lab in peers:
            mine = "ours:" + lab[3:]
            if mine not in ov:  # no same-D counterpart (hf:draft, hf:ngram@10): our best of that drafter
                fam = "ours:" + lab[3:].split("@")[0]
                mine = max((k for k in ov if k.split("@")[0] == fam), key=lambda k: ov[k]["tokens_per_second"], default=None)
            if mine in ov:
                a, b = ov[mine]["tokens_per_second"], ov[lab]["tokens_per_second"]
                ca, cb = ov[mine].get("cpu_speedup"), ov[lab].get("cpu_speedup")
                lines.append(f"| {mine} vs {lab} | {a:.0f} | {b:.0f} | {a / b:.2f}x | {_f(ca / cb if ca and cb else None, '{:.2f}x')} |")
    lcp = [lab for lab in ov if lab.startswith("llamacpp:")]
    if lcp:
        base = ov["ours:plain"].get("decode_tokens_per_second")
        lines += ["", "Ours vs llama.cpp (llama-server) on the same weights, decode-only tokens/s (prefill excluded on both sides):", "",
                  "| method | decode tok/s | vs ours:plain | draft acceptance | lossless |", "|---|---|---|---|---|"]
        for lab in [k for k in ov if k.startswith("ours:")] + lcp:
            d = ov[lab].get("decode_tokens_per_second")
            lines.append(f"| {lab} | {_f(d, '{:.0f}')} | {_f(d / base if d and base else None, '{:.2f}x')} | "
                         f"{_f(ov[lab].get('draft_acceptance'))} | {ov[lab]['lossless']} |")
    if cost:
        r = cost["ratio"]
        lines += [
            "", f"Cost model (measured here, {cost['threads']} thread(s)):", "",
            "| k | " + " | ".join(str(i + 1) for i in range(len(r))) + " |", "|---" * (len(r) + 1) + "|",
            "| T(k)/T(1) | " + " | ".join(f"{x:.2f}" for x in r) + " |", "",
            f"T(1) = {1000 * cost['t1']:.3f} ms."
            + "".join(f" Drafter '{k}' per step of d drafts (propose + commit), d = 1..{len(v)}: " + ", ".join(f"{1000 * x:.2f}" for x in v) + " ms"
                      + (f"; its prompt catch-up {cost['prefill_ratio'][k]:.2f}x the target's prefill" if k in cost.get("prefill_ratio", {}) else "") + "."
                      for k, v in cost.get("draft_steps", {}).items()),
        ]
        vs = cost.get("verify_steps") or {}
        if vs:
            lines[-1] += (" Verify forward in situ (timed in each drafter's loop, used by the predictions), d = 0 (its plain"
                          f" steps) .. {max(len(v) for v in vs.values()) - 1}: "
                          + "; ".join(f"{k} " + ", ".join(f"{1000 * x:.2f}" for x in v) + f" ms ({v[0] / cost['t1']:.2f}x T(1) back to back at d = 0)"
                                      for k, v in vs.items()) + ".")
    if meta.get("peers_skipped"):
        lines += ["", "Peers not run: " + "; ".join(f"{lab} ({why})" for lab, why in meta["peers_skipped"].items()) + "."]
    tg = result.get("targets")
    if tg:
        lines += ["", "Targets:", "", "| target | measured | goal | met |", "|---|---|---|---|"]
        for t in tg:
            det = f" ({t['detail']})" if t.get("detail") else ""
            lines.append(f"| {t['target']}{det} | {t['measured']} | {t['goal']} | {'yes' if t['met'] else '**no**'} |")
    for img in images or []:
        lines += ["", f"![{Path(img).stem}]({img})"]
    return "\n".join(lines) + "\n"


# --- plots -----------------------------------------------------------------------------------


def plots(result: dict, out_dir: Path, prefix: str = "bench_") -> list[Path]:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    s = result["summary"]
    ov, cats = s["overall"], s["by_category"]
    labels = list(ov)
    groups = list(cats) + ["overall"]
    paths = []

    fig, ax = plt.subplots(figsize=(max(7, 1.3 * len(groups)), 4))
    w = 0.8 / len(labels)
    for i, lab in enumerate(labels):
        ys = [cats[g][lab]["speedup"] if g in cats else ov[lab]["speedup"] for g in groups]
        ax.bar([x + i * w for x in range(len(groups))], ys, w, label=lab)
    ax.axhline(1.0, color="k", lw=0.8)
    ax.set_xticks([x + 0.4 - w / 2 for x in range(len(groups))], groups, rotation=20)
    ax.set_ylabel("speedup over ours:plain")
    ax.set_title(f"{result['config']['model_name']}: speedup by category")
    ax.legend(fontsize=7, ncol=2)
    fig.tight_layout()
    paths.append(out_dir / f"{prefix}speedup.png")
    fig.savefig(paths[-1], dpi=110)
    plt.close(fig)

    fig, axes = plt.subplots(1, 3, figsize=(15, 4))
    ax = axes[0]
    for lab in labels:
        acc = ov[lab]["acceptance_by_position"]
        if acc:
            ax.plot(range(1, len(acc) + 1), acc, marker="o", label=lab)
    ax.set_xlabel("draft position i")
    ax.set_ylabel("P(accepted | earlier accepted)")
    ax.set_title("acceptance by position")
    ax.set_ylim(0, 1.05)
    if ax.get_legend_handles_labels()[0]:
        ax.legend(fontsize=7)
    ax = axes[1]
    ours = [lab for lab in labels if ov[lab]["time_split"]]
    left = [0.0] * len(ours)
    for part in ("prefill", "draft", "verify", "overhead"):
        vals = [1000 * ov[lab]["time_split"][part] for lab in ours]
        ax.barh(ours, vals, left=left, label=part)
        left = [a + b for a, b in zip(left, vals)]
    ax.set_xlabel("ms per generated token")
    ax.set_title("time split")
    ax.legend(fontsize=7)
    ax = axes[2]
    pts = [(ov[lab]["predicted_speedup"], ov[lab]["speedup"], lab) for lab in labels if ov[lab].get("predicted_speedup")]
    if pts:
        for px, py, lab in pts:
            ax.scatter(px, py)
            ax.annotate(lab.replace("ours:", ""), (px, py), fontsize=7)
        hi = max(max(p[0], p[1]) for p in pts) * 1.05
        lo = min(min(p[0], p[1]) for p in pts) * 0.9
        ax.plot([lo, hi], [lo, hi], "k--", lw=0.8)
        ax.plot([lo, hi], [0.9 * lo, 0.9 * hi], "k:", lw=0.8)
        ax.set_xlim(lo, hi)
        ax.set_ylim(0.9 * lo, hi)
    ax.set_xlabel("predicted speedup (cost model)")
    ax.set_ylabel("measured speedup")
    ax.set_title("measured vs predicted (dotted: 90%)")
    fig.tight_layout()
    paths.append(out_dir / f"{prefix}acceptance_time.png")
    fig.savefig(paths[-1], dpi=110)
    plt.close(fig)
    return paths


def write_all(result: dict, out_dir: Path, prefix: str = "bench_") -> dict[str, Path]:
    out_dir.mkdir(parents=True, exist_ok=True)
    imgs = plots(result, out_dir, prefix)
    md = markdown(result, [p.name for p in imgs])
    (out_dir / "report.md").write_text(md)
    (out_dir / "results.json").write_text(json.dumps(result, indent=1))
    return {"json": out_dir / "results.json", "markdown": out_dir / "report.md", **{p.stem: p for p in imgs}}

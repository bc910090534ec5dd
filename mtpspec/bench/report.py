"""Aggregate benchmark runs, check the targets, write JSON, a markdown report and PNG plots.

The markdown table, target and figure helpers here serve batch.py too."""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field
from pathlib import Path

from ..metrics import Acceptance
from .common import fmt as _f, pyplot, save, section, target, targets_md
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


def _ratio(a: float | None, b: float | None) -> float | None:
    return a / b if a and b else None


def aggregate(rs: list[Run], plain: list[Run], cost: CostModel | None) -> Aggregate:
    """One method's runs `rs` against ours:plain's runs `plain` on the same prompts."""
    toks, wall = sum(r.new_tokens for r in rs), sum(r.wall_seconds for r in rs)
    tps = _ratio(toks, wall) or 0.0
    cpu_per_token = _ratio(sum(r.cpu_seconds or 0.0 for r in rs), toks)
    p_toks = sum(r.new_tokens for r in plain)
    p_tps = _ratio(p_toks, sum(r.wall_seconds for r in plain))
    p_cpu_per_token = _ratio(sum(r.cpu_seconds or 0.0 for r in plain), p_toks)
    flags = [r.lossless for r in rs if r.lossless is not None]
    acc = sum((Acceptance(forwards=r.target_forwards or 0, drafted=r.draft_tokens or 0, accepted=r.accepted_tokens or 0,
                          reached=r.reached, passed=r.passed) for r in rs), Acceptance())
    agg = Aggregate(method=rs[0].method, prompts=len(rs), new_tokens=toks, wall_seconds=wall, tokens_per_second=tps,
                    speedup=_ratio(tps, p_tps) or 0.0, cpu_speedup=_ratio(p_cpu_per_token, cpu_per_token),
                    lossless=f"{sum(flags)}/{len(flags)}" if flags else "-", draft_acceptance=acc.draft_acceptance)
    if all(r.prefill_seconds is not None for r in rs):
        decoded = sum(r.new_tokens if r.decode_tokens is None else r.decode_tokens for r in rs)
        agg.decode_tokens_per_second = _ratio(decoded, sum(r.wall_seconds - r.prefill_seconds for r in rs))
    if rs[0].target_forwards is None:  # a peer: no counters of ours
        return agg
    agg.mean_accepted_length = acc.mean_accepted_length
    agg.acceptance_by_position = [0.0 if x is None else x for x in acc.by_position()]
    agg.time_split = {k: sum(getattr(r, f"{k}_seconds") for r in rs) / max(toks, 1) for k in ("prefill", "draft", "verify", "overhead")}
    steps = [d for r in rs for d in r.drafts_per_step]
    agg.mean_depth = sum(steps) / len(steps) if steps else 0.0
    if cost is not None:
        pre = {r.prompt_id: r.prefill_seconds or 0.0 for r in plain}
        name = rs[0].method.split(":", 1)[1]
        dr = "none" if name == "plain" else name.split("@", 1)[0].split("+", 1)[0]  # (the cost model prices the drafter alone)
        plain_s = sum(r.new_tokens * cost.plain_seconds(dr) + pre.get(r.prompt_id, 0.0) for r in rs)
        agg.predicted_speedup = _ratio(plain_s, sum(cost.run_seconds(dr, r.drafts_per_step, pre.get(r.prompt_id, 0.0)) for r in rs))
        agg.efficiency = _ratio(agg.speedup, agg.predicted_speedup)
    return agg


def summarize(runs: list[Run], methods: list[Method], cost: CostModel | None) -> dict:
    labels = list(dict.fromkeys([PLAIN.label] + [m.label for m in methods]))
    cats = list(dict.fromkeys(r.category for r in runs))

    def group(rs: list[Run]) -> dict:
        plain = [r for r in rs if r.method == PLAIN.label]
        return {lab: asdict(aggregate([r for r in rs if r.method == lab], plain, cost)) for lab in labels}

    return {"categories": cats, "methods": labels, "overall": group(runs),
            "by_category": {c: group([r for r in runs if r.category == c]) for c in cats}}


def _best(values: dict[str, float | None], prefix: str) -> tuple[float, str]:
    return max((v, k) for k, v in values.items() if k.startswith(prefix) and v)


def check_targets(summary: dict, elapsed_seconds: float | None = None) -> list[dict]:
    """The benchmark's targets that this run measured (docs/benchmarks.md, "Targets")."""
    ov, cats = summary["overall"], summary["by_category"]
    tps = {k: v["tokens_per_second"] for k, v in ov.items()}
    dec = {k: v.get("decode_tokens_per_second") for k, v in ov.items()}
    out = []
    if "hf:plain" in tps:
        out.append(target("ours:plain / hf:plain tokens/s", tps["ours:plain"] / tps["hf:plain"], 1.0))
    out += [target(f"ours:{lab[3:]} / {lab} tokens/s", tps["ours:" + lab[3:]] / tps[lab], 1.2)
            for lab in tps if lab.startswith("hf:ngram") and "ours:" + lab[3:] in tps]
    if any(k.startswith("hf:ngram") for k in tps):
        (o, ol), (h, hl) = _best(tps, "ours:ngram"), _best(tps, "hf:ngram")
        out.append(target("best ours:ngram / best hf:ngram tokens/s", o / h, 1.2, f"{ol} vs {hl}"))
    if "hf:draft" in tps:
        o, ol = _best(tps, "ours:draft")
        out.append(target("best ours:draft / hf:draft (assisted) tokens/s", o / tps["hf:draft"], 1.0, ol))
    if dec.get("llamacpp:plain") and dec.get("ours:plain"):
        out.append(target("ours:plain / llamacpp:plain decode tok/s", dec["ours:plain"] / dec["llamacpp:plain"], 0.5))
        (o, ol), (c, cl) = _best(dec, "ours:"), _best(dec, "llamacpp:")
        out.append(target("best ours / best llamacpp decode tok/s", o / c, 1.0, f"{ol} vs {cl}"))
    out += [target(f"{lab}: measured / predicted speedup", a["efficiency"], 0.9)
            for lab, a in ov.items() if a.get("efficiency") is not None and lab != PLAIN.label]
    for lab in [k for k in ov if k.startswith("ours:") and k.endswith("@auto")] if cats else []:
        at = {c: cats[c][lab] for c in cats}
        worst = min(cats, key=lambda c: at[c]["speedup"])
        pw = at[worst].get("predicted_speedup")
        out.append(target(f"{lab}: speedup on its worst category", at[worst]["speedup"], 0.97,
                          worst + (f"; cost model predicts {pw:.2f}" if pw else "")))
        fixed = [k for k in ov if k.startswith(lab[:-4]) and k != lab]
        if fixed:
            cat = max(cats, key=lambda c: max(cats[c][f]["speedup"] for f in fixed))
            best = max(fixed, key=lambda f: cats[cat][f]["speedup"])
            predicted = _ratio(at[cat].get("predicted_speedup"), cats[cat][best].get("predicted_speedup"))
            out.append(target(f"{lab} / best fixed D on the best category", at[cat]["speedup"] / cats[cat][best]["speedup"], 0.9,
                              f"{cat}: {best}" + (f"; cost model predicts {predicted:.2f}" if predicted else "")))
    if elapsed_seconds is not None:
        out.append({"target": "benchmark wall time (s)", "measured": round(elapsed_seconds, 1), "goal": 300, "met": elapsed_seconds < 300,
                    "detail": "whole run incl. cost model and peers"})
    return out


# --- markdown --------------------------------------------------------------------------------


def _speedup_mal(a: dict) -> str:
    return f"{a['speedup']:.2f}x" + ("" if a["mean_accepted_length"] is None else f" ({a['mean_accepted_length']:.2f})")


def markdown(result: dict, images: list[str] | None = None) -> str:
    s, meta, cost = result["summary"], result["config"], result.get("cost_model")
    ov, cats = s["overall"], s["by_category"]
    repeat = meta.get("repeat", 1)
    lines = [
        f"## {meta['model_name']} on {meta['prompts_name']}",
        "",
        f"{meta['num_prompts']} prompts x {meta['max_new_tokens']} new tokens, temperature {meta['temperature']}, "
        f"torch threads {meta['threads']}, " + ("our steps compiled (--compile), " if meta.get("compile") else "")
        + (f"{meta.get('keep', 'mean')} of {repeat} alternating rounds" if repeat > 1 else "one round")
        + (", our methods of each prompt interleaved every 5 ms" if meta.get("interleave") == "step" else "")
        + f", prompts cut to {meta['max_prompt_tokens']} tokens; wall time {meta['elapsed_seconds']:.0f} s. "
        "Speedup = tokens/s over ours:plain on the same prompts in the same run.",
    ]
    lines += section(None, ["method", "tok/s", "decode tok/s", "speedup", "speedup (CPU time)", "predicted", "measured/predicted",
                          "mean accepted length", "drafts/step", "lossless"],
                     [[lab, f"{a['tokens_per_second']:.0f}", _f(a["decode_tokens_per_second"], "{:.0f}"), f"{a['speedup']:.2f}x",
                       _f(a["cpu_speedup"], "{:.2f}x"), _f(a["predicted_speedup"], "{:.2f}x"), _f(a["efficiency"]),
                       _f(a["mean_accepted_length"]), _f(a["mean_depth"]), a["lossless"]] for lab, a in ov.items()])
    lines += section("Speedup by category (mean accepted length in brackets):", ["method", *cats],
                     [[lab] + [_speedup_mal(cats[c][lab]) for c in cats] for lab in ov])
    if any(cats[c][lab]["cpu_speedup"] for c in cats for lab in ov):
        lines += section("Speedup by category from process CPU time (blind to time other jobs took the core):", ["method", *cats],
                         [[lab] + [_f(cats[c][lab]["cpu_speedup"], "{:.2f}x") for c in cats] for lab in ov])
    accs = {lab: a["acceptance_by_position"] for lab, a in ov.items() if a["acceptance_by_position"]}
    if accs:
        n = max(map(len, accs.values()))
        lines += section("Acceptance by position (P(draft i accepted | drafts before it accepted)), all prompts:",
                         ["method", *range(1, n + 1)], [[lab] + [f"{x:.2f}" for x in acc] + [""] * (n - len(acc)) for lab, acc in accs.items()])
    lines += section("Time split, milliseconds per generated token:", ["method", "prefill", "draft", "verify", "overhead", "total"],
                     [[lab] + [f"{1000 * x:.3f}" for x in a["time_split"].values()] + [f"{1000 * sum(a['time_split'].values()):.3f}"]
                      for lab, a in ov.items() if a["time_split"]])
    hf = []
    for lab in [k for k in ov if k.startswith("hf:")]:
        mine = "ours:" + lab[3:]
        if mine not in ov:  # no same-D counterpart (hf:draft, hf:ngram@10): our best of that drafter
            fam = mine.split("@")[0]
            mine = max((k for k in ov if k.split("@")[0] == fam), key=lambda k: ov[k]["tokens_per_second"], default=None)
        if mine:
            a, b = ov[mine]["tokens_per_second"], ov[lab]["tokens_per_second"]
            hf.append([f"{mine} vs {lab}", f"{a:.0f}", f"{b:.0f}", f"{a / b:.2f}x",
                       _f(_ratio(ov[mine]["cpu_speedup"], ov[lab]["cpu_speedup"]), "{:.2f}x")])
    if hf:
        lines += section("Ours vs transformers on the same weights (tokens/s; the last column from process CPU time):",
                         ["method", "ours", "transformers", "ours / theirs", "ours / theirs (CPU time)"], hf)
    if any(k.startswith("llamacpp:") for k in ov):
        base = ov[PLAIN.label]["decode_tokens_per_second"]
        lines += section("Ours vs llama.cpp (llama-server) on the same weights, decode-only tokens/s (prefill excluded on both sides):",
                         ["method", "decode tok/s", "vs ours:plain", "draft acceptance", "lossless"],
                         [[lab, _f(a["decode_tokens_per_second"], "{:.0f}"), _f(_ratio(a["decode_tokens_per_second"], base), "{:.2f}x"),
                           _f(a["draft_acceptance"]), a["lossless"]] for lab, a in ov.items() if not lab.startswith("hf:")])
    splits: dict[tuple, list[str]] = {}  # a peer's methods that leave ours at the same token (its speculation is lossless)
    for r in result.get("runs", []):
        if r.get("split") is not None:
            key = (r["method"].split(":")[0], r["prompt_id"], r["split"], r["split_margin"])
            splits.setdefault(key, []).append(r["method"])
    if splits:
        lines += section("Where a peer's greedy text leaves ours: the first differing new token, and our logit margin there "
                         "(our token's logit minus the peer's token's; \"-\": one side stopped):",
                         ["methods", "prompt", "token", "our margin"],
                         [[ms[0] + (f" and {len(ms) - 1} more" if len(ms) > 1 else ""), prompt, i, _f(m, "{:.3f}")]
                          for (_, prompt, i, m), ms in splits.items()])
    if cost:
        ms = lambda xs: ", ".join(f"{1000 * x:.2f}" for x in xs) + " ms"  # noqa: E731
        lines += section(f"Cost model (measured here, {cost['threads']} thread(s)):", ["k", *range(1, len(cost["ratio"]) + 1)],
                         [["T(k)/T(1)"] + [f"{x:.2f}" for x in cost["ratio"]]])
        lines += ["", f"T(1) = {1000 * cost['t1']:.3f} ms."] + [
            f"Drafter '{k}': per step of d drafts (propose + commit), d = 1..{len(v)}: {ms(v)}; its prompt catch-up "
            f"{cost['prefill_ratio'][k]:.2f}x the target's prefill; verify forward in situ (timed in its loop, used by the "
            f"predictions), d = 0 (its plain steps) .. {len(v)}: {ms(cost['verify_steps'][k])} "
            f"({cost['verify_steps'][k][0] / cost['t1']:.2f}x T(1) back to back at d = 0)." for k, v in cost["draft_steps"].items()]
    if meta.get("peers_skipped"):
        lines += ["", "Peers not run: " + "; ".join(f"{lab} ({why})" for lab, why in meta["peers_skipped"].items()) + "."]
    lines += targets_md(result.get("targets") or [])
    lines += [f"\n![{Path(img).stem}]({img})" for img in images or []]
    return "\n".join(lines) + "\n"


# --- plots -----------------------------------------------------------------------------------


def plots(result: dict, out_dir: Path, prefix: str = "bench_") -> list[Path]:
    """Speedup by category; acceptance by position, time split, and measured against predicted speedup."""
    plt = pyplot()
    ov, cats = result["summary"]["overall"], result["summary"]["by_category"]
    groups = {**cats, "overall": ov}
    fig, ax = plt.subplots(figsize=(max(7, 1.3 * len(groups)), 4))
    w = 0.8 / len(ov)
    for i, lab in enumerate(ov):
        ax.bar([x + i * w for x in range(len(groups))], [g[lab]["speedup"] for g in groups.values()], w, label=lab)
    ax.axhline(1.0, color="k", lw=0.8)
    ax.set_xticks([x + 0.4 - w / 2 for x in range(len(groups))], list(groups), rotation=20)
    ax.set(ylabel="speedup over ours:plain", title=f"{result['config']['model_name']}: speedup by category")
    ax.legend(fontsize=7, ncol=2)
    paths = [save(fig, out_dir / f"{prefix}speedup.png")]

    fig, (acc, split, pred) = plt.subplots(1, 3, figsize=(15, 4))
    for lab, a in ov.items():
        if a["acceptance_by_position"]:
            acc.plot(range(1, len(a["acceptance_by_position"]) + 1), a["acceptance_by_position"], marker="o", label=lab)
    acc.set(xlabel="draft position i", ylabel="P(accepted | earlier accepted)", title="acceptance by position", ylim=(0, 1.05))
    ours = [lab for lab in ov if ov[lab]["time_split"]]
    left = [0.0] * len(ours)
    for part in ("prefill", "draft", "verify", "overhead"):
        vals = [1000 * ov[lab]["time_split"][part] for lab in ours]
        split.barh(ours, vals, left=left, label=part)
        left = [a + b for a, b in zip(left, vals)]
    split.set(xlabel="ms per generated token", title="time split")
    pts = [(a["predicted_speedup"], a["speedup"], lab) for lab, a in ov.items() if a["predicted_speedup"]]
    for px, py, lab in pts:
        pred.scatter(px, py)
        pred.annotate(lab.replace("ours:", ""), (px, py), fontsize=7)
    if pts:
        lo, hi = 0.9 * min(min(p[:2]) for p in pts), 1.05 * max(max(p[:2]) for p in pts)
        pred.plot([lo, hi], [lo, hi], "k--", lw=0.8)
        pred.plot([lo, hi], [0.9 * lo, 0.9 * hi], "k:", lw=0.8)
        pred.set(xlim=(lo, hi), ylim=(0.9 * lo, hi))
    pred.set(xlabel="predicted speedup (cost model)", ylabel="measured speedup", title="measured vs predicted (dotted: 90%)")
    for ax in (acc, split):
        if ax.get_legend_handles_labels()[0]:
            ax.legend(fontsize=7)
    return paths + [save(fig, out_dir / f"{prefix}acceptance_time.png")]


def write_all(result: dict, out_dir: Path, prefix: str = "bench_") -> dict[str, Path]:
    out_dir.mkdir(parents=True, exist_ok=True)
    imgs = plots(result, out_dir, prefix)
    (out_dir / "report.md").write_text(markdown(result, [p.name for p in imgs]))
    (out_dir / "results.json").write_text(json.dumps(result, indent=1))
    return {"json": out_dir / "results.json", "markdown": out_dir / "report.md", **{p.stem: p for p in imgs}}

"""`mtpspec bench --batch 1,2,4,8`: throughput and per-sequence latency of B sequences decoding together.

At each B every method (plain, each drafter at each fixed depth and auto, one depth policy per auto method for the
whole run, as a server keeps one) decodes the whole prompt set in one Engine(max_batch=B) (continuous batching); the
methods' engines are stepped in turn, each timed by its own decode steps. Figures are medians over rounds, a ratio of
two methods the median of its rounds' ratios; plain's scaling is also taken against one sequence stepped beside it
(docs/benchmarks.md, "Batches").
"""

from __future__ import annotations

import json
import statistics
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from time import perf_counter, process_time

from ..errors import ConfigError
from ..heap import frozen_heap
from ..models.compiled import AUTO_K_MAX, auto_depth
from .common import log2_axis, median, parse_counts, progress_bar, pyplot, quantile, save, section, target, targets_md


def parse_batches(text: str) -> list[int]:
    """--batch "1,2,4,8" -> [1, 2, 4, 8] (sorted, each once)."""
    return parse_counts(text, "--batch", "batch sizes")


@dataclass(frozen=True)
class BatchMethod:
    drafter: str  # "none" = plain decoding
    k: int | str  # draft depth D, or "auto"
    tree: int | None = None  # a token tree of this many nodes (depth <= k), else a chain

    @property
    def label(self) -> str:
        if self.drafter == "none":
            return "plain"
        return f"{self.drafter}@{self.k}" + ("" if self.tree is None else f"/tree{self.tree}")


@dataclass
class BatchRun:
    """One method at one batch size in one round."""

    method: str
    batch: int
    round: int
    decode_tokens: int  # tokens emitted in decode steps (not in a step that prefilled a prompt)
    decode_seconds: float  # the decode steps' seconds
    decode_cpu_seconds: float  # the process's CPU time over the same span (with one thread: little moved by other jobs)
    prefill_seconds: float  # the other steps (each prefilled a prompt and decoded the sequences already in)
    seconds_per_token: float  # mean over sequences of its decode seconds / its decode tokens
    p50_token_latency: float | None
    p99_token_latency: float | None
    mean_depth: float  # drafted tokens per sequence per decode step (a tree: its nodes)
    tokens_per_forward: float  # emitted tokens per sequence per decode step (the mean accepted length)
    steps: int  # decode steps
    tokens: list[list[int]] = field(repr=False)  # every sequence's whole generation (for the identity check)
    full_tokens: int = 0  # of decode_tokens, those of the steps that decoded B sequences (every slot busy)
    full_seconds: float = 0.0  # those steps' seconds (the rest: the queue's end, as the batch drains)

    @property
    def tokens_per_second(self) -> float:
        return self.decode_tokens / self.decode_seconds if self.decode_seconds > 0 else 0.0

    @property
    def cpu_tokens_per_second(self) -> float:
        return self.decode_tokens / self.decode_cpu_seconds if self.decode_cpu_seconds > 0 else 0.0

    @property
    def full_tokens_per_second(self) -> float:
        """Throughput at B itself: over the steps that decoded B sequences (a server's steady state at B)."""
        return self.full_tokens / self.full_seconds if self.full_seconds > 0 else 0.0


class _Run:
    """One method's engine in a round: every prompt queued in one Engine(max_batch=B); its clock: its decode steps."""

    def __init__(self, model, method: BatchMethod, prompts: list[list[int]], b: int, max_new_tokens: int, draft_models: dict,
                 temperature: float, seed: int, policy=None) -> None:
        from ..drafters import make_drafter
        from ..engine import Engine
        from ..sampling import Sampler, SamplingParams

        self.method, self.b = method, b
        k = auto_depth(model.module) if method.k == "auto" else (1 if method.drafter == "none" else method.k)
        self.engine = Engine(model.module, max_batch=b, depth=policy if method.k == "auto" else None)
        n = len(prompts)
        self.got: dict[int, int] = {}  # sequence index -> tokens it received in the current step
        self.clock = self.cpu = self.prefill = self.full_clock = 0.0
        self.full_tok = 0  # tokens of the steps that decoded b sequences, and their seconds (full_clock)
        self.start: list[float | None] = [None] * n  # the clock when it joined the batch
        self.last, self.n_tok, self.lat = [0.0] * n, [0] * n, []
        self.drafted = self.seq_steps = self.steps = 0
        self.sids, params = [], SamplingParams(temperature=temperature)
        for i, ids in enumerate(prompts):
            drafter = make_drafter(method.drafter, model.module, draft_model=draft_models.get(method.drafter),
                                   tree=method.tree)
            self.sids.append(self.engine.add(ids, drafter, Sampler(params, seed + i), k,
                                             max_new_tokens, model.tokenizer.stop_ids,
                                             lambda toks, i=i: self.got.__setitem__(i, self.got.get(i, 0) + len(toks))))
        self.index = {sid: i for i, sid in enumerate(self.sids)}

    @property
    def active(self) -> bool:
        return self.engine.active

    def step(self) -> None:
        """One engine step, timed; a step that prefills (some of) a prompt is prefill time, its tokens not counted."""
        e = self.engine
        decoding, full = not e.admitting, len(e.running) == self.b
        t0, c0 = perf_counter(), process_time()
        rec = e.step()
        dt, dc = perf_counter() - t0, process_time() - c0
        if not decoding:
            self.prefill += dt
            self.got.clear()
            for s in e.running:  # joined in this step: its clock starts now
                i = self.index[s.id]
                if self.start[i] is None:
                    self.start[i] = self.last[i] = self.clock
            return
        self.clock, self.cpu = self.clock + dt, self.cpu + dc
        if full:
            self.full_clock, self.full_tok = self.full_clock + dt, self.full_tok + sum(self.got.values())
        if rec is not None:
            self.steps, self.seq_steps = self.steps + 1, self.seq_steps + len(rec.seqs)
            self.drafted += sum(s.drafted for s in rec.seqs)
        for i, n in self.got.items():
            self.lat += [(self.clock - self.last[i]) / n] * n
            self.last[i], self.n_tok[i] = self.clock, self.n_tok[i] + n
        self.got.clear()

    def result(self, round_: int) -> BatchRun:
        per_seq = [(self.last[i] - self.start[i]) / self.n_tok[i] for i in range(len(self.n_tok)) if self.n_tok[i]]
        return BatchRun(
            method=self.method.label, batch=self.b, round=round_, decode_tokens=sum(self.n_tok), decode_seconds=self.clock,
            decode_cpu_seconds=self.cpu, prefill_seconds=self.prefill,
            seconds_per_token=statistics.mean(per_seq) if per_seq else 0.0,
            p50_token_latency=quantile(self.lat, 0.5), p99_token_latency=quantile(self.lat, 0.99),
            mean_depth=self.drafted / self.seq_steps if self.seq_steps else 0.0, steps=self.steps,
            tokens_per_forward=sum(self.n_tok) / self.seq_steps if self.seq_steps else 0.0,
            tokens=[self.engine.finished[s].result().tokens for s in self.sids if s in self.engine.finished],  # BESIDE: stopped midway
            full_tokens=self.full_tok, full_seconds=self.full_clock,
        )


BESIDE = "plain@B=1 beside"  # the label of the one-sequence plain run stepped beside plain at each B > 1


def cycled(ids: list[list[int]], b: int) -> list[list[int]]:
    """The prompt set, cycled up to b prompts when it has fewer (B sequences decode together from the start)."""
    return [ids[i % len(ids)] for i in range(max(len(ids), b))]


def run_round(model, methods: list[BatchMethod], prompts: list[list[int]], max_new_tokens: int, draft_models: dict,
              temperature: float = 0.0, seed: int = 0, round_: int = 0, batch: int | None = None,
              policies: dict | None = None, beside: bool = False) -> list[BatchRun]:
    """Every method's engine over `prompts` (cycled up to `batch`), stepped in turn (the order rotating by round).
    `policies`: label -> the depth policy of each auto method, kept by the caller. `beside` (batch > 1): one sequence
    decoding plain, a step after each of plain's, returned last as BESIDE."""
    from ..adaptive import ByBatchSize

    b = batch or len(prompts)
    prompts = cycled(prompts, b)
    policies = {} if policies is None else policies
    for m in methods:
        if m.k == "auto" and m.label not in policies:
            policies[m.label] = ByBatchSize(k_max=auto_depth(model.module))
    runs = [_Run(model, m, prompts, b, max_new_tokens, draft_models, temperature, seed, policies.get(m.label)) for m in methods]
    plain = next((x for x in runs if x.method.drafter == "none"), None)
    one = None
    if beside and plain is not None and b > 1:
        one = _Run(model, plain.method, prompts, 1, max_new_tokens, draft_models, temperature, seed)
    r = round_ % len(runs)
    runs = runs[r:] + runs[:r]
    while any(x.active for x in runs):
        for x in runs:
            if x.active:
                x.step()
                if x is plain and one is not None and one.active:
                    one.step()
    done = [x.result(round_) for x in sorted(runs, key=lambda x: methods.index(x.method))]
    return done + ([replace(one.result(round_), method=BESIDE, batch=b)] if one is not None else [])


def measure(model, methods: list[BatchMethod], ids: list[list[int]], batches: list[int], max_new_tokens: int,
            draft_models: dict, rounds: int = 3, temperature: float = 0.0, seed: int = 0, tick=None) -> list[BatchRun]:
    """Every method at every batch size, `rounds` times (run_round, after an untimed warm-up at each B)."""
    runs, policies = [], {}
    with frozen_heap():
        for b_n in batches:
            # untimed warm-up (B prompts, a few tokens)
            run_round(model, methods, cycled(ids, b_n)[:b_n], min(max_new_tokens, 4), draft_models, temperature, seed,
                      policies=policies)
            for r in range(rounds):
                runs += run_round(model, methods, ids, max_new_tokens, draft_models, temperature, seed, r, b_n, policies, beside=True)
                if tick is not None:
                    tick(f"B={b_n} round {r + 1}")
    return runs


METRICS = ("tokens_per_second", "cpu_tokens_per_second", "full_tokens_per_second", "seconds_per_token", "p50_token_latency", "p99_token_latency",
           "mean_depth", "tokens_per_forward", "decode_tokens")


def summarize(runs: list[BatchRun], methods: list[BatchMethod], batches: list[int], greedy: bool) -> dict:
    """Medians per (method, B), speedups over plain, auto against the best rival, greedy identity with plain."""
    table: dict[str, dict[str, dict]] = {m.label: {} for m in methods}
    mismatches = []
    for b_n in batches:
        plain = {r.round: r.tokens for r in runs if r.batch == b_n and r.method == "plain"}
        for m in methods:
            rs = [r for r in runs if r.batch == b_n and r.method == m.label]
            bad = []  # sequences whose tokens differ from plain's in the same round
            for r in rs if greedy else []:
                for i, (a, p) in enumerate(zip(r.tokens, plain[r.round])):
                    if a != p:
                        first = next((j for j, (x, y) in enumerate(zip(a, p)) if x != y), min(len(a), len(p)))
                        bad.append({"method": r.method, "batch": b_n, "round": r.round, "sequence": i, "first_difference": first})
            mismatches += bad
            cell = {k: median(getattr(r, k) for r in rs) for k in METRICS}
            n = len(rs[0].tokens) if rs else b_n
            table[m.label][str(b_n)] = cell | {"identical": f"{n - len({x['sequence'] for x in bad})}/{n}" if greedy else "-"}
    for row in table.values():
        for b, cell in row.items():
            p = table["plain"][b]["tokens_per_second"]
            cell["speedup"] = cell["tokens_per_second"] / p if p > 0 else None
    across = {}  # plain at each B against plain at the smallest B that ran the same prompt (default-mode batch agreement)
    first: dict[int, list[int]] = {}
    for b_n in batches if greedy else []:
        toks = next(r for r in runs if r.batch == b_n and r.method == "plain" and r.round == 0).tokens
        across[str(b_n)] = f"{sum(t == first.setdefault(i, t) for i, t in enumerate(toks))}/{len(toks)}"
    wall, cpu = (_ratios(table, runs, methods, batches, key) | {"plain_scaling_beside": _beside(runs, batches, key)}
                 for key in ("tokens_per_second", "cpu_tokens_per_second"))
    full = _ratios(table, runs, methods, batches, "full_tokens_per_second")["auto"]  # B slots busy: the drain left out
    return {"table": table, **wall, "mismatches": mismatches, "agreement_across_batch": across, "cpu": cpu, "full": full}


def _beside(runs: list[BatchRun], batches: list[int], key: str) -> dict:
    """Plain at each B over the one sequence stepped beside it (per round; B = 1: 1.0)."""
    out = {}
    for b in batches:
        r = 1.0 if b == 1 else _paired(runs, "plain", BESIDE, b, key)
        if r is not None and any(x.batch == b and x.method == "plain" for x in runs):
            out[str(b)] = r
    return out


def _ratios(table: dict, runs: list[BatchRun], methods: list[BatchMethod], batches: list[int], key: str) -> dict:
    """By throughput `key`: each auto method over plain and over the best (highest median) of plain and its drafter's
    fixed depths, paired round by round; beside it the ratio of medians and `ratio_to_held_out` (the rival picked on
    the other rounds: picked and judged on the same rounds, the best of tied rivals is the luckiest); plain over B = 1."""
    auto = {}
    for m in [m for m in methods if m.k == "auto"]:
        rivals = ["plain"] + [x.label for x in methods if x.drafter == m.drafter and x.k != "auto"]
        auto[m.label] = {}
        for b in batches:
            best = max(rivals, key=lambda lab: table[lab][str(b)][key])
            auto[m.label][str(b)] = {"best": best, "ratio_to_best": _paired(runs, m.label, best, b, key),
                                     "ratio_to_plain": _paired(runs, m.label, "plain", b, key),
                                     "ratio_of_medians": _over(table[m.label][str(b)][key], table[best][str(b)][key]),
                                     "ratio_to_held_out": _held_out(runs, m.label, rivals, b, key)}
    p1 = table["plain"]["1"][key] if 1 in batches else None
    return {"auto": auto, "plain_scaling": {str(b): table["plain"][str(b)][key] / p1 for b in batches} if p1 else {}}


def _held_out(runs: list[BatchRun], num: str, rivals: list[str], b: int, key: str) -> float | None:
    """Per round, `num` over the rival with the highest median in the other rounds; their median (None under 2 rounds)."""
    by = _by_round(runs, b, key)
    rounds = sorted({rnd for m, rnd in by if m == num})
    if len(rounds) < 2:
        return None
    ratios = []
    for rnd in rounds:
        others = {lab: median(v for (m, q), v in by.items() if m == lab and q != rnd) for lab in rivals}
        others = {lab: v for lab, v in others.items() if v is not None and (lab, rnd) in by}
        if others:
            ratios.append(_over(by[num, rnd], by[max(others, key=others.get), rnd]))
    return median(ratios)


def _by_round(runs: list[BatchRun], b: int, key: str) -> dict[tuple[str, int], float]:
    """(method, round) -> its `key` at batch size b."""
    return {(r.method, r.round): getattr(r, key) for r in runs if r.batch == b}


def _over(a: float, b: float) -> float | None:
    return a / b if b > 0 else None


def _paired(runs: list[BatchRun], num: str, den: str, b: int, key: str) -> float | None:
    """The median over rounds of method `num`'s `key` over method `den`'s in the same round, at batch size b."""
    by = _by_round(runs, b, key)
    return median(_over(by[num, rnd], by[den, rnd]) for m, rnd in by if m == num and (den, rnd) in by)


def check_targets(summary: dict, model_name: str) -> list[dict]:
    """The batch targets this run measured, by wall time (the detail: by CPU time)."""
    wall, cpu = summary, summary["cpu"]
    out = []
    if "8" in wall["plain_scaling_beside"]:
        across = f"across phases {wall['plain_scaling']['8']:.2f}; " if "8" in wall["plain_scaling"] else ""
        out.append(target("plain throughput at B=8 >= 4x B=1 (one sequence stepped beside it)", wall["plain_scaling_beside"]["8"], 4.0,
                          f"{across}by CPU time {cpu['plain_scaling_beside']['8']:.2f}"))
    for lab, per_b in wall["auto"].items():
        worst = min(per_b, key=lambda b: per_b[b]["ratio_to_best"] or 0.0)
        cpu_worst = min(x["ratio_to_best"] or 0.0 for x in cpu["auto"][lab].values())
        medians = min(x["ratio_of_medians"] or 0.0 for x in per_b.values())
        held = [x["ratio_to_held_out"] for x in per_b.values() if x["ratio_to_held_out"] is not None]
        held_out = f"; over the rival best in the other rounds, worst {min(held):.2f}" if len(held) == len(per_b) else ""
        out.append(target(f"{lab} >= 0.97x the best of plain and fixed D at every B, per round (worst: B={worst}, vs {per_b[worst]['best']})",
                          per_b[worst]["ratio_to_best"] or 0.0, 0.97, f"ratio of medians, worst {medians:.2f}{held_out}; by CPU time {cpu_worst:.2f}"))
        out += [target(f"{lab} >= 1.3x plain at B={b}" + ("" if model_name == "demo" else " (stated for the demo model)"),
                       per_b[b]["ratio_to_plain"] or 0.0, 1.3, f"by CPU time {cpu['auto'][lab][b]['ratio_to_plain'] or 0.0:.2f}")
                for b in ("1", "2") if b in per_b]
    return out


def markdown(result: dict, image: str | None) -> str:
    c, s = result["config"], result["summary"]
    bs = [str(b) for b in c["batches"]]
    ms = lambda x: "-" if x is None else f"{1000 * x:.1f}"  # noqa: E731

    def table(title: str, fmt) -> list[str]:
        return section(title, ["method"] + [f"B={b}" for b in bs], [[lab] + [fmt(row[b]) for b in bs] for lab, row in s["table"].items()])

    lines = [
        f"# Batch benchmark: {c['model_name']}", "",
        f"{c['num_prompts']} prompts from {c['prompts_name']} at every B, B decoding at a time (one joins as another leaves; cycled when B exceeds them), "
        f"{c['max_new_tokens']} new tokens per sequence, temperature {c['temperature']}, {c['threads']} thread(s), median of {c['rounds']} rounds (methods alternate "
        "within a round; one `--k auto` policy per method for the whole run). Decode only: the steps that prefilled a prompt are not timed.",
        *table("## Throughput (tokens/s, all sequences)", lambda x: f"{x['tokens_per_second']:.1f}"),
        *table("## Throughput with every slot busy (tokens/s over the steps that decoded B sequences: the queue's end, as "
               "the batch drains, left out)", lambda x: f"{x['full_tokens_per_second']:.1f}"),
        *table("## Throughput by CPU time (tokens per CPU second of this process: with one thread, little moved by other jobs)",
               lambda x: f"{x['cpu_tokens_per_second']:.1f}"),
        *table("## Speedup over plain at the same B", lambda x: f"{x['speedup']:.2f}" if x["speedup"] else "-"),
        *table("## Per-sequence latency (ms per token: mean over sequences / p50 / p99 over tokens)",
               lambda x: f"{ms(x['seconds_per_token'])} / {ms(x['p50_token_latency'])} / {ms(x['p99_token_latency'])}"),
        *table("## Mean draft depth per sequence step (a tree: its nodes)", lambda x: f"{x['mean_depth']:.2f}"),
        *table("## Tokens per target forward (per sequence: the mean accepted length)", lambda x: f"{x['tokens_per_forward']:.2f}"),
        *table("## Greedy identity with plain (sequences equal in every round)", lambda x: x["identical"]), "",
    ]
    for name, r in (("", s), (" (by CPU time)", s["cpu"])):
        if r["plain_scaling"]:
            lines.append(f"Plain throughput over B=1{name}, across phases: " + ", ".join(f"B={b}: {v:.2f}x" for b, v in r["plain_scaling"].items()) + "\n")
        if r["plain_scaling_beside"]:
            lines.append(f"Plain throughput over one sequence stepped beside it{name}: "
                         + ", ".join(f"B={b}: {v:.2f}x" for b, v in r["plain_scaling_beside"].items()) + "\n")
        lines += [f"{lab} over the best of plain and fixed D{name}: " + ", ".join(
            f"B={b}: {v['ratio_to_best']:.2f} (best {v['best']}; ratio of medians {v['ratio_of_medians']:.2f}"
            + (f"; over the rival best in the other rounds {v['ratio_to_held_out']:.2f}" if v["ratio_to_held_out"] is not None else "") + ")"
            for b, v in per_b.items() if v["ratio_to_best"] is not None and v["ratio_of_medians"] is not None) + "\n"
            for lab, per_b in r["auto"].items()]
    lines += [f"{lab} over the best of plain and fixed D with every slot busy (not a target: the drain left out): " + ", ".join(
        f"B={b}: {v['ratio_to_best']:.2f} (best {v['best']})" for b, v in per_b.items() if v["ratio_to_best"] is not None) + "\n"
        for lab, per_b in s["full"].items()]
    if s["agreement_across_batch"]:
        lines.append("Plain at B against plain at the smallest B with the same prompt (default mode): "
                     + ", ".join(f"B={b}: {v}" for b, v in s["agreement_across_batch"].items()))
    if s["mismatches"]:
        lines.append(f"**{len(s['mismatches'])} mismatches with plain**: " + "; ".join(
            f"{x['method']} B={x['batch']} round {x['round']} seq {x['sequence']} from token {x['first_difference']}"
            for x in s["mismatches"][:20]))
    lines += targets_md(result["targets"]) + ([f"\n![throughput and speedup against batch size]({image})"] if image else [])
    return "\n".join(lines) + "\n"


def plot(result: dict, path: Path) -> Path:
    """Throughput against B (one line per method) and speedup over plain against B."""
    t, bs = result["summary"]["table"], result["config"]["batches"]
    fig, (a, b) = pyplot().subplots(1, 2, figsize=(11, 4))
    for lab, row in t.items():
        a.plot(bs, [row[str(x)]["tokens_per_second"] for x in bs], marker="o", label=lab)
        b.plot(bs, [row[str(x)]["speedup"] or 0.0 for x in bs], marker="o", label=lab)
    for ax, yl in ((a, "tokens/s (all sequences, decode)"), (b, "speedup over plain at the same B")):
        log2_axis(ax, bs, "batch size B", yl)
        ax.legend(fontsize=7)
    b.axhline(1.0, color="k", lw=0.8)
    fig.suptitle(f"{result['config']['model_name']}: throughput against batch size")
    return save(fig, path)


def run_batch_bench(setup, drafters: list[str], ks: list[int | str], batches: list[int], out: str | Path, rounds: int = 3,
                    trees: list[int] | None = None, temperature: float = 0.0, seed: int = 0, plot_prefix: str = "bench_",
                    progress: bool = True) -> dict:
    """Measure on a loaded cli.Setup; write batch.json, batch.md and {plot_prefix}batch.png into `out`; return the result."""
    if rounds < 1:
        raise ConfigError(f"--rounds must be >= 1, got {rounds}")
    t_start = perf_counter()
    methods = [BatchMethod("none", 1)] + [BatchMethod(d, k) for d in drafters if d != "none" for k in ks]
    methods += [BatchMethod(d, k, n) for d in drafters if d != "none" for k in ks if k != "auto" for n in trees or ()]
    with progress_bar(progress, len(batches) * rounds, "bench --batch", "round") as tick:
        runs = measure(setup.model, methods, setup.ids, batches, setup.config["max_new_tokens"], setup.draft_models, rounds,
                       temperature, seed, tick)
    summary = summarize(runs, methods, batches, greedy=temperature == 0)
    result = {
        "config": setup.config | {"batches": batches, "methods": [m.label for m in methods], "k_max_auto": AUTO_K_MAX,
                                  "temperature": temperature, "seed": seed, "rounds": rounds, "elapsed_seconds": perf_counter() - t_start,
                                  "timing": "decode only: the engine steps that prefilled a prompt are not timed"},
        "summary": summary,
        "runs": [{k: v for k, v in asdict(r).items() if k != "tokens"} | {k: getattr(r, k) for k in METRICS[:3]} for r in runs],
        "targets": check_targets(summary, setup.config["model_name"]),
    }
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    files = {"json": out / "batch.json", "markdown": out / "batch.md", "plot": plot(result, out / f"{plot_prefix}batch.png")}
    result["files"] = {k: str(v) for k, v in files.items()}
    files["markdown"].write_text(markdown(result, files["plot"].name))
    files["json"].write_text(json.dumps(result, indent=1))
    return result

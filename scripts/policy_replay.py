"""Replay `--k auto` on the demo's real acceptance, with the machine's noise under control.

Greedy tokens do not depend on the depths chosen, and neither does the MTP head's chain of drafts from a position.
`record` generates each prompt once with plain steps, computing the head's chain of k drafts at every position, and
stores L(p): how many of them the target's own tokens agree with. A step that drafts d from p then accepts exactly
min(d, L(p)), alone or in a batch (checked: docs/benchmarks.md, "Replaying the policy").

`run` replays the `mtpspec bench --batch` loop (prompts queued, B decoding at a time; `--groups`: in groups of B)
against that table and a cost model per batch size (DEMO_COST), the policy's own Python time counted, with the
machine's noise dialled in: spread per step, spikes, and drift along one path of simulated time, the same for every
method and seed; it prints each method's tokens/s over the best fixed D. Costs being known, a policy's loss here is
its decisions' alone. Not modelled: the drafter's catch-up after plain steps and any bend of the forward's cost
across widths, so a change that leans on those can win here and lose on the machine.

    .venv/bin/python scripts/policy_replay.py record --out build/replay.json       # demo, 16 prompts
    .venv/bin/python scripts/policy_replay.py run --table build/replay.json --batch 1,2,4,8,16 \
        [--seeds 12] [--spread 0.15] [--drift 0.03] [--spike 0.05] [--option cost_margin=0.0 ...] \
        [--cost 8=14.8,21.8,2.6,1.3,2.3 ...] [--queue 48 | --groups] [--fresh]
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import time

from mtpspec.types import BatchStep, Draft, SeqStep

# batch size -> (plain forward, forward at width 2, per width beyond, drafting per step, per draft level) in ms: the
# demo's medians by width over plain and fixed D = 1-6 (one thread, humaneval, 128 tokens); sizes between are
# interpolated. Re-measure on another machine and pass --cost: the best fixed D moves with the price of drafting.
DEMO_COST = {1: (10.27, 11.05, 0.46, 0.57, 0.67), 2: (11.13, 14.11, 0.96, 0.76, 0.98), 4: (12.93, 17.22, 1.78, 0.99, 1.29),
             8: (15.95, 22.48, 3.44, 1.24, 1.89), 16: (22.92, 34.51, 5.31, 2.04, 3.04)}


class Peek:
    """A drafter that computes the MTP head's chain of k drafts, records them, and drafts nothing (a plain step)."""

    name, prefill_logits = "peek", False

    def __init__(self, inner) -> None:
        self.inner, self.drafts = inner, []  # [(context length, [k drafted tokens])]

    def prefill(self, context, out, sampler) -> None:
        self.inner.prefill(context, out, sampler)

    def propose(self, context, k: int) -> Draft:
        d = self.inner.propose(context, k)
        self.drafts.append((int(context.shape[0]), d.tokens.tolist()))
        return Draft.empty()

    def commit(self, verdict, out) -> None:
        self.inner.cache.crop(self.inner.committed)  # drop the chain's entries, as after a verify that kept none
        self.inner.commit(verdict, out)


def record(model_name: str, prompts: str, limit: int, max_new_tokens: int, k: int) -> list[list[int]]:
    """L(p) for every decode position p of every prompt: the agreement of the head's k-draft chain with greedy."""
    import mtpspec
    from mtpspec.bench.harness import prepare_ids
    from mtpspec.drafters import make_drafter
    from mtpspec.engine import Engine
    from mtpspec.prompts import load_prompts
    from mtpspec.sampling import Sampler, SamplingParams

    model = mtpspec.load(model_name, threads=1)
    table = []
    for ids in prepare_ids(model, load_prompts(prompts, limit), max_new_tokens):
        engine, peek = Engine(model.module), Peek(make_drafter("mtp", model.module))
        sid = engine.add(ids, peek, Sampler(SamplingParams()), k, max_new_tokens, model.tokenizer.stop_ids)
        text = list(ids) + list(engine.run()[sid].tokens)
        row = []
        for n, drafts in peek.drafts:
            agree = 0
            while agree < len(drafts) and n + agree < len(text) and drafts[agree] == text[n + agree]:
                agree += 1
            row.append(agree)
        table.append(row)
    return table


class Fixed:
    """Every sequence drafts d (as room allows)."""

    def __init__(self, d: int) -> None:
        self.d = d

    def next_depths(self, seqs, k_max):
        return [min(self.d, k) for k in k_max]

    def observe(self, step) -> None: ...

    def drop(self, seq) -> None: ...


def cost_at(b: int, costs: dict) -> tuple[float, ...]:
    lo, hi = max(x for x in costs if x <= b), min((x for x in costs if x >= b), default=max(costs))
    t = 0.0 if hi == lo else (b - lo) / (hi - lo)
    return tuple(a + t * (c - a) for a, c in zip(costs[lo], costs[hi]))


def replay(policy, table: list[list[int]], batch: int, rounds: int = 3, seed: int = 0, budget: int = 128,
           spread: float = 0.15, drift: float = 0.0, spike: float = 0.0, costs: dict = DEMO_COST, k: int = 8,
           queue: int = 0) -> float:
    """Tokens/s of `policy` over `rounds` passes of the bench --batch loop (the median round); `k`: the chain length
    the table was recorded with, the deepest draft it can answer for. `queue` > 0: in place of groups, `queue`
    prompts (the table cycled) join one by one as sequences leave, so the batch stays full until the queue is
    empty (continuous batching: one tail per round, not one per group)."""
    rng, path_rng, path = random.Random(seed), random.Random(seed + 7919), [1.0]
    clock, rates, sid = 0.0, [], 0

    def speed(t: float) -> float:  # the machine's slowness per 50 ms of simulated time (one path for every method)
        while len(path) <= int(t / 0.05):
            path.append(min(max(1.0 + 0.97 * (path[-1] - 1.0) + path_rng.gauss(0.0, drift), 0.7), 1.5))
        return path[int(t / 0.05)]

    for _ in range(rounds):
        tokens = seconds = 0.0
        waiting = [table[i % len(table)] for i in range(queue or len(table))]
        pos, rows = {}, {}  # sequence id -> tokens emitted, its row of L
        while waiting or pos:
            if not pos or queue:  # groups: the next B once the last group has left; a queue: every free slot
                while waiting and len(pos) < batch:
                    pos[sid], rows[sid] = 0, waiting.pop(0)
                    sid += 1
            seqs = list(pos)
            caps = [max(min(k, budget - pos[s] - 1), 0) for s in seqs]
            t0 = time.perf_counter()
            ds = [min(d, c) for d, c in zip(policy.next_depths(seqs, caps), caps)]
            policy_s = time.perf_counter() - t0
            plain, w2, per_width, draft0, per_level = cost_at(len(seqs), costs)
            width, now = max(ds) + 1, speed(clock)
            jolt = 1.0 + (rng.uniform(0.3, 1.0) if rng.random() < spike else 0.0)  # a spike slows the forward
            forward = (plain if width == 1 else w2 + per_width * (width - 2)) * 1e-3 * now * jolt
            forward *= rng.uniform(1 - spread / 5, 1 + spread)
            draft = (draft0 + per_level * (width - 1)) * 1e-3 * now if width > 1 else 0.0
            draft *= rng.uniform(1 - spread / 5, 1 + spread)
            overhead, drafting = 3e-5 * len(seqs), sum(1 for d in ds if d)
            parts = []
            for s, d in zip(seqs, ds):
                accepted = min(d, rows[s][pos[s]]) if pos[s] < len(rows[s]) else 0
                pos[s] += accepted + 1
                parts.append(SeqStep(s, d, accepted, draft / drafting if d else 0.0, True))
            t0 = time.perf_counter()
            policy.observe(BatchStep(rows=len(seqs) + sum(ds), width=width, forward_seconds=forward,
                                     overhead_seconds=overhead, seqs=tuple(parts)))
            policy_s += time.perf_counter() - t0
            tokens += len(seqs) + sum(p.accepted for p in parts)
            seconds += forward + draft + overhead + policy_s
            clock += forward + draft + overhead
            for s in seqs:
                if pos[s] >= budget:
                    policy.drop(s)
                    del pos[s]
        rates.append(tokens / seconds)
    return statistics.median(rates)


def compare(table: list[list[int]], batch: int, policies: dict, seeds: int, before: tuple[int, ...] = (),
            **noise) -> dict[str, float]:
    """Mean tokens/s over `seeds` of plain, fixed D = 1..5 and each policy (name -> factory); `before`: batch sizes
    each policy first serves for one round (as `bench --batch` keeps one policy from B = 1 up; a fixed depth learns
    nothing, so it does not)."""
    makers = {"plain": lambda: Fixed(0), **{f"mtp@{d}": (lambda d=d: Fixed(d)) for d in range(1, 6)}, **policies}

    def run(make, s: int) -> float:
        policy = make()
        for b in before if not isinstance(policy, Fixed) else ():
            replay(policy, table, b, rounds=1, seed=1000 + s, **noise)
        return replay(policy, table, batch, seed=s, **noise)

    return {name: statistics.mean(run(make, s) for s in range(seeds)) for name, make in makers.items()}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    sub = ap.add_subparsers(dest="cmd", required=True)
    rec = sub.add_parser("record", help="L(p) for every position of every prompt (runs the model)")
    rec.add_argument("--model", default="demo")
    rec.add_argument("--prompts", default="humaneval")
    rec.add_argument("--limit", type=int, default=16)
    rec.add_argument("--max-new-tokens", type=int, default=128)
    rec.add_argument("--k", type=int, default=8)
    rec.add_argument("--out", required=True)
    run = sub.add_parser("run", help="replay fixed D and --k auto against a recorded table")
    run.add_argument("--table", required=True)
    run.add_argument("--batch", default="2,4,8,16")
    run.add_argument("--seeds", type=int, default=12)
    run.add_argument("--spread", type=float, default=0.15, help="per-step spread of a cost (its fraction above the base)")
    run.add_argument("--drift", type=float, default=0.0, help="step of the machine speed's random walk per 50 ms")
    run.add_argument("--spike", type=float, default=0.0, help="share of forwards 1.3-2x slow")
    run.add_argument("--queue", type=int, default=0, help="N prompts per round fed from the queue (a sequence joins as "
                     "one leaves; default: the table's prompts, as the bench)")
    run.add_argument("--groups", action="store_true", help="the prompts in groups of B, each after the last has left "
                     "(the bench until 2026-12-04)")
    run.add_argument("--fresh", action="store_true", help="a new policy at each B (default: it first serves each "
                     "smaller B of --batch for a round, as the bench's one policy does)")
    run.add_argument("--option", action="append", default=[], help="name=value for the auto policy (repeatable)")
    run.add_argument("--cost", action="append", default=[], help="B=plain,width2,per_width,draft,per_level in ms: replaces "
                     "one batch size's costs (repeatable)")
    args = ap.parse_args()
    if args.cmd == "record":
        table = record(args.model, args.prompts, args.limit, args.max_new_tokens, args.k)
        with open(args.out, "w") as f:
            json.dump({"model": args.model, "prompts": args.prompts, "k": args.k, "L": table}, f)
        print(f"{len(table)} prompts, mean L {statistics.mean(x for row in table for x in row):.2f} -> {args.out}")
        return
    from mtpspec.adaptive import ByBatchSize
    from mtpspec.bench.harness import K_MAX_AUTO

    with open(args.table) as f:
        recorded = json.load(f)
    table, k = recorded["L"], recorded["k"]
    options = {k: json.loads(v) for k, v in (o.split("=", 1) for o in args.option)}
    costs = dict(DEMO_COST)
    for c in args.cost:
        b, values = c.split("=", 1)
        costs[int(b)] = tuple(float(x) for x in values.split(","))
        if len(costs[int(b)]) != 5:
            raise SystemExit(f"--cost {c}: give five numbers (plain, width 2, per width, draft, per level)")
    policies = {"mtp@auto": lambda: ByBatchSize(k_max=min(K_MAX_AUTO, k), **options)}
    batches = sorted(int(x) for x in args.batch.split(","))
    for b in batches:
        before = () if args.fresh else tuple(x for x in batches if x < b)
        rates = compare(table, b, policies, args.seeds, before, spread=args.spread, drift=args.drift, spike=args.spike,
                        costs=costs, k=k, queue=0 if args.groups else args.queue or len(table))
        best = max(v for name, v in rates.items() if name not in policies)
        print(f"B={b:2d} " + "  ".join(f"{name} {v:.0f} ({v / best:.3f})" for name, v in rates.items()), flush=True)


if __name__ == "__main__":
    main()

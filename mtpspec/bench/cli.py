"""`mtpspec bench`: acceptance, speedup, cost model and peers on a prompt set; JSON + markdown + PNG.

    mtpspec bench --model stories260K.bin --tokenizer tok512.bin --prompts spec_bench --drafters none,ngram,draft \\
        --draft-model stories260K_q80.bin --k 1,2,4,auto --limit 20 --max-new-tokens 128 --peers --out bench_out

--batch 1,2,4,8 measures B sequences decoding together instead (batch.py); --contexts L,... --sparse-model S full-attention
against sparse MTP by context length (contexts.py).
"""

from __future__ import annotations

import argparse
import sys
from dataclasses import dataclass
from pathlib import Path
from time import perf_counter

import torch

from ..cli import add_device_arg, add_model_args, add_threads_arg, command, parse_k, use_device, use_threads
from ..errors import ConfigError
from ..loading import parse_dtype
from .common import parse_counts, progress_bar


def _list(text: str) -> list[str]:
    return [x.strip() for x in text.split(",") if x.strip()]


def _args(p: argparse.ArgumentParser) -> None:
    add_model_args(p)
    p.add_argument("--prompts", help="(required but with --contexts) spec_bench | mt_bench | humaneval | tinystories, or a .jsonl / .jsonl.gz / .txt file")
    p.add_argument("--drafters", default="none,ngram", help="comma-separated: none,ngram,draft,mtp,...; a drafter with options "
                   "as NAME+KEY=VALUE (e.g. mtp+mtp_lookup=4, keywords as in Model.generate), measured beside NAME alone")
    p.add_argument("--draft-model", help="draft model for the 'draft' drafter (and the assisted-generation peer), "
                   "or a head folder (mtp / eagle / medusa, from `mtpspec train head`) for that drafter")
    p.add_argument("--k", help="comma-separated draft depths, e.g. 1,2,4,auto (default; with --contexts: one depth, default 4)")
    p.add_argument("--limit", type=int, help="number of prompts (taken round-robin over categories)")
    p.add_argument("--max-new-tokens", type=int, default=128)
    p.add_argument("--temperature", type=float, default=0.0)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--repeat", type=int, default=1, help="run each prompt x method N times (alternating rounds)")
    p.add_argument("--keep", choices=["mean", "median", "best"], default="mean",
                   help="with --repeat: the rounds' mean time (keeps the pairing of interleaved runs), their median, or each one's fastest")
    p.add_argument("--interleave", choices=["auto", "step", "run"], default="auto",
                   help="step: our methods of a prompt take turns every 5 ms (drift cancels step by step); "
                   "run: whole generations in turn, as a peer runs; auto: step with one torch thread and no peers, else run")
    add_threads_arg(p)
    add_device_arg(p)
    p.add_argument("--peers", nargs="?", const="hf", default="",
                   help="peers on the same weights, comma-separated: hf (transformers' generate(); bare --peers), "
                   "llamacpp (llama-server from `make llamacpp`, on a GGUF export)")
    p.add_argument("--gguf", help="the target as GGUF for the llamacpp peer (default: exported to OUT/gguf)")
    p.add_argument("--no-cost-model", action="store_true", help="skip measuring the cost model")
    p.add_argument("--plot-prefix", default="bench_", help="file name prefix of the PNG plots")
    p.add_argument("--no-progress", action="store_true")
    p.add_argument("--batch", help="batch sizes, comma-separated (e.g. 1,2,4,8,16): measure B sequences decoding together "
                   "(throughput, per-sequence latency) for plain, each --k and auto instead of the per-prompt benchmark")
    p.add_argument("--rounds", type=int, default=3, help="with --batch: rounds (methods alternate within one); medians are reported")
    p.add_argument("--trees", help="with --batch: token-tree node budgets, comma-separated (e.g. 8,16): each drafter at each "
                   "fixed --k also drafts trees of that many nodes (depth <= k), measured beside the chains")
    p.add_argument("--contexts", help="context lengths in tokens, comma-separated (e.g. 512,1024,4096,16384): full-attention MTP "
                   "(--model) vs sparse MTP (--sparse-model, recompute and reuse) vs plain at one depth --k on prompts of exactly "
                   "that many tokens of held-out text (--prompts: a text file or folder of .py files; default the demo's held-out "
                   "stdlib modules); --limit prompts per context (default 4 up to 2k tokens, fewer beyond)")
    p.add_argument("--sparse-model", help="with --contexts: a checkpoint of the same target with a sparse-attention MTP module")
    p.add_argument("--out", required=True, help="output directory")


def drafter_specs(items: list[str]) -> list[tuple[str, tuple[tuple[str, object], ...]]]:
    """--drafters entries, NAME or NAME+KEY=VALUE[+KEY=VALUE...], as (name, options); options checked as make_drafter checks
    them (an unknown one, or one the drafter does not read, is an error naming it)."""
    from ..drafters import check_options

    specs = []
    for item in items:
        name, *pairs = item.split("+")
        options = []
        for pair in pairs:
            key, eq, text = pair.partition("=")
            if not eq or not key or not text:
                raise ConfigError(f"--drafters {item}: a drafter option is KEY=VALUE (e.g. mtp+mtp_lookup=4), got {pair!r}")
            value = {"true": True, "false": False}.get(text.lower(), int(text) if text.lstrip("-").isdigit() else text)
            options.append((key, value))
        check_options(name, dict(options))
        specs.append((name, tuple(options)))
    return specs


@dataclass
class Setup:
    """What every mode of the benchmark loads before it times anything."""

    model: object  # api.Model
    draft: object | None  # the full draft model (when --draft-model is one), for the peers
    draft_models: dict  # drafter -> its draft_model argument (a module, a head)
    prompts: list  # prompts.Prompt
    ids: list[list[int]]  # their token ids, cut to leave room for max_new_tokens
    config: dict  # what the results record of it


def load_bench(model_path: str, prompts: str, drafters: list[str], ks: list[int | str], max_new_tokens: int = 128,
               tokenizer: str | None = None, draft_model: str | None = None, limit: int | None = None, dtype: str = "fp32",
               threads: int | None = None, quant: str | None = None, compile: bool = False, tree: int | None = None,
               device: str | None = None) -> Setup:
    """Check the request and load what it names; a bad combination fails here, before anything is timed."""
    from ..api import load
    from ..drafters import REGISTRY, make_drafter
    from ..models.heads import load_head
    from ..prompts import load_prompts
    from .harness import prepare_ids

    for d in drafters:
        if d not in REGISTRY:
            raise ConfigError(f"unknown or unavailable drafter '{d}' (available: {', '.join(sorted(REGISTRY))})")
    if "draft" in drafters and not draft_model:
        raise ConfigError("--drafters draft needs --draft-model")
    for k in ks:
        if k != "auto" and (not isinstance(k, int) or isinstance(k, bool) or k < 1):
            raise ConfigError(f"--k values must be integers >= 1 or 'auto', got {k!r}")
    if limit is not None and limit < 1:
        raise ConfigError(f"--limit must be >= 1, got {limit}")
    model = load(model_path, tokenizer, dtype, threads=threads, quant=quant, compile=compile, device=device)
    dm, draft_models = None, {}  # the full draft model; drafter -> its draft_model argument
    if draft_model and (Path(draft_model) / "head.json").exists():  # a head folder goes to the drafter of its kind
        head = load_head(Path(draft_model), parse_dtype(dtype))
        kind = head.config.kind
        if "draft" in drafters:
            raise ConfigError(f"--drafters draft needs a full draft model; {draft_model} is a {kind} head")
        if kind not in drafters:
            raise ConfigError(f"--draft-model {draft_model} is a {kind} head, but --drafters ({','.join(drafters)}) does not include {kind}")
        draft_models = {kind: head}
    elif draft_model:  # a full model, for the 'draft' drafter and the assisted-generation peer (as `mtpspec generate` takes it)
        dm = load(draft_model, tokenizer, dtype, device=device)
        draft_models = {"draft": dm.module}
    for d in drafters:  # a head for another target, no MTP module, ...
        make_drafter(d, model.module, draft_model=draft_models.get(d), tree=tree)
    try:
        plist = load_prompts(prompts, limit)
    except (OSError, UnicodeDecodeError, EOFError) as e:
        raise ConfigError(f"--prompts {prompts}: cannot read prompts from it ({e.__class__.__name__}: {e})") from None
    config = {"model": str(model_path), "model_name": Path(str(model_path)).name, "draft_model": draft_model, "dtype": dtype,
              "compile": compile, "quant": quant,
              "prompts": str(prompts), "prompts_name": Path(str(prompts)).name, "num_prompts": len(plist),
              "max_new_tokens": max_new_tokens, "max_prompt_tokens": model.max_seq_len - max_new_tokens, "drafters": drafters,
              "k": ks, "threads": model.threads, "torch": torch.__version__}
    return Setup(model, dm, draft_models, plist, prepare_ids(model, plist, max_new_tokens), config)


def run_benchmark(model_path: str, prompts: str, drafters: list[str], ks: list[int | str], out: str | Path, tokenizer: str | None = None,
                  draft_model: str | None = None, limit: int | None = None, max_new_tokens: int = 128, temperature: float = 0.0,
                  seed: int = 0, peers: bool | str | list[str] = False, threads: int | None = None, cost_model: bool = True,
                  dtype: str = "fp32", plot_prefix: str = "bench_", progress: bool = True, repeat: int = 1,
                  interleave: str = "auto", keep: str = "mean", gguf: str | None = None, quant: str | None = None,
                  compile: bool = False, device: str | None = None) -> dict:
    """Run the whole benchmark; write results.json, report.md and the plots into `out`; return the result."""
    from . import costmodel
    from ..models.compiled import AUTO_K_MAX, MAX_WIDTH, auto_depth, prepare
    from .harness import PLAIN, Method, OursRunner, run_bench, warm_up
    from .report import check_targets, summarize, write_all

    t_start = t = perf_counter()
    out = Path(out)
    if repeat < 1:
        raise ConfigError(f"--repeat must be >= 1, got {repeat}")
    if interleave not in ("auto", "step", "run") or keep not in ("mean", "median", "best"):
        raise ConfigError(f"--interleave takes auto, step or run and --keep mean, median or best, got {interleave!r} and {keep!r}")
    peers = ["hf"] if peers is True else _list(peers) if isinstance(peers, str) else list(peers or [])
    if set(peers) - {"hf", "llamacpp"}:
        raise ConfigError(f"--peers takes hf and/or llamacpp, got {','.join(peers)}")
    if "llamacpp" in peers:  # a missing binary fails before anything is loaded or timed
        from .llamacpp import find_binary

        find_binary("llama-server")
    specs = drafter_specs(drafters)
    drafters = list(dict.fromkeys(name for name, _ in specs))  # the drafters' names, each once
    s = load_bench(model_path, prompts, drafters, ks, max_new_tokens, tokenizer, draft_model, limit, dtype, threads, quant,
                   compile, device=device)
    model, ids, threads = s.model, s.ids, s.model.threads
    if interleave == "auto":  # lockstep needs one torch thread (waiting jobs' OpenMP pools would spin), and a peer runs
        # whole requests alone: in the rotation our compiled methods run slower than alone (scripts/rotation_cost.py)
        interleave = "step" if threads == 1 and not peers else "run"
    elif interleave == "step" and threads != 1:
        raise ConfigError(f"--interleave step needs --threads 1 (got {threads}): each waiting job's thread pool would spin")
    phases, t = {"load": perf_counter() - t}, perf_counter()  # seconds of each setup phase and of the timed runs
    cost = None
    if cost_model:
        k_max = max([k for k in ks if k != "auto"] + [AUTO_K_MAX])
        typical = sorted(ids, key=len)[len(ids) // 2]  # the median prompt
        context = min(len(typical) + max_new_tokens // 2, model.max_seq_len - k_max - 2)  # a typical cache
        cost = costmodel.measure(model.module, k_max, context, threads, drafters, s.draft_models, typical)
    phases["cost_model"], t = perf_counter() - t, perf_counter()

    methods = [PLAIN] + [Method("mtpspec", d, k, options) for d, options in specs if d != "none" for k in ks]
    runners: dict[str, object] = {"mtpspec": OursRunner(model, s.draft_models, cost)}
    skipped: dict[str, str] = {}  # peer method -> why the peer cannot run it on this model
    export_diff = {}
    if "hf" in peers:
        from .peers import HFRunner, peer_model

        exported = {"target": peer_model(model, out / "hf", "target")}
        if s.draft is not None:
            exported["draft"] = peer_model(s.draft, out / "hf", "draft")
        export_diff = {name: p.export_diff for name, p in exported.items()}
        runners["transformers"] = HFRunner(exported["target"], exported.get("draft"), tuple(model.tokenizer.stop_ids))
        hf_ks = [k for k in ks if k != "auto"]
        hf_ks += [] if 10 in hf_ks else [10]  # 10: transformers' usual prompt lookup
        candidates = [Method("transformers", "none", None)]
        candidates += [Method("transformers", "ngram", k) for k in hf_ks] if "ngram" in drafters else []
        candidates += [Method("transformers", "draft", None)] if "draft" in drafters else []
        _admit(runners["transformers"], candidates, methods, skipped)
        phases["peers_setup"], t = perf_counter() - t, perf_counter()
    if "llamacpp" in peers:
        from .llamacpp import LlamaCppRunner, llamacpp_methods, peer_gguf

        tg = Path(gguf) if gguf else peer_gguf(model, out / "gguf", "target")
        dg = peer_gguf(s.draft, out / "gguf", "draft") if s.draft is not None and "draft" in drafters else None
        runners["llamacpp"] = LlamaCppRunner(tg, threads, model.max_seq_len, tuple(model.tokenizer.stop_ids), dg)
        _admit(runners["llamacpp"], llamacpp_methods(drafters, ks), methods, skipped)
        phases["llamacpp_setup"], t = perf_counter() - t, perf_counter()
    if compile:  # every graph the runs can reach, built before anything is timed
        ours = [m for m in methods if m.engine == "mtpspec"]
        def deepest(ms: list[Method]) -> int:
            return max((auto_depth(model.module) if m.k == "auto" else m.k or 0 for m in ms), default=0)

        k_top = deepest(ours)
        mtp_top = deepest([m for m in ours if m.drafter == "mtp"])
        # after rounds drafted by lookup (mtp_lookup) the module catches up on several rounds' tokens: every compiled width
        lookup = any(dict(m.options).get("mtp_lookup") for m in ours)
        prepare(model.module, range(1, k_top + 2), min(map(len, ids)), max(map(len, ids)) + max_new_tokens + k_top,
                chains=range(1, mtp_top + 1), draft_widths=range(1, MAX_WIDTH + 1) if lookup else None)
        phases["compile"], t = perf_counter() - t, perf_counter()
    try:
        with progress_bar(progress, len(s.prompts) * len(methods) * repeat, "bench", "run") as tick:
            warm_up(methods, s.prompts[0], ids[0], runners, temperature, seed)
            phases["warm_up"], t = perf_counter() - t, perf_counter()
            runs = run_bench(methods, s.prompts, ids, runners, max_new_tokens, temperature, seed, tick, repeat, interleave, keep)
            phases["runs"] = perf_counter() - t
    finally:
        if "llamacpp" in runners:
            runners["llamacpp"].close()
    elapsed = perf_counter() - t_start
    summary = summarize(runs, methods, cost)
    result = {
        "config": s.config | {
            "temperature": temperature, "seed": seed, "repeat": repeat, "keep": keep, "interleave": interleave, "peers": peers,
            "peers_skipped": skipped, "elapsed_seconds": elapsed, "phase_seconds": {k: round(v, 3) for k, v in phases.items()},
            "export_max_abs_logit_diff": export_diff,
            "llamacpp": runners["llamacpp"].describe(methods) if "llamacpp" in runners else None,
        },
        "cost_model": cost.to_json() if cost else None,
        "summary": summary,
        "runs": [r.to_json() for r in runs],
        "targets": check_targets(summary, elapsed),
    }
    result["files"] = {k: str(v) for k, v in write_all(result, out, plot_prefix).items()}
    return result


def _admit(runner, candidates: list, methods: list, skipped: dict[str, str]) -> None:
    """A peer's methods join the run, or `skipped` (label -> why) when the peer cannot run them on this model."""
    for m in candidates:
        why = runner.unsupported(m)
        if why:
            skipped[m.label] = why
        else:
            methods.append(m)


@command("bench")(_args)
def run_bench_cmd(args: argparse.Namespace) -> int:
    use_device(args)  # a bad --device or --threads is named before anything loads
    use_threads(args.threads)
    if args.contexts is not None or args.sparse_model is not None:
        res = _run_contexts(args)
    elif args.prompts is None:
        raise ConfigError("--prompts is required (a named set or a file), except with --contexts")
    else:
        try:
            ks = [parse_k(k) for k in _list(args.k or "1,2,4,auto")]
        except argparse.ArgumentTypeError as e:
            raise ConfigError(str(e)) from None
        res = _run_batch(args, ks) if args.batch is not None else run_benchmark(
            args.model, args.prompts, _list(args.drafters), ks, args.out, tokenizer=args.tokenizer,
            draft_model=args.draft_model, limit=args.limit, max_new_tokens=args.max_new_tokens,
            temperature=args.temperature, seed=args.seed, peers=args.peers, threads=args.threads,
            cost_model=not args.no_cost_model, dtype=args.dtype, plot_prefix=args.plot_prefix,
            progress=not args.no_progress, repeat=args.repeat, interleave=args.interleave, keep=args.keep, gguf=args.gguf,
            quant=args.quant, compile=args.compile, device=args.device,
        )
    print(Path(res["files"]["markdown"]).read_text())
    print(f"wrote {', '.join(res['files'].values())}", file=sys.stderr)
    return 0


def _run_batch(args: argparse.Namespace, ks: list[int | str]) -> dict:
    """`mtpspec bench --batch ...`: the batch benchmark (bench/batch.py); options it has no use for are refused."""
    from ..tree import check_tree_budget
    from .batch import parse_batches, run_batch_bench

    batches = parse_batches(args.batch)
    if args.peers:
        raise ConfigError("--peers does not run with --batch (the peers are measured one sequence at a time)")
    if args.repeat != 1:
        raise ConfigError("--repeat does not apply with --batch: use --rounds")
    if args.rounds < 1:
        raise ConfigError(f"--rounds must be >= 1, got {args.rounds}")
    trees = [check_tree_budget(n) for n in parse_counts(args.trees, "--trees", "node budgets", "8,16")] if args.trees else []
    drafters = _list(args.drafters)
    if any(options for _, options in drafter_specs(drafters)):
        raise ConfigError("drafter options in --drafters (NAME+KEY=VALUE) are measured by the per-prompt bench, not with --batch")
    setup = load_bench(args.model, args.prompts, drafters, ks, args.max_new_tokens, args.tokenizer, args.draft_model, args.limit,
                       args.dtype, args.threads, args.quant, args.compile, tree=(trees or [None])[0], device=args.device)
    return run_batch_bench(setup, drafters, ks, batches, args.out, args.rounds, trees, args.temperature, args.seed,
                           args.plot_prefix, not args.no_progress)


def _run_contexts(args: argparse.Namespace) -> dict:
    """`mtpspec bench --contexts ... --sparse-model S`: MTP against context length (bench/contexts.py)."""
    from .contexts import parse_contexts, run_contexts

    if args.contexts is None or args.sparse_model is None:
        raise ConfigError("--contexts and --sparse-model go together (full-attention vs sparse MTP against context length)")
    unused = {"--batch": args.batch, "--peers": args.peers, "--draft-model": args.draft_model, "--trees": args.trees,
              "--quant": args.quant, "--compile": args.compile, "--repeat": args.repeat != 1, "--temperature": args.temperature != 0}
    if any(unused.values()):
        raise ConfigError(f"{', '.join(k for k, v in unused.items() if v)}: not measured with --contexts (greedy, one round, fp weights)")
    try:
        k = int(args.k or 4)
    except ValueError:
        raise ConfigError(f"--k with --contexts is one fixed draft depth (e.g. 4), got {args.k!r}") from None
    return run_contexts(args.model, args.sparse_model, parse_contexts(args.contexts), args.out, k=k, limit=args.limit,
                        max_new_tokens=args.max_new_tokens, text=args.prompts, tokenizer=args.tokenizer, dtype=args.dtype,
                        threads=args.threads, seed=args.seed, plot_prefix=args.plot_prefix, progress=not args.no_progress)

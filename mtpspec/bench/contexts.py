"""`mtpspec bench --contexts 512,...,16384 --sparse-model S`: full-attention vs sparse MTP against context length.

At each length L, prompts of exactly L tokens of held-out text are decoded greedily at D = k by plain (the reference),
mtp (--model's module, full attention), sparse-full (--sparse-model's weights attending fully), sparse-recompute (its
indexer run on every draft step) and sparse-reuse (run on the round's first row, its blocks reused). Both checkpoints
must hold the same target, so every method's tokens must equal plain's. The methods of a prompt take turns as bench's
do; timing is decode only, and an MTP drafter's module forwards are timed apart (the round's first, the chained ones).
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field
from functools import partial
from itertools import count
from pathlib import Path
from time import perf_counter

import torch

from ..alternate import alternate
from ..errors import ConfigError
from ..heap import frozen_heap
from ..metrics import Acceptance
from .common import Lockstep, fmt as _f, log2_axis, parse_counts, progress_bar, pyplot, save

METHODS = ("plain", "mtp", "sparse-full", "sparse-recompute", "sparse-reuse")


def parse_contexts(text: str) -> list[int]:
    return parse_counts(text, "--contexts", "context lengths (tokens)", "512,1024,4096")


def check_same_target(m, s, m_path: str, s_path: str) -> int:
    """--model has an MTP module, --sparse-model a sparse one, and both the same target; returns the tensors compared."""
    if getattr(m.module, "mtp", None) is None:
        raise ConfigError(f"--model {m_path} has no MTP module (mtp.* tensors): there is no full-attention MTP to measure")
    if getattr(getattr(s.module, "config", None), "mtp_sparse_attention", None) is None:
        raise ConfigError(f"--sparse-model {s_path} has no sparse-attention MTP module (its config sets no mtp_sparse_attention)")
    ca, cb = ({k: v for k, v in x.module.config.to_dict().items() if not k.startswith("mtp_")} for x in (m, s))
    diff = sorted(k for k in ca.keys() | cb.keys() if ca.get(k) != cb.get(k))
    a, b = ({k: v for k, v in x.module.state_dict().items() if not k.startswith("mtp.")} for x in (m, s))
    only = sorted(a.keys() ^ b.keys())
    bad = [k for k in a if k in b and (a[k].shape != b[k].shape or not torch.equal(a[k], b[k]))]
    if diff or only or bad:
        what = (f"config field(s) {', '.join(diff)} differ" if diff else f"tensor(s) in one only: {', '.join(only[:4])}" if only
                else f"{len(bad)} of {len(a)} target tensors differ ({', '.join(bad[:4])})")
        raise ConfigError(f"--model {m_path} and --sparse-model {s_path} are not the same target: {what}; "
                          "the sparse MTP must be trained on --model with the target frozen")
    return len(a)


def heldout_stream(model, source: str | None) -> list[int]:
    """Token ids of the held-out text (a file, a folder's .py files, default the stdlib's HELDOUT modules): each file
    encoded (BOS first, as training's streams) and concatenated."""
    from ..stdlib_text import read_texts, stdlib_files

    p = Path(source or ".")
    if source is not None and not p.exists():
        raise ConfigError(f"--prompts {source}: no such file or folder (with --contexts: a text file or a folder of .py files)")
    files = stdlib_files()[1] if source is None else sorted(p.rglob("*.py")) if p.is_dir() else [p]
    return [t for text in read_texts(files) for t in model.encode(text)]


def context_prompts(stream: list[int], bos: list[int], length: int, n: int) -> list[tuple[int, list[int]]]:
    """n prompts (offset, ids) of exactly `length` tokens: BOS + the text after offsets spread from start to end."""
    need = length - len(bos)
    if need > len(stream):
        raise ConfigError(f"the held-out text holds {len(stream)} tokens, fewer than a context of {length}")
    return [(o, bos + stream[o : o + need]) for o in sorted({round(i * (len(stream) - need) / max(n - 1, 1)) for i in range(n)})]


class MTPClock:
    """Times an MTP drafter's module forwards inside propose(): the round's first one, and the chained ones after it."""

    def __init__(self, drafter) -> None:
        self.first: list[float] = []
        self.chained: list[float] = []
        self._n: int | None = None  # forwards so far in the current propose; None outside one (prefill, commit)
        mtp, propose = drafter._mtp, drafter.propose

        def timed_mtp(*args, **kw):
            t0 = perf_counter()
            out = mtp(*args, **kw)
            if self._n is not None:
                (self.chained if self._n else self.first).append(perf_counter() - t0)
                self._n += 1
            return out

        def timed_propose(*args, **kw):
            self._n = 0
            try:
                return propose(*args, **kw)
            finally:
                self._n = None

        drafter._mtp, drafter.propose = timed_mtp, timed_propose


@dataclass
class ContextRun:
    """One prompt of one context through one method."""

    method: str
    context: int
    offset: int  # where in the held-out token stream the prompt's text starts
    tokens: list[int]
    prefill_seconds: float
    decode_seconds: float  # wall - prefill - time away in the rotation
    draft_seconds: float
    verify_seconds: float
    acceptance: Acceptance
    mtp_first: list[float] = field(default_factory=list)  # seconds of each round's first MTP forward
    mtp_chained: list[float] = field(default_factory=list)  # ... and of each chained one
    identical: bool | None = None  # greedy tokens equal plain's


def run_method(models: dict, method: str, k: int, max_new_tokens: int, prompt: tuple[int, int, list[int]], turn=None) -> ContextRun:
    from ..drafters import make_drafter
    from ..engine import generate_tokens
    from ..sampling import Sampler, SamplingParams

    length, offset, ids = prompt
    sparse = method.startswith("sparse")
    module = models["sparse" if sparse else "full"].module
    if sparse:
        opts = {"sparse_select": method[7:]}
    else:  # 'mtp' attends fully, also when --model's module was trained with a sparse config (a control)
        opts = {"sparse_select": "full"} if getattr(module.config, "mtp_sparse_attention", None) is not None and method == "mtp" else {}
    drafter = make_drafter("none" if method == "plain" else "mtp", module, **opts)
    clock = MTPClock(drafter) if method != "plain" else None
    res = generate_tokens(module, ids, drafter, k, Sampler(SamplingParams(temperature=0.0)), max_new_tokens, (),
                          turn.step_done if turn is not None else None)
    s, away = res.stats, turn.waited if turn is not None else 0.0
    return ContextRun(method, length, offset, list(res.tokens), s.prefill_seconds, s.wall_seconds - s.prefill_seconds - away,
                      s.draft_seconds, s.verify_seconds, Acceptance.from_steps(res.steps), *((clock.first, clock.chained) if clock else ()))


def aggregate(rs: list[ContextRun], plain_tps: float | None, k: int) -> dict:
    toks, dec, acc = sum(len(r.tokens) for r in rs), sum(r.decode_seconds for r in rs), sum((r.acceptance for r in rs), Acceptance())
    tps = toks / dec if dec > 0 else 0.0
    ms = lambda xs: 1000 * sum(xs) / len(xs) if xs else None  # noqa: E731
    return {
        "prompts": len(rs), "new_tokens": toks, "decode_tokens_per_second": tps, "speedup": tps / plain_tps if plain_tps else 1.0,
        "mean_accepted_length": acc.mean_accepted_length, "acceptance_by_position": acc.by_position(k) if acc.drafted else [],
        "draft_ms_per_drafted_token": 1000 * sum(r.draft_seconds for r in rs) / acc.drafted if acc.drafted else None,
        "mtp_first_ms": ms([x for r in rs for x in r.mtp_first]), "mtp_chained_ms": ms([x for r in rs for x in r.mtp_chained]),
        "verify_ms_per_step": 1000 * sum(r.verify_seconds for r in rs) / max(acc.forwards, 1),
        "prefill_seconds": sum(r.prefill_seconds for r in rs) / len(rs), "greedy_identical": f"{sum(bool(r.identical) for r in rs)}/{len(rs)}",
    }


def targets(summary: dict[str, dict]) -> list[dict]:
    """The targets: reuse within 3% of full-attention MTP's mean accepted length at every context; at the longest, a
    reused (chained) draft forward >= 3x cheaper than a full-attention one, and decoding faster than with it."""
    out = [(f"L={L}: sparse-reuse / {ref} mean accepted length", 0.97, s["sparse-reuse"]["mean_accepted_length"] / s[ref]["mean_accepted_length"])
           for L, s in summary.items() for ref in ("mtp", "sparse-full")]
    L = max(summary, key=int)
    full, reuse = summary[L]["mtp"], summary[L]["sparse-reuse"]
    if full["mtp_chained_ms"] and reuse["mtp_chained_ms"]:
        out.append((f"L={L}: chained MTP forward ms, mtp / sparse-reuse", 3.0, full["mtp_chained_ms"] / reuse["mtp_chained_ms"]))
    out.append((f"L={L}: decode tok/s, sparse-reuse / mtp", 1.0, reuse["decode_tokens_per_second"] / full["decode_tokens_per_second"]))
    return [{"target": t, "goal": g, "measured": v, "met": v >= g} for t, g, v in out]


def markdown(result: dict, images: list[str]) -> str:
    c, k = result["config"], result["config"]["k"]
    kind = "its MTP trained with a sparse config, drafting with dense attention" if c.get("model_mtp_sparse") else "full-attention MTP"
    lines = [f"## {c['model']} ({kind}) vs {c['sparse_model']} (sparse MTP) against context length", "",
             f"Greedy, D = {k}, {c['max_new_tokens']} new tokens per prompt (no stop token), prompts of exactly L tokens from "
             f"{c['text']}; torch threads {c['threads']}, methods interleaved {c['interleave']}; decode time only (prefill "
             f"excluded). Same target: {c['target_tensors_equal']} tensors outside mtp.* equal. Wall time {c['elapsed_seconds']:.0f} s.", "",
             "| L | method | prompts | decode tok/s | speedup | mean acc. length | " + " | ".join(f"acc@{i + 1}" for i in range(k))
             + " | draft ms / drafted token | MTP first fwd ms | MTP chained fwd ms | verify ms / step | prefill s | greedy identical |",
             "|---" * (12 + k) + "|"]
    for L, per in result["summary"].items():
        for m, a in per.items():
            lines.append(f"| {L} | {m} | {a['prompts']} | {a['decode_tokens_per_second']:.1f} | {a['speedup']:.2f}x | {a['mean_accepted_length']:.2f} | "
                         + " | ".join(_f(x) for x in a["acceptance_by_position"] or [None] * k) + " | "
                         + " | ".join(_f(a[x]) for x in ("draft_ms_per_drafted_token", "mtp_first_ms", "mtp_chained_ms", "verify_ms_per_step"))
                         + f" | {a['prefill_seconds']:.1f} | {a['greedy_identical']} |")
    lines += ["", "Targets:", "", "| target | measured | goal | met |", "|---|---|---|---|"]
    lines += [f"| {t['target']} | {t['measured']:.3f} | {t['goal']:.2f} | {'yes' if t['met'] else '**no**'} |" for t in result["targets"]]
    return "\n".join(lines + [f"\n![{Path(i).stem}]({i})" for i in images]) + "\n"


def plots(result: dict, out: Path, prefix: str) -> list[Path]:
    """Acceptance, decode tokens/s and draft times against context: a line per method (one colour each)."""
    s, k = result["summary"], result["config"]["k"]
    xs = [int(L) for L in s]
    get = lambda key, i=None: lambda a: a[key] if i is None else (a[key] or [None] * k)[i]  # noqa: E731
    figures = {"acceptance": [("mean accepted length", get("mean_accepted_length"))]
               + [(f"acceptance at position {i + 1}", get("acceptance_by_position", i)) for i in range(k)],
               "tokens_per_second": [("decode tokens/s (prefill excluded)", get("decode_tokens_per_second"))],
               "draft_ms": [("MTP forward ms: chained draft steps", get("mtp_chained_ms")), ("MTP forward ms: round's first", get("mtp_first_ms")),
                            ("draft ms per drafted token (all of propose)", get("draft_ms_per_drafted_token"))]}
    paths = []
    for name, panels in figures.items():
        fig, axes = pyplot().subplots(1, len(panels), figsize=(4.2 * len(panels), 3.6), squeeze=False)
        for ax, (title, value) in zip(axes[0], panels):
            for c, m in enumerate(METHODS):
                ys = [value(s[str(L)][m]) for L in xs]
                if any(y is not None for y in ys):
                    ax.plot(xs, [float("nan") if y is None else y for y in ys], marker="o", color=f"C{c}", label=m)
            log2_axis(ax, xs, "context (tokens)")
            ax.set_ylim(0, None)
            ax.set_title(title, fontsize=9)
        axes[0][0].legend(fontsize=7)
        paths.append(save(fig, out / f"{prefix}contexts_{name}.png"))
    return paths


def run_contexts(model_path: str, sparse_path: str, contexts: list[int], out: str | Path, k: int = 4, limit: int | None = None,
                 max_new_tokens: int = 64, text: str | None = None, tokenizer: str | None = None, dtype: str = "fp32",
                 threads: int | None = None, seed: int = 0, plot_prefix: str = "bench_", progress: bool = True) -> dict:
    """Every method at every context, shortest first, into `out` (contexts.json and .md rewritten after each context, the
    plots at the end). limit: prompts per context (default 4 up to 2k tokens, then 8192 // L: prefill grows with L)."""
    from ..api import load
    from ..engine import check_count

    t_start, out, contexts = perf_counter(), Path(out), sorted(contexts)
    k, max_new_tokens = check_count("--k (with --contexts)", k, 1), check_count("--max-new-tokens", max_new_tokens, 1)
    if limit is not None:
        check_count("--limit", limit, 1)
    models = {"full": load(model_path, tokenizer, dtype, threads=threads), "sparse": load(sparse_path, tokenizer, dtype, threads=threads)}
    equal, full = check_same_target(models["full"], models["sparse"], model_path, sparse_path), models["full"]
    models["sparse"].module.token_ranking = getattr(full.module, "token_ranking", None)  # one draft vocabulary for both
    longest = min(m.max_seq_len for m in models.values())
    if contexts[-1] + max_new_tokens > longest:
        raise ConfigError(f"--contexts {contexts[-1]} + --max-new-tokens {max_new_tokens} is longer than the models' context of "
                          f"{longest} tokens: measure contexts up to {longest - max_new_tokens}")
    stream, bos = heldout_stream(full, text), full.encode("")
    prompts = {L: [(L, o, ids) for o, ids in context_prompts(stream, bos, L, limit or min(4, max(1, 8192 // L)))] for L in contexts}
    torch.set_num_threads(full.threads)
    step = full.threads == 1  # lockstep needs one thread: waiting jobs' OpenMP pools would spin
    tick, turns = None, count()

    def run(method: str, prompt, turn=None) -> ContextRun:
        r = run_method(models, method, k, max_new_tokens, prompt, turn)
        if tick is not None:
            tick(f"L={prompt[0]} offset {prompt[1]}")
        return r

    def together(ms: list[str], prompt) -> list[ContextRun]:
        if not step:
            return [run(m, prompt) for m in ms]
        with torch.inference_mode():  # one mode for all jobs (common.Lockstep)
            return Lockstep(seed=f"{seed}/{next(turns)}").run([partial(run, m, prompt) for m in ms])

    L0, o0, ids0 = prompts[contexts[0]][0]
    for m in METHODS:  # warm-up on a short prompt, untimed: first-call costs
        run_method(models, m, k, 8, (L0, o0, ids0[:128]))
    result = {"config": {"model": str(model_path), "sparse_model": str(sparse_path), "contexts": contexts, "k": k,
                         "max_new_tokens": max_new_tokens, "prompts_per_context": {str(L): len(ps) for L, ps in prompts.items()},
                         "threads": full.threads, "interleave": "every 5 ms (lockstep)" if step else "run by run", "dtype": dtype,
                         "seed": seed, "text": text or "the held-out stdlib modules (stdlib_text.py HELDOUT)", "text_tokens": len(stream),
                         "target_tensors_equal": equal, "sparse_config": models["sparse"].module.config.mtp_sparse_attention.to_dict(),
                         "model_mtp_sparse": getattr(getattr(full.module, "config", None), "mtp_sparse_attention", None) is not None,
                         "torch": torch.__version__},
              "summary": {}, "runs": []}
    out.mkdir(parents=True, exist_ok=True)
    # the loaded models set aside: a full collection would land inside one timed run; the bar closed however it ends
    with frozen_heap(), progress_bar(progress, sum(map(len, prompts.values())) * len(METHODS), "contexts", "run") as tick:
        for L in contexts:
            got = alternate(METHODS, prompts[L], run, 1, f"{seed}/{L}", together)  # got[method][prompt][round]
            per = {m: [got[j][i][0] for i in range(len(prompts[L]))] for j, m in enumerate(METHODS)}
            for rs in per.values():
                for r, ref in zip(rs, per["plain"]):
                    r.identical = r.tokens == ref.tokens
            plain = aggregate(per["plain"], None, k)["decode_tokens_per_second"]
            result["summary"][str(L)] = {m: aggregate(rs, plain, k) for m, rs in per.items()}
            result["runs"] += [asdict(r) for rs in per.values() for r in rs]
            result["config"]["elapsed_seconds"] = perf_counter() - t_start
            result["targets"] = targets(result["summary"])
            images = plots(result, out, plot_prefix) if L == contexts[-1] else []
            (out / "contexts.md").write_text(markdown(result, [p.name for p in images]))
            (out / "contexts.json").write_text(json.dumps(result, indent=1))
    result["files"] = {"json": str(out / "contexts.json"), "markdown": str(out / "contexts.md"), **{p.stem: str(p) for p in images}}
    return result

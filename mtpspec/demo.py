"""`make demo`: plain vs speculative decoding side by side, with speedup and acceptance.

With the shipped demo model (models/demo, a hybrid trained with an MTP head on the Python standard
library): plain vs its own MTP head vs prompt lookup, on code from stdlib modules held out of its
training. Without it: stories260K from the assets, plain vs prompt lookup vs a draft model.
"""

from __future__ import annotations

import torch

from .alternate import alternate
from .api import load
from .loading import assets_dir, shipped_demo_dir
from .metrics import mean_accepted_length
from .models.compiled import cache_dir
from .prompts import tinystories_prompts

FALLBACK_CODE_PROMPTS = [
    "def mean(data):\n    \"\"\"Return the sample arithmetic mean of data.\"\"\"\n",
    "class Stack:\n    def __init__(self):\n        self.items = []\n\n    def push(self, item):\n",
]


def _table(target, prompts: list[str], runs: list[tuple[str, str, int]], max_new_tokens: int, draft=None, rounds: int = 3) -> None:
    """Every run on every prompt, alternating in a shuffled order, `rounds` times (each keeps its fastest
    wall time, so machine noise does not pick the winner); the plain run is the reference every other must equal."""

    def generate(run: tuple[str, str, int], prompt: str, n: int = max_new_tokens):
        _, drafter, k = run
        return target.generate(prompt, drafter=drafter, k=k, draft_model=draft if drafter == "draft" else None, max_new_tokens=n)

    for run in runs:  # warm-up: the first call of each run pays one-off costs (compiling its widths, with --compile)
        generate(run, prompts[0], 8)
    compiled = target.module.compiled_step
    if compiled is not None:
        drafts = getattr(getattr(target.module, "mtp", None), "compiled_step", None)
        graphs = compiled.stats.graphs + (drafts.stats.graphs if drafts else 0)
        seconds = compiled.stats.seconds + (drafts.stats.seconds if drafts else 0.0)
        print(f"compiled {graphs} graphs in {seconds:.0f} s (kernels cached in {cache_dir()}: later runs load them)\n")
    results = alternate(runs, prompts, generate, rounds)  # [run][prompt][round]
    refs = [tries[0] for tries in results[0]]
    print(f"prompt:\n{prompts[0]}\u2502{refs[0].text}\n")
    rows = []
    for (label, _, _), by_prompt in zip(runs, results):
        rs = [tries[0] for tries in by_prompt]
        identical = all(r.tokens == ref.tokens for r, ref in zip(rs, refs))
        tokens = sum(len(r.tokens) for r in rs)
        wall = sum(min(r.stats.wall_seconds for r in tries) for tries in by_prompt)
        forwards = sum(r.stats.target_forwards for r in rs)
        drafted = sum(r.stats.draft_tokens for r in rs)
        accepted = sum(r.stats.accepted_tokens for r in rs)
        rows.append((label, tokens / wall, mean_accepted_length(accepted, forwards), accepted / drafted if drafted else None, identical))
    base = rows[0][1]
    print(f"{'decoding':<28}{'tok/s':>8}{'speedup':>9}{'tokens/forward':>16}{'accepted':>10}  identical to plain")
    for label, tps, tpf, acc, same in rows:
        a = f"{acc:.0%}" if acc is not None else "-"
        print(f"{label:<28}{tps:>8.0f}{tps / base:>8.2f}x{tpf:>16.2f}{a:>10}  {'yes' if same else 'NO'}")
    n = torch.get_num_threads()
    print(f"(best of {rounds} alternating rounds per prompt and method; {n} torch thread{'s' if n > 1 else ''}, mtpspec.threads' rule)")


def demo(max_new_tokens: int = 200, n_prompts: int = 5, threads: int | None = None, compile: bool = False) -> None:
    """threads: torch threads (None = mtpspec.threads' rule: 1 for these small models); compile: mtpspec.models.compiled."""
    if (shipped_demo_dir() / "mtpspec.json").exists():
        demo_code(max_new_tokens=min(max_new_tokens, 96), n_prompts=min(n_prompts, 3), threads=threads, compile=compile)
    else:
        demo_stories(max_new_tokens, n_prompts, threads=threads, compile=compile)


def demo_code(max_new_tokens: int = 96, n_prompts: int = 3, threads: int | None = None, compile: bool = False) -> None:
    from .stdlib_text import HELDOUT, code_prompts, stdlib_files

    target = load(shipped_demo_dir(), threads=threads, compile=compile)
    prompts = code_prompts(stdlib_files()[1], n_prompts) or FALLBACK_CODE_PROMPTS[:n_prompts]
    print(f"target: models/demo (Qwen3.5-style hybrid with an MTP head, trained on the Python stdlib), {len(prompts)} "
          f"prompts from held-out modules ({', '.join(HELDOUT)}) x {max_new_tokens} new tokens, greedy\n")
    runs = [("plain", "none", 1), ("MTP head, D=1", "mtp", 1), ("MTP head, D=2", "mtp", 2), ("prompt lookup (n-gram), D=4", "ngram", 4)]
    _table(target, prompts, runs, max_new_tokens)
    print("\nThe MTP head is one extra decoder layer trained with the model (next-token loss + 0.3 x MTP loss), then"
          "\ntuned to the model's own predictions (`mtpspec train mtp`); it scores the 1536 most frequent tokens"
          "\n(draft_vocab.json). A draft costs about a seventh of a target step on this 8-layer model; the verify"
          "\npass keeps the output exactly plain greedy.")


def demo_real(max_new_tokens: int = 128, n_prompts: int = 3, threads: int | None = None) -> None:
    """Gemma 3 270M (the public Q4_K_M GGUF) plain vs its trained MTP head (models/heads/gemma3-270m-mtp) vs prompt
    lookup, on held-out prompts: code (HumanEval), chat (MT-bench), a summary (Spec-Bench)."""
    from .loading import GEMMA3_270M
    from .prompts import load_prompts

    target = load(GEMMA3_270M, threads=threads)
    groups = [load_prompts("humaneval"), load_prompts("mt_bench"), [p for p in load_prompts("spec_bench") if p.category == "summarization"]]
    prompts = [g[i].text for i in range(n_prompts) for g in groups][:n_prompts]  # the heads' evaluation prompts
    print(f"target: Gemma 3 270M Q4_K_M (GGUF, block kernels), {len(prompts)} held-out prompts (code, chat, summary) x "
          f"{max_new_tokens} new tokens, greedy\n")
    runs = [("plain", "none", 1), ("MTP head, D=2", "mtp", 2), ("MTP head, D=3", "mtp", 3), ("prompt lookup (n-gram), D=4", "ngram", 4)]
    _table(target, prompts, runs, max_new_tokens)
    print("\nGemma 3 270M ships no MTP head: this one (6.4M parameters, the model's own decoder-layer kind, drafting over its"
          "\n16,384 most frequent output tokens) was trained here on the model's own continuations (`mtpspec train head`,"
          "\nmodels/heads/gemma3-270m-mtp/MODEL_CARD.md). The verify pass keeps the output exactly plain greedy.")


def demo_stories(max_new_tokens: int = 200, n_prompts: int = 5, threads: int | None = None, compile: bool = False) -> None:
    models = assets_dir() / "models"
    target = load(models / "stories260K.bin", models / "tok512.bin", threads=threads, compile=compile)
    draft = load(models / "stories260K_q80.bin", models / "tok512.bin")
    prompts = tinystories_prompts(n_prompts)
    print(f"target: stories260K.bin (fp32), {len(prompts)} TinyStories prompts x {max_new_tokens} new tokens, greedy\n")
    runs = [("plain", "none", 1), ("prompt lookup (n-gram)", "ngram", 4), ("draft model (Q8_0 twin)", "draft", 4)]
    _table(target, prompts, runs, max_new_tokens, draft)
    print(
        "\nThe Q8_0 twin agrees with the target almost always, but dequantised it is the target's size, so each"
        "\ndrafted token costs a full forward: high acceptance, no speedup. Prompt lookup drafts for free."
    )

"""Command line: `mtpspec generate | demo`, and the subcommands their own modules register (bench, train, serve, ...).

Bad input gives one line `mtpspec: error: ...` on stderr and exit status 2, never a traceback.
"""

from __future__ import annotations

import argparse
import json
import sys
from typing import Callable

from .errors import ConfigError, MtpspecError

COMMANDS: dict[str, tuple[Callable[[argparse.ArgumentParser], None], Callable[[argparse.Namespace], int]]] = {}

# Each subcommand's line in `mtpspec --help` (a module may give its own to `command(name, help=...)`).
HELP: dict[str, str] = {
    "generate": "generate text after a prompt, with speculative decoding (lossless: the target's own output)",
    "demo": "run the shipped demo: plain vs speculative decoding on a few TinyStories prompts",
    "bench": "measure acceptance, speedup and cost per drafter and draft length on a prompt set (JSON, markdown, PNG)",
    "trace": "draw plain vs speculative decoding of the same prompt as an HTML timeline and a PNG",
    "train": "train a model (pretrain, long context), a draft head (mtp, eagle, medusa) or a native MTP module; evaluate them",
    "loadtest": "load-test `mtpspec serve` on loopback: throughput and latency per concurrency and speculation",
}


def command(name: str, help: str | None = None):  # noqa: A002 - argparse's word
    """Register a subcommand: decorate `run(args) -> int`, given `add_args(parser)`; `help` is its one line in
    `mtpspec --help`."""

    def deco(add_args):
        def wrap(run):
            COMMANDS[name] = (add_args, run)
            if help is not None:
                HELP[name] = help
            return run

        return wrap

    return deco


AUTO_DRAFTER = "the model's own MTP module when it has one, else prompt lookup (ngram)"


def auto_drafter(module) -> str:
    """What `--drafter auto` drafts with, the default of `generate` and `serve`: "mtp" when the model has an MTP
    module of its own (trained with it), else "ngram" (needs nothing). A head trained afterwards for a model file
    (models/heads: `--drafter mtp`'s default there) is not auto's: on Gemma 3 270M its drafts do not pay for
    themselves where prompt lookup's do (docs/decisions.md, "What --drafter auto drafts with")."""
    return "mtp" if getattr(module, "mtp", None) is not None else "ngram"


def parse_k(text: str) -> int | str:
    if text == "auto":
        return text
    try:
        return int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"k must be an integer >= 1 or 'auto', got {text!r}") from None


def parse_tree(text: str) -> int | str:
    if text == "auto":
        return text
    try:
        return int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"--tree must be a node budget (an integer) or 'auto', got {text!r}") from None


def parse_logit_bias(text: str) -> dict[int, float]:
    """--logit-bias ID=BIAS,... -> {id: bias} (the ranges are SamplingParams')."""
    out: dict[int, float] = {}
    for item in text.split(","):
        tid, eq, bias = item.partition("=")
        try:
            if not eq:
                raise ValueError
            out[int(tid)] = float(bias)
        except ValueError:
            raise argparse.ArgumentTypeError(f"--logit-bias takes ID=BIAS pairs separated by commas (3=-1.5,17=2), got {item!r}") from None
    return out


def parse_ids(text: str) -> tuple[int, ...]:
    """--ban ID,... -> token ids."""
    try:
        return tuple(int(t) for t in text.split(","))
    except ValueError:
        raise argparse.ArgumentTypeError(f"--ban takes token ids separated by commas (3,17), got {text!r}") from None


THREADS_RULE = ("chosen per model: 1 under 256 MiB of weights (unless --compile) or on a busy machine, else the idle cores "
                "(mtpspec.threads)")


def add_threads_arg(p: argparse.ArgumentParser, default: int | None = None, when_unset: str = THREADS_RULE) -> None:
    """--threads for every command that runs a model; unset = mtpspec.threads.default_threads, the one rule."""
    shown = f"default {default}" if default is not None else f"default: {when_unset}"
    p.add_argument("--threads", type=int, default=default, help=f"torch threads ({shown})")


def use_threads(n: int | None) -> int | None:
    """Check --threads and apply a number at once (None: the rule, applied by api.load once the model is known)."""
    from .threads import apply_threads, check_threads

    n = check_threads(n, "--threads")
    if n is not None:
        apply_threads(n)
    return n


def add_model_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", required=True, help="llama2.c .bin, HF directory, project checkpoint, or 'demo'")
    p.add_argument("--tokenizer", help="tokenizer file (llama2.c tokenizer.bin) when the model does not carry one")
    p.add_argument("--dtype", default="fp32", help="fp32 (default), bf16, or fp64 (slow; every computation in float64, to check results without rounding noise)")
    add_quant_args(p)
    add_compile_arg(p)


def add_compile_arg(p: argparse.ArgumentParser) -> None:
    p.add_argument("--compile", action="store_true",
                   help="decode and verify through torch.compile'd graphs (mtpspec.models.compiled): faster steps; the first run "
                   "compiles each width used (minutes on 2 cores), later runs load the kernels from ~/.cache/mtpspec")


def add_quant_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--quant", default=None, help="weight-only quantization of the linear layers into a GGUF block type "
                   "q8_0, q4_0, q5_0, q4_k, q5_k, q6_k, on the GGUF block kernel (default: none; the quantized model is the "
                   "target, speculation stays lossless to it; mtpspec.quant). "
                   "int8: another name of q8_0. "
                   "int4: another name of q4_k.")


DEVICE_HELP = ("where the model computes: cpu (mtpspec's C++ kernels), cuda or cuda:N (torch's kernels; GGUF blocks and --quant "
               "dequantized at load into --dtype); default: $MTPSPEC_DEVICE, else cpu (docs/scale.md#devices)")


def add_device_arg(p: argparse.ArgumentParser) -> None:
    p.add_argument("--device", default=None, help=DEVICE_HELP)


def use_device(args: argparse.Namespace):
    """Check --device before anything loads (an unknown or absent device: one error line, exit 2); the torch.device."""
    from .device import resolve

    return resolve(getattr(args, "device", None))


def load_kwargs(args: argparse.Namespace) -> dict:
    """api.load keyword arguments from --threads / --quant / --compile / --device."""
    return dict(threads=getattr(args, "threads", None), quant=getattr(args, "quant", None),
                compile=getattr(args, "compile", False), device=getattr(args, "device", None))


def add_generation_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--drafter", default="auto",
                   help=f"auto | none | ngram | lookahead | suffix | draft | mtp | medusa | eagle; auto: {AUTO_DRAFTER} "
                        "(default: %(default)s)")
    p.add_argument("--draft-model", help="draft model (for --drafter draft) or draft head checkpoint")
    p.add_argument("--k", type=parse_k, default=None,
                   help="draft length D per step (>= 1), or 'auto' (default: 4 greedy, auto when sampling)")
    p.add_argument("--temperature", type=float, default=0.0,
                   help="0 = greedy (default); T -> 0 samples among tied argmaxes, inf uniformly over the allowed tokens")
    p.add_argument("--top-p", type=float, default=1.0)
    p.add_argument("--top-k", type=int, default=0)
    p.add_argument("--min-p", type=float, default=0.0, help="drop tokens less likely than MIN_P x the most likely one (default 0: off)")
    p.add_argument("--repetition-penalty", type=float, default=1.0,
                   help="> 0: the logits of tokens in the prompt or generated divided by it (> 0) or multiplied (< 0) (default 1: off)")
    p.add_argument("--frequency-penalty", type=float, default=0.0,
                   help="in [-2, 2]: subtracted from a token's logit once per time it was generated (default 0)")
    p.add_argument("--presence-penalty", type=float, default=0.0,
                   help="in [-2, 2]: subtracted from the logit of every token generated at least once (default 0)")
    p.add_argument("--logit-bias", type=parse_logit_bias, default={}, metavar="ID=BIAS,...",
                   help="added to those tokens' logits, each in [-100, 100]")
    p.add_argument("--ban", type=parse_ids, default=(), metavar="ID,...", help="token ids never generated")
    p.add_argument("--min-tokens", type=int, default=0, help="no end-of-sequence token before this many new tokens (default 0)")
    p.add_argument("--seed", type=int, default=0, help="sampling seed, an integer in [0, 2**64)")
    p.add_argument("--sampler", choices=("auto", "gumbel", "rejection"), default="auto",
                   help="how sampled tokens are drawn: gumbel (position-keyed noise: one seed, one text, whatever the drafter, "
                        "--k or batch), rejection (rejection sampling: the text also depends on the drafts); auto: gumbel "
                        "(default: %(default)s)")
    p.add_argument("--max-new-tokens", type=int, default=256)
    p.add_argument("--exact", action="store_true",
                   help="bit-exact mode: every position computed as a one-token step computes it (same tokens and logits for any k or batch; no speedup)")
    p.add_argument("--draft-vocab", type=int, default=None,
                   help="MTP: draft over the N most frequent tokens only (default: the checkpoint's draft_vocab.json; 0 = full vocabulary)")
    p.add_argument("--mtp-lookup", type=int, default=None, metavar="N",
                   help="mtp: where the context's last N tokens (N >= 2; 4 on code) occurred before, draft what followed them "
                        "instead of running the MTP head (default 0: off)")
    p.add_argument("--ngram-min", type=int, default=None, help="prompt lookup: shortest n-gram matched (default 1)")
    p.add_argument("--ngram-max", type=int, default=None, help="prompt lookup: longest n-gram matched (default 3)")
    p.add_argument("--lookahead-n", type=int, default=None, help="lookahead: n-gram size N, keys of 1..N-1 tokens (default 5)")
    p.add_argument("--lookahead-jacobi", action=argparse.BooleanOptionalAction, default=None,
                   help="lookahead: feed the target's guesses past the accepted prefix into the pool (default on)")
    p.add_argument("--suffix-depth", type=int, default=None, help="suffix: longest substring held, suffixes of up to depth-1 tokens matched (default 24)")
    p.add_argument("--suffix-shared", action="store_true", default=None,
                   help="suffix: also match the outputs of earlier sequences on this model (default off)")
    p.add_argument("--tree", type=parse_tree, default=None, metavar="N|auto",
                   help="mtp / eagle / draft / medusa / ngram: draft a token tree of at most N nodes (depth <= --k), verified "
                        "in one forward; auto: a chain or a tree of 4, 8 or 16 nodes, whichever has given the most tokens/s "
                        "(default: a chain)")
    p.add_argument("--tree-beam", type=int, default=None, metavar="N",
                   help="mtp / eagle / draft with --tree: nodes expanded per level (default 1: the best path, each level's "
                        "runner-up kept as a leaf; 4 is EAGLE-2's shape: more tokens per forward, more rows and drafting)")
    p.add_argument("--sparse-select", choices=("reuse", "recompute", "full"), default=None,
                   help="mtp with a sparse-attention MTP module: run its indexer on the round's first draft step and reuse "
                        "those blocks for the rest (reuse, default), on every step (recompute), or attend the whole context "
                        "with the same weights (full)")


def generation_kwargs(args: argparse.Namespace) -> dict:
    """Model.generate keyword arguments; drafter options left unset are None (make_drafter skips them)."""
    return dict(
        drafter=args.drafter, k=args.k, draft_model=args.draft_model, temperature=args.temperature,
        top_k=args.top_k, top_p=args.top_p, seed=args.seed, max_new_tokens=args.max_new_tokens, min_p=args.min_p,
        repetition_penalty=args.repetition_penalty, frequency_penalty=args.frequency_penalty,
        presence_penalty=args.presence_penalty, logit_bias=args.logit_bias, banned_ids=args.ban, min_tokens=args.min_tokens,
        sampler=args.sampler, ngram_min=args.ngram_min, ngram_max=args.ngram_max, exact=args.exact, draft_vocab=args.draft_vocab,
        tree=args.tree, tree_beam=args.tree_beam, lookahead_n=args.lookahead_n, lookahead_jacobi=args.lookahead_jacobi, suffix_depth=args.suffix_depth,
        suffix_shared=args.suffix_shared, sparse_select=args.sparse_select, mtp_lookup=args.mtp_lookup,
    )


def _generate_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("prompt", nargs="?", default="", help="prompt text ('' = BOS alone)")
    add_model_args(p)
    add_generation_args(p)
    p.add_argument("--chat", action="store_true",
                   help="the prompt is a user's message: rendered by the model's chat template, the reply printed alone")
    p.add_argument("--system", metavar="TEXT", help="with --chat: a system message before it")
    p.add_argument("--json", action="store_true", help="print one JSON object instead of streaming text")
    add_grammar_args(p)
    add_threads_arg(p)
    add_device_arg(p)


def add_grammar_args(p: argparse.ArgumentParser) -> None:
    """Structured output (mtpspec.grammar): at most one constraint the generated text must match."""
    g = p.add_mutually_exclusive_group()
    g.add_argument("--json-schema", metavar="FILE", help="the output is JSON valid under the JSON schema in FILE")
    g.add_argument("--json-object", action="store_true", help="the output is a JSON object")
    g.add_argument("--regex", metavar="R", help="the output matches the regular expression R as a whole (Rust regex syntax)")
    g.add_argument("--grammar", metavar="FILE", help="the output matches the Lark grammar in FILE (llguidance's dialect, rule start)")


def grammar_arg(args: argparse.Namespace):
    """The mtpspec.Grammar that --json-schema / --json-object / --regex / --grammar ask for, or None."""
    from .grammar import Grammar

    def read(flag: str, path: str) -> str:
        try:
            with open(path, encoding="utf-8") as f:
                return f.read()
        except (OSError, UnicodeDecodeError) as e:
            raise ConfigError(f"{flag} {path}: cannot read it ({getattr(e, 'strerror', None) or e})") from None

    if args.json_schema is not None:
        return Grammar.json_schema(read("--json-schema", args.json_schema))
    if args.json_object:
        return Grammar.json_object()
    if args.regex is not None:
        return Grammar.regex(args.regex)
    if args.grammar is not None:
        return Grammar.lark(read("--grammar", args.grammar))
    return None


class _Echo:
    """Streams text to stdout, the prompt first."""

    def __init__(self, prompt: str) -> None:
        self.prompt: str | None = prompt

    def __call__(self, text: str) -> None:
        if self.prompt is not None:
            text, self.prompt = self.prompt + text, None
        sys.stdout.write(text)
        sys.stdout.flush()


def _load_for_generation(args: argparse.Namespace):
    """(model, Model.generate keyword arguments) for `generate` and `chat`, every setting checked first."""
    from .api import load

    use_device(args)
    use_threads(args.threads)
    if args.drafter == "auto" and args.draft_model is not None:
        raise ConfigError("--draft-model needs --drafter draft, mtp, eagle or medusa (the default, auto, drafts with the "
                          "model's own MTP head or prompt lookup)")
    grammar = grammar_arg(args)  # a bad file or schema is named before the model loads
    model = load(args.model, args.tokenizer, args.dtype, **load_kwargs(args))
    kwargs = {**generation_kwargs(args), "grammar": grammar}
    if args.drafter == "auto":
        kwargs["drafter"] = auto_drafter(model.module)
        if kwargs["drafter"] == "ngram":
            kwargs["mtp_lookup"] = None  # --mtp-lookup is the MTP drafter's: moot when auto chose prompt lookup (as serve)
    return model, kwargs


def _summary(args: argparse.Namespace, kwargs: dict, res) -> str:
    from .config import GenerationConfig

    s = res.stats
    depth = GenerationConfig(k=args.k, temperature=args.temperature).depth()
    drafted = "plain" if kwargs["drafter"] == "none" else f"{kwargs['drafter']}{' (auto)' if args.drafter == 'auto' else ''} D={depth}"
    cached = f", {s.cached_tokens} prompt positions reused" if s.cached_tokens else ""
    return (f"[{len(res.tokens)} tokens, {drafted}, {s.tokens_per_second:.1f} tok/s, {s.target_forwards} target forwards, "
            f"mean accepted length {s.mean_accepted_length:.2f}, finish: {res.finish_reason}{cached}]")


@command("generate")(_generate_args)
def run_generate(args: argparse.Namespace) -> int:
    if args.system is not None and not args.chat:
        raise ConfigError("--system needs --chat (a system message goes before the user's, in the chat template)")
    model, kwargs = _load_for_generation(args)
    on_text, echo = None, _Echo("" if args.chat else args.prompt)
    if not args.json:  # the prompt is echoed with the first text: after every setting has been validated
        on_text = echo
    if args.chat:
        messages = ([{"role": "system", "content": args.system}] if args.system is not None else []) + [
            {"role": "user", "content": args.prompt}]
        res = model.chat(messages, on_text=on_text, **kwargs)
    else:
        res = model.generate(args.prompt, on_text=on_text, **kwargs)
    if args.json:
        print(json.dumps(res.to_json()))
    else:
        echo("")  # the prompt, if no text came
        sys.stdout.write("\n")
        print(_summary(args, kwargs, res), file=sys.stderr)
    return 0


def _chat_args(p: argparse.ArgumentParser) -> None:
    add_model_args(p)
    add_generation_args(p)
    p.add_argument("--system", metavar="TEXT", help="a system message before the conversation")
    p.add_argument("--prefix-cache", type=int, default=32768, metavar="N",
                   help="positions of the conversation's KV kept between turns, so a turn prefills only its new text (on "
                        "dense GGUF files: llama, qwen2, qwen3, gemma3; 0: off; default 32768)")
    add_grammar_args(p)
    add_threads_arg(p)
    add_device_arg(p)


HELP["chat"] = "talk with a model through its chat template: one user turn per line of input, each reply streamed"


@command("chat")(_chat_args)
def run_chat(args: argparse.Namespace) -> int:
    """User turns from stdin, one a line ("/reset" forgets the conversation), replies to stdout; the earlier turns'
    KV is reused where the model allows it (mtpspec.prefix). Ends at end of input."""
    from .prefix import PrefixStore

    if args.prefix_cache < 0:
        raise ConfigError(f"--prefix-cache must be an integer >= 0, got {args.prefix_cache}")
    model, kwargs = _load_for_generation(args)
    store = PrefixStore(args.prefix_cache) if args.prefix_cache else None
    system = [{"role": "system", "content": args.system}] if args.system is not None else []
    messages = list(system)
    tty = sys.stdin.isatty()
    while True:
        if tty:
            print("> ", end="", file=sys.stderr, flush=True)
        line = sys.stdin.readline()
        if not line:
            return 0
        text = line.rstrip("\n")
        if text.strip() == "/reset":
            messages = list(system)
            continue
        if not text.strip():
            continue
        messages.append({"role": "user", "content": text})
        res = model.chat(messages, on_text=_Echo(""), prefixes=store, **kwargs)
        messages.append({"role": "assistant", "content": res.text})
        sys.stdout.write("\n")
        sys.stdout.flush()
        print(_summary(args, kwargs, res), file=sys.stderr)


def _demo_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--max-new-tokens", type=int, default=200)
    p.add_argument("--prompts", type=int, default=5, help="number of prompts")
    p.add_argument("--real", action="store_true", help="Gemma 3 270M (its GGUF, the `real` extra) with its trained MTP head")
    add_threads_arg(p)
    add_compile_arg(p)


@command("demo")(_demo_args)
def run_demo(args: argparse.Namespace) -> int:
    from .demo import demo, demo_real

    if args.real:
        demo_real(max_new_tokens=args.max_new_tokens, n_prompts=args.prompts, threads=use_threads(args.threads))
        return 0
    demo(max_new_tokens=args.max_new_tokens, n_prompts=args.prompts, threads=use_threads(args.threads), compile=args.compile)
    return 0


def build_parser() -> argparse.ArgumentParser:
    _load_optional_commands()
    from . import __version__

    parser = argparse.ArgumentParser(prog="mtpspec", description="Lossless speculative decoding with MTP")
    parser.add_argument("--version", action="version", version=f"mtpspec {__version__}")
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    for name, (add_args, _) in COMMANDS.items():
        add_args(sub.add_parser(name, help=HELP.get(name), description=HELP.get(name)))
    return parser


def _load_optional_commands() -> None:
    """Subcommands that live in their own modules register themselves on import."""
    import importlib

    for mod in ("mtpspec.bench.cli", "mtpspec.bench.serve_load", "mtpspec.viz.cli", "mtpspec.server.cli", "mtpspec.train.cli",
                "mtpspec.export"):
        try:
            importlib.import_module(mod)
        except ModuleNotFoundError as e:
            if e.name is None or not mod.startswith(e.name):
                raise


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        return COMMANDS[args.command][1](args)
    except MtpspecError as e:
        print(f"mtpspec: error: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        return 130
    except BrokenPipeError:  # the reader went away (`mtpspec generate ... | head`): stop quietly, as Unix tools do
        import os

        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())  # so the exit-time flush does not raise again
        return 141


if __name__ == "__main__":  # run the package's copy, where the optional subcommands register
    from mtpspec.cli import main as package_main

    sys.exit(package_main())

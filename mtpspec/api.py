"""The Python API: load a model, generate with any drafter, get a GenerationResult.

    import mtpspec
    model = mtpspec.load("stories260K.bin", tokenizer="tok512.bin")
    print(model.generate("Once upon a time", drafter="ngram", k=4).text)
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from pathlib import Path
from typing import Callable

import torch

from . import device as devices
from . import kernels
from .drafters import make_drafter
from .config import GenerationConfig, draft_model_arg
from .engine import Engine, check_count, check_prompt
from .errors import ConfigError
from .grammar import Grammar
from .loading import load_checkpoint, parse_dtype, resolve_name
from .models.compiled import auto_depth, check_compilable, compile_model, warm
from .models.placement import place
from .prefix import PrefixStore
from .quant import check_quant, quantize
from .sampling import Sampler, SamplingParams
from .threads import apply_threads, check_threads, resolve_threads
from .types import GenerationResult


@dataclass
class Model:
    """A loaded causal LM with its tokenizer."""

    module: torch.nn.Module  # forward_tokens / new_cache / max_seq_len / vocab_size
    tokenizer: object  # encode(text) -> ids with BOS, decode(ids), stream(), stop_ids
    path: str = ""
    threads: int | None = None  # torch threads for generate(); None = threads.default_threads(module)

    @property
    def max_seq_len(self) -> int:
        return self.module.max_seq_len

    @property
    def device(self) -> torch.device:
        """Where the model computes (its weights, caches and steps): load(..., device=)."""
        return devices.of(self.module)

    def encode(self, prompt: str) -> list[int]:
        """Text -> token ids (with BOS where the tokenizer adds one); text that is not valid Unicode is a ConfigError."""
        if not isinstance(prompt, str):
            raise ConfigError(f"prompt must be text, got {type(prompt).__name__}")
        try:
            prompt.encode("utf-8")
        except UnicodeEncodeError as e:  # a lone surrogate: e.g. bytes a UTF-8 terminal could not decode
            raise ConfigError(f"the prompt is not valid text: lone surrogate {prompt[e.start]!r} at character {e.start}") from None
        return self.tokenizer.encode(prompt)

    def _prompt_ids(self, prompt) -> list[int]:
        if isinstance(prompt, str):
            return self.encode(prompt)
        if isinstance(prompt, (list, tuple)):
            return list(prompt)
        if isinstance(prompt, torch.Tensor) and prompt.ndim == 1 and not prompt.is_floating_point():
            return prompt.tolist()
        raise ConfigError(f"prompt must be text or a list of token ids, got {type(prompt).__name__}")

    def generate(
        self,
        prompt: str | list[int] = "",
        config: GenerationConfig | None = None,
        *,
        on_text: Callable[[str], None] | None = None,
        on_tokens: Callable[[list[int]], None] | None = None,
        depth_policy=None,
        prefixes: PrefixStore | None = None,
        **overrides,
    ) -> GenerationResult:
        """Generate after `prompt` (text, or token ids that start with BOS). Lossless for every drafter.

        Keyword arguments override `config`'s fields; those that are not fields are drafter options (ngram_min,
        draft_vocab, ...). on_text gets each step's new text, on_tokens its new ids. prefixes: a PrefixStore kept across
        calls (a conversation's turns): the prompt's longest kept prefix is copied, not prefilled, where that is
        bitwise a prefill (mtpspec.prefix), and this generation is kept in it. Threads are set process-wide."""
        cfg = (config or GenerationConfig()).with_overrides(**overrides)
        for name, f in (("on_text", on_text), ("on_tokens", on_tokens)):
            if f is not None and not callable(f):
                raise ConfigError(f"{name} must be a function, got {type(f).__name__}")
        ids = self._prompt_ids(prompt)
        engine, k, depth = self._engine(cfg, 1, depth_policy, prefixes)
        params = self.sampling(cfg)
        if self.module.compiled_step is not None:  # every graph the run may take, built before its first step
            mtp = cfg.drafter == "mtp"
            warm(self.module, 0 if cfg.drafter == "none" else k, mtp, mtp and params.greedy)
        stream = self.tokenizer.stream(prev=ids[-1]) if ids else None
        callback = (lambda toks: on_text(stream.push(toks))) if on_text is not None else None
        if on_tokens is not None:
            callback = on_tokens if callback is None else (lambda toks, text=callback: (on_tokens(toks), text(toks)))
        sid = self._add(engine, ids, cfg, params, k, 0, callback)
        res = engine.run()[sid]
        if on_text is not None:
            tail = stream.flush()
            if tail:
                on_text(tail)
        return replace(res, text=self.tokenizer.decode(res.tokens, prev=ids[-1]))

    def chat(self, messages: list[dict], config: GenerationConfig | None = None, *, on_text: Callable[[str], None] | None = None,
             on_tokens: Callable[[list[int]], None] | None = None, depth_policy=None, prefixes: PrefixStore | None = None,
             **overrides) -> GenerationResult:
        """The assistant's next message after `messages` ({"role", "content"} dicts, as OpenAI's chat API takes them),
        rendered by the tokenizer's chat template (mtpspec.chat; "Role: content" lines where it has none): generate()
        on that prompt, so lossless for every drafter; the result's text is the reply, ended by a stop token (EOS, the
        end of a turn) or the length."""
        from .chat import ChatTemplate

        ids = ChatTemplate.for_tokenizer(self.tokenizer).prompt_ids(self, messages)
        return self.generate(ids, config, on_text=on_text, on_tokens=on_tokens, depth_policy=depth_policy, prefixes=prefixes,
                             **overrides)

    def generate_batch(self, prompts: list, config: GenerationConfig | None = None, *, max_batch: int | None = None,
                       depth_policy=None, **overrides) -> list[GenerationResult]:
        """Generate after each prompt, up to `max_batch` sequences (default: all) sharing each target forward.

        Each sequence has its own drafter and sampler (seed + its index); with k="auto" one policy chooses every
        sequence's depth from the whole batch's cost. Greedy output equals generate() on each prompt alone."""
        cfg = (config or GenerationConfig()).with_overrides(**overrides)
        if not isinstance(prompts, (list, tuple)) or not prompts:
            raise ConfigError("prompts must be a non-empty list of prompts")
        ids = [self._prompt_ids(p) for p in prompts]
        engine, k, _ = self._engine(cfg, len(ids) if max_batch is None else max_batch, depth_policy)
        params = self.sampling(cfg)
        sids = [self._add(engine, x, cfg, params, k, i, None) for i, x in enumerate(ids)]
        results = engine.run()
        return [replace(results[s], text=self.tokenizer.decode(results[s].tokens, prev=x[-1])) for s, x in zip(sids, ids)]

    def _engine(self, cfg: GenerationConfig, max_batch, depth_policy, prefixes: PrefixStore | None = None) -> tuple[Engine, int, object]:
        """The engine for `cfg` (threads applied, k resolved: "auto" = a depth policy over depths up to compiled.AUTO_K_MAX,
        compiled up to compiled.AUTO_DEPTH)."""
        n_threads = resolve_threads(self.threads if cfg.threads is None else cfg.threads, self.module)
        k = cfg.depth()
        if k == "auto":  # adaptive draft depth, D chosen per step from acceptance and measured cost
            from .adaptive import ByBatchSize

            deepest = auto_depth(self.module)
            depth_policy, k = depth_policy or ByBatchSize(k_max=deepest), deepest
        k = check_count("k (draft length)", k, 1)
        check_count("max-new-tokens", cfg.max_new_tokens, 0)
        if not isinstance(cfg.exact, bool):
            raise ConfigError(f"exact must be True or False, got {cfg.exact!r}")
        max_batch = check_count("max batch", max_batch, 1)
        cfg.sampling()  # checked before any work
        if self.device.type == "cpu":  # (on a device the host threads only feed it: torch's count is left alone)
            apply_threads(n_threads)
        return Engine(self.module, max_batch, cfg.exact, depth_policy, prefixes=prefixes), k, depth_policy

    def sampling(self, cfg: GenerationConfig) -> SamplingParams:
        """cfg's sampling params, its grammar (a mtpspec.Grammar) compiled against this model's tokenizer."""
        params = cfg.sampling()
        if cfg.grammar is None:
            return params
        if not isinstance(cfg.grammar, Grammar):
            raise ConfigError("grammar must be a mtpspec.Grammar (Grammar.json_schema(schema), .json_object(), .regex(pattern) "
                              f"or .lark(text)), got {type(cfg.grammar).__name__}")
        return replace(params, grammar=cfg.grammar.compile(self.tokenizer, self.module.vocab_size))

    def _add(self, engine: Engine, ids: list[int], cfg: GenerationConfig, params: SamplingParams, k: int, index: int,
             callback) -> int:
        check_prompt(ids, self.module.max_seq_len, self.module.vocab_size)
        ids = [int(t) for t in ids]  # (numpy integers too)
        d = make_drafter(cfg.drafter, self.module, draft_model=draft_model_arg(cfg.draft_model, cfg.drafter), **cfg.options)
        sampler = Sampler(params, cfg.seed + index)
        return engine.add(ids, d, sampler, k, cfg.max_new_tokens, self.tokenizer.stop_ids, callback, cfg.trace)


def load(path: str | Path, tokenizer: str | Path | None = None, dtype: str | torch.dtype = "fp32", *,
         threads: int | None = None, quant: str | None = None, compile: bool = False,
         device: str | torch.device | None = None) -> Model:
    """Load a llama2.c .bin, a Hugging Face directory, a project checkpoint, or 'demo'.

    device: "cpu" (mtpspec's C++ kernels), "cuda" or "cuda:N" (torch's kernels; GGUF block weights and `quant`
    dequantized at load into `dtype` there); None: $MTPSPEC_DEVICE, else "cpu". mtpspec.device says what differs.

    threads: torch threads for generate() (None: mtpspec.threads.default_threads), applied now too (process-wide).
    quant: None or a GGUF block type ("q8_0", "q4_0", "q5_0", "q4_k", "q5_k", "q6_k"; "int8" / "int4" name q8_0 / q4_k):
    weight-only quantization on the block kernel (mtpspec.quant); generation is lossless to the quantized model.
    compile: decode and verify windows through torch.compile'd graphs (mtpspec.models.compiled), cached on disk.
    """
    check_threads(threads)
    dev = devices.resolve(device)
    if not isinstance(compile, bool):
        raise ConfigError(f"compile must be True or False, got {compile!r}")
    if compile and dev.type != "cpu":
        raise ConfigError(f"compile builds CPU graphs on mtpspec's kernels; it is not available on {dev}")
    if compile:
        check_compilable(None, parse_dtype(dtype))
    qcfg = check_quant(quant, parse_dtype(dtype))  # bad settings are named before a slow load
    path = resolve_name(path)
    with kernels.torch_path(dev.type != "cpu"):  # for a device: block weights in the layout torch dequantizes, no C++ build
        module, tok = load_checkpoint(path, tokenizer, dtype)
        if qcfg is not None:
            quantize(module, qcfg.kind)
    if dev.type != "cpu":
        place(module, dev)  # block weights dequantized, everything moved; no CPU threads chosen or kernels built
        return Model(module=module, tokenizer=tok, path=str(path), threads=threads)
    n = apply_threads(resolve_threads(threads, module, compiled=compile))
    if module.dtype in kernels.DTYPES:
        kernels.available()  # the small-row kernel built (once per machine) or loaded now, not inside the first step
    if compile:
        compile_model(module)  # after the threads are set: kernels keep the thread count they are built for
    return Model(module=module, tokenizer=tok, path=str(path), threads=n)

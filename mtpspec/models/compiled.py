"""The compiled decode step: the model's one forward (forward.py) over T <= k+1 new positions.

At batch 1 on CPU an eager step is dispatch-bound: hundreds of small ATen calls, each paying Python and dispatcher
overhead for a few thousand multiply-adds. The graph entries of forward.py take positions as a tensor (the
ForwardBatch has no start), the KV cache as the preallocated buffer whose span in use (its length symbolic) is read
under a mask, and no Python branch depends on a position, so torch.compile (inductor, CPU) traces the same forward once
per width T and fuses it into a few C++ kernels.

What stays outside the graph is the cache's bookkeeping (hybrid_cache.py): the graph takes each Gated DeltaNet
layer's conv window and incoming state and returns the widened conv window and what rebuilds the state after each
of its T positions; keys and values are written into the KV buffer in place. A compiled forward equals the eager
one up to float rounding (tests prove greedy identity and bound the logits). Prefills, exact mode, fp64 and windows
wider than the compiled widths run eagerly.
"""

from __future__ import annotations

import itertools
import os
import types
import weakref
from dataclasses import dataclass
from pathlib import Path
from time import perf_counter
from typing import Iterable

import torch
from torch import Tensor

from ..cache import check_room
from ..errors import ConfigError
from ..types import TargetOutput
from ..weight_cache import weights_version
from .hybrid_cache import HybridCache, Window
from .common import rotaries
from .forward import dense_graph, draft_chain_graph, fuse_projections, hybrid_graph, hybrid_window_graph, module_graph


def cache_dir() -> Path:
    """Where inductor keeps compiled kernels between runs ($MTPSPEC_COMPILE_CACHE, default ~/.cache/mtpspec/inductor)."""
    return Path(os.environ.get("MTPSPEC_COMPILE_CACHE", Path.home() / ".cache" / "mtpspec" / "inductor"))


def use_cache_dir() -> None:
    """Point inductor's on-disk cache at cache_dir(), unless the user chose one with TORCHINDUCTOR_CACHE_DIR
    (torch fills that variable with its /tmp default on first use: that default is replaced)."""
    from torch._inductor.runtime.cache_dir_utils import default_cache_dir

    chosen = os.environ.get("TORCHINDUCTOR_CACHE_DIR")
    if chosen is None or os.path.abspath(chosen) == os.path.abspath(default_cache_dir()) or "MTPSPEC_COMPILE_CACHE" in os.environ:
        os.environ["TORCHINDUCTOR_CACHE_DIR"] = str(cache_dir())


@dataclass
class CompileStats:
    """What compiling cost: graphs built and the seconds their first calls took."""

    graphs: int = 0
    seconds: float = 0.0


# The kernels are called from a C++ wrapper, not a Python one: per-step overhead is the point. Weights stay graph
# inputs (not frozen constants): frozen graphs are not cached across runs, and each run would compile again.
OPTIONS = {"cpp_wrapper": True}

# A model under threads.SMALL_BYTES gets serial graphs whatever torch's thread count: their fused kernels work on a few
# thousand elements, where an OpenMP fork/join costs more than it saves, while the small-row kernel (mtpspec.kernels),
# called from inside the graph, still splits each matrix product between torch's threads at run time. Measured:
# faster at two threads than two-thread graphs (docs/decisions.md#serial-compiled-graphs-for-small-models). One
# serial graph then serves every thread count.
SERIAL = {"cpp.threads": 1}

MAX_WIDTH = 8  # the widest window (rows) a compiled graph takes by default; wider ones (a verify at D = 8) run eagerly


BUCKETS = (1, 4, 6, 8)  # the rows of the graphs a window runs in (bucket()), below max_width

AUTO_K_MAX = 8  # the deepest draft `--k auto` may choose (library, server, bench)
AUTO_DEPTH = 5  # --k auto's deepest draft on a compiled model: its windows (up to 6 rows) take the graphs of 1, 4, 6 rows


def auto_depth(model, deepest: int = AUTO_K_MAX) -> int:
    """--k auto's deepest draft on `model`: `deepest`, at most AUTO_DEPTH once the model is compiled."""
    return deepest if model.compiled_step is None else min(deepest, AUTO_DEPTH)


def bucket(t: int, max_width: int) -> int:
    """The rows of the graph that runs a window of t rows: the first of BUCKETS >= t, else max_width (1, 4, 6, 8 by
    default). A window is padded to its bucket, so the widths a policy visits share a few graphs instead of one
    each: a target graph of the demo costs 25-50 s to build cold on 2 cores (more the wider), a padded row of a demo
    step ~0.1-0.2 ms, paid only where a window is short of its bucket (D = 3 and 5 verify 4 and 6 rows exactly;
    docs/decisions.md). Padded rows come after the real ones: no real row attends to them (attention is causal by
    position), every row of a matrix product is computed alone (the small-row kernel), and the keys and values they
    write lie beyond the cache's length, where the next window writes before anything reads."""
    return next((b for b in BUCKETS if t <= b < max_width), max_width)


def buckets(widths: Iterable[int], max_width: int) -> list[int]:
    """The graphs' widths that windows of `widths` rows (those up to max_width) run in (bucket())."""
    return sorted({bucket(t, max_width) for t in widths if 1 <= t <= max_width})


CHAIN_MAX = 5  # the most drafts one chain graph unrolls: deeper chains run as segments (CompiledDraftStep.chain)

WINDOW_FORM_STATE = 2**16  # elements of one Gated DeltaNet layer's state from which the compiled step takes the window form


# Once a graph is built, it is called without dynamo: the function's transformed bytecode (what dynamo runs when the
# guards pass: read the inputs, call the compiled graph) is taken from dynamo's cache and called as a plain function.
# Re-checking the guards (one per weight) costs about as much as a small kernel per call, and entering dynamo even with
# the guards skipped is a measurable share of a small model's step (docs/decisions.md#compiled-graphs-called-without-dynamo);
# each graph has a function of its own (_Compiled._compile), so nothing else needs telling apart, and its inputs are
# read afresh at every call (new weights of the same shapes are used).
DIRECT = True


_STEPS = itertools.count()  # the compiled steps made in this process


class _Compiled:
    """What both compiled steps share: one graph per (width, threads), built on first use and timed; the
    concatenated projections rebuilt when the weights change; the cache's positions as a tensor."""

    def __init__(self, fn, module, max_width: int, backend: str = "inductor", also=(), model=None) -> None:
        import torch._dynamo

        from ..kernels import attention as attention_kernels
        from ..threads import SMALL_BYTES, parameter_bytes

        attention_kernels.available()  # built before tracing: the graphs write the KV cache with its op (attention.write)

        self.module, self.max_width, self.backend = module, max_width, backend
        # serial graphs (SERIAL) for a small model: one graph for every thread count (keyed as 1); else torch's count
        self.serial = parameter_bytes(model if model is not None else module) < SMALL_BYTES
        # a graph per key: never fall back to eager silently for lack of room in dynamo's cache
        torch._dynamo.config.recompile_limit = max(torch._dynamo.config.recompile_limit, 8 * max_width)
        torch._dynamo.config.accumulated_recompile_limit = max(torch._dynamo.config.accumulated_recompile_limit, 64 * max_width)
        # a built graph's guards: the model's modules are checked by their dicts' tags, not tensor by tensor (a check
        # per weight is a measurable share of a small model's step); a changed dict falls back to the full check
        torch._dynamo.config.use_recursive_dict_tags_for_guards = True
        self.fn = fn
        self.also = tuple(also)  # modules outside `module` that the graphs read (a draft chain: the target's LM head)
        self.params = [p for m in (module, *self.also) for p in m.parameters()]
        for r in rotaries(module):  # whole tables before tracing: traced code must never grow them
            r.whole()
        self.version = weights_version(self.params)  # changes when a weight is updated in place or replaced
        self._fuse()
        self.graphs: dict[tuple, object] = {}  # (width, threads, *extra) -> its compiled function
        self.seen = lambda: None  # the cache of the last call (a weak reference)
        self.stats = CompileStats()
        self.ordinal = next(_STEPS)  # (see _compile)
        self.warmed: set[tuple[int, bool, bool]] = set()  # the (k, mtp, chains) that warm() built every graph for

    @property
    def built(self) -> set[tuple]:
        return set(self.graphs)

    def _fuse(self) -> None:
        for m in (self.module, *self.also):
            fuse_projections(m)

    def _compile(self, key: tuple, fn=None):
        """fn compiled for one key (width, threads, ...), from a copy of fn's code object: dynamo keeps compiled graphs per
        code object and walks them on every call, so with one shared code object each step would pay for checking the
        guards of its sibling graphs; a code object of its own holds one graph and nothing to walk. The name carries
        the step's serial number: dynamo keeps what it saw of a frame's shapes by (file, line, name), and a graph of
        another model under the same name would be traced with the shapes that differ made dynamic (generic kernels:
        slower, and rounded otherwise)."""
        base = fn or self.fn
        name = f"{base.__name__}_n{self.ordinal}_w{key[0]}_t{key[1]}" + "".join(f"_{x}" for x in key[2:])
        code = base.__code__.replace(co_name=name)
        fn = types.FunctionType(code, base.__globals__, code.co_name, base.__defaults__, base.__closure__)
        fn.__kwdefaults__ = base.__kwdefaults__
        # backend "eager" traces the same graphs without generating code (tests of the tracing and bookkeeping)
        options = {**OPTIONS, **(SERIAL if self.serial else {})} if self.backend == "inductor" else None
        return torch.compile(fn, dynamic=None, fullgraph=True, backend=self.backend, options=options), fn

    def usable(self, t: int, length: int, max_len: int, dtype: torch.dtype, batch: int) -> bool:
        """Whether a window of t rows after `length` positions runs a graph: its bucket fits the buffer (else it runs
        eagerly: near a full cache, rather than a graph of its own), a batch-1 fp32 / bf16 cache, inference mode."""
        return (1 <= t <= self.max_width and length + bucket(t, self.max_width) <= max_len
                and dtype in (torch.float32, torch.bfloat16) and batch == 1 and torch.is_inference_mode_enabled())

    def run(self, t: int, cache, *args, fn=None, extra: tuple = ()):
        """The graph for width t (a new (t, threads, *extra) compiles, or loads its kernels from the disk cache; a built
        one is called without dynamo, _direct). Among args, the KV span's positions (_keys) have a symbolic length, so
        one graph serves every span. fn, extra: another function of the same module (a draft chain) and what else
        tells its graphs apart."""
        if self.seen() is not cache:  # weights change between generations (training), never inside one: checked per cache
            version = weights_version(self.params)  # (a walk over every weight: too dear for every call)
            if version != self.version:  # trained since: the concatenated projections are rebuilt from the new weights
                self._fuse()
                self.version = version
            self.seen = weakref.ref(cache)
        # compiled kernels keep the thread count they were built for (a serial graph's: 1, whatever torch's count)
        key = (t, 1 if self.serial else torch.get_num_threads(), *extra)
        graph = self.graphs.get(key)
        if graph is not None:  # built: its guards were checked on the first call
            return graph(*args, key[1])
        t0 = perf_counter()
        graph, plain = self._compile(key, fn)
        out = graph(*args, key[1])
        self.graphs[key] = _direct(plain) or _guards_skipped(graph)
        self.stats.graphs += 1
        self.stats.seconds += perf_counter() - t0
        return out


def _direct(fn):
    """fn's one compiled entry as a plain function (DIRECT), or None when dynamo holds other than one entry for it."""
    from torch._dynamo.eval_frame import _debug_get_cache_entry_list

    entries = _debug_get_cache_entry_list(fn.__code__) if DIRECT else []
    if len(entries) != 1:
        return None
    code = entries[0].code  # reads fn's arguments, calls the compiled graph (a global dynamo put in fn's module)
    return types.FunctionType(code, fn.__globals__, code.co_name, fn.__defaults__, fn.__closure__)


def _guards_skipped(graph):
    """The compiled function called through dynamo with its guards skipped (when _direct finds no single entry)."""
    def call(*args):
        with torch.compiler.set_stance(skip_guard_eval_unsafe=True):
            return graph(*args)
    return call


def span(n: int, max_len: int) -> int:
    """The KV positions a graph attends over when n are in use: the next power of two >= n (at least 64), at most
    the buffer. Attention reads every position of its span under a mask, so reading the whole buffer would pay for
    every position at every step; the span keeps that cost near the context in use (its length is symbolic in the
    graphs: one graph serves every span)."""
    return min(max_len, max(64, 1 << (n - 1).bit_length()))


_KEYS: dict[int, Tensor] = {}


def _keys(n: int, max_len: int) -> Tensor:
    """(S,) the positions of the span a graph attends over when n are in use (span()): an input whose length is the
    graph's symbolic KV length (marked dynamic once, when made; the buffers themselves go in whole, written in place)."""
    s = span(n, max_len)
    got = _KEYS.get(s)
    if got is None:
        import torch._dynamo

        with torch.inference_mode():
            got = torch.arange(s)
        torch._dynamo.mark_dynamic(got, 0)
        _KEYS[s] = got
    return got


def spans(lo: int, hi: int, max_len: int) -> list[tuple[int, int]]:
    """(span, the span below it or 0) for every span that a window ending at positions lo..hi can fall in."""
    out, below, s = [], 0, span(1, max_len)
    while True:
        if s >= span(lo, max_len):
            out.append((s, below))
        if s >= span(hi, max_len):
            return out
        below, s = s, span(s + 1, max_len)


def _inference(x: Tensor) -> Tensor:
    """One kind of input tensor for the graph (an inference tensor): a normal one would fail a guard and recompile
    (or, with the guards between built graphs only, be taken for another)."""
    return x if x.is_inference() else x.clone()


class CompiledStep(_Compiled):
    """The target's static-shape forward, compiled per width T = 1..max_width on first use.

    `handles(t, cache)` says whether a forward goes this way (a decode or verify window of a batch-1
    fp32 / bf16 model outside exact mode and prefill); `__call__` runs it and keeps the cache's
    bookkeeping as the eager forward does, so crop / rollback / snapshot work unchanged.
    """

    def __init__(self, model, max_width: int = MAX_WIDTH, backend: str = "inductor") -> None:
        self.hybrid = isinstance(model.new_cache(1), HybridCache)
        super().__init__(hybrid_graph if self.hybrid else dense_graph, model, max_width, backend)
        # Gated DeltaNet windows of 2+ positions: position by position, returning the state after each (T states per
        # layer written), or, when a layer's state is large, as one exact chunk (gated_deltanet.window_delta_rule)
        # returning what rebuilds any of them (the eager forward's form): at the Qwen3.5-0.8B shape (16 heads of
        # 128 x 128) T states cost more to write than the chunk's triangular solve (docs/engine.md)
        dn = next((m for m in model.modules() if hasattr(m, "in_proj_qkv")), None)
        self.window_form = dn is not None and dn.nv * dn.dk * dn.dv >= WINDOW_FORM_STATE

    def handles(self, t: int, cache) -> bool:
        kv = cache.kv
        # a KV cache that is a slot of the batched engine's storage (a strided view) runs eagerly: graphs are built
        # for the one-sequence buffer's layout
        return kv.k.is_contiguous() and self.usable(t, cache.length, kv.max_len, self.module.dtype, kv.k.shape[1])

    @torch.inference_mode()
    def prepare(self, widths: range, lo: int, hi: int) -> None:
        """Build (or load from the disk cache) the graph of every width in `widths`, run in every span a window ending
        at positions lo..hi falls in, on a scratch cache, so that none is built inside a timed run (mtpspec bench)."""
        cache = self.module.new_cache()
        kv = cache.kv
        for s, below in spans(lo, hi, kv.max_len):
            start = max(below, 1)  # a window of t <= max_width rows after `start` ends inside the span
            if cache.length < start:
                self.module.forward_tokens(torch.zeros(start - cache.length, dtype=torch.long), cache, prefill=True)
            snap = cache.snapshot()
            for t in buckets(widths, self.max_width):
                if start + t <= s:
                    self(torch.zeros(t, dtype=torch.long), cache)
                    cache.restore(snap)

    def __call__(self, tokens: Tensor, cache) -> TargetOutput:
        t = tokens.shape[0]
        kv = cache.kv
        start = cache.length
        w = bucket(t, self.max_width)  # the graph's rows: the window padded (bucket())
        check_room(start + w, kv.max_len)
        if w > t:
            tokens = torch.cat([tokens, tokens.new_zeros(w - t)])
        pos = torch.arange(start, start + w)[None]  # (1, W)
        keys = _keys(start + w, kv.max_len)  # the span read: the buffers' first S positions
        if self.hybrid:
            n = range(cache.n_linear)
            convs = [cache.conv_window(i).contiguous() for i in n]  # (1, C, K-1)
            states = [_inference(cache.start_state(i).contiguous()) for i in n]  # (1, nv, dk, dv)
            chunk = self.window_form and w > 1
            logits, hid, pre, hists, slots = self.run(w, cache, self.module, _inference(tokens[None]), pos, keys, kv.k, kv.v,
                                                      convs, states,
                                                      **({"fn": hybrid_window_graph, "extra": ("window",)} if chunk else {}))
            for i in n:
                hist, window = hists[i], Window(*slots[i]) if chunk else Window(states=list(slots[i].unbind(0)))
                if w > t:  # the real rows' part: the conv window widened by t positions, the first t slots
                    hist, window = hist[..., : hist.shape[-1] - (w - t)], window.take(0, t)
                cache.record_window(i, hist, [window])
        else:
            logits, hid, pre = self.run(w, cache, self.module, _inference(tokens[None]), pos, keys, kv.k, kv.v)
        cache.advance(t)
        return TargetOutput(logits=logits[:t], hidden=hid[:t], prenorm_hidden=pre[:t])  # (T, .) rows


class CompiledDraftStep(_Compiled):
    """The static-shape MTP / EAGLE module step (a chained draft step, or the catch-up over accepted
    tokens), compiled per width T = 1..max_width like CompiledStep."""

    def __init__(self, module, base, max_width: int = MAX_WIDTH, backend: str = "inductor") -> None:
        # base: the model whose embedding and LM head a draft chain reads (the target, or a trained head's target)
        super().__init__(module_graph, module, max_width, backend, also=(base.lm_head, base.model.embed_tokens), model=base)
        self.base, self.chain_max = base, CHAIN_MAX

    def handles(self, t: int, cache) -> bool:
        return self.usable(t, cache.length, cache.max_len, self.module.fc.weight.dtype, cache.k.shape[1])

    def chain(self, h: Tensor, cache, k: int, head) -> Tensor:
        """k greedy drafts from h (1, H), the output at the cache's last entry (draft_chain_graph), in segments of at
        most `chain_max` drafts, each one graph per (threads, depth, draft vocabulary size): a graph unrolls its depth
        (a module step and a head product per draft), so its build time grows with it, and deeper chains reuse the
        shallow ones (a later segment feeds the previous one's last draft first). Advances the cache by k - 1. -> (k,)"""
        check_room(cache.length + k - 1, cache.max_len, "draft module")
        vocab = 0 if head is None else head.ids.shape[0]
        k_buf, v_buf = cache.buffers(self.module.layers[0].self_attn.kv_index)  # (1, nkv, max_len, hd)
        out, x, left = [], None, k
        while left:
            n = min(left, self.chain_max)
            fed = n - 1 if x is None else n  # the positions this segment writes
            start = cache.length
            keys = _keys(start + fed if fed else 1, cache.max_len)  # (a lone head product reads no keys)
            pos = torch.tensor([[start]])  # (1, 1) the first fed position
            drafts, h = self.run(1, cache, self.module, self.base, head, _inference(h), x, k_buf, v_buf, pos, keys, n,
                                 fn=draft_chain_graph, extra=("chain" if x is None else "cont", n, vocab))
            cache.advance(fed)
            out.append(drafts)
            x, left = drafts[-1:], left - n
        return torch.cat(out) if len(out) > 1 else out[0]

    @torch.inference_mode()
    def prepare(self, widths: range, lo: int, hi: int, cache, chains: Iterable[int] = (), head=None) -> None:
        """CompiledStep.prepare for the module's steps over `cache` (an empty MTP / EAGLE KV cache, used as scratch),
        and its greedy chains of each depth in `chains` with `head` (a DraftHead, or None: the LM head)."""
        h = self.module.fc.weight.shape[0]
        zeros = torch.zeros(self.max_width, h, dtype=self.module.fc.weight.dtype)
        for s, below in spans(lo, hi, cache.max_len):
            for layer in range(len(self.module.layers)):
                for t in buckets(widths, self.max_width):
                    if below + t <= s:
                        cache.length = below  # the keys there are zeros: only the shapes matter here
                        self(zeros[:t], zeros[:t], cache, layer)
            for k in (k for k in chains if k > 1):  # a chain starting at `start` reads the span of start + k - 1 positions
                cache.length = max(below + 2 - k, 1)
                self.chain(zeros[:1], cache, k, head)
        if 1 in chains:  # the head alone: one graph
            cache.length = 1
            self.chain(zeros[:1], cache, 1, head)
        cache.length = 0

    def __call__(self, hidden: Tensor, emb: Tensor, cache, layer: int = 0) -> Tensor:
        """hidden, emb (T, H) at the cache's next positions -> (T, H); advances the cache."""
        t = hidden.shape[0]
        start = cache.length
        w = bucket(t, self.max_width)  # the graph's rows: the window padded with zeros (bucket())
        check_room(start + w, cache.max_len, "draft module")
        if w > t:
            hidden, emb = (torch.cat([x, x.new_zeros(w - t, x.shape[1])]) for x in (hidden, emb))
        pos = torch.arange(start, start + w)[None]  # (1, W)
        k_buf, v_buf = cache.buffers(self.module.layers[layer].self_attn.kv_index)  # (1, nkv, max_len, hd)
        out = self.run(w, cache, self.module, _inference(hidden[None]), _inference(emb[None]), k_buf, v_buf, pos,
                       _keys(start + w, cache.max_len), layer)
        cache.advance(t)
        return out[0, :t]


def check_compilable(model=None, dtype: torch.dtype | None = None) -> None:
    """A ConfigError naming why `model` (or, before loading, a model of `dtype`) cannot take the compiled path. GGUF
    block weights (a GGUF file's, or --quant's) compile: their kernels are opaque ops in the graph."""
    dtype = dtype or model.dtype
    if dtype not in (torch.float32, torch.bfloat16):
        raise ConfigError(f"--compile needs fp32 or bf16 weights, not {str(dtype).removeprefix('torch.')} (fp64 is the eager reference)")
    if model is not None and getattr(model.config, "num_experts", 0) > 0:
        raise ConfigError("--compile does not cover mixture-of-experts layers (Qwen3-Next) yet: run without --compile")
    if model is not None and (getattr(model.config, "sparse_attention", None) or getattr(model.config, "mtp_sparse_attention", None)):
        raise ConfigError("--compile does not cover sparse attention layers yet: run without --compile")


def compile_model(model, max_width: int = MAX_WIDTH, backend: str = "inductor") -> CompiledStep:
    """Route `model.forward_tokens` windows of up to max_width positions (and its MTP module's steps) through
    compiled graphs, kept on the model. Graphs are built on first use of each width; kernels are cached on
    disk (cache_dir()) so later runs skip the C++ compilation."""
    check_compilable(model)
    use_cache_dir()
    step = CompiledStep(model, max_width, backend)
    model.compiled_step = step  # not a submodule: state_dict and .to() leave it alone
    if getattr(model, "mtp", None) is not None:
        model.mtp.compiled_step = CompiledDraftStep(model.mtp, model, max_width, backend)
    return step


@torch.inference_mode()  # the scratch caches are inference tensors, as the engine's are (a guard tells them apart)
def prepare(model, widths: range, lo: int, hi: int, chains: Iterable[int] = (), draft_widths: range | None = None,
            module: bool = True) -> None:
    """Build the graphs of a compiled model (compile_model) that windows of `widths` rows ending at positions lo..hi
    use, target and (`module`) MTP module (`draft_widths` for the module when other: a catch-up after rounds drafted
    by lookup spans several rounds' tokens), and the MTP module's greedy chains of each depth in `chains` (with the
    checkpoint's default draft vocabulary), before anything is timed."""
    from .draft_vocab import make_draft_head

    step = model.compiled_step
    if step is None:
        return
    step.prepare(widths, lo, hi)
    draft = module and getattr(model, "mtp", None) is not None and model.mtp.compiled_step
    if draft:
        draft.prepare(draft_widths or widths, lo, hi, model.new_mtp_cache(), chains, make_draft_head(model, None) if chains else None)


def warm(model, k: int, mtp: bool, chains: bool) -> None:
    """Build, once per (k, mtp, chains), every graph that decoding with up to k drafts a step may run: the windows'
    buckets, the MTP module's when `mtp`, and its greedy chains when `chains`. After it no depth a policy picks (--k
    auto) compiles anything. One span suffices: a built graph serves every span (its length symbolic, the graph
    called unguarded)."""
    step = model.compiled_step
    if step is not None and (k, mtp, chains) not in step.warmed:
        prepare(model, range(1, k + 2), 1, 1, chains=range(1, k + 1) if chains else (), module=mtp)
        step.warmed.add((k, mtp, chains))


def compiled_draft_step(module, target) -> CompiledDraftStep | None:
    """The compiled step of an MTP / EAGLE module (its own, or a trained head's on `target`, an AttachedHead)
    when the target model was compiled (compile_model); else None."""
    step = module.compiled_step
    base = getattr(target, "target", target)  # an AttachedHead's frozen target
    parent = getattr(base, "compiled_step", None)
    if step is None and parent is not None:
        step = module.compiled_step = CompiledDraftStep(module, base, parent.max_width, parent.backend)
    return step

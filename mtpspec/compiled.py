"""A compiled decode step: the target's forward over T <= k+1 new positions with static shapes.

At batch 1 on CPU an eager step is dispatch-bound: hundreds of small ATen calls, each paying
Python and dispatcher overhead for a few thousand multiply-adds. This file writes the same forward
once more as a function of tensors only (positions are a tensor, the KV cache is the preallocated
buffer, attention reads the whole buffer under a mask, no Python branch depends on a position), so
torch.compile (inductor, CPU) traces it once per width T and fuses it into a few C++ kernels.

What stays outside the graph is the cache's bookkeeping (hybrid_cache.py): the graph takes each
Gated DeltaNet layer's conv window and incoming state and returns the widened conv window and the
state after each of its T positions (the slots rollback selects), computed position by position as
an exact-mode step does; keys and values are written into the KV buffer in place.

Eager stays the reference: a compiled forward equals the eager one up to float rounding (tests prove
greedy identity and bound the logits). Prefills, exact mode, fp64 and windows wider than the
compiled widths run eagerly.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path
from time import perf_counter

import torch
import torch.nn.functional as F
from torch import Tensor

from .models.common import SwiGLU, weights_version, wide
from .models.gated_deltanet import _l2norm, causal_conv
from .models.hybrid_cache import HybridCache, Window
from .errors import ConfigError
from .types import TargetOutput


def cache_dir() -> Path:
    """Where inductor keeps compiled kernels between runs ($MTPSPEC_COMPILE_CACHE, default ~/.cache/mtpspec/inductor)."""
    return Path(os.environ.get("MTPSPEC_COMPILE_CACHE", Path.home() / ".cache" / "mtpspec" / "inductor"))


def _proj(x: Tensor, *linears) -> list[Tensor]:
    """Several nn.Linear of the same input as one product -> their outputs, split back.

    The concatenated weight (and bias) is built once, outside the graph, by `fuse_projections` and kept
    on the first module; the graph reads it as an input (one GEMM call instead of several)."""
    w, b = linears[0].__dict__["fused_with_next"]
    return list(F.linear(x, w, b).split([lin.weight.shape[0] for lin in linears], dim=-1))


def _fuse(*linears) -> None:
    """Concatenate the weights (and biases) of linears that read the same input; stored on the first."""
    with torch.no_grad():
        w = torch.cat([lin.weight for lin in linears])
        biases = [lin.bias for lin in linears]
        b = None if all(x is None for x in biases) else torch.cat([
            bias if bias is not None else lin.weight.new_zeros(lin.weight.shape[0]) for bias, lin in zip(biases, linears)])
    linears[0].__dict__["fused_with_next"] = (w, b)


def fuse_projections(module) -> None:
    """Build the concatenated projections the static functions read (attention q/k/v, the DeltaNet's four
    input projections, SwiGLU gate/up) for every layer of `module`; rebuilt when its weights change."""
    for m in module.modules():
        if hasattr(m, "in_proj_qkv"):
            _fuse(m.in_proj_qkv, m.in_proj_z, m.in_proj_b, m.in_proj_a)
        elif hasattr(m, "q_proj") and hasattr(m, "v_proj"):
            _fuse(m.q_proj, m.k_proj, m.v_proj)
        elif isinstance(m, SwiGLU):
            _fuse(m.gate_proj, m.up_proj)


def use_cache_dir() -> None:
    """Point inductor's on-disk cache at cache_dir(), unless the user chose one with TORCHINDUCTOR_CACHE_DIR
    (torch fills that variable with its /tmp default on first use: that default is replaced)."""
    from torch._inductor.runtime.cache_dir_utils import default_cache_dir

    chosen = os.environ.get("TORCHINDUCTOR_CACHE_DIR")
    if chosen is None or os.path.abspath(chosen) == os.path.abspath(default_cache_dir()) or "MTPSPEC_COMPILE_CACHE" in os.environ:
        os.environ["TORCHINDUCTOR_CACHE_DIR"] = str(cache_dir())


def _rope(x: Tensor, cos: Tensor, sin: Tensor, rot: int) -> Tensor:
    """x (B, nh, T, hd), cos / sin (T, rot) gathered at the positions -> rotated on the first rot dims."""
    xr, xp = x[..., :rot], x[..., rot:]
    half = rot // 2
    rotated = torch.cat([-xr[..., half:], xr[..., :half]], dim=-1)
    return torch.cat([xr * cos + rotated * sin, xp], dim=-1)


def _attend(q: Tensor, k_buf: Tensor, v_buf: Tensor, k: Tensor, v: Tensor, pos: Tensor, window: int) -> Tensor:
    """Write k, v (1, nkv, T, hd) at positions pos (T,) of the buffers (1, nkv, S, hd); q (1, nh, T, hd) attends
    to every buffer position <= its own (and within `window` of it, when window > 0) -> (1, nh, T, hd)."""
    k_buf.index_copy_(2, pos, k)
    v_buf.index_copy_(2, pos, v)
    keys = torch.arange(k_buf.shape[2])  # (S,)
    mask = keys[None, :] <= pos[:, None]  # (T, S) causal over the whole buffer: later slots are masked out
    if window > 0:
        mask = mask & (keys[None, :] > pos[:, None] - window)
    return F.scaled_dot_product_attention(q, k_buf, v_buf, attn_mask=mask, enable_gqa=q.shape[1] != k_buf.shape[1])


def _gated_attention(att, x: Tensor, k_buf: Tensor, v_buf: Tensor, pos: Tensor) -> Tensor:
    """models.qwen35.GatedAttention.forward with the position as a tensor."""
    b, t, _ = x.shape
    qg, k, v = _proj(x, att.q_proj, att.k_proj, att.v_proj)
    q, gate = qg.reshape(b, t, att.nh, 2 * att.hd).chunk(2, dim=-1)
    k = k.reshape(b, t, att.nkv, att.hd)
    v = v.reshape(b, t, att.nkv, att.hd).transpose(1, 2)
    rope = att.rotary[0]
    cos, sin = (tab[pos].to(x.dtype) for tab in rope.tables(x.dtype))  # (T, rot)
    q = _rope(att.q_norm(q).transpose(1, 2), cos, sin, rope.rot_dim)
    k = _rope(att.k_norm(k).transpose(1, 2), cos, sin, rope.rot_dim)
    y = _attend(q, k_buf, v_buf, k, v, pos, 0).transpose(1, 2).reshape(b, t, att.nh * att.hd)
    return att.o_proj(y * torch.sigmoid(gate.reshape(b, t, -1)))


def _dense_attention(att, x: Tensor, k_buf: Tensor, v_buf: Tensor, pos: Tensor) -> Tensor:
    """models.dense.Attention.forward with the position as a tensor."""
    b, t, _ = x.shape
    q, k, v = _proj(x, att.q_proj, att.k_proj, att.v_proj)
    q = q.reshape(b, t, att.nh, att.hd)
    k = k.reshape(b, t, att.nkv, att.hd)
    v = v.reshape(b, t, att.nkv, att.hd).transpose(1, 2)
    if att.qk_norm:
        q, k = att.q_norm(q), att.k_norm(k)
    rope = att.rotary[0]
    cos, sin = (tab[pos].to(x.dtype) for tab in rope.tables(x.dtype))
    q = _rope(q.transpose(1, 2), cos, sin, rope.rot_dim)
    k = _rope(k.transpose(1, 2), cos, sin, rope.rot_dim)
    y = _attend(q, k_buf, v_buf, k, v, pos, att.window)
    return att.o_proj(y.transpose(1, 2).reshape(b, t, att.nh * att.hd))


def _delta_net(dn, x: Tensor, conv_window: Tensor, s0: Tensor) -> tuple[Tensor, Tensor, Tensor]:
    """models.gated_deltanet.GatedDeltaNet.forward in its exact (position by position) form.

    x (1, T, H), conv_window (1, C, K-1), s0 (1, nv, dk, dv) -> out (1, T, H), the widened conv window
    (1, C, K-1+T) and the states after each position (T, 1, nv, dk, dv)."""
    b, t, _ = x.shape
    mixed, z, b_in, a_in = _proj(x, dn.in_proj_qkv, dn.in_proj_z, dn.in_proj_b, dn.in_proj_a)
    mixed = mixed.transpose(1, 2)  # (1, C, T)
    hist = torch.cat([conv_window.to(mixed.dtype), mixed], dim=-1)
    conv = F.silu(causal_conv(hist, dn.conv1d.weight)).transpose(1, 2)  # (1, T, C)
    q, k, v = conv.split([dn.key_dim, dn.key_dim, dn.value_dim], dim=-1)
    r, dt = dn.nv // dn.nk, wide(x.dtype)
    q = q.reshape(b, t, dn.nk, dn.dk).repeat_interleave(r, dim=2).transpose(1, 2).to(dt)  # (1, nv, T, dk)
    k = k.reshape(b, t, dn.nk, dn.dk).repeat_interleave(r, dim=2).transpose(1, 2).to(dt)
    v = v.reshape(b, t, dn.nv, dn.dv).transpose(1, 2).to(dt)  # (1, nv, T, dv)
    q = _l2norm(q) * dn.dk**-0.5
    k = _l2norm(k)
    beta = b_in.to(dt).sigmoid().transpose(1, 2)  # (1, nv, T)
    decay = (-dn.A_log.to(dt).exp() * F.softplus(a_in.to(dt) + dn.dt_bias.to(dt))).transpose(1, 2).exp()
    outs, states, s = [], [], s0
    for i in range(t):  # unrolled: T is fixed per compiled graph
        k_i = k[:, :, i, :, None]  # (1, nv, dk, 1)
        s = s * decay[:, :, i, None, None]
        s = s + k_i * ((v[:, :, i] - (k_i * s).sum(-2)) * beta[:, :, i, None]).unsqueeze(-2)
        outs.append((q[:, :, i, :, None] * s).sum(-2))  # (1, nv, dv)
        states.append(s)
    o = torch.stack(outs, dim=1).to(x.dtype)  # (1, T, nv, dv)
    z = z.reshape(b, t, dn.nv, dn.dv)
    y = dn.norm(o, z).reshape(b, t, dn.value_dim)
    return dn.out_proj(y), hist, torch.stack(states)


def _mlp(mlp, x: Tensor) -> Tensor:
    """SwiGLU with gate and up in one projection (their weights concatenated: folded into one constant when frozen)."""
    if not isinstance(mlp, SwiGLU):  # a mixture of experts runs as it is
        return mlp(x)
    g, u = _proj(x, mlp.gate_proj, mlp.up_proj)
    return mlp.down_proj(F.silu(g) * u)


def _check_threads(threads: int) -> None:
    """A Python branch on the thread count: dynamo guards on it, so another count builds its own graph."""
    if threads < 1:
        raise ValueError(f"threads must be >= 1, got {threads}")


def hybrid_forward(model, tokens: Tensor, pos: Tensor, k_bufs: Tensor, v_bufs: Tensor,
                   convs: list[Tensor], states: list[Tensor], threads: int = 1):
    """HybridLM.forward_tokens as a static-shape function: tokens (T,), pos (T,) their positions,
    k_bufs / v_bufs (L_full, 1, nkv, S, hd) the KV buffers (written in place), convs / states per linear layer.
    Returns logits (T, V), hidden (T, H), prenorm (T, H), and per linear layer the widened conv window and T states.
    `threads` only keys the graph: compiled kernels keep the thread count they were built with."""
    _check_threads(threads)
    x = model.embed(tokens[None])  # (1, T, H)
    hists, slots = [], []
    for layer in model.model.layers:
        h = layer.input_layernorm(x)
        if layer.layer_type == "linear_attention":
            dn = layer.linear_attn
            o, hist, st = _delta_net(dn, h, convs[dn.slot], states[dn.slot])
            hists.append(hist)
            slots.append(st)
        else:
            kv = layer.self_attn.kv_index
            o = _gated_attention(layer.self_attn, h, k_bufs[kv], v_bufs[kv], pos)
        x = x + o
        x = x + _mlp(layer.mlp, layer.post_attention_layernorm(x))
    hid = model.model.norm(x)[0]
    return model.head(hid), hid, x[0], hists, slots


def dense_forward(model, tokens: Tensor, pos: Tensor, k_bufs: Tensor, v_bufs: Tensor, threads: int = 1):
    """DenseLM.forward_tokens as a static-shape function (see hybrid_forward)."""
    _check_threads(threads)
    x = model.embed(tokens[None])
    for i, layer in enumerate(model.model.layers):
        x = x + _dense_attention(layer.self_attn, layer.input_layernorm(x), k_bufs[i], v_bufs[i], pos)
        x = x + _mlp(layer.mlp, layer.post_attention_layernorm(x))
    hid = model.model.norm(x)[0]
    return model.head(hid), hid, x[0]


def draft_module_forward(module, hidden: Tensor, emb: Tensor, k_buf: Tensor, v_buf: Tensor, pos: Tensor, layer: int,
                         threads: int = 1) -> Tensor:
    """MTPModule.forward / EagleModule.forward as a static-shape function: hidden, emb (T, H) at positions
    pos (T,) of its own KV buffers (L, 1, nkv, S, hd) -> (T, H) (after mtp.norm for an MTP module)."""
    _check_threads(threads)
    mtp = hasattr(module, "pre_fc_norm_hidden")
    if mtp:
        x = module.fc(torch.cat([module.pre_fc_norm_embedding(emb), module.pre_fc_norm_hidden(hidden)], dim=-1))[None]
    else:  # EAGLE: fc([e, h]) with a bias, no norms
        x = module.fc(torch.cat([emb, hidden], dim=-1))[None]
    block = module.layers[layer]
    kv = block.self_attn.kv_index
    x = x + _gated_attention(block.self_attn, block.input_layernorm(x), k_buf[kv], v_buf[kv], pos)
    x = x + _mlp(block.mlp, block.post_attention_layernorm(x))
    return module.norm(x)[0] if mtp else x[0]


@dataclass
class CompileStats:
    """What compiling cost: graphs built (one per width T and thread count) and the seconds their first calls took."""

    graphs: int = 0
    seconds: float = 0.0


# The kernels are called from a C++ wrapper, not a Python one: per-step overhead is the point. Weights stay graph
# inputs (not frozen constants): frozen graphs are not cached across runs, and each run would compile again.
OPTIONS = {"cpp_wrapper": True}


# Once every graph in use is built, dynamo re-checking all of each graph's guards (one per weight) costs about
# as much as a small kernel per step; the guards that tell the graphs apart are still checked.
SKIP_GUARDS = True


class _Compiled:
    """What both compiled steps share: one graph per (width, KV length, threads), built on first use and timed; the
    concatenated projections rebuilt when the weights change; the cache's positions as a tensor."""

    def __init__(self, fn, module, max_width: int, backend: str = "inductor") -> None:
        import torch._dynamo

        self.module, self.max_width, self.backend = module, max_width, backend
        # one graph per width: never fall back to eager silently for lack of room in dynamo's cache
        torch._dynamo.config.recompile_limit = max(torch._dynamo.config.recompile_limit, 8 * max_width)
        torch._dynamo.config.accumulated_recompile_limit = max(torch._dynamo.config.accumulated_recompile_limit, 64 * max_width)
        # backend "eager" traces the same static graphs without generating code (tests of the tracing and bookkeeping)
        self.fn = torch.compile(fn, dynamic=False, fullgraph=True, backend=backend, options=OPTIONS if backend == "inductor" else None)
        self.params = list(module.parameters())
        self.version = weights_version(self.params)  # changes when a weight is updated in place or replaced
        fuse_projections(module)
        self.built: set[tuple[int, int, int]] = set()  # (width, KV length, threads) run with every guard checked
        self.stats = CompileStats()

    def usable(self, t: int, exact: bool, dtype: torch.dtype, batch: int) -> bool:
        return (1 <= t <= self.max_width and not exact and dtype in (torch.float32, torch.bfloat16) and batch == 1
                and torch.is_inference_mode_enabled())

    def run(self, t: int, length: int, *args):
        """The graph for width t over KV buffers of `length` positions (a new (t, length, threads) is run with
        every guard checked, compiling when needed; a known one checks only the guards between graphs)."""
        version = weights_version(self.params)
        if version != self.version:  # trained since: the concatenated projections are rebuilt from the new weights
            fuse_projections(self.module)
            self.version = version
        key = (t, length, torch.get_num_threads())  # compiled kernels keep the thread count they were built for
        if key in self.built:  # a built graph: evaluate only the guards that tell the graphs apart
            with torch.compiler.set_stance(skip_guard_eval_unsafe=SKIP_GUARDS):
                return self.fn(*args, key[1])
        t0 = perf_counter()
        out = self.fn(*args, key[1])
        self.built.add(key)
        self.stats.graphs += 1
        self.stats.seconds += perf_counter() - t0
        return out


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

    def __init__(self, model, max_width: int = 9, backend: str = "inductor") -> None:
        self.hybrid = isinstance(model.new_cache(1), HybridCache)
        super().__init__(hybrid_forward if self.hybrid else dense_forward, model, max_width, backend)

    def handles(self, t: int, cache) -> bool:
        kv = cache.kv if self.hybrid else cache
        return not getattr(cache, "prefill", False) and self.usable(t, cache.exact, self.module.dtype, kv.k.shape[1])

    def __call__(self, tokens: Tensor, cache) -> TargetOutput:
        t = tokens.shape[0]
        kv = cache.kv if self.hybrid else cache
        start = cache.length
        if start + t > kv.max_len:
            raise ConfigError(f"context full: {start + t} positions exceed the model's context of {kv.max_len}")
        pos = torch.arange(start, start + t)  # (T,)
        if self.hybrid:
            n = range(cache.n_linear)
            convs = [cache.conv_window(i).contiguous() for i in n]  # (1, C, K-1)
            states = [_inference(cache.start_state(i).contiguous()) for i in n]  # (1, nv, dk, dv)
            logits, hid, pre, hists, slots = self.run(t, kv.max_len, self.module, _inference(tokens), pos, kv.k, kv.v, convs, states)
            for i in n:
                cache.record_window(i, hists[i], [Window(states=list(slots[i].unbind(0)))], None)
        else:
            logits, hid, pre = self.run(t, kv.max_len, self.module, _inference(tokens), pos, kv.k, kv.v)
        cache.advance(t)
        return TargetOutput(logits=logits, hidden=hid, prenorm_hidden=pre)


class CompiledDraftStep(_Compiled):
    """The static-shape MTP / EAGLE module step (a chained draft step, or the catch-up over accepted
    tokens), compiled per width T = 1..max_width like CompiledStep."""

    def __init__(self, module, max_width: int = 9, backend: str = "inductor") -> None:
        super().__init__(draft_module_forward, module, max_width, backend)

    def handles(self, t: int, cache) -> bool:
        return self.usable(t, cache.exact, self.module.fc.weight.dtype, cache.k.shape[1])

    def __call__(self, hidden: Tensor, emb: Tensor, cache, layer: int = 0) -> Tensor:
        """hidden, emb (T, H) at the cache's next positions -> (T, H); advances the cache."""
        t = hidden.shape[0]
        start = cache.length
        if start + t > cache.max_len:
            raise ConfigError(f"context full: {start + t} positions exceed the draft module's context of {cache.max_len}")
        pos = torch.arange(start, start + t)
        out = self.run(t, cache.max_len, self.module, _inference(hidden), _inference(emb), cache.k, cache.v, pos, layer)
        cache.advance(t)
        return out


def check_compilable(model=None, dtype: torch.dtype | None = None, quant: str | None = None) -> None:
    """A ConfigError naming why `model` (or, before loading, a model of `dtype` quantized as `quant`) cannot
    take the compiled path."""
    from .quant import QuantLinear

    dtype = dtype or model.dtype
    if dtype not in (torch.float32, torch.bfloat16):
        raise ConfigError(f"--compile needs fp32 or bf16 weights, not {str(dtype).removeprefix('torch.')} (fp64 is the eager reference)")
    if quant is not None or (model is not None and any(isinstance(m, QuantLinear) for m in model.modules())):
        raise ConfigError("--compile with --quant is not supported yet: the compiled graph reads full-precision weights")
    if model is not None and getattr(model.config, "num_experts", 0) > 0:
        raise ConfigError("--compile does not cover mixture-of-experts layers (Qwen3-Next) yet: run without --compile")


def compile_model(model, max_width: int = 9, backend: str = "inductor") -> CompiledStep:
    """Route `model.forward_tokens` windows of up to max_width positions (and its MTP module's steps) through
    compiled graphs, kept on the model. Graphs are built on first use of each width; kernels are cached on
    disk (cache_dir()) so later runs skip the C++ compilation."""
    check_compilable(model)
    use_cache_dir()
    step = CompiledStep(model, max_width, backend)
    model.__dict__["compiled_step"] = step  # not a submodule: state_dict and .to() leave it alone
    if getattr(model, "mtp", None) is not None:
        model.mtp.__dict__["compiled_step"] = CompiledDraftStep(model.mtp, max_width, backend)
    return step


def compiled_draft_step(module, target) -> CompiledDraftStep | None:
    """The compiled step of an MTP / EAGLE module (its own, or a trained head's on `target`, an AttachedHead)
    when the target model was compiled (compile_model); else None."""
    step = module.__dict__.get("compiled_step")
    base = getattr(target, "target", target)  # an AttachedHead's frozen target
    if step is None and "compiled_step" in getattr(base, "__dict__", {}):
        parent = base.__dict__["compiled_step"]
        step = module.__dict__["compiled_step"] = CompiledDraftStep(module, parent.max_width, parent.backend)
    return step

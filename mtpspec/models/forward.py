"""The one forward of each architecture: dense (Llama / Qwen2 / Qwen3 / Gemma 3), hybrid (Qwen3.5 / Qwen3-Next with
Gated DeltaNet layers) and the MTP / EAGLE module (a decoder layer of the same code).

Each is a function of the weights (the model's modules, read as containers), the new tokens (B, W), a ForwardBatch
(batch.py: each row's position, the tree, prefill, which rows are real) and the KV buffers. Eager one-sequence
decoding, chain and tree verification, exact mode (width-one calls), prefill, batched decoding (batching.py),
training (B windows, no cache) and the compiled graphs (compiled.py) all call these. Projections, norms and MLPs
run on the N real rows; attention (attention.py) and the Gated DeltaNet recurrence on the grid.

`forward_tokens` is the one-sequence entry over a cache (CausalLM.forward_tokens); the cache's bookkeeping (its
length, a Gated DeltaNet layer's slots for rollback, hybrid_cache.py) is kept here and in batching.forward_batch.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import Tensor

from .. import kernels
from ..kernels import quantized, rowstack
from ..cache import check_room
from ..device import on
from ..errors import ConfigError
from ..types import TargetOutput
from ..weight_cache import weights_version
from .attention import RowPlan, attend, norm_rope, rope, rotary_at, write
from .batch import ForwardBatch
from .blocks import holds_blocks
from .common import ACTIVATIONS, Linear, RMSNorm, SwiGLU, wide
from .gated_deltanet import CHUNK, SHORT_MAX_T, _l2norm, causal_conv, chunked_delta_rule, piece_delta_rule, tree_conv, window_delta_rule
from .hybrid_cache import HybridCache, Window
from .sparse_attention import IndexKeys, sparse_attend, window_sparse_attention


def _proj(x: Tensor, *linears) -> list[Tensor]:
    """Several Linear of the same input as one product -> their outputs, split back.

    The concatenated weight (and bias) is built once by `fuse_projections` and kept on the first (Linear.fused). GGUF block
    layers without biases share one kernel call on an fp32 input (quantized.linear_many: x quantized once, bitwise
    each layer's own product); other layers run one by one."""
    fused = getattr(linears[0], "fused", None)
    if fused is None:
        if x.dtype == torch.float32 and len(linears) > 1 and all(holds_blocks(lin) and lin.bias is None for lin in linears):
            y = quantized.linear_many(x, [lin.qweight for lin in linears])  # (N, sum of outputs)
            return list(y.split([lin.out_features for lin in linears], dim=-1))
        return [lin(x) for lin in linears]
    w, b, panels = fused
    y = kernels.packed_linear(x, panels, w.shape[0], b) if panels is not None and kernels.usable(x, w) else F.linear(x, w, b)
    return list(y.split([lin.weight.shape[0] for lin in linears], dim=-1))


def _fuse(*linears) -> bool:
    """Concatenate the weights (and biases) of linears that read the same input; kept by the first (Linear.fused).
    False when they stay apart (quantized layers keep their own kernels)."""
    if not isinstance(linears[0], Linear) or not all(isinstance(lin, torch.nn.Linear) and not holds_blocks(lin) for lin in linears):
        return False  # block weights keep their own kernel (and their row invariance)
    with torch.no_grad():
        w = torch.cat([lin.weight for lin in linears])
        biases = [lin.bias for lin in linears]
        b = None if all(x is None for x in biases) else torch.cat([
            bias if bias is not None else lin.weight.new_zeros(lin.weight.shape[0]) for bias, lin in zip(biases, linears)])
        panels = kernels.pack(w) if w.dtype in kernels.DTYPES and w.device.type == "cpu" and kernels.available() else None
    linears[0].fused = (w, b, panels)
    return True


def fuse_projections(module) -> None:
    """Build the concatenated projections (attention q/k/v, the DeltaNet's four input projections, SwiGLU gate/up) of
    every layer of `module`, and every other Linear's panels for the small-row kernel; rebuilt when weights change."""
    fused: set[int] = set()
    for m in module.modules():
        group = ((m.in_proj_qkv, m.in_proj_z, m.in_proj_b, m.in_proj_a) if hasattr(m, "in_proj_qkv")
                 else (m.q_proj, m.k_proj, m.v_proj) if hasattr(m, "q_proj") and hasattr(m, "v_proj")
                 else (m.gate_proj, m.up_proj) if isinstance(m, SwiGLU) else ())
        if group and _fuse(*group):
            fused.update(id(lin) for lin in group)
    for m in module.modules():
        if (isinstance(m, Linear) and id(m) not in fused and not holds_blocks(m) and m.weight.dtype in kernels.DTYPES
                and m.weight.device.type == "cpu" and kernels.available()):
            m.packed()


def fused_for_decoding(module) -> None:
    """fuse_projections for a module that decodes eagerly (a draft module: a few rows per call, where each product's
    call costs more than its arithmetic), again whenever its weights have changed since."""
    version = weights_version(module.parameters())
    if module.fused_version != version:
        fuse_projections(module)
        module.fused_version = version


def _mlp(mlp, x: Tensor) -> Tensor:
    """The gated MLP with gate and up in one projection when fused; a mixture of experts runs as it is."""
    if not isinstance(mlp, SwiGLU):
        return mlp(x)
    g, u = _proj(x, mlp.gate_proj, mlp.up_proj)
    return mlp.down_proj(mlp.act(g) * u)


def _dense_attention(att, x: Tensor, k_buf: Tensor | None, v_buf: Tensor | None, fb: ForwardBatch,
                     plan: RowPlan | None = None) -> Tensor:
    """Llama / Qwen / Gemma attention: x (N, H) real rows -> (N, H); k_buf / v_buf (B, nkv, S, hd) written in place.
    plan: one sequence's rows in order on the row kernels (RowPlan): the same values, bitwise, in fewer calls (rows
    kept flat, norm and rotation in one call per tensor, the shared tables made once per forward)."""
    if plan is not None:
        n = x.shape[0]
        q, k, v = _proj(x, att.q_proj, att.k_proj, att.v_proj)  # (N, nh hd), (N, nkv hd) x 2
        cos, sin = plan.rotary(att.rotary[0], x.dtype)  # (N, rot)
        q = norm_rope(q.view(n, att.nh, att.hd), att.q_norm if att.qk_norm else None, cos, sin)  # (N, nh, hd)
        k = norm_rope(k.view(n, att.nkv, att.hd), att.k_norm if att.qk_norm else None, cos, sin)  # (N, nkv, hd)
        y = plan.write_attend(q, k, v.view(n, att.nkv, att.hd), k_buf, v_buf, att.window)  # (N, nh, hd)
        return att.o_proj(y.view(n, -1))
    b, t = fb.b, fb.w
    q, k, v = (fb.grid(y) for y in _proj(x, att.q_proj, att.k_proj, att.v_proj))  # (B, W, .) each
    q = q.reshape(b, t, att.nh, att.hd)
    k = k.reshape(b, t, att.nkv, att.hd)
    v = v.reshape(b, t, att.nkv, att.hd).transpose(1, 2)  # (B, nkv, W, hd)
    if att.qk_norm:
        q, k = att.q_norm(q), att.k_norm(k)
    cos, sin = rotary_at(att.rotary[0], fb, x.dtype)
    rot = att.rotary[0].rot_dim
    q = rope(q.transpose(1, 2), cos, sin, rot)  # (B, nh, W, hd)
    k = rope(k.transpose(1, 2), cos, sin, rot)  # (B, nkv, W, hd)
    y = _write_attend(q, k, v, k_buf, v_buf, fb, att.window, att.rows)  # (B, nh, W, hd)
    return att.o_proj(fb.real(y.transpose(1, 2)))


def _write_attend(q: Tensor, k: Tensor, v: Tensor, k_buf, v_buf, fb: ForwardBatch, window: int = 0, by_row: bool = False) -> Tensor:
    """Write k, v (B, nkv, W, hd) and attend q (B, nh, W, hd) -> (B, nh, W, hd). k_buf / v_buf: the buffers (B, nkv, S,
    hd), or a list of one (1, nkv, S, hd) per sequence (a draft module over several sequences' own caches, in place:
    fb from ForwardBatch.many), each sequence's padding rows then zero."""
    if not isinstance(k_buf, list):
        keys, vals = write(k_buf, v_buf, k, v, fb)
        return attend(q, keys, vals, fb, window, by_row)
    y = q.new_zeros(q.shape)
    for i, (kb, vb, (start, n)) in enumerate(zip(k_buf, v_buf, fb.runs)):
        one = ForwardBatch.one(start, n)
        keys, vals = write(kb, vb, k[i : i + 1, :, :n], v[i : i + 1, :, :n], one)
        y[i : i + 1, :, :n] = attend(q[i : i + 1, :, :n], keys, vals, one, window, by_row)
    return y


def _gated_attention(att, x: Tensor, k_buf: Tensor | None, v_buf: Tensor | None, fb: ForwardBatch, kv=None) -> Tensor:
    """Qwen3.5 full attention (per-head q/k norm, partial rotary, a sigmoid output gate packed beside q): x (N, H) ->
    (N, H). kv: the KVCache whose indexer keys and selection state a block-sparse layer reads (None: training)."""
    b, t = fb.b, fb.w
    qg, k, v = (fb.grid(y) for y in _proj(x, att.q_proj, att.k_proj, att.v_proj))
    q, gate = qg.reshape(b, t, att.nh, 2 * att.hd).chunk(2, dim=-1)  # (B, W, nh, hd) each
    k = k.reshape(b, t, att.nkv, att.hd)
    v = v.reshape(b, t, att.nkv, att.hd).transpose(1, 2)
    cos, sin = rotary_at(att.rotary[0], fb, x.dtype)
    rot = att.rotary[0].rot_dim
    q = rope(att.q_norm(q).transpose(1, 2), cos, sin, rot)  # (B, nh, W, hd)
    k = rope(att.k_norm(k).transpose(1, 2), cos, sin, rot)
    if att.sparse is not None and not isinstance(k_buf, list):
        keys, vals = write(k_buf, v_buf, k, v, fb)
        y = _sparse_attention(att, x, q, keys, vals, fb, kv)  # (B, W, nh hd)
    else:
        y = _write_attend(q, k, v, k_buf, v_buf, fb).transpose(1, 2).reshape(b, t, att.nh * att.hd)
    return att.o_proj(fb.real(y * torch.sigmoid(gate.reshape(b, t, -1))))


def _sparse_attention(att, x: Tensor, q: Tensor, keys: Tensor, vals: Tensor, fb: ForwardBatch, kv) -> Tensor:
    """Block-sparse attention (sparse_attention.py): x (N, H) the normed input, q (B, nh, W, hd) -> (B, W, nh hd)."""
    scale = 1.0 / math.sqrt(att.hd)
    if kv is None:  # training windows from position 0: the indexer selects within each window
        return window_sparse_attention(att.sparse, att.indexer, fb.grid(x), q, keys, vals, scale).transpose(1, 2).flatten(2)
    if fb.b != 1 or fb.tree is not None or fb.start is None:
        raise ConfigError("sparse attention runs one sequence at a time, without token trees")
    if kv.index is None:  # a cache made without the model's new_cache: the indexer's keys live with it from now on
        kv.index = IndexKeys(kv.k.shape[0], kv.max_len, att.sparse, x.dtype)
    state = kv.sparse
    reusing = state is not None and state.reusing(att.kv_index, fb.sparse)
    if not reusing:  # a reused step's rows are draft positions, rewritten (and their blocks refreshed) before any read
        kv.index.write(att.kv_index, fb.start, att.indexer.keys(x))
    if fb.sparse == "full":  # dense causal attention, same weights (the ablation of sparsity)
        return attend(q, keys, vals, fb).transpose(1, 2).flatten(2)
    queries = None if reusing else att.indexer.queries(x)
    y = sparse_attend(att.sparse, q[0].transpose(0, 1), keys[0], vals[0], kv.index, att.kv_index, fb.start, queries, state,
                      scale, fb.sparse)
    return y[None]


def _delta_net(dn, x: Tensor, conv_window: Tensor, s0: Tensor, fb: ForwardBatch) -> tuple[Tensor, Tensor, list[Window] | Tensor]:
    """Gated DeltaNet: x (N, H) real rows, conv_window (B, C, K-1) the inputs before the window, s0 (B, nv, dk, dv) the
    incoming state -> out (N, H), the widened conv window (B, C, K-1+W), and what rebuilds the state after each
    position (the slots rollback selects, hybrid_cache.py), in the form that suits the forward:

    - token trees (one sequence's, or B sequences'): one exact chunk, each row along its own path (window_delta_rule
      with the ancestors);
    - a prompt's prefill longer than SHORT_MAX_T: 64-position chunks, the final state only (a Tensor);
    - fb.steps (compiled graphs of small states): position by position, the W states;
    - one position: the state read by two matmuls and the rank-1 write one baddbmm, the state itself;
    - else: exact chunks of at most 64 positions (piece_delta_rule), each a Window of decays, keys and corrections."""
    b, t = fb.b, fb.w
    mixed, z, b_in, a_in = _proj(x, dn.in_proj_qkv, dn.in_proj_z, dn.in_proj_b, dn.in_proj_a)
    mixed, b_in, a_in = fb.grid(mixed), fb.grid(b_in), fb.grid(a_in)  # (B, W, C), (B, W, nv) x 2
    tree = fb.tree is not None or fb.anc is not None
    if not tree:
        hist = torch.cat([conv_window.to(mixed.dtype), mixed.transpose(1, 2)], dim=-1)  # (B, C, K-1+W)
        conv = F.silu(causal_conv(hist, dn.conv1d.weight)).transpose(1, 2)  # (B, W, C)
    else:  # each row reads its own path's inputs: gathered by whole rows of C inputs
        rows = torch.cat([conv_window.to(mixed.dtype).transpose(1, 2), mixed], dim=1)  # (B, K-1+W, C)
        taps = fb.tree.conv_taps(dn.kernel) if fb.tree is not None else torch.stack([t.conv_taps(dn.kernel) for t in fb.trees])
        conv = F.silu(tree_conv(rows, dn.conv1d.weight, taps))  # (B, W, C)
        hist = rows.transpose(1, 2)
    q, k, v = conv.split([dn.key_dim, dn.key_dim, dn.value_dim], dim=-1)
    r, dt = dn.nv // dn.nk, wide(x.dtype)  # value heads per key head; the recurrence runs in at least fp32
    q = q.reshape(b, t, dn.nk, dn.dk).repeat_interleave(r, dim=2).transpose(1, 2).to(dt)  # (B, nv, W, dk)
    k = k.reshape(b, t, dn.nk, dn.dk).repeat_interleave(r, dim=2).transpose(1, 2).to(dt)
    v = v.reshape(b, t, dn.nv, dn.dv).transpose(1, 2).to(dt)  # (B, nv, W, dv)
    q = _l2norm(q) * dn.dk**-0.5
    k = _l2norm(k)
    beta = b_in.to(dt).sigmoid().transpose(1, 2)  # (B, nv, W)
    g = (-dn.A_log.to(dt).exp() * F.softplus(a_in.to(dt) + dn.dt_bias.to(dt))).transpose(1, 2)  # (B, nv, W) log decay
    if tree:
        if t > CHUNK:
            raise ValueError(f"a token tree of {t} rows: at most {CHUNK} fit one verify window")
        o, gc, u = window_delta_rule(q, k, v, g, beta, s0, anc=fb.tree.anc if fb.tree is not None else fb.anc)
        rec: list[Window] | Tensor = [Window(gc, k, u)]
    elif fb.prefill and t > SHORT_MAX_T:
        o, rec = chunked_delta_rule(q, k, v, g, beta, s0)
    elif fb.steps:
        decay, outs, states, s = g.exp(), [], [], s0
        for i in range(t):  # unrolled: W is fixed per compiled graph
            k_i = k[:, :, i, :, None]  # (B, nv, dk, 1)
            s = s * decay[:, :, i, None, None]
            s = s + k_i * ((v[:, :, i] - (k_i * s).sum(-2)) * beta[:, :, i, None]).unsqueeze(-2)
            outs.append((q[:, :, i, :, None] * s).sum(-2))  # (B, nv, dv)
            states.append(s)
        o, rec = torch.stack(outs, dim=2), [Window(states=states)]
    elif t == 1:
        s = s0 * g.exp()[..., None]  # (B, nv, dk, dv) decayed
        delta = (v - k @ s) * beta[..., None]  # (B, nv, 1, dv) the correction
        s = torch.baddbmm(s.view(-1, dn.dk, dn.dv), k.reshape(-1, dn.dk, 1), delta.view(-1, 1, dn.dv)).view_as(s0)
        o, rec = q @ s, [Window(states=[s])]
    else:
        o, rec = piece_delta_rule(q, k, v, g, beta, s0)
    o = fb.real(o.transpose(1, 2).to(x.dtype)).view(-1, dn.nv, dn.dv)  # (N, nv, dv)
    out = dn.out_proj(dn.norm(o, z.view(-1, dn.nv, dn.dv)).reshape(-1, dn.value_dim))
    return out, hist, rec


def tap_slots(taps: tuple[int, ...]) -> dict | None:
    """{layer id: None} for the layers a forward is asked to tap (an EAGLE-3 drafter's feature layers), filled by
    dense_forward / hybrid_forward; None when it taps none."""
    return dict.fromkeys(taps) if taps else None


def dense_forward(model, tokens: Tensor, fb: ForwardBatch, k_bufs: Tensor | None, v_bufs: Tensor | None, taps: dict | None = None):
    """DenseLM: tokens (B, W), k_bufs / v_bufs (L, B, nkv, S, hd) (None: training, no cache) -> logits (N, V) (None
    when fb.logits is False), hidden (N, H) post final norm, prenorm (N, H) of the real rows. taps: {layer id: None}
    filled with the residual stream (N, H) entering each of those layers."""
    x = fb.real(model.embed(tokens))  # (N, H)
    plan = None
    if model.config.row_kernels and k_bufs is not None and x.dtype == torch.float32 and x.device.type == "cpu":
        plan = RowPlan.of(fb)
    stack = row_stack(model) if plan is not None and not torch.is_grad_enabled() else None
    if stack is not None:
        x = stack.run(x.contiguous(), k_bufs, v_bufs, plan, taps)
    else:
        for i, layer in enumerate(model.model.layers):
            if taps is not None and i in taps:
                taps[i] = x
            x = _dense_layer(layer, x, None if k_bufs is None else k_bufs[i], None if v_bufs is None else v_bufs[i], fb, plan)
    hid = model.model.norm(x)
    return (model.head(hid) if fb.logits else None), hid, x


class RowStack:
    """A dense model's layers as kernels/rowstack.cpp takes them, for the row path (RowPlan): the same ops in the same
    order as _dense_layer, bitwise its outputs, in one call per forward. Holds references to the weights (updates in
    place are seen); a model whose layers are replaced sets its `row_stack` back to None."""

    W = 7  # weights per layer: q, k, v, o, gate, up, down

    def __init__(self, model) -> None:
        layers = model.model.layers
        att0 = layers[0].self_attn
        self.weights, self.qtypes, self.ns, self.norms = [], [], [], []
        self.rotaries, self.windows = [], []
        for layer in layers:
            att = layer.self_attn
            for lin in _stack_linears(layer):
                q = lin.qweight
                self.weights.append(q.data)
                self.qtypes.append(q.qtype.value)
                self.ns.append(q.shape[0])
            self.norms += _stack_norms(layer)
            self.rotaries.append(att.rotary[0])
            self.windows.append(att.window)
        norm = layers[0].input_layernorm
        self.eps, self.zero_centred = norm.eps, norm.zero_centred
        act = 1 if layers[0].mlp.act is ACTIVATIONS["gelu_tanh"] else 0
        self.dims = [att0.nh, att0.nkv, att0.hd, int(att0.qk_norm), int(layers[0].sandwich), act]
        self.per_norms = len(self.norms) // len(layers)
        self.scale = att0.hd ** -0.5  # attend_rows' default, as RowPlan.write_attend calls it

    @staticmethod
    def fits(model) -> bool:
        """Whether every layer is one the kernel computes: block weights without biases in the panel layout, q / k / v
        reading one input, row-kernel norms sharing one eps, silu or gelu-tanh, one shape."""
        layers = getattr(model.model, "layers", None)
        if not layers or not rowstack.available():
            return False
        first = layers[0]
        if not hasattr(first, "sandwich") or not isinstance(first.mlp, SwiGLU):
            return False
        att0, norm0 = first.self_attn, first.input_layernorm
        for layer in layers:
            att, mlp = layer.self_attn, layer.mlp
            if not isinstance(mlp, SwiGLU) or not (mlp.act is ACTIVATIONS["silu"] or mlp.act is ACTIVATIONS["gelu_tanh"]):
                return False
            if ((att.nh, att.nkv, att.hd, att.qk_norm, layer.sandwich, mlp.act) !=
                    (att0.nh, att0.nkv, att0.hd, att0.qk_norm, first.sandwich, first.mlp.act)):
                return False
            if not all(holds_blocks(lin) and lin.bias is None and lin.qweight.layout == "panels16" for lin in _stack_linears(layer)):
                return False
            if not (att.q_proj.qweight.shape[1] == att.k_proj.qweight.shape[1] == att.v_proj.qweight.shape[1]):
                return False
            norms = _stack_norms(layer, modules=True)
            if not all(isinstance(n, RMSNorm) and n.row_kernel and n.weight.dtype == torch.float32
                       and (n.eps, n.zero_centred) == (norm0.eps, norm0.zero_centred) for n in norms):
                return False
        return True

    def run(self, x: Tensor, k_bufs: Tensor, v_bufs: Tensor, plan: RowPlan, taps: dict | None) -> Tensor:
        """x (N, H) the embedded rows -> the stream after the last layer; taps filled as dense_forward's."""
        rot, lo, masks = [], [], []
        for rotary, window in zip(self.rotaries, self.windows):
            rot += plan.rotary(rotary, x.dtype)
            lo.append(plan.first_keys(window))
            if plan.fb.tree is not None:
                masks.append(plan.mask(window))
        cuts = sorted(i for i in taps if 0 <= i < len(self.windows)) if taps else []
        bounds = [0] + [c for c in cuts if c > 0] + [len(self.windows)]
        for a, b in zip(bounds, bounds[1:]):
            if taps is not None and a in taps:
                taps[a] = x
            w, p = self.W, self.per_norms
            x = rowstack.dense_stack(x, self.weights[a * w : b * w], self.qtypes[a * w : b * w], self.ns[a * w : b * w],
                                     self.norms[a * p : b * p], k_bufs, v_bufs, a, rot[2 * a : 2 * b], lo[a:b],
                                     masks[a:b], plan.seq, plan.slot, plan.hi, self.dims, self.eps, self.zero_centred,
                                     self.scale)
        return x


def _stack_linears(layer) -> tuple:
    """A layer's 7 linears in the kernel's order: q, k, v, o, gate, up, down."""
    att, mlp = layer.self_attn, layer.mlp
    return att.q_proj, att.k_proj, att.v_proj, att.o_proj, mlp.gate_proj, mlp.up_proj, mlp.down_proj


def _stack_norms(layer, modules: bool = False) -> list:
    """A layer's norms in the kernel's order: input, [q, k,] post-attention, [pre-, post-feedforward]; their weights
    (or the modules)."""
    att = layer.self_attn
    norms = [layer.input_layernorm] + ([att.q_norm, att.k_norm] if att.qk_norm else []) + [layer.post_attention_layernorm]
    if layer.sandwich:
        norms += [layer.pre_feedforward_layernorm, layer.post_feedforward_layernorm]
    return norms if modules else [n.weight for n in norms]


def row_stack(model) -> RowStack | None:
    """The model's RowStack (built on first use, kept as model.row_stack), or None when its layers do not fit it."""
    stack = model.row_stack
    if stack is None:
        stack = model.row_stack = RowStack(model) if RowStack.fits(model) else False
    return stack or None


def _dense_layer(layer, x: Tensor, k_buf, v_buf, fb: ForwardBatch, plan: RowPlan | None = None) -> Tensor:
    """One dense decoder layer (dense.Block): x (N, H) -> (N, H)."""
    a = _dense_attention(layer.self_attn, layer.input_layernorm(x), k_buf, v_buf, fb, plan)
    if layer.sandwich:  # Gemma 3: norms after attention and around the MLP
        x = x + layer.post_attention_layernorm(a)
        return x + layer.post_feedforward_layernorm(_mlp(layer.mlp, layer.pre_feedforward_layernorm(x)))
    x = x + a
    return x + _mlp(layer.mlp, layer.post_attention_layernorm(x))


def hybrid_forward(model, tokens: Tensor, fb: ForwardBatch, k_bufs: Tensor | None, v_bufs: Tensor | None,
                   convs: list[Tensor] | None, states: list[Tensor] | None, kv=None, taps: dict | None = None):
    """HybridLM: tokens (B, W), k_bufs / v_bufs (L_full, B, nkv, S, hd), per linear layer its conv window (B, C, K-1) and
    incoming state (B, nv, dk, dv) (None: training, zeros and no cache), kv: the KVCache a block-sparse layer's indexer
    reads -> logits (N, V) or None, hidden (N, H), prenorm (N, H), and per linear layer its widened conv window and
    its slots (see _delta_net). taps: as dense_forward's."""
    x = fb.real(model.embed(tokens))  # (N, H)
    hists, recs = [], []
    for n, layer in enumerate(model.model.layers):
        if taps is not None and n in taps:
            taps[n] = x
        h = layer.input_layernorm(x)
        if layer.layer_type == "linear_attention":
            dn = layer.linear_attn
            if convs is None:
                conv = h.new_zeros(fb.b, dn.conv_dim, dn.kernel - 1)
                s0 = torch.zeros(fb.b, dn.nv, dn.dk, dn.dv, dtype=wide(h.dtype))
            else:
                conv, s0 = convs[dn.slot], states[dn.slot]
            o, hist, rec = _delta_net(dn, h, conv, s0, fb)
            hists.append(hist)
            recs.append(rec)
        else:
            i = layer.self_attn.kv_index
            o = _gated_attention(layer.self_attn, h, None if k_bufs is None else k_bufs[i], None if v_bufs is None else v_bufs[i], fb, kv)
        x = x + o
        x = x + _mlp(layer.mlp, layer.post_attention_layernorm(x))
    hid = model.model.norm(x)
    return (model.head(hid) if fb.logits else None), hid, x, hists, recs


def module_forward(module, hidden: Tensor, emb: Tensor, k_buf: Tensor | None, v_buf: Tensor | None, fb: ForwardBatch,
                   layer: int = 0, kv=None) -> Tensor:
    """An MTP module (fc([norm(e), norm(h)]) -> decoder layer -> norm), an EAGLE module (fc([e, h]) with a bias ->
    decoder layer) or an EAGLE-3 module (eagle3.py: its layer on g, fc having run on the target's features): hidden,
    emb (B, W, H) at the rows' positions, k_buf / v_buf (B, nkv, S, hd) its layer's KV (or one (1, nkv, S, hd) per
    sequence, each its own cache: fb from ForwardBatch.many) -> (B, W, H), padding rows zero. The
    decoder layer is a layer of the target's kind, run by the same code: the hybrid's full-attention layer, or a dense
    layer (dense.Block: a head trained for a Llama / Qwen3 / Gemma 3 target)."""
    mtp = hasattr(module, "pre_fc_norm_hidden")
    hidden, emb = fb.real(hidden), fb.real(emb)  # (N, H)
    block = module.layers[layer]
    if hasattr(block, "hidden_norm"):  # EAGLE-3 (eagle3.py): hidden is g, emb the raw embedding; -> the pre-norm output
        g = block.hidden_norm(hidden)
        x = torch.cat([block.input_layernorm(emb), g], dim=-1)  # (N, 2H)
        x = (g if module.norm_before_residual else hidden) + _dense_attention(block.self_attn, x, k_buf, v_buf, fb)
        return fb.grid(x + _mlp(block.mlp, block.post_attention_layernorm(x)))  # (B, W, H)
    if mtp:
        x = module.fc(torch.cat([module.pre_fc_norm_embedding(emb), module.pre_fc_norm_hidden(hidden)], dim=-1))
    else:
        x = module.fc(torch.cat([emb, hidden], dim=-1))
    if hasattr(block, "sandwich"):
        x = _dense_layer(block, x, k_buf, v_buf, fb)
    else:
        x = x + _gated_attention(block.self_attn, block.input_layernorm(x), k_buf, v_buf, fb, kv)
        x = x + _mlp(block.mlp, block.post_attention_layernorm(x))
    return fb.grid(module.norm(x) if mtp else x)  # (B, W, H)


def record(cache: HybridCache, hists: list[Tensor], recs: list, b: int = 0, t: int | None = None) -> None:
    """Sequence b's part (its first t rows) of a forward's Gated DeltaNet records into its cache."""
    for i, (hist, rec) in enumerate(zip(hists, recs)):
        if isinstance(rec, Tensor):  # a prefill's final state
            cache.record_window(i, hist[b : b + 1], rec[b : b + 1])
        else:
            cache.record_window(i, hist[b : b + 1], [w.take(b, t) for w in rec] if t is not None else rec)


@torch.inference_mode()
def forward_tokens(model, tokens: Tensor, cache, tree=None, prefill: bool = False, logits: bool = True,
                   taps: tuple[int, ...] = ()) -> TargetOutput:
    """One sequence: tokens (T,) appended at positions cache.length.. (a token tree's rows at start + depth) ->
    logits (T, V) (None when logits=False), hidden (T, H) post final norm, and the residual stream (T, H) entering
    each layer in `taps` (layer_inputs); the cache advances by T."""
    t, start = tokens.shape[0], cache.length
    check_room(start + t, cache.max_len)
    fb = ForwardBatch.one(start, t, tree, prefill, logits)
    inputs = tap_slots(taps)  # {layer id: (T, H)} once the forward has run
    if isinstance(cache, HybridCache):
        kv, n = cache.kv, range(cache.n_linear)
        convs = [cache.conv_window(i) for i in n]  # (1, C, K-1)
        states = [cache.start_state(i) for i in n]  # (1, nv, dk, dv)
        lg, hid, pre, hists, recs = hybrid_forward(model, tokens[None], fb, kv.k, kv.v, convs, states, kv, inputs)
        record(cache, hists, recs)
    else:
        lg, hid, pre = dense_forward(model, tokens[None], fb, cache.k, cache.v, inputs)
    cache.advance(t)
    return TargetOutput(logits=lg, hidden=hid, prenorm_hidden=pre, layer_inputs=inputs)


@torch.inference_mode()
def run(model, tokens: Tensor, cache, exact: bool = False, logits: bool = True, tree=None, prefill: bool = False,
        taps: tuple[int, ...] = ()) -> TargetOutput:
    """model.forward_tokens: one sequence's forward over tokens (T,) appended to its cache.

    exact (outside a prefill): T one-position forwards (by_position). A window the model's compiled step handles
    (compiled.compile_model: chains of a batch-1 fp32 / bf16 model) runs its graph, unless the forward taps layer
    inputs (its graphs return none). logits=False: the LM head is left out (a prefill nobody reads; the compiled and
    exact paths return logits regardless). tree: a token tree's rows. taps: the layers whose inputs the output
    carries (TargetOutput.layer_inputs: an EAGLE-3 drafter's features). On a model off the CPU (mtpspec.device: its
    cache is there too) the tokens are moved there and what the forward makes is made there."""
    dev = cache.kv.k.device
    if dev.type != "cpu" and (tokens.device != dev or torch.get_default_device() != dev):
        with on(dev):
            return run(model, tokens.to(dev), cache, exact, logits, tree, prefill, taps)
    if tree is None and not prefill:
        if exact and tokens.shape[0] > 1:
            return by_position(model, tokens, cache, taps)
        step = model.compiled_step
        if step is not None and not taps and step.handles(tokens.shape[0], cache):
            return step(tokens, cache)
    return forward_tokens(model, tokens, cache, tree, prefill, logits, taps)


def by_position(model, tokens: Tensor, cache, taps: tuple[int, ...] = ()) -> TargetOutput:
    """tokens (T,) as T one-position forwards: exact mode's verify pass.

    Each position is then computed by exactly the code and shapes of a plain decode step, so its logits are bitwise
    the same whatever else shares the pass: GEMM kernels choose their blocking (and so each dot product's order of
    summation) by the number of rows, and vectorised elementwise kernels round a scalar tail differently. The pass
    still rolls back as one forward: a hybrid cache is left holding the state after each position (HybridCache.stitch)."""
    hybrid = isinstance(cache, HybridCache)
    stitch = cache.stitch_begin() if hybrid else None
    outs = []
    for j in range(tokens.shape[0]):
        outs.append(run(model, tokens[j : j + 1], cache, taps=taps))
        if hybrid:
            cache.stitch_add(stitch)
    if hybrid:
        cache.stitch_end(stitch)
    return TargetOutput.cat(outs)


@torch.inference_mode()
def module_tokens(module, embed, hidden: Tensor, tokens: Tensor, cache, layer: int = 0, tree=None,
                  sparse: str = "recompute") -> Tensor:
    """An MTP / EAGLE module over pairs (hidden[i], tokens[i]) (T, H), (T,) at its cache's next positions (a tree's rows
    at start + depth; sparse: a block-sparse module's selection) -> (T, H); the cache advances by T."""
    t, start = tokens.shape[0], cache.length
    check_room(start + t, cache.max_len, "draft module")
    fb = ForwardBatch.one(start, t, tree, sparse=sparse)
    k_buf, v_buf = cache.buffers(module.layers[layer].self_attn.kv_index)
    out = module_forward(module, hidden[None], embed(tokens)[None], k_buf, v_buf, fb, layer, cache)[0]
    cache.advance(t)
    return out


def _check_threads(threads: int) -> None:
    """A Python branch on the thread count: dynamo guards on it, so another count builds its own graph."""
    if threads < 1:
        raise ValueError(f"threads must be >= 1, got {threads}")


# The compiled graphs' entries (compiled.py): tensors in, the ForwardBatch built inside (positions as tensors).

def dense_graph(model, tokens: Tensor, pos: Tensor, keys: Tensor, k_bufs: Tensor, v_bufs: Tensor, threads: int = 1):
    _check_threads(threads)
    return dense_forward(model, tokens, ForwardBatch(pos, keys=keys), k_bufs, v_bufs)


def hybrid_graph(model, tokens: Tensor, pos: Tensor, keys: Tensor, k_bufs: Tensor, v_bufs: Tensor, convs: list[Tensor],
                 states: list[Tensor], threads: int = 1):
    """Position by position: per linear layer the W states (W, B, nv, dk, dv) (small states)."""
    _check_threads(threads)
    logits, hid, pre, hists, recs = hybrid_forward(model, tokens, ForwardBatch(pos, steps=True, keys=keys), k_bufs, v_bufs, convs, states)
    return logits, hid, pre, hists, [torch.stack(r[0].states) for r in recs]


def hybrid_window_graph(model, tokens: Tensor, pos: Tensor, keys: Tensor, k_bufs: Tensor, v_bufs: Tensor, convs: list[Tensor],
                        states: list[Tensor], threads: int = 1):
    """Each window of 2..64 rows as one exact chunk, per linear layer its (gc, k, u) (large states: W states cost more to
    write than the chunk's triangular solve)."""
    _check_threads(threads)
    logits, hid, pre, hists, recs = hybrid_forward(model, tokens, ForwardBatch(pos, keys=keys), k_bufs, v_bufs, convs, states)
    return logits, hid, pre, hists, [(r[0].gc, r[0].k, r[0].u) for r in recs]


def module_graph(module, hidden: Tensor, emb: Tensor, k_buf: Tensor, v_buf: Tensor, pos: Tensor, keys: Tensor, layer: int,
                 threads: int = 1) -> Tensor:
    _check_threads(threads)
    return module_forward(module, hidden, emb, k_buf, v_buf, ForwardBatch(pos, keys=keys), layer)


def greedy_draft(target, head, h: Tensor) -> Tensor:
    """h (n, H) draft-module outputs -> (n,) the greedy drafts: the argmax of the target's LM head, or of `head` (a
    DraftHead: the draft vocabulary) mapped back to token ids."""
    return target.head(h).argmax(-1) if head is None else head.token(head.logits(h).argmax(-1))


def draft_chain_graph(module, target, head, h: Tensor, x: Tensor | None, k_buf: Tensor, v_buf: Tensor, pos: Tensor,
                      keys: Tensor, k: int, threads: int = 1) -> tuple[Tensor, Tensor]:
    """A greedy MTP chain as one graph, as MTPDrafter.propose drafts step by step: from h (1, H), the module's output at
    the last pending pair, k drafts, each the argmax of the head over the latest output, the first k-1 fed back with
    their embeddings at positions pos, pos+1, .. (pos (1, 1)). x (1,): a continuation, x (the previous segment's last
    draft) fed first at pos, then k drafts of which the first k-1 are fed. -> the drafts (k,) and the output the last
    one came from (1, H)."""
    _check_threads(threads)
    drafts, fed = [], 0
    if x is not None:
        h = module_forward(module, h[None], target.embed(x)[None], k_buf, v_buf, ForwardBatch(pos, keys=keys), 0)[0]
        fed = 1
    for j in range(k):
        x = greedy_draft(target, head, h)  # (1,)
        drafts.append(x)
        if j + 1 < k:
            h = module_forward(module, h[None], target.embed(x)[None], k_buf, v_buf, ForwardBatch(pos + fed, keys=keys), 0)[0]  # (1, H)
            fed += 1
    return torch.cat(drafts), h  # (k,), (1, H)

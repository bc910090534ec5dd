"""The forward with positions as a tensor: B sequences x T new positions each, in one pass.

The eager forwards (dense.py, qwen35.py) take one sequence and its start position as a Python int.
These functions compute the same thing as functions of tensors only: each row b of the batch has
its own positions pos[b] (T,), keys and values are written into the preallocated KV buffers at those
positions, and attention reads the buffer under a mask (key s is seen by a query at position p iff
s <= p), so sequences of different lengths share every matrix product. No Python branch depends on a
position, so torch.compile can trace them once per shape (compiled.py) and the batched engine runs
them eagerly for B > 1 (engine.py).

Gated DeltaNet runs position by position (the recurrent form, as exact mode does) and returns the
state after every position: the slots a rollback selects, per sequence. Rows past a sequence's real
positions (padding, when sequences carry different draft lengths) come after its real ones, so they
change none of its outputs or slots; their keys and values go to a scratch position the caller
reserves past the context (the buffer's last), which no real query sees.
"""

from __future__ import annotations

from typing import NamedTuple

import torch
import torch.nn.functional as F
from torch import Tensor

from .. import kernels
from ..kernels.attention import attend_rows
from .common import Linear, SwiGLU, first_keys, wide
from .gated_deltanet import CHUNK, _l2norm, causal_conv, window_delta_rule


def _proj(x: Tensor, *linears) -> list[Tensor]:
    """Several nn.Linear of the same input as one product -> their outputs, split back.

    The concatenated weight (and bias) is built once, outside the graph, by `fuse_projections` and kept
    on the first module; the graph reads it as an input (one GEMM call instead of several). Layers that
    were not fused (quantized ones) run one by one."""
    fused = linears[0].__dict__.get("fused_with_next")
    if fused is None:
        return [lin(x) for lin in linears]
    w, b, panels = fused
    y = kernels.packed_linear(x, panels, w.shape[0], b) if panels is not None and kernels.usable(x, w) else F.linear(x, w, b)
    return list(y.split([lin.weight.shape[0] for lin in linears], dim=-1))


def _fuse(*linears) -> bool:
    """Concatenate the weights (and biases) of linears that read the same input; stored on the first. False when they
    stay apart."""
    if not all(isinstance(lin, torch.nn.Linear) for lin in linears):  # quantized layers keep their own kernels
        return False
    with torch.no_grad():
        w = torch.cat([lin.weight for lin in linears])
        biases = [lin.bias for lin in linears]
        b = None if all(x is None for x in biases) else torch.cat([
            bias if bias is not None else lin.weight.new_zeros(lin.weight.shape[0]) for bias, lin in zip(biases, linears)])
        panels = kernels.pack(w) if w.dtype in kernels.DTYPES and kernels.available() else None
    linears[0].__dict__["fused_with_next"] = (w, b, panels)
    return True


def fuse_projections(module) -> None:
    """Build the concatenated projections the static functions read (attention q/k/v, the DeltaNet's four
    input projections, SwiGLU gate/up) for every layer of `module`, and every Linear's panels for the
    small-row kernel (mtpspec.kernels) that the graphs read (not those of fused linears, which only the eager
    forward reads, packing its own on first use); rebuilt when its weights change."""
    fused: set[int] = set()
    for m in module.modules():
        group = ((m.in_proj_qkv, m.in_proj_z, m.in_proj_b, m.in_proj_a) if hasattr(m, "in_proj_qkv")
                 else (m.q_proj, m.k_proj, m.v_proj) if hasattr(m, "q_proj") and hasattr(m, "v_proj")
                 else (m.gate_proj, m.up_proj) if isinstance(m, SwiGLU) else ())
        if group and _fuse(*group):
            fused.update(id(lin) for lin in group)
    for m in module.modules():
        if isinstance(m, Linear) and id(m) not in fused and m.weight.dtype in kernels.DTYPES and kernels.available():
            kernels.panels_of(m.__dict__, m.weight)


class Layout(NamedTuple):
    """Where the N real rows of a forward sit in its (B, W) grid: `rows` (N,) indexes the flattened grid (None: all
    B x W rows are real). Projections and MLPs run on the N real rows only; attention and the Gated DeltaNet
    recurrence, which need each sequence's rows in order, run on the grid."""

    b: int
    w: int
    rows: Tensor | None = None

    def grid(self, x: Tensor) -> Tensor:
        """(N, d) real rows -> (B, W, d), padding rows zero."""
        if self.rows is None:
            return x.view(self.b, self.w, x.shape[-1])
        return x.new_zeros(self.b * self.w, x.shape[-1]).index_copy_(0, self.rows, x).view(self.b, self.w, x.shape[-1])

    def real(self, x: Tensor) -> Tensor:
        """(B, W, ...) -> (N, d) the real rows, flattened after the grid dims."""
        x = x.reshape(self.b * self.w, -1)
        return x if self.rows is None else x[self.rows]


def _rope(x: Tensor, cos: Tensor, sin: Tensor, rot: int) -> Tensor:
    """x (B, nh, T, hd), cos / sin (B, 1, T, rot) gathered at the positions -> rotated on the first rot dims."""
    xr, xp = x[..., :rot], x[..., rot:]
    half = rot // 2
    rotated = torch.cat([-xr[..., half:], xr[..., :half]], dim=-1)
    return torch.cat([xr * cos + rotated * sin, xp], dim=-1)


def _attend(q: Tensor, k_buf: Tensor, v_buf: Tensor, k: Tensor, v: Tensor, pos: Tensor, window: int, by_row: bool = False) -> Tensor:
    """Write k, v (B, nkv, T, hd) at positions pos (B, T) of the buffers (B, nkv, S, hd); q (B, nh, T, hd) attends
    to every buffer position <= its own (and within `window` of it, when window > 0) -> (B, nh, T, hd).
    by_row: each query row by the row-invariant kernel (common.rows_attention), as the model's eager forward does."""
    if pos.shape[0] == 1:
        k_buf.index_copy_(2, pos[0], k)
        v_buf.index_copy_(2, pos[0], v)
    else:  # each row at its own positions
        rows = torch.arange(pos.shape[0])[:, None].expand_as(pos)  # (B, T)
        k_buf[rows, :, pos] = k.transpose(1, 2)  # advanced indices first: (B, T, nkv, hd)
        v_buf[rows, :, pos] = v.transpose(1, 2)
    if by_row:
        b, nh, t, hd = q.shape
        hi = pos.reshape(-1)  # (B T,) each row's own position: its last key
        out = attend_rows(q.transpose(1, 2).reshape(b * t, nh, hd), k_buf, v_buf, torch.arange(b).repeat_interleave(t),
                          first_keys(hi, window), hi)
        return out.view(b, t, nh, hd).transpose(1, 2)
    keys = torch.arange(k_buf.shape[2])  # (S,)
    mask = keys <= pos[:, None, :, None]  # (B, 1, T, S) causal over the whole buffer: later slots are masked out
    if window > 0:
        mask = mask & (keys > pos[:, None, :, None] - window)
    return F.scaled_dot_product_attention(q, k_buf, v_buf, attn_mask=mask, enable_gqa=q.shape[1] != k_buf.shape[1])


def _rotary(att, pos: Tensor, dtype: torch.dtype) -> tuple[Tensor, Tensor]:
    """cos, sin (B, 1, T, rot) at the positions (padding rows past the table read its last entry)."""
    return tuple(tab[pos.clamp(max=tab.shape[0] - 1)][:, None].to(dtype) for tab in att.rotary[0].tables(dtype))


def _gated_attention(att, x: Tensor, k_buf: Tensor, v_buf: Tensor, pos: Tensor, lay: Layout) -> Tensor:
    """models.qwen35.GatedAttention.forward with the positions as a tensor: x (N, H) real rows -> (N, H)."""
    b, t = lay.b, lay.w
    qg, k, v = (lay.grid(y) for y in _proj(x, att.q_proj, att.k_proj, att.v_proj))  # (B, W, .) each
    q, gate = qg.reshape(b, t, att.nh, 2 * att.hd).chunk(2, dim=-1)
    k = k.reshape(b, t, att.nkv, att.hd)
    v = v.reshape(b, t, att.nkv, att.hd).transpose(1, 2)
    cos, sin = _rotary(att, pos, x.dtype)
    rot = att.rotary[0].rot_dim
    q = _rope(att.q_norm(q).transpose(1, 2), cos, sin, rot)  # (B, nh, W, hd)
    k = _rope(att.k_norm(k).transpose(1, 2), cos, sin, rot)
    y = _attend(q, k_buf, v_buf, k, v, pos, 0).transpose(1, 2).reshape(b, t, att.nh * att.hd)
    return att.o_proj(lay.real(y * torch.sigmoid(gate.reshape(b, t, -1))))


def _dense_attention(att, x: Tensor, k_buf: Tensor, v_buf: Tensor, pos: Tensor, lay: Layout) -> Tensor:
    """models.dense.Attention.forward with the positions as a tensor: x (N, H) real rows -> (N, H)."""
    b, t = lay.b, lay.w
    q, k, v = (lay.grid(y) for y in _proj(x, att.q_proj, att.k_proj, att.v_proj))
    q = q.reshape(b, t, att.nh, att.hd)
    k = k.reshape(b, t, att.nkv, att.hd)
    v = v.reshape(b, t, att.nkv, att.hd).transpose(1, 2)
    if att.qk_norm:
        q, k = att.q_norm(q), att.k_norm(k)
    cos, sin = _rotary(att, pos, x.dtype)
    rot = att.rotary[0].rot_dim
    q = _rope(q.transpose(1, 2), cos, sin, rot)
    k = _rope(k.transpose(1, 2), cos, sin, rot)
    y = _attend(q, k_buf, v_buf, k, v, pos, att.window, att.rows)
    return att.o_proj(lay.real(y.transpose(1, 2)))


def _delta_net(dn, x: Tensor, conv_window: Tensor, s0: Tensor, lay: Layout, chunk: bool = False):
    """models.gated_deltanet.GatedDeltaNet.forward: x (N, H) real rows, conv_window (B, C, K-1), s0 (B, nv, dk, dv)
    -> out (N, H), the widened conv window (B, C, K-1+W) and what rebuilds the state after each position:

    - position by position (the recurrent form, unrolled in a compiled graph): the states (W, B, nv, dk, dv);
    - chunk=True and W = 1 (the eager batched forward's plain step): the same step with the state read by two
      matmuls and the delta rule's rank-1 write one baddbmm (demo, plain: 5% faster a step at 8 sequences, 13% at 16);
      the elementwise form, its products written out whole and summed, passed over the state ~12 times;
    - chunk=True and 1 < W <= 64 (the eager batched forward): the window as one exact chunk
      (gated_deltanet.window_delta_rule), a tuple (gc, k, u) (B, nv, W), (B, nv, W, dk), (B, nv, W, dv), a
      fixed number of operations whatever W (the recurrent form's grow with W, for every sequence of the grid)."""
    b, t = lay.b, lay.w
    mixed, z, b_in, a_in = _proj(x, dn.in_proj_qkv, dn.in_proj_z, dn.in_proj_b, dn.in_proj_a)
    mixed, b_in, a_in = lay.grid(mixed).transpose(1, 2), lay.grid(b_in), lay.grid(a_in)  # (B, C, W), (B, W, nv) x 2
    hist = torch.cat([conv_window.to(mixed.dtype), mixed], dim=-1)
    conv = F.silu(causal_conv(hist, dn.conv1d.weight)).transpose(1, 2)  # (B, W, C)
    q, k, v = conv.split([dn.key_dim, dn.key_dim, dn.value_dim], dim=-1)
    r, dt = dn.nv // dn.nk, wide(x.dtype)
    q = q.reshape(b, t, dn.nk, dn.dk).repeat_interleave(r, dim=2).transpose(1, 2).to(dt)  # (B, nv, W, dk)
    k = k.reshape(b, t, dn.nk, dn.dk).repeat_interleave(r, dim=2).transpose(1, 2).to(dt)
    v = v.reshape(b, t, dn.nv, dn.dv).transpose(1, 2).to(dt)  # (B, nv, W, dv)
    q = _l2norm(q) * dn.dk**-0.5
    k = _l2norm(k)
    beta = b_in.to(dt).sigmoid().transpose(1, 2)  # (B, nv, W)
    g = (-dn.A_log.to(dt).exp() * F.softplus(a_in.to(dt) + dn.dt_bias.to(dt))).transpose(1, 2)  # (B, nv, W) log decay
    if chunk and 1 < t <= CHUNK:
        o, gc, u = window_delta_rule(q, k, v, g, beta, s0)  # (B, nv, W, dv)
        o = lay.real(o.transpose(1, 2).to(x.dtype)).view(-1, dn.nv, dn.dv)  # (N, nv, dv)
        return _gated_out(dn, o, z), hist, (gc, k, u)
    if chunk and t == 1:  # one position (a batch's plain step): the state passed over 4 times, not ~12
        s = s0 * g.exp()[..., None]  # (B, nv, dk, dv) decayed
        delta = (v - k @ s) * beta[..., None]  # (B, nv, 1, dv) the correction
        s = torch.baddbmm(s.view(-1, dn.dk, dn.dv), k.reshape(-1, dn.dk, 1), delta.view(-1, 1, dn.dv)).view_as(s0)
        o = lay.real((q @ s).transpose(1, 2).to(x.dtype)).view(-1, dn.nv, dn.dv)  # (N, nv, dv)
        return _gated_out(dn, o, z), hist, s[None]  # (1, B, nv, dk, dv): the state after the position
    decay = g.exp()
    outs, states, s = [], [], s0
    for i in range(t):  # unrolled: T is fixed per compiled graph
        k_i = k[:, :, i, :, None]  # (B, nv, dk, 1)
        s = s * decay[:, :, i, None, None]
        s = s + k_i * ((v[:, :, i] - (k_i * s).sum(-2)) * beta[:, :, i, None]).unsqueeze(-2)
        outs.append((q[:, :, i, :, None] * s).sum(-2))  # (B, nv, dv)
        states.append(s)
    o = lay.real(torch.stack(outs, dim=1).to(x.dtype)).view(-1, dn.nv, dn.dv)  # (N, nv, dv)
    return _gated_out(dn, o, z), hist, torch.stack(states)


def _gated_out(dn, o: Tensor, z: Tensor) -> Tensor:
    """The DeltaNet's read-out o (N, nv, dv) through its gated norm (gate z (N, nv dv)) and output projection -> (N, H)."""
    return dn.out_proj(dn.norm(o, z.view(-1, dn.nv, dn.dv)).reshape(-1, dn.value_dim))


def _mlp(mlp, x: Tensor) -> Tensor:
    """SwiGLU with gate and up in one projection (their weights concatenated: folded into one constant when frozen)."""
    if not isinstance(mlp, SwiGLU):  # a mixture of experts runs as it is
        return mlp(x)
    g, u = _proj(x, mlp.gate_proj, mlp.up_proj)
    return mlp.down_proj(mlp.act(g) * u)


def _check_threads(threads: int) -> None:
    """A Python branch on the thread count: dynamo guards on it, so another count builds its own graph."""
    if threads < 1:
        raise ValueError(f"threads must be >= 1, got {threads}")


def hybrid_forward(model, tokens: Tensor, pos: Tensor, k_bufs: Tensor, v_bufs: Tensor,
                   convs: list[Tensor], states: list[Tensor], threads: int = 1, head: bool = True, rows: Tensor | None = None,
                   chunk: bool = False):
    """HybridLM.forward_tokens as a function of tensors: tokens (B, T), pos (B, T) their positions,
    k_bufs / v_bufs (L_full, B, nkv, S, hd) the KV buffers (written in place), convs (B, C, K-1) / states
    (B, nv, dk, dv) per linear layer; rows (N,): the real rows of the flattened (B, T) grid (None: all).
    Returns logits (N, V) (None when head=False), hidden (N, H), prenorm (N, H) of the real rows, and per
    linear layer the widened conv window (B, C, K-1+T) and T states (T, B, nv, dk, dv) (chunk=True: (gc, k, u), see
    _delta_net). `threads` only keys the graph: compiled kernels keep the thread count they were built with."""
    _check_threads(threads)
    lay = Layout(*tokens.shape, rows)
    x = lay.real(model.embed(tokens))  # (N, H)
    hists, slots = [], []
    for layer in model.model.layers:
        h = layer.input_layernorm(x)
        if layer.layer_type == "linear_attention":
            dn = layer.linear_attn
            o, hist, st = _delta_net(dn, h, convs[dn.slot], states[dn.slot], lay, chunk)
            hists.append(hist)
            slots.append(st)
        else:
            kv = layer.self_attn.kv_index
            o = _gated_attention(layer.self_attn, h, k_bufs[kv], v_bufs[kv], pos, lay)
        x = x + o
        x = x + _mlp(layer.mlp, layer.post_attention_layernorm(x))
    hid = model.model.norm(x)
    return (model.head(hid) if head else None), hid, x, hists, slots


def hybrid_window_forward(model, tokens: Tensor, pos: Tensor, k_bufs: Tensor, v_bufs: Tensor, convs: list[Tensor],
                          states: list[Tensor], threads: int = 1):
    """hybrid_forward with chunk=True: each Gated DeltaNet window as one exact chunk, returning (gc, k, u) per layer (the
    compiled step's form for windows of 2+ positions of a model with large states, compiled.CompiledStep)."""
    return hybrid_forward(model, tokens, pos, k_bufs, v_bufs, convs, states, threads, chunk=True)


def dense_forward(model, tokens: Tensor, pos: Tensor, k_bufs: Tensor, v_bufs: Tensor, threads: int = 1, head: bool = True,
                  rows: Tensor | None = None):
    """DenseLM.forward_tokens as a function of tensors (see hybrid_forward): logits (N, V) or None, hidden, prenorm."""
    _check_threads(threads)
    lay = Layout(*tokens.shape, rows)
    x = lay.real(model.embed(tokens))  # (N, H)
    for i, layer in enumerate(model.model.layers):
        a = _dense_attention(layer.self_attn, layer.input_layernorm(x), k_bufs[i], v_bufs[i], pos, lay)
        if layer.sandwich:  # Gemma 3's norms after attention and around the MLP (dense.Block)
            x = x + layer.post_attention_layernorm(a)
            x = x + layer.post_feedforward_layernorm(_mlp(layer.mlp, layer.pre_feedforward_layernorm(x)))
        else:
            x = x + a
            x = x + _mlp(layer.mlp, layer.post_attention_layernorm(x))
    hid = model.model.norm(x)
    return (model.head(hid) if head else None), hid, x


def draft_module_forward(module, hidden: Tensor, emb: Tensor, k_buf: Tensor, v_buf: Tensor, pos: Tensor, layer: int,
                         threads: int = 1, rows: Tensor | None = None) -> Tensor:
    """MTPModule.forward / EagleModule.forward as a function of tensors: hidden, emb (B, T, H) at positions
    pos (B, T) of its own KV buffers (L, B, nkv, S, hd) -> (B, T, H) (after mtp.norm for an MTP module);
    rows (N,): the real rows of the flattened grid (the others are not computed and come back zero)."""
    _check_threads(threads)
    mtp = hasattr(module, "pre_fc_norm_hidden")
    lay = Layout(*pos.shape, rows)
    hidden, emb = lay.real(hidden), lay.real(emb)  # (N, H)
    if mtp:
        x = module.fc(torch.cat([module.pre_fc_norm_embedding(emb), module.pre_fc_norm_hidden(hidden)], dim=-1))
    else:  # EAGLE: fc([e, h]) with a bias, no norms
        x = module.fc(torch.cat([emb, hidden], dim=-1))
    block = module.layers[layer]
    kv = block.self_attn.kv_index
    x = x + _gated_attention(block.self_attn, block.input_layernorm(x), k_buf[kv], v_buf[kv], pos, lay)
    x = x + _mlp(block.mlp, block.post_attention_layernorm(x))
    return lay.grid(module.norm(x) if mtp else x)  # (B, T, H)


def greedy_draft(target, head, h: Tensor) -> Tensor:
    """h (n, H) draft-module outputs -> (n,) the greedy drafts: the argmax of the target's LM head, or of `head` (a
    DraftHead: the draft vocabulary) mapped back to token ids. Eager (MTPDrafter) and compiled (draft_chain_forward)."""
    return target.head(h).argmax(-1) if head is None else head.token(head.logits(h).argmax(-1))


def draft_chain_forward(module, target, head, h: Tensor, k_buf: Tensor, v_buf: Tensor, pos: Tensor, k: int,
                        threads: int = 1) -> Tensor:
    """A greedy MTP chain as one function: from h (1, H), the module's output at the last pending pair, k drafts,
    each the argmax of the head over the latest output, the first k-1 fed back with their embeddings at positions
    pos, pos+1, .. (pos (1, 1): the position after that pair's), as MTPDrafter.propose does step by step.
    `head`: a DraftHead (draft vocabulary) or None (the target's LM head). -> the k drafted tokens (k,)."""
    drafts = []
    for j in range(k):
        x = greedy_draft(target, head, h)  # (1,)
        drafts.append(x)
        if j + 1 < k:
            h = draft_module_forward(module, h[None], target.embed(x)[None], k_buf, v_buf, pos + j, 0, threads)[0]  # (1, H)
    return torch.cat(drafts)  # (k,)

"""Decode-time MTP / EAGLE module with folded weights: the module's maths in a third of the dispatched ops.

At batch 1 on CPU a draft step is dispatch-bound (the call count, not the arithmetic, sets its cost), so
the drafter runs a folded copy of the module's weights (docs/models.md, "Folded decode copy"):

- RMSNorm as x / hypot(|x|, sqrt(D eps)); its factor sqrt(D) (1 + w) is folded into whatever reads the
  result (the next projection's input columns, the q/k norm scales, the final norm's scale);
- one projection for [q | k | gate | v] (q and k share one norm and one rotary call), one for [gate | up];
- the attention scale 1/sqrt(hd) folded into the q norm's scale;
- rotary as x C + (x P) S with C = [cos, 1], S = [sin, 0] and a signed permutation P (rotate_half);
- a short window (a chained draft step, a catch-up) attends with two small matmuls and a fixed causal block.

Outputs equal the module's up to float rounding, which can change a draft but never the generated text:
verification always runs the target. The copy is rebuilt when any parameter changes (training); other
layouts (MoE layers, biases, bf16) run the module itself. An fp64 module folds in fp64.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from .. import kernels
from ..cache import KVCache, check_room
from ..device import of as device_of, on
from ..errors import ConfigError
from ..weight_cache import weights_version
from .common import RMSNorm, SwiGLU, wide
from .sparse_attention import dense_attend, sparse_attend

SHORT = 16  # catch-up windows up to this long attend with plain matmuls; longer ones (a prompt) through dense_attend


def _unit(x: Tensor, c: Tensor) -> Tensor:
    """x / sqrt(|x|^2 + c^2) over the last dim, c^2 = D eps: RMSNorm up to the factor sqrt(D) (folded elsewhere)."""
    return x / torch.hypot(torch.linalg.vector_norm(x, dim=-1, keepdim=True), c)


def _c(norm: RMSNorm, dim: int, dtype: torch.dtype) -> Tensor:
    """sqrt(D eps): the eps term of `_unit` for this norm."""
    return torch.tensor(math.sqrt(dim * norm.eps), dtype=dtype)


def _scale(norm: RMSNorm, dim: int) -> Tensor:
    """(D,) what multiplies x / |x| in a zero-centred RMSNorm: sqrt(D) (1 + w), in at least fp32."""
    w = norm.weight.detach()
    return math.sqrt(dim) * (1.0 + w.to(wide(w.dtype)))


def _fold(weights: list[Tensor], scale: Tensor | None, dtype: torch.dtype) -> kernels.Product:
    """Stack nn.Linear weights (N_i, K) and scale their input columns: x -> x @ W^T, (K,) -> (sum N_i,), kept in the
    small-row kernel's layout (mtpspec.kernels)."""
    w = torch.cat([x.detach().to(wide(x.dtype)) for x in weights])
    if scale is not None:
        w = w * scale
    return kernels.Product(w.to(dtype))


class FusedAttentionBlock:
    """A full-attention HybridBlock (gated attention + dense SwiGLU) with its norms folded in."""

    def __init__(self, block: nn.Module) -> None:
        att, mlp = block.self_attn, block.mlp
        dtype, h = att.q_proj.weight.dtype, att.q_proj.weight.shape[1]
        nh, nkv, hd = self.nh, self.nkv, self.hd = att.nh, att.nkv, att.hd
        self.kv_index = att.kv_index
        self.c_in, self.c_post = _c(block.input_layernorm, h, dtype), _c(block.post_attention_layernorm, h, dtype)
        self.c_qk = torch.cat([_c(att.q_norm, hd, dtype).expand(nh), _c(att.k_norm, hd, dtype).expand(nkv)])[:, None]  # (nh + nkv, 1)
        qg = att.q_proj.weight.detach().view(nh, 2, hd, h)  # per head [q | gate]
        rows = [qg[:, 0].reshape(nh * hd, h), att.k_proj.weight, qg[:, 1].reshape(nh * hd, h), att.v_proj.weight]
        self.split = [(nh + nkv) * hd, nh * hd, nkv * hd]
        self.sparse = att.sparse  # block-sparse attention: the indexer's projections join the same product
        if self.sparse is not None:
            ix = att.indexer
            rows += [ix.q_proj.weight, ix.k_proj.weight, ix.w_proj.weight]
            self.split += [self.sparse.heads * self.sparse.dim, self.sparse.dim, self.sparse.heads]
        self.qkgv = _fold(rows, _scale(block.input_layernorm, h), dtype)  # H -> (nh + nkv) hd + nh hd + nkv hd [+ indexer]
        # per-head scales of x / |x| for q and k; q's sqrt(hd) cancels the attention's 1 / sqrt(hd)
        self.qk_w = torch.cat([_scale(att.q_norm, hd).expand(nh, hd) / math.sqrt(hd), _scale(att.k_norm, hd).expand(nkv, hd)]).to(dtype)
        self.o = _fold([att.o_proj.weight], None, dtype)  # nh hd -> H
        self.gate_up = _fold([mlp.gate_proj.weight, mlp.up_proj.weight], _scale(block.post_attention_layernorm, h), dtype)
        self.down = _fold([mlp.down_proj.weight], None, dtype)  # I -> H
        rope = att.rotary[0]
        cos, sin = rope.tables(dtype)  # (max_len, rot)
        n, rot = cos.shape[0], rope.rot_dim
        self.cos = torch.cat([cos, cos.new_ones(n, hd - rot)], -1).to(dtype)[:, None]  # (max_len, 1, hd)
        self.sin = torch.cat([sin, sin.new_zeros(n, hd - rot)], -1).to(dtype)[:, None]
        half, idx = rot // 2, torch.arange(rot // 2)
        self.p = torch.zeros(hd, hd, dtype=dtype)  # x @ p = [rotate_half(x[:rot]), 0]
        self.p[idx + half, idx] = -1.0
        self.p[idx, idx + half] = 1.0
        self.future = torch.full((SHORT, SHORT), float("-inf"), dtype=dtype).triu(1)  # (S, S) keys after the query

    def _attend(self, q: Tensor, k: Tensor, v: Tensor, start: int, tree_mask: Tensor | None = None) -> Tensor:
        """q (T, nh, hd) pre-scaled; k, v (nkv, start+T, hd) -> (T, nh hd). Query i sees keys ..start+i, or with
        tree_mask (T, start+T) (a drafter's token tree, tree.TreeRows) the keys it marks."""
        t, nh, nkv, hd = q.shape[0], self.nh, self.nkv, self.hd
        g = nh // nkv  # query heads per kv head, grouped as enable_gqa does
        if tree_mask is not None:  # a tree: SDPA with its mask
            y = F.scaled_dot_product_attention(q.transpose(0, 1), k, v, attn_mask=tree_mask, scale=1.0, enable_gqa=g > 1)
            return y.transpose(0, 1).reshape(t, nh * hd)
        if t > SHORT:  # a long catch-up (the prompt's pairs): causal attention in chunks of rows (a 16k prompt's mask is 256 MB)
            return dense_attend(q, k, v, start, 1.0)
        rows = q.view(t, nkv, g, hd).transpose(0, 1).reshape(nkv, t * g, hd)  # (nkv, T g, hd), row = (position, head)
        w = rows @ k.transpose(1, 2)  # (nkv, T g, start + T)
        if t > 1:  # causal among the new positions (a view of a fixed -inf block, no mask built per call)
            w[:, :, start:] += self.future[:t, :t].repeat_interleave(g, 0)
        return (torch.softmax(w, dim=-1) @ v).view(nkv, t, g, hd).transpose(0, 1).reshape(t, nh * hd)

    def _sparse(self, q: Tensor, k: Tensor, v: Tensor, kv: KVCache, start: int, index: list[Tensor], tree, mode: str) -> Tensor:
        """Block-sparse attention (sparse_attention.py): q (T, nh, hd) pre-scaled; index = the indexer's [q, k, w] rows;
        mode: how the blocks are chosen (ForwardBatch.sparse)."""
        if tree is not None or kv.index is None:
            raise ConfigError("sparse attention needs the model's own MTP cache and runs without token trees")
        iq, ik, iw = index
        state = kv.sparse
        reusing = state is not None and state.reusing(self.kv_index, mode)
        if not reusing:  # a reused step's rows are draft positions, rewritten (and their blocks refreshed) before any read
            kv.index.write(self.kv_index, start, ik)
        if mode == "full":  # this layer's dense attention
            return self._attend(q, k, v, start)
        queries = None if reusing else (iq.unflatten(-1, (self.sparse.heads, self.sparse.dim)), iw)
        return sparse_attend(self.sparse, q, k, v, kv.index, self.kv_index, start, queries, state, 1.0, mode)

    def _qkv(self, x: Tensor, where) -> tuple[Tensor, Tensor, Tensor, list[Tensor]]:
        """x (T, H) at positions `where` (a slice or (T,) index) -> q and k normed and rotated (T, nh + nkv, hd), the
        gate (T, nh hd), v (T, nkv, hd) and the indexer's rows (a sparse layer; else empty)."""
        t, nh, nkv, hd = x.shape[0], self.nh, self.nkv, self.hd
        qk, gate, v, *index = self.qkgv(_unit(x, self.c_in)).split(self.split, -1)
        qk = _unit(qk.view(t, nh + nkv, hd), self.c_qk) * self.qk_w  # (T, nh + nkv, hd) normed q and k
        return qk * self.cos[where] + (qk @ self.p) * self.sin[where], gate, v.view(t, nkv, hd), index

    def _out(self, x: Tensor, y: Tensor, gate: Tensor) -> Tensor:
        """The gated attention output y (T, nh hd) onto x (T, H), then the SwiGLU -> (T, H)."""
        x = x + self.o(y * torch.sigmoid(gate))
        g, u = self.gate_up(_unit(x, self.c_post)).chunk(2, -1)
        return x + self.down(F.silu(g) * u)

    def __call__(self, x: Tensor, kv: KVCache, start: int, tree=None, sparse: str = "recompute") -> Tensor:
        """x (T, H) at positions start.. (a drafter's token tree: rows at their own positions, each seeing its own path)
        -> (T, H); writes this layer's keys and values into kv."""
        t, nh = x.shape[0], self.nh
        qk, gate, v, index = self._qkv(x, slice(start, start + t) if tree is None else tree.positions(start))
        k_all, v_all = _write(kv, self.kv_index, start, qk[:, nh:].transpose(0, 1)[None], v.transpose(0, 1)[None])
        if self.sparse is not None:
            y = self._sparse(qk[:, :nh], k_all[0], v_all[0], kv, start, index, tree, sparse)
        else:
            y = self._attend(qk[:, :nh], k_all[0], v_all[0], start, None if tree is None else tree.attn_mask(start))  # (T, nh hd)
        return self._out(x, y, gate)

    def many(self, x: Tensor, kvs: list[KVCache], starts: list[int], counts: list[int]) -> Tensor:
        """Several sequences' rows at once: x (N, H), counts[i] rows of sequence i (in order) at positions starts[i]..
        of its own cache kvs[i] -> (N, H). The products run once over all N rows; only attention is per sequence
        (each reads its own cache). Chains only: no token trees, no sparse attention."""
        nh = self.nh
        pos = torch.cat([torch.arange(s, s + c) for s, c in zip(starts, counts)])  # (N,) each row's position
        qk, gate, v, _ = self._qkv(x, pos)
        ys, r = [], 0
        for kv, s, c in zip(kvs, starts, counts):
            k_all, v_all = _write(kv, self.kv_index, s, qk[r : r + c, nh:].transpose(0, 1)[None], v[r : r + c].transpose(0, 1)[None])
            ys.append(self._attend(qk[r : r + c, :nh], k_all[0], v_all[0], s))  # (c, nh hd)
            r += c
        return self._out(x, torch.cat(ys), gate)


class FusedMTP:
    """forward(hidden, emb, cache, start, layer) -> (T, H), as MTPModule.forward / EagleModule.forward."""

    def __init__(self, module: nn.Module) -> None:
        self.eagle = not hasattr(module, "pre_fc_norm_hidden")  # EAGLE: fc([e, h]) with bias, no norms
        fc = module.fc.weight
        h = fc.shape[0]
        self.fc_bias = module.fc.bias.detach() if module.fc.bias is not None else None
        if self.eagle:
            self.fc, self.norm_w = _fold([fc], None, fc.dtype), None  # 2H -> H
        else:
            scale = torch.cat([_scale(module.pre_fc_norm_embedding, h), _scale(module.pre_fc_norm_hidden, h)])
            self.fc = _fold([fc], scale, fc.dtype)  # 2H -> H
            self.norm_w = _scale(module.norm, h).to(fc.dtype)
            self.c_pre = torch.stack([_c(module.pre_fc_norm_embedding, h, fc.dtype), _c(module.pre_fc_norm_hidden, h, fc.dtype)])[:, None]  # (2, 1)
            self.c_norm = _c(module.norm, h, fc.dtype)
        self.layers = [FusedAttentionBlock(b) for b in module.layers]

    def _in(self, hidden: Tensor, emb: Tensor) -> Tensor:
        """hidden, emb (T, H) -> the fusion projection's output (T, H)."""
        t, h = hidden.shape
        x = torch.cat([emb, hidden], -1)  # (T, 2H)
        if not self.eagle:  # the two pre-fc norms at once (their scales are folded into fc)
            x = _unit(x.view(t, 2, h), self.c_pre).view(t, 2 * h)
        return self.fc(x, self.fc_bias)

    def _out(self, x: Tensor) -> Tensor:
        return x if self.eagle else _unit(x, self.c_norm) * self.norm_w

    def __call__(self, hidden: Tensor, emb: Tensor, cache: KVCache, start: int, layer: int = 0, tree=None,
                 sparse: str = "recompute") -> Tensor:
        return self._out(self.layers[layer](self._in(hidden, emb), cache, start, tree, sparse))

    def many(self, hidden: Tensor, emb: Tensor, caches: list[KVCache], counts: list[int], layer: int = 0) -> Tensor:
        """__call__ for several sequences' rows (N, H) each (counts[i] rows of sequence i, at its cache's length, in
        order) -> (N, H); advances each cache by its rows. The products run once for all of them."""
        x = self.layers[layer].many(self._in(hidden, emb), caches, [c.length for c in caches], counts)
        for c, n in zip(caches, counts):
            c.advance(n)
        return self._out(x)


def _write(kv: KVCache, layer: int, start: int, k: Tensor, v: Tensor) -> tuple[Tensor, Tensor]:
    """k, v (1, nkv, T, hd) into the cache's layer buffers at start.. -> the keys and values 0..start+T-1."""
    end = start + k.shape[2]
    check_room(end, kv.max_len, "draft module")
    kb, vb = kv.buffers(layer)  # (1, nkv, max_len, hd)
    kb[:, :, start:end], vb[:, :, start:end] = k, v
    return kb[:, :, :end], vb[:, :, :end]


def _foldable(module: nn.Module) -> bool:
    """fp32 (or fp64) full-attention layers with a dense, bias-free SwiGLU and bias-free projections (what
    folding assumes; in bf16 the module's norms compute in fp32, which folded weights would not keep)."""
    if module.fc.weight.dtype not in (torch.float32, torch.float64):
        return False
    for block in module.layers:
        att, mlp = getattr(block, "self_attn", None), block.mlp
        if att is None or hasattr(block, "sandwich"):  # a dense layer (a head for a dense target) runs as it is
            return False
        if type(mlp) is not SwiGLU or any(lin.bias is not None for lin in (
            att.q_proj, att.k_proj, att.v_proj, att.o_proj, mlp.gate_proj, mlp.up_proj, mlp.down_proj,
        )):
            return False
    return True


def fused_mtp(module: nn.Module) -> FusedMTP | None:
    """The folded copy of an MTP / EAGLE module (kept as its `folded`), or None when its layout is not foldable."""
    if not _foldable(module):
        return None
    key = weights_version(module.parameters())
    cached = module.folded
    if cached is None or cached[0] != key:
        with torch.no_grad(), on(device_of(module)):  # its tables beside the module's weights (mtpspec.device)
            cached = module.folded = (key, FusedMTP(module))
    return cached[1]

"""Attention, in one place: rotary embedding, the KV write, and causal / sliding-window / token-tree attention.

Every forward (models/forward.py) calls `attend` with its ForwardBatch, which says where each row sits:

- one sequence at `fb.start` (eager decoding, verification, prefill, training windows): the keys the first row cannot
  see are not read, a one-row step needs no mask;
- positions as tensors only (a batch of sequences, a compiled graph): the buffer is read under a mask built from the
  positions, so no Python branch depends on a position;
- a token tree (one sequence): row i sees the committed keys and its own ancestors in the window;
- `by_row` (block-quantized models): each query row alone by the row-invariant kernel (kernels/attention.cpp), keys
  visited in index order, so a verify row is bitwise the plain step at its position.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F
from torch import Tensor

from ..kernels import rownorm
from ..kernels.attention import attend_rows, available as kernels_available
from .batch import ForwardBatch

SHORT_ATTENTION = 64  # query rows up to which bf16 attention is computed in fp32 (_attention_fp32: a decode or verify window)


def rope(x: Tensor, cos: Tensor, sin: Tensor, rot: int) -> Tensor:
    """x (B, nh, T, hd), cos / sin (B, 1, T, rot) at the rows' positions -> x rotated on its first rot dims (half-split)."""
    xr, xp = x[..., :rot], x[..., rot:]
    half = rot // 2
    rotated = torch.cat([-xr[..., half:], xr[..., :half]], dim=-1)
    return torch.cat([xr * cos + rotated * sin, xp], dim=-1)


def norm_rope(x: Tensor, norm, cos: Tensor, sin: Tensor) -> Tensor:
    """x (N, h, hd) fp32 -> each head normed by `norm` (a row-kernel RMSNorm, or None) and rotated on its first rot dims
    by its row's cos / sin (N, rot): bitwise the norm then rope, in one call where the kernel is built."""
    if x.device.type == "cpu" and x.stride(-1) == 1 and rownorm.available():
        w, eps, zc = (None, 0.0, False) if norm is None else (norm.weight, norm.eps, norm.zero_centred)
        return torch.ops.mtpspec_rownorm.norm_rope(x, w, eps, zc, cos, sin)
    y = x if norm is None else norm(x)
    return rope(y.transpose(0, 1), cos, sin, cos.shape[-1]).transpose(0, 1)  # (N, h, hd)


def rotary_at(rotary, fb: ForwardBatch, dtype: torch.dtype) -> tuple[Tensor, Tensor]:
    """cos, sin (B, 1, T, rot) of a Rotary's tables at the rows' positions (padding rows past the table read its last).
    The tables grow to the positions the rows reach: known from `start` or `runs`; positions as tensors only (a
    compiled graph) read the whole tables."""
    if fb.start is not None and fb.tree is None:  # one sequence in order: a slice, no gather
        t = fb.pos.shape[1]
        cos, sin = rotary.tables(dtype, fb.start + t)
        return cos[fb.start : fb.start + t].to(dtype)[None, None], sin[fb.start : fb.start + t].to(dtype)[None, None]
    reach = fb.start if fb.start is not None else max(s for s, _ in fb.runs) if fb.runs else None
    cos, sin = rotary.tables(dtype, None if reach is None else reach + fb.w)  # a tree's rows sit below start + W
    pos = fb.pos.clamp(max=cos.shape[0] - 1)
    return cos[pos][:, None].to(dtype), sin[pos][:, None].to(dtype)


@dataclass(frozen=True)
class RowPlan:
    """What every attention layer shares in a forward on the row kernels (a block-quantized model's plain step, chain or
    tree verify, prefill of one sequence, or a batch of sequences' chains), made once per forward, the real rows flat:
    each row's sequence, buffer slot and last key, each rotary's cos / sin rows, each window's first keys or, for a
    token tree, its mask (filled by the first layer that asks)."""

    fb: ForwardBatch
    seq: Tensor  # (N,) each row's sequence
    slot: Tensor  # (N,) each row's buffer index
    hi: Tensor  # (N,) each row's last key: its position in order, its own slot in a tree (ancestors sit below it)
    lo: dict = field(default_factory=dict)  # window -> (N,) first keys
    masks: dict = field(default_factory=dict)  # window -> (N, start + N) a tree's keys per row (tree_mask)
    tables: dict = field(default_factory=dict)  # id(Rotary) -> (cos, sin) (N, rot)

    @staticmethod
    def of(fb: ForwardBatch) -> "RowPlan | None":
        """The plan of one sequence's rows (in order or a tree) or of a batch of chains; None for a batch with trees
        or a compiled graph's span (the grid path)."""
        if fb.start is not None:
            slot = fb.start + torch.arange(fb.w)
            return RowPlan(fb, torch.zeros_like(slot), slot, fb.pos[0] if fb.tree is None else slot)
        if fb.trees is not None or fb.slots is not None or fb.keys is not None:
            return None
        pos = fb.real(fb.pos)[:, 0]  # (N,) a chain's rows sit at their positions
        return RowPlan(fb, fb.real(torch.arange(fb.b)[:, None].expand(fb.b, fb.w))[:, 0], pos, pos)

    def rotary(self, rotary, dtype: torch.dtype) -> tuple[Tensor, Tensor]:
        got = self.tables.get(id(rotary))
        if got is None:
            cos, sin = rotary_at(rotary, self.fb, dtype)  # (B, 1, W, rot)
            got = self.tables[id(rotary)] = (self.fb.real(cos[:, 0]), self.fb.real(sin[:, 0]))
        return got

    def first_keys(self, window: int) -> Tensor:
        """(N,) each row's oldest visible key under a sliding window (0: none; a tree's mask holds its window), made
        once per window."""
        lo = self.lo.get(window)
        if lo is None:
            lo = self.lo[window] = first_keys(self.hi, window) if self.fb.tree is None else torch.zeros_like(self.hi)
        return lo

    def mask(self, window: int) -> Tensor | None:
        """A tree's (N, start + N) keys per row under `window`, made once per window; None in order (lo..hi)."""
        if self.fb.tree is None:
            return None
        m = self.masks.get(window)
        if m is None:
            m = self.masks[window] = tree_mask(self.fb, window)
        return m

    def write_attend(self, q: Tensor, k: Tensor, v: Tensor, k_buf: Tensor, v_buf: Tensor, window: int) -> Tensor:
        """Store k, v (N, nkv, hd) at the rows' slots of the buffers (B, nkv, S, hd) and attend q (N, nh, hd) by the
        row kernel -> (N, nh, hd): bitwise `write` then `attend(by_row=True)`, without the (B, nh, W, hd) grid."""
        k_buf[self.seq, :, self.slot] = k
        v_buf[self.seq, :, self.slot] = v
        return attend_rows(q, k_buf, v_buf, self.seq, self.first_keys(window), self.hi, self.mask(window))


def first_keys(pos: Tensor, window: int) -> Tensor:
    """The oldest key each query at positions `pos` sees: pos - window + 1 with a sliding window (transformers'
    sliding_window), else 0."""
    return (pos - window + 1).clamp(min=0) if window > 0 else torch.zeros_like(pos)


def write(k_buf: Tensor | None, v_buf: Tensor | None, k: Tensor, v: Tensor, fb: ForwardBatch) -> tuple[Tensor, Tensor]:
    """Store k, v (B, nkv, T, hd) at the rows' positions of the buffers (B, nkv, S, hd) -> the keys and values the rows
    read: [0, start + T) of one sequence's buffer, the whole buffer otherwise. No buffer (training): k, v themselves."""
    if k_buf is None:
        return k, v
    if fb.start is not None:
        end = fb.start + k.shape[2]
        k_buf[:, :, fb.start : end] = k
        v_buf[:, :, fb.start : end] = v
        return k_buf[:, :, :end], v_buf[:, :, :end]
    pos = fb.pos if fb.slots is None else fb.slots  # (B, T) buffer indices
    if pos.shape[0] == 1 and torch.compiler.is_compiling() and k_buf.device.type == "cpu" and kernels_available():
        # in place: an ATen write to these views of the graph's cache input would copy the span (kernels/attention.cpp)
        torch.ops.mtpspec_attention.write_rows(k_buf, v_buf, pos[0], k, v)
    elif pos.shape[0] == 1:
        k_buf.index_copy_(2, pos[0], k)
        v_buf.index_copy_(2, pos[0], v)
    else:  # each sequence at its own positions
        rows = torch.arange(pos.shape[0])[:, None].expand_as(pos)  # (B, T)
        k_buf[rows, :, pos] = k.transpose(1, 2)  # advanced indices first: (B, T, nkv, hd)
        v_buf[rows, :, pos] = v.transpose(1, 2)
    if fb.keys is not None:  # a compiled graph's span: the first S positions
        return k_buf[:, :, : fb.keys.shape[0]], v_buf[:, :, : fb.keys.shape[0]]
    return k_buf, v_buf


def attend(q: Tensor, keys: Tensor, vals: Tensor, fb: ForwardBatch, window: int = 0, by_row: bool = False,
           scale: float | None = None) -> Tensor:
    """q (B, nh, T, hd) at the rows' positions, keys / vals (B, nkv, S, hd) from `write` -> (B, nh, T, hd).

    A query at position p sees keys 0..p (p - window + 1..p with a sliding window); query head h reads KV head
    h // (nh / nkv)."""
    b, nh, t, hd = q.shape
    if by_row:
        return _by_row(q, keys, vals, fb, window)
    gqa = nh != keys.shape[1]
    if fb.tree is not None:
        return F.scaled_dot_product_attention(q, keys, vals, attn_mask=tree_mask(fb, window), enable_gqa=gqa, scale=scale)
    if fb.anc is not None:  # B sequences' trees
        return F.scaled_dot_product_attention(q, keys, vals, attn_mask=trees_mask(fb, keys.shape[2], window)[:, None],
                                              enable_gqa=gqa, scale=scale)
    if fb.start is None:  # positions as tensors: the whole buffer under a mask
        idx = torch.arange(keys.shape[2])  # (S,)
        pos = fb.pos[:, None, :, None]  # (B, 1, T, 1)
        mask = idx <= pos  # (B, 1, T, S)
        if window > 0:
            mask = mask & (idx > pos - window)
        return F.scaled_dot_product_attention(q, keys, vals, attn_mask=mask, enable_gqa=gqa, scale=scale)
    start, s = fb.start, keys.shape[2]
    lo = max(0, start - window + 1) if window > 0 else 0  # keys older than the first query's window are seen by none
    if lo:
        keys, vals = keys[:, :, lo:], vals[:, :, lo:]  # (B, nkv, S - lo, hd)
    mask = None
    if t > 1:
        mask = torch.ones(t, s - lo, dtype=torch.bool).tril(diagonal=start - lo)  # (T, S - lo): causal
        if window > 0:
            mask &= torch.ones(t, s - lo, dtype=torch.bool).triu(diagonal=start - lo - window + 1)
    if q.dtype in (torch.bfloat16, torch.float16) and q.device.type == "cpu" and t <= SHORT_ATTENTION and scale is None:
        return _attention_fp32(q, keys, vals, mask)
    return F.scaled_dot_product_attention(q, keys, vals, attn_mask=mask, enable_gqa=gqa, scale=scale)


def tree_mask(fb: ForwardBatch, window: int) -> Tensor:
    """(T, S) which keys each row of a token tree sees: the committed ones and its ancestors (within the window)."""
    start, tree = fb.start, fb.tree
    mask = tree.attn_mask(start)  # (T, S)
    if window > 0:
        pos = tree.positions(start)  # (T,)
        mask = mask & ((pos[:, None] - torch.cat([torch.arange(start), pos])[None, :]) < window)
    return mask


def trees_mask(fb: ForwardBatch, s: int, window: int) -> Tensor:
    """(B, W, S) which of the first S buffer slots each row of B sequences' trees sees: the slots before the
    sequence's first row, then its ancestors (within the window, by position)."""
    b, w = fb.pos.shape
    start = fb.slots[:, :1]  # (B, 1) each sequence's first slot
    rel = torch.arange(s)[None, :] - start  # (B, S) a slot's row in its sequence's window (< 0: committed)
    inside = (rel >= 0) & (rel < w)
    row = rel.clamp(0, w - 1)
    mask = (rel < 0)[:, None, :] | (fb.anc.gather(2, row[:, None, :].expand(b, w, s)) & inside[:, None, :])
    if window > 0:
        key_pos = torch.where(inside, fb.pos.gather(1, row), torch.arange(s)[None, :])  # (B, S)
        mask = mask & ((fb.pos[:, :, None] - key_pos[:, None, :]) < window)
    return mask


def _by_row(q: Tensor, keys: Tensor, vals: Tensor, fb: ForwardBatch, window: int) -> Tensor:
    """attend with each query row alone (kernels.attention), fp32: bitwise the one-row step's output at its position."""
    b, nh, t, hd = q.shape
    rows = q.transpose(1, 2).reshape(b * t, nh, hd)  # (B T, nh, hd)
    seq = torch.arange(b).repeat_interleave(t)  # (B T,)
    if fb.tree is not None:
        hi = fb.start + torch.arange(t)  # a tree row's keys are masked, up to its own slot
        out = attend_rows(rows, keys, vals, seq, torch.zeros(t, dtype=torch.long), hi, tree_mask(fb, window))
    elif fb.anc is not None:
        hi = fb.slots.reshape(-1)  # (B T,)
        mask = trees_mask(fb, keys.shape[2], window).reshape(b * t, -1)
        out = attend_rows(rows, keys, vals, seq, torch.zeros_like(hi), hi, mask)
    else:
        hi = fb.pos.reshape(-1)  # (B T,) each row's own position: its last key
        out = attend_rows(rows, keys, vals, seq, first_keys(hi, window), hi)
    return out.view(b, t, nh, hd).transpose(1, 2)


def _attention_fp32(q: Tensor, k: Tensor, v: Tensor, mask: Tensor | None) -> Tensor:
    """softmax(q k^T / sqrt(hd)) v in fp32 for bf16 / fp16 q, k, v (B, nh | n_kv, ., hd) -> (B, nh, T, hd) in q's dtype.

    For a few query rows torch's CPU SDPA in bf16 is several times slower than these three products in fp32; SDPA
    accumulates in fp32 too, so the two differ by rounding. Query heads share key heads as enable_gqa does."""
    b, nh, t, hd = q.shape
    nkv = k.shape[1]
    g = nh // nkv
    rows = q.float().reshape(b, nkv, g * t, hd)  # (B, n_kv, g T, hd): head h = kv * g + j, rows ordered (j, t)
    w = (rows @ k.float().transpose(-1, -2)) * hd**-0.5  # (B, n_kv, g T, S)
    if mask is not None:
        w = w.masked_fill(~mask.repeat(g, 1), float("-inf"))
    return (torch.softmax(w, dim=-1) @ v.float()).view(b, nh, t, hd).to(q.dtype)


def scale_inv_freq(inv_freq: Tensor, scaling: dict | None) -> Tensor:
    """Rotary inverse frequencies (rot/2,) rescaled for long context, as config.json's rope_parameters say.

    linear: every frequency divided by `factor`. llama3 (Llama 3.1+): wavelengths longer than
    original_max_position_embeddings / low_freq_factor are stretched by `factor`, shorter than
    original / high_freq_factor kept, and those between interpolated linearly in original / wavelength.
    """
    kind = (scaling or {}).get("rope_type", "default")
    if kind == "default":
        return inv_freq
    if kind == "linear":
        return inv_freq / scaling["factor"]
    if kind != "llama3":
        raise ValueError(f"rope type {kind!r} is not implemented")
    factor, low, high = scaling["factor"], scaling["low_freq_factor"], scaling["high_freq_factor"]
    original = scaling["original_max_position_embeddings"]
    wavelen = 2 * math.pi / inv_freq
    stretched = torch.where(wavelen > original / low, inv_freq / factor, inv_freq)
    smooth = (original / wavelen - low) / (high - low)  # 0 at the long end of the band, 1 at the short end
    blended = (1 - smooth) * stretched / factor + smooth * stretched
    between = (wavelen >= original / high) & (wavelen <= original / low)
    return torch.where(between, blended, stretched)

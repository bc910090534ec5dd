"""Block-sparse attention with a learned indexer (QSA / DSA style), for the MTP layer and full-attention layers.

Each query attends to a local window of the last `window` positions plus the `top_k` blocks of `block`
earlier tokens that a light indexer scores highest:

- the indexer keeps one small key per token (k_proj, `dim` wide); a block's key is the mean of its
  `block` token keys (kept up to date on every write, so rollback needs nothing: IndexKeys);
- a query row has `heads` indexer queries and weights; the score of block b is
  sum_j w_j relu(q_j . K_b) / sqrt(dim) (block_scores);
- the candidates of a query at position p are the blocks that start before its window
  (b * block <= p - window); they are complete, since window >= block. The top_k are attended,
  with the window (select_blocks, attend_gathered). Tokens of a chosen block that lie in the window
  are counted once.

With at most top_k candidates every earlier token is attended: sparse equals full attention (up to
rounding), so short contexts lose nothing.

**Selection reuse** (SparseState, docs/sparse-mtp.md): the drafter runs the indexer once per round, on
the last *accepted* token's row (never a row of a rejected branch), and the chained steps reuse its
blocks with its window start, so a token that leaves a later step's window is still seen.

A decode or verify pass (T <= GATHER_ROWS rows) gathers each row's chosen blocks: a plain step and a
verify row compute the same function over the same keys. Longer passes (a prompt) run masked
attention over the whole cache in chunks.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass, field

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from ..errors import ConfigError
from .common import Linear

GATHER_ROWS = 32  # passes up to this many rows gather their keys; longer ones (a prompt) use a mask
MASK_CHUNK = 256  # rows per masked chunk of a long pass
REUSE_REACH = 64  # a reused selection serves steps at most this far past its anchor


@dataclass(frozen=True)
class SparseAttentionConfig:
    block: int = 4  # r: tokens per compressed block
    top_k: int = 512  # blocks attended per query (512 x 4 = 2,048 tokens, as Qwen's QSA)
    window: int = 128  # the last `window` positions are always attended (>= block)
    heads: int = 4  # indexer heads
    dim: int = 32  # indexer key / query width

    def __post_init__(self) -> None:
        for name in ("block", "top_k", "window", "heads", "dim"):
            v = getattr(self, name)
            if not isinstance(v, int) or isinstance(v, bool) or v < 1:
                raise ConfigError(f"sparse attention: {name} must be a positive integer, got {v!r}")
        if self.window < self.block:
            raise ConfigError(f"sparse attention: window ({self.window}) must be at least one block ({self.block})")

    @classmethod
    def parse(cls, value) -> "SparseAttentionConfig | None":
        """None, a SparseAttentionConfig, or its dict (a checkpoint's config) -> the config."""
        if value is None or isinstance(value, cls):
            return value
        if not isinstance(value, dict):
            raise ConfigError(f"sparse attention config must be a mapping, got {type(value).__name__}")
        unknown = sorted(set(value) - {f for f in cls.__dataclass_fields__})
        if unknown:
            raise ConfigError(f"sparse attention: unknown field(s) {', '.join(unknown)} (known: {', '.join(cls.__dataclass_fields__)})")
        return cls(**value)

    def to_dict(self) -> dict:
        return asdict(self)


class Indexer(nn.Module):
    """The light scorer: from a layer's normed input x (T, H), token keys (T, dim), queries (T, heads, dim), weights (T, heads)."""

    def __init__(self, hidden: int, cfg: SparseAttentionConfig) -> None:
        super().__init__()
        self.cfg = cfg
        self.q_proj = Linear(hidden, cfg.heads * cfg.dim, bias=False)
        self.k_proj = Linear(hidden, cfg.dim, bias=False)
        self.w_proj = Linear(hidden, cfg.heads, bias=False)

    def keys(self, x: Tensor) -> Tensor:
        return self.k_proj(x)  # (..., dim)

    def queries(self, x: Tensor) -> tuple[Tensor, Tensor]:
        q = self.q_proj(x).unflatten(-1, (self.cfg.heads, self.cfg.dim))  # (..., heads, dim)
        return q, self.w_proj(x)  # (..., heads)


def block_scores(q: Tensor, w: Tensor, bk: Tensor) -> Tensor:
    """q (T, heads, dim), w (T, heads), block keys bk (nb, dim) -> scores (T, nb)."""
    s = torch.relu(q @ bk.t())  # (T, heads, nb)
    return (w[..., None] * s).sum(1) / math.sqrt(q.shape[-1])


def candidates(pos: Tensor, nb: int, cfg: SparseAttentionConfig) -> Tensor:
    """pos (T,) -> (T, nb) bool: block b is a candidate of the query at pos when it starts before its window."""
    starts = torch.arange(nb) * cfg.block  # (nb,)
    return starts[None, :] <= (pos[:, None] - cfg.window)


def select_blocks(scores: Tensor, pos: Tensor, cfg: SparseAttentionConfig) -> tuple[Tensor, Tensor]:
    """scores (T, nb), pos (T,) -> blocks (T, k) and ok (T, k): the top_k candidates (k = min(top_k, nb)); ok is
    False where a row has fewer candidates than k."""
    nb = scores.shape[1]
    k = min(cfg.top_k, nb)
    if k == 0:
        return torch.zeros(scores.shape[0], 0, dtype=torch.long), torch.zeros(scores.shape[0], 0, dtype=torch.bool)
    cand = candidates(pos, nb, cfg)  # (T, nb)
    masked = scores.masked_fill(~cand, float("-inf"))
    # ties (relu gives many exact zeros) go to the earlier blocks whatever nb is, so a row chooses the same blocks in
    # a plain step and inside a verify pass: every block above the k-th largest score, then the earliest at it
    thr = masked.topk(k, dim=-1).values[:, -1:]  # (T, 1) the k-th largest
    above, at = masked > thr, masked == thr  # (T, nb)
    chosen = above | (at & (at.cumsum(-1) <= k - above.sum(-1, keepdim=True)))  # (T, nb), k per row
    blocks = chosen.nonzero()[:, 1].view(-1, k)  # (T, k) in block order
    return blocks, masked.gather(1, blocks) > float("-inf")


def attend_gathered(q: Tensor, k: Tensor, v: Tensor, blocks: Tensor, ok: Tensor, pos: Tensor, lo: Tensor,
                    cfg: SparseAttentionConfig, scale: float, scratch: "IndexKeys") -> Tensor:
    """A short pass: q (T, nh, hd), k / v (nkv, S, hd) the cache, blocks / ok (T, k), rows at pos (T,) with windows
    starting at lo (T,) -> (T, nh * hd).

    Each row's chosen blocks are gathered whole (r * hd contiguous values each, into buffers kept on `scratch`: a
    fresh megabyte per call would cost page faults); the windows are one slice shared by the rows, masked per row.
    A chosen block's tokens inside the row's window count once (the window's)."""
    t, nh, hd = q.shape
    nkv, r, kb = k.shape[0], cfg.block, blocks.shape[1]
    g = nh // nkv
    rows = q.view(t, nkv, g, hd).transpose(0, 1)  # (nkv, T, g, hd)
    a, b = max(int(lo.min()), 0), int(pos.max()) + 1
    kw, vw = k[:, a:b], v[:, a:b]  # (nkv, Wn, hd) the rows' windows
    keys = torch.arange(a, b)
    masks = [(keys[None] >= lo[:, None]) & (keys[None] <= pos[:, None])]  # (T, Wn)
    scores = [(rows.reshape(nkv, t * g, hd) @ kw.transpose(1, 2)).view(nkv, t, g, b - a)]  # (nkv, T, g, Wn)
    if kb:
        flat = blocks.reshape(-1)  # (T k,)
        grad = torch.is_grad_enabled() and (k.requires_grad or q.requires_grad)  # autograd: no out= buffers
        kg, vg = (None, None) if grad else scratch.buffers((nkv, t * kb, r * hd), k.dtype)
        kg, vg = gather_blocks(k, flat, r, kg), gather_blocks(v, flat, r, vg)
        kg, vg = kg.view(nkv, t, kb * r, hd), vg.view(nkv, t, kb * r, hd)
        tok = (blocks[..., None] * r + torch.arange(r)).flatten(1)  # (T, k r) their positions
        masks.insert(0, ok.repeat_interleave(r, dim=1) & (tok < lo[:, None]))
        scores.insert(0, rows @ kg.transpose(-1, -2))  # (nkv, T, g, k r)
    w = torch.cat(scores, dim=-1) * scale  # (nkv, T, g, k r + Wn)
    w = w.masked_fill(~torch.cat(masks, dim=1)[None, :, None, :], float("-inf"))
    p = torch.softmax(w, dim=-1)
    y = (p[..., -(b - a):].reshape(nkv, t * g, b - a) @ vw).view(nkv, t, g, hd)  # (nkv, T, g, hd)
    if kb:
        y = y + p[..., : kb * r] @ vg
    return y.transpose(0, 1).reshape(t, nh * hd)


def attention_mask(blocks: Tensor, ok: Tensor, pos: Tensor, lo: Tensor, s: int, cfg: SparseAttentionConfig) -> Tensor:
    """The key sets attend_gathered reads, as a (T, s) bool mask over cache positions 0..s-1."""
    t = blocks.shape[0]
    nb = -(-s // cfg.block)
    chosen = torch.zeros(t, nb + 1, dtype=torch.bool)
    chosen.scatter_(1, torch.where(ok, blocks, nb), True)  # rejected picks land in the spare column nb
    keys = torch.arange(s)
    in_blocks = chosen[:, :nb].repeat_interleave(cfg.block, dim=1)[:, :s] & (keys[None] < lo[:, None])
    in_window = (keys[None] >= lo[:, None]) & (keys[None] <= pos[:, None])
    return in_blocks | in_window


def chunked_sdpa(q: Tensor, k: Tensor, v: Tensor, start: int, scale: float, mask_for) -> Tensor:
    """A long pass (a prompt) at positions start..: q (T, nh, hd), k / v (nkv, S, hd) -> (T, nh * hd), SDPA in chunks of
    MASK_CHUNK rows; mask_for(a, b, end) gives rows a..b-1's (b - a, end) bool mask over keys 0..end-1."""
    t, nh, hd = q.shape
    out = []
    for a in range(0, t, MASK_CHUNK):
        b = min(a + MASK_CHUNK, t)
        end = start + b  # keys after the chunk's last row are seen by none of its rows
        y = F.scaled_dot_product_attention(q[a:b].transpose(0, 1), k[:, :end], v[:, :end], attn_mask=mask_for(a, b, end),
                                           scale=scale, enable_gqa=nh != k.shape[0])  # (nh, Tc, hd)
        out.append(y.transpose(0, 1).reshape(b - a, nh * hd))
    return torch.cat(out)


def attend_masked(q: Tensor, k: Tensor, v: Tensor, blocks: Tensor, ok: Tensor, pos: Tensor, lo: Tensor,
                  cfg: SparseAttentionConfig, scale: float) -> Tensor:
    """A long pass (a prompt): q (T, nh, hd), k / v (nkv, S, hd) -> (T, nh * hd), the chosen key sets as masks."""
    return chunked_sdpa(q, k, v, int(pos[0]), scale,
                        lambda a, b, end: attention_mask(blocks[a:b], ok[a:b], pos[a:b], lo[a:b], end, cfg))


def gather_blocks(k: Tensor, blocks: Tensor, r: int, out: Tensor | None = None) -> Tensor:
    """k (nkv, S, hd) the cache -> (nkv, n, r * hd): the blocks of r tokens numbered `blocks` (n,), whole. One head at a
    time: a cache view is strided across heads, and index_select over it would copy the whole cache first."""
    nkv, s, hd = k.shape
    whole = k[:, : s // r * r].view(nkv, s // r, r * hd)
    if out is None:
        return torch.stack([whole[h].index_select(0, blocks) for h in range(nkv)])
    for h in range(nkv):
        torch.index_select(whole[h], 0, blocks, out=out[h])
    return out


class IndexKeys:
    """The indexer's per-token keys and their block means, position-indexed like the KV cache beside it.

    A write recomputes the means of the blocks it touches, so after a rollback (the KV cache's pointer moves
    back) the next write overwrites the stale positions and refreshes their blocks: the complete blocks a query
    may choose always hold the current tokens' keys."""

    def __init__(self, n_layers: int, max_len: int, cfg: SparseAttentionConfig, dtype: torch.dtype) -> None:
        self.cfg = cfg
        nb = -(-max_len // cfg.block)
        self.keys = torch.zeros(n_layers, nb * cfg.block, cfg.dim, dtype=dtype)  # (L, max_len rounded up, dim)
        self.blocks = torch.zeros(n_layers, nb, cfg.dim, dtype=dtype)  # (L, nb, dim)
        self._scratch: dict = {}  # (use, shape, dtype) -> (keys, values): gather buffers

    def write(self, layer: int, start: int, keys: Tensor) -> None:
        """keys (T, dim) at positions start.."""
        r, end = self.cfg.block, start + keys.shape[0]
        self.keys[layer, start:end] = keys
        a, b = start // r, -(-end // r)  # the blocks touched
        self.blocks[layer, a:b] = self.keys[layer, a * r : b * r].view(b - a, r, -1).mean(1)

    def buffers(self, shape: tuple[int, ...], dtype: torch.dtype, use: str = "rows") -> tuple[Tensor, Tensor]:
        """Two scratch tensors of `shape` for gathered keys and values, kept per use and shape (a few shapes recur:
        one per verify width)."""
        key = (use, shape, dtype)
        if key not in self._scratch:
            if len(self._scratch) >= 8:
                self._scratch.clear()
            self._scratch[key] = (torch.empty(shape, dtype=dtype), torch.empty(shape, dtype=dtype))
        return self._scratch[key]

    def complete(self, layer: int, length: int) -> Tensor:
        """(nb, dim): the blocks entirely below `length`."""
        return self.blocks[layer, : length // self.cfg.block]


@dataclass
class Selection:
    """One row's chosen blocks, kept for reuse by later rows of the same round."""

    blocks: Tensor  # (k,) block ids
    ok: Tensor  # (k,) bool
    anchor: int  # the position of the row it was computed for
    dense: bool = False  # the row had at most top_k candidates: it attended everything (and so do its reusers)
    keys: tuple[Tensor, Tensor, int, int] | None = None  # (kb, vb (nkv, cap, hd), n kept tokens, window copied up to)


SELECTIONS = ("recompute", "record", "reuse", "full")  # ForwardBatch.sparse: how a pass's sparse layers choose blocks


@dataclass
class SparseState:
    """A cache's kept block selections (per layer), recorded by one pass for later passes to reuse.

    How a pass chooses its blocks is the pass's own (ForwardBatch.sparse): 'recompute' (the indexer on every row),
    'record' (recompute, and keep the pass's last row's selection per layer here), 'reuse' (the kept selection, no
    indexer), or 'full' (no choice: dense causal attention over every key, the same weights without sparsity)."""

    kept: dict[int, Selection] = field(default_factory=dict)

    def reusing(self, layer: int, mode: str) -> bool:
        return mode == "reuse" and layer in self.kept


def sparse_attend(cfg: SparseAttentionConfig, q: Tensor, k: Tensor, v: Tensor, index: IndexKeys, layer: int, start: int,
                  queries: tuple[Tensor, Tensor] | None, state: SparseState | None, scale: float, mode: str = "recompute") -> Tensor:
    """Attention of rows at positions start..start+T-1 over the cache's keys (already written, with the indexer keys).

    q (T, nh, hd); k, v (nkv, S >= start+T, hd); queries: the indexer's (q (T, heads, dim), w (T, heads)), None when
    the state reuses a kept selection. -> (T, nh * hd)."""
    t = q.shape[0]
    pos = torch.arange(start, start + t)  # (T,)
    if state is not None and state.reusing(layer, mode):
        kept = state.kept[layer]
        reach = t + start - 1 - kept.anchor  # how far the last row lies past the anchor
        if reach < 0 or reach > REUSE_REACH:
            raise ValueError(f"a reused selection (anchor {kept.anchor}) cannot serve positions {start}..{start + t - 1}")
        if kept.dense:
            return dense_attend(q, k, v, start, scale)
        return attend_reused(q, k, v, kept, pos, cfg, scale, index, layer)
    last = start + t - 1
    if (last - cfg.window) // cfg.block + 1 <= cfg.top_k:  # no row has more than top_k candidates: all are chosen
        if state is not None and mode == "record":
            state.kept[layer] = Selection(torch.zeros(0, dtype=torch.long), torch.zeros(0, dtype=torch.bool), last, dense=True)
        return dense_attend(q, k, v, start, scale)
    iq, iw = queries
    bk = index.complete(layer, start + t)  # (nb, dim)
    blocks, ok = select_blocks(block_scores(iq, iw, bk), pos, cfg)  # (T, k)
    lo = pos - cfg.window + 1
    if t <= GATHER_ROWS:
        y = attend_gathered(q, k, v, blocks, ok, pos, lo, cfg, scale, index)
    else:
        y = attend_masked(q, k, v, blocks, ok, pos, lo, cfg, scale)
    if state is not None and mode == "record":  # keep the last row's blocks, gathered now while they are warm
        state.kept[layer] = Selection(blocks[-1].clone(), ok[-1].clone(), last)
        keep_keys(k, v, state.kept[layer], cfg, index, layer)
    return y


def dense_attend(q: Tensor, k: Tensor, v: Tensor, start: int, scale: float) -> Tensor:
    """Causal attention over every cached key (what sparse attention equals while a row has at most top_k candidate
    blocks): q (T, nh, hd), k / v (nkv, S, hd) -> (T, nh * hd)."""
    t, nh, hd = q.shape
    nkv = k.shape[0]
    g = nh // nkv
    if t > GATHER_ROWS:  # a prompt: causal SDPA in chunks of rows
        return chunked_sdpa(q, k, v, start, scale, lambda a, b, end: torch.ones(b - a, end, dtype=torch.bool).tril(diagonal=start + a))
    rows = q.view(t, nkv, g, hd).transpose(0, 1).reshape(nkv, t * g, hd)  # (nkv, T g, hd), row = (position, head)
    w = (rows @ k[:, : start + t].transpose(1, 2)) * scale  # (nkv, T g, start + T)
    if t > 1:  # causal among the new positions
        future = torch.ones(t, t, dtype=torch.bool).triu(1).repeat_interleave(g, 0)  # (T g, T)
        w[:, :, start:] = w[:, :, start:].masked_fill(future, float("-inf"))
    y = torch.softmax(w, dim=-1) @ v[:, : start + t]  # (nkv, T g, hd)
    return y.view(nkv, t, g, hd).transpose(0, 1).reshape(t, nh * hd)


@torch.no_grad()
def keep_keys(k: Tensor, v: Tensor, kept: Selection, cfg: SparseAttentionConfig, scratch: IndexKeys, layer: int) -> None:
    """Gather a kept selection's tokens once per round (kept.keys): those of its valid blocks before the anchor's
    window start, from the cache k / v (nkv, S, hd) into a buffer kept on `scratch` with room for the window after.
    Drafting state: no gradient flows through it."""
    nkv, hd, r = k.shape[0], k.shape[2], cfg.block
    lo = kept.anchor - cfg.window + 1
    cap = cfg.top_k * r + cfg.window + REUSE_REACH + 1
    kb, vb = scratch.buffers((nkv, cap, hd), k.dtype, use=f"reuse{layer}")  # (nkv, cap, hd)
    tok = (kept.blocks[:, None] * r + torch.arange(r)).flatten()  # (k r,) the kept tokens' positions
    tok = tok[kept.ok.repeat_interleave(r) & (tok < lo)]  # (n,) valid blocks, before the window
    n, a = tok.numel(), max(lo, 0)
    gather_blocks(k, tok, 1, kb[:, :n]), gather_blocks(v, tok, 1, vb[:, :n])  # tokens: blocks of one
    kb[:, n : n + kept.anchor + 1 - a] = k[:, a : kept.anchor + 1]  # the anchor's window, through the anchor
    vb[:, n : n + kept.anchor + 1 - a] = v[:, a : kept.anchor + 1]
    kept.keys = (kb, vb, n, kept.anchor + 1)


def attend_reused(q: Tensor, k: Tensor, v: Tensor, kept: Selection, pos: Tensor, cfg: SparseAttentionConfig,
                  scale: float, scratch: IndexKeys, layer: int) -> Tensor:
    """Rows of a round's chained draft steps attending a kept selection: q (T, nh, hd), k / v (nkv, S, hd) ->
    (T, nh * hd). The kept blocks lie in committed positions no draft step rewrites, so their tokens and the anchor's
    window are gathered once per round (keep_keys); each call appends the positions past those copied (its own rows
    included) and attends the buffer as a short dense pass, causal among the rows only."""
    t = q.shape[0]
    a, b = max(kept.anchor - cfg.window + 1, 0), int(pos[-1]) + 1
    if kept.keys is None:
        keep_keys(k, v, kept, cfg, scratch, layer)
    kb, vb, n, upto = kept.keys
    c = min(upto, int(pos[0]))  # copy from here: positions not copied yet, and the rows just written
    kb[:, n + c - a : n + b - a] = k[:, c:b]
    vb[:, n + c - a : n + b - a] = v[:, c:b]
    kept.keys = (kb, vb, n, b)
    return dense_attend(q, kb, vb, n + b - a - t, scale)


def block_attention_mass(probs: Tensor, pos: Tensor, nb: int, cfg: SparseAttentionConfig) -> Tensor:
    """Full attention's probabilities probs (..., T, S) summed per block over the candidates of each row and
    renormalised -> (..., T, nb): the distribution an indexer is distilled towards (rows without candidates are 0)."""
    s = probs.shape[-1]
    pad = nb * cfg.block - s
    if pad > 0:
        probs = F.pad(probs, (0, pad))
    mass = probs[..., : nb * cfg.block].unflatten(-1, (nb, cfg.block)).sum(-1)  # (..., T, nb)
    mass = mass * candidates(pos, nb, cfg)
    return mass / mass.sum(-1, keepdim=True).clamp_min(1e-12)


def window_sparse_attention(cfg: SparseAttentionConfig, indexer: Indexer, x: Tensor, q: Tensor, k: Tensor, v: Tensor,
                            scale: float) -> Tensor:
    """Whole windows from position 0 (training): x (B, T, H) the normed input, q (B, nh, T, hd), k / v (B, nkv, T, hd)
    -> (B, nh, T, hd), differentiable in q, k, v (the selection is not: the indexer is trained by distillation)."""
    b, _, t, _ = q.shape
    nb = t // cfg.block  # complete blocks only (a candidate block is always complete)
    pos = torch.arange(t)
    with torch.no_grad():
        keys = indexer.keys(x)[:, : nb * cfg.block]  # (B, nb r, dim)
        bk = keys.unflatten(1, (nb, cfg.block)).mean(2)  # (B, nb, dim)
        iq, iw = indexer.queries(x)  # (B, T, heads, dim), (B, T, heads)
    out = []
    for i in range(b):
        blocks, ok = select_blocks(block_scores(iq[i], iw[i], bk[i]), pos, cfg)  # (T, k)
        mask = attention_mask(blocks, ok, pos, pos - cfg.window + 1, t, cfg)  # (T, T)
        out.append(F.scaled_dot_product_attention(q[i], k[i], v[i], attn_mask=mask, scale=scale, enable_gqa=q.shape[1] != k.shape[1]))
    return torch.stack(out)  # (B, nh, T, hd)

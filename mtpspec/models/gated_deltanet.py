"""Gated DeltaNet (Qwen3-Next / Qwen3.5 linear attention): a causal conv window + a gated delta-rule state.

Per value head the state S (dk, dv) evolves, for each position t, as

    S <- S * exp(g_t)                                   decay (g_t <= 0)
    S <- S + k_t (beta_t * (v_t - k_t^T S))^T            delta rule: write the correction only
    o_t = q_t^T S                                       read

with q, k L2-normalised (q also scaled by dk^-1/2), beta_t = sigmoid(b_t) and
g_t = -exp(A_log) * softplus(a_t + dt_bias). Two exact forms of the same recurrence are implemented:

- `window_delta_rule`, for decode and verify windows (T <= 64): one exact chunk of the window's own
  length. It reads the state once and returns the per-position decays, keys and corrections, from
  which the cache rebuilds the state after ANY position (the slot rollback selects) in one pass
  over the state, where a position-by-position loop would pass over it several times per position.
- `piece_delta_rule`, for every window that may be cropped: pieces of at most 64 positions, each a
  window as above from its own incoming state, so every slot stays selectable (hybrid_cache.py).
- `chunked_delta_rule`: 64-position chunks solved with a triangular (UT) system, for a prompt
  prefill (ForwardBatch.prefill), which is never cropped inside and keeps only its final state.

In exact mode (engine.py) a verify window runs as one-position forwards, each exactly a plain step.

Parameter names follow the Hugging Face Qwen3.5 layout (in_proj_qkv / in_proj_z / in_proj_b /
in_proj_a, conv1d, A_log, dt_bias, norm, out_proj). Qwen3-Next's fused in_proj_qkvz / in_proj_ba
are converted to this layout when loading (loading/hf.py).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from .common import Linear, wide
from .hybrid_cache import Window, slot_state

SHORT_MAX_T = 16  # a prompt prefill up to this long runs the window form too (it is cheaper than padding to a chunk)
CHUNK = 64


def _l2norm(x: Tensor, eps: float = 1e-6) -> Tensor:
    return x * torch.rsqrt((x * x).sum(-1, keepdim=True) + eps)


def window_delta_rule(q: Tensor, k: Tensor, v: Tensor, g: Tensor, beta: Tensor, state: Tensor,
                      anc: Tensor | None = None) -> tuple[Tensor, Tensor, Tensor]:
    """A short window (decode / verify) as one exact chunk, without padding and without writing states.

    anc (T, T) bool (or (B, T, T), a tree per sequence), for a token tree's verify window (tree.py): position i follows its own ancestors
    only (anc[i, j]: j is i or an ancestor of i), so the decays accumulate along each row's path and a
    row reads and writes the state of its own path; every row's (gc, u) is then that of the chain
    along its path, and rollback to an accepted path is a re-indexing (HybridCache.keep).

    q, k (B, nv, T, dk), v (B, nv, T, dv), g, beta (B, nv, T), state (B, nv, dk, dv); fp32 (fp64 for an fp64 model).
    Returns o (B, nv, T, dv), gc (B, nv, T) the cumulative log decay and u (B, nv, T, dv) the
    corrections written: the state after j positions is
    S_j = S_0 exp(gc_{j-1}) + sum_{i<j} exp(gc_{j-1} - gc_i) k_i u_i^T (see hybrid_cache.py).
    The state itself is read once (one matmul for the decayed keys and queries together).
    """
    t_len, dk, dv = q.shape[2], q.shape[-1], v.shape[-1]
    if anc is None:
        gc = g.cumsum(-1)  # (B, nv, T)
        causal = torch.ones(t_len, t_len, dtype=torch.bool).tril()
    else:  # a tree: decays summed along each row's path, keys seen along it only
        gc = g @ anc.to(g.dtype).transpose(-1, -2)  # (B, nv, T); anc (T, T), or (B, T, T): each sequence its own tree
        causal = anc if anc.dim() == 2 else anc[:, None]  # (T, T) or (B, 1, T, T)
    gamma = (gc[..., :, None] - gc[..., None, :]).masked_fill(~causal, float("-inf")).exp()  # (B, nv, T, T)
    k_beta = k * beta[..., None]
    system = (k_beta @ k.transpose(-1, -2)) * gamma  # unit lower triangular system (strict part used)
    rhs = torch.cat([v * beta[..., None], k_beta * gc.exp()[..., None]], dim=-1)  # (B, nv, T, dv + dk)
    u0, w = torch.linalg.solve_triangular(system, rhs, upper=False, unitriangular=True).split([dv, dk], dim=-1)
    read = torch.cat([w, q * gc.exp()[..., None]], dim=-2) @ state  # (B, nv, 2T, dv): one pass over the state
    u = u0 - read[:, :, :t_len]  # corrections given the incoming state
    o = read[:, :, t_len:] + ((q @ k.transpose(-1, -2)) * gamma) @ u
    return o, gc, u


def piece_delta_rule(q: Tensor, k: Tensor, v: Tensor, g: Tensor, beta: Tensor, state: Tensor, piece: int = CHUNK) -> tuple[Tensor, list[Window]]:
    """A window of any length as pieces of at most `piece` positions, each one `window_delta_rule` chunk.

    Same inputs as `window_delta_rule`; returns o (B, nv, T, dv) and one Window per piece. A piece's
    incoming state (the slot after the previous piece, one pass over the state) is kept in its Window;
    the last piece's final state is left to the cache to materialise, as for a short window.
    """
    if q.shape[2] <= piece:  # one piece: the window itself (decode and short verify windows: no slicing)
        o, gc, u = window_delta_rule(q, k, v, g, beta, state)
        return o, [Window(gc, k, u)]
    outs, pieces, s = [], [], state
    for a in range(0, q.shape[2], piece):
        if pieces:
            s = slot_state(s, pieces[-1], pieces[-1].length)  # (B, nv, dk, dv) the state after the previous piece
        part = slice(a, a + piece)
        o, gc, u = window_delta_rule(q[:, :, part], k[:, :, part], v[:, :, part], g[:, :, part], beta[:, :, part], s)
        outs.append(o)
        pieces.append(Window(gc, k[:, :, part], u, start=a, s0=s if a else None))
    return torch.cat(outs, dim=2), pieces


def causal_conv(hist: Tensor, weight: Tensor) -> Tensor:
    """Depthwise causal conv: hist (B, C, K-1+T) inputs, weight (C, 1, K) -> (B, C, T), accumulated in at least fp32.

    A sum of K shifted products: for the short windows of decode / verify this is far cheaper on CPU
    than a grouped F.conv1d call.
    """
    kern = weight.shape[-1]
    t_len = hist.shape[-1] - kern + 1
    dt = wide(hist.dtype)
    w = weight[:, 0].to(dt)  # (C, K)
    h = hist.to(dt)
    out = h[..., :t_len] * w[:, 0, None]
    for j in range(1, kern):
        out += h[..., j : j + t_len] * w[:, j, None]
    return out.to(hist.dtype)


def tree_conv(rows: Tensor, weight: Tensor, taps: Tensor) -> Tensor:
    """causal_conv over a token tree, each row reading its own path's inputs, in the rows' layout: rows (B, K-1+T, C)
    (the K-1 inputs before the window, then the window's), taps (T K,): row r's K input rows, oldest first
    (TreeLayout.conv_taps; (B, T K): each sequence's own) -> (B, T, C). One gather of whole rows, then the taps summed one by one in at least fp32, as
    causal_conv sums them (the same products and sums per element: a chain's numbers along every path)."""
    kern = weight.shape[-1]
    dt = wide(rows.dtype)
    w = weight[:, 0].to(dt)  # (C, K)
    if taps.dim() == 1:
        h = rows.index_select(1, taps)  # (B, T K, C)
    else:  # (B, T K): each sequence its own tree
        h = rows.gather(1, taps[..., None].expand(-1, -1, rows.shape[-1]))
    h = h.to(dt).unflatten(1, (-1, kern))  # (B, T, K, C)
    out = h[:, :, 0] * w[:, 0]
    for j in range(1, kern):
        out += h[:, :, j] * w[:, j]
    return out.to(rows.dtype)


def chunked_delta_rule(q: Tensor, k: Tensor, v: Tensor, g: Tensor, beta: Tensor, state: Tensor, chunk: int = CHUNK) -> tuple[Tensor, Tensor]:
    """Same inputs as `window_delta_rule`; returns o (B, nv, T, dv) and the final state only.

    Within a chunk the delta-rule updates are condensed by solving the unit-lower-triangular system
    (I + tril(diag(beta) K K^T * Gamma, -1)) U = diag(beta) V (Gamma = pairwise decays); then the
    chunk reads the incoming state, and the state advances by one matmul per chunk.
    """
    b, h, t_len, dk = q.shape
    pad = (chunk - t_len % chunk) % chunk
    if pad:
        q, k, v = (F.pad(x, (0, 0, 0, pad)) for x in (q, k, v))
        g, beta = (F.pad(x, (0, pad)) for x in (g, beta))
    n = (t_len + pad) // chunk
    q, k, v = (x.reshape(b, h, n, chunk, x.shape[-1]) for x in (q, k, v))  # (B, h, n, C, d)
    g, beta = g.reshape(b, h, n, chunk), beta.reshape(b, h, n, chunk)
    gc = g.cumsum(-1)  # (B, h, n, C) log decay from chunk start to each position
    causal = torch.ones(chunk, chunk, dtype=torch.bool).tril()  # (C, C) incl. diagonal
    gamma = (gc.unsqueeze(-1) - gc.unsqueeze(-2)).masked_fill(~causal, float("-inf")).exp()  # (B,h,n,C,C)
    k_beta = k * beta.unsqueeze(-1)
    system = (k_beta @ k.transpose(-1, -2)) * gamma  # only its strict lower part is used (unit diagonal)
    u = torch.linalg.solve_triangular(system, v * beta.unsqueeze(-1), upper=False, unitriangular=True)
    w = torch.linalg.solve_triangular(system, k_beta * gc.exp().unsqueeze(-1), upper=False, unitriangular=True)
    attn = (q @ k.transpose(-1, -2)) * gamma  # (B, h, n, C, C) intra-chunk, causal incl. diagonal
    q_dec = q * gc.exp().unsqueeze(-1)  # query reads the incoming state decayed to its position
    k_dec = k * (gc[..., -1:] - gc).exp().unsqueeze(-1)  # key written, decayed to the chunk end
    chunk_decay = gc[..., -1].exp()  # (B, h, n)
    out = torch.empty_like(v)
    s = state
    for i in range(n):
        v_new = u[:, :, i] - w[:, :, i] @ s  # (B, h, C, dv) corrections given the incoming state
        out[:, :, i] = q_dec[:, :, i] @ s + attn[:, :, i] @ v_new
        s = s * chunk_decay[:, :, i, None, None] + k_dec[:, :, i].transpose(-1, -2) @ v_new
    out = out.reshape(b, h, n * chunk, -1)[:, :, :t_len]
    return out, s


class GatedRMSNorm(nn.Module):
    """Per-head RMSNorm (plain weight, not zero-centred) followed by a SiLU gate: norm(x) * w * silu(z)."""

    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: Tensor, z: Tensor) -> Tensor:
        dt = wide(x.dtype)
        xf = x.to(dt)
        y = (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)).to(x.dtype)
        return (self.weight * y * F.silu(z.to(dt))).to(x.dtype)


class GatedDeltaNet(nn.Module):
    """The layer's weights and shapes (forward._delta_net computes it)."""

    def __init__(self, hidden: int, nk: int, nv: int, dk: int, dv: int, conv_kernel: int, eps: float, slot: int) -> None:
        super().__init__()
        if nv % nk:
            raise ValueError(f"linear_num_value_heads ({nv}) must be a multiple of linear_num_key_heads ({nk})")
        self.nk, self.nv, self.dk, self.dv, self.kernel = nk, nv, dk, dv, conv_kernel
        self.slot = slot  # index of this layer among the linear-attention layers of the cache
        self.key_dim, self.value_dim = nk * dk, nv * dv
        self.conv_dim = 2 * self.key_dim + self.value_dim
        self.in_proj_qkv = Linear(hidden, self.conv_dim, bias=False)
        self.in_proj_z = Linear(hidden, self.value_dim, bias=False)
        self.in_proj_b = Linear(hidden, nv, bias=False)
        self.in_proj_a = Linear(hidden, nv, bias=False)
        self.conv1d = nn.Conv1d(self.conv_dim, self.conv_dim, conv_kernel, groups=self.conv_dim, bias=False)
        self.dt_bias = nn.Parameter(torch.ones(nv))
        self.A_log = nn.Parameter(torch.empty(nv).uniform_(0.01, 16).log())
        self.norm = GatedRMSNorm(dv, eps)
        self.out_proj = Linear(self.value_dim, hidden, bias=False)

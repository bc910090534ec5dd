"""Building blocks shared by the decoders: RMSNorm, rotary embedding, attention, SwiGLU MLP."""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from .. import kernels
from ..kernels.attention import attend_rows
from ..kernels.rownorm import rms_norm


class CausalLM(nn.Module):
    """What every target and draft model shares: `config` (with max_seq_len, vocab_size), `model.embed_tokens`,
    `lm_head`; subclasses add new_cache() and forward_tokens(tokens, cache) -> TargetOutput."""

    @property
    def max_seq_len(self) -> int:
        return self.config.max_seq_len

    @property
    def vocab_size(self) -> int:
        return self.config.vocab_size

    @property
    def dtype(self) -> torch.dtype:
        emb = self.model.embed_tokens
        return emb.weight.dtype if isinstance(emb, nn.Embedding) else emb.dtype  # a GGUF block table names its dtype

    def embed(self, tokens: Tensor) -> Tensor:
        return self.model.embed_tokens(tokens)

    def reset_buffers(self) -> None:
        """Compute every rotary table again (non-persistent buffers: a model built on the meta device has none)."""
        for m in self.modules():
            if isinstance(m, Rotary):
                m.cos, m.sin = m.compute(torch.float32)

    def shortcut(self, tokens: Tensor, cache, exact: bool):
        """The forward when it does not run the eager layers at once: exact mode's one-position forwards
        (by_position), or the compiled step (compiled.compile_model); else None. A token tree's
        verify window (cache.tree) always runs the eager layers."""
        if getattr(cache, "tree", None) is not None:
            return None
        if exact and tokens.shape[0] > 1 and not cache.prefill:
            return by_position(self, tokens, cache)
        step = self.__dict__.get("compiled_step")
        if step is not None and step.handles(tokens.shape[0], cache):
            return step(tokens, cache)
        return None

    def head(self, hidden: Tensor) -> Tensor:
        """Logits in at least fp32: fp32 for fp32 / bf16 models (a bf16 model's logits are bf16 values), fp64 for fp64 ones."""
        if isinstance(self.lm_head, Linear):
            return self.lm_head.wide(hidden)
        logits = self.lm_head(hidden)
        return logits.to(wide(logits.dtype))


class Linear(nn.Linear):
    """nn.Linear (same parameters, same state dict) whose inference products of a few fp32 / bf16 rows run on the
    panel kernel (mtpspec.kernels: the weight read once at full bandwidth, row-invariant results); training,
    prefill and other dtypes run F.linear as nn.Linear does."""

    def forward(self, x: Tensor) -> Tensor:
        if not kernels.usable(x, self.weight):
            return F.linear(x, self.weight, self.bias)
        return kernels.packed_linear(x, kernels.panels_of(self.__dict__, self.weight), self.out_features, self.bias)

    def wide(self, x: Tensor) -> Tensor:
        """forward(x) in at least fp32 (the logits of an LM head): the same values, without converting a bf16 result
        twice on the kernel's path."""
        if not kernels.usable(x, self.weight):
            y = F.linear(x, self.weight, self.bias)
            return y.to(wide(y.dtype))
        return kernels.packed_linear(x, kernels.panels_of(self.__dict__, self.weight), self.out_features, self.bias, widen=True)


def wide(dtype: torch.dtype) -> torch.dtype:
    """The dtype to compute in: at least fp32 (bf16 / fp16 -> fp32), the input's own when wider (fp64)."""
    return torch.promote_types(dtype, torch.float32)


def by_position(model, tokens: Tensor, cache) -> "TargetOutput":
    """model.forward_tokens over tokens (T,) as T one-position forwards: exact mode's verify pass.

    Each position is then computed by exactly the code and shapes of a plain decode step, so its logits
    are bitwise the same whatever else shares the pass (other positions, other sequences). A pass over
    T rows cannot promise that on CPU: GEMM kernels choose their blocking, and so each dot product's
    order of summation, by the number of rows (fp32 `F.linear(x)[i]` differs from `F.linear(x[i:i+1])`
    in the last bits for most row counts here), and vectorised elementwise kernels (SiLU, exp) give the
    elements that fall in a scalar tail another rounding. The pass still rolls back as one forward: a
    hybrid cache is left holding the state after each of the T positions (HybridCache.stitch).
    """
    from ..types import TargetOutput

    stitch = cache.stitch_begin() if hasattr(cache, "stitch_begin") else None  # a cache with recurrent state
    outs = []
    for j in range(tokens.shape[0]):
        outs.append(model.forward_tokens(tokens[j : j + 1], cache))
        if stitch is not None:
            cache.stitch_add(stitch)
    if stitch is not None:
        cache.stitch_end(stitch)
    return TargetOutput.cat(outs)


class RMSNorm(nn.Module):
    """y = x / rms(x) * w, or * (1 + w) for the zero-centred norms of Qwen3-Next / Qwen3.5."""

    def __init__(self, dim: int, eps: float = 1e-6, zero_centred: bool = False, row_kernel: bool = False) -> None:
        super().__init__()
        self.eps = eps
        self.zero_centred = zero_centred
        self.row_kernel = row_kernel  # fp32 inference by kernels/rownorm.cpp: one call, each row alone
        self.weight = nn.Parameter(torch.zeros(dim) if zero_centred else torch.ones(dim))

    def forward(self, x: Tensor) -> Tensor:
        if self.row_kernel and x.dtype == self.weight.dtype == torch.float32 and not torch.is_grad_enabled():
            return rms_norm(x, self.weight, self.eps, self.zero_centred)
        if x.dtype == self.weight.dtype == wide(x.dtype):  # fp32 or fp64: same arithmetic, no no-op casts
            y = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps)  # (each cast is a dispatched op)
            return y * (1.0 + self.weight) if self.zero_centred else self.weight * y
        dt = wide(x.dtype)
        xf = x.to(dt)
        y = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)
        w = self.weight.to(dt)
        if self.zero_centred:
            return (y * (1.0 + w)).to(x.dtype)
        return self.weight * y.to(x.dtype)


class Rotary(nn.Module):
    """Rotary position embedding in the half-split layout (rotate_half), on the first `rot_dim` dims.

    The `cos` / `sin` buffers are computed in fp32 (as transformers computes them) and cast to the
    input's dtype; an fp64 input uses tables computed in fp64 (`tables`), built once on first use.
    """

    def __init__(self, rot_dim: int, max_len: int, theta: float, scaling: dict | None = None) -> None:
        super().__init__()
        self.rot_dim, self.max_len, self.theta = rot_dim, max_len, theta
        self.scaling = scaling  # rope scaling (linear / llama3), see scale_inv_freq
        cos, sin = self.compute(torch.float32)
        self.register_buffer("cos", cos, persistent=False)
        self.register_buffer("sin", sin, persistent=False)

    def compute(self, dtype: torch.dtype) -> tuple[Tensor, Tensor]:
        """cos, sin (max_len, rot) computed in `dtype` (fp32 or fp64)."""
        inv_freq = 1.0 / (self.theta ** (torch.arange(0, self.rot_dim, 2, dtype=torch.int64).to(dtype) / self.rot_dim))
        inv_freq = scale_inv_freq(inv_freq, self.scaling)  # (rot/2,)
        freqs = torch.outer(torch.arange(self.max_len).to(dtype), inv_freq)  # (max_len, rot/2)
        emb = torch.cat([freqs, freqs], dim=-1)  # (max_len, rot)
        return emb.cos(), emb.sin()

    def tables(self, dtype: torch.dtype) -> tuple[Tensor, Tensor]:
        """cos, sin (max_len, rot) for inputs of `dtype`: the buffers, or fp64 tables computed in fp64."""
        if dtype != torch.float64:
            return self.cos, self.sin
        if self.__dict__.get("_fp64") is None:  # not a buffer: module.to() / to_empty() leave it alone
            self.__dict__["_fp64"] = self.compute(torch.float64)
        return self.__dict__["_fp64"]

    def forward(self, x: Tensor, start: int, positions: Tensor | None = None) -> Tensor:
        """x (B, nh, T, hd) at positions start..start+T-1 (or at `positions` (T,): a token tree) -> same shape, rotated."""
        t = x.shape[2]
        if positions is not None:  # a tree's rows: gathered once per forward (every layer passes the same tensor)
            kept = self.__dict__.get("_rows")
            if kept is None or kept[0] is not positions or kept[1] != x.dtype:
                cos, sin = self.tables(x.dtype)
                self.__dict__["_rows"] = kept = (positions, x.dtype, cos[positions].to(x.dtype), sin[positions].to(x.dtype))
            cos, sin = kept[2], kept[3]  # (T, rot)
        else:
            cos, sin = self.tables(x.dtype)
            cos = cos[start : start + t].to(x.dtype)  # (T, rot)
            sin = sin[start : start + t].to(x.dtype)
        xr, xp = x[..., : self.rot_dim], x[..., self.rot_dim :]
        half = self.rot_dim // 2
        rotated = torch.cat([-xr[..., half:], xr[..., :half]], dim=-1)
        return torch.cat([xr * cos + rotated * sin, xp], dim=-1)


def causal_attention(q: Tensor, k: Tensor, v: Tensor, start: int, window: int = 0, tree=None) -> Tensor:
    """q (B, nh, T, hd) at positions start.., k/v (B, n_kv, start+T, hd) -> (B, nh, T, hd).

    Query i sees keys 0..start+i; with a sliding window (window > 0) only the last `window` of them,
    start+i-window+1..start+i (transformers' sliding_window). GQA heads are shared by SDPA's enable_gqa.
    tree (a TreeLayout): row i sees the keys before `start` and its own ancestors in the window (tree.py).
    """
    if tree is not None:
        return _tree_attention(q, k, v, start, window, tree)
    t, s = q.shape[2], k.shape[2]
    gqa = q.shape[1] != k.shape[1]

    def first(pos: int) -> int:  # the oldest key position a query at `pos` sees
        return max(0, pos - window + 1) if window > 0 else 0

    lo = first(start)  # keys older than the first query's window are seen by no query
    if lo:
        k, v = k[:, :, lo:], v[:, :, lo:]  # (B, n_kv, S - lo, hd)
    mask = None
    if t > 1:
        mask = torch.ones(t, s - lo, dtype=torch.bool).tril(diagonal=start - lo)  # (T, S - lo): causal
        if window > 0:
            mask &= torch.ones(t, s - lo, dtype=torch.bool).triu(diagonal=start - lo - window + 1)  # the window
    if q.dtype in (torch.bfloat16, torch.float16) and q.device.type == "cpu" and t <= SHORT_ATTENTION:
        return _attention_fp32(q, k, v, mask)
    return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, enable_gqa=gqa)


def rows_attention(q: Tensor, k: Tensor, v: Tensor, start: int, window: int = 0, tree=None) -> Tensor:
    """causal_attention with each query row computed alone (kernels.attention): row i's output is bitwise the one-row
    step's at its position, whatever the window or tree around it. q (1, nh, T, hd), k / v (1, n_kv, start+T, hd) fp32.

    A tree row sees the committed keys and its ancestors, in index order: the keys, in the order, that the plain step
    at its position sees once its path is accepted (ancestors come before their descendants in a tree's layout)."""
    t = q.shape[2]
    mask = None
    if tree is not None:
        pos = tree.positions(start)  # (T,)
        mask = tree.attn_mask(start)  # (T, start + T)
        if window > 0:
            mask = mask & ((pos[:, None] - torch.cat([torch.arange(start), pos])[None, :]) < window)
        hi, lo = start + torch.arange(t), torch.zeros(t, dtype=torch.long)
    else:
        hi = start + torch.arange(t)  # (T,) each row's own position: its last key
        lo = first_keys(hi, window)
    out = attend_rows(q[0].transpose(0, 1), k, v, torch.zeros(t, dtype=torch.long), lo, hi, mask)  # (T, nh, hd)
    return out.transpose(0, 1)[None]  # (1, nh, T, hd)


def first_keys(pos: Tensor, window: int) -> Tensor:
    """The oldest key each query at positions `pos` sees: pos - window + 1 with a sliding window (transformers'
    sliding_window), else 0."""
    return (pos - window + 1).clamp(min=0) if window > 0 else torch.zeros_like(pos)


SHORT_ATTENTION = 64  # query rows up to which bf16 attention is computed by _attention_fp32 (a decode or verify window)


def _attention_fp32(q: Tensor, k: Tensor, v: Tensor, mask: Tensor | None) -> Tensor:
    """softmax(q k^T / sqrt(hd)) v in fp32 for bf16 / fp16 q, k, v (B, nh | n_kv, ., hd) -> (B, nh, T, hd) in q's dtype.

    For a few query rows torch's CPU SDPA in bf16 is several times slower than these three products in fp32 (every
    decode step, every layer); SDPA accumulates in fp32 too, so the two differ by rounding. Query heads share key
    heads as enable_gqa does (head h reads h // g)."""
    b, nh, t, hd = q.shape
    nkv = k.shape[1]
    g = nh // nkv
    rows = q.float().reshape(b, nkv, g * t, hd)  # (B, n_kv, g T, hd): head h = kv * g + j, rows ordered (j, t)
    w = (rows @ k.float().transpose(-1, -2)) * hd**-0.5  # (B, n_kv, g T, S)
    if mask is not None:
        w = w.masked_fill(~mask.repeat(g, 1), float("-inf"))
    return (torch.softmax(w, dim=-1) @ v.float()).view(b, nh, t, hd).to(q.dtype)


def _tree_attention(q: Tensor, k: Tensor, v: Tensor, start: int, window: int, tree) -> Tensor:
    """causal_attention over a token tree's verify window: rows at positions start + depth, each row seeing the
    committed keys and its ancestors (and, with a sliding window, only those less than `window` positions back)."""
    gqa = q.shape[1] != k.shape[1]
    mask = tree.attn_mask(start)  # (T, start + T)
    if window > 0:
        q_pos = tree.positions(start)  # (T,)
        k_pos = torch.cat([torch.arange(start), q_pos])  # (start + T,)
        mask = mask & ((q_pos[:, None] - k_pos[None, :]) < window)
    return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, enable_gqa=gqa)


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


def gelu_tanh(x: Tensor) -> Tensor:
    return F.gelu(x, approximate="tanh")


ACTIVATIONS = {"silu": F.silu, "gelu_tanh": gelu_tanh}  # a gated MLP's activation by config name


class SwiGLU(nn.Module):
    """down(act(gate(x)) * up(x)): SwiGLU with act = silu, Gemma's GeGLU with gelu_tanh."""

    def __init__(self, dim: int, hidden: int, bias: bool = False, act: str = "silu") -> None:
        super().__init__()
        self.gate_proj = Linear(dim, hidden, bias=bias)
        self.up_proj = Linear(dim, hidden, bias=bias)
        self.down_proj = Linear(hidden, dim, bias=bias)
        self.act = ACTIVATIONS[act]

    def forward(self, x: Tensor) -> Tensor:
        return self.down_proj(self.act(self.gate_proj(x)) * self.up_proj(x))

"""Weight-only quantization of a model's linear layers into GGUF block types, run on the GGUF block kernel.

A quantized model is another target: speculation is lossless with respect to it (its distance from the unquantized
model: `greedy_agreement`).

- q8_0, q4_0, q5_0 (32 inputs a block), q4_k, q5_k, q6_k (256): the bytes a GGUF file of that type holds
  (gguf.quants for the first three, a numpy port of llama.cpp's reference K-quantizers), in a models.common.Linear
  on block weights (Linear.of_blocks). K not a multiple of 256 gets q8_0; not of 32, fp weights.
- int8 and int4 are other names of q8_0 and q4_k (ALIASES).

The block kernel computes in fp32: a bf16 model's activations are widened exactly and each output rounded back to
bf16. It computes each row independently of M (bitwise, tested), so a verify over k+1 rows scores each row as plain
decoding does. Every nn.Linear is quantized, lm_head and the MTP module's included; a tied embedding table stays in
the model's dtype; draft heads and layers already on block weights (a GGUF file's) stay as they are; fp64 (the
rounding-free reference) is refused.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
import torch
from torch import Tensor, nn

from .errors import ConfigError

BLOCK_KINDS = ("q8_0", "q4_0", "q5_0", "q4_k", "q5_k", "q6_k")  # GGUF block types, on the GGUF block kernel
ALIASES = {"int8": "q8_0", "int4": "q4_k"}  # names kept from torch's int8 / int4 kernels, which these replaced
KINDS = BLOCK_KINDS + tuple(ALIASES)


@dataclass(frozen=True)
class QuantConfig:
    kind: str  # a GGUF block type (BLOCK_KINDS), aliases resolved


def check_quant(kind, dtype: torch.dtype | None = None) -> QuantConfig | None:
    """None (no quantization) or a QuantConfig; an unknown name, or an fp64 model, is a ConfigError naming it."""
    if kind is None or kind == "none":
        return None
    if kind not in KINDS:
        names = [*BLOCK_KINDS, *(f"{a} (= {b})" for a, b in ALIASES.items())]
        raise ConfigError(f"unknown quant {kind!r} (choose {', '.join(names)}, or none)")
    if dtype == torch.float64:
        raise ConfigError(f"quant {kind} does not combine with fp64: the GGUF block kernel computes in fp32, and fp64 is "
                          "the rounding-free reference mode; quantize an fp32 or bf16 model")
    return QuantConfig(ALIASES.get(kind, kind))


# The K-quants follow llama.cpp's quantize_row_q{4,5,6}_K_ref (no importance matrix) in fp32 in their operation order:
# sums left to right (np.cumsum), no fused products, half-to-even rounding (np.rint, numpy's fp16 cast); each loop
# step vectorised over all blocks.
QK_K = 256
_F = np.float32
GROUP_MAX_EPS = _F(1e-15)


def _sum(a: np.ndarray) -> np.ndarray:
    """Sum over the last axis, left to right in fp32 (a C loop `s += a[i]`), not numpy's pairwise order."""
    return np.cumsum(a, axis=-1, dtype=_F)[..., -1]


def _nearest_int(v: np.ndarray) -> np.ndarray:
    return np.rint(v).astype(np.int32)


def _make_qkx2_quants(x: np.ndarray, w: np.ndarray, nmax: int, rmin: float, rdelta: float, nstep: int):
    """llama.cpp's make_qkx2_quants over blocks x (B, n) with weights w (B, n): codes L (B, n) in [0, nmax], scale
    (B,), the_min (B,) with x ~ scale L - the_min, the (scale, min) pair of least weighted squared error over
    nstep + 1 trial scales, each refined by weighted least squares (min kept <= 0)."""
    mn = np.minimum(x.min(-1), 0)  # (B,)
    mx = x.max(-1)
    sum_w, sum_x = _sum(w), _sum(w * x)
    flat = mx == mn
    rng = np.where(flat, _F(1), mx - mn)
    iscale = _F(nmax) / rng
    scale = _F(1) / iscale
    L = np.clip(_nearest_int(iscale[:, None] * (x - mn[:, None])), 0, nmax)  # (B, n)
    diff = scale[:, None] * L.astype(_F) + mn[:, None] - x
    best = _sum(w * (diff * diff))
    for step in range(nstep + 1):
        iscale = (_F(rmin) + _F(rdelta) * _F(step) + _F(nmax)) / np.where(flat, _F(1), mx - mn)  # min moves on improvement
        la = np.clip(_nearest_int(iscale[:, None] * (x - mn[:, None])), 0, nmax)
        lf = la.astype(_F)
        wl = w * lf
        sum_l, sum_l2, sum_xl = _sum(wl), _sum(wl * lf), _sum(wl * x)
        D = sum_w * sum_l2 - sum_l * sum_l
        with np.errstate(divide="ignore", invalid="ignore"):
            this_scale = (sum_w * sum_xl - sum_x * sum_l) / D
            this_min = (sum_l2 * sum_x - sum_l * sum_xl) / D
            pos = this_min > 0
            this_scale = np.where(pos, sum_xl / sum_l2, this_scale)
        this_min = np.where(pos, _F(0), this_min)
        d = this_scale[:, None] * lf + this_min[:, None] - x
        cur = _sum(w * (d * d))
        take = (D > 0) & (cur < best) & ~flat
        L = np.where(take[:, None], la, L)
        best, scale, mn = np.where(take, cur, best), np.where(take, this_scale, scale), np.where(take, this_min, mn)
    L[flat] = 0
    return L, np.where(flat, _F(0), scale), -mn


def _make_qx_quants(x: np.ndarray, nmax: int):
    """llama.cpp's make_qx_quants(rmse_type 1, no importance weights) over blocks x (B, n): signed codes L + nmax
    (B, n) in [0, 2 nmax) and a scale (B,), x ~ scale L, the best x^2-weighted fit over 19 trial scales."""
    ax = np.abs(x)
    at = ax.argmax(-1)  # the first largest |x|, as the C loop's strict `>` keeps
    rows = np.arange(x.shape[0])
    mx, zero = x[rows, at], ax[rows, at] < GROUP_MAX_EPS
    mx = np.where(zero, _F(1), mx)
    w = x * x

    def trial(iscale):
        l = np.clip(_nearest_int(iscale[:, None] * x), -nmax, nmax - 1)
        lf = l.astype(_F)
        return l, _sum(w * x * lf), _sum(w * lf * lf)

    L, sumlx, suml2 = trial(_F(-nmax) / mx)
    with np.errstate(divide="ignore", invalid="ignore"):
        scale = np.where(suml2 != 0, sumlx / suml2, _F(0))
    best = scale * sumlx
    for step in (*range(-9, 0), *range(1, 10)):
        l, sumlx, suml2 = trial(-(_F(nmax) + _F(0.1) * _F(step)) / mx)
        take = (suml2 > 0) & (sumlx * sumlx > best * suml2)
        with np.errstate(divide="ignore", invalid="ignore"):
            scale = np.where(take, sumlx / suml2, scale)
        best = np.where(take, scale * sumlx, best)
        L = np.where(take[:, None], l, L)
    L = np.where(zero[:, None], 0, L + nmax)
    return L, np.where(zero, _F(0), scale)


def _fp16(v: np.ndarray) -> np.ndarray:
    return v.astype(np.float16)


def _k_scales(x: np.ndarray, nmax: int, rmin: float, rdelta: float, nstep: int):
    """Q4_K / Q5_K: x (S, 256) -> codes L (S, 256) in [0, nmax], packed 6-bit scales and mins (S, 12) uint8,
    d and dmin (S,) fp16. Per block of 32: make_qkx2_quants weighted by rms(block) + |x|; the 8 scales and
    mins then quantized to 6 bits against the super-block's largest, and the codes recomputed with them."""
    S = x.shape[0]
    xb = x.reshape(S * 8, 32)
    av_x = np.sqrt(_sum(xb * xb) / _F(32))
    L, scales, mins = _make_qkx2_quants(xb, av_x[:, None] + np.abs(xb), nmax, rmin, rdelta, nstep)
    scales, mins, L = scales.reshape(S, 8), mins.reshape(S, 8), L.reshape(S, 8, 32)
    max_scale, max_min = np.maximum(scales.max(1), 0), np.maximum(mins.max(1), 0)  # (S,)
    with np.errstate(divide="ignore"):
        inv_scale = np.where(max_scale > 0, _F(63) / max_scale, _F(0))
        inv_min = np.where(max_min > 0, _F(63) / max_min, _F(0))
    ls = np.minimum(_nearest_int(inv_scale[:, None] * scales) & 0xFF, 63).astype(np.uint8)  # (S, 8) uint8_t, then MIN(63)
    lm = np.minimum(_nearest_int(inv_min[:, None] * mins) & 0xFF, 63).astype(np.uint8)
    packed = np.concatenate([ls[:, :4] | ((ls[:, 4:] >> 4) << 6), lm[:, :4] | ((lm[:, 4:] >> 4) << 6),
                             (ls[:, 4:] & 0xF) | ((lm[:, 4:] & 0xF) << 4)], axis=1)  # (S, 12)
    d, dmin = _fp16(max_scale / _F(63)), _fp16(max_min / _F(63))
    dl = d.astype(_F)[:, None] * ls.astype(_F)  # (S, 8)
    ml = dmin.astype(_F)[:, None] * lm.astype(_F)
    with np.errstate(divide="ignore", invalid="ignore"):
        requant = np.clip(_nearest_int((x.reshape(S, 8, 32) + ml[..., None]) / dl[..., None]), 0, nmax)
    L = np.where((dl != 0)[..., None], requant, L)  # a zero scale keeps make_qkx2_quants' codes
    return L.reshape(S, QK_K).astype(np.uint8), packed, d, dmin


def _halves(v: np.ndarray) -> np.ndarray:
    """fp16 (S,) -> its 2 bytes (S, 2), little endian as in the file."""
    return v.astype("<f2").view(np.uint8).reshape(-1, 2)


def quantize_q4_k(x: np.ndarray) -> np.ndarray:
    """x (S, 256) fp32 -> Q4_K blocks (S, 144): d, dmin (fp16), 12 bytes of 6-bit scales / mins, 128 bytes of codes
    (bytes 32 i + l: the codes of elements 64 i + l (low nibble) and 64 i + 32 + l (high))."""
    L, packed, d, dmin = _k_scales(x, 15, -1.0, 0.1, 20)
    L = L.reshape(-1, 4, 2, 32)
    qs = (L[:, :, 0] | (L[:, :, 1] << 4)).reshape(-1, 128)
    return np.concatenate([_halves(d), _halves(dmin), packed, qs], axis=1)


def quantize_q5_k(x: np.ndarray) -> np.ndarray:
    """x (S, 256) fp32 -> Q5_K blocks (S, 176): d, dmin, 12 bytes of scales / mins, 32 bytes of fifth bits (bit j
    of byte l: element 32 j + l), 128 bytes of low nibbles laid out as Q4_K's."""
    L, packed, d, dmin = _k_scales(x, 31, -0.5, 0.1, 15)
    L = L.reshape(-1, 8, 32)
    qh = np.zeros((L.shape[0], 32), np.uint8)
    for j in range(8):
        qh |= (L[:, j] >> 4) << j
    lo = (L & 0xF).reshape(-1, 4, 2, 32)
    qs = (lo[:, :, 0] | (lo[:, :, 1] << 4)).reshape(-1, 128)
    return np.concatenate([_halves(d), _halves(dmin), packed, qh, qs], axis=1)


def quantize_q6_k(x: np.ndarray) -> np.ndarray:
    """x (S, 256) fp32 -> Q6_K blocks (S, 210): 128 bytes of low nibbles, 64 of high 2-bit pairs, 16 int8 scales
    (one per 16 elements, against the super-block's largest |scale| as -128), d (fp16). Per 16: make_qx_quants."""
    S = x.shape[0]
    L, scales = _make_qx_quants(x.reshape(S * 16, 16), 32)
    L, scales = L.reshape(S, 16, 16), scales.reshape(S, 16)
    at = np.abs(scales).argmax(1)
    max_scale = scales[np.arange(S), at]  # (S,) the first of largest magnitude
    zero = np.abs(max_scale) < GROUP_MAX_EPS
    iscale = _F(-128) / np.where(zero, _F(1), max_scale)
    d = _fp16(_F(1) / iscale)
    sc = np.minimum(_nearest_int(iscale[:, None] * scales), 127).astype(np.int8)  # (S, 16)
    dl = d.astype(_F)[:, None] * sc.astype(_F)
    with np.errstate(divide="ignore", invalid="ignore"):
        requant = np.clip(_nearest_int(x.reshape(S, 16, 16) / dl[..., None]), -32, 31) + 32
    L = np.where((dl != 0)[..., None], requant, L).astype(np.uint8).reshape(S, 2, 4, 32)  # (half, quarter, l)
    ql = np.concatenate([(L[:, :, 0] & 0xF) | ((L[:, :, 2] & 0xF) << 4), (L[:, :, 1] & 0xF) | ((L[:, :, 3] & 0xF) << 4)], axis=2)
    qh = (L[:, :, 0] >> 4) | ((L[:, :, 1] >> 4) << 2) | ((L[:, :, 2] >> 4) << 4) | ((L[:, :, 3] >> 4) << 6)  # (S, 2, 32)
    out = np.concatenate([ql.reshape(S, 128), qh.reshape(S, 64), sc.view(np.uint8), _halves(d)], axis=1)
    out[zero] = 0  # an all-zero super-block: every byte 0
    return out


_K_QUANTIZERS = {"q4_k": quantize_q4_k, "q5_k": quantize_q5_k, "q6_k": quantize_q6_k}


def gguf_type(kind: str):
    """The GGMLQuantizationType of a block kind ("q4_k" -> Q4_K)."""
    from gguf import GGMLQuantizationType

    return GGMLQuantizationType[kind.upper()]


def quantize_gguf(w: Tensor | np.ndarray, kind: str) -> np.ndarray:
    """w (N, K) fp32 / bf16 -> (N, K / block * type bytes) uint8: the tensor's bytes in a GGUF file of block type
    `kind` (BLOCK_KINDS), row by row. K must be a multiple of block_size(kind); weights must be finite."""
    import gguf

    x = w.detach().float().cpu().numpy() if isinstance(w, Tensor) else np.asarray(w, dtype=_F)
    n, k = x.shape
    if kind not in BLOCK_KINDS:
        raise ConfigError(f"quantize_gguf: {kind!r} is not a GGUF block kind ({', '.join(BLOCK_KINDS)})")
    if k % block_size(kind):
        raise ConfigError(f"quantize_gguf: {kind} needs K a multiple of {block_size(kind)}, got ({n}, {k})")
    if not np.isfinite(x).all():
        raise ConfigError(f"quantize_gguf: the ({n}, {k}) weight holds inf or nan")
    if kind in _K_QUANTIZERS:
        return _K_QUANTIZERS[kind](np.ascontiguousarray(x).reshape(-1, QK_K)).reshape(n, -1)
    return gguf.quants.quantize(np.ascontiguousarray(x), gguf_type(kind))


def block_size(kind: str) -> int:
    """Inputs per block of a GGUF block kind: 32, or 256 for the K-quants' super-blocks."""
    return 256 if kind.endswith("_k") else 32


def layer_kind(in_features: int, kind: str) -> str | None:
    """The kind a layer of this input width gets: `kind`; q8_0 where a K-quant's 256-input super-blocks do not fit;
    None (kept in fp) where no 32-input block fits."""
    return next((k for k in (kind, "q8_0") if in_features % block_size(k) == 0), None)


def block_linear(linear: nn.Linear, kind: str):
    """A models.common.Linear on `linear`'s weight quantized to GGUF block type `kind` (its K must fit the type:
    layer_kind chooses the fallback), the bias kept in fp32, outputs in the weight's dtype (fp32 or bf16)."""
    from .kernels import quantized
    from .models.common import Linear

    w = linear.weight.detach()  # (N, K)
    if w.dtype not in (torch.float32, torch.bfloat16):
        raise ConfigError(f"weight-only quantization takes fp32 or bf16 weights, got {w.dtype}")
    n, k = w.shape
    if kind not in BLOCK_KINDS or k % block_size(kind):
        raise ConfigError(f"a {k}-wide input does not fit GGUF block type {kind!r} (K a multiple of 32, 256 for the K-quants)")
    qw = quantized.from_gguf(quantize_gguf(w, kind), gguf_type(kind), (n, k))
    layer = Linear.of_blocks(qw, None if linear.bias is None else linear.bias.detach(), w.dtype)
    return layer


def kind_of(layer: nn.Module) -> str:
    """The block kind of a layer on block weights ("q4_k")."""
    return layer.qweight.qtype.name.lower()


@dataclass
class QuantReport:
    """What quantize() did."""

    kind: str  # the block kind asked for (aliases resolved)
    layers: dict[str, int] = field(default_factory=dict)  # kind ("q8_0", "q4_k", ...) -> layers quantized so, "kept" -> left in fp
    bytes_before: int = 0  # bytes of the replaced weights
    bytes_after: int = 0  # bytes of their blocks


def quantize(module: nn.Module, kind: str = "q8_0", head: bool = True) -> QuantReport:
    """Replace every nn.Linear inside `module` (lm_head too unless head=False) by a models.common.Linear on GGUF
    block weights, in place, each layer of the kind layer_kind gives its input width. Layers already on block
    weights are left alone."""
    from .models.blocks import holds_blocks
    from .models.common import CausalLM, DraftModule

    config = check_quant(kind, next(module.parameters()).dtype)
    if config is None:
        raise ConfigError(f"quantize() needs a kind: {', '.join(KINDS)}")
    report = QuantReport(config.kind)
    targets = [(name, m) for name, m in module.named_modules() if isinstance(m, nn.Linear) and not holds_blocks(m)]
    for name, lin in targets:
        if name == "lm_head" and not head:
            continue
        kind = layer_kind(lin.in_features, config.kind)
        if kind is None:
            report.layers["kept"] = report.layers.get("kept", 0) + 1
            continue
        q = block_linear(lin, kind)
        parent_name, _, attr = name.rpartition(".")
        setattr(module.get_submodule(parent_name) if parent_name else module, attr, q)
        report.layers[kind] = report.layers.get(kind, 0) + 1
        report.bytes_before += lin.weight.numel() * lin.weight.element_size()
        report.bytes_after += q.qweight.nbytes
    # a folded MTP copy or a row stack of the old weights is stale (a draft vocabulary's head is keyed by its LM head)
    for m in module.modules():
        if isinstance(m, DraftModule):
            m.folded = None
        elif isinstance(m, CausalLM):
            m.row_stack = None
    return report


@dataclass
class Agreement:
    """Greedy agreement of a quantized model with the unquantized one over some prompts."""

    prompts: int
    new_tokens: int  # per prompt (the reference's greedy continuation)
    prefix_lengths: list[int]  # per prompt: leading tokens where both greedy continuations are equal
    match_rate: float  # teacher-forced: fraction of the reference's tokens the quantized model also ranks first

    @property
    def mean_prefix(self) -> float:
        return sum(self.prefix_lengths) / max(1, len(self.prefix_lengths))

    def to_json(self) -> dict:
        return {"prompts": self.prompts, "new_tokens": self.new_tokens, "prefix_lengths": self.prefix_lengths,
                "mean_prefix": self.mean_prefix, "match_rate": self.match_rate}


def greedy_agreement(reference, quantized, prompts: list[str], max_new_tokens: int = 64) -> Agreement:
    """reference, quantized: api.Model. Greedy continuations compared (prefix length), and the quantized model's
    teacher-forced top-1 match on the reference's continuation."""
    prefixes, hits, total = [], 0, 0
    for p in prompts:
        ref = reference.generate(p, max_new_tokens=max_new_tokens).tokens
        out = quantized.generate(p, max_new_tokens=max_new_tokens).tokens
        prefixes.append(next((i for i, (a, b) in enumerate(zip(ref, out)) if a != b), min(len(ref), len(out))))
        if not ref:
            continue
        ids = quantized.encode(p)
        seq = torch.tensor(ids + ref)  # (L + T,)
        with torch.inference_mode():
            logits = quantized.module.forward_tokens(seq[:-1], quantized.module.new_cache()).logits  # (L + T - 1, V)
        pred = logits[len(ids) - 1 :].argmax(-1)  # (T,) the quantized model's choice after each reference prefix
        hits += int((pred == seq[len(ids) :]).sum())
        total += len(ref)
    return Agreement(len(prompts), max_new_tokens, prefixes, hits / max(1, total))


__all__ = ["KINDS", "BLOCK_KINDS", "ALIASES", "QuantConfig", "check_quant", "quantize_gguf", "quantize_q4_k", "quantize_q5_k",
           "quantize_q6_k", "block_size", "gguf_type", "layer_kind", "block_linear", "kind_of", "QuantReport", "quantize",
           "Agreement", "greedy_agreement"]

"""Weight-only int8 / int4 quantization of a model's linear layers, on torch's CPU kernels.

A quantized model is another target: every drafter is verified against it, and speculation is lossless with respect
to it (its distance from the unquantized model: `greedy_agreement`).

- int8: per output channel, symmetric: w[n, k] ~ q[n, k] * s[n], q in [-127, 127], s = max_k |w[n, k]| / 127
  (rounded up to bf16, so no weight is clipped): |w - q s| <= s / 2 for every element (see quantize_int8).
  Kernel: torch._weight_int8pack_mm(x (M, K) bf16, q (N, K) int8, s (N,) bf16) -> (M, N) bf16. It needs
  K % 8 == 0 (else wrong rows from M = 3 on, or a crash): such a layer (stories260K's K = 172) keeps its fp weights.
- int4: per group of `group_size` input columns, asymmetric: w ~ (q - 8) s + z, q in [0, 15], s = (max - min) / 15.
  Kernel: torch.ops.aten._weight_int4pack_mm_for_cpu(x (M, K), packed (N, K/2) uint8, group_size, sz (K/g, N, 2)),
  packed by _convert_weight_to_int4pack_for_cpu; it takes N % 16 == 0 and K % group_size == 0 only: other layers
  (the DeltaNet's 4-row gate projections) are quantized int8 instead.

Activations go into the kernels in bf16, for fp32 models too: the fp32-activation paths are much slower than fp32
F.linear (docs/models.md#quantization). The kernels compute each row independently of M (bitwise, tested), so a
verify over k+1 rows scores each row as plain decoding does. Quantized: every nn.Linear, the MTP module's and lm_head
included; a tied embedding table stays in the model's dtype (a lookup has no arithmetic to save: the tie becomes two
copies); trained draft heads stay unquantized. fp64 models are refused (the kernels take fp32 / bf16 activations, and
fp64 is the rounding-free reference).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from .errors import ConfigError

KINDS = ("int8", "int4")
GROUP_SIZES = (32, 64, 128)  # what torch's int4 CPU kernel takes
ACT = torch.bfloat16  # activation dtype fed to the kernels (their fast path)


@dataclass(frozen=True)
class QuantConfig:
    kind: str  # "int8" (per-channel symmetric) or "int4" (per-group asymmetric)
    group_size: int = 64  # int4 only: input columns sharing one scale and zero point (32, 64 or 128)
    head: bool = True  # also quantize lm_head (the tied embedding table itself stays in the model's dtype)


def check_quant(kind, group_size: int = 64, dtype: torch.dtype | None = None) -> QuantConfig | None:
    """None (no quantization) or a QuantConfig; an unknown name or group size, or an fp64 model, is a ConfigError naming it."""
    if kind is None or kind == "none":
        return None
    if kind not in KINDS:
        raise ConfigError(f"unknown quant {kind!r} (choose int8 or int4, or none)")
    if kind == "int4" and group_size not in GROUP_SIZES:
        raise ConfigError(f"int4 group size must be one of {', '.join(map(str, GROUP_SIZES))} (torch's CPU kernel), got {group_size!r}")
    if dtype == torch.float64:
        raise ConfigError(f"quant {kind} does not combine with fp64: torch's int8 / int4 kernels take fp32 or bf16 "
                          "activations, and fp64 is the rounding-free reference mode; quantize an fp32 or bf16 model")
    return QuantConfig(kind, group_size)


def _round_up_bf16(x: Tensor) -> Tensor:
    """The smallest bf16 >= x (fp32 x): a scale rounded up never makes max |w| / s exceed the code range."""
    y = x.to(ACT)
    return torch.where(y.float() < x, torch.nextafter(y, torch.full_like(y, float("inf"))), y)


def quantize_int8(w: Tensor) -> tuple[Tensor, Tensor]:
    """w (N, K) -> q (N, K) int8, s (N,) bf16 with |w - q s| <= s / 2 exactly, elementwise.

    Proof: s >= max_k |w[n, k]| / 127 (rounded up), so |w / s| <= 127 and q = round(w / s) needs no clipping;
    the quotient is formed in fp64 from fp32 / bf16 inputs, whose distance to a half-integer is either 0 (a tie:
    either neighbour is within s / 2) or at least 2^-25 (w and (m + 1/2) s lie on a grid of 2^(e_s - 24)),
    far above fp64's quotient error (127.5 * 2^-53); so q is a nearest integer to w / s and |w / s - q| <= 1/2."""
    w = w.detach().float()
    s = _round_up_bf16(w.abs().amax(dim=1) / 127)  # (N,)
    s = torch.where(s == 0, torch.ones_like(s), s)  # an all-zero row: any scale, q = 0
    q = torch.round(w.double() / s.double()[:, None]).clamp_(-127, 127).to(torch.int8)  # (N, K)
    return q, s


def quantize_int4(w: Tensor, group_size: int) -> tuple[Tensor, Tensor]:
    """w (N, K) -> codes (N, K) uint8 in [0, 15], sz (K / g, N, 2) bf16 [scale, zero]: w ~ (codes - 8) * scale + zero.

    scale = (max - min) / 15 of each group rounded up to bf16, zero = min + 8 scale rounded to bf16: every weight
    lies within half a zero-ulp of [zero - 8 s, zero + 7 s], so |w - deq(w)| <= s / 2 + ulp(zero) / 2 (tests check)."""
    n, k = w.shape
    wg = w.detach().float().view(n, k // group_size, group_size)  # (N, G, g)
    mn, mx = wg.amin(-1), wg.amax(-1)  # (N, G)
    s = _round_up_bf16(((mx - mn) / 15).clamp(min=torch.finfo(torch.float32).tiny))
    z = (mn + 8 * s.float()).to(ACT)  # (N, G)
    codes = torch.round((wg.double() - z.double()[..., None]) / s.double()[..., None] + 8).clamp_(0, 15)
    sz = torch.stack([s, z], -1).transpose(0, 1).contiguous()  # (G, N, 2)
    return codes.view(n, k).to(torch.uint8), sz


def int4_fits(out_features: int, in_features: int, group_size: int) -> bool:
    """What _convert_weight_to_int4pack_for_cpu / the int4 kernel accept."""
    return out_features % 16 == 0 and in_features % group_size == 0


def int8_fits(in_features: int) -> bool:
    """What torch._weight_int8pack_mm computes correctly (K % 8 != 0: wrong rows, or a crash, from M = 3 rows)."""
    return in_features % 8 == 0


def layer_kind(out_features: int, in_features: int, config: QuantConfig) -> str | None:
    """The kind a layer of this shape gets: config.kind, int8 where int4's kernel cannot take it, None (kept) where neither can."""
    if config.kind == "int4" and int4_fits(out_features, in_features, config.group_size):
        return "int4"
    return "int8" if int8_fits(in_features) else None


class QuantLinear(nn.Module):
    """y = x W^T + b with W stored int8 (per-channel scales) or int4 (per-group scale and zero); x goes to the kernel in bf16.

    Reading `.weight` returns the dequantized W (N, K) in the model's dtype, built once and kept (the MTP drafter's
    folded copy and the draft-vocabulary head read it); the forward never does."""

    def __init__(self, linear: nn.Linear, config: QuantConfig) -> None:
        super().__init__()
        w = linear.weight.detach()  # (N, K)
        if w.dtype not in (torch.float32, torch.bfloat16):
            raise ConfigError(f"weight-only quantization takes fp32 or bf16 weights, got {w.dtype}")
        self.in_features, self.out_features = linear.in_features, linear.out_features
        self.out_dtype = w.dtype
        kind = layer_kind(self.out_features, self.in_features, config)
        if kind is None:
            raise ConfigError(f"torch's int8 / int4 kernels cannot take a {self.in_features}-wide input (K % 8 != 0)")
        self.kind, self.group_size = kind, config.group_size if kind == "int4" else 0
        if kind == "int8":
            q, s = quantize_int8(w)
            self.register_buffer("qweight", q)  # (N, K) int8
            self.register_buffer("scales", s)  # (N,) bf16
        else:
            codes, sz = quantize_int4(w, config.group_size)
            self.register_buffer("codes", (codes[:, 0::2] | (codes[:, 1::2] << 4)).contiguous())  # (N, K/2): even k low nibble
            self.register_buffer("packed", torch.ops.aten._convert_weight_to_int4pack_for_cpu(codes.to(torch.int32), 1))  # (N, K/2) kernel layout
            self.register_buffer("scales_zeros", sz)  # (K/g, N, 2) bf16
        self.bias = None if linear.bias is None else nn.Parameter(linear.bias.detach().clone(), requires_grad=False)
        self._dequantized: Tensor | None = None

    def forward(self, x: Tensor) -> Tensor:
        shape = x.shape
        x2 = x.reshape(-1, self.in_features).to(ACT)  # (M, K) the kernels take 2-D bf16
        if self.kind == "int8":
            y = torch._weight_int8pack_mm(x2, self.qweight, self.scales)  # (M, N) bf16
        else:
            y = torch.ops.aten._weight_int4pack_mm_for_cpu(x2, self.packed, self.group_size, self.scales_zeros)  # (M, N)
        y = y.to(self.out_dtype)
        if self.bias is not None:
            y = y + self.bias
        return y.view(*shape[:-1], self.out_features)

    def dequantize(self, dtype: torch.dtype = torch.float64) -> Tensor:
        """The weight the kernel multiplies by, (N, K) in `dtype` (fp64: exact for int8, and for int4's (q - 8) s + z
        up to fp64 rounding)."""
        if self.kind == "int8":
            return (self.qweight.to(torch.float64) * self.scales.to(torch.float64)[:, None]).to(dtype)
        lo, hi = self.codes & 15, self.codes >> 4  # (N, K/2) each
        codes = torch.stack([lo, hi], -1).view(self.out_features, self.in_features).to(torch.float64)
        s, z = self.scales_zeros.to(torch.float64).unbind(-1)  # (G, N) each
        g = self.group_size
        return ((codes - 8) * s.t().repeat_interleave(g, 1) + z.t().repeat_interleave(g, 1)).to(dtype)

    @property
    def weight(self) -> Tensor:
        if self._dequantized is None:
            self._dequantized = self.dequantize(self.out_dtype)
        return self._dequantized

    def extra_repr(self) -> str:
        g = f", group_size={self.group_size}" if self.kind == "int4" else ""
        return f"{self.in_features} -> {self.out_features}, {self.kind}{g}, bias={self.bias is not None}"


@dataclass
class QuantReport:
    """What quantize() did."""

    kind: str
    group_size: int
    layers: dict[str, int] = field(default_factory=dict)  # "int8" / "int4" -> layers quantized so, "kept" -> left in fp
    bytes_before: int = 0  # bytes of the replaced weights
    bytes_after: int = 0  # bytes of their codes, scales (and int4's unpacked codes)


def quantize(module: nn.Module, kind: str = "int8", group_size: int = 64, head: bool = True) -> QuantReport:
    """Replace every nn.Linear inside `module` (lm_head too unless head=False) by a QuantLinear, in place."""
    config = check_quant(kind, group_size, next(module.parameters()).dtype)
    if config is None:
        raise ConfigError("quantize() needs a kind: int8 or int4")
    report = QuantReport(config.kind, config.group_size if config.kind == "int4" else 0)
    targets = [(name, m) for name, m in module.named_modules() if isinstance(m, nn.Linear)]
    for name, lin in targets:
        if name == "lm_head" and not head:
            continue
        if layer_kind(lin.out_features, lin.in_features, config) is None:
            report.layers["kept"] = report.layers.get("kept", 0) + 1
            continue
        q = QuantLinear(lin, config)
        parent_name, _, attr = name.rpartition(".")
        setattr(module.get_submodule(parent_name) if parent_name else module, attr, q)
        report.layers[q.kind] = report.layers.get(q.kind, 0) + 1
        report.bytes_before += lin.weight.numel() * lin.weight.element_size()
        report.bytes_after += sum(b.numel() * b.element_size() for b in q.buffers())
    for m in module.modules():  # copies derived from the old weights (folded MTP, draft-vocabulary heads) are stale
        m.__dict__.pop("_fused_mtp", None)
        m.__dict__.pop("_draft_heads", None)
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
    """reference, quantized: api.Model. Greedy continuations of both, compared (prefix length), and the quantized
    model scored on the reference's continuation (teacher-forced top-1 match: one forward over prompt + continuation)."""
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


__all__ = ["KINDS", "GROUP_SIZES", "QuantConfig", "check_quant", "quantize_int8", "quantize_int4", "layer_kind", "QuantLinear",
           "QuantReport", "quantize", "Agreement", "greedy_agreement"]

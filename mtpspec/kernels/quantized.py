"""Linear layers from a GGUF file's weights, kept in their block types (F32, F16, BF16, Q8_0, Q4_0, Q5_0, Q4_K, Q5_K, Q6_K).

gguf_blocks.cpp multiplies the blocks directly: from_gguf() re-lays a weight out once into panels of 16 outputs
(layout "panels16"), and linear() streams them once per call whatever the number of rows, split between torch's
threads; linear_many() does several weights that read one input (q, k, v) in one such call. Activations are quantized
to 8 bits per 32 inputs (scale max|x|/127) and multiplied in integers, as llama.cpp's CPU kernels do (slightly off a
float product with the dequantized weight). Each output is the same operations whatever shares the call, so linear()
is row-invariant bitwise; dequantize() and embedding() are exact (bit for bit gguf.quants.dequantize). Float types are
widened to fp32 for the panel kernel (mtpspec.kernels).
Without a compiler, or with MTPSPEC_KERNELS=0, every type keeps GGUF's row order (layout "rows") and linear() is
F.linear on the dequantized weight (kept after the first call).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

import gguf
import numpy as np
import torch
import torch.nn.functional as F
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType as QT
from torch import Tensor

from . import Extension
from . import available as panel_kernel_available
from . import pack as pack_panels
from . import packed_linear, MAX_ROWS

BLOCK_TYPES = (QT.Q8_0, QT.Q4_0, QT.Q5_0, QT.Q4_K, QT.Q5_K, QT.Q6_K)  # multiplied in their blocks
FLOAT_TYPES = (QT.F32, QT.F16, QT.BF16)  # widened to fp32
TYPES = BLOCK_TYPES + FLOAT_TYPES
PANEL = 16  # outputs per panel of the "panels16" layout

_ops: dict[str, object] = {}  # the kernel's ops, looked up once


def _ready() -> None:
    torch.library.register_fake("mtpspec_gguf::linear")(lambda x, data, qtype, n: x.new_empty(x.shape[0], n))
    torch.library.register_fake("mtpspec_gguf::dequantize")(
        lambda data, qtype, n, k, ids: data.new_empty(n if ids is None else ids.shape[0], k, dtype=torch.float32))
    torch.library.register_fake("mtpspec_gguf::linear_many")(lambda x, data, qtypes, ns: x.new_empty(x.shape[0], sum(ns)))
    _ops["linear"] = torch.ops.mtpspec_gguf.linear.default
    _ops["linear_many"] = torch.ops.mtpspec_gguf.linear_many.default


_EXT = Extension("mtpspec_gguf_blocks", "gguf_blocks.cpp", "gguf", "quantized linear layers run on dequantized weights "
                 "with torch's F.linear (slower, more memory)", _ready)


def available() -> bool:
    """Build (or load the cached build of) gguf_blocks.cpp once per process; False, with a warning, if that fails."""
    return _EXT.available()


def isa() -> str:
    """The instruction set the block kernel was built for: "avx512vnni", "avx2" or "scalar" ("none" without it)."""
    return str(torch.ops.mtpspec_gguf.isa()) if available() else "none"


@dataclass(eq=False)
class QuantizedWeight:
    """One (N out, K in) weight of a GGUF file in its block type. data: uint8, layout "panels16" (ceil(N/16),
    K/block, bytes per 16 blocks) or "rows" (GGUF's bytes, (N, K/block * type bytes)); dense: the fp32 weight where
    kept (no kernel for it); panels: the fp32 panel kernel's panels of a float type."""

    qtype: QT
    shape: tuple[int, int]
    data: Tensor
    layout: str
    dense: Tensor | None = field(default=None, repr=False)
    panels: Tensor | None = field(default=None, repr=False)

    @property
    def nbytes(self) -> int:
        return self.data.numel()


def _as_bytes(raw) -> np.ndarray:
    if isinstance(raw, Tensor):
        raw = raw.detach().cpu().contiguous().view(torch.uint8).numpy() if raw.numel() else raw.cpu().numpy()
    return np.ascontiguousarray(raw).reshape(-1).view(np.uint8)


def from_gguf(raw, qtype, shape) -> QuantizedWeight:
    """A weight from its GGUF bytes: raw a numpy array or tensor holding the tensor's data as in the file (any dtype,
    read as bytes), qtype a GGMLQuantizationType (or its int), shape (N out, K in) (GGUF lists it as (K, N))."""
    qtype = QT(int(qtype))
    if qtype not in TYPES:
        raise ValueError(f"from_gguf: block type {qtype.name} is not supported (supported: {', '.join(t.name for t in TYPES)})")
    n, k = (int(s) for s in shape)
    bs, ts = GGML_QUANT_SIZES[qtype]
    if n <= 0 or k <= 0 or k % bs:
        raise ValueError(f"from_gguf: shape ({n}, {k}) does not fit {qtype.name}: K must be a positive multiple of {bs}")
    b = _as_bytes(raw)
    if b.size != n * (k // bs) * ts:
        raise ValueError(f"from_gguf: {qtype.name} ({n}, {k}) takes {n * (k // bs) * ts} bytes, got {b.size}")
    rows = torch.from_numpy(b.copy()).view(n, -1)  # (N, row bytes)
    if qtype in FLOAT_TYPES:
        w = QuantizedWeight(qtype, (n, k), rows, "rows")
        dense = dequantize(w)  # (N, K)
        if panel_kernel_available():
            w.panels = pack_panels(dense)  # (ceil(N/32), K, 32)
        else:
            w.dense = dense
        return w
    if available():
        return QuantizedWeight(qtype, (n, k), torch.ops.mtpspec_gguf.pack(rows, int(qtype), n, k), "panels16")
    return QuantizedWeight(qtype, (n, k), rows, "rows")


def q8_0(w: Tensor) -> QuantizedWeight:
    """w (N, K) float, K a multiple of 32 -> the weight as Q8_0 blocks (gguf's reference quantizer), on the kernel."""
    n, k = w.shape
    raw = gguf.quants.quantize(np.ascontiguousarray(w.detach().float().numpy()), QT.Q8_0)
    return from_gguf(raw, QT.Q8_0, (n, k))


def _rows_dequantize(w: QuantizedWeight, ids: Tensor | None) -> Tensor:
    """gguf's numpy reference (and the float types' exact widening) on layout "rows"."""
    n, k = w.shape
    raw = w.data.numpy()
    if ids is not None:
        raw = raw[ids.numpy()]
    if w.qtype == QT.BF16:  # a bfloat16 is the top half of a float32: widening is exact
        return torch.from_numpy(np.ascontiguousarray(raw)).view(torch.int16).to(torch.int32).bitwise_left_shift(16).view(torch.float32).view(-1, k)
    out = gguf.quants.dequantize(np.ascontiguousarray(raw), w.qtype)
    return torch.from_numpy(np.ascontiguousarray(out, dtype=np.float32)).view(-1, k)


def dequantize(w: QuantizedWeight) -> Tensor:
    """The fp32 weight (N, K): bit for bit gguf.quants.dequantize of the file's bytes."""
    n, k = w.shape
    if w.layout == "panels16":
        return torch.ops.mtpspec_gguf.dequantize(w.data, int(w.qtype), n, k, None)
    return _rows_dequantize(w, None)


def embedding(w: QuantizedWeight, ids: Tensor) -> Tensor:
    """The rows `ids` (any shape, int) of the weight dequantized exactly: (ids.numel(), K), an embedding lookup."""
    n, k = w.shape
    flat = ids.reshape(-1).to(torch.long)
    if not torch.compiler.is_compiling() and flat.numel() and (int(flat.min()) < 0 or int(flat.max()) >= n):
        raise IndexError(f"embedding: ids must lie in 0..{n - 1}, got {int(flat.min())}..{int(flat.max())}")
    if w.layout == "panels16":
        return torch.ops.mtpspec_gguf.dequantize(w.data, int(w.qtype), n, k, flat)
    return _rows_dequantize(w, flat)


def linear(x: Tensor, w: QuantizedWeight) -> Tensor:
    """x (M, K) float32 -> x @ W^T (M, N) float32, row-invariant bitwise (see the module's docstring); leading
    dimensions of x beyond one are kept."""
    n, k = w.shape
    if w.layout == "panels16" and x.dim() == 2 and x.shape[1] == k and x.dtype == torch.float32 and x.is_contiguous():
        return _ops["linear"](x, w.data, w.qtype.value, n)  # the decode step's call, without the checks below
    if x.shape[-1] != k:
        raise ValueError(f"linear: x has {x.shape[-1]} inputs, the weight takes {k}")
    if x.dtype != torch.float32:
        raise TypeError(f"linear: x must be float32, got {x.dtype}")
    flat = x.reshape(-1, k)
    if w.layout == "panels16":
        y = torch.ops.mtpspec_gguf.linear(flat.contiguous(), w.data, int(w.qtype), n)  # (M, N)
    elif w.panels is not None:
        y = torch.cat([packed_linear(part, w.panels, n) for part in flat.split(MAX_ROWS)]) if flat.shape[0] else flat.new_empty(0, n)
    else:
        if w.dense is None:
            w.dense = dequantize(w)
        y = F.linear(flat, w.dense)
    return y.view(*x.shape[:-1], n)


def linear_many(x: Tensor, weights: Sequence[QuantizedWeight]) -> Tensor:
    """x (M, K) float32 -> (M, sum of the weights' N): linear(x, w) for each weight side by side, bitwise the same.
    For weights that read one input (q, k, v; gate, up): on "panels16" weights one kernel call quantizes x once and
    splits all their panels between the threads at once; otherwise (a "rows" weight, other x) torch.cat of linear()."""
    if not weights:
        raise ValueError("linear_many: no weights")
    k = weights[0].shape[1]
    if x.dim() == 2 and x.shape[1] == k and x.dtype == torch.float32 and x.is_contiguous():
        data, qtypes, ns = [], [], []
        for w in weights:  # one pass: this runs per layer per step
            if w.layout != "panels16" or w.shape[1] != k:
                break
            data.append(w.data)
            qtypes.append(w.qtype.value)
            ns.append(w.shape[0])
        else:
            return _ops["linear_many"](x, data, qtypes, ns)
    return torch.cat([linear(x, w) for w in weights], dim=-1)


def quantize_activations(x: Tensor) -> tuple[Tensor, Tensor]:
    """What linear() multiplies a block type's weight by: x (M, K) float32 -> (q int8 (M, K), scale float32 (M, K/32)),
    x ~ q * scale per 32 inputs. Needs the block kernel."""
    if not available():
        raise RuntimeError(f"quantize_activations: the GGUF block kernel is not available ({_EXT.error})")
    return torch.ops.mtpspec_gguf.quantize_activations(x.contiguous())

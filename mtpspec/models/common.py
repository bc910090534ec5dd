"""Building blocks shared by the decoders: RMSNorm, rotary embedding, attention, SwiGLU MLP."""

from __future__ import annotations

import threading

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from .. import kernels
from ..kernels import quantized
from ..kernels.quantized import QuantizedWeight
from ..kernels.rownorm import rms_norm
from ..weight_cache import weights_version
from .attention import scale_inv_freq


class CausalLM(nn.Module):
    """What every target and draft model shares: `config` (with max_seq_len, vocab_size), `model.embed_tokens`,
    `lm_head`; subclasses add new_cache() and forward_tokens(tokens, cache) -> TargetOutput (forward.run)."""

    compiled_step = None  # its compiled decode step (compiled.compile_model), or None: eager
    row_stack = None  # forward.RowStack once built (False: its layers do not fit the kernel), or None: not yet
    default_head = None  # the folder of a head trained for this model's file (loading.default_head), or None

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
        """Empty rotary tables on the CPU (non-persistent buffers: a model built on the meta device has none); they grow
        with use."""
        for m in rotaries(self):
            m.reset()

    def head(self, hidden: Tensor) -> Tensor:
        """Logits in at least fp32: fp32 for fp32 / bf16 models (a bf16 model's logits are bf16 values), fp64 for fp64 ones."""
        if isinstance(self.lm_head, Linear):
            return self.lm_head.wide(hidden)
        logits = self.lm_head(hidden)
        return logits.to(wide(logits.dtype))


class DraftModule(nn.Module):
    """What every MTP / EAGLE module holds beside its weights: copies derived from them, each rebuilt by its reader
    when the weights change (not submodules: state_dict and .to() leave them alone)."""

    compiled_step = None  # its compiled step (compiled.CompiledDraftStep), or None: eager
    folded = None  # (weights_version, fused_mtp.FusedMTP): its folded decode copy, or None: not built
    fused_version = None  # the weights_version its projections were fused at (forward.fused_for_decoding), or None


class Linear(nn.Linear):
    """y = x W^T (+ b): every model's linear layer. It holds one of two weights, and its forward picks the kernel:

    - dense: nn.Linear's `weight` Parameter (same parameters, same state dict). Inference products of a few fp32 /
      bf16 rows run on the panel kernel (mtpspec.kernels: the weight read once at full bandwidth, row-invariant
      results); training, prefill and other dtypes run F.linear as nn.Linear does.
    - GGUF blocks: `qweight`, a kernels.quantized.QuantizedWeight (a GGUF file's, or mtpspec.quant's), made by
      of_blocks(). The block kernel computes in fp32 (x widened exactly, y rounded back to x's dtype), each row
      alone; the state dict holds the bias only (fp32), and `.weight` is the dequantized W, built on each read.

    Copies derived from the dense weight, each with the weights' version it was made from and rebuilt by its reader
    when that changes (not parameters: state_dict and .to() leave them alone): `panels`, the kernel's layout of W;
    `fused`, the weights of this layer and the siblings that read the same input concatenated (forward._fuse).
    """

    qweight: QuantizedWeight | None = None  # GGUF block weights (of_blocks), or None: the dense `weight`
    panels: tuple | None = None  # (weights_version, kernels.pack(W)), or None: not packed yet
    fused: tuple | None = None  # (W, bias, panels) of this layer and its siblings concatenated, or None

    @classmethod
    def of_blocks(cls, qweight: QuantizedWeight, bias: Tensor | None = None, dtype: torch.dtype = torch.float32) -> Linear:
        """A Linear on GGUF block weights (no dense weight allocated); the bias kept in fp32; dtype: the model's,
        what `.weight` dequantizes to (fp32 for a GGUF file's model)."""
        self = cls.__new__(cls)
        nn.Module.__init__(self)
        self.out_features, self.in_features = qweight.shape
        self.qweight, self.weight_dtype = qweight, dtype
        self.register_parameter("bias", None if bias is None else nn.Parameter(bias.detach().float(), requires_grad=False))
        return self

    @property
    def weight(self) -> Tensor:
        """The dense Parameter, or the block weights dequantized exactly (N, K) in the model's dtype: for code that
        derives copies from a layer's weight (a folded MTP module, a draft-vocabulary head)."""
        w = self._parameters.get("weight")
        if w is not None:
            return w
        q = self.qweight
        if q is None:
            raise AttributeError("'Linear' object has no attribute 'weight'")
        return quantized.dequantize(q).to(self.weight_dtype)

    def rows(self, ids: Tensor) -> Tensor:
        """The weight's rows `ids` (n, K) in the model's dtype, without dequantizing the others (a draft vocabulary's
        rows of an LM head)."""
        q = self.qweight
        return self._parameters["weight"].detach()[ids] if q is None else quantized.embedding(q, ids).to(self.weight_dtype)

    def forward(self, x: Tensor) -> Tensor:
        q = self.qweight
        if q is not None:
            return self._blocks(x, q)
        w = self._parameters["weight"]
        if not kernels.usable(x, w):
            return F.linear(x, w, self.bias)
        return kernels.packed_linear(x, self.packed(), self.out_features, self.bias)

    def packed(self) -> Tensor:
        """The dense weight's panels: packed on first use and whenever the weight changes. Inside a compiled graph
        they are read as they are (the compiled step packs them before tracing, fuse_projections)."""
        if torch.compiler.is_compiling():
            return self.panels[1]
        w = self._parameters["weight"]
        key = weights_version([w])
        if self.panels is None or self.panels[0] != key:
            self.panels = (key, kernels.pack(w))
        return self.panels[1]

    def wide(self, x: Tensor) -> Tensor:
        """forward(x) in at least fp32 (the logits of an LM head): the same values, without converting a bf16 result
        twice on the kernel's path."""
        q = self.qweight
        if q is not None:
            y = self._blocks(x, q)
            return y.to(wide(y.dtype))
        w = self._parameters["weight"]
        if not kernels.usable(x, w):
            y = F.linear(x, w, self.bias)
            return y.to(wide(y.dtype))
        return kernels.packed_linear(x, self.packed(), self.out_features, self.bias, widen=True)

    def _blocks(self, x: Tensor, q: QuantizedWeight) -> Tensor:
        """The block kernel's product (fp32, + the fp32 bias) in x's dtype."""
        y = quantized.linear(x if x.dtype == torch.float32 else x.float(), q)  # (..., N) fp32
        if self.bias is not None:
            y = y + self.bias
        return y if y.dtype == x.dtype else y.to(x.dtype)

    def extra_repr(self) -> str:
        q = self.qweight
        if q is None:
            return super().extra_repr()
        return f"in_features={self.in_features}, out_features={self.out_features}, {q.qtype.name}, bias={self.bias is not None}"


def wide(dtype: torch.dtype) -> torch.dtype:
    """The dtype to compute in: at least fp32 (bf16 / fp16 -> fp32), the input's own when wider (fp64)."""
    return torch.promote_types(dtype, torch.float32)


class RMSNorm(nn.Module):
    """y = x / rms(x) * w, or * (1 + w) for the zero-centred norms of Qwen3-Next / Qwen3.5."""

    def __init__(self, dim: int, eps: float = 1e-6, zero_centred: bool = False, row_kernel: bool = False) -> None:
        super().__init__()
        self.eps = eps
        self.zero_centred = zero_centred
        self.row_kernel = row_kernel  # fp32 without autograd by kernels/rownorm.cpp: one call, each row alone
        self.weight = nn.Parameter(torch.zeros(dim) if zero_centred else torch.ones(dim))

    def forward(self, x: Tensor) -> Tensor:
        if (self.row_kernel and x.dtype == self.weight.dtype == torch.float32
                and not (torch.is_grad_enabled() and (x.requires_grad or self.weight.requires_grad))):
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

    The `cos` / `sin` buffers (n, rot) cover positions 0..n-1 and grow with use (`tables(dtype, n)`: at least doubling,
    up to max_len), so a model holds the tables of the positions it has reached, not of its whole context. They are
    computed in fp32 (as transformers computes them) and cast to the input's dtype; an fp64 input uses tables computed
    in fp64. Every operation is elementwise, so a position's entry is bitwise the same whatever the table's size or
    how it grew (tested). A compiled graph reads them whole (`whole`, before tracing: a graph never grows them).
    """

    FIRST = 256  # positions of a table's first growth

    def __init__(self, rot_dim: int, max_len: int, theta: float, scaling: dict | None = None) -> None:
        super().__init__()
        self.rot_dim, self.max_len, self.theta = rot_dim, max_len, theta
        self.scaling = scaling  # rope scaling (linear / llama3), see scale_inv_freq
        self.register_buffer("cos", torch.empty(0, rot_dim), persistent=False)  # (n, rot) positions 0..n-1
        self.register_buffer("sin", torch.empty(0, rot_dim), persistent=False)
        # cos, sin computed in fp64 for fp64 inputs; not buffers, so module.to() / to_empty() leave them alone
        self.fp64: tuple[Tensor, Tensor] | None = None

    def reset(self) -> None:
        """Empty tables on the CPU (a model built on the meta device has none); they grow again with use."""
        self.cos, self.sin = torch.empty(0, self.rot_dim), torch.empty(0, self.rot_dim)
        self.fp64 = None

    def rows(self, start: int, end: int, dtype: torch.dtype) -> tuple[Tensor, Tensor]:
        """cos, sin (end - start, rot) of positions start..end-1, computed in `dtype` (fp32 or fp64) on the CPU."""
        inv_freq = 1.0 / (self.theta ** (torch.arange(0, self.rot_dim, 2, dtype=torch.int64).to(dtype) / self.rot_dim))
        inv_freq = scale_inv_freq(inv_freq, self.scaling)  # (rot/2,)
        freqs = torch.outer(torch.arange(start, end).to(dtype), inv_freq)  # (end - start, rot/2)
        emb = torch.cat([freqs, freqs], dim=-1)  # (end - start, rot)
        return emb.cos(), emb.sin()

    def _grown(self, cos: Tensor, sin: Tensor, n: int, dtype: torch.dtype) -> tuple[Tensor, Tensor]:
        """cos, sin extended past n positions (computed in `dtype`, stored in the old tables' dtype and device)."""
        have = sin.shape[0]
        size = min(self.max_len, max(n, 2 * have, self.FIRST))
        with torch.inference_mode(False), torch.no_grad():  # plain tensors even under inference mode: training reads them
            c, s = self.rows(have, size, dtype)
            c, s = c.to(cos.device, cos.dtype), s.to(sin.device, sin.dtype)
            return (torch.cat([cos, c]), torch.cat([sin, s])) if have else (c, s)

    def tables(self, dtype: torch.dtype, n: int | None = None) -> tuple[Tensor, Tensor]:
        """cos, sin (at least n positions, rot; all max_len when n is None) for inputs of `dtype`: the buffers, or fp64
        tables computed in fp64. Grown, never shrunk: sin is stored last, so a table as long as n has its cos too."""
        n = self.max_len if n is None else min(n, self.max_len)
        if dtype == torch.float64:
            t = self.fp64
            if t is None or t[1].shape[0] < n:
                empty = torch.empty(0, self.rot_dim, dtype=torch.float64)
                with _GROWING:
                    t = self.fp64 or (empty, empty)
                    if t[1].shape[0] < n:
                        t = self.fp64 = self._grown(*t, n, torch.float64)
            return t
        if self.sin.shape[0] < n:
            with _GROWING:  # one thread grows it; another that waited finds it long enough
                if self.sin.shape[0] < n:
                    self.cos, self.sin = self._grown(self.cos, self.sin, n, torch.float32)
        return self.cos, self.sin

    def whole(self) -> None:
        """Every position's tables (a compiled graph's input: traced code must never grow them)."""
        self.tables(self.cos.dtype)


_GROWING = threading.Lock()  # shared by every Rotary: a lock per module would not survive copy.deepcopy


def rotaries(module: nn.Module) -> list[Rotary]:
    """The Rotary modules a model's layers use: registered ones and those shared by reference (`layer.rotary = [r]`)."""
    found: dict[int, Rotary] = {}
    for m in module.modules():
        shared = getattr(m, "rotary", None)
        for r in [m, *(shared if isinstance(shared, list) else ())]:
            if isinstance(r, Rotary):
                found[id(r)] = r
    return list(found.values())


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

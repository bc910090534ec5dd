"""A matrix product for a few rows: the decode step's and the verify pass's linear layers, fp32 or bf16 on CPU.

At batch 1 reading the weights is the whole cost, and torch's BLAS path reads a row-major weight at a fraction of
the memory bandwidth. small_linear.cpp keeps each weight in panels (N/32, K, 32) read once per call whatever the
number of rows, so a verify over k+1 rows costs little more than one step; each output is the same FMA chain over
k in order however many rows share the call (row-invariant, bitwise). bf16 weights stay bf16 (half the bytes) and
accumulate in fp32, multiplied in pairs by vdpbf16ps where the CPU has AVX512_BF16 (bf16_pairs()). Panels are
split between torch's threads; each output is one thread's chain.

Built on first use with torch's extension builder (g++ with OpenMP, once per machine, under $MTPSPEC_KERNEL_CACHE,
default ~/.cache/mtpspec/kernels, in a folder per instruction set). Without a compiler, with MTPSPEC_KERNELS=0, or
inside `torch_path()`, products run on F.linear: same results up to rounding, slower. models.common.Linear takes the
kernel when usable() (fp32 / bf16 CPU tensors, up to MAX_ROWS rows, outside autograd) and F.linear otherwise; a model
on another device (mtpspec.device) never reaches a kernel. Every kernel of this package (panels, GGUF blocks, row
norms, row attention) answers available() through Extension, so one switch turns them all off.
"""

from __future__ import annotations

import contextlib
import hashlib
import os
import platform
import threading
import warnings
from pathlib import Path

import torch
from torch import Tensor


P = 32  # outputs per panel (small_linear.cpp)
DTYPES = (torch.float32, torch.bfloat16)  # x and weight of one of these (bf16 accumulates in fp32)
MAX_ROWS = 64  # up to here the panel kernel beat MKL on every fp32 shape measured (docs/engine.md); prefill goes to MKL

_state: dict[str, object] = {}  # "pairs": whether the build multiplies bf16 weights in pairs
_thread = threading.local()  # .torch: inside torch_path() (per thread: a server's other threads keep their kernels)


@contextlib.contextmanager
def torch_path(on: bool = True):
    """Inside (with on=True): every kernel of this package reports itself unavailable, so models built and run here
    take torch's ops (F.linear, dequantized GGUF blocks, torch norms and attention) on the CPU, as on a CUDA device:
    the path a GPU runs, testable on a CPU. on=False leaves things as they are (an outer torch_path stays on). A model
    whose layouts were packed for the kernels outside keeps reading them. Per thread."""
    before = getattr(_thread, "torch", False)
    _thread.torch = before or on
    try:
        yield
    finally:
        _thread.torch = before


def cache_dir() -> Path:
    return Path(os.environ.get("MTPSPEC_KERNEL_CACHE", Path.home() / ".cache" / "mtpspec" / "kernels"))


def _cpu_tag() -> str:
    """Names the build folder: a -march=native build must not be loaded on another CPU."""
    flags = platform.machine()
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith(("flags", "Features")):
                flags += line.split(":", 1)[1]
                break
    except OSError:
        pass
    return hashlib.sha256(flags.encode()).hexdigest()[:12]


EXACT_CFLAGS = ("-O3", "-march=native", "-fopenmp", "-ffp-contract=off")  # no fused multiply-adds: exactness counts roundings


def build_extension(name: str, source: str, subdir: str, cflags: tuple[str, ...] = EXACT_CFLAGS) -> None:
    """Compile (or load the cached build of) `source` beside this module as the torch extension `name`, under
    cache_dir() in a folder for this CPU, torch version and source text (`subdir` below it): two checkouts of the
    same source share one build, and neither rebuilds the other's. Raises what the build raises."""
    from torch.utils.cpp_extension import load

    build = build_dir(source, subdir, cflags)
    build.mkdir(parents=True, exist_ok=True)
    copy = build / source  # compiled from here: the build names its source's path, and a checkout's own path
    if not copy.exists():  # would make every other checkout's process rebuild it
        tmp = build / f"{source}.{os.getpid()}.tmp"
        tmp.write_bytes(Path(__file__).with_name(source).read_bytes())
        tmp.replace(copy)  # atomic: a concurrent process reads a whole file or none
    load(name=name, sources=[str(copy)], build_directory=str(build), is_python_module=False,
         verbose=False, extra_cflags=list(cflags), extra_ldflags=["-fopenmp"])


def build_dir(source: str, subdir: str, cflags: tuple[str, ...]) -> Path:
    text = hashlib.sha256(Path(__file__).with_name(source).read_bytes() + " ".join(cflags).encode()).hexdigest()[:12]
    return cache_dir() / f"{_cpu_tag()}-torch{torch.__version__}" / (subdir or "linear") / text


class Extension:
    """A C++ file beside this module built on first use, once per process; `available()` says whether it loaded (one
    warning naming the fallback when not). `ready` runs once after a build (fake kernels, op lookups)."""

    def __init__(self, name: str, source: str, subdir: str, fallback: str, ready=None,
                 cflags: tuple[str, ...] = EXACT_CFLAGS) -> None:
        self.name, self.source, self.subdir, self.fallback, self.ready = name, source, subdir, fallback, ready
        self.cflags = cflags
        self.ok: bool | None = None
        self.error = ""

    def available(self) -> bool:
        if getattr(_thread, "torch", False):
            return False
        if self.ok is not None:
            return self.ok
        self.ok = False
        if os.environ.get("MTPSPEC_KERNELS", "1") == "0":
            self.error = "turned off by MTPSPEC_KERNELS=0"
            return False
        try:
            build_extension(self.name, self.source, self.subdir, self.cflags)
            if self.ready is not None:
                self.ready()
            self.ok = True
        except Exception as e:  # no compiler, no headers, a read-only cache: the torch path serves instead
            self.error = f"{type(e).__name__}: {str(e).strip().splitlines()[-1] if str(e).strip() else ''}"
            warnings.warn(f"mtpspec: {self.source} is not available ({self.error}); {self.fallback}", stacklevel=3)
        return self.ok


def _ready() -> None:
    torch.library.register_fake("mtpspec::packed_linear")(_fake)


# the panel kernel keeps the compiler's FMA contraction: its exactness is row-invariance, one FMA chain per output
_EXT = Extension("mtpspec_small_linear", "small_linear.cpp", "", "linear layers run on torch's F.linear (slower decode steps)",
                 _ready, cflags=("-O3", "-march=native", "-fopenmp"))


def available() -> bool:
    """Build (or load the cached build of) the kernel once per process; False, with a warning, if that fails."""
    return _EXT.available()


def _fake(x: Tensor, panels: Tensor, n: int, bias: Tensor | None, widen: bool = False) -> Tensor:
    return x.new_empty(x.shape[0], n, dtype=torch.float32 if widen else x.dtype)


# bf16 panels hold each 16 outputs as o0 o8 o1 o9 .. o7 o15: the kernel widens a 32-bit word (two bfloat16) into
# outputs i and i+8 with two integer ops (small_linear.cpp, row8 / row16)
BF16_ORDER = [g * 16 + i + h * 8 for g in range(2) for i in range(8) for h in range(2)]
BF16_UNDO = sorted(range(P), key=BF16_ORDER.__getitem__)  # panel position of output j


def bf16_pairs() -> bool:
    """Whether this build multiplies bf16 weights in pairs (vdpbf16ps): bf16 panels (ceil(N/32), ceil(K/2), 64)."""
    if not available():
        return False
    if "pairs" not in _state:
        _state["pairs"] = bool(torch.ops.mtpspec.bf16_pairs())
    return bool(_state["pairs"])


def pack(weight: Tensor) -> Tensor:
    """(N, K) -> panels (ceil(N/32), K, 32): panel p holds outputs 32p.. 32p+31, one input column's 32 weights
    side by side (bf16: in the kernel's interleaved order, BF16_ORDER); rows past N are zero. bf16 where the kernel
    multiplies in pairs (bf16_pairs()): (ceil(N/32), ceil(K/2), 64), each pair of input columns' weights of one
    output side by side, output by output (an odd K gets a zero column)."""
    n, k = weight.shape
    pairs = weight.dtype == torch.bfloat16 and bf16_pairs()
    kp = k + k % 2 if pairs else k
    padded = weight.new_zeros((n + P - 1) // P * P, kp)
    padded[:n, :k] = weight.detach()
    if pairs:  # (NP, 32, K/2, 2) -> (NP, K/2, 32, 2)
        return padded.view(-1, P, kp // 2, 2).transpose(1, 2).reshape(-1, kp // 2, 2 * P).contiguous()
    panels = padded.view(-1, P, k).transpose(1, 2)  # (NP, K, 32)
    if weight.dtype == torch.bfloat16:
        panels = panels[..., BF16_ORDER]
    return panels.contiguous()


def takes(x: Tensor, dtype: torch.dtype) -> bool:
    """Whether the kernel takes x (..., K) against weights of `dtype`: 1..MAX_ROWS rows of that dtype (fp32 or bf16) on
    the CPU, outside autograd."""
    rows = x.numel() // x.shape[-1] if x.shape[-1] else 0
    return (0 < rows <= MAX_ROWS and x.dtype == dtype and dtype in DTYPES and x.device.type == "cpu"
            and not (torch.is_grad_enabled() and x.requires_grad))


def usable(x: Tensor, weight: Tensor) -> bool:
    """Whether a Linear (or a fused projection) runs this call on the kernel: takes(), a weight outside autograd, and
    the kernel built."""
    return takes(x, weight.dtype) and not (torch.is_grad_enabled() and weight.requires_grad) and available()


def packed_linear(x: Tensor, panels: Tensor, n: int, bias: Tensor | None = None, widen: bool = False) -> Tensor:
    """x (..., K) -> (..., n) through the kernel, with panels = pack(weight). widen: bf16 results come back as the
    fp32 values of their bf16 rounding (what .to(bf16).float() gives, without the two conversions)."""
    y = torch.ops.mtpspec.packed_linear(x.reshape(-1, x.shape[-1]), panels, n, bias, widen)
    return y.view(*x.shape[:-1], n)


class Product:
    """x @ W^T for a derived, cached weight (a folded MTP module, a draft-vocabulary head), held only in its fastest
    layout: the kernel's panels (more than MAX_ROWS rows: torch's batched matmul over them), else W^T contiguous."""

    def __init__(self, weight: Tensor) -> None:
        weight = weight.detach()
        self.n, self.k = weight.shape  # (N, K)
        self.dtype = weight.dtype
        kernel = weight.dtype in DTYPES and weight.device.type == "cpu" and available()
        self.panels = pack(weight) if kernel else None  # (ceil(N/32), K, 32)
        self.t = None if kernel else weight.t().contiguous()  # (K, N)

    def __call__(self, x: Tensor, bias: Tensor | None = None, widen: bool = False) -> Tensor:
        """x (..., K) -> (..., N); widen: in at least fp32 (the values of the weight's dtype, packed_linear)."""
        if widen:
            return self(x, bias) if not takes(x, self.dtype) or self.t is not None else packed_linear(x, self.panels, self.n, bias, True)
        if self.t is not None:
            return x @ self.t if bias is None else torch.addmm(bias, x.reshape(-1, self.k), self.t).view(*x.shape[:-1], self.n)
        if takes(x, self.dtype):
            return packed_linear(x, self.panels, self.n, bias)
        rows = x.numel() // self.k
        flat = x.reshape(-1, self.k)
        if self.panels.shape[-1] != P:  # bf16 pairs: no torch product reads them, so MAX_ROWS rows at a time
            y = torch.cat([packed_linear(part, self.panels, self.n, bias) for part in flat.split(MAX_ROWS)])
            return y.view(*x.shape[:-1], self.n)
        y = torch.matmul(flat, self.panels)  # (NP, M, 32)
        if self.dtype == torch.bfloat16:  # the panels' interleaved order, undone
            y = y[..., BF16_UNDO]
        y = y.transpose(0, 1).reshape(rows, -1)[:, : self.n]  # (M, N)
        y = y if bias is None else y + bias
        return y.reshape(*x.shape[:-1], self.n)

"""Where a model computes: the CPU (mtpspec's C++ kernels) or a torch device such as CUDA (torch's own kernels).

The CPU path is the project's default and its fastest small-batch path: linear layers on the panel / GGUF block
kernels (mtpspec.kernels), each row bitwise the same however many rows share a call. On any other device a model is
dense torch modules: GGUF block weights are dequantized at load into the model's dtype, every product is torch's
(F.linear, SDPA), caches are plain device tensors, and the engine runs its steps under `on(device)` so that every
tensor a step makes lands there. Host syncs are the accept decisions (a step's argmaxes, a Gumbel choice, the number
of accepted drafts), one `.tolist()` per step where it can be.

`resolve()` turns what a user wrote (`cpu`, `cuda`, `cuda:1`; None: $MTPSPEC_DEVICE, else `cpu`) into a torch.device
or one ConfigError line; models.placement.place() moves a loaded model there.
"""

from __future__ import annotations

import contextlib
import os

import torch

from .errors import ConfigError

ENV = "MTPSPEC_DEVICE"  # the default device of load() and every command (the test suite's switch for a CUDA run)
CPU = torch.device("cpu")


def resolve(spec: str | torch.device | None = None) -> torch.device:
    """'cpu' | 'cuda' | 'cuda:N' (a torch.device too; None: $MTPSPEC_DEVICE or 'cpu') -> the torch.device, checked to
    exist on this machine (a ConfigError naming the problem otherwise)."""
    if spec is None:
        spec = os.environ.get(ENV) or "cpu"
    if isinstance(spec, torch.device):
        dev = spec
    elif isinstance(spec, str):
        try:
            dev = torch.device(spec.strip().lower())
        except RuntimeError:
            raise ConfigError(f"unknown device {spec!r} (choose from cpu, cuda, cuda:N)") from None
    else:
        raise ConfigError(f"device must be a name such as 'cpu' or 'cuda', got {type(spec).__name__}")
    if dev.type == "cpu":
        return CPU
    if dev.type != "cuda":
        raise ConfigError(f"device {str(dev)!r} is not supported (choose from cpu, cuda, cuda:N)")
    if not torch.cuda.is_available():
        why = "this torch is built without CUDA" if torch.version.cuda is None else "no CUDA GPU is visible"
        raise ConfigError(f"CUDA is not available on this machine ({why}): use --device cpu")
    n = torch.cuda.device_count()
    index = 0 if dev.index is None else dev.index
    if index >= n:
        raise ConfigError(f"device cuda:{index} does not exist: this machine has {n} CUDA device{'s' if n != 1 else ''}")
    return torch.device("cuda", index)


def of(module) -> torch.device:
    """The device a model (or any module) computes on: that of its first parameter or buffer (the CPU without any)."""
    for name in ("parameters", "buffers"):  # (a target that is not a torch module computes on the CPU)
        for t in getattr(module, name, tuple)():
            return t.device
    return CPU


def on(device: torch.device):
    """A context in which tensors made without a device are made on `device` (nothing on the CPU: its path stays as
    it is, with no mode in the way of its dispatch)."""
    return contextlib.nullcontext() if device.type == "cpu" else torch.device(device)


def synchronize(device: torch.device) -> None:
    """Wait for the device's queued work (a timing's end); nothing on the CPU."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def name(device: torch.device) -> str:
    """The device in words: 'cpu', or the card's name ('cuda:0 (NVIDIA H100 80GB HBM3)')."""
    if device.type == "cuda":
        return f"{device} ({torch.cuda.get_device_name(device)})"
    return str(device)

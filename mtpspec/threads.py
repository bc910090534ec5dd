"""How many torch threads a model runs with by default: one rule for the API, every command and the server.

A batch-1 step is a chain of small matrix-vector products, and splitting one across threads pays a fork/join per
op (far more when another job holds the other core): an eager model under SMALL_BYTES runs 1 thread; a larger one,
a compiled one or one on the row kernels from ROW_BYTES (GGUF block weights: its step is the kernels' products, the
layers one call), one thread per idle physical core. The rule is applied once, at load (the load average counts this
process once it runs), and torch.set_num_threads is process-wide: Model.generate applies its model's count at the
start of each call. Measurements: docs/decisions.md#default-thread-count.
"""

from __future__ import annotations

import os
from numbers import Integral

import torch
from torch import nn

from .errors import ConfigError

SMALL_BYTES = 256 * 2**20  # below this an eager model gains nothing from a second thread
ROW_BYTES = 16 * 2**20  # from this size a model on the row kernels does (its products are worth splitting)


def parameter_bytes(module: nn.Module) -> int:
    """Bytes of the module's weights, each once (a tied head): its state_dict and GGUF block weights (held beside it)."""
    seen, total = set(), 0
    for m in module.modules():
        w = getattr(m, "qweight", None)
        if w is not None and id(w) not in seen:
            seen.add(id(w))
            total += w.nbytes
    for t in module.state_dict(keep_vars=True).values():
        key = (t.untyped_storage().data_ptr(), t.storage_offset()) if t.device.type != "meta" else id(t)
        if key not in seen:
            seen.add(key)
            total += t.numel() * t.element_size()
    return total


def physical_cores() -> int:
    """Physical cores this process may run on (hyperthread siblings counted once; the affinity mask respected)."""
    try:
        cpus = sorted(os.sched_getaffinity(0))
    except AttributeError:  # not Linux
        return max(1, (os.cpu_count() or 1))
    cores = set()
    for c in cpus:
        base = f"/sys/devices/system/cpu/cpu{c}/topology/"
        try:
            with open(base + "physical_package_id") as f, open(base + "core_id") as g:
                cores.add((f.read().strip(), g.read().strip()))
        except OSError:
            cores.add(("cpu", str(c)))
    return max(1, len(cores))


def machine_load() -> float:
    """The 1-minute load average (runnable jobs), 0.0 where the OS has none."""
    try:
        return os.getloadavg()[0]
    except (AttributeError, OSError):
        return 0.0


def default_threads(module: nn.Module, cores: int | None = None, load: float | None = None, compiled: bool | None = None) -> int:
    """1 thread under SMALL_BYTES of weights unless compiled or on the row kernels (from ROW_BYTES); else cores -
    round(load), at least 1. cores / load: this machine's by default; compiled None: whether compile_model has been
    applied."""
    if compiled is None:
        compiled = getattr(module, "compiled_step", None) is not None
    size = parameter_bytes(module)
    rows = bool(getattr(getattr(module, "config", None), "row_kernels", False)) and size >= ROW_BYTES
    if size < SMALL_BYTES and not compiled and not rows:
        return 1
    cores = physical_cores() if cores is None else cores
    load = machine_load() if load is None else load
    return max(1, min(cores, cores - int(load + 0.5)))


def check_threads(threads, name: str = "threads") -> int | None:
    """None (the rule) or an integer >= 1; anything else is a ConfigError naming it."""
    if threads is None:
        return None
    if not isinstance(threads, Integral) or isinstance(threads, bool):
        raise ConfigError(f"{name} must be an integer >= 1 or None (chosen per model), got {threads!r}")
    if threads < 1:
        raise ConfigError(f"{name} must be >= 1, got {threads}")
    return int(threads)


def resolve_threads(threads, module: nn.Module, compiled: bool | None = None) -> int:
    """threads as given (checked), or default_threads(module) when None."""
    n = check_threads(threads)
    return default_threads(module, compiled=compiled) if n is None else n


def apply_threads(n: int) -> int:
    """Set torch's (process-wide) intra-op thread count; returns n."""
    if torch.get_num_threads() != n:
        torch.set_num_threads(n)
    return n


__all__ = ["SMALL_BYTES", "ROW_BYTES", "parameter_bytes", "physical_cores", "machine_load", "default_threads", "check_threads",
           "resolve_threads", "apply_threads"]

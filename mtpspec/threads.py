"""How many torch threads a model runs with by default: one rule, used by the API, every command and the server.

Decoding at batch 1 is a chain of small matrix-vector products. Splitting one across threads pays a
fork/join per op (tens of microseconds, far more when another job holds the other core and the
OpenMP workers spin waiting for it), so a second thread only helps when each op has enough weights
to stream. Measured here (2-vCPU AMD EPYC VM; T(1) = one plain one-token forward over a 128-token cache,
median, 1 and 2 threads interleaved rep by rep: scripts/threads_t1.py --ladder --big), on a busy machine
(load average ~4: a C++ build and other jobs on both cores):

    model (weights)                              T(1) 1 thread   T(1) 2 threads   2 threads vs 1
    stories260K fp32 (1 MB)                       9.0 ms          11.2 ms          1.24x slower
    demo hybrid fp32 (32 MB)                     39.5 ms          63.5 ms          1.61x slower
    stories15M-shaped dense fp32 (61 MB)         25.5 ms          31.3 ms          1.23x slower
    stories42M-shaped dense fp32 (167 MB)        35.7 ms          91.7 ms          2.57x slower
    stories110M-shaped dense fp32 (438 MB)       70.0 ms         202.3 ms          2.89x slower
    Qwen3.5-0.8B-shaped hybrid bf16 (1.5 GB)      341 ms          3770 ms          11x slower

and on a quiet one (issue 13's measurement, same VM): the 0.8B shape 121 ms at 1 thread, 92 ms at 2
(1.3x faster). The demo's ~4 ms steps are dispatch-bound (issue 13), so splitting them cannot pay. No quiet
machine was available for the ladder in between, so the size threshold sits between the largest
dispatch-bound model here (the demo, 32 MB) and the smallest one measured to gain (1.5 GB).

Re-measured on a quiet machine (2026-12-02, a fresh AMD EPYC VM; the kernel now built with OpenMP, so a
second thread splits every matrix product; `--ladder --big --reps 15`, eager):

    model (weights)                              T(1) 1 thread   T(1) 2 threads   2 threads vs 1
    stories260K fp32 (1 MB)                        2.18 ms          2.19 ms          1.00
    demo hybrid fp32 (32 MB)                       7.51 ms          7.33 ms          0.98
    stories15M-shaped dense fp32 (61 MB)           4.61 ms          4.39 ms          0.95
    stories42M-shaped dense fp32 (167 MB)         10.81 ms          9.88 ms          0.91
    stories110M-shaped dense fp32 (438 MB)        21.94 ms         20.82 ms          0.95
    Qwen3.5-0.8B-shaped hybrid bf16 (1.5 GB)      96.8 ms          82.8 ms          0.86

An eager small model still gains nothing from a second core (its step is Python and dispatch), but a
compiled one does: the demo's compiled step is mostly the kernel's products, and with two threads plain
decoding ran 1.28x and MTP at D = 3 1.23x faster than with one, in one process, alternating
(docs/engine.md, "threads"); in `mtpspec bench --peers llamacpp --compile` runs of the same day the demo
decoded 1.3-1.4x faster at two threads than at one. Hence:

- weights under SMALL_BYTES (256 MiB), not compiled: 1 thread, always;
- larger, or compiled (`load(..., compile=True)`, `--compile`): one thread per idle physical core (cores this
  process may run on, minus the 1-minute load average rounded), at least 1: on a busy machine extra threads
  cost 3-11x, on a quiet one they gain 1.1-1.4x.
  The load average counts this process too once it has run for a while: load() applies the rule once, at
  load time, and generate() reuses that count.

torch.set_num_threads is process-wide: apply_threads sets it for the whole process (every model in it).
Model.generate applies its model's count at the start of each call, so two models in one process each
run with their own; two generations running at once in Python threads share whichever was set last.
"""

from __future__ import annotations

import os
from numbers import Integral

import torch
from torch import nn

from .errors import ConfigError

SMALL_BYTES = 256 * 2**20  # below 256 MiB of weights one thread is fastest (measurements above)


def parameter_bytes(module: nn.Module) -> int:
    """Bytes of the module's weights: its state_dict (parameters, quantized codes; not the rotary tables), each tensor once (a tied head)."""
    seen, total = set(), 0
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
    """The rule: 1 thread under SMALL_BYTES of weights unless compiled; else one per idle core (cores - round(load)),
    at least 1.

    cores / load default to this machine's (physical_cores, machine_load); pass them to ask about another. compiled:
    whether the model runs the compiled step (None: whether compile_model has been applied to it)."""
    if compiled is None:
        compiled = "compiled_step" in module.__dict__
    if parameter_bytes(module) < SMALL_BYTES and not compiled:
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
    """threads as given (checked), or default_threads(module) when None (compiled: as default_threads takes it)."""
    n = check_threads(threads)
    return default_threads(module, compiled=compiled) if n is None else n


def apply_threads(n: int) -> int:
    """Set torch's intra-op thread count for the whole process (torch.set_num_threads is process-wide); returns n."""
    if torch.get_num_threads() != n:
        torch.set_num_threads(n)
    return n


__all__ = ["SMALL_BYTES", "parameter_bytes", "physical_cores", "machine_load", "default_threads", "check_threads",
           "resolve_threads", "apply_threads"]

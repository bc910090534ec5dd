"""Models built on the meta device (shapes only) before a checkpoint fills them, without their random init.

torch runs a meta tensor's normal_ through its Python reference, whose first call imports torch._dynamo and sympy
(about 80 MB of a process's memory, and their import time) for values nobody reads: the loaders skip it.
"""

from __future__ import annotations

from contextlib import contextmanager

import torch
from torch.overrides import TorchFunctionMode

_INITS = frozenset({torch.nn.init.normal_, torch.Tensor.normal_, torch.nn.init.trunc_normal_})


class _NoMetaInit(TorchFunctionMode):
    """Random initialisation of a meta tensor is a no-op (it has no values)."""

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func in _INITS:
            t = args[0] if args else kwargs.get("tensor")
            if isinstance(t, torch.Tensor) and t.is_meta:
                return t
        return func(*args, **kwargs)


@contextmanager
def meta_device():
    """Build modules on the meta device, their random init skipped."""
    with torch.device("meta"), _NoMetaInit():
        yield

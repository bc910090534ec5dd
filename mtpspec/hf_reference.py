"""transformers' models as a float64 reference: the one way mtpspec runs them in fp64.

transformers' modeling files cast to float32 in fixed places whatever the model's dtype (norms, rotary tables, the
DeltaNet's fallbacks, softmaxes), so a `.double()`d model still rounds to fp32 there. An fp64 twin of a modeling
module is its own source recompiled with three rewrites, as `<name>_fp64`: `torch.float32` / `torch.float` ->
`torch.float64`; `<expr>.float(...)` -> `<expr>.double(...)`; `from ...modeling_rope_utils import` -> that
module's twin. Every operation, eps and constant stays transformers' code; a source naming float32 any other way is
refused, and the tests watch a twin's forward for float32 results (float32_ops). Nothing is patched.
"""

from __future__ import annotations

import ast
import copy
import functools
import importlib
import importlib.util
import sys
import types
from pathlib import Path

import torch

from .errors import ModelLoadError

# helper modules of transformers whose fp32 casts the modeling files call into: twinned as well
_TWINNED_HELPERS = ("transformers.modeling_rope_utils",)
_FP32_NAMES = ("float32", "float")


def fp64_class(cls: type) -> type:
    """The fp64 twin of a transformers model class (same name, in `<its module>_fp64`)."""
    return getattr(_fp64_module(cls.__module__), cls.__name__)


def load_hf_fp64(directory: str | Path):
    """transformers' causal LM for a directory (the class its config.json names), as an fp64 twin, eval mode."""
    from transformers import AutoConfig
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING

    cls = MODEL_FOR_CAUSAL_LM_MAPPING[type(AutoConfig.from_pretrained(str(directory)))]
    return _ready(fp64_class(cls).from_pretrained(str(directory), dtype=torch.float64))


def hf_fp64_copy(model):
    """The fp64 twin of a loaded transformers model: same config, its weights in fp64, eval mode.
    Non-persistent buffers (rotary inverse frequencies) are recomputed by the twin, in fp64."""
    twin = fp64_class(type(model))._from_config(copy.deepcopy(model.config), dtype=torch.float64)
    twin.load_state_dict({k: v.to(torch.float64) for k, v in model.state_dict().items()})
    return _ready(twin)


def float32_ops(fn, *args, **kwargs) -> list[str]:
    """The aten ops that produced a float32 tensor while `fn(*args, **kwargs)` ran (a twin: none)."""
    from torch.utils._python_dispatch import TorchDispatchMode
    from torch.utils._pytree import tree_leaves

    seen: list[str] = []

    class _Watch(TorchDispatchMode):
        def __torch_dispatch__(self, func, types_, args=(), kwargs=None):
            out = func(*args, **(kwargs or {}))
            if any(isinstance(t, torch.Tensor) and t.dtype == torch.float32 for t in tree_leaves(out)):
                seen.append(str(func))
            return out

    with _Watch():
        fn(*args, **kwargs)
    return seen


def _ready(model):
    for m in model.modules():
        if hasattr(m, "original_inv_freq"):
            _rotary_in_fp64(m)
    if getattr(model.config, "num_experts", 0):
        model.set_experts_implementation("eager")  # the grouped-mm experts kernel has no fp64
    return model.eval()


def _rotary_in_fp64(rotary) -> None:
    """Give a twin's rotary module the fp64 inverse frequencies its own __init__ computes (transformers'
    _init_weights, not twinned, recomputes them in fp32)."""
    try:
        fresh = type(rotary)(config=rotary.config)
    except Exception as e:  # noqa: BLE001 - another transformers version's rotary module
        raise ModelLoadError(f"no fp64 reference: {type(rotary).__name__}(config=...) failed ({type(e).__name__}: {e})") from None
    for name, buf in fresh.named_buffers(recurse=False):
        if "inv_freq" in name:
            setattr(rotary, name, buf)


class _Fp64Casts(ast.NodeTransformer):
    """The three rewrites (module docstring); `package` resolves relative imports."""

    def __init__(self, package: str):
        self.package = package

    def visit_Attribute(self, node: ast.Attribute):
        self.generic_visit(node)
        if isinstance(node.value, ast.Name) and node.value.id == "torch" and node.attr in _FP32_NAMES:
            return ast.copy_location(ast.Attribute(value=node.value, attr="float64", ctx=node.ctx), node)
        return node

    def visit_Call(self, node: ast.Call):
        self.generic_visit(node)
        f = node.func
        if isinstance(f, ast.Attribute) and f.attr == "float":  # Tensor.double takes .float's arguments
            node.func = ast.copy_location(ast.Attribute(value=f.value, attr="double", ctx=f.ctx), f)
        return node

    def visit_ImportFrom(self, node: ast.ImportFrom):
        name = importlib.util.resolve_name("." * node.level + (node.module or ""), self.package)
        if name in _TWINNED_HELPERS:
            return ast.copy_location(ast.ImportFrom(module=_fp64_module(name).__name__, names=node.names, level=0), node)
        return node


def _fp32_left(tree: ast.AST) -> list[int]:
    """Lines that still name float32 after the rewrites (`from torch import float32`, `x.float32`, "float32")."""
    lines = []
    for n in ast.walk(tree):
        if isinstance(n, ast.ImportFrom) and n.module == "torch" and any(a.name in _FP32_NAMES for a in n.names):
            lines.append(n.lineno)
        elif isinstance(n, ast.Attribute) and n.attr == "float32":
            lines.append(n.lineno)
        elif isinstance(n, ast.Constant) and n.value in ("float32", "fp32"):
            lines.append(n.lineno)
    return lines


@functools.lru_cache(maxsize=None)
def _fp64_module(name: str) -> types.ModuleType:
    """The fp64 twin of module `name`: its source, rewritten (_Fp64Casts), executed as `<name>_fp64`."""
    src_mod = importlib.import_module(name)
    path = src_mod.__file__
    try:
        tree = _Fp64Casts(src_mod.__package__).visit(ast.parse(Path(path).read_text(), path))
        left = _fp32_left(tree)
        if left:
            raise ModelLoadError(f"{path} names float32 in a way the fp64 reference cannot rewrite (line {left[0]})")
        code = compile(ast.fix_missing_locations(tree), path, "exec", dont_inherit=True)
        mod = types.ModuleType(name + "_fp64")
        mod.__package__, mod.__file__ = src_mod.__package__, path
        sys.modules[mod.__name__] = mod  # its classes' __module__ must resolve (transformers looks them up)
        exec(code, mod.__dict__)  # noqa: S102 - transformers' own source, casts rewritten
    except ModelLoadError:
        raise
    except Exception as e:  # noqa: BLE001 - another transformers version's source
        sys.modules.pop(name + "_fp64", None)
        raise ModelLoadError(f"no fp64 reference for {name}: its source did not load rewritten ({type(e).__name__}: {e})") from None
    return mod

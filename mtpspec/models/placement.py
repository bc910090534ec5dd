"""A loaded model moved to a device (mtpspec.device): GGUF block layers made dense there, the CPU-only copies dropped."""

from __future__ import annotations

import dataclasses

import torch
from torch import nn

from .blocks import BlockEmbedding
from .common import DraftModule, Linear, RMSNorm, Rotary


def densify(module: nn.Module) -> int:
    """Replace every GGUF block layer of `module` (block Linear, BlockEmbedding) by its dense equivalent in the model's
    dtype, exactly dequantized, sharing ties (an LM head on the embedding's blocks reads the same dense table).
    Returns how many layers changed. For devices without the block kernel."""
    done: dict[int, nn.Parameter] = {}  # id(QuantizedWeight) -> its dense Parameter (tied weights stay tied)
    changed = 0
    for parent in list(module.modules()):
        for name, child in list(parent.named_children()):
            q = getattr(child, "qweight", None)
            if q is None:
                continue
            if id(q) not in done:
                dense = child.weight if isinstance(child, Linear) else child.weight.to(child.dtype)
                done[id(q)] = nn.Parameter(dense.detach().contiguous(), requires_grad=False)
            w = done[id(q)]
            if isinstance(child, BlockEmbedding):
                new = nn.Embedding(child.num_embeddings, child.embedding_dim, _weight=w, _freeze=True)
            else:
                new = Linear(child.in_features, child.out_features, bias=child.bias is not None, device="meta")
                new.weight = w
                if child.bias is not None:
                    new.bias = nn.Parameter(child.bias.detach().to(w.dtype), requires_grad=False)
            setattr(parent, name, new)
            changed += 1
    return changed


def plain_rows(module: nn.Module) -> None:
    """Attention and norms in torch's batched form: the one-row-at-a-time forms (kernels/attention.cpp, rownorm.cpp)
    keep a GGUF model's rows bitwise alike for the block kernel's 8-bit activations, which a dense model on a device
    does not have (there, exact mode's width-one calls are what make rows alike). A Python loop per row on a GPU."""
    for m in module.modules():
        if isinstance(m, RMSNorm):
            m.row_kernel = False
        elif isinstance(getattr(m, "rows", None), bool) and hasattr(m, "q_proj"):  # an attention layer's by-row flag
            m.rows = False
    cfg = getattr(module, "config", None)
    if getattr(cfg, "row_kernels", False):
        module.config = dataclasses.replace(cfg, row_kernels=False)  # (what a head built from the config copies)


def place(module: nn.Module, device: torch.device) -> nn.Module:
    """Move a loaded model to `device`: nothing on the CPU; elsewhere its block layers dequantized (densify), its rows
    computed in torch's batched form (plain_rows), then every parameter and buffer moved, and the derived copies that
    were packed for the CPU kernels dropped."""
    if device.type == "cpu":
        return module
    densify(module)
    plain_rows(module)
    module.to(device)
    for m in module.modules():  # the copies packed for the CPU kernels: rebuilt by their readers where they apply
        if isinstance(m, Linear):
            m.panels = m.fused = None
        elif isinstance(m, DraftModule):
            m.folded = m.fused_version = None
        elif isinstance(m, Rotary) and m.fp64 is not None:  # made on the CPU on first use
            m.fp64 = tuple(t.to(device) for t in m.fp64)
    return module

"""Weights kept in a GGUF file's block types (Q8_0, Q4_K, ...): linear layers (models.common.Linear.of_blocks) and
the embedding table (BlockEmbedding).

They stand in for dense layers in a model loaded from GGUF (or quantized by mtpspec.quant), with the same call
signatures, so every forward (eager, batched, tree, exact) runs unchanged. The product is the block kernel's
(mtpspec.kernels.quantized): its activations are rounded to 8 bits per 32 inputs, row by row, so a row's output
is bitwise the same however many rows share the call, and speculation is exactly lossless against this model.
"""

from __future__ import annotations

import torch
from torch import Tensor, nn

from ..kernels import quantized
from ..kernels.quantized import QuantizedWeight
from .common import Linear


class BlockEmbedding(nn.Module):
    """An embedding table (V, H) kept as a QuantizedWeight: a lookup dequantizes the rows it reads, exactly."""

    def __init__(self, weight: QuantizedWeight) -> None:
        super().__init__()
        self.qweight = weight
        self.num_embeddings, self.embedding_dim = weight.shape
        self.dtype = torch.float32

    def forward(self, ids: Tensor) -> Tensor:
        return quantized.embedding(self.qweight, ids).view(*ids.shape, self.embedding_dim)  # (..., H)

    @property
    def weight(self) -> Tensor:
        return quantized.dequantize(self.qweight)

    def extra_repr(self) -> str:
        return f"{self.num_embeddings} x {self.embedding_dim}, {self.qweight.qtype.name}"


def holds_blocks(m: nn.Module) -> bool:
    """Whether `m` keeps GGUF block weights: a Linear made by Linear.of_blocks, or a BlockEmbedding."""
    return getattr(m, "qweight", None) is not None


def block_layer(old: nn.Module, weight: QuantizedWeight, bias: Tensor | None = None) -> nn.Module:
    """The block layer standing in for `old`: a BlockEmbedding for an embedding table, a block Linear otherwise."""
    return BlockEmbedding(weight) if isinstance(old, nn.Embedding) else Linear.of_blocks(weight, bias)


def tie_head(model: nn.Module) -> None:
    """The LM head reads the embedding table: the same QuantizedWeight for a block table, the same Parameter otherwise."""
    emb = model.model.embed_tokens
    if isinstance(emb, BlockEmbedding):
        model.lm_head = Linear.of_blocks(emb.qweight)
    else:
        model.lm_head.weight = emb.weight

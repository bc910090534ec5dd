"""Layers whose weights stay in a GGUF file's block types (Q8_0, Q4_K, ...): a linear layer and an embedding.

They stand in for models.common.Linear and nn.Embedding in a model loaded from GGUF, with the same call
signatures, so every forward (eager, batched, tree, exact) runs unchanged. The product is the block kernel's
(mtpspec.kernels.quantized): its activations are rounded to 8 bits per 32 inputs, row by row, so a row's output
is bitwise the same however many rows share the call, and speculation is exactly lossless against this model.
"""

from __future__ import annotations

import torch
from torch import Tensor, nn

from ..kernels import quantized
from ..kernels.quantized import QuantizedWeight


class BlockLinear(nn.Module):
    """y = x W^T (+ b), W (N, K) kept as a QuantizedWeight; fp32 in and out (the kernel's dtype)."""

    def __init__(self, weight: QuantizedWeight, bias: Tensor | None = None) -> None:
        super().__init__()
        self.qweight = weight
        self.out_features, self.in_features = weight.shape
        self.bias = None if bias is None else nn.Parameter(bias.float(), requires_grad=False)

    def forward(self, x: Tensor) -> Tensor:
        y = quantized.linear(x if x.dtype == torch.float32 else x.float(), self.qweight)  # (..., N)
        if self.bias is not None:
            y = y + self.bias
        return y if y.dtype == x.dtype else y.to(x.dtype)

    @property
    def weight(self) -> Tensor:
        """The dequantized W (N, K) fp32, built on each read: for code that derives copies from a head's weight."""
        return quantized.dequantize(self.qweight)

    def extra_repr(self) -> str:
        return f"{self.in_features} -> {self.out_features}, {self.qweight.qtype.name}"


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


def block_layer(old: nn.Module, weight: QuantizedWeight, bias: Tensor | None = None) -> nn.Module:
    """The block layer standing in for `old`: a BlockEmbedding for an embedding table, a BlockLinear otherwise."""
    return BlockEmbedding(weight) if isinstance(old, nn.Embedding) else BlockLinear(weight, bias)


def tie_head(model: nn.Module) -> None:
    """The LM head reads the embedding table: the same QuantizedWeight for a block table, the same Parameter otherwise."""
    emb = model.model.embed_tokens
    if isinstance(emb, BlockEmbedding):
        model.lm_head = BlockLinear(emb.qweight)
    else:
        model.lm_head.weight = emb.weight

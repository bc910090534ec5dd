"""Sampling parameters and the logits -> probabilities transform, applied identically to p and q.

The lossless guarantee of rejection sampling holds for the distribution both sides are drawn from,
so the target (p) and the drafter (q) must go through exactly this transform with the same params.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

from .errors import ConfigError


@dataclass(frozen=True)
class SamplingParams:
    temperature: float = 0.0  # 0 = greedy (argmax); > 0 = sample from softmax(logits / T)
    top_k: int = 0  # keep the k most likely tokens; 0 = off
    top_p: float = 1.0  # keep the smallest prefix of sorted tokens with mass >= top_p; 1 = off

    def __post_init__(self) -> None:
        if not (self.temperature >= 0.0):  # also rejects NaN
            raise ConfigError(f"temperature must be >= 0, got {self.temperature}")
        if self.top_k < 0:
            raise ConfigError(f"top-k must be >= 0 (0 = off), got {self.top_k}")
        if not (0.0 < self.top_p <= 1.0):
            raise ConfigError(f"top-p must be in (0, 1], got {self.top_p}")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0


def logits_to_probs(logits: Tensor, params: SamplingParams) -> Tensor:
    """(..., V) logits -> (..., V) float32 probabilities after temperature, top-k and top-p.

    Greedy params give a one-hot at the argmax (the distribution greedy decoding samples from).
    """
    logits = logits.float()
    if params.greedy:
        return torch.nn.functional.one_hot(logits.argmax(-1), logits.shape[-1]).float()
    logits = logits / params.temperature
    if params.top_k and params.top_k < logits.shape[-1]:
        kth = torch.topk(logits, params.top_k, dim=-1).values[..., -1:]  # (..., 1)
        logits = logits.masked_fill(logits < kth, float("-inf"))
    probs = torch.softmax(logits, dim=-1)
    if params.top_p < 1.0:
        sorted_p, order = torch.sort(probs, dim=-1, descending=True)  # (..., V)
        mass_before = torch.cumsum(sorted_p, dim=-1) - sorted_p  # mass of strictly more likely tokens
        drop_sorted = mass_before >= params.top_p  # the top token always survives (mass_before = 0)
        drop = torch.zeros_like(drop_sorted).scatter(-1, order, drop_sorted)
        probs = probs.masked_fill(drop, 0.0)
        probs = probs / probs.sum(-1, keepdim=True)
    return probs


class Sampler:
    """Owns the sampling params and the seeded generator, so a run with the same seed reproduces."""

    def __init__(self, params: SamplingParams, seed: int = 0) -> None:
        self.params = params
        self.seed = seed
        self.generator = torch.Generator().manual_seed(seed)

    def probs(self, logits: Tensor) -> Tensor:
        return logits_to_probs(logits, self.params)

    def sample(self, probs: Tensor) -> Tensor:
        """(..., V) probabilities -> (...,) int64 token ids (argmax when greedy)."""
        if self.params.greedy:
            return probs.argmax(-1)
        flat = probs.reshape(-1, probs.shape[-1])
        return torch.multinomial(flat, 1, generator=self.generator).reshape(probs.shape[:-1])

    def uniform(self, n: int) -> Tensor:
        return torch.rand(n, generator=self.generator)

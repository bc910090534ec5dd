"""Sampling parameters and the logits -> probabilities transform, applied identically to p and q.

The lossless guarantee of rejection sampling holds for the distribution both sides are drawn from,
so the target (p) and the drafter (q) must go through exactly this transform with the same params.
"""

from __future__ import annotations

from dataclasses import dataclass
from numbers import Integral, Real

import torch
from torch import Tensor

from .errors import ConfigError, ModelLoadError


SEED_LIMIT = 2**64  # torch generators take a 64-bit seed


def check_seed(seed) -> int:
    """A seed is an integer in [0, 2**64): anything else is a clear error (never reduced silently)."""
    if not isinstance(seed, Integral) or isinstance(seed, bool):
        raise ConfigError(f"seed must be an integer, got {seed!r}")
    if not 0 <= seed < SEED_LIMIT:
        raise ConfigError(f"seed must be in [0, 2**64), got {seed}")
    return int(seed)


def _real(name: str, v) -> None:
    if not isinstance(v, Real) or isinstance(v, bool):
        raise ConfigError(f"{name} must be a number, got {v!r}")


@dataclass(frozen=True)
class SamplingParams:
    """Temperature limits: T -> 0+ samples uniformly among the tied argmaxes (one-hot without ties),
    T = inf (or a T too large for logits / T to differ from 0) uniformly over the allowed tokens (top-k / top-p / a draft
    vocabulary still apply); neither ever gives NaN. T = 0 is greedy decoding."""

    temperature: float = 0.0  # 0 = greedy (argmax); > 0 = sample from softmax(logits / T)
    top_k: int = 0  # keep the k most likely tokens; 0 = off
    top_p: float = 1.0  # keep the smallest prefix of sorted tokens with mass >= top_p; 1 = off

    def __post_init__(self) -> None:
        _real("temperature", self.temperature)
        _real("top-p", self.top_p)
        if not isinstance(self.top_k, Integral) or isinstance(self.top_k, bool):
            raise ConfigError(f"top-k must be an integer, got {self.top_k!r}")
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
    """(..., V) logits -> (..., V) float32 probabilities after temperature, top-k and top-p (greedy: a one-hot)."""
    logits = logits.float()
    if params.greedy:
        return torch.nn.functional.one_hot(logits.argmax(-1), logits.shape[-1]).float()
    raw = logits
    if params.top_k and params.top_k < logits.shape[-1]:
        kth = torch.topk(logits, params.top_k, dim=-1).values[..., -1:]  # (..., 1) the same cut at any T > 0
        logits = logits.masked_fill(logits < kth, float("-inf"))
    logits = _scale(logits, params.temperature)
    probs = torch.softmax(logits, dim=-1)
    if params.top_p < 1.0:
        # order by the raw logits: the order of probs at any finite T, also where T's limits tie them
        order = torch.sort(raw, dim=-1, descending=True, stable=True).indices
        sorted_p = probs.gather(-1, order)  # (..., V)
        mass_before = torch.cumsum(sorted_p, dim=-1) - sorted_p  # mass of strictly more likely tokens
        drop_sorted = mass_before >= params.top_p  # the top token always survives (mass_before = 0) ...
        drop_sorted[..., 0] = False  # ... even when top_p is below float32's range (compared as 0)
        drop = torch.zeros_like(drop_sorted).scatter(-1, order, drop_sorted)
        probs = probs.masked_fill(drop, 0.0)
        probs = probs / probs.sum(-1, keepdim=True)
    if not bool(torch.isfinite(probs).all()):  # only from non-finite logits: the model itself is broken
        raise ModelLoadError("the model produced non-finite logits (NaN or inf): its weights are broken or overflow this dtype")
    return probs


def _scale(logits: Tensor, t: float) -> Tensor:
    """logits / T (-inf, outside the allowed set, stays -inf). Where that overflows (tiny T) or T is beyond float32
    (huge T), the logits are shifted by their max first (softmax unchanged): tiny T then gives the uniform
    distribution over the tied argmaxes, huge T the uniform one over the allowed set."""
    scaled = logits / t
    allowed = logits > float("-inf")
    if torch.equal(torch.isfinite(scaled), allowed) and not bool(scaled.isnan().any()):  # -inf stayed -inf
        return scaled
    shifted = logits - logits.max(dim=-1, keepdim=True).values  # (..., V) <= 0 on the allowed set
    out = (shifted.double() / t).float()  # T in float64: a T below float32's range is not 0, one above it not inf
    return out.masked_fill(~allowed, float("-inf"))  # (-inf / inf = NaN outside the allowed set)


class Sampler:
    """Owns the sampling params and the seeded generator, so a run with the same seed reproduces."""

    def __init__(self, params: SamplingParams, seed: int = 0) -> None:
        self.params = params
        self.seed = check_seed(seed)
        self.generator = torch.Generator().manual_seed(self.seed)

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

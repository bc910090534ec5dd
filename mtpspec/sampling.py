"""Sampling parameters and the logits -> probabilities transform, applied identically to p and q.

The lossless guarantee of rejection sampling holds for the distribution both sides are drawn from,
so the target (p) and the drafter (q) must go through exactly this transform with the same params.

Context controls (repetition / frequency / presence penalties, logit_bias, banned ids, min_tokens) read what came
before the row they transform, so every row is transformed with its own context: a verify window's row i sees the
committed tokens plus draft tokens 0..i-1 (a token tree's row: the tokens on its node's path), a drafter's step j the
committed tokens plus its own drafts 0..j-1 (`Paths`). The speculative output then has exactly plain sampling's
distribution under the same controls, and greedy output is exactly plain greedy's (the argmax of the controlled
logits). Each sequence's sampler is bound to its prompt (`Sampler.bind`) and told what it emits (`advance`).

Two ways to draw a sampled token (`SamplingParams.sampler`): "rejection" takes the seeded generator's next draws
(verify.py's rejection sampling: how many draws a step takes depends on its drafts, so the text depends on the drafter,
the depth and the batch); "gumbel" takes the token at absolute position t as argmax_v(log p_t(v) + g_t(v)), the Gumbel
noise g_t a fixed function of (seed, t) alone (`gumbel_noise`): every drafter, depth, batch, and plain decoding then
give the same text for one seed, each token still an exact sample from p_t (Gumbel-max).

A grammar (structured output, grammar.py) is one more such control: row r is masked to the tokens the grammar allows
after the committed tokens plus row r's path; this module only holds the sequence's grammar state and applies its mask.
"""

from __future__ import annotations

import contextlib
import copy
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from numbers import Integral, Real

import torch
from torch import Tensor

from .errors import ConfigError, ModelLoadError
from .kernels.sampling import gumbel_candidates, leading_ids


SEED_LIMIT = 2**64  # torch generators take a 64-bit seed
SAMPLERS = ("rejection", "gumbel")  # SamplingParams.sampler; a request may also ask for "auto" (pick_sampler)


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


def _token_id(name: str, t) -> int:
    if not isinstance(t, Integral) or isinstance(t, bool) or t < 0:
        raise ConfigError(f"{name} token ids must be integers >= 0, got {t!r}")
    return int(t)


@dataclass(frozen=True)
class SamplingParams:
    """Temperature limits: T -> 0+ samples uniformly among the tied argmaxes (one-hot without ties),
    T = inf (or a T too large for logits / T to differ from 0) uniformly over the allowed tokens (top-k / top-p / a draft
    vocabulary still apply); neither ever gives NaN. T = 0 is greedy decoding.

    The logits of a row go through, in this order (vLLM's): logit_bias added; repetition_penalty over the tokens present
    in the prompt and the generated tokens (HF / vLLM / llama.cpp: a logit > 0 divided by it, one < 0 multiplied);
    frequency_penalty * count and presence_penalty * [count > 0] subtracted, counting generated tokens only (OpenAI);
    banned_ids, tokens outside the grammar (grammar.py; where it is complete, its end comes before min_tokens), and the
    sequence's stop ids while fewer than min_tokens tokens were generated, set to -inf. Then
    temperature, top-k, top-p, and min_p (tokens of probability < min_p * the largest dropped; the largest survives,
    so greedy decoding is the argmax of the controlled logits). "Generated" includes the drafts before the row."""

    temperature: float = 0.0  # 0 = greedy (argmax); > 0 = sample from softmax(logits / T)
    top_k: int = 0  # keep the k most likely tokens; 0 = off
    top_p: float = 1.0  # keep the smallest prefix of sorted tokens with mass >= top_p; 1 = off
    min_p: float = 0.0  # drop tokens less likely than min_p * the most likely one; 0 = off
    repetition_penalty: float = 1.0  # > 0; 1 = off
    frequency_penalty: float = 0.0  # in [-2, 2]; 0 = off
    presence_penalty: float = 0.0  # in [-2, 2]; 0 = off
    logit_bias: tuple[tuple[int, float], ...] = ()  # (token id, bias in [-100, 100]) pairs; a {id: bias} mapping is taken too
    banned_ids: tuple[int, ...] = ()  # token ids never sampled
    min_tokens: int = 0  # no stop token before this many new tokens
    sampler: str = "rejection"  # "rejection" or "gumbel" (position-keyed noise: the text a function of the seed alone)
    grammar: object = None  # a grammar.CompiledGrammar (Grammar.compile): the output matches it; None = off

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
        for name, v in (("min-p", self.min_p), ("repetition penalty", self.repetition_penalty),
                        ("frequency penalty", self.frequency_penalty), ("presence penalty", self.presence_penalty)):
            _real(name, v)
        if not (0.0 <= self.min_p <= 1.0):
            raise ConfigError(f"min-p must be in [0, 1], got {self.min_p}")
        if not (0.0 < self.repetition_penalty < float("inf")):
            raise ConfigError(f"repetition penalty must be a finite number > 0 (1 = off), got {self.repetition_penalty}")
        for name, v in (("frequency penalty", self.frequency_penalty), ("presence penalty", self.presence_penalty)):
            if not (-2.0 <= v <= 2.0):
                raise ConfigError(f"{name} must be in [-2, 2], got {v}")
        bias = self.logit_bias
        if isinstance(bias, Mapping):
            bias = tuple(bias.items())
        if not isinstance(bias, (tuple, list)) or not all(isinstance(b, (tuple, list)) and len(b) == 2 for b in bias):
            raise ConfigError(f"logit bias must map token ids to numbers ({{id: bias}}), got {self.logit_bias!r}")
        for t, b in bias:
            _token_id("logit bias", t)
            _real(f"logit bias of token {t}", b)
            if not (-100.0 <= b <= 100.0):
                raise ConfigError(f"logit bias of token {t} must be in [-100, 100], got {b}")
        if len({t for t, _ in bias}) != len(bias):
            raise ConfigError("logit bias names a token id twice")
        object.__setattr__(self, "logit_bias", tuple((int(t), float(b)) for t, b in bias))
        if isinstance(self.banned_ids, (str, bytes)) or not isinstance(self.banned_ids, Sequence):
            raise ConfigError(f"banned ids must be a list of token ids, got {self.banned_ids!r}")
        object.__setattr__(self, "banned_ids", tuple(_token_id("banned", t) for t in self.banned_ids))
        if not isinstance(self.min_tokens, Integral) or isinstance(self.min_tokens, bool) or self.min_tokens < 0:
            raise ConfigError(f"min-tokens must be an integer >= 0, got {self.min_tokens!r}")
        if self.sampler not in SAMPLERS:
            raise ConfigError(f"sampler must be one of {', '.join(SAMPLERS)}, got {self.sampler!r}")
        if self.grammar is not None and not callable(getattr(self.grammar, "start", None)):
            raise ConfigError("grammar must be compiled against the model's tokenizer (mtpspec.Grammar(...).compile(tokenizer, "
                              f"vocab_size), or give the Grammar to Model.generate), got {type(self.grammar).__name__}")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0

    @property
    def controls(self) -> bool:
        """Whether any logit control is on: then each row is transformed with its own context (`Sampler.bind`)."""
        return bool(self.repetition_penalty != 1.0 or self.frequency_penalty or self.presence_penalty or self.logit_bias
                    or self.banned_ids or self.min_tokens or self.grammar is not None)


# What each row of a window saw beyond the committed context: None, nothing (every row right after it); a 1-D tensor
# d, a chain's drafts (row i after d[:i]); a list, row r's own tokens (a tree node's path, a drafter's drafts so far).
Paths = Tensor | Sequence[Sequence[int]] | None


def host():
    """Tensors made inside on the CPU, whatever the default device: for host code (the grammar's numpy automaton)."""
    return contextlib.nullcontext() if torch.get_default_device().type == "cpu" else torch.device("cpu")


class History:
    """What the context controls read of one sequence's committed tokens: the ids present (prompt + generated), the
    generated tokens' counts, and how many were generated."""

    def __init__(self, prompt: Sequence[int], vocab_size: int) -> None:
        # (on torch's default device: the engine's, the model's)
        self.counts = torch.zeros(vocab_size)  # (V,) float32
        self.seen = torch.unique(torch.as_tensor(list(prompt), dtype=torch.long, device=self.counts.device))  # (n,) sorted ids
        self.generated = 0
        self.grammar = None  # a grammar.GrammarState at the committed tokens (Sampler.bind), when the params have a grammar

    def add(self, tokens: Sequence[int]) -> None:
        tokens = [int(x) for x in tokens]
        t = torch.as_tensor(tokens, dtype=torch.long, device=self.seen.device)  # (n,)
        self.seen = torch.unique(torch.cat([self.seen, t]))
        self.counts.index_put_((t,), torch.ones(t.shape[0], device=t.device), accumulate=True)
        self.generated += t.shape[0]
        if self.grammar is not None:
            with host():
                self.grammar.advance(tokens)


def _row_paths(paths: Paths, rows: int) -> list[list[int]]:
    if paths is None:
        return [[] for _ in range(rows)]
    if isinstance(paths, Tensor):  # a chain: row i after its first i drafts
        d = paths.tolist()
        return [d[:i] for i in range(rows)]
    if len(paths) != rows:
        raise ValueError(f"{len(paths)} paths for {rows} rows")
    return [[int(t) for t in p] for p in paths]


def controlled_logits(logits: Tensor, params: SamplingParams, history: History, stop_ids: tuple[int, ...],
                      paths: Paths = None) -> Tensor:
    """(..., V) logits -> (..., V) float32 logits after the context controls (SamplingParams' order), row r seeing the
    committed context (`history`) plus paths' row r."""
    shape, dev = logits.shape, logits.device
    x = logits.float().reshape(-1, shape[-1]).clone()  # (R, V)
    rows = _row_paths(paths, x.shape[0])
    if params.logit_bias:
        ids, bias = zip(*params.logit_bias)
        x[:, list(ids)] += torch.tensor(bias, device=dev)
    if params.repetition_penalty != 1.0 or params.frequency_penalty or params.presence_penalty:
        # only the tokens present (prompt + generated + the row's path) can move: each row's are gathered, changed
        # elementwise and written back (a count of 0 subtracts 0)
        seen, counts = history.seen.to(dev), history.counts.to(dev)
        for r, path in enumerate(rows):
            t = torch.tensor(path, dtype=torch.long, device=dev)  # (d,)
            ids = torch.unique(torch.cat([seen, t]))  # (n,) sorted
            v = x[r, ids]
            if params.repetition_penalty != 1.0:
                rp = params.repetition_penalty
                v = torch.where(v > 0, v / rp, v * rp)
            if params.frequency_penalty or params.presence_penalty:
                c = counts[ids].index_add_(0, torch.searchsorted(ids, t), torch.ones(t.shape[0], device=dev))  # generated only
                v = v - params.frequency_penalty * c - params.presence_penalty * (c > 0).float()
            x[r, ids] = v
    if params.banned_ids:
        x[:, list(params.banned_ids)] = float("-inf")
    complete = torch.zeros(x.shape[0], dtype=torch.bool, device=dev)  # (R,) rows where the grammar is complete: it ends before min_tokens
    if history.grammar is not None:  # the grammar's automaton is host code (numpy): its rows go there and back
        with host():
            x, complete = history.grammar.mask(x.cpu(), rows, logits.reshape(x.shape).cpu())
        x, complete = x.to(dev), complete.to(dev)
    if params.min_tokens and stop_ids:
        early = torch.tensor([history.generated + len(p) < params.min_tokens for p in rows], device=dev) & ~complete  # (R,)
        if bool(early.any()):
            x[early.nonzero()[:, :1], torch.tensor(stop_ids, device=dev)] = float("-inf")
    if bool((x.amax(-1) == float("-inf")).any()):
        raise ConfigError("the sampling controls leave no token to sample (banned ids, min-tokens' stop ids and the grammar "
                          "cover the whole vocabulary)")
    return x.reshape(shape)


def logits_to_probs(logits: Tensor, params: SamplingParams) -> Tensor:
    """(..., V) logits (after the context controls) -> (..., V) float32 probabilities after temperature, top-k, top-p
    and min-p (greedy: a one-hot). Each row is transformed alone: its result never depends on the other rows, and a
    262k-token row stays in cache through every pass."""
    logits = logits.float()
    if params.greedy:
        return torch.nn.functional.one_hot(logits.argmax(-1), logits.shape[-1]).float()
    flat = logits.reshape(-1, logits.shape[-1])
    if flat.shape[0] == 1:
        return _row_probs(flat[0], params).reshape(logits.shape)
    out = torch.empty_like(flat)
    for x, o in zip(flat, out):
        o.copy_(_row_probs(x, params))
    return out.reshape(logits.shape)


def _row_probs(x: Tensor, params: SamplingParams) -> Tensor:
    """One row of `logits_to_probs`: (V,) -> (V,)."""
    raw, lead = x, None
    if params.top_k and params.top_k < x.shape[0]:
        kth, lead = _kth_largest(x, params.top_k)  # () the same cut at any T > 0
        x = x.masked_fill(x < kth, float("-inf"))
    probs = torch.softmax(_scale(x, params.temperature), dim=-1)
    if params.top_p < 1.0:
        probs = _nucleus(raw, probs, params.top_p, lead)
        probs = probs / probs.sum()
    if params.min_p > 0.0:
        probs = probs.masked_fill(probs < params.min_p * probs.amax(), 0.0)  # the largest survives
        probs = probs / probs.sum()
    if not _finite(probs):  # only from non-finite logits: the model itself is broken
        raise ModelLoadError("the model produced non-finite logits (NaN or inf): its weights are broken or overflow this dtype")
    return probs


def _nucleus_drop(raw: Tensor, probs: Tensor, top_p: float) -> Tensor:
    """(..., V) -> (..., V) bool, the definition of top-p: tokens in order of their raw logits (the order of probs at any
    finite T, also where T's limits tie them; ties by id), dropped where the mass of the tokens before them reaches
    top_p (torch's running sum: on the CPU a sequential one in float64). The top token always survives, even when top_p
    is below float32's range (compared as 0)."""
    order = torch.sort(raw, dim=-1, descending=True, stable=True).indices
    sorted_p = probs.gather(-1, order)  # (..., V)
    drop_sorted = torch.cumsum(sorted_p, dim=-1) - sorted_p >= top_p  # mass of strictly more likely tokens
    drop_sorted[..., 0] = False
    return torch.zeros_like(drop_sorted).scatter(-1, order, drop_sorted)


NUCLEUS_PREFIX = (256, 4096)  # leading tokens a row's nucleus is first looked for in, before a sort of the whole row
NUCLEUS_MARGIN = 1e-6  # the prefix's mass must pass top_p by more than the float32 roundings of the running sum (~2e-7)


def _nucleus(raw: Tensor, p: Tensor, top_p: float, lead: Tensor | None = None) -> Tensor:
    """One row's p (V,) with the tokens outside its nucleus set to 0 (not renormalized): `_nucleus_drop`, bitwise,
    without sorting the whole row where a prefix of its order settles it (`_prefix_nucleus`; lead: top-k's leading
    tokens, the prefix tried first)."""
    ids = _prefix_nucleus(raw, p, top_p, lead=lead)
    if ids is None:
        return p.masked_fill(_nucleus_drop(raw, p, top_p), 0.0)
    out = torch.zeros_like(p)
    out[ids] = p[ids]
    return out


def _prefix_nucleus(raw: Tensor, p: Tensor, top_p: float, sizes: tuple[int, ...] = NUCLEUS_PREFIX,
                    lead: Tensor | None = None) -> Tensor | None:
    """The ids one row's nucleus keeps, found among its leading tokens, or None. Every token at or above a threshold
    (`_leading`), in ascending id order then stably sorted, is the full order's first n tokens, so their running sums
    are the full sort's. Where their mass passes top_p by NUCLEUS_MARGIN, every later token is dropped whatever the
    roundings. CPU only (elsewhere a sort is cheap and cumsum a parallel scan)."""
    if raw.device.type != "cpu":
        return None
    for ids in _leading(raw, sizes, lead):
        ids = ids[torch.sort(raw[ids], descending=True, stable=True).indices]
        mass = torch.cumsum(p[ids], dim=0)  # (n,)
        if float(mass[-1]) >= top_p + NUCLEUS_MARGIN:
            kept = mass - p[ids] < top_p
            kept[0] = True
            return ids[kept]
    return None


def _leading(raw: Tensor, sizes: tuple[int, ...], lead: Tensor | None):
    """Growing sets of a row's leading tokens, each every token at or above a threshold (ascending ids): `lead` (top-k's),
    then at least k tokens for each k of `sizes` (sampling.cpp's threshold, else topk's K-th logit). Stops at a NaN
    logit (left to the whole sort and the check that follows it)."""
    if lead is not None:
        yield lead
    for k in sizes:
        if 4 * k >= raw.shape[0]:
            return
        ids = leading_ids(raw, k)
        if ids is None or ids.shape[0] > 16 * k:  # no kernel, or a flat row: topk's exact K
            ids = torch.nonzero(raw >= torch.topk(raw, k, sorted=False).values.min()).flatten()  # (n >= k,)
        if ids.shape[0] < k:
            return
        yield ids


def _kth_largest(x: Tensor, k: int) -> tuple[Tensor, Tensor | None]:
    """(V,) -> () the row's k-th largest value (topk's), and (n,) the ids of every token at or above sampling.cpp's
    threshold, a set of leading tokens that holds the k largest (None without the kernel)."""
    ids = leading_ids(x, k)
    return torch.topk(x if ids is None else x[ids], k).values[-1], ids


def _finite(x: Tensor) -> bool:
    """Whether every element is finite (NaN and inf reach the min or the max): one pass, where isfinite().all()
    builds a mask."""
    lo, hi = torch.aminmax(x)
    return bool(torch.isfinite(lo) & torch.isfinite(hi))


def _scale(logits: Tensor, t: float) -> Tensor:
    """logits / T (-inf, outside the allowed set, stays -inf). Where that overflows (tiny T) or T is beyond float32
    (huge T), the logits are shifted by their max first (softmax unchanged): tiny T then gives the uniform
    distribution over the tied argmaxes, huge T the uniform one over the allowed set."""
    scaled = logits / t
    lo, hi = torch.aminmax(scaled)  # NaN in either if any element is NaN
    if bool(torch.isfinite(hi)) and not bool(lo.isnan()):
        if bool(torch.isfinite(lo)) or t >= 1.0:  # every logit finite after the scale, or none can overflow
            return scaled
        if bool(torch.isfinite(torch.nan_to_num(logits, neginf=0.0).abs().amax() / t)):  # nor the largest finite one
            return scaled
    allowed = logits > float("-inf")
    shifted = logits - logits.max(dim=-1, keepdim=True).values  # (..., V) <= 0 on the allowed set
    out = (shifted.double() / t).float()  # T in float64: a T below float32's range is not 0, one above it not inf
    return out.masked_fill(~allowed, float("-inf"))  # (-inf / inf = NaN outside the allowed set)


def pick_sampler(choice: str, temperature, seeded: bool) -> str:
    """A request's sampler: "auto" is gumbel for a seeded sampled request (its text then depends on the seed alone, not
    on what drafts it), rejection otherwise (an unseeded one keeps today's draws); "gumbel" / "rejection" as asked."""
    if choice == "auto":
        sampled = isinstance(temperature, Real) and not isinstance(temperature, bool) and temperature > 0
        return "gumbel" if seeded and sampled else "rejection"
    if choice not in SAMPLERS:
        raise ConfigError(f"sampler must be one of auto, {', '.join(SAMPLERS)}, got {choice!r}")
    return choice


# Gumbel noise keyed by (seed, position): SplitMix64 (Steele et al. 2014), exact 64-bit integer arithmetic, so the same
# uniforms come out on any machine. The key of position t is output t + 1 of SplitMix64 started at the seed's first
# output; u_t(v) is output v + 1 of SplitMix64 started at that key, its top 52 bits as (m + 1/2) / 2**52 in (0, 1).
# A hash of (key, v) rather than a generator's stream: a row needs the noise of the tokens it can emit only (its support).
_GOLDEN, _MIX1, _MIX2 = 0x9E3779B97F4A7C15, 0xBF58476D1CE4E5B9, 0x94D049BB133111EB
_MASK64 = (1 << 64) - 1


def splitmix64(x: int) -> int:
    """SplitMix64's output function of a 64-bit state (Python ints: the reference the tensor code follows)."""
    x &= _MASK64
    x = ((x ^ (x >> 30)) * _MIX1) & _MASK64
    x = ((x ^ (x >> 27)) * _MIX2) & _MASK64
    return x ^ (x >> 31)


def position_key(seed: int, position: int) -> int:
    """The 64-bit key of the noise at absolute position `position` of a sequence sampled with `seed`."""
    return splitmix64(splitmix64(seed + _GOLDEN) + (position + 1) * _GOLDEN)


def _i64(x: int) -> int:
    """A 64-bit pattern as the int64 that holds it (torch's integers are signed; products wrap)."""
    return x - (1 << 64) if x >= 1 << 63 else x


def _shr(z: Tensor, s: int) -> Tensor:
    """Logical right shift of int64 patterns (torch's >> is arithmetic)."""
    return (z >> s) & ((1 << (64 - s)) - 1)


def gumbel_uniforms(key: int, ids: Tensor) -> Tensor:
    """(n,) token ids -> (n,) float64 u(v) in (0, 1): splitmix64(key + (v + 1) * golden) in wrapping int64."""
    z = ids.to(torch.int64) + 1
    z.mul_(_i64(_GOLDEN)).add_(_i64(key & _MASK64))
    z ^= _shr(z, 30)
    z.mul_(_i64(_MIX1))
    z ^= _shr(z, 27)
    z.mul_(_i64(_MIX2))
    z ^= _shr(z, 31)
    return (_shr(z, 12).double() + 0.5) * 2.0**-52  # (n,) exact multiples of 2**-53, never 0 or 1


def gumbel_noise(seed: int, position: int, ids: Tensor) -> Tensor:
    """g_t(v) = -log(-log u_t(v)) (float64) for tokens `ids` at position t: standard Gumbel, independent over (t, v)."""
    return -torch.log(-torch.log(gumbel_uniforms(position_key(seed, position), ids)))


def gumbel_max(probs: Tensor, seed: int, position: int) -> Tensor:
    """(V,) probabilities -> () int64: argmax_v(log p(v) + g_t(v)), an exact sample from p. Computed as argmax p(v) / E(v)
    with E = -log u ~ Exp(1) (the same order: log p - log E), over p's support only (p = 0 is log p = -inf)."""
    key = position_key(seed, position)
    ids = gumbel_candidates(probs, key)  # (n,) the few tokens that can win (kernels/sampling.cpp), or None
    if ids is None:
        support = probs > 0  # (V,)
        if 4 * int(support.sum()) < probs.shape[0]:  # a small support (top-k, top-p, min-p): its tokens' noise only
            ids = torch.nonzero(support).flatten()  # (n,)
    if ids is not None:
        return ids[torch.argmax(probs[ids].double() / -torch.log(gumbel_uniforms(key, ids)))]
    e = -torch.log(gumbel_uniforms(key, torch.arange(probs.shape[0], device=probs.device)))  # (V,) > 0
    return torch.argmax(probs.double() / e)  # p = 0 scores 0, below every token of the support


def inverse_cdf(probs: Tensor, generator: torch.Generator) -> Tensor:
    """(N, V) non-negative weights (each row with a positive one) -> (N,) int64 draws, one uniform each: the first
    token whose fp64 running sum exceeds u * total. Never a zero-weight token (right-sided search; a product rounded up
    to the total falls back to the row's last positive token). torch.multinomial draws V exponentials a row
    (docs/decisions.md)."""
    c = probs.cumsum(-1, dtype=torch.float64)  # (each weight widened before it is added: no fp64 copy of the row)
    x = torch.rand(probs.shape[0], 1, generator=generator, dtype=torch.float64) * c[:, -1:]
    idx = torch.searchsorted(c, x, right=True)[:, 0].clamp_max(probs.shape[-1] - 1)
    zero = probs.gather(1, idx[:, None])[:, 0] <= 0
    if zero.any():
        last = probs.shape[-1] - 1 - (probs[zero].flip(-1) > 0).to(torch.uint8).argmax(-1)
        idx[zero] = last
    return idx


class Sampler:
    """Owns the sampling params and the seeded generator, so a run with the same seed reproduces.

    With context controls on, each sequence samples through its own bound copy (`bind`: its prompt, stop ids and
    emitted tokens, sharing this generator); without them `bind` returns the sampler itself and no context is read."""

    def __init__(self, params: SamplingParams, seed: int = 0) -> None:
        self.params = params
        self.seed = check_seed(seed)
        self.generator = torch.Generator().manual_seed(self.seed)
        self.history: History | None = None  # set on a bound copy
        self.stop_ids: tuple[int, ...] = ()

    def bind(self, prompt: Sequence[int], stop_ids: Sequence[int], vocab_size: int | None) -> "Sampler":
        """The sampler of one sequence after `prompt`, whose generation ends at `stop_ids` (min_tokens bans them)."""
        if not self.params.controls:
            return self
        if vocab_size is None:
            raise ConfigError("sampling controls need the model's vocabulary size (the target has no vocab_size)")
        for name, ids in (("logit bias", [t for t, _ in self.params.logit_bias]), ("banned", self.params.banned_ids)):
            bad = [t for t in ids if t >= vocab_size]
            if bad:
                raise ConfigError(f"{name} token id {bad[0]} is outside the model's vocabulary [0, {vocab_size})")
        bound = copy.copy(self)
        bound.history = History(prompt, vocab_size)
        bound.stop_ids = tuple(int(t) for t in stop_ids if 0 <= t < vocab_size)
        if self.params.grammar is not None:
            with host():
                bound.history.grammar = self.params.grammar.start(bound.stop_ids, vocab_size)
        return bound

    @property
    def reads_context(self) -> bool:
        """Whether a row's transform depends on what came before it (then greedy choices are argmaxes of `logits`)."""
        return self.history is not None

    def advance(self, tokens: Sequence[int]) -> None:
        """The sequence committed `tokens` (its context grew by them)."""
        if self.history is not None:
            self.history.add(tokens)

    def within_grammar(self, tokens: Tensor) -> int:
        """How many of a chain's draft `tokens` (D,) the sequence's grammar allows in a row (all of them without one)."""
        g = self.history.grammar if self.history is not None else None
        if g is None:
            return tokens.shape[0]
        with host():
            return g.valid_prefix(tokens.tolist())

    def logits(self, logits: Tensor, paths: Paths = None) -> Tensor:
        """(..., V) -> the logits after the context controls (row r after paths' row r); themselves when none are on."""
        if self.history is None:
            if self.params.controls:
                raise ConfigError("sampling controls need the sequence's context: use Sampler.bind(prompt, stop_ids, vocab_size)")
            return logits
        return controlled_logits(logits, self.params, self.history, self.stop_ids, paths)

    def probs(self, logits: Tensor, paths: Paths = None) -> Tensor:
        """(..., V) logits -> (..., V) the sampling distribution of each row (row r after paths' row r)."""
        return logits_to_probs(self.logits(logits, paths), self.params)

    def sample(self, probs: Tensor) -> Tensor:
        """(..., V) probabilities -> (...,) int64 token ids (argmax when greedy)."""
        if self.params.greedy:
            return probs.argmax(-1)
        flat = probs.reshape(-1, probs.shape[-1])
        return inverse_cdf(flat.cpu(), self.generator).reshape(probs.shape[:-1]).to(flat.device)  # the host's generator

    def uniform(self, n: int) -> Tensor:
        """(n,) uniforms in [0, 1) of the generator, on the host (the generator's device), whatever the default device."""
        return torch.rand(n, generator=self.generator, device="cpu")

    @property
    def gumbel(self) -> bool:
        """Whether sampled tokens are Gumbel-max choices under position-keyed noise (greedy stays the argmax)."""
        return self.params.sampler == "gumbel" and not self.params.greedy

    def choose(self, probs: Tensor, positions: Sequence[int]) -> Tensor:
        """(R, V) probabilities, row r the distribution at absolute position positions[r] -> (R,) int64 Gumbel-max
        tokens: what a plain step at that position emits, whichever window the row came from."""
        if probs.shape[0] != len(positions):
            raise ValueError(f"{len(positions)} positions for {probs.shape[0]} rows")
        return torch.stack([gumbel_max(row, self.seed, int(t)) for row, t in zip(probs, positions)]) if len(positions) \
            else torch.empty(0, dtype=torch.long, device=probs.device)

    def draw(self, probs: Tensor, position: int) -> Tensor:
        """A drafter's token(s) from q: (V,) at absolute position `position`, or (n, V) at position..position+n-1.
        Gumbel: argmax(log q + g_t) with the noise the target's token there will use, so a q close to p drafts that
        token (acceptance rises; verification does not read q). Otherwise a draw of the generator (`sample`)."""
        if not self.gumbel:
            return self.sample(probs)
        if probs.ndim == 1:
            return self.choose(probs[None], [position])[0]
        return self.choose(probs, range(position, position + probs.shape[0]))

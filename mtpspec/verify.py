"""Lossless verification of a draft against the target's logits.

Greedy: draft token i is accepted iff it equals argmax p_i and all earlier drafts were accepted;
the first mismatch emits argmax p there (recovered), full acceptance emits argmax p_D (bonus).
The output is token-identical to plain greedy decoding.

Sampling (Leviathan et al. 2023, Alg. 1; Chen et al. 2023): draft x_i ~ q_i is accepted with
probability min(1, p_i(x_i) / q_i(x_i)); at the first rejection the recovered token is drawn from
norm(max(p_i - q_i, 0)); if all survive the bonus is drawn from p_D. The emitted stream then has
exactly the target's distribution. A drafter without q is a point mass at its token (q(x) = 1).

Gumbel (`SamplingParams.sampler == "gumbel"`): the target's token at absolute position t is the Gumbel-max choice
argmax_v(log p_t(v) + g_t(v)), the noise a function of (seed, t) alone (sampling.py); draft token i is accepted iff it
equals that choice at its position, the first mismatch emits the choice there, full acceptance the choice at D+1. Every
emitted token is then the one a plain step with the same seed emits: the text depends on the seed alone, not on the
drafter, the depth or the batch, and each token is an exact sample from p. q is not read.

Row i of the window is transformed (sampling.py's context controls) with the committed context plus d1..di as its
context: the distribution, or the argmax, a plain step would have there.
"""

from __future__ import annotations

import torch
from torch import Tensor

from .sampling import Sampler
from .types import Draft, Verdict


def verify_greedy(draft_tokens: Tensor, p_logits: Tensor) -> Verdict:
    """draft_tokens (D,), p_logits (D+1, V) -> Verdict (its tokens on the logits' device; one host sync: n)."""
    d = draft_tokens.shape[0]
    target = p_logits.argmax(-1)  # (D+1,) the target's own greedy choice at every position
    draft_tokens = draft_tokens.to(target.device)  # (D,) (a no-op on the CPU)
    agree = (draft_tokens == target[:d]).to(torch.int8)  # (D,)
    n = int(agree.cumprod(0).sum()) if d else 0  # length of the agreeing prefix
    tokens = torch.cat([draft_tokens[:n], target[n : n + 1]])  # accepted + recovered/bonus
    return Verdict(num_accepted=n, tokens=tokens, num_drafted=d)


def verify_greedy_many(drafts: list[Draft], choices: list[int] | Tensor) -> list[Verdict]:
    """verify_greedy for several sequences at once: choices = the target's argmax at every verified row, the
    sequences' D_i + 1 rows one after another (one host sync for the whole batch instead of one per sequence). Choices
    as a tensor on a device are read back together with the drafts: one transfer to the host. The verdicts' tokens are
    made on torch's default device (the engine's: the model's)."""
    if isinstance(choices, Tensor) and choices.device.type != "cpu":
        sizes = [d.tokens.shape[0] for d in drafts]
        host = torch.cat([*(d.tokens.to(choices.device) for d in drafts), choices]).tolist()
        drafted, at = [], 0
        for n in sizes:
            drafted.append(host[at : at + n])
            at += n
        choices = host[at:]
    else:
        drafted = [d.tokens.tolist() for d in drafts]
        choices = choices.tolist() if isinstance(choices, Tensor) else choices
    verdicts, i = [], 0
    for d in drafted:
        target = choices[i : i + len(d) + 1]  # (D+1,) the target's own choice at every position
        n = 0
        while n < len(d) and d[n] == target[n]:
            n += 1
        verdicts.append(Verdict(num_accepted=n, tokens=torch.tensor(d[:n] + [target[n]]), num_drafted=len(d)))
        i += len(d) + 1
    return verdicts


def verify_sampling(draft: Draft, p: Tensor, sampler: Sampler) -> Verdict:
    """Rejection sampling. p (D+1, V): the target's probabilities after the sampling transform."""
    x = draft.tokens.to(p.device)  # (D,)
    d = x.shape[0]
    idx = torch.arange(d, device=p.device)
    p_x = p[idx, x]  # (D,) target probability of each draft token
    q_x = draft.q[idx, x] if draft.q is not None else torch.ones(d, device=p.device)  # (D,) point mass when no q
    u = sampler.uniform(d).to(p.device)  # (D,) the generator's draws (host), compared where p is
    accept = (u * q_x < p_x).to(torch.int8)  # u < p/q  <=>  accept with probability min(1, p/q)
    n = int(accept.cumprod(0).sum()) if d else 0
    if n == d:  # every draft survived: the bonus token comes from p at position D+1
        last = sampler.sample(p[d])
    else:  # first rejection at n: the recovered token comes from the residual norm(max(p - q, 0))
        q_n = draft.q[n] if draft.q is not None else torch.nn.functional.one_hot(x[n], p.shape[-1]).float()
        residual = torch.clamp(p[n] - q_n, min=0.0)  # (V,)
        total = residual.sum()
        # total == 0 only if p_n <= q_n everywhere, i.e. p_n == q_n, where rejection has probability 0
        last = sampler.sample(residual / total if total > 0 else p[n])
    tokens = torch.cat([x[:n], last.reshape(1)])
    return Verdict(num_accepted=n, tokens=tokens, num_drafted=d)


def verify_gumbel(draft_tokens: Tensor, p: Tensor, sampler: Sampler, position: int) -> Verdict:
    """Gumbel-max verification. p (D+1, V) after the sampling transform, row i the distribution at absolute position
    position + i (position: the context's length, the first new token's place)."""
    d, n = draft_tokens.shape[0], 0
    draft_tokens = draft_tokens.to(p.device)  # (D,) (a no-op on the CPU)
    while True:  # row by row: the rows after the first mismatch are never drawn
        choice = sampler.choose(p[n : n + 1], [position + n])  # (1,) the target's token at position + n
        if n == d or int(choice) != int(draft_tokens[n]):
            break
        n += 1
    return Verdict(num_accepted=n, tokens=torch.cat([draft_tokens[:n], choice]), num_drafted=d)


def verify(draft: Draft, p_logits: Tensor, sampler: Sampler, position: int | None = None) -> Verdict:
    """draft (D tokens, q (D, V) or None), p_logits (D+1, V) -> Verdict (n accepted + 1 token). position: the absolute
    position of row 0's token (the committed context's length), which Gumbel sampling keys its noise by."""
    if sampler.params.greedy:
        return verify_greedy(draft.tokens, sampler.logits(p_logits, draft.tokens))  # row i after d1..di
    if sampler.gumbel:
        if position is None:
            raise ValueError("Gumbel sampling verifies at absolute positions: pass the context's length as position")
        return verify_gumbel(draft.tokens, sampler.probs(p_logits, draft.tokens), sampler, position)
    return verify_sampling(draft, sampler.probs(p_logits, draft.tokens), sampler)

"""The computations behind the live verify page, free of HTTP: load, tokenise, verify one draft, step a run.

verify_draft() is one real verification round, the engine's own step (engine.Session with a
FixedDrafter proposing the page's draft): the target fills its cache with the prefix (all but the
last token), then ONE forward over [last, d1..dD] gives D+1 next-token distributions p, and greedy
verification keeps the longest prefix of the draft that equals argmax p, plus the target's own
token at the first mismatch (recovered) or after the last draft (bonus). Draft tokens after the
first mismatch are discarded unchecked: a later guess is never kept once its prefix is wrong.
"""

from __future__ import annotations

import torch

from ..api import Model
from ..drafters import make_drafter
from ..drafters.fixed import FixedDrafter
from ..engine import Session
from ..errors import ConfigError
from ..sampling import Sampler, SamplingParams
from ..types import GenerationResult

MAX_DRAFT = 64  # longest draft the page verifies in one forward (D + 1 positions)
MAX_TOP_K = 50
MAX_NEW_TOKENS = 512  # longest step-through run


class FieldError(ConfigError):
    """Bad input in one request field: answered 4xx with {"error": "FIELD: ..."} (400, or 404 for an unknown name)."""

    def __init__(self, field: str, message: str, status: int = 400) -> None:
        super().__init__(f"{field}: {message}")
        self.field, self.status = field, status


def token_texts(model: Model, ids: list[int], prev: int | None) -> list[dict]:
    """[{id, text}] decoded in context, so spaces come out as the model sees them."""
    out = []
    for t in ids:
        out.append({"id": int(t), "text": model.tokenizer.decode([int(t)], prev=prev)})
        prev = int(t)
    return out


def _encode_piece(model: Model, text: str) -> list[int]:
    """Tokens of `text` exactly as written (no BOS, no dummy-prefix space), for a draft typed on its own."""
    tok = model.tokenizer
    if hasattr(tok, "lookup") and hasattr(tok, "scores"):  # llama2.c: its encode() always adds " " first
        if text.startswith(" "):
            return tok.encode(text[1:], bos=False)  # the dummy-prefix space stands for the typed one
        return _llama2c_merge(tok, text)
    inner = getattr(tok, "tokenizer", None)  # Hugging Face `tokenizers`: encode without special tokens
    if inner is not None and hasattr(inner, "encode"):
        return list(inner.encode(text, add_special_tokens=False).ids)
    ids = tok.encode(text)
    return ids[1:] if ids and ids[0] == getattr(tok, "bos_id", None) else ids


def _llama2c_merge(tok, text: str) -> list[int]:
    """llama2.c BPE of `text` without the dummy-prefix space (run.c's merge loop, unchanged)."""
    ids: list[int] = []
    for ch in text:
        b = ch.encode("utf-8")
        ids += [tok.lookup[b]] if b in tok.lookup else [byte + 3 for byte in b]  # byte fallback
    while True:
        best, best_i, best_id = -1e10, -1, -1
        for i in range(len(ids) - 1):
            tid = tok.lookup.get(tok.pieces[ids[i]] + tok.pieces[ids[i + 1]])
            if tid is not None and tok.scores[tid] > best:
                best, best_i, best_id = tok.scores[tid], i, tid
        if best_i < 0:
            return ids
        ids[best_i : best_i + 2] = [best_id]


def tokenize_draft(model: Model, prefix_ids: list[int], prefix: str, draft: str) -> list[int]:
    """A typed continuation as token ids after prefix_ids.

    Preferred: encode(prefix + draft) and keep the ids after the prefix's own ids, when the prefix
    tokenises the same way inside the longer text (the ids the model would really see). Otherwise
    the draft is tokenised alone, exactly as typed (llama2.c: without the dummy-prefix space).
    """
    full = model.tokenizer.encode(prefix + draft)
    if full[: len(prefix_ids)] == prefix_ids and len(full) > len(prefix_ids):
        return full[len(prefix_ids) :]
    return _encode_piece(model, draft)


def _dist(model: Model, p_row: torch.Tensor, prev: int, top_k: int) -> list[dict]:
    probs, ids = torch.topk(p_row, min(top_k, p_row.shape[-1]))
    return [{"id": int(i), "text": model.tokenizer.decode([int(i)], prev=prev), "p": float(q)} for q, i in zip(probs, ids)]


@torch.inference_mode()
def verify_draft(
    model: Model,
    prefix: str,
    draft: str | None = None,
    draft_ids: list[int] | None = None,
    drafter: str | None = None,
    k: int = 4,
    draft_model: object | None = None,
    top_k: int = 10,
) -> dict:
    """One greedy verification round of a draft after `prefix`; see the module docstring.

    draft_model: what drafter `drafter` drafts with (a draft model's module, or a trained head)."""
    if not 1 <= top_k <= MAX_TOP_K:
        raise FieldError("top_k", f"must be in 1..{MAX_TOP_K}, got {top_k}")
    module, tok = model.module, model.tokenizer
    ids = prefix_ids(model, prefix)
    if draft_ids is not None:
        dids = [int(t) for t in draft_ids]
        bad = [t for t in dids if not 0 <= t < module.vocab_size]
        if bad:
            raise FieldError("draft_ids", f"token ids out of range 0..{module.vocab_size - 1}: {bad[:5]}")
        source = "ids"
    elif draft is not None and draft != "":
        dids, source = tokenize_draft(model, ids, prefix, draft), "typed"
    elif drafter:
        if not 1 <= k <= MAX_DRAFT:
            raise FieldError("k", f"D (draft length) must be in 1..{MAX_DRAFT}, got {k}")
        dids, source = None, drafter
    else:
        raise FieldError("draft", "no draft: type a continuation, or choose a drafter to propose one")
    if dids is not None:
        _check_draft_fits(module, ids, dids, "draft_ids" if source == "ids" else "draft")
        fixed, depth = FixedDrafter(dids), len(dids)
    else:
        fixed, depth = FixedDrafter(inner=make_drafter(drafter, module, draft_model=draft_model)), k
    # the engine's own step: prefill all but the last token, ONE verify pass over [last, d1..dD], greedy acceptance
    session = Session(module, ids, fixed, Sampler(SamplingParams()), k=max(depth, 1), max_new_tokens=depth + 1, trace=True)
    step = session.step(depth)
    dids, n, emitted_ids = step.draft, step.num_accepted, step.emitted
    p = torch.softmax(fixed.verified.logits.float(), dim=-1)  # (D+1, V) the target's distribution at each position
    dlen = len(dids)
    prevs = [ids[-1]] + dids  # the token each position conditions on last
    positions = []
    for i in range(dlen + 1):
        target = step.target_choice[i]
        if i < dlen:
            status = "accepted" if i < n else "rejected" if i == n else "discarded"
            dtok = {"id": dids[i], "text": tok.decode([dids[i]], prev=prevs[i]), "p": step.p_of_draft[i]}
        else:
            status, dtok = ("bonus" if n == dlen else "unused"), None
        positions.append({
            "index": i, "status": status, "draft": dtok,
            "target": {"id": target, "text": tok.decode([target], prev=prevs[i]), "p": float(p[i, target])},
            "top": _dist(model, p[i], prevs[i], top_k),
        })
    emitted = token_texts(model, emitted_ids, ids[-1])
    last = positions[n]["target"]
    return {
        "verification": "greedy",
        "rule": "draft token i is accepted iff it equals the target's argmax at its position and every earlier draft "
                "token was accepted; the target's own argmax follows (correction at the first mismatch, bonus if all pass)",
        "prefix": {"text": prefix, "ids": ids, "tokens": _prefix_tokens(model, ids)},
        "draft": {"source": source, "ids": dids, "tokens": token_texts(model, dids, ids[-1]),
                  "text": tok.decode(dids, prev=ids[-1])},
        "num_drafted": dlen,
        "num_accepted": n,
        "correction": dict(last, position=n) if n < dlen else None,
        "bonus": dict(last, position=n) if n == dlen else None,
        "emitted": emitted,
        "emitted_text": tok.decode(emitted_ids, prev=ids[-1]),
        "discarded": [positions[i]["draft"] for i in range(n + 1, dlen)],
        "target_forwards": 1,
        "positions": positions,
    }


def prefix_ids(model: Model, prefix: str) -> list[int]:
    """The prefix's token ids; an empty prefix, or one that fills the context, is a `prefix` error."""
    if not prefix or not prefix.strip():
        raise FieldError("prefix", "empty: type some text for the model to continue")
    ids = model.tokenizer.encode(prefix)
    if not ids:
        raise FieldError("prefix", "tokenises to no tokens")
    if len(ids) >= model.module.max_seq_len:
        raise FieldError("prefix", f"{len(ids)} tokens leave no room in the model's context of {model.module.max_seq_len}")
    return ids


def _check_draft_fits(module, ids: list[int], dids: list[int], field: str) -> None:
    if len(ids) + len(dids) > module.max_seq_len:
        raise FieldError(field, f"prefix ({len(ids)} tokens) + draft ({len(dids)} tokens) is longer than the model's context of {module.max_seq_len}")
    if len(dids) > MAX_DRAFT:
        raise FieldError(field, f"the draft is {len(dids)} tokens; the page verifies at most {MAX_DRAFT} at once")


def _prefix_tokens(model: Model, ids: list[int]) -> list[dict]:
    """The prefix's tokens for display (BOS, when the tokenizer adds one, left out)."""
    if ids and ids[0] == getattr(model.tokenizer, "bos_id", None):
        return token_texts(model, ids[1:], ids[0])
    return token_texts(model, ids, None)


def step_through(model: Model, prefix: str, drafter: str, k: int, max_new_tokens: int, draft_model: object | None = None) -> dict:
    """A real speculative run (and the plain run it must equal), every step laid out for the page."""
    if not 1 <= max_new_tokens <= MAX_NEW_TOKENS:
        raise FieldError("max_new_tokens", f"must be in 1..{MAX_NEW_TOKENS}, got {max_new_tokens}")
    if not 1 <= k <= MAX_DRAFT:
        raise FieldError("k", f"D (draft length) must be in 1..{MAX_DRAFT}, got {k}")
    if drafter in ("none", ""):
        raise FieldError("drafter", "choose a drafter (ngram, draft, ...) to step through speculative rounds")
    prefix_ids(model, prefix)
    plain = model.generate(prefix, max_new_tokens=max_new_tokens, trace=True)
    spec = model.generate(prefix, drafter=drafter, k=k, draft_model=draft_model, max_new_tokens=max_new_tokens, trace=True)
    plain_step = _mean_step_seconds(plain)
    prev = spec.prompt_tokens[-1]
    steps = []
    tok = model.tokenizer
    for i, s in enumerate(spec.steps):
        n, d = s.num_accepted, len(s.draft)
        draft_toks = token_texts(model, s.draft, prev)
        prevs = [prev] + s.draft
        choice = [{"id": t, "text": tok.decode([t], prev=prevs[j]), "p": None} for j, t in enumerate(s.target_choice)]
        steps.append({
            "index": i, "draft": draft_toks, "num_drafted": d, "num_accepted": n, "target_choice": choice,
            "p_of_draft": s.p_of_draft, "emitted": token_texts(model, s.emitted, prev), "p_of_emitted": s.p_of_emitted,
            "last_kind": "bonus" if n == d else "recovered",
            "discarded": draft_toks[n + 1 :], "rejected": draft_toks[n] if n < d else None,
            "draft_seconds": s.draft_seconds, "verify_seconds": s.verify_seconds,
            "cost_seconds": s.draft_seconds + s.verify_seconds,
            "plain_cost_seconds": plain_step * len(s.emitted),
        })
        if s.emitted:
            prev = s.emitted[-1]
    return {
        "drafter": drafter, "k": k, "prompt_tokens": spec.prompt_tokens, "text": spec.text,
        "identical_to_plain": spec.tokens == plain.tokens, "plain_step_seconds": plain_step,
        "stats": spec.stats.to_json(), "plain_stats": plain.stats.to_json(), "steps": steps,
    }


def _mean_step_seconds(res: GenerationResult) -> float:
    steps = res.steps or []
    return sum(s.draft_seconds + s.verify_seconds for s in steps) / len(steps) if steps else 0.0


__all__ = ["FieldError", "verify_draft", "step_through", "tokenize_draft", "MAX_DRAFT", "MAX_TOP_K", "MAX_NEW_TOKENS"]

"""The computations behind the live verify page, free of HTTP: load, tokenise, verify one draft, step a run.

verify_draft() is one real verification round, the engine's own step (engine.Session with a FixedDrafter
proposing the page's draft): the target caches the prefix but its last token, then ONE forward over
[last, d1..dD] gives D+1 next-token distributions p; greedy verification keeps the longest prefix of the draft
that equals argmax p, plus the target's own token at the first mismatch (recovered) or after the last draft
(bonus). Drafts after the first mismatch are discarded unchecked.

A token tree (a drafter's `tree` node budget) is verified the same way in one forward; draft_tree() lays out
any step's draft as a tree (a chain: node i's parent is i - 1), each node accepted (on the target's path),
rejected (a reached node's child, refused) or discarded (never checked), then the target's token after the
path (recovered when the path's end had children, bonus at a leaf).
"""

from __future__ import annotations

import torch

from ..api import Model
from ..drafters import OPTIONS, make_drafter
from ..drafters.fixed import FixedDrafter
from ..engine import Session
from ..errors import ConfigError
from ..sampling import Sampler, SamplingParams
from ..tree import MAX_TREE
from ..types import GenerationResult, StepRecord

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
    tree: int = 0,
    tree_beam: int = 1,
) -> dict:
    """One greedy verification round of a draft after `prefix`; see the module docstring.

    draft_model: what drafter `drafter` drafts with (a draft model's module, or a trained head).
    tree: a node budget for a proposing drafter that grows token trees (0: a chain); see _tree_answer. tree_beam: its nodes
    expanded per level (mtp, eagle, draft)."""
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
        if tree:
            raise FieldError("tree", "is used only when a drafter proposes the draft (no draft, no draft_ids)")
        _check_draft_fits(module, ids, dids, "draft_ids" if source == "ids" else "draft")
        fixed, depth = FixedDrafter(dids), len(dids)
    else:
        budget = check_tree(drafter, tree)
        fixed, depth = FixedDrafter(inner=make_drafter(drafter, module, draft_model=draft_model, tree=budget,
                                                       **beam_option(drafter, budget, tree_beam))), k
    # the engine's own step: prefill all but the last token, ONE verify pass over [last, d1..dD], greedy acceptance
    session = Session(module, ids, fixed, Sampler(SamplingParams()), k=max(depth, 1), max_new_tokens=depth + 1, trace=True)
    step = session.step(depth)
    if step.draft_parents is not None:
        return _tree_answer(model, prefix, ids, source, step, fixed.verified.logits, top_k)
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


def _tree_answer(model: Model, prefix: str, ids: list[int], source: str, step: StepRecord, logits: torch.Tensor,
                 top_k: int) -> dict:
    """verify_draft's answer for a token tree: the tree (draft_tree) and one position per row the walk reached (the
    root, then each accepted node; logits (n+1, V) are those rows of the verify pass, what the engine keeps).

    Position i < n is accepted (its node on the path); position n is where the walk stopped: rejected when that row
    had children (each one refused: `refused`), bonus when it was a leaf. Either way the target's token follows."""
    tok, n = model.tokenizer, step.num_accepted
    layout = draft_tree(model, step, ids[-1])
    nodes, path = layout["nodes"], layout["path"]
    p = torch.softmax(logits.float(), dim=-1)  # (n+1, V) the target's distribution at each reached row
    rows = [-1] + path  # the node each position follows (-1: the last prefix token)
    prevs = [ids[-1]] + [step.draft[j] for j in path]
    positions = []
    for i in range(n + 1):
        target = step.target_choice[i]
        node = nodes[path[i]] if i < n else None
        refused = [{"id": x["id"], "text": x["text"], "p": x["p"], "node": x["index"]}
                   for x in nodes if x["status"] == "rejected" and x["parent"] == rows[i]]
        positions.append({
            "index": i, "status": "accepted" if i < n else "rejected" if refused else "bonus",
            "node": None if node is None else node["index"],
            "draft": None if node is None else {"id": node["id"], "text": node["text"], "p": node["p"]},
            "refused": refused,
            "target": {"id": target, "text": tok.decode([target], prev=prevs[i]), "p": float(p[i, target])},
            "top": _dist(model, p[i], prevs[i], top_k),
        })
    last = positions[n]["target"]
    recovered = layout["target"]["kind"] == "recovered"
    return {
        "verification": "greedy",
        "rule": "the walk starts after the last prefix token; at each reached node the child equal to the target's argmax "
                "is accepted and the walk goes on from it, other children are rejected and their subtrees discarded "
                "unchecked; the target's own argmax follows where the walk stops (correction if that node had children, "
                "bonus at a leaf)",
        "prefix": {"text": prefix, "ids": ids, "tokens": _prefix_tokens(model, ids)},
        "draft": {"source": source, "ids": step.draft, "tokens": [{"id": x["id"], "text": x["text"]} for x in nodes],
                  "text": tok.decode([nodes[j]["id"] for j in path], prev=ids[-1])},  # a tree's text: its accepted path
        "num_drafted": len(nodes),
        "num_accepted": n,
        "correction": dict(last, position=n) if recovered else None,
        "bonus": None if recovered else dict(last, position=n),
        "emitted": token_texts(model, step.emitted, ids[-1]),
        "emitted_text": tok.decode(step.emitted, prev=ids[-1]),
        "discarded": [{"id": x["id"], "text": x["text"], "p": x["p"]} for x in nodes if x["status"] == "discarded"],
        "target_forwards": 1,
        "positions": positions,
        "tree": layout,
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


def beam_option(drafter: str, budget: int | None, beam: int) -> dict:
    """make_drafter's tree_beam for the page's form: given to the drafters that read it, when it drafts a tree; a beam
    other than 1 with any other drafter is a field error."""
    if budget is not None and "tree_beam" in OPTIONS.get(drafter, ()):
        return {"tree_beam": beam}
    if beam != 1:
        takers = ", ".join(name for name, keys in OPTIONS.items() if "tree_beam" in keys)
        raise FieldError("tree_beam", f"is an option of token trees (tree > 0) drafted by {takers}, not of {drafter}"
                         + ("" if budget is not None else " chains"))
    return {}


def check_tree(drafter: str, tree: int) -> int | None:
    """The page's tree budget: 0 = a chain (None for the drafter), 1..MAX_TREE nodes for a drafter that grows trees."""
    if isinstance(tree, bool) or not isinstance(tree, int) or not 0 <= tree <= MAX_TREE:
        raise FieldError("tree", f"tree nodes must be in 0..{MAX_TREE} (0 = a chain), got {tree!r}")
    if tree and "tree" not in OPTIONS.get(drafter, ("tree",)):
        growers = ", ".join(n for n, keys in OPTIONS.items() if "tree" in keys)
        raise FieldError("tree", f"drafter {drafter!r} drafts chains only (tree nodes 0); trees: {growers}")
    return tree or None


def draft_tree(model: Model, step: StepRecord, prev: int) -> dict:
    """One step's draft as a tree (a chain: node i's parent is i - 1), every node's verdict, and the target's token
    after the accepted path. `prev`: the last token before the step (what the roots follow)."""
    tok, d, n = model.tokenizer, len(step.draft), step.num_accepted
    tree = step.draft_parents is not None
    parents = list(step.draft_parents) if tree else [i - 1 for i in range(d)]
    path = list(step.path) if tree else list(range(n))
    row = {-1: 0, **{node: j + 1 for j, node in enumerate(path)}}  # a reached node -> its index in target_choice
    on_path, depth, nodes = set(path), [], []
    for i, (t, par) in enumerate(zip(step.draft, parents)):
        depth.append(1 if par < 0 else depth[par] + 1)  # depth 1: the first position after `prev`
        status = "accepted" if i in on_path else "rejected" if par in row else "discarded"
        before = prev if par < 0 else step.draft[par]
        choice = step.target_choice[row[par]] if par in row and row[par] < len(step.target_choice) else None
        nodes.append({
            "index": i, "id": t, "text": tok.decode([t], prev=before), "parent": par, "depth": depth[i], "status": status,
            "p": step.p_of_draft[i] if i < len(step.p_of_draft) else None,  # the target's p of this token after its parent
            "target": None if choice is None else {"id": choice, "text": tok.decode([choice], prev=before)},
        })
    end = path[-1] if path else -1
    target = None
    if n < len(step.target_choice):
        t = step.target_choice[n]
        target = {"id": t, "text": tok.decode([t], prev=step.draft[end] if end >= 0 else prev), "parent": end,
                  "depth": n + 1, "kind": "recovered" if any(p == end for p in parents) else "bonus",
                  "emitted": len(step.emitted) > n}  # a stop token is chosen but not emitted
    return {"is_tree": tree, "nodes": nodes, "path": path, "target": target,
            "depth": max(depth, default=0), "root": {"id": prev, "text": tok.decode([prev])}}


def step_through(model: Model, prefix: str, drafter: str, k: int, max_new_tokens: int, draft_model: object | None = None,
                 tree: int = 0, tree_beam: int = 1) -> dict:
    """A real speculative run (and the plain run it must equal), every step laid out for the page.

    tree: a node budget for a drafter that grows token trees (0: chains); each step's `tree` is its draft as a tree."""
    if not 1 <= max_new_tokens <= MAX_NEW_TOKENS:
        raise FieldError("max_new_tokens", f"must be in 1..{MAX_NEW_TOKENS}, got {max_new_tokens}")
    if not 1 <= k <= MAX_DRAFT:
        raise FieldError("k", f"D (draft length) must be in 1..{MAX_DRAFT}, got {k}")
    if drafter in ("none", ""):
        raise FieldError("drafter", "choose a drafter (ngram, draft, ...) to step through speculative rounds")
    budget = check_tree(drafter, tree)
    beam = beam_option(drafter, budget, tree_beam)
    prefix_ids(model, prefix)
    plain = model.generate(prefix, max_new_tokens=max_new_tokens, trace=True)
    spec = model.generate(prefix, drafter=drafter, k=k, draft_model=draft_model, max_new_tokens=max_new_tokens, trace=True,
                          tree=budget, **beam)
    plain_step = _mean_step_seconds(plain)
    prev = spec.prompt_tokens[-1]
    steps = []
    tok = model.tokenizer
    for i, s in enumerate(spec.steps):
        n, d = s.num_accepted, len(s.draft)
        layout = draft_tree(model, s, prev)
        draft_toks = token_texts(model, s.draft, prev)
        if layout["is_tree"]:  # a node's text follows its parent; target_choice is along the accepted path
            draft_toks = [{"id": x["id"], "text": x["text"]} for x in layout["nodes"]]
            prevs = [prev] + [s.draft[j] for j in layout["path"]]
        else:
            prevs = [prev] + s.draft
        choice = [{"id": t, "text": tok.decode([t], prev=prevs[j]), "p": None} for j, t in enumerate(s.target_choice)]
        last_kind = layout["target"]["kind"] if layout["target"] else ("bonus" if n == d else "recovered")
        steps.append({
            "index": i, "draft": draft_toks, "num_drafted": d, "num_accepted": n, "target_choice": choice,
            "p_of_draft": s.p_of_draft, "emitted": token_texts(model, s.emitted, prev), "p_of_emitted": s.p_of_emitted,
            "last_kind": last_kind,
            # a chain: the tokens after the first mismatch, and the refused one; a tree: tree.nodes says per node
            "discarded": [draft_toks[x["index"]] for x in layout["nodes"] if x["status"] == "discarded"],
            "rejected": None if layout["is_tree"] else draft_toks[n] if n < d else None,
            "tree": layout,
            "draft_seconds": s.draft_seconds, "verify_seconds": s.verify_seconds,
            "cost_seconds": s.draft_seconds + s.verify_seconds,
            "plain_cost_seconds": plain_step * len(s.emitted),
        })
        if s.emitted:
            prev = s.emitted[-1]
    return {
        "drafter": drafter, "k": k, "tree": tree, "prompt_tokens": spec.prompt_tokens, "text": spec.text,
        "identical_to_plain": spec.tokens == plain.tokens, "plain_step_seconds": plain_step,
        "stats": spec.stats.to_json(), "plain_stats": plain.stats.to_json(), "steps": steps,
    }


def _mean_step_seconds(res: GenerationResult) -> float:
    steps = res.steps or []
    return sum(s.draft_seconds + s.verify_seconds for s in steps) / len(steps) if steps else 0.0


__all__ = ["FieldError", "verify_draft", "step_through", "draft_tree", "check_tree", "tokenize_draft", "MAX_DRAFT", "MAX_TOP_K",
           "MAX_NEW_TOKENS", "MAX_TREE"]

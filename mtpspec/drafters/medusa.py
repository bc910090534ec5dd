"""Medusa drafting: K residual heads on the target's hidden state at the last forwarded position.

With the engine's convention the target's cache holds every token but `last`; the hidden state h at
the last forwarded position is the one whose next token is `last`. Medusa block k (1-based) on h
predicts the token k positions after `last`, so one call of the K blocks drafts d1..dK at once
(a chain of their top-1 tokens, or with `tree` a token tree: the most probable paths through each
block's top guesses, tree.py). Each head's q is its own
distribution, which does not depend on the earlier drafts: still a valid proposal, so rejection
sampling stays exact.

After a verify over [last, d1..dD] with n accepted, the next `last` is verdict.tokens[n] and the
hidden at row n of that pass is its predecessor's: the one the next proposal reads.
"""

from __future__ import annotations

import torch
from torch import Tensor

from ..sampling import Sampler
from ..tree import observe_step, tree_budget
from ..types import Draft, TargetOutput, Verdict


class MedusaDrafter:
    name = "medusa"
    prefill_logits = False  # it never reads the target's logits over the prompt
    prefill_hidden = True  # its heads start from the last prompt position's hidden state
    taps = ()  # nor any layer's inputs

    def __init__(self, target, head, tree: int | None = None) -> None:
        from ..models.heads import check_fits
        from ..tree import TreeChoice, check_tree_budget, shared_sizer

        check_fits(head, target)
        self.tree = check_tree_budget(tree)
        self.sizer = TreeChoice(shared_sizer(target, "medusa")) if tree == "auto" else None  # --tree auto
        self.ranks = self.proposed = None  # a tree: tree.RankAcceptance and the last tree.Proposed
        self.target, self.heads = target, head.medusa
        self.k_max = head.config.num_medusa
        self.h: Tensor | None = None  # (H,) hidden at the last forwarded position
        self.sampler: Sampler | None = None

    def prefill(self, context: Tensor, out: TargetOutput | None, sampler: Sampler) -> None:
        self.sampler = sampler
        self.h = out.hidden[-1] if out is not None else None

    @torch.inference_mode()
    def propose(self, context: Tensor, k: int) -> Draft:
        if self.h is None:
            return Draft.empty()
        k = min(k, self.k_max)
        logits = self.target.head(self.heads(self.h[None])[:k, 0])  # (k, V)
        budget = tree_budget(self.tree, self.sizer)
        if budget is not None:
            return self._tree(logits, budget)
        if self.sampler.reads_context:  # head j's row after the drafts before it, as the target's row j
            return self._in_context(logits, len(context))
        if self.sampler.params.greedy:
            return Draft(tokens=logits.argmax(-1))
        q = self.sampler.probs(logits)  # (k, V) the same transform as p
        return Draft(tokens=self.sampler.draw(q, len(context)), q=q)  # row j at position len(context) + j

    def _in_context(self, logits: Tensor, at: int) -> Draft:
        """logits (k, V) -> the chain drawn head by head, row j transformed after drafts 0..j-1 (the context controls),
        at absolute position at + j."""
        tokens, qs = [], []
        for row in logits:
            if self.sampler.params.greedy:
                tokens.append(self.sampler.logits(row, [tokens]).argmax(-1))
                continue
            qs.append(self.sampler.probs(row, [tokens]))  # (V,)
            tokens.append(self.sampler.draw(qs[-1], at + len(tokens)))
        return Draft(tokens=torch.stack(tokens), q=torch.stack(qs) if qs else None)  # (k,), q (k, V)

    def _tree(self, logits: Tensor, budget: int) -> Draft:
        """Block j's top guesses as the children of every node at depth j (the blocks do not read the drafts
        before them), expanded and kept by value along the path (tree.grow / keep_best); point masses."""
        from ..tree import GrowingTree, RankAcceptance, grow, keep_best

        greedy = self.sampler.params.greedy
        logq = torch.log_softmax(logits.float(), -1) if greedy else self.sampler.probs(logits).log()  # (k, V)
        branch = min(4, budget)
        top = logq.topk(branch, dim=-1)  # (k, branch) values, ids
        grown = GrowingTree(0)
        self.ranks = self.ranks or RankAcceptance(branch)
        grow(grown, (top.values[0], top.indices[0]), lambda nodes: (top.values[grown.depth[nodes[0]] + 1].expand(len(nodes), -1),
                                                                       top.indices[grown.depth[nodes[0]] + 1].expand(len(nodes), -1)),
             logq.shape[0], 4, self.ranks)
        draft, self.proposed = keep_best(grown, budget)
        return draft

    def commit(self, verdict: Verdict, out: TargetOutput) -> None:
        observe_step(self.sizer, verdict)
        if verdict.path is not None and self.proposed is not None:
            self.ranks.observe(self.proposed.parents, self.proposed.ranks, verdict.path)
        self.h = out.hidden[verdict.num_accepted]

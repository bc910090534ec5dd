"""An independent draft model: any causal LM the project can load, sharing the target's vocabulary.

It keeps its own KV cache over the committed context plus the drafts it fed itself, drafts k tokens
autoregressively (sampled from q with the same sampling transform as the target, or argmax when
greedy) and returns q, so rejection sampling stays exact and acceptance stays high at T > 0.
After verification it crops its cache to the context plus the accepted drafts (a pointer move).
A draft model with recurrent state (a hybrid) can only crop inside its last forward, and drafting
runs one forward per token: it snapshots its state after reading the context and, at commit,
restores it; the accepted drafts are then read again with the next context (one forward).
"""

from __future__ import annotations

import torch
from torch import Tensor

from ..errors import ConfigError
from ..sampling import Sampler
from ..tree import observe_step, tree_budget
from ..types import Draft, TargetOutput, Verdict


class DraftModelDrafter:
    name = "draft"
    prefill_logits = False  # it never reads the target's logits over the prompt
    prefill_hidden = False  # nor its hidden states
    taps = ()  # nor any layer's inputs

    def __init__(self, model, target_vocab_size: int, tree: int | None = None, tree_beam: int = 1) -> None:
        from ..tree import TreeChoice, check_tree_beam, check_tree_budget, shared_sizer

        if model.vocab_size != target_vocab_size:
            raise ConfigError(
                f"draft model vocabulary ({model.vocab_size}) differs from the target's ({target_vocab_size})"
            )
        self.tree_beam = check_tree_beam(tree_beam)  # a tree: nodes expanded per level
        self.tree = check_tree_budget(tree)  # a node budget: draft a token tree (tree.py); "auto": TreeSizer decides
        self.sizer = TreeChoice(shared_sizer(model, "draft")) if tree == "auto" else None
        if self.tree is not None and not model.new_cache(1).crops_across_forwards:
            raise ConfigError("--tree with --drafter draft needs a draft model with attention only (this one has recurrent layers)")
        self.model = model
        self.cache = None
        self.fed = 0  # context tokens in the draft cache
        self.pending = 0  # drafts fed into the cache by the last propose (beyond the context)
        self.snap = None  # the cache right after the context, when crop cannot reach back that far
        self.sampler: Sampler | None = None
        self.ranks = self.proposed = None  # a tree: tree.RankAcceptance and the last tree.Proposed

    def prefill(self, context: Tensor, out: TargetOutput | None, sampler: Sampler) -> None:
        self.sampler = sampler
        self.cache = None  # lazy: the first propose allocates it and reads the prompt, so a run that
        self.pending = 0  # never drafts (adaptive depth on plain) never pays for either
        self.fed = 0

    @torch.inference_mode()
    def propose(self, context: Tensor, k: int) -> Draft:
        k = min(k, self.model.max_seq_len - len(context) + 1)  # context + k-1 fed drafts must fit
        if k < 1:
            return Draft.empty()
        sampler = self.sampler
        prompt = self.cache is None  # the prompt: never cropped into (a hybrid keeps its final state only)
        if prompt:
            self.cache = self.model.new_cache()
        logits = self.model.forward_tokens(context[self.fed :], self.cache, prefill=prompt).logits[-1]  # (V,)
        self.fed = len(context)
        budget = tree_budget(self.tree, self.sizer)
        if budget is not None:
            return self._tree(logits, k, budget)
        if k > 1 and not self.cache.crops_across_forwards:
            self.snap = self.cache.snapshot()
        tokens, qs = [], []
        for i in range(k):
            if sampler.params.greedy:  # (after the controls, with this round's drafts so far as context)
                x = sampler.logits(logits, [tokens]).argmax(-1)
            else:
                q = sampler.probs(logits, [tokens])  # (V,) same transform as the target's p, at the same context
                x = sampler.draw(q, len(context) + i)  # (Gumbel: the noise of the target's token there)
                qs.append(q)
            tokens.append(x)
            if i + 1 < k:
                logits = self.model.forward_tokens(x.reshape(1), self.cache).logits[-1]
        self.pending = k - 1
        toks = torch.stack(tokens)  # (k,)
        return Draft(tokens=toks, q=None if sampler.params.greedy else torch.stack(qs))  # q (k, V)

    def _tree(self, logits: Tensor, k: int, budget: int) -> Draft:
        """A dynamic token tree (EAGLE-2 expansion, tree.grow): each level one forward of the draft model over the
        nodes expanded, every row attending to its own path (tree.TreeRows); point masses. Its cache entries past
        the context are dropped at commit (the accepted tokens are read again with the next context)."""
        from ..tree import GrowingTree, RankAcceptance, grow, keep_best, top_guesses, tree_branch

        grown = GrowingTree(self.cache.length)

        def top(lg: Tensor, paths=None) -> tuple[Tensor, Tensor]:  # (n, V) -> the draft's best guesses: log q, ids (n, branch)
            if self.sampler.params.greedy:
                return top_guesses(self.sampler.logits(lg, paths), branch)
            return self.sampler.probs(lg, paths).log().topk(branch, dim=-1)

        def expand(nodes: list[int]) -> tuple[Tensor, Tensor]:
            out = self.model.forward_tokens(torch.tensor([grown.tokens[n] for n in nodes]), self.cache, tree=grown.rows_for(nodes))
            return top(out.logits, [grown.path(n) for n in nodes] if self.sampler.reads_context else None)

        branch = tree_branch(self.tree_beam)
        self.ranks = self.ranks or RankAcceptance(branch)
        vals, ids = top(logits[None])
        grow(grown, (vals[0], ids[0]), expand, k, self.tree_beam, self.ranks)
        draft, self.proposed = keep_best(grown, budget)
        self.pending = 0  # commit crops to the context
        return draft

    def commit(self, verdict: Verdict, out: TargetOutput) -> None:
        observe_step(self.sizer, verdict)
        if verdict.path is not None and self.proposed is not None:
            self.ranks.observe(self.proposed.parents, self.proposed.ranks, verdict.path)
        if self.cache is None:  # nothing drafted yet
            return
        if self.snap is not None:  # back to the context; the accepted drafts are read with the next one
            self.cache.restore(self.snap)
            self.snap, self.pending = None, 0
            return
        keep = min(verdict.num_accepted, self.pending)  # accepted drafts already in the cache
        self.cache.crop(self.fed + keep)
        self.fed += keep
        self.pending = 0

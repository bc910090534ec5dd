"""Native MTP drafting: the target's own MTP module guesses the next D tokens.

MTP position i reads the pair (h_i, e_{i+1}): the target's post-final-norm hidden state at i and the
embedding of the token after it, and predicts t_{i+2}. Its KV cache holds one entry per pair.

Bookkeeping, with the engine's convention (the target cache holds every token but the last):

- prefill over t_0..t_{L-2} gives h_0..h_{L-2}: the pending pairs are (h_i, t_{i+1}), i = 0..L-2.
- propose: run the pending pairs through the MTP at once (catch-up + the last one); the output at
  the last pair (h_{L-2}, t_{L-1}) gives d1. For D > 1, step j feeds the MTP's own output hidden
  with the embedding of d_{j-1}, one position further (entries cropped again at commit).
- commit after a verify over [t_{L-1}, d1..dD] with n accepted: crop the MTP cache to the real
  pairs, and the pending pairs become (out.hidden[j], verdict.tokens[j]) for j = 0..n.

Multi-layer modules (n = mtp_num_layers > 1, docs/mtp-layers.md) follow DeepSeek-V3's depths, as training
does: draft step k is depth k at position L-2, runs layer (k-1) % n and has its own KV cache (`DepthChain`);
commit crops each depth to the entries whose inputs were real. That path runs eagerly one sequence at a
time: no token trees (refused), no batched or compiled draft step.

Greedy drafts are argmaxes (q None); sampled drafts come from q = sampler.probs (the target's transform),
returned so rejection sampling stays exact (Gumbel sampling: argmax(log q + g_t) with the target's noise at the draft's
position, sampling.Sampler.draw). Draft step j is transformed with the round's drafts 0..j-1 as its context
beyond the committed tokens (a tree node: its path), as the target's row j is (sampling.py's context controls). A draft vocabulary (models/draft_vocab.py) restricts both to its N
most frequent tokens (q zero outside them).

Prompt-lookup shortcut (`lookup=N`, `--mtp-lookup N`, docs/models.md): when the context's last N tokens
occurred earlier, the round drafts what followed their latest occurrence (ngram.py) instead of running the
module, whose pending pairs wait for the next round that drafts with it. A lookup draft is a point mass
(q = None), so verification stays lossless.
"""

from __future__ import annotations

from functools import partial

import torch
from torch import Tensor

from ..cache import KVCache
from ..errors import ConfigError
from ..models.compiled import compiled_draft_step
from ..models.draft_vocab import make_draft_head
from ..models.fused_mtp import FusedMTP, fused_mtp
from ..models.batch import ForwardBatch
from ..models.forward import fused_for_decoding, greedy_draft, module_forward
from ..sampling import Sampler
from ..tree import (GrowingTree, RankAcceptance, TreeChoice, check_tree_beam, check_tree_budget, grow, keep_best, observe_step,
                    shared_sizer, top_guesses, tree_branch, tree_budget)
from ..types import Draft, TargetOutput, Verdict
from .ngram import NgramDrafter


SPARSE_SELECT = ("reuse", "recompute", "full")  # a sparse MTP's block choice for chained draft steps (full: attend everything)
MAX_PENDING = 16  # pairs queued before a catch-up runs without a draft (plain steps chosen by --k auto, a long prompt)


def check_lookup(n) -> int:
    """--mtp-lookup's value: 0 (off) or a match length N >= 2; anything else is a ConfigError naming it."""
    if isinstance(n, bool) or not isinstance(n, int) or n < 0 or n == 1:
        raise ConfigError(f"--mtp-lookup takes 0 (off) or a match length N >= 2 (tokens), got {n!r}")
    return n


class MTPDrafter:
    name = "mtp"
    prefill_logits = False  # it never reads the target's logits over the prompt
    prefill_hidden = True  # its module pairs every prompt position's hidden state with the next token

    def __init__(self, target, prenorm_hidden: bool = False, draft_vocab: int | None = None, fused: bool = True,
                 tree: int | None = None, sparse_select: str = "reuse", lookup: int = 0, tree_beam: int = 1) -> None:
        if getattr(target, "mtp", None) is None:
            raise ConfigError(
                "--drafter mtp needs a model with an MTP module (mtp.* tensors in the checkpoint); this one has none"
            )
        self.target = target
        self.tree_beam = check_tree_beam(tree_beam)  # a tree: nodes expanded per level
        self.prenorm = prenorm_hidden  # feed the pre-final-norm hidden (for heads trained that way)
        # an EAGLE-3 head (models.heads.Eagle3Head): its pairs' hidden states come from the target's layer inputs, its
        # drafts from its own LM head over its draft vocabulary
        self.pair_hidden = getattr(target, "pair_hidden", None)
        self.taps: tuple[int, ...] = getattr(target, "taps", ())  # the target layers whose inputs pair_hidden reads
        own = getattr(target, "own_head", None)
        if own is not None and draft_vocab:
            raise ConfigError("--draft-vocab does not apply to an eagle3 head: its draft vocabulary is its own (d2t)")
        self.head = own if own is not None else make_draft_head(target, draft_vocab)  # None = the target's full LM head
        self.n_layers = target.config.mtp_num_layers
        if self.n_layers > 1 and tree is not None:
            raise ConfigError(f"token trees (--tree) need a one-layer MTP module; this one has {self.n_layers} layers "
                              "(multi-layer MTP drafts a chain, one depth per step)")
        self.depths: DepthChain | None = None  # n_layers > 1: the per-depth state (set by prefill)
        if sparse_select not in SPARSE_SELECT:
            raise ConfigError(f"sparse_select must be one of {', '.join(SPARSE_SELECT)}, got {sparse_select!r}")
        # a sparse-attention MTP (sparse_attention.py): its indexer runs on the round's first row only ("reuse"), or on every step
        self.sparse = getattr(target.config, "mtp_sparse_attention", None) is not None
        self.select = sparse_select
        self.catch_up = "full" if sparse_select == "full" else "recompute"  # a sparse pass's selection outside a round's chain
        if self.sparse and tree is not None:
            raise ConfigError("token trees are not available with a sparse-attention MTP module yet: use a chain (no --tree)")
        if self.sparse and self.n_layers > 1:
            raise ConfigError(f"a sparse-attention MTP module drafts with one layer; this one has {self.n_layers}")
        self.fused = fused_mtp(target.mtp) if fused else None  # folded decode copy (None = the module itself)
        if self.fused is None:
            fused_for_decoding(target.mtp)  # the module's q / k / v and gate / up, each one product
        # the compiled step when the target was compiled, else None (an EAGLE-3 head drafts eagerly: its target's forwards
        # must tap layer inputs, which its compiled graphs do not)
        self.compiled = None if self.pair_hidden is not None else compiled_draft_step(target.mtp, target)
        self.sampler: Sampler | None = None
        self.cache = None
        self.pending_h: Tensor | None = None  # (P, H) target hidden states of pairs not yet in the MTP cache
        self.pending_t: Tensor | None = None  # (P,) the tokens that follow them
        self.committed = 0  # MTP cache entries built from real target hidden states
        self.tree = check_tree_budget(tree)  # a node budget: propose a token tree (tree.py) of at most this many nodes, depth <= k
        self.ranks: RankAcceptance | None = None  # a tree: how often each rank of guess is taken (learned at commit)
        self.proposed = None  # a tree: the last one proposed (tree.Proposed)
        # --tree auto: a chain or a tree, by measured tokens/s (one sizer per MTP / EAGLE module, shared by its sequences)
        self.sizer = TreeChoice(shared_sizer(target.mtp, "mtp")) if tree == "auto" else None
        check_lookup(lookup)
        if lookup and tree is not None:
            raise ConfigError("--mtp-lookup drafts chains: it cannot be combined with --tree")
        # the prompt-lookup shortcut: the continuation of the context's last `lookup` tokens where they occurred before
        self.lookup = NgramDrafter(n_min=lookup, n_max=lookup) if lookup else None

    def _hidden(self, out: TargetOutput) -> Tensor:
        """The hidden state of the pairs at a target forward's rows (T, H)."""
        if self.pair_hidden is not None:
            return self.pair_hidden(out)  # EAGLE-3: g = fc(the target's layer inputs)
        return out.prenorm_hidden if self.prenorm and out.prenorm_hidden is not None else out.hidden

    def _queue(self, h: Tensor, t: Tensor) -> None:
        if self.pending_h is None or self.pending_h.shape[0] == 0:
            self.pending_h, self.pending_t = h, t
        else:
            self.pending_h = torch.cat([self.pending_h, h])
            self.pending_t = torch.cat([self.pending_t, t])
        if self.pending_h.shape[0] > MAX_PENDING:  # a long plain stretch: catch up now, so pending stays short
            self._mtp(self.pending_h[:-1], self.pending_t[:-1], 0)  # (real pairs: their entries are kept)
            self.committed = self.cache.length
            self.pending_h, self.pending_t = self.pending_h[-1:], self.pending_t[-1:]

    def prefill(self, context: Tensor, out: TargetOutput | None, sampler: Sampler) -> None:
        self.sampler = sampler
        if self.lookup is not None:
            self.lookup.prefill(context, out, sampler)
        if self.n_layers > 1:
            self.depths = DepthChain(self.target, self.fused)
            if out is not None:
                self.depths.add_target(self._hidden(out))
            return
        self.cache = self.target.new_mtp_cache()
        self.pending_h = self.pending_t = None
        if out is not None:  # pairs (h_i, t_{i+1}) for i = 0..L-2
            self._queue(self._hidden(out), context[1 : out.hidden.shape[0] + 1])

    def _looked_up(self, context: Tensor, k: int) -> Draft | None:
        """The lookup shortcut's draft for this round (at least 2 tokens, or k when k < 2), else None."""
        if self.lookup is None:
            return None
        pending = 0 if self.pending_h is None else self.pending_h.shape[0]
        if self.compiled is not None and pending + k + 1 > self.compiled.max_width:
            return None  # the module catches up now: after one more lookup round it would be wider than its compiled graphs
        draft = self.lookup.propose(context, k)
        return draft if draft.size >= min(2, k) else None

    @torch.inference_mode()
    def propose(self, context: Tensor, k: int) -> Draft:
        return self.propose_batch([self], [context], [k])[0]

    @classmethod
    @torch.inference_mode()
    def propose_batch(cls, drafters: list["MTPDrafter"], contexts: list[Tensor], ks: list[int]) -> list[Draft]:
        """Each sequence's draft; a single sequence is a batch of one. The lookup shortcut's drafts need no module
        forward; a drafter that drafts alone (`_alone`) does; the chains of the others that share a module draft
        together, each step one forward over all of them (`_chain_rounds`)."""
        # a lookup draft leaves the module's state as after a plain step: commit queues this round's pairs
        drafts = [d._looked_up(c, k) for d, c, k in zip(drafters, contexts, ks)]
        groups: dict[int, list[int]] = {}  # module -> the sequences drafting a chain with it together
        for i, (d, c, k) in enumerate(zip(drafters, contexts, ks)):
            if drafts[i] is None:
                drafts[i] = d._alone(c, k, len(drafters) == 1)
            if drafts[i] is None:
                groups.setdefault(id(d.target.mtp) if not d.sparse else id(d), []).append(i)  # sparse: its own forward
        for idx in groups.values():
            got = cls._chain_rounds([drafters[i] for i in idx], [contexts[i] for i in idx],
                                    [drafters[i]._room(ks[i]) for i in idx])
            for i, dr in zip(idx, got):
                drafts[i] = dr
        return drafts

    def _room(self, k: int) -> int:
        """k cut to the MTP cache's room after the catch-up over the pending pairs."""
        return min(k, self.cache.max_len - self.cache.length - self.pending_h.shape[0] + 1)

    def _alone(self, context: Tensor, k: int, single: bool) -> Draft | None:
        """The round's draft when this drafter drafts alone (a multi-layer module's depths, a token tree, nothing to
        draft from; a single sequence's greedy compiled chain, one graph), else None: a chain for `_chain_rounds`."""
        if self.depths is not None:
            return self._propose_depths(context, k)
        if self.pending_h is None or self.pending_h.shape[0] == 0:
            return Draft.empty()  # the prompt was BOS alone: no hidden state yet
        k = self._room(k)
        if k < 1:
            return Draft.empty()
        budget = tree_budget(self.tree, self.sizer)
        if budget is None and not (single and self._chains()):
            return None
        h = self._mtp(self.pending_h, self.pending_t, 0)[-1:]  # (1, H) the catch-up
        self.pending_h = self.pending_t = None
        if budget is not None:
            return self._propose_tree(h, k, budget)
        tokens = self.compiled.chain(h, self.cache, k, self.head)  # (k,) greedy, compiled: the chain graphs (CompiledDraftStep.chain)
        self.committed = self.cache.length - (k - 1)
        return Draft(tokens=tokens, q=None)

    @classmethod
    def _chain_rounds(cls, drafters: list["MTPDrafter"], contexts: list[Tensor], ks: list[int]) -> list[Draft]:
        """Chains of ks[i] drafts from one module: its catch-up over each sequence's pending pairs, then per step its
        forward over the rows of the sequences still drafting, each attention on the sequence's own cache in place.
        One sequence runs through `_mtp` (a compiled graph, a sparse module's block selection: with "reuse" the
        catch-up's last row records its blocks and the chained steps attend them without the indexer); several
        through `_many` (the folded copy when every drafter has it, else forward.module_forward)."""
        first = drafters[0]
        if len(drafters) == 1:
            reuse = first.cache.sparse is not None and first.select == "reuse"
            if reuse:
                first.cache.sparse.kept = {}

            def run(hidden, tokens, caches, layer, step):
                sparse = ("reuse" if step else "record") if reuse else None
                return first._mtp(hidden[0], tokens[0], layer, sparse=sparse)[-1:]
        else:
            folded = all(d.fused is first.fused is not None and d.compiled is None for d in drafters)
            many = partial(_many, first.fused if folded else first.target.mtp, first.target)
            run = lambda hidden, tokens, caches, layer, step: many(hidden, tokens, caches, layer)  # noqa: E731
        h = run([d.pending_h for d in drafters], [d.pending_t for d in drafters], [d.cache for d in drafters], 0, 0)
        for d in drafters:
            d.pending_h = d.pending_t = None
        tokens: list[list[Tensor]] = [[] for _ in drafters]
        qs: list[list[Tensor]] = [[] for _ in drafters]
        going = list(range(len(drafters)))  # sequences drafting this step
        for j in range(max(ks)):
            for i, (x, q) in zip(going, cls._next_many([drafters[i] for i in going], h, [tokens[i] for i in going],
                                                        [contexts[i].shape[0] for i in going])):
                tokens[i].append(x)
                if q is not None:
                    qs[i].append(q)
            keep = [n for n, i in enumerate(going) if j + 1 < ks[i]]  # rows of h whose sequence drafts another
            if not keep:
                break
            going = [going[n] for n in keep]  # chain: own output hidden + embedding of the token just drafted
            h = run([h[n : n + 1] for n in keep], [tokens[i][-1].reshape(1) for i in going], [drafters[i].cache for i in going],
                    (j + 1) % first.n_layers, j + 1)
        drafts = []
        for i, d in enumerate(drafters):
            d.committed = d.cache.length - (ks[i] - 1)  # MTP entries built from real target hiddens
            drafts.append(Draft(tokens=torch.stack(tokens[i]), q=torch.stack(qs[i]) if qs[i] else None))  # q (k, V)
        return drafts

    def _propose_depths(self, context: Tensor, k: int) -> Draft:
        """A multi-layer module's chain: draft step j is depth j at the last target position (module docstring)."""
        if self.depths.known == 0 or k < 1:
            return Draft.empty()  # (known == 0: the prompt was BOS alone, no hidden state yet)
        tokens, qs = [], []
        for depth in range(1, k + 1):
            x, q = self._next(self.depths.run(context, tokens, depth), tokens, context.shape[0])
            tokens.append(x)
            if q is not None:
                qs.append(q)
        return Draft(tokens=torch.stack(tokens), q=torch.stack(qs) if qs else None)  # (k,), q (k, V)

    def _propose_tree(self, h: Tensor, k: int, budget: int) -> Draft:
        """A dynamic token tree (EAGLE-2): the root's top guesses, then level by level the most probable nodes
        expanded by one MTP forward over them (each row attending to its own path, tree.TreeRows), depth <= k;
        the `tree` most probable nodes kept. Its tokens are point masses (q = None), greedy and sampling alike."""
        grown = GrowingTree(self.cache.length)
        self.committed = self.cache.length  # entries from here on are drafted (cropped at commit)
        hid: dict[int, Tensor] = {}  # node -> the MTP output after its pair

        def expand(nodes: list[int]) -> tuple[Tensor, Tensor]:
            parent_h = torch.stack([h[0] if grown.parents[n] < 0 else hid[grown.parents[n]] for n in nodes])  # (n, H)
            toks = torch.tensor([grown.tokens[n] for n in nodes], dtype=torch.long)
            out = self._mtp(parent_h, toks, grown.depth[nodes[0]] % self.n_layers, grown.rows_for(nodes))  # (n, H)
            for n, o in zip(nodes, out):
                hid[n] = o
            return self._top(out, branch, [grown.path(n) for n in nodes] if self.sampler.reads_context else None)

        branch = tree_branch(self.tree_beam)
        if self.ranks is None:
            self.ranks = RankAcceptance(branch)
        vals, ids = self._top(h, branch)
        grow(grown, (vals[0], ids[0]), expand, k, self.tree_beam, self.ranks)
        draft, self.proposed = keep_best(grown, budget)
        return draft

    def _chains(self) -> bool:
        """Whether this round's drafts come from one compiled graph (CompiledDraftStep.chain): greedy, and a compiled
        one-layer module with dense attention."""
        return (self.compiled is not None and self.sampler.params.greedy and not self.sampler.reads_context and self.n_layers == 1
                and not self.sparse and self.compiled.handles(1, self.cache))

    def _top(self, h: Tensor, branch: int, paths=None) -> tuple[Tensor, Tensor]:
        """h (n, H) MTP outputs -> the drafter's `branch` best guesses after each: log q values and token ids (n, branch)
        (a tree ranks its nodes by them). Greedy: the top of the logits (the draft vocabulary's, mapped to ids).
        paths: each row's tokens beyond the committed context (sampling.Paths)."""
        greedy = self.sampler.params.greedy
        if greedy and not self.sampler.reads_context:
            if self.head is None:
                return top_guesses(self.target.head(h), branch)
            vals, idx = top_guesses(self.head.logits(h), branch)
            return vals, self.head.token(idx)
        logits = self.target.head(h) if self.head is None else self.head.full(self.head.logits(h))  # (n, V)
        if greedy:
            return top_guesses(self.sampler.logits(logits, paths), branch)
        return self.sampler.probs(logits, paths).log().topk(branch, dim=-1)

    def _mtp(self, hidden: Tensor, tokens: Tensor, layer: int, tree=None, sparse: str | None = None) -> Tensor:
        """The MTP over pairs (hidden[i], tokens[i]) at the next cache positions (a token tree's rows: `tree`; a sparse
        module's block selection: `sparse`, by default the catch-up's) -> (T, H); advances the cache."""
        sparse = sparse or self.catch_up
        if self.compiled is not None and tree is None and self.compiled.handles(tokens.shape[0], self.cache):
            return self.compiled(hidden, self.target.embed(tokens), self.cache, layer)
        if self.fused is None:
            return self.target.mtp_forward(hidden, tokens, self.cache, layer=layer, tree=tree, sparse=sparse)
        out = self.fused(hidden, self.target.embed(tokens), self.cache, self.cache.length, layer, tree, sparse)
        self.cache.advance(tokens.shape[0])
        return out

    @staticmethod
    def _next_many(drafters: list["MTPDrafter"], h: Tensor, drafted: list[list[Tensor]],
                   ats: list[int]) -> list[tuple[Tensor, Tensor | None]]:
        """_next for each drafter's row of h (n, H) after its drafts so far (its round starting at position ats[i]): one
        head product for all of them when they are greedy without context controls and share a head (the target's, or
        the same draft-vocabulary head)."""
        head = drafters[0].head
        if all(d.sampler.params.greedy and not d.sampler.reads_context and d.head is head for d in drafters):
            return [(x, None) for x in greedy_draft(drafters[0].target, head, h)]  # (n,) tokens
        return [d._next(h[i : i + 1], t, at) for i, (d, t, at) in enumerate(zip(drafters, drafted, ats))]

    def _next(self, h: Tensor, drafted: list[Tensor], at: int) -> tuple[Tensor, Tensor | None]:
        """h (1, H) MTP output, the round's drafts before it, the round's first position `at` (the context's length) ->
        the drafted token and q (V,) (None when greedy)."""
        head = self.head
        greedy = self.sampler.params.greedy
        if greedy and not self.sampler.reads_context:
            return greedy_draft(self.target, head, h)[0], None
        logits = self.target.head(h)[0] if head is None else head.full(head.logits(h))[0]  # (V,)
        if greedy:  # the argmax after the controls (-inf outside a draft vocabulary stays -inf)
            return self.sampler.logits(logits, [drafted]).argmax(-1), None
        q = self.sampler.probs(logits, [drafted])  # (V,) the same transform as p; zero outside a draft vocabulary
        return self.sampler.draw(q, at + len(drafted)), q  # (Gumbel: the noise of the target's token there)

    def commit(self, verdict: Verdict, out: TargetOutput) -> None:
        if self.depths is not None:
            self.depths.commit(verdict.num_accepted, self._hidden(out)[: verdict.num_accepted + 1])
            return
        observe_step(self.sizer, verdict)
        if verdict.path is not None and self.proposed is not None:
            self.ranks.observe(self.proposed.parents, self.proposed.ranks, verdict.path)
        if verdict.num_drafted > 0:
            self.cache.crop(self.committed)  # drop the entries built from drafted (not target) states
        n = verdict.num_accepted
        self._queue(self._hidden(out.rows(list(range(n + 1))) if self.pair_hidden is not None else out)[: n + 1],
                    verdict.tokens[: n + 1])


def _many(module, target, hidden: list[Tensor], tokens: list[Tensor], caches: list[KVCache], layer: int) -> Tensor:
    """The module (or its folded copy, a FusedMTP) over several sequences' pairs at once: hidden[b] (n_b, H), tokens[b]
    (n_b,) at caches[b]'s next positions (each cache read and written in place) -> (B, H) the output at each
    sequence's last pair; advances them."""
    lens = [t.shape[0] for t in tokens]
    if isinstance(module, FusedMTP):
        out = module.many(torch.cat(hidden), target.embed(torch.cat(tokens)), caches, lens, layer)  # (N, H)
        return out[torch.tensor(lens).cumsum(0) - 1]
    fb = ForwardBatch.many([c.length for c in caches], lens, caches[0].max_len)
    hid = hidden[0].new_zeros(fb.b, fb.w, hidden[0].shape[-1])  # (B, W, H)
    toks = torch.zeros(fb.b, fb.w, dtype=torch.long)  # (B, W)
    for b, (h, t) in enumerate(zip(hidden, tokens)):
        hid[b, : lens[b]], toks[b, : lens[b]] = h, t
    kv = module.layers[layer].self_attn.kv_index
    bufs = [c.buffers(kv) for c in caches]
    out = module_forward(module, hid, target.embed(toks), [k for k, _ in bufs], [v for _, v in bufs], fb, layer)  # (B, W, H)
    for c, n in zip(caches, lens):
        c.advance(n)
    return out[torch.arange(fb.b), torch.tensor(lens) - 1]  # (B, H)


class DepthCache(KVCache):
    """One draft depth's KV cache: a single slot, written by whichever MTP layer runs that depth."""

    def __init__(self, target) -> None:
        c = target.config
        super().__init__(1, c.num_kv_heads, c.head_dim, c.max_seq_len, target.dtype)

    def buffers(self, layer: int) -> tuple[Tensor, Tensor]:
        return super().buffers(0)


class DepthChain:
    """A multi-layer MTP module's draft state: DeepSeek-V3 depths, each with its own KV cache.

    Position i of depth k (1-based) reads h^{k-1}_i and e(t_{i+k}) and writes h^k_i into outs[k-1] and
    its keys / values into caches[k-1] at index i. Entries 0..caches[k-1].length-1 are valid. Memory: per
    depth drafted, one KV layer and a (max_len, H) buffer of its outputs (the next depth's inputs)."""

    def __init__(self, target, fused) -> None:
        self.target, self.fused, self.n = target, fused, target.config.mtp_num_layers
        self.caches: list[DepthCache] = []  # depth k at index k-1, created the first time a round drafts k tokens
        self.outs: list[Tensor] = []  # (max_len, H) h^k per position
        self.h0: Tensor | None = None  # (max_len, H) the target's hiddens
        self.known = 0  # target hiddens known: positions 0..known-1 (the target cache's length)

    @torch.inference_mode()
    def add_target(self, h: Tensor) -> None:
        """h (T, H) the target's hiddens at positions known.. (prefill, then each verify's accepted rows)."""
        if self.h0 is None:
            self.h0 = h.new_zeros(self.target.config.max_seq_len, h.shape[-1])
        self.h0[self.known : self.known + h.shape[0]] = h
        self.known += h.shape[0]

    @torch.inference_mode()
    def run(self, context: Tensor, drafts: list[Tensor], depth: int) -> Tensor:
        """Depth `depth` over its missing positions up to known-1 -> its output there (1, H).

        context (L,) the real tokens (L = known + 1), drafts: d_1..d_{depth-1} of this round."""
        if len(self.caches) < depth:  # a new depth: it catches up from position 0 (the previous depth's outs are whole)
            self.caches.append(DepthCache(self.target))
            self.outs.append(torch.zeros_like(self.h0))
        cache, out = self.caches[depth - 1], self.outs[depth - 1]
        a, end = cache.length, self.known  # positions a..end-1 to compute
        seq = torch.cat([context, torch.stack(drafts)]) if drafts else context  # (L + depth - 1,) t_0..t_{L-1}, d_1..
        hidden = (self.h0 if depth == 1 else self.outs[depth - 2])[a:end]  # (T, H) h^{depth-1}_i
        tokens = seq[a + depth : end + depth]  # (T,) t_{i+depth}
        layer = (depth - 1) % self.n
        if self.fused is None:
            h = self.target.mtp_forward(hidden, tokens, cache, layer=layer)  # (T, H)
        else:
            h = self.fused(hidden, self.target.embed(tokens), cache, a, layer)
            cache.advance(tokens.shape[0])
        out[a:end] = h
        return h[-1:]

    def commit(self, n: int, hidden: Tensor) -> None:
        """After a verify that accepted n drafts: keep each depth's entries whose tokens were real (t_{i+k} up to
        the last accepted draft, index known + n), then add the target's hiddens (n + 1, H)."""
        for k, cache in enumerate(self.caches, 1):
            cache.crop(max(0, min(cache.length, self.known + n - k + 1)))
        self.add_target(hidden)

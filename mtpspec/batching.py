"""B sequences in one target forward: slot storage for their KV caches and the batched pass.

Every running sequence keeps its own cache object (a KVCache, or a HybridCache holding one), so its rollback is a
single sequence's: the KV length is a pointer per sequence, a Gated DeltaNet layer's state after each position of the
last forward a slot per sequence (hybrid_cache.py). What the batch shares is memory: each sequence's KV tensors are
views of one row (its slot) of a buffer (L, slots, n_kv, max_len + 1, hd), so the batched forward reads the KV of B
sequences as one tensor, without copying, when they hold slots 0..B-1; the engine keeps them there (a leaving
sequence's slot is taken by the one in the last slot).

The batched pass runs the model's one forward (models/forward.py) over a (B, W) grid, W = the widest sequence's 1 + D_i,
shorter sequences padded after their real rows. Only attention and the Gated DeltaNet recurrence run on the grid;
projections, MLPs and the LM head run on the real rows alone. Padded rows touch nothing a sequence keeps (their keys
go past its length, their states past its last slot; position max_len, one past the context, takes those that would
not fit).
"""

from __future__ import annotations

import copy
import itertools
from dataclasses import replace

import torch
from torch import Tensor

from .cache import KVCache, lazy_zeros
from .models.batch import ForwardBatch
from .models.forward import dense_forward, hybrid_forward, record, tap_slots
from .models.hybrid_cache import HybridCache
from .types import TargetOutput


class SlotKV:
    """KV memory for up to `slots` sequences of one model; a sequence's KVCache becomes views of one slot."""

    def __init__(self, like: KVCache, slots: int) -> None:
        n_layers, _, n_kv, _, hd = like.k.shape  # (L, 1, n_kv, max_len, hd)
        self.max_len = like.max_len
        shape = (n_layers, slots, n_kv, like.max_len + 1, hd)  # + 1: the scratch position of padded rows
        self.k = lazy_zeros(shape, like.k.dtype, like.k.device)  # (L, slots, n_kv, max_len + 1, hd)
        self.v = lazy_zeros(shape, like.v.dtype, like.v.device)

    @property
    def slots(self) -> int:
        return self.k.shape[1]

    def bind(self, kv: KVCache, slot: int) -> None:
        """Point `kv` at slot `slot` (its current contents are copied there)."""
        n = kv.length
        self.k[:, slot, :, :n] = kv.k[:, 0, :, :n]
        self.v[:, slot, :, :n] = kv.v[:, 0, :, :n]
        kv.k, kv.v = self.k[:, slot : slot + 1], self.v[:, slot : slot + 1]  # (L, 1, n_kv, max_len + 1, hd) views

    def move(self, kv: KVCache, dst: int) -> None:
        """Move the sequence whose KVCache is `kv` to slot `dst` (its committed positions are copied)."""
        n = kv.length
        self.k[:, dst, :, :n] = kv.k[:, 0, :, :n]
        self.v[:, dst, :, :n] = kv.v[:, 0, :, :n]
        kv.k, kv.v = self.k[:, dst : dst + 1], self.v[:, dst : dst + 1]


def clone_cache(src, fresh):
    """A copy of cache `src` (a sequence's, after its prompt's prefill) into `fresh`, a new cache of the same model:
    its KV buffers receive src's committed positions (the rest of their length is not copied), the rest of the state
    (a hybrid's recurrent state, sparse attention's keys) is deep-copied. Returns the copy (a cache of src's class)."""
    kv, dst = src.kv, fresh.kv
    n = kv.length
    dst.k[:, :, :, :n] = kv.k[:, :, :, :n]  # (L, 1, n_kv, n, hd)
    dst.v[:, :, :, :n] = kv.v[:, :, :, :n]
    return copy.deepcopy(src, {id(kv.k): dst.k, id(kv.v): dst.v})


def stack_rows(rows: list[Tensor]) -> Tensor:
    """torch.cat(rows) for rows (1, ...) each, without a copy when they are already rows 0..n-1 of one tensor in order:
    after a plain batched step every sequence's DeltaNet state and conv window is a view of that step's batched output,
    and copying them back together is a measurable share of the next plain step."""
    first = rows[0]
    shape, stride, at = first.shape, first.stride(), first.storage_offset()
    base = first.untyped_storage().data_ptr()
    if all(r.shape == shape and r.stride() == stride and r.dtype == first.dtype and r.storage_offset() == at + b * stride[0]
           and r.untyped_storage().data_ptr() == base for b, r in enumerate(rows)):
        return first.as_strided((len(rows), *shape[1:]), stride, at)
    return torch.cat(rows)


def verify_pass(target, storage: SlotKV | None, caches: list, tokens: list[Tensor], trees: list, lazy: list[bool],
                taps: list[tuple[int, ...]], exact: bool) -> list[TargetOutput]:
    """A step's verify forward over every sequence's [last, drafts] (trees[b]: its TreeLayout or None; lazy[b]: its
    logits left out; taps[b]: the layers whose inputs its drafter reads (layer_inputs)): one batched forward, tapping
    the union of the batch's taps. Each sequence alone (with its own taps) when there is one, or no slot storage, in
    exact mode (its width-one calls are a plain step's, per sequence) and with block-sparse attention (each
    sequence's block selection is its own state)."""
    sparse = getattr(getattr(target, "config", None), "sparse_attention", None) is not None
    if len(caches) > 1 and storage is not None and not exact and not sparse:
        return forward_batch(target, storage, caches, tokens, trees, lazy, taps=tuple(sorted(set().union(*taps))))
    outs = [target.forward_tokens(t, c, exact, logits=not z, tree=tr, taps=tp)
            for t, c, tr, z, tp in zip(tokens, caches, trees, lazy, taps)]
    for tr in trees:
        if tr is not None:
            tr.memo.pop("mask", None)  # (T, start + T): not kept with the shape between forwards
    return outs


def forward_batch(target, storage: SlotKV, caches: list, tokens: list[Tensor], trees: list | None = None,
                  lazy: list[bool] | None = None, taps: tuple[int, ...] = ()) -> list[TargetOutput]:
    """One forward of `target` over tokens[b] (T_b,) appended to caches[b], b = 0..B-1 in slots 0..B-1.

    trees[b]: sequence b's token tree (a TreeLayout over [last, nodes]) or None (a chain). lazy[b]: its logits are
    left out (None: a greedy tree's verification runs the LM head only where its walk goes). taps: the layers whose
    inputs every sequence's output carries (layer_inputs; () leaves it None). Returns one TargetOutput
    per sequence (T_b rows each); each cache ends T_b positions further, with the per-position slots of its recurrent
    state kept for rollback (a tree's along each row's path, for keep()), as after forward_tokens.
    """
    lens = [t.shape[0] for t in tokens]
    fb = ForwardBatch.many([c.length for c in caches], lens, storage.max_len, trees)  # padding rows: the scratch position
    toks = torch.zeros(fb.b, fb.w, dtype=torch.long)  # (B, W)
    for b, t in enumerate(tokens):
        toks[b, : lens[b]] = t
    slots = fb.pos if fb.slots is None else fb.slots
    used = min(int(slots.max()) + 1, storage.max_len + 1)  # keys no query can see are not read
    k_bufs, v_bufs = storage.k[:, : fb.b, :, :used], storage.v[:, : fb.b, :, :used]  # (L, B, n_kv, S, hd) views
    fb = replace(fb, logits=False)  # the head runs once below, over the real rows
    inputs = tap_slots(taps)  # {layer id: (N, H)} once the forward has run, or None
    if isinstance(caches[0], HybridCache):
        n = range(caches[0].n_linear)
        convs = [stack_rows([c.conv_window(i) for c in caches]) for i in n]  # (B, C, K-1)
        states = [stack_rows([c.start_state(i) for c in caches]) for i in n]  # (B, nv, dk, dv) (read, never written)
        _, hid, pre, hists, recs = hybrid_forward(target, toks, fb, k_bufs, v_bufs, convs, states, taps=inputs)
        for b, c in enumerate(caches):
            record(c, hists, recs, b, lens[b])
    else:
        _, hid, pre = dense_forward(target, toks, fb, k_bufs, v_bufs, inputs)  # (N, H) each
    for b, c in enumerate(caches):
        c.advance(lens[b])
    lazy = lazy or [False] * len(lens)
    ends = list(itertools.accumulate(lens))  # (host ints: no device round trip)
    if any(lazy):  # the head over the rows of the sequences that read logits now
        need = [torch.arange(e - t, e) for t, e, z in zip(lens, ends, lazy) if not z]
        head = target.head(hid[torch.cat(need)]) if need else None  # (N', V)
    else:
        head = target.head(hid)  # (N, V)
    outs, i, j = [], 0, 0
    for t, z in zip(lens, lazy):
        logits = None if z else head[j : j + t]
        outs.append(TargetOutput(logits=logits, hidden=hid[i : i + t], prenorm_hidden=pre[i : i + t],
                                 layer_inputs=None if inputs is None else {n: x[i : i + t] for n, x in inputs.items()}))
        i, j = i + t, j + (0 if z else t)
    return outs

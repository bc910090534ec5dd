"""Token trees: several guesses per position, verified in one target forward, still lossless.

A tree draft is `Draft(tokens (N,), parents (N,))`: node i guesses tokens[i] after the path to its parent
(parents[i] = -1: right after the last emitted token; parents[i] < i). The verify window has T = N + 1 rows: row 0
is the last emitted token (the root), row i + 1 is node i, at position start + depth(row) and attending to the
committed context plus its own ancestors (`TreeLayout.attn_mask`). A chain is the tree whose node i has parent i - 1.

Verification walks down from the root. Greedy: the target's argmax at a row is looked up among its children; a match
is accepted and the walk goes on there, else the argmax is emitted (recovered) and the walk ends; a leaf reached emits
the target's choice (bonus): exactly plain greedy decoding. Sampling (SpecInfer's multi-candidate rule): the children
are tried in order, child x (drawn from q; a point mass at x where the drafter gives none) accepted with probability
min(1, p(x) / q(x)), a rejection replacing p by norm(max(p - q, 0)); when all are rejected the token is drawn from what
is left of p. Children with a q must be drawn independently from that q, children without one must be distinct: then
every emitted token has the target's distribution. Gumbel sampling walks as greedy does, with the target's Gumbel-max
token at each row (its noise keyed by the row's absolute position, committed + its depth: verify.py). Each row is transformed with its node's path as the context beyond
the committed tokens (`row_paths`; sampling.py's context controls). The accepted rows are moved to the front of the window (`keep`: KV
entries copied, a Gated DeltaNet's per-row records re-indexed) and the cache cropped to them, as after a chain.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from time import perf_counter
from weakref import WeakKeyDictionary

import torch
from torch import Tensor

from .errors import ConfigError
from .sampling import Sampler
from .types import Draft, TargetOutput, Verdict


@dataclass(frozen=True)
class TreeRows:
    """New rows of a tree grown over several forwards (a drafter expanding its tree level by level): their
    absolute positions and which keys each sees; read by attention as a TreeLayout is (positions, attn_mask)."""

    pos: Tensor  # (T,) absolute positions
    mask: Tensor  # (T, S) bool over every key up to the last new row

    def positions(self, start: int) -> Tensor:
        return self.pos

    def attn_mask(self, start: int) -> Tensor:
        return self.mask


class GrowingTree:
    """A draft tree grown level by level in a drafter's own KV cache, after `base` committed entries: node i
    (token, parent, score = log q along its path) may be expanded, i.e. get a cache entry, later."""

    def __init__(self, base: int) -> None:
        self.base = base
        self.tokens: list[int] = []
        self.parents: list[int] = []
        self.scores: list[float] = []
        self.depth: list[int] = []
        self.rank: list[int] = []  # the node's place among its parent's guesses (0 = the drafter's top one)
        self.logq: list[float] = []  # the drafter's log q of the node's token after its parent
        self.entry: dict[int, int] = {}  # node -> its cache entry (0-based after base)
        self.entry_node: list[int] = []  # cache entry -> node

    def add(self, parent: int, token: int, score: float, rank: int = 0, logq: float = 0.0) -> int:
        self.rank.append(rank)
        self.logq.append(logq)
        self.tokens.append(token)
        self.parents.append(parent)
        self.scores.append(score)
        self.depth.append(0 if parent < 0 else self.depth[parent] + 1)
        return len(self.tokens) - 1

    def path(self, node: int) -> list[int]:
        """The tokens from the root to `node`, itself included (its context beyond the committed tokens)."""
        out = []
        while node >= 0:
            out.append(self.tokens[node])
            node = self.parents[node]
        return out[::-1]

    def rows_for(self, nodes: list[int]) -> TreeRows | None:
        """The attention of new cache entries for `nodes` (appended in this order): each sees the committed
        entries and its ancestors' entries (every ancestor was expanded before it). None when the entries go on
        as a chain's would (one node whose ancestors are every entry so far: a beam of 1, or the first level), so
        the drafter runs its plain causal step, at the position a chain's step takes (base + its depth)."""
        if len(nodes) == 1 and len(self.entry_node) == self.depth[nodes[0]]:
            self.entry[nodes[0]] = len(self.entry_node)
            self.entry_node.append(nodes[0])
            return None
        for n in nodes:
            self.entry[n] = len(self.entry_node)
            self.entry_node.append(n)
        total = self.base + len(self.entry_node)
        mask = torch.zeros(len(nodes), total, dtype=torch.bool)
        mask[:, : self.base] = True
        hits = []
        for r, n in enumerate(nodes):
            j = n
            while j >= 0:
                hits.append(r * total + self.base + self.entry[j])
                j = self.parents[j]
        mask.view(-1)[hits] = True
        pos = torch.tensor([self.base + self.depth[n] for n in nodes], dtype=torch.long)
        return TreeRows(pos, mask)


class RankAcceptance:
    """How often a drafter's r-th guess at a reached node is the one verification takes there, learned from its
    verdicts (decayed counts from a prior). A node's value is the product along its path of these rates, times a
    little of the drafter's own q: a drafter's q is not its acceptance (a draft model close to the target may give
    its top guess q ~ 0.5 and have it accepted nearly always), so ranking nodes by q alone (EAGLE-2) cuts deep
    chains for shallow siblings that rarely pay."""

    Q_WEIGHT = 0.1  # how much of log q breaks ties between nodes of equal rank paths

    def __init__(self, branch: int, prior: tuple[float, ...] = (0.7, 0.15, 0.06, 0.03), weight: float = 8.0,
                 decay: float = 0.995) -> None:
        self.hit = [weight * (prior[r] if r < len(prior) else prior[-1]) for r in range(branch)]
        self.seen = [weight] * branch
        self.decay = decay

    def score(self, rank: int, logq: float) -> float:
        """The log-value a node adds to its path's."""
        return math.log(max(self.hit[rank], 1e-3) / self.seen[rank]) + self.Q_WEIGHT * max(logq, -30.0)

    def observe(self, parents: list[int], ranks: list[int], path: tuple[int, ...]) -> None:
        """After a tree's verdict: at each reached row, each child's rank either taken (on the path) or not."""
        kids, row = children_of(parents), 0
        for i in range(len(path) + 1):
            nxt = path[i] if i < len(path) else None
            for c in kids.get(row, ()):
                r = ranks[c - 1]
                self.seen[r] = self.decay * self.seen[r] + 1.0
                self.hit[r] = self.decay * self.hit[r] + (1.0 if c == nxt else 0.0)
            if nxt is None:
                break
            row = nxt


def grow(tree: GrowingTree, roots: tuple[Tensor, Tensor], expand, depth: int, beam: int, ranks: RankAcceptance) -> None:
    """EAGLE-2's expansion: the root's top guesses (roots: log q values, token ids), then per level the `beam` most
    valuable frontier nodes (RankAcceptance) expanded by `expand(nodes) -> (log q values, ids) (n, branch)`."""
    frontier = [tree.add(-1, int(t), ranks.score(r, float(v)), r, float(v)) for r, (v, t) in enumerate(zip(*roots))]
    for _ in range(1, depth):
        pick = sorted(frontier, key=lambda n: -tree.scores[n])[:beam]
        vals, ids = expand(pick)  # (n, branch) each
        frontier = [tree.add(n, int(t), tree.scores[n] + ranks.score(r, v), r, v)
                    for n, vs, ts in zip(pick, vals.tolist(), ids.tolist()) for r, (v, t) in enumerate(zip(vs, ts))]


@dataclass(frozen=True)
class Proposed:
    """What a tree drafter keeps of its last tree, to learn from the verdict (RankAcceptance.observe)."""

    parents: list[int]
    ranks: list[int]
    logq: list[float]  # the drafter's log q of each node's token after its parent


def top_guesses(logits: Tensor, branch: int) -> tuple[Tensor, Tensor]:
    """logits (n, V) -> the `branch` largest log-softmax values and their indices, (n, branch) each (two fused
    kernels; a logsumexp beside top-k of the logits is several, and cost more at the vocabularies here)."""
    return torch.log_softmax(logits.float(), dim=-1).topk(branch, dim=-1)


def keep_best(tree: GrowingTree, budget: int) -> tuple[Draft, Proposed]:
    """The `budget` most valuable nodes of a grown tree as a Draft (point masses), and what observe() needs."""
    nodes = best_first(tree.parents, tree.scores, best_nodes(tree.parents, tree.scores, budget))
    tokens, parents = subtree(tree.tokens, tree.parents, nodes)
    return Draft(tokens=tokens, parents=parents), Proposed(parents.tolist(), [tree.rank[i] for i in nodes], [tree.logq[i] for i in nodes])


MAX_TREE = 63  # nodes: the verify window (T = nodes + 1) must fit one Gated DeltaNet piece of 64 rows


def check_tree_budget(tree) -> int | str | None:
    """A drafter's `tree` option: None (a chain), a node budget 1..MAX_TREE, or "auto" (TreeSizer)."""
    if tree is None or tree == "auto":
        return tree
    if not isinstance(tree, int) or isinstance(tree, bool) or not 1 <= tree <= MAX_TREE:
        raise ConfigError(f"--tree must be a node budget from 1 to {MAX_TREE} or 'auto', got {tree!r}")
    return tree


MAX_BEAM = 8


def check_tree_beam(beam) -> int:
    """A tree drafter's `tree_beam` option: nodes expanded per level, 1..MAX_BEAM."""
    if not isinstance(beam, int) or isinstance(beam, bool) or not 1 <= beam <= MAX_BEAM:
        raise ConfigError(f"--tree-beam must be the number of nodes expanded per level, 1 to {MAX_BEAM}, got {beam!r}")
    return beam


def tree_branch(beam: int) -> int:
    """Children per expanded node (the drafter's top guesses there): 2 for a beam of 1 (the best path, and at each
    level its runner-up as a leaf), else 4 (EAGLE-2's shape)."""
    return 2 if beam == 1 else 4


class TreeSizer:
    """`--tree auto`: each step, a chain or a tree of 4, 8 or 16 nodes, whichever has given the most tokens per
    second: tokens a step emitted over its seconds from propose to commit (drafting, the verify forward, the
    walk), running means per choice. Each choice is tried WARM times first; then the best is used, and every
    PROBE steps the choice measured longest ago is tried again (the machine and the text change). One sizer
    serves every sequence a drafter kind drafts for on one model (`shared_sizer`), so a server or a batch pays
    for the exploration once; each drafter keeps its own step's choice and start (a Pending)."""

    ARMS = (None, 4, 8, 16)
    PROBE = 24
    WARM = 3

    def __init__(self) -> None:
        self.tokens = [0.0] * len(self.ARMS)  # running mean tokens per step
        self.seconds = [0.0] * len(self.ARMS)  # running mean seconds per step
        self.count = [0] * len(self.ARMS)
        self.last = [0] * len(self.ARMS)  # the step each was last chosen
        self.step = 0

    def next(self) -> int:
        """The choice (an index into ARMS) for a step starting now."""
        self.step += 1
        cold = [i for i, n in enumerate(self.count) if n < self.WARM]
        if cold:
            arm = min(cold, key=lambda i: self.last[i])
        elif self.step % self.PROBE == 0:
            arm = min(range(len(self.ARMS)), key=lambda i: self.last[i])
        else:
            arm = max(range(len(self.ARMS)), key=lambda i: self.tokens[i] / max(self.seconds[i], 1e-9))
        self.last[arm] = self.step
        return arm

    def observe(self, arm: int, tokens: int, seconds: float) -> None:
        self.count[arm] += 1
        # a mean, then a running one: tokens per step vary with the text far more than a step's cost does, and
        # the choices are measured on different stretches of it, so tokens are averaged over many more steps
        self.tokens[arm] += (tokens - self.tokens[arm]) / min(self.count[arm], 64)
        self.seconds[arm] += (seconds - self.seconds[arm]) / min(self.count[arm], 16)


_SIZERS: WeakKeyDictionary = WeakKeyDictionary()  # model -> {drafter kind: TreeSizer}, alive while the model is


def shared_sizer(owner, kind: str) -> TreeSizer:
    """The TreeSizer of drafter kind `kind` on model `owner`."""
    return _SIZERS.setdefault(owner, {}).setdefault(kind, TreeSizer())


class TreeChoice:
    """A drafter's side of `--tree auto`: the shared sizer, and this drafter's pending step (choice, start)."""

    def __init__(self, sizer: TreeSizer) -> None:
        self.sizer, self.pending = sizer, None

    def budget(self) -> int | None:
        arm = self.sizer.next()
        self.pending = (arm, perf_counter())
        return TreeSizer.ARMS[arm]

    def observe(self, verdict: Verdict) -> None:
        if self.pending is not None:
            arm, t0 = self.pending
            self.sizer.observe(arm, len(verdict.tokens), perf_counter() - t0)
            self.pending = None


def tree_budget(tree, choice: TreeChoice | None) -> int | None:
    """This step's node budget for a drafter whose `tree` option is None, N or "auto" (then `choice` decides)."""
    return choice.budget() if choice is not None else tree


def observe_step(choice: TreeChoice | None, verdict: Verdict) -> None:
    if choice is not None:
        choice.observe(verdict)


def children_of(parents: list[int]) -> dict[int, list[int]]:
    """Row -> its child rows, in node order."""
    kids: dict[int, list[int]] = {}
    for i, p in enumerate(parents):
        kids.setdefault(p + 1, []).append(i + 1)
    return kids


def verify_tree_greedy(draft: Draft, choices) -> Verdict:
    """choices[row]: the target's argmax at that row (a list, or _RowChoices). Accept the path that follows them."""
    tokens, parents = draft.tokens.tolist(), draft.parents.tolist()
    kids = children_of(parents)
    row, path, out = 0, [], []
    while True:
        want = choices[row]
        nxt = next((c for c in kids.get(row, ()) if tokens[c - 1] == want), None)
        out.append(want)
        if nxt is None:
            break
        path.append(nxt)
        row = nxt
    return Verdict(num_accepted=len(path), tokens=torch.tensor(out), num_drafted=len(tokens), path=tuple(path))


class _RowChoices:
    """The target's argmax at the rows of a tree's verify window, its LM head run where first needed: the best path's
    rows (0, 1, ..: best_first puts it first) in one product, any other row alone. A tree of N nodes reaches at most
    its depth + 1 rows, and the head over a large vocabulary is a large part of a row's cost on a CPU."""

    def __init__(self, hidden: Tensor, head, parents: list[int]) -> None:
        m = 1  # rows 0..m-1 a chain: node i (row i + 1) the child of row i
        while m <= len(parents) and parents[m - 1] == m - 2:
            m += 1
        self.hidden, self.head = hidden, head
        logits = head(hidden[:m])  # (m, V)
        self.logits = dict(enumerate(logits))
        self.choice = dict(enumerate(logits.argmax(-1).tolist()))

    def __getitem__(self, row: int) -> int:
        if row not in self.choice:
            self.logits[row] = self.head(self.hidden[row : row + 1])[0]  # (V,)
            self.choice[row] = int(self.logits[row].argmax())
        return self.choice[row]


def verify_tree_lazily(draft: Draft, out: TargetOutput, head) -> tuple[Verdict, Tensor]:
    """Greedy verification of a tree whose forward left out the LM head (forward_tokens(..., logits=False, tree=...)): `head`
    (hidden (n, H) -> logits (n, V)) runs at the rows the walk reaches. -> the verdict and its kept rows' logits."""
    rows = _RowChoices(out.hidden, head, draft.parents.tolist())
    verdict = verify_tree_greedy(draft, rows)
    return verdict, torch.stack([rows.logits[r] for r in kept_rows(verdict)])  # (n + 1, V)


def verify_tree_sampling(draft: Draft, p: Tensor, sampler: Sampler) -> Verdict:
    """p (T, V): the target's sampling distribution at every row. SpecInfer's multi-candidate rule (module doc)."""
    tokens, parents = draft.tokens.tolist(), draft.parents.tolist()
    kids = children_of(parents)
    row, path, out = 0, [], []
    while True:
        res = p[row].clone()  # (V,) what is left of the target's distribution at this row
        nxt = None
        for c in kids.get(row, ()):
            x = tokens[c - 1]
            q = draft.q[c - 1] if draft.q is not None else None  # (V,) or a point mass at x
            q_x = float(q[x]) if q is not None else 1.0
            if float(sampler.uniform(1)[0]) * q_x < float(res[x]):  # accept with probability min(1, res(x) / q(x))
                nxt = c
                break
            if q is None:
                res[x] = 0.0
            else:
                res = torch.clamp(res - q, min=0.0)
            total = res.sum()
            if total <= 0:  # res == q: rejection had probability 0; nothing can follow
                res = p[row].clone()
                break
            res = res / total
        if nxt is None:
            out.append(int(sampler.sample(res)))
            break
        out.append(tokens[nxt - 1])
        path.append(nxt)
        row = nxt
    return Verdict(num_accepted=len(path), tokens=torch.tensor(out), num_drafted=len(tokens), path=tuple(path))


def row_paths(tokens: list[int], parents: list[int]) -> list[list[int]]:
    """The tokens on the path to each row of a tree's verify window (row 0, the root: none; row i + 1: node i's)."""
    paths = [[]]
    for t, p in zip(tokens, parents):
        paths.append(paths[p + 1] + [t])
    return paths


class _GumbelChoices:
    """The target's Gumbel-max token at the rows of a tree's verify window, drawn where the walk first reads it: row r
    at absolute position `position` + its depth (a node at depth j verifies the token at committed + j)."""

    def __init__(self, p: Tensor, parents: list[int], sampler: Sampler, position: int) -> None:
        self.p, self.sampler, self.depth = p, sampler, [0]  # (T, V); depth per row
        for q in parents:
            self.depth.append(self.depth[q + 1] + 1)
        self.position = position

    def __getitem__(self, row: int) -> int:
        return int(self.sampler.choose(self.p[row : row + 1], [self.position + self.depth[row]])[0])


def verify_tree(draft: Draft, p_logits: Tensor, sampler: Sampler, position: int | None = None) -> Verdict:
    """A tree draft against the target's logits (T, V) over its verify window. position: the absolute position of the
    root row's token (the committed context's length), which Gumbel sampling keys its noise by; the walk is then the
    greedy one with the target's Gumbel-max token at each row (verify.py)."""
    paths = row_paths(draft.tokens.tolist(), draft.parents.tolist()) if sampler.reads_context else None
    if sampler.params.greedy:
        return verify_tree_greedy(draft, sampler.logits(p_logits, paths).argmax(-1).tolist())
    if sampler.gumbel:
        if position is None:
            raise ValueError("Gumbel sampling verifies at absolute positions: pass the context's length as position")
        return verify_tree_greedy(draft, _GumbelChoices(sampler.probs(p_logits, paths), draft.parents.tolist(), sampler, position))
    return verify_tree_sampling(draft, sampler.probs(p_logits, paths), sampler)


def kept_rows(verdict: Verdict) -> list[int]:
    """The verify window's rows the cache keeps: the root and the accepted path."""
    return [0, *verdict.path] if verdict.path is not None else list(range(verdict.num_accepted + 1))


def best_nodes(parents: list[int], scores: list[float], budget: int) -> list[int]:
    """The `budget` nodes of highest score (a log probability along the path, so a node never outscores its
    parent), closed under parents, in node order: EAGLE-2's re-ranking of an expanded tree."""
    order = sorted(range(len(scores)), key=lambda i: -scores[i])
    keep: set[int] = set()
    for i in order:
        if len(keep) >= budget:
            break
        chain = []
        j = i
        while j >= 0 and j not in keep:
            chain.append(j)
            j = parents[j]
        if len(keep) + len(chain) <= budget:
            keep.update(chain)
    return sorted(keep)


def best_first(parents: list[int], scores: list[float], nodes: list[int]) -> list[int]:
    """`nodes` (closed under parents) in depth-first order, the most valuable child first: the tree's best path
    takes rows 1, 2, ..., so when verification accepts along it the kept rows are a prefix of the window, as a
    chain's are, and rollback is the chain's crop (HybridCache.keep, KVCache.keep)."""
    kids: dict[int, list[int]] = {}
    for n in nodes:
        kids.setdefault(parents[n], []).append(n)
    order, stack = [], sorted(kids.get(-1, []), key=lambda c: scores[c])
    while stack:
        n = stack.pop()  # the most valuable of the nodes waiting
        order.append(n)
        stack += sorted(kids.get(n, []), key=lambda c: scores[c])
    return order


def subtree(tokens: list[int], parents: list[int], nodes: list[int]) -> tuple[Tensor, Tensor]:
    """The tree restricted to `nodes` (closed under parents, each after its parent), renumbered: tokens (n,), parents (n,)."""
    index = {old: new for new, old in enumerate(nodes)}
    return (torch.tensor([tokens[i] for i in nodes], dtype=torch.long),
            torch.tensor([index[parents[i]] if parents[i] >= 0 else -1 for i in nodes], dtype=torch.long))

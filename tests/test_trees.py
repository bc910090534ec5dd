"""Token trees (tree.py): lossless greedy and sampling, dense and hybrid targets, every tree drafter.

Greedy identity is checked against plain greedy decoding in fp32 on real weights (stories260K with its
trained MTP / EAGLE / Medusa heads, the demo hybrid with its own MTP head) and with adversarial random
trees (the true continuation to a random depth, random siblings and branches) that exercise every
rollback: a Gated DeltaNet state that followed a wrong branch would change the tokens after it.
The sampling rule is checked exactly on a synthetic target and statistically on the real model.
"""

from __future__ import annotations

import math
import random

import pytest
import torch

import mtpspec
from mtpspec.drafters import make_drafter
from mtpspec.engine import Engine, generate_tokens
from mtpspec.errors import ConfigError
from mtpspec.models.batch import TreeLayout
from mtpspec.sampling import Sampler, SamplingParams
from mtpspec.tree import (GrowingTree, best_first, best_nodes, verify_tree_greedy, verify_tree_lazily,
                          verify_tree_sampling)
from mtpspec.types import TargetOutput
from mtpspec.types import Draft

from test_sampling_exact import PARAMS, PROMPT, chi_square, exact_pairs

HEADS = "models/heads/stories260K-"
PROMPTS = ["Once upon a time", "The little dog ran to the park and", "Lily wanted to play with her ball"]


@pytest.fixture(scope="module")
def plain64(stories) -> dict[str, list[int]]:
    """stories260K's plain greedy 64 tokens after each prompt (the reference of the tree runs)."""
    return {p: stories.generate(p, max_new_tokens=64).tokens for p in PROMPTS}


class RandomTree:
    """Trees holding the true greedy continuation to a random depth, plus random siblings and branches."""

    name = "random-tree"
    prefill_logits = False
    prefill_hidden = False
    taps = ()

    def __init__(self, truth: list[int], prompt_len: int, vocab: int, seed: int) -> None:
        self.truth, self.base, self.vocab, self.rng = truth, prompt_len, vocab, random.Random(seed)

    def prefill(self, context, out, sampler) -> None:
        pass

    def propose(self, context, k: int) -> Draft:
        want = self.truth[context.shape[0] - self.base :][:k]
        good = self.rng.randint(0, len(want))
        toks, parents, prev = [], [], -1
        for j, t in enumerate(want):
            for _ in range(self.rng.randint(0, 2)):  # wrong siblings before the right one
                toks.append(self.rng.randrange(self.vocab))
                parents.append(prev)
            toks.append(t if j < good else self.rng.randrange(self.vocab))
            parents.append(prev)
            prev = len(toks) - 1
            if self.rng.random() < 0.5:  # a branch anywhere above
                toks.append(self.rng.randrange(self.vocab))
                parents.append(self.rng.randrange(-1, len(toks) - 1))
        if not toks:
            return Draft.empty()
        return Draft(tokens=torch.tensor(toks), parents=torch.tensor(parents))

    def commit(self, verdict, out) -> None:
        pass


@pytest.fixture(scope="module")
def demo():
    return mtpspec.load("demo")


@pytest.mark.parametrize("which", ["stories", "demo"])
def test_random_trees_equal_plain_greedy(which, stories, demo):
    model = stories if which == "stories" else demo
    greedy = SamplingParams()
    for prompt in PROMPTS:
        ids = model.encode(prompt)
        plain = generate_tokens(model.module, ids, make_drafter("none", model.module), 1, Sampler(greedy, 0), 48)
        for seed in range(3):
            tree = RandomTree(plain.tokens + [0] * 8, len(ids), model.module.vocab_size, seed)
            got = generate_tokens(model.module, ids, tree, 5, Sampler(greedy, 0), 48)
            assert got.tokens == plain.tokens, (prompt, seed)
            assert got.stats.target_forwards < 48  # the trees were used


@pytest.mark.parametrize("drafter", ["mtp", "eagle", "medusa"])
def test_head_trees_equal_plain_greedy_and_beat_the_chain(stories, plain64, drafter):
    head = HEADS + drafter
    forwards = {}
    for tree in (None, 16):
        total = 0
        for prompt in PROMPTS:
            plain = plain64[prompt]
            r = stories.generate(prompt, drafter=drafter, draft_model=head, k=4 if tree is None else 6, tree=tree, max_new_tokens=64)
            assert r.tokens == plain, (drafter, tree, prompt)
            total += r.stats.target_forwards
        forwards[tree] = total
    assert forwards[16] < forwards[None]  # more tokens per target forward than the chain of depth 4


@pytest.mark.parametrize("drafter", ["mtp", "eagle"])
def test_wide_beam_trees_equal_plain_greedy(stories, plain64, drafter):
    """tree_beam=4 (EAGLE-2's shape: 4 nodes expanded per level, each row of the head's forward on its own path)."""
    for prompt in PROMPTS:
        r = stories.generate(prompt, drafter=drafter, draft_model=HEADS + drafter, k=6, tree=16, tree_beam=4, max_new_tokens=64)
        assert r.tokens == plain64[prompt], (drafter, prompt)


def test_demo_mtp_tree_equals_plain_greedy(demo):
    for prompt in ["def fib(n):\n", "import os\nimport sys\n"]:
        plain = demo.generate(prompt, max_new_tokens=48).tokens
        assert demo.generate(prompt, drafter="mtp", k=5, tree=12, max_new_tokens=48).tokens == plain
        assert demo.generate(prompt, drafter="mtp", k=5, tree=12, tree_beam=3, max_new_tokens=48).tokens == plain


def test_trees_and_chains_in_one_batch_equal_separate_runs(stories):
    cfgs = [("eagle", 5, 16), ("mtp", 3, None), ("medusa", 4, 8), ("ngram", 3, None), ("mtp", 6, 10)]
    engine = Engine(stories.module, max_batch=3)
    sids = []
    for i, (drafter, k, tree) in enumerate(cfgs):
        d = make_drafter(drafter, stories.module, draft_model=None if drafter == "ngram" else HEADS + drafter, tree=tree)
        sids.append(engine.add(stories.encode(PROMPTS[i % 3]), d, Sampler(SamplingParams(), 0), k, 40))
    got = engine.run()
    for i, sid in enumerate(sids):
        assert got[sid].tokens == stories.generate(PROMPTS[i % 3], max_new_tokens=40).tokens, cfgs[i]


def _tree_case():
    """A synthetic target over V = 6 tokens and a tree: root children 2, 0, 5 (point masses), and under 2: 1, 3."""
    torch.manual_seed(0)
    logits = torch.randn(6, 6) * 1.5  # rows: root, then the five nodes
    draft = Draft(tokens=torch.tensor([2, 0, 5, 1, 3]), parents=torch.tensor([-1, -1, -1, 0, 0]))
    return logits, draft


def test_tree_sampling_rule_keeps_the_target_distribution():
    """First token ~ p(root); given the walk went to child 2, the next ~ p(that row). Exact to sampling noise."""
    logits, draft = _tree_case()
    params = SamplingParams(temperature=1.0)
    p = torch.softmax(logits, -1)
    n = 12000
    first, second = torch.zeros(6), torch.zeros(6)
    for seed in range(n):
        v = verify_tree_sampling(draft, p, Sampler(params, seed))
        first[v.tokens[0]] += 1
        if v.tokens[0] == 2:
            second[v.tokens[1]] += 1
    for counts, want in ((first, p[0]), (second, p[1])):
        m = counts.sum()
        stat = float(((counts - m * want) ** 2 / (m * want)).sum())
        assert stat < 5 + 5 * math.sqrt(10), (counts / m, want)  # chi2 with 5 degrees of freedom, far tail


def test_tree_sampling_with_iid_q_children():
    """Children drawn independently from one q (duplicates allowed) follow SpecInfer's residual rule."""
    torch.manual_seed(1)
    p = torch.softmax(torch.randn(5) * 2, -1)
    q = torch.softmax(torch.randn(5), -1)
    n = 12000
    counts = torch.zeros(5)
    gen = torch.Generator().manual_seed(3)
    for seed in range(n):
        kids = torch.multinomial(q, 3, replacement=True, generator=gen)
        draft = Draft(tokens=kids, q=q.expand(3, -1), parents=torch.tensor([-1, -1, -1]))
        rows = p.expand(4, -1)  # every row's p (the leaves' rows are never read for the first token)
        counts[verify_tree_sampling(draft, rows, Sampler(SamplingParams(temperature=1.0), seed)).tokens[0]] += 1
    stat = float(((counts - n * p) ** 2 / (n * p)).sum())
    assert stat < 4 + 5 * math.sqrt(8), (counts / n, p)


@pytest.mark.slow  # 21 s; the rule itself is checked exactly on a synthetic target in the default suite
def test_real_model_tree_sampling_follows_the_target(stories):
    ids = stories.encode(PROMPT)
    exact = exact_pairs(stories, ids)
    n = 800
    counts: dict = {}
    for seed in range(n):
        r = stories.generate(ids, drafter="eagle", draft_model=HEADS + "eagle", k=4, tree=12, temperature=PARAMS.temperature,
                             top_p=PARAMS.top_p, seed=seed, max_new_tokens=2)
        counts[tuple(r.tokens)] = counts.get(tuple(r.tokens), 0) + 1
    stat, df = chi_square(counts, exact, n)
    assert stat < df + 5 * math.sqrt(2 * df), (stat, df)


def test_greedy_walk_and_layout():
    _, draft = _tree_case()
    layout = TreeLayout.of(draft.parents)
    assert TreeLayout.of(draft.parents.clone()) is layout  # one layout per shape
    assert layout.depth.tolist() == [0, 1, 1, 1, 2, 2] and layout.anc[4].tolist() == [True, True, False, False, True, False]
    v = verify_tree_greedy(draft, [2, 3, 0, 0, 0, 4])  # root -> 2 (row 1), then 3 (row 5), then 4
    assert v.tokens.tolist() == [2, 3, 4] and v.path == (1, 5) and v.num_accepted == 2
    v = verify_tree_greedy(draft, [4, 0, 0, 0, 0, 0])  # no child matches: the target's own token
    assert v.tokens.tolist() == [4] and v.path == () and v.num_accepted == 0
    assert best_nodes([-1, 0, 0, -1], [-0.1, -0.5, -0.2, -3.0], 2) == [0, 2]


def test_lazy_head_walk_equals_the_full_one():
    """verify_tree_lazily (the LM head run at the rows the walk reaches) gives the verdict of the walk over every row's
    argmax, and its kept rows' logits; random trees in best-first order, targets that often follow the best path."""
    torch.manual_seed(0)
    rng = random.Random(0)
    head = torch.nn.Linear(8, 5, bias=False)
    for _ in range(200):
        n = rng.randint(1, 12)
        parents = [-1] + [rng.randrange(-1, i) for i in range(1, n)]
        order = best_first(parents, [-rng.random() * (1 + i) for i in range(n)], list(range(n)))
        index = {old: new for new, old in enumerate(order)}
        par = [index[parents[i]] if parents[i] >= 0 else -1 for i in order]
        toks = torch.randint(0, 5, (n,))
        hidden = torch.randn(n + 1, 8)
        logits = head(hidden).detach()  # (n + 1, 5)
        for r, p in enumerate(par):  # make the target agree with about half the nodes
            if rng.random() < 0.5:
                logits[p + 1] = logits[p + 1].index_fill(0, toks[r].reshape(1), 10.0)
        reached = []
        draft = Draft(tokens=toks, parents=torch.tensor(par))
        rows_of = {tuple(hidden[i].tolist()): i for i in range(n + 1)}
        lazy_head = lambda h: (reached.append(h.shape[0]), logits[[rows_of[tuple(x.tolist())] for x in h]])[1]
        v, kept = verify_tree_lazily(draft, TargetOutput(logits=None, hidden=hidden), lazy_head)
        full = verify_tree_greedy(draft, logits.argmax(-1).tolist())
        assert (v.path, v.tokens.tolist()) == (full.path, full.tokens.tolist())
        assert torch.equal(kept, logits[[0, *v.path]])
        assert sum(reached) <= (v.num_accepted + 1) + sum(1 for i, p in enumerate(par) if p == i - 1)  # the path + the best chain


def test_best_first_order_and_chain_shaped_expansions():
    parents, scores = [-1, -1, 0, 0, 2, 1], [-0.5, -0.1, -0.9, -0.6, -0.8, -0.3]
    order = best_first(parents, scores, list(range(6)))
    assert order == [1, 5, 0, 3, 2, 4]  # the best root child and its subtree first, each child after its parent
    tree = GrowingTree(base=7)
    a = tree.add(-1, 3, -0.1)
    b = tree.add(-1, 4, -0.2)
    assert tree.rows_for([a]) is None  # the first level: a chain's step
    c = tree.add(a, 5, -0.3)
    assert tree.rows_for([c]) is None  # every entry so far is its ancestor: a chain's step, at position 7 + 1
    rows = tree.rows_for([b])  # a sibling of an entry: its own row, seeing the context and itself only
    assert rows is not None and rows.pos.tolist() == [7]
    assert rows.mask.tolist() == [[True] * 7 + [False, False, True]]


def test_kept_tree_carries_each_nodes_rank_and_log_q(stories):
    """Proposed (what a drafter keeps of its tree to learn from the verdict):
    per kept node, in draft order, its rank among its parent's guesses and the drafter's log q of it, which is
    log_softmax of the head at the parent (ranks 0 and 1 of the same parent: the top two guesses there)."""
    from mtpspec.tree import keep_best

    tree = GrowingTree(base=0)
    a = tree.add(-1, 3, -0.1, 0, -0.2)
    b = tree.add(-1, 4, -0.5, 1, -1.9)
    c = tree.add(a, 5, -0.3, 0, -0.4)
    draft, kept = keep_best(tree, 3)
    assert draft.tokens.tolist() == [3, 5, 4] and kept.ranks == [0, 0, 1] and kept.logq == [-0.2, -0.4, -1.9]
    assert (a, b, c) == (0, 1, 2)
    d = make_drafter("mtp", stories.module, draft_model=HEADS + "mtp", tree=8)
    out = generate_tokens(stories.module, stories.encode(PROMPTS[0]), d, 4, Sampler(SamplingParams()), 8)
    p = d.proposed
    assert out.tokens and p is not None and len(p.logq) == len(p.parents) == len(p.ranks)
    assert all(lq <= 0.0 for lq in p.logq)
    for i, parent in enumerate(p.parents):  # a parent's top guess is at least as likely as its runner-up
        sibs = [j for j, q in enumerate(p.parents) if q == parent]
        for j in sibs:
            if p.ranks[j] < p.ranks[i]:
                assert p.logq[j] >= p.logq[i]


def test_bad_tree_settings_are_named(stories):
    for bad in (0, 64, "x", True):
        with pytest.raises(ConfigError, match="--tree"):
            make_drafter("eagle", stories.module, draft_model=HEADS + "eagle", tree=bad)
    for bad in (0, 9, "2", True):
        with pytest.raises(ConfigError, match="--tree-beam"):
            make_drafter("mtp", stories.module, draft_model=HEADS + "mtp", tree=8, tree_beam=bad)
    with pytest.raises(ConfigError, match="not used by --drafter none"):
        make_drafter("none", stories.module, tree=8)
    with pytest.raises(ConfigError, match="exact mode"):
        stories.generate("Once", drafter="eagle", draft_model=HEADS + "eagle", tree=8, exact=True, max_new_tokens=4)


def test_draft_model_and_ngram_trees_equal_plain_greedy(stories, stories_q80, plain64):
    forwards = {}
    for drafter, tree in (("draft", None), ("draft", 16), ("ngram", None), ("ngram", 12)):
        total = 0
        for prompt in PROMPTS:
            plain = plain64[prompt]
            r = stories.generate(prompt, drafter=drafter, draft_model=stories_q80 if drafter == "draft" else None,
                                 k=4 if tree is None else 6, tree=tree, max_new_tokens=64)
            assert r.tokens == plain, (drafter, tree, prompt)
            total += r.stats.target_forwards
        forwards[(drafter, tree)] = total
    assert forwards[("draft", 16)] < forwards[("draft", None)]


def test_a_hybrid_draft_model_cannot_draft_trees(demo):
    with pytest.raises(ConfigError, match="recurrent layers"):
        make_drafter("draft", demo.module, draft_model=demo.module, tree=8)


def test_a_traced_tree_shows_its_accepted_path_and_refused_nodes(stories):
    from mtpspec.viz.trace import step_cells

    r = stories.generate(PROMPTS[0], drafter="eagle", draft_model=HEADS + "eagle", k=5, tree=12, max_new_tokens=24, trace=True)
    prev = r.prompt_tokens[-1]
    for s in r.steps:
        assert len(s.draft_parents) == len(s.draft) == len(s.p_of_draft) and len(s.path) == s.num_accepted
        assert [s.draft[i] for i in s.path] == s.emitted[: s.num_accepted] or len(s.emitted) < s.num_accepted
        cells = step_cells(s, prev, stories.tokenizer)
        kinds = [c.kind for c in cells]
        assert kinds[: s.num_accepted] == ["accepted"] * s.num_accepted and len(cells) == len(s.emitted) + len(s.draft) - len(s.path)
        assert set(kinds[len(s.emitted):]) <= {"rejected", "discarded"} and "rejected" in kinds or kinds[len(s.emitted) - 1] == "bonus"
        for i in s.path:  # accepted nodes: the target agreed, so its probability there is the largest
            assert s.p_of_draft[i] > 0.0
        prev = s.emitted[-1] if s.emitted else prev


def test_tree_auto_measures_chain_and_trees_and_stays_lossless(stories):
    from mtpspec.tree import TreeSizer

    d = make_drafter("eagle", stories.module, draft_model=HEADS + "eagle", tree="auto")
    sizer = d.sizer.sizer
    before = sum(sizer.count)
    plain = stories.generate(PROMPTS[1], max_new_tokens=80).tokens
    got = generate_tokens(stories.module, stories.encode(PROMPTS[1]), d, 5, Sampler(SamplingParams(), 0), 80)
    assert got.tokens == plain
    assert min(sizer.count) >= TreeSizer.WARM  # every choice measured
    assert len(got.steps) - 1 <= sum(sizer.count) - before <= len(got.steps)  # every drafting step counted (the last may draft none)
    again = make_drafter("eagle", stories.module, draft_model=HEADS + "eagle", tree="auto")
    assert again.sizer.sizer is sizer  # the head folder is read once per process: its drafters share its module and sizer
    sizer = TreeSizer()  # the choice follows the measured tokens per second
    for _ in range(40):
        arm = sizer.next()
        sizer.observe(arm, (3, 4, 5, 5)[arm], (1.0, 1.5, 1.2, 2.0)[arm])
    assert TreeSizer.ARMS[sizer.next()] == 8


@pytest.mark.parametrize("drafter, head", [("ngram", None), ("mtp", HEADS + "mtp")])
def test_a_tree_near_the_context_end_is_cut_to_the_room_left(stories, drafter, head):
    """A token tree whose window would pass the context's end is cut to the positions left (as a chain's depth is):
    generation stops with finish_reason "context" and plain greedy's tokens, never a context-full error mid-run."""
    ids = stories.encode("Once upon a time, there was a little girl named Lily. She loved to play outside.") * 20
    ids = ids[: stories.module.max_seq_len - 40]  # 40 positions left: the last steps have fewer than a tree's nodes
    plain = stories.generate(ids, drafter="none", max_new_tokens=96)
    got = stories.generate(ids, drafter=drafter, draft_model=head, k=1, tree=8, max_new_tokens=96)
    assert got.finish_reason == plain.finish_reason == "context"
    assert got.tokens == plain.tokens


@pytest.mark.parametrize("drafter, head", [("ngram", None), ("mtp", HEADS + "mtp")])
def test_batched_tree_verification_equals_each_run_alone(stories, plain64, drafter, head):
    """Several sequences' token trees verified in one batched forward (engine.step -> batching.forward_batch with
    trees): each sequence's tokens are plain greedy's."""
    prompts = PROMPTS[:4]
    got = stories.generate_batch(prompts, drafter=drafter, draft_model=head, k=4, tree=8, max_new_tokens=64)
    assert [r.tokens for r in got] == [plain64[p] for p in prompts]

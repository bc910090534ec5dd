"""Trained draft heads (MTP for a target without one, Medusa, EAGLE): lossless on the shared verify
path (greedy token-identical to plain, sampling exact), strict save / load, training lowers the loss."""

from __future__ import annotations

import copy
import random

import pytest
import torch

from mtpspec.drafters import make_drafter
from mtpspec.engine import generate_tokens
from mtpspec.errors import ConfigError, ModelLoadError
from mtpspec.models.heads import DraftHead, DraftHeadConfig, load_head, save_head
from mtpspec.models.qwen35 import HybridConfig, HybridLM
from mtpspec.sampling import Sampler, SamplingParams
from mtpspec.train.heads import HeadConfig, _batch, head_losses
from qwen35_tiny import randomize
from test_mtp_lossless import _chi_square_ok, _exact_two_token_distribution

V = 16
CFG = HybridConfig(
    vocab_size=V, hidden_size=32, num_layers=2, layer_types=("linear_attention", "full_attention"),
    num_heads=4, num_kv_heads=2, head_dim=16, intermediate_size=48, max_seq_len=128, linear_key_head_dim=8,
    linear_value_head_dim=8, linear_num_key_heads=2, linear_num_value_heads=4, mtp_num_layers=0, tie_embeddings=False,
)
PROMPTS = [[3], [1, 4, 1, 5, 9, 2, 6], [7, 7, 7, 7], list(range(16)) + list(range(8))]
KINDS = ("mtp", "eagle", "medusa")
N = 40


@pytest.fixture(scope="module")
def target():
    torch.manual_seed(0)
    m = HybridLM(CFG)
    randomize(m, 3)
    return m.eval()


def _head(kind: str, seed: int = 1) -> DraftHead:
    torch.manual_seed(seed)
    h = DraftHead(DraftHeadConfig(kind=kind, hidden_size=32, vocab_size=V, max_seq_len=128, num_heads=2, num_kv_heads=2,
                                  head_dim=16, intermediate_size=32, num_medusa=3))
    randomize(h, seed)
    return h.eval()


@pytest.fixture(scope="module")
def heads():
    return {k: _head(k) for k in KINDS}


def run(target, prompt, drafter, k, head=None, params=SamplingParams(), seed=0, n=N):
    d = make_drafter(drafter, target, draft_model=head)
    return generate_tokens(target, prompt, d, k, Sampler(params, seed), n)


@pytest.fixture(scope="module")
def plain(target):
    return [run(target, p, "none", 1).tokens for p in PROMPTS]


@pytest.fixture(scope="module")
def fp64(target, heads):
    """The target and heads in float64, with plain greedy's tokens."""
    t64 = copy.deepcopy(target).double()
    return t64, {k: copy.deepcopy(h).double() for k, h in heads.items()}, [run(t64, p, "none", 1).tokens for p in PROMPTS]


# fp32 logits of tiny hybrids are within ~850 eps32 * max |logit| of the fp64 truth at their worst (measured in
# tests/test_hf_parity.py): a verify window and a one-token step may round a near-tie differently.
TIE_ULPS = 4096


def _same_up_to_a_tie(got: list[int], ref: list[int], prompt: list[int], target64) -> None:
    """Equal, or equal up to a position where the fp64 logits have a tie within fp32 rounding."""
    if got == ref:
        return
    i = next(j for j, (a, b) in enumerate(zip(got, ref)) if a != b)
    with torch.inference_mode():
        last = target64.forward_tokens(torch.tensor(prompt + ref[:i]), target64.new_cache()).logits[-1]
    gap = (last[got[i]] - last[ref[i]]).abs().item()
    assert gap < TIE_ULPS * torch.finfo(torch.float32).eps * last.abs().max().item(), f"token {i}: {got[i]} vs {ref[i]}"


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("k", [1, 3])
def test_greedy_identical_to_plain(target, heads, plain, fp64, kind, k):
    """fp64: the same tokens (no tie is that close). fp32: the same up to a genuine near-tie."""
    target64, heads64, plain64 = fp64
    drafted = 0
    for prompt, ref, ref64 in zip(PROMPTS, plain, plain64):
        r = run(target64, prompt, kind, k, heads64[kind])
        assert r.tokens == ref64, f"{kind} k={k} differs on prompt {prompt} (fp64)"
        drafted += r.stats.draft_tokens
        _same_up_to_a_tie(run(target, prompt, kind, k, heads[kind]).tokens, ref, prompt, target64)
    assert drafted > 0


# eagle's (11 s) in make test-slow: --drafter eagle is the MTP drafter with the EAGLE head attached (drafters/__init__.py),
# whose sampling path the default suite checks in test_mtp_lossless.py[mtp-2]; medusa's own drafter stays here
@pytest.mark.parametrize("kind", ["medusa", pytest.param("eagle", marks=pytest.mark.slow)])
def test_sampling_distribution_is_the_targets(target, heads, kind):
    params = SamplingParams(temperature=0.9, top_p=0.9)
    prompt = [2, 9, 4, 2, 9]
    joint = _exact_two_token_distribution(target, prompt, params)
    n_runs = 800
    counts = torch.zeros(V, V)
    drafted = 0
    for seed in range(n_runs):
        r = run(target, prompt, kind, 2, heads[kind], params, seed=seed, n=2)
        counts[r.tokens[0], r.tokens[1]] += 1
        drafted += r.stats.draft_tokens
    assert drafted > 0
    ok, stat, df = _chi_square_ok(counts, joint, n_runs)
    assert ok, f"{kind}: chi-square {stat:.1f} with {df} degrees of freedom"


@pytest.mark.parametrize("kind", KINDS)
def test_save_load_round_trip(tmp_path, target, heads, kind):
    save_head(heads[kind], tmp_path / kind)
    loaded = load_head(tmp_path / kind)
    for (n1, a), (n2, b) in zip(heads[kind].state_dict().items(), loaded.state_dict().items()):
        assert n1 == n2 and torch.equal(a, b)
    a = run(target, PROMPTS[1], kind, 3, heads[kind])
    b = run(target, PROMPTS[1], kind, 3, str(tmp_path / kind))  # a path, as --draft-model gives it
    assert [s.draft for s in a.steps] == [s.draft for s in b.steps]


def test_strict_loading_names_missing_tensors(tmp_path, heads):
    from safetensors.torch import load_file, save_file

    d = save_head(heads["eagle"], tmp_path / "e")
    state = load_file(str(d / "head.safetensors"))
    state.pop("mtp.fc.bias")
    save_file(state, str(d / "head.safetensors"))
    with pytest.raises(ModelLoadError, match="mtp.fc.bias"):
        load_head(d)


def test_clear_errors(target, heads):
    with pytest.raises(ConfigError, match="needs a trained head"):
        make_drafter("medusa", target)
    with pytest.raises(ConfigError, match="was given a medusa head"):
        make_drafter("eagle", target, draft_model=heads["medusa"])
    wrong = DraftHead(DraftHeadConfig(kind="medusa", hidden_size=24, vocab_size=V, max_seq_len=128))
    with pytest.raises(ConfigError, match="hidden 24"):
        make_drafter("medusa", target, draft_model=wrong)


@pytest.mark.parametrize("kind", KINDS)
def test_training_lowers_the_loss(target, kind):
    """Self-distillation on the target's own greedy / sampled continuations: a few steps fit better."""
    seqs = []
    with torch.inference_mode():
        for i, p in enumerate(PROMPTS * 2):
            r = run(target, p, "none", 1, params=SamplingParams(temperature=float(i % 2)), seed=i, n=40)
            toks = torch.tensor(p + r.tokens)
            seqs.append((toks.clone(), target.forward_tokens(toks, target.new_cache()).hidden.clone()))
    for p in target.parameters():
        p.requires_grad_(False)
    cfg = HeadConfig(out="", kind=kind, depth=2)
    head = _head(kind, seed=2).train()
    torch.manual_seed(0)
    opt = torch.optim.AdamW(head.parameters(), lr=3e-3)
    rng = random.Random(0)
    fixed = _batch(seqs, 8, 32, random.Random(1))
    first = head_losses(head, target, *fixed, cfg)[0].item()
    for _ in range(40):
        loss, _ = head_losses(head, target, *_batch(seqs, 8, 32, rng), cfg)
        opt.zero_grad()
        loss.backward()
        opt.step()
    last = head_losses(head, target, *fixed, cfg)[0].item()
    assert last < first - 0.05, (first, last)


SHIPPED = __import__("pathlib").Path(__file__).resolve().parents[1] / "models" / "heads"


@pytest.mark.parametrize("kind", KINDS)
def test_shipped_stories260K_heads_are_lossless_and_accept(stories, kind):
    """The heads shipped in models/heads (trained by `mtpspec train head` on stories260K): greedy identical."""
    path = SHIPPED / f"stories260K-{kind}"
    if not path.exists():
        pytest.skip(f"{path} not shipped")
    from mtpspec.prompts import tinystories_prompts

    for p in tinystories_prompts(3):  # held out of the heads' training (its first 50 prompts)
        ref = stories.generate(p, max_new_tokens=64)
        r = stories.generate(p, drafter=kind, k=3, draft_model=str(path), max_new_tokens=64)
        assert r.tokens == ref.tokens
        assert r.stats.mean_accepted_length > (1.05 if kind == "medusa" else 1.5)  # medusa is the weakest head here


# A head for a dense target (Llama / Qwen3 / Gemma 3) has the target's own decoder layer (`--layer target`), started from
# its last layer; a small Gemma-3-shaped target (sandwich norms, QK-norm, GELU-tanh, local and global layers) stands in.
from mtpspec.models.dense import DenseConfig, DenseLM  # noqa: E402
from mtpspec.train.heads import head_config, init_from_target, train_head  # noqa: E402

DENSE = DenseConfig(vocab_size=V, hidden_size=32, num_layers=3, num_heads=2, num_kv_heads=1, intermediate_size=48,
                    max_seq_len=128, head_dim=16, qk_norm=True, layer_windows=(4, 4, 0), rope_theta=1e6,
                    rope_local_theta=1e4, sandwich_norms=True, hidden_act="gelu_tanh", embed_scale=True)


@pytest.fixture(scope="module")
def dense_pair():
    torch.manual_seed(3)
    t = DenseLM(DENSE)
    randomize(t, 4)
    head = DraftHead(head_config(t, HeadConfig(out="", layer="target")))
    randomize(head, 5)
    return t.eval(), head.eval()


def test_a_dense_head_is_the_targets_layer_started_from_its_last(dense_pair):
    t, _ = dense_pair
    head = DraftHead(head_config(t, HeadConfig(out="", layer="target")))
    init_from_target(head, t)
    src, dst = dict(t.model.layers[-1].named_parameters()), dict(head.mtp.layers[0].named_parameters())
    assert src.keys() == dst.keys()
    assert all(torch.equal(src[n], dst[n]) for n in src)
    assert torch.equal(head.mtp.norm.weight, t.model.norm.weight)
    with pytest.raises(ConfigError, match="dense target"):
        head_config(HybridLM(CFG), HeadConfig(out="", layer="target"))


@pytest.mark.parametrize("extra", [{}, pytest.param({"tree": 6}, marks=pytest.mark.slow)])
def test_a_dense_head_is_lossless_alone_and_in_a_batch(dense_pair, extra):
    """fp64: every prompt's tokens equal plain greedy's, one at a time and four sequences sharing each forward."""
    from mtpspec.engine import Engine

    t, head = (copy.deepcopy(m).double() for m in dense_pair)
    want = [run(t, p, "none", 1).tokens for p in PROMPTS]
    drafted = 0
    for p, ref in zip(PROMPTS, want):
        r = generate_tokens(t, p, make_drafter("mtp", t, draft_model=head, **extra), 3, Sampler(SamplingParams()), N)
        assert r.tokens == ref
        drafted += r.stats.draft_tokens
    assert drafted > 0
    engine = Engine(t, 4)
    ids = [engine.add(p, make_drafter("mtp", t, draft_model=head, **extra), Sampler(SamplingParams()), 3, N) for p in PROMPTS]
    got = engine.run()
    assert [got[i].tokens for i in ids] == want


def test_a_dense_head_round_trips_in_bf16_with_its_draft_vocabulary(tmp_path, dense_pair):
    from mtpspec.models.draft_vocab import TokenRanking

    t, head = dense_pair
    h = copy.deepcopy(head)
    h.token_ranking = TokenRanking(torch.arange(V).flip(0), 8)
    save_head(h, tmp_path / "h", torch.bfloat16)
    back = load_head(tmp_path / "h")
    assert back.config == head.config and back.token_ranking.default_size == 8
    assert all(torch.equal(a.to(torch.bfloat16).float(), b) for a, b in zip(head.state_dict().values(), back.state_dict().values()))
    d = make_drafter("mtp", t, draft_model=str(tmp_path / "h"))
    assert d.head is not None and d.head.ids.tolist() == list(range(V - 1, V - 9, -1))  # drafts over the head's 8 tokens
    r = run(t, PROMPTS[1], "mtp", 3, str(tmp_path / "h"))
    assert r.tokens == run(t, PROMPTS[1], "none", 1).tokens


def test_training_a_dense_head_resumes_exactly(tmp_path, dense_pair, monkeypatch):
    """`train head --layer target --draft-vocab N --checkpoint-every 2`: a run stopped after step 3 and started again
    writes the same head as one that ran through."""
    import mtpspec.train.pretrain as pretrain

    t, _ = dense_pair
    tok = _DigitTokenizer()

    def cfg(out):
        return HeadConfig(out=str(out), layer="target", prompts=str(tmp_path / "prompts.txt"), heldout_prompts=1,
                          train_prompts=4, gen_tokens=12, gen_batch=2, depth=2, steps=5, batch_size=2, seq_len=8,
                          draft_vocab=8, checkpoint_every=2, eval_prompts=1, eval_tokens=8, data_cache=str(tmp_path / "data.pt"))

    (tmp_path / "prompts.txt").write_text("\n".join(["1 2 3", "4 5 6 7", "8 9", "3 1 4 1 5", "9 2 6"]) + "\n")
    whole = train_head("tiny", cfg(tmp_path / "a"), target=(t, tok), progress_bar=False)
    assert whole["draft_vocab"] == 8 and whole["heldout_greedy"]["identical_to_plain"]
    real_step, calls = pretrain.optimizer_step, []

    def stop_at_the_fourth(*a, **kw):
        calls.append(1)
        if len(calls) == 4:
            raise KeyboardInterrupt
        return real_step(*a, **kw)

    monkeypatch.setattr(pretrain, "optimizer_step", stop_at_the_fourth)
    with pytest.raises(KeyboardInterrupt):
        train_head("tiny", cfg(tmp_path / "b"), target=(t, tok), progress_bar=False)
    assert (tmp_path / "b" / "train_state.pt").exists()
    monkeypatch.setattr(pretrain, "optimizer_step", real_step)
    train_head("tiny", cfg(tmp_path / "b"), target=(t, tok), progress_bar=False)
    a, b = load_head(tmp_path / "a"), load_head(tmp_path / "b")
    assert all(torch.equal(x, y) for x, y in zip(a.state_dict().values(), b.state_dict().values()))
    assert not (tmp_path / "b" / "train_state.pt").exists()


def test_generation_rounds_continue_every_prompt_again_sampled(dense_pair):
    """--gen-rounds 2: continuation j is prompt j mod N's, greedy only in round 0 for even prompts (the target's own
    greedy text), sampled otherwise; a rank's share (indices) generates the same sequences as one process."""
    from mtpspec.train.heads import self_distill_data

    t, _ = dense_pair
    tok = _DigitTokenizer()
    prompts = ["1 2 3", "4 5 6 7", "8 9"]
    cfg = HeadConfig(out="", gen_tokens=10, gen_batch=2, gen_rounds=2, gen_temperature=1.0, seed=1)
    seqs = self_distill_data(t, tok, prompts, cfg, progress_bar=False)
    assert len(seqs) == 6
    for j, (toks, hidden) in enumerate(seqs):
        x = tok.encode(prompts[j % 3])
        assert toks[: len(x)].tolist() == x and toks.shape[0] == len(x) + 10 and hidden.shape[0] == toks.shape[0]

    def alone(i: int, temperature: float, seed: int) -> list[int]:
        return generate_tokens(t, tok.encode(prompts[i]), make_drafter("none", t), 1,
                               Sampler(SamplingParams(temperature=temperature), seed=seed), 10).tokens

    assert seqs[0][0][-10:].tolist() == alone(0, 0.0, 0)
    assert [seqs[j][0][-10:].tolist() for j in (1, 3, 4)] == [alone(1, 1.0, 2), alone(0, 1.0, 4), alone(1, 1.0, 5)]
    part = self_distill_data(t, tok, prompts, cfg, progress_bar=False, indices=[1, 4])
    assert all(torch.equal(a[0], b[0]) for a, b in zip(part, (seqs[1], seqs[4])))


class _DigitTokenizer:
    """Digits as tokens 1..10 after BOS 0: enough of a tokenizer for the training loop's prompts."""

    def encode(self, text: str) -> list[int]:
        return [0] + [int(c) + 1 for c in text if c.isdigit()]

"""--drafter eagle3: an EAGLE-3 head (models/eagle3.py) on its frozen target: greedy identical to plain, sampling exact,
its draft chain the arithmetic of llama.cpp's eagle3.cpp, its training-time test the chain it drafts, its checkpoint."""

from __future__ import annotations

import copy
import random

import pytest
import torch
import torch.nn.functional as F

from mtpspec.drafters import make_drafter
from mtpspec.engine import generate_tokens
from mtpspec.errors import ConfigError, ModelLoadError
from mtpspec.models.heads import DraftHead, DraftHeadConfig, attach, load_head, save_head
from mtpspec.models.qwen35 import HybridLM
from mtpspec.sampling import Sampler, SamplingParams
from mtpspec.train.heads import HeadConfig, _batch, eagle3_chain, head_config, head_losses, init_eagle3, layer_input_data
from qwen35_tiny import randomize
from test_heads import CFG, PROMPTS, V
from test_mtp_lossless import _chi_square_ok, _exact_two_token_distribution

N = 40
LAYERS = (0, 1, 1)  # the tiny target has two layers


@pytest.fixture(scope="module")
def target():
    torch.manual_seed(0)
    m = HybridLM(CFG)
    randomize(m, 3)
    return m.eval()


def _head(seed: int = 1, vocab: int = 12, norm_before_residual: bool = False) -> DraftHead:
    torch.manual_seed(seed)
    h = DraftHead(DraftHeadConfig(kind="eagle3", hidden_size=32, vocab_size=V, max_seq_len=128, num_heads=4, num_kv_heads=2,
                                  head_dim=16, intermediate_size=32, aux_layers=LAYERS, draft_vocab_size=vocab,
                                  norm_before_residual=norm_before_residual))
    randomize(h, seed)
    if vocab:
        h.mtp.set_vocab(torch.randperm(V, generator=torch.Generator().manual_seed(seed))[:vocab])
    return h.eval()


@pytest.fixture(scope="module")
def head():
    return _head()


def run(target, prompt, k, head, params=SamplingParams(), seed=0, n=N, drafter="eagle3", **opts):
    d = make_drafter(drafter, target, draft_model=head, **opts)
    return generate_tokens(target, prompt, d, k, Sampler(params, seed), n)


def _fp64(target, head):
    return copy.deepcopy(target).double(), copy.deepcopy(head).double()


@pytest.mark.parametrize("k", [1, 3])
def test_greedy_identical_to_plain(target, head, k):
    """fp64 (no near-ties): the same tokens as plain decoding, with and without norm_before_residual, chains and a tree."""
    t64, h64 = _fp64(target, head)
    _, h64b = _fp64(target, _head(2, 0, norm_before_residual=True))  # and the full vocabulary
    drafted = accepted = 0
    for prompt in PROMPTS:
        ref = run(t64, prompt, 1, None, drafter="none").tokens
        for h in (h64, h64b) if k > 1 else (h64,):
            r = run(t64, prompt, k, h)
            assert r.tokens == ref, f"k={k} differs on prompt {prompt}"
            drafted += r.stats.draft_tokens
            accepted += r.stats.accepted_tokens
        if k > 1 and len(prompt) > 4:  # a token tree (EAGLE-2's dynamic tree over the head's guesses)
            assert run(t64, prompt, k, h64, tree=8).tokens == ref
    assert drafted > 0 and accepted > 0


def _rms(x, w, eps):
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * w


def _rope(x, pos, theta, hd):
    """HF's half-split rotary (llama.cpp's normal rope on the converter's permuted q / k rows is the same map)."""
    inv = 1.0 / theta ** (torch.arange(0, hd, 2, dtype=x.dtype) / hd)
    ang = pos * inv
    cos, sin = torch.cat([ang, ang]).cos(), torch.cat([ang, ang]).sin()
    return x * cos + torch.cat([-x[..., hd // 2 :], x[..., : hd // 2]], -1) * sin


def reference_drafts(target, head, context: list[int], k: int) -> list[int]:
    """llama.cpp's EAGLE-3 (src/models/eagle3.cpp's encoder and decoder graphs, common/speculative.cpp's
    draft-eagle3: the pair at position p is (token[p + 1], g[p]), each chained step feeds the decoder's pre-norm
    output back as g), written out in plain torch from those files: the k greedy drafts after `context`."""
    m, c = head.mtp, head.config
    blk, eps = m.layers[0], c.norm_eps
    att = blk.self_attn
    nh, nkv, hd = att.nh, att.nkv, att.hd
    with torch.inference_mode():
        out = target.forward_tokens(torch.tensor(context[:-1]), target.new_cache(), taps=LAYERS)
        feats = torch.cat([out.layer_inputs[i] for i in c.aux_layers], -1)  # (P, 3H) [low, mid, high]
        g_all = feats @ m.fc.weight.t()  # the encoder: fc_out
        tok_embd = target.model.embed_tokens.weight
        keys, vals = [], []

        def step(token: int, g, pos: int):
            embd_norm = _rms(tok_embd[token], blk.input_layernorm.weight, eps)
            g_norm = _rms(g, blk.hidden_norm.weight, eps)
            inp_sa = g_norm if c.norm_before_residual else g
            cur = torch.cat([embd_norm, g_norm])  # (2H,)
            q = _rope((cur @ att.q_proj.weight.t()).view(nh, hd), pos, c.rope_theta, hd)
            keys.append(_rope((cur @ att.k_proj.weight.t()).view(nkv, hd), pos, c.rope_theta, hd))
            vals.append((cur @ att.v_proj.weight.t()).view(nkv, hd))
            kk = torch.stack(keys, 1).repeat_interleave(nh // nkv, 0)  # (nh, n, hd)
            vv = torch.stack(vals, 1).repeat_interleave(nh // nkv, 0)
            a = torch.softmax((kk @ q[:, :, None])[..., 0] / hd**0.5, -1)  # (nh, n)
            o = (a[..., None] * vv).sum(1).reshape(-1) @ att.o_proj.weight.t()
            ffn_inp = o + inp_sa
            cur = _rms(ffn_inp, blk.post_attention_layernorm.weight, eps)
            ffn = (F.silu(cur @ blk.mlp.gate_proj.weight.t()) * (cur @ blk.mlp.up_proj.weight.t())) @ blk.mlp.down_proj.weight.t()
            prenorm = ffn + ffn_inp  # t_h_nextn
            logits = _rms(prenorm, m.norm.weight, eps) @ m.lm_head.weight.t()  # over the draft vocabulary
            full = torch.full((c.vocab_size,), float("-inf"), dtype=logits.dtype)
            full[torch.arange(m.d2t.numel()) + m.d2t] = logits  # d2t: ggml_set_rows at the absolute target ids
            return prenorm, full

        for p in range(len(context) - 1):
            pre, logits = step(context[p + 1], g_all[p], p)
        drafts = []
        for j in range(k):
            drafts.append(int(logits.argmax()))
            pre, logits = step(drafts[-1], pre, len(context) - 1 + j)
    return drafts


@pytest.mark.parametrize("norm_before_residual", [False, True])
def test_drafts_are_llamacpps_eagle3(target, norm_before_residual):
    t64, h64 = _fp64(target, _head(3, 12, norm_before_residual))
    for prompt in PROMPTS[1:]:
        first = run(t64, prompt, 3, h64, n=4).steps[0].draft
        assert first == reference_drafts(t64, h64, prompt, 3)


def test_training_time_test_is_the_draft_chain(target):
    """eagle3_chain's step k at root i (training) = the drafter's k-th chained output after the pairs up to i."""
    t64, h64 = _fp64(target, _head(4))
    toks = torch.tensor([1, 4, 1, 5, 9, 2, 6, 3, 3, 7, 8, 1])
    src = attach(t64, h64)
    with torch.inference_mode():
        out = t64.forward_tokens(toks, t64.new_cache(), taps=src.taps)
        outs = eagle3_chain(h64, t64, toks[None], torch.cat([out.layer_inputs[i] for i in LAYERS], -1)[None], 3)
        g = src.pair_hidden(out)
        for i in (0, 4, 8):
            cache = src.new_mtp_cache()
            o = src.mtp_forward(g[: i + 1], toks[1 : i + 2], cache)[-1:]
            for k in range(3):
                torch.testing.assert_close(o[0], outs[k][0, i], rtol=0, atol=1e-12)
                if k < 2:  # step k + 1 reads step k's output and t_{i+k+2}
                    o = src.mtp_forward(o, toks[i + 2 + k : i + 3 + k], cache)


def test_taps_are_passed_for_the_eagle3_sequence_only(target, head, monkeypatch):
    """The EAGLE-3 drafter asks for its layers' inputs (`taps`) and the engine passes them to its own sequence's target
    forwards (prefill, verify; exact mode's one-position forwards): attaching the head sets nothing on the target, and
    other drafters' forwards of the same model, before, after and beside it, tap nothing. A batched verify pass taps
    the union of its sequences' taps."""
    import mtpspec.batching as batching
    from mtpspec.engine import Engine

    t64, h64 = _fp64(target, head)
    before = dict(vars(t64))
    d = make_drafter("eagle3", t64, draft_model=h64)
    assert d.taps == (0, 1) and vars(t64) == before
    assert make_drafter("ngram", t64).taps == () and make_drafter("none", t64).taps == ()
    seen, unions = [], []  # (taps, the layers of layer_inputs or None) of every sequence's forward; each batch's taps
    forward, batched = type(t64).forward_tokens, batching.forward_batch

    def one(self, *args, **kw):
        out = forward(self, *args, **kw)
        seen.append((kw.get("taps", ()), None if out.layer_inputs is None else tuple(sorted(out.layer_inputs))))
        return out

    def many(*args, **kw):
        outs = batched(*args, **kw)
        unions.append(kw["taps"])
        seen.extend((kw["taps"], None if o.layer_inputs is None else tuple(sorted(o.layer_inputs))) for o in outs)
        return outs

    monkeypatch.setattr(type(t64), "forward_tokens", one)
    monkeypatch.setattr(batching, "forward_batch", many)
    a, b = PROMPTS[1], PROMPTS[3]
    refs = [run(t64, p, 1, None, drafter="none").tokens for p in (a, b)]
    assert seen and set(seen) == {((), None)}
    for exact in (False, True):
        seen.clear()
        r = generate_tokens(t64, a, make_drafter("eagle3", t64, draft_model=h64), 3, Sampler(SamplingParams(), 0), N, exact=exact)
        assert r.tokens == refs[0] and r.stats.draft_tokens > 0
        assert seen and set(seen) == {((0, 1), (0, 1))}
    seen.clear()
    assert run(t64, a, 3, None, drafter="ngram").tokens == refs[0]
    assert seen and set(seen) == {((), None)}
    seen.clear()
    engine = Engine(t64, max_batch=2)
    sids = [engine.add(a, make_drafter("eagle3", t64, draft_model=h64), Sampler(SamplingParams(), 0), 3, N),
            engine.add(b, make_drafter("ngram", t64), Sampler(SamplingParams(), 0), 3, N)]
    got = engine.run()
    assert [got[s].tokens for s in sids] == refs
    assert seen[:2] == [((0, 1), (0, 1)), ((), None)]  # each prompt's own prefill: its own drafter's taps
    assert unions and set(unions) == {(0, 1)}  # the batch's verify passes, while both ran
    assert set(seen[2:]) <= {((0, 1), (0, 1)), ((), None)}


def test_a_plain_sequence_after_an_eagle3_one_takes_the_compiled_step(target, head):
    """Only a forward that taps runs eagerly on a compiled model: the EAGLE-3 sequence's forwards skip the compiled
    step, a plain sequence on the same model object after it takes it again."""
    from mtpspec.models.forward import forward_tokens

    t64, h64 = _fp64(target, head)

    class Step:  # a compiled step that takes every window it is offered, run as the eager forward
        calls = 0

        def handles(self, t, cache):
            return True

        def __call__(self, tokens, cache):
            self.calls += 1
            return forward_tokens(t64, tokens, cache)

    ref = run(t64, PROMPTS[1], 1, None, drafter="none").tokens
    t64.compiled_step = step = Step()
    assert run(t64, PROMPTS[1], 3, h64).tokens == ref and step.calls == 0
    assert run(t64, PROMPTS[1], 1, None, drafter="none").tokens == ref and step.calls == N  # every step's forward


@pytest.mark.slow
def test_sampling_distribution_is_the_targets(target, head):
    params = SamplingParams(temperature=0.9, top_p=0.9)
    prompt = [2, 9, 4, 2, 9]
    joint = _exact_two_token_distribution(target, prompt, params)
    n_runs = 800
    counts = torch.zeros(V, V)
    drafted = 0
    for seed in range(n_runs):
        r = run(target, prompt, 2, head, params, seed=seed, n=2)
        counts[r.tokens[0], r.tokens[1]] += 1
        drafted += r.stats.draft_tokens
    assert drafted > 0
    ok, stat, df = _chi_square_ok(counts, joint, n_runs)
    assert ok, f"chi-square {stat:.1f} with {df} degrees of freedom"


def test_sampled_drafts_stay_in_the_draft_vocabulary(target, head):
    """Sampled: q is zero outside the draft vocabulary, so every drafted token is one of its tokens; seeded runs repeat."""
    params = SamplingParams(temperature=0.8)
    a = run(target, PROMPTS[1], 3, head, params, seed=5)
    assert a.tokens == run(target, PROMPTS[1], 3, head, params, seed=5).tokens
    inside = set(head.mtp.ids.tolist())
    assert all(t in inside for s in a.steps for t in s.draft) and a.stats.draft_tokens > 0


def test_save_load_round_trip(tmp_path, target, head):
    save_head(head, tmp_path / "e3", torch.bfloat16)
    loaded = load_head(tmp_path / "e3")
    assert loaded.config == head.config and torch.equal(loaded.mtp.d2t, head.mtp.d2t) and torch.equal(loaded.mtp.t2d, head.mtp.t2d)
    save_head(head, tmp_path / "f32")
    a = run(target, PROMPTS[1], 3, head)
    b = run(target, PROMPTS[1], 3, str(tmp_path / "f32"))  # a path, as --draft-model gives it
    assert [s.draft for s in a.steps] == [s.draft for s in b.steps]


def test_strict_loading_and_clear_errors(tmp_path, target, head):
    from safetensors.torch import load_file, save_file

    d = save_head(head, tmp_path / "e")
    state = load_file(str(d / "head.safetensors"))
    state.pop("mtp.layers.0.hidden_norm.weight")
    save_file(state, str(d / "head.safetensors"))
    with pytest.raises(ModelLoadError, match="hidden_norm"):
        load_head(d)
    with pytest.raises(ConfigError, match="draft-vocab"):
        make_drafter("eagle3", target, draft_model=head, draft_vocab=8)
    with pytest.raises(ConfigError, match="was given a eagle3 head"):
        make_drafter("eagle", target, draft_model=head)
    deep = copy.deepcopy(head)
    object.__setattr__(deep.config, "aux_layers", (0, 1, 5))
    with pytest.raises(ConfigError, match="this target has 2 layers"):
        make_drafter("eagle3", target, draft_model=deep)
    with pytest.raises(ConfigError, match="--aux-layers"):
        head_config(target, HeadConfig(out="", kind="eagle3", aux_layers="0,1"))


@pytest.mark.slow  # (test_train_head_end_to_end runs the same training path by default)
def test_training_lowers_the_loss(target):
    """A few steps of the training-time test (3 chained steps) on the target's own continuations fit better."""
    seqs = []
    with torch.inference_mode():
        for i, p in enumerate(PROMPTS * 2):
            r = run(target, p, 1, None, SamplingParams(temperature=float(i % 2)), seed=i, n=40, drafter="none")
            toks = torch.tensor(p + r.tokens)
            seqs.append((toks.clone(), target.forward_tokens(toks, target.new_cache()).hidden.clone()))
    for p in target.parameters():
        p.requires_grad_(False)
    before = dict(vars(target))
    one = layer_input_data(target, seqs[1:2], (1, 0, 1), progress_bar=False)[0][2]  # (T, 3H): layers 1, 0, 1's inputs
    assert vars(target) == before  # the taps were passed to the forward, nothing set on the target
    assert torch.equal(one[:, :32], one[:, 64:]) and not torch.equal(one[:, :32], one[:, 32:64])
    seqs = layer_input_data(target, seqs, LAYERS, progress_bar=False)
    cfg = HeadConfig(out="", kind="eagle3", depth=3, draft_vocab=12)
    head = DraftHead(head_config(target, cfg))
    assert head.config.aux_layers == (0, 1, 1)  # a 2-layer target: its layers' default, kept inside it
    lm, coverage = init_eagle3(head, target, seqs, 12)
    assert 0.5 < coverage <= 1 and head.mtp.ids.numel() == 12
    torch.manual_seed(0)
    opt = torch.optim.AdamW(head.parameters(), lr=3e-3)
    rng = random.Random(0)
    fixed = _batch(seqs, 8, 32, random.Random(1))
    first = head_losses(head, target, *fixed[:2], cfg, lm, fixed[2])[0].item()
    for _ in range(20):
        b = _batch(seqs, 8, 32, rng)
        loss, parts = head_losses(head, target, *b[:2], cfg, lm, b[2])
        opt.zero_grad()
        loss.backward()
        opt.step()
    assert set(parts) == {"ce_1", "ce_2", "ce_3"}
    last = head_losses(head, target, *fixed[:2], cfg, lm, fixed[2])[0].item()
    assert last < first - 0.05, (first, last)


def _real_head(module, draft_vocab: int) -> DraftHead:
    """An untrained eagle3 head for a real target, its LM head started from the target's (drafts get accepted now and then)."""
    torch.manual_seed(0)
    head = DraftHead(head_config(module, HeadConfig(out="", kind="eagle3", draft_vocab=draft_vocab, num_heads=2, num_kv_heads=1)))
    seqs = [(torch.arange(module.vocab_size), None)]
    init_eagle3(head, module, seqs, draft_vocab)
    return head.eval()


@pytest.mark.parametrize("which", ["demo", "stories260K", pytest.param("stories260K-q8_0", marks=pytest.mark.slow)])
def test_real_targets_greedy_identical_alone_and_batched(which, stories, assets):
    """The demo (a hybrid), stories260K (dense), and stories260K on Q8_0 blocks (the head then drafts on blocks too)."""
    import mtpspec
    from mtpspec.prompts import tinystories_prompts

    if which == "stories260K-q8_0":
        model = mtpspec.load(assets / "models" / "stories260K.bin", tokenizer=assets / "models" / "tok512.bin", quant="q8_0")
    else:
        model = mtpspec.load("demo") if which == "demo" else stories
    head = _real_head(model.module, 256)
    prompts = tinystories_prompts(2)
    refs = [model.generate(p, max_new_tokens=24).tokens for p in prompts]
    for p, ref in zip(prompts, refs):
        r = model.generate(p, drafter="eagle3", k=3, draft_model=head, max_new_tokens=24)
        assert r.tokens == ref and r.stats.draft_tokens > 0
    batch = model.generate_batch(prompts, drafter="eagle3", k=2, draft_model=head, max_new_tokens=24)
    assert [r.tokens for r in batch] == refs


def test_train_head_end_to_end(tmp_path, target):
    """`train head --kind eagle3` on the tiny target: the layer-input pass on an even subset of the data
    (--feature-sequences) cached beside the data, a time budget (--max-minutes) that ends training, and a head that
    drafts losslessly as written."""
    from mtpspec.train.heads import train_head
    from test_heads import _DigitTokenizer

    (tmp_path / "prompts.txt").write_text("\n".join(["1 2 3", "4 5 6 7", "8 9", "3 1 4 1 5", "9 2 6", "2 7 1 8"]) + "\n")
    cfg = dict(kind="eagle3", prompts=str(tmp_path / "prompts.txt"), heldout_prompts=1, train_prompts=5, gen_tokens=16,
               gen_batch=2, depth=2, steps=6, batch_size=2, seq_len=8, draft_vocab=8, eval_prompts=1, eval_tokens=8,
               data_cache=str(tmp_path / "data.pt"), feature_sequences=3, num_heads=2, num_kv_heads=1)
    report = train_head("tiny", HeadConfig(out=str(tmp_path / "a"), **cfg), target=(target, _DigitTokenizer()), progress_bar=False)
    assert report["kind"] == "eagle3" and report["steps"] == 6 and report["heldout_greedy"]["identical_to_plain"]
    assert report["draft_vocab_coverage"] > 0.5
    assert len(torch.load(tmp_path / "data.layers-0-1-1.n3.pt")) == 3
    head = load_head(tmp_path / "a")
    assert head.config.aux_layers == LAYERS and head.config.draft_vocab_size == 8 and head.token_ranking is None
    timed = train_head("tiny", HeadConfig(out=str(tmp_path / "b"), max_minutes=1e-9, **cfg), target=(target, _DigitTokenizer()),
                       progress_bar=False)
    assert timed["steps"] == 1  # the budget was spent by the first step

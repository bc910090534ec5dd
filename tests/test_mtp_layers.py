"""Multi-layer MTP (mtp_num_layers > 1, docs/mtp-layers.md): the drafter's depths equal DeepSeek-V3's definition
(train/pretrain.py `mtp_hiddens`) computed from scratch, greedy speculative decoding is token-identical to plain,
checkpoints keep every `mtp.layers.{i}.*` tensor, training runs, and GGUF export refuses clearly."""

from __future__ import annotations

import json

import pytest
import torch

from mtpspec.drafters import make_drafter
from mtpspec.drafters.mtp import MTPDrafter
from mtpspec.engine import generate_tokens
from mtpspec.errors import ConfigError, ModelLoadError
from mtpspec.models.qwen35 import HybridConfig, HybridLM
from mtpspec.sampling import Sampler, SamplingParams
from mtpspec.train.pretrain import mtp_hiddens
from mtpspec.types import Verdict
from qwen35_tiny import randomize, write_tokenizer

V = 16  # a small vocabulary: drafts are accepted now and then


def config(n_layers: int, vocab: int = V) -> HybridConfig:
    return HybridConfig(
        vocab_size=vocab, hidden_size=32, num_layers=4, layer_types=("linear_attention", "full_attention") * 2,
        num_heads=4, num_kv_heads=2, head_dim=16, intermediate_size=48, max_seq_len=256, linear_key_head_dim=8,
        linear_value_head_dim=8, linear_num_key_heads=2, linear_num_value_heads=4, mtp_num_layers=n_layers,
    )


def model(n_layers: int, dtype=torch.float64, vocab: int = V) -> HybridLM:
    torch.manual_seed(0)
    m = HybridLM(config(n_layers, vocab))
    randomize(m, 5)
    return m.to(dtype).eval()


@pytest.fixture(scope="module", params=[2, 3])
def deep(request) -> HybridLM:
    return model(request.param)


def reference(m: HybridLM, seq: torch.Tensor, depth: int) -> list[torch.Tensor]:
    """From scratch over the whole sequence (context + drafts): [h^k (T-k, H) for k = 1..depth]."""
    with torch.inference_mode():
        h = m.forward_tokens(seq, m.new_cache()).hidden  # (T, H) the target's hiddens, fresh cache
        return [x[0] for x in mtp_hiddens(m.mtp, m.embed, h[None], seq[None], depth)]


# (D, accepted) per round: 0 accepted, all accepted, partial, depths growing and shrinking, a plain step (D = 0)
ROUNDS = [(4, 0), (2, 2), (3, 1), (1, 0), (4, 4), (0, 0), (5, 2), (1, 1), (3, 0), (4, 3), (2, 0), (6, 6), (3, 2)]


@pytest.mark.parametrize("fused", [True, False])
@torch.inference_mode()
def test_every_draft_step_equals_the_from_scratch_depths(deep, fused):
    """Forced acceptance after each round; each draft step's hidden and logits equal depth k of `mtp_hiddens`
    at the last target position, over context + this round's drafts, within 1e-10 of their scale (fp64)."""
    m = deep
    g = torch.Generator().manual_seed(1)
    context = torch.randint(0, V, (11,), generator=g)
    cache = m.new_cache()
    out = m.forward_tokens(context[:-1], cache)
    drafter = MTPDrafter(m, fused=fused)
    drafter.prefill(context, out, Sampler(SamplingParams()))
    for d, n in ROUNDS:
        draft = drafter.propose(context, d)
        assert draft.tokens.shape[0] == d
        L = context.shape[0]
        if d:
            ref = reference(m, torch.cat([context, draft.tokens[:-1]]), d)
            for k in range(1, d + 1):
                want, got = ref[k - 1][L - 2], drafter.depths.outs[k - 1][L - 2]  # (H,) depth k at the last target position
                scale = want.abs().max().item()
                assert (got - want).abs().max().item() <= 1e-10 * scale, f"depth {k} of {d}, round {(d, n)}"
                lw, lg = m.head(want[None])[0], m.head(got[None])[0]  # (V,)
                assert (lg - lw).abs().max().item() <= 1e-10 * lw.abs().max().item()
                assert draft.tokens[k - 1].item() == lw.argmax().item()
        start = cache.length
        verify = m.forward_tokens(torch.cat([context[-1:], draft.tokens]), cache)  # over [t_{L-1}, d1..dD]
        cache.crop(start + n + 1)
        nxt = (draft.tokens[n] + 1) % V if n < d else torch.tensor(3)  # a rejected draft is replaced by another token
        kept = torch.cat([draft.tokens[:n], nxt.reshape(1)])
        drafter.commit(Verdict(num_accepted=n, tokens=kept, num_drafted=d), verify)
        context = torch.cat([context, kept])
        for k, c in enumerate(drafter.depths.caches, 1):  # only entries with real inputs survive a commit
            assert c.length <= drafter.depths.known - k + 1
    assert len(drafter.depths.caches) == max(d for d, _ in ROUNDS)  # one cache per depth drafted


PROMPTS = [[3], [1, 4, 1, 5, 9, 2, 6], list(range(16)) + list(range(8))]


@pytest.fixture(scope="module")
def plain(deep) -> list[list[int]]:
    return [generate_tokens(deep, p, make_drafter("none", deep), 1, Sampler(SamplingParams()), 32).tokens for p in PROMPTS]


@pytest.mark.parametrize("k", [1, 2, 3, 4])
def test_greedy_identical_to_plain(deep, plain, k):
    for prompt, ref in zip(PROMPTS, plain):
        spec = generate_tokens(deep, prompt, make_drafter("mtp", deep), k, Sampler(SamplingParams()), 32).tokens
        assert spec == ref, f"k={k} differs on prompt {prompt}"


def test_sampling_runs_and_reproduces(deep):
    """Sampled drafts carry q (k, V); a seeded run reproduces."""
    params = SamplingParams(temperature=1.0)
    a, b = (generate_tokens(deep, [1, 2, 3], make_drafter("mtp", deep), 3, Sampler(params, 7), 30).tokens for _ in range(2))
    assert a == b and len(a) == 30


@torch.inference_mode()
def test_sampled_drafts_carry_each_depths_distribution(deep):
    """Sampling: q at step k is the sampler's transform of depth k's logits (so rejection sampling stays exact)."""
    sampler = Sampler(SamplingParams(temperature=0.8, top_k=8), 3)
    context = torch.tensor([1, 4, 1, 5, 9, 2, 6])
    d = MTPDrafter(deep)
    d.prefill(context, deep.forward_tokens(context[:-1], deep.new_cache()), sampler)
    draft = d.propose(context, 3)
    ref = reference(deep, torch.cat([context, draft.tokens[:-1]]), 3)
    for k in range(1, 4):
        want = sampler.probs(deep.head(ref[k - 1][context.shape[0] - 2][None])[0])  # (V,)
        assert (draft.q[k - 1] - want).abs().max().item() <= 1e-10
        assert want[draft.tokens[k - 1]] > 0


def test_batch_falls_back_to_each_sequence(deep):
    """propose_batch with multi-layer modules drafts each sequence as propose() does."""
    contexts = [torch.tensor([1, 4, 1, 5, 9]), torch.tensor([2, 7, 1, 8, 2, 8, 1, 8])]

    def ready():
        ds = []
        for c in contexts:
            d = MTPDrafter(deep)
            d.prefill(c, deep.forward_tokens(c[:-1], deep.new_cache()), Sampler(SamplingParams()))
            ds.append(d)
        return ds

    batched = MTPDrafter.propose_batch(ready(), contexts, [3, 2])
    alone = [d.propose(c, k) for d, c, k in zip(ready(), contexts, [3, 2])]
    assert [x.tokens.tolist() for x in batched] == [x.tokens.tolist() for x in alone]


def test_trees_are_refused(deep):
    with pytest.raises(ConfigError, match="one-layer MTP"):
        make_drafter("mtp", deep, tree=4)


def _mtp_tensors(m) -> dict[str, torch.Tensor]:
    return {k: v for k, v in m.state_dict().items() if k.startswith("mtp.")}


def test_checkpoint_round_trip_keeps_every_layer(tmp_path):
    from safetensors.torch import load_file, save_file

    from mtpspec.loading import load_checkpoint
    from mtpspec.loading.native import save_checkpoint

    m = model(2, torch.float32)
    save_checkpoint(m, None, tmp_path / "ck")
    back, _ = load_checkpoint(tmp_path / "ck", with_tokenizer=False)
    want, got = _mtp_tensors(m), _mtp_tensors(back)
    assert back.config.mtp_num_layers == 2 and any(k.startswith("mtp.layers.1.") for k in want)
    assert want.keys() == got.keys() and all(torch.equal(want[k], got[k]) for k in want)
    sd = load_file(str(tmp_path / "ck" / "model.safetensors"))
    save_file({k: v for k, v in sd.items() if k != "mtp.layers.1.self_attn.q_proj.weight"}, str(tmp_path / "ck" / "model.safetensors"))
    with pytest.raises(ModelLoadError, match=r"mtp\.layers\.1\.self_attn\.q_proj\.weight"):
        load_checkpoint(tmp_path / "ck", with_tokenizer=False)
    save_file({k: v for k, v in sd.items() if not k.startswith("mtp.layers.1.")}, str(tmp_path / "ck" / "model.safetensors"))
    with pytest.raises(ModelLoadError, match=r"mtp\.layers\.1\.\*"):
        load_checkpoint(tmp_path / "ck", with_tokenizer=False)


def test_hf_export_round_trip_keeps_every_layer(tmp_path):
    from safetensors.torch import load_file, save_file

    from mtpspec.export import export_hf
    from mtpspec.loading.hf import load_hf_model

    m = model(3, torch.float32)
    export_hf(m, tmp_path / "hf")
    assert json.loads((tmp_path / "hf" / "config.json").read_text())["mtp_num_hidden_layers"] == 3
    back = load_hf_model(tmp_path / "hf", torch.float32)
    want, got = _mtp_tensors(m), _mtp_tensors(back)
    assert back.config.mtp_num_layers == 3 and any(k.startswith("mtp.layers.2.") for k in want)
    assert want.keys() == got.keys() and all(torch.equal(want[k], got[k]) for k in want)
    prompt = [1, 4, 1, 5, 9]
    assert (generate_tokens(back, prompt, make_drafter("mtp", back), 3, Sampler(SamplingParams()), 20).tokens
            == generate_tokens(m, prompt, make_drafter("none", m), 1, Sampler(SamplingParams()), 20).tokens)
    sd = load_file(str(tmp_path / "hf" / "model.safetensors"))
    save_file({k: v for k, v in sd.items() if not k.startswith("mtp.layers.1.")}, str(tmp_path / "hf" / "model.safetensors"))
    with pytest.raises(ModelLoadError, match=r"missing tensors: .*mtp\.layers\.1\.input_layernorm\.weight"):
        load_hf_model(tmp_path / "hf", torch.float32)  # config.json says 3 layers: the missing one is named


def test_gguf_export_refuses_more_than_one_layer(tmp_path):
    from mtpspec.export_gguf import export_gguf
    from mtpspec.loading.tokenizer_hf import HFTokenizer

    write_tokenizer(tmp_path, vocab=V)
    tok = HFTokenizer.load(tmp_path / "tokenizer.json")
    with pytest.raises(ConfigError, match=r"llama\.cpp runs one MTP \(nextn\) layer; this model's MTP module has 2"):
        export_gguf(model(2, torch.float32), tok, tmp_path / "m.gguf")
    assert not (tmp_path / "m.gguf").exists()


def test_pretrain_and_native_tuning_train_every_layer(tmp_path):
    """`mtpspec train pretrain --mtp-num-layers 2` and `mtpspec train mtp` on its output, a few steps each: both
    MTP layers change, the checkpoint keeps both, and the tuned model drafts losslessly."""
    from safetensors.torch import load_file

    import mtpspec
    from mtpspec.train import data as D
    from mtpspec.train.native_mtp import MTPTuneConfig, tune_native_mtp
    from mtpspec.train.pretrain import PretrainConfig, pretrain

    train, held = D.stdlib_files()
    small = [f for f in train if f.name in ("abc.py", "keyword.py", "colorsys.py")]
    cfg = PretrainConfig(
        out=str(tmp_path / "pre"), vocab_size=300, hidden_size=32, num_layers=4, num_heads=2, num_kv_heads=1, head_dim=16,
        intermediate_size=64, linear_key_heads=1, linear_value_heads=2, linear_head_dim=16, max_seq_len=256, seq_len=48,
        batch_size=2, steps=3, eval_every=3, save_every=3, eval_windows=2, warmup_steps=1, mtp_depth=3, mtp_num_layers=2,
        data_files=[str(p) for p in small], heldout_files=[str(held[0])],
    )
    with pytest.raises(ConfigError, match="mtp-num-layers"):
        pretrain(PretrainConfig(**{**cfg.__dict__, "mtp_depth": 1}), progress_bar=False)
    report = pretrain(cfg, progress_bar=False)
    assert set(report["heldout_loss"]) == {"next_token", "mtp_1", "mtp_2", "mtp_3"}
    src = tmp_path / "pre"
    assert json.loads((src / "mtpspec.json").read_text())["config"]["mtp_num_layers"] == 2
    prompts = tmp_path / "prompts.txt"
    prompts.write_text("\n".join(f"def f{i}(x):" for i in range(8)) + "\n")
    tune = MTPTuneConfig(out=str(tmp_path / "tuned"), prompts=str(prompts), heldout_prompts=1, train_prompts=6, gen_tokens=12,
                         depth=2, steps=3, batch_size=2, seq_len=16, eval_tokens=8)
    tuned = tune_native_mtp(src, tune, progress_bar=False)
    assert tuned["mtp_layers"] == 2 and tuned["mtp_layers_trained"] == [0, 1]
    assert tuned["heldout_greedy_after"]["identical_to_plain"]
    old, new = load_file(str(src / "model.safetensors")), load_file(str(tmp_path / "tuned" / "model.safetensors"))
    changed = {k for k in old if not torch.equal(old[k], new[k])}
    assert all(k.startswith("mtp.") for k in changed)
    for i in (0, 1):
        assert any(k.startswith(f"mtp.layers.{i}.") for k in changed), f"layer {i} was not trained"
    m = mtpspec.load(tmp_path / "tuned")
    ids = m.encode("def g(x):")
    assert m.generate(ids, drafter="mtp", k=3, max_new_tokens=12).tokens == m.generate(ids, max_new_tokens=12).tokens


def test_cli_takes_the_layer_count():
    from mtpspec.cli import build_parser

    args = build_parser().parse_args(["train", "pretrain", "--out", "x", "--mtp-depth", "3", "--mtp-num-layers", "2"])
    assert args.mtp_num_layers == 2 and args.mtp_depth == 3

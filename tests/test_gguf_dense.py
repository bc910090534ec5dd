"""Dense models from GGUF files (llama, qwen2, qwen3, gemma3): the file's function, and lossless speculation on it.

Tiny transformers models are written as GGUF files the way llama.cpp's converter writes them (its tensor names,
llama's q / k rows permuted to adjacent rotary pairs, Gemma's norms stored as 1 + w), then loaded back:
- dequantized in fp64, the model is transformers' function to 1e-10 of the logits' scale;
- kept in blocks (F32 widened, Q8_0 / Q5_0 multiplied in blocks), every drafter's greedy output equals the loaded
  model's own plain greedy output.
"""

from __future__ import annotations

import gguf
import numpy as np
import pytest
import torch

import mtpspec
from mtpspec.export_gguf import permute_rope_interleaved
from mtpspec.hf_reference import hf_fp64_copy
from mtpspec.loading.gguf_model import load_gguf_model
from mtpspec.models.batch import TreeLayout
from mtpspec.models.blocks import holds_blocks
from mtpspec.models.common import Linear
from qwen35_tiny import hf_model

Q = gguf.GGMLQuantizationType
ARCH = {"llama": "llama", "qwen2": "qwen2", "qwen3": "qwen3", "gemma3": "gemma3"}
_LEAF = {"input_layernorm": "attn_norm", "self_attn.q_proj": "attn_q", "self_attn.k_proj": "attn_k",
         "self_attn.v_proj": "attn_v", "self_attn.o_proj": "attn_output", "self_attn.q_norm": "attn_q_norm",
         "self_attn.k_norm": "attn_k_norm", "mlp.gate_proj": "ffn_gate", "mlp.up_proj": "ffn_up", "mlp.down_proj": "ffn_down"}


def _gguf_name(kind: str, name: str) -> str | None:
    """llama.cpp's name for a transformers parameter (None: not written, a tied head)."""
    stem, _, suffix = name.rpartition(".")
    top = {"model.embed_tokens": "token_embd", "model.norm": "output_norm", "lm_head": "output"}
    if stem in top:
        return f"{top[stem]}.{suffix}"
    _, _, layer, rest = stem.split(".", 3)
    leaf = dict(_LEAF)
    if kind == "gemma3":
        leaf |= {"post_attention_layernorm": "post_attention_norm", "pre_feedforward_layernorm": "ffn_norm",
                 "post_feedforward_layernorm": "post_ffw_norm"}
    else:
        leaf["post_attention_layernorm"] = "ffn_norm"
    return f"blk.{layer}.{leaf[rest]}.{suffix}"


def write_gguf_like_llamacpp(ref, kind: str, path, qtype=Q.F32):
    """transformers model `ref` as llama.cpp's converter writes it; matrices in `qtype` (vectors F32)."""
    c = ref.config
    a = ARCH[kind]
    w = gguf.GGUFWriter(str(path), a)
    w.add_uint32(f"{a}.block_count", c.num_hidden_layers)
    w.add_uint32(f"{a}.context_length", 256)
    w.add_uint32(f"{a}.embedding_length", c.hidden_size)
    w.add_uint32(f"{a}.feed_forward_length", c.intermediate_size)
    w.add_uint32(f"{a}.attention.head_count", c.num_attention_heads)
    w.add_uint32(f"{a}.attention.head_count_kv", c.num_key_value_heads)
    hd = getattr(c, "head_dim", None) or c.hidden_size // c.num_attention_heads
    w.add_uint32(f"{a}.attention.key_length", hd)
    w.add_uint32(f"{a}.attention.value_length", hd)
    w.add_float32(f"{a}.attention.layer_norm_rms_epsilon", c.rms_norm_eps)
    rope = c.rope_parameters if kind != "gemma3" else c.rope_parameters["full_attention"]
    w.add_float32(f"{a}.rope.freq_base", rope["rope_theta"])
    if kind == "gemma3":
        w.add_uint32(f"{a}.attention.sliding_window", c.sliding_window)
        w.add_uint32(f"{a}.attention.sliding_window_pattern", 3)  # layers 0, 1 slide, 2 is global (GEMMA3_KW)
    for name, t in ref.state_dict().items():
        if name == "lm_head.weight" and c.tie_word_embeddings:
            continue
        x = t.detach().float()
        if kind == "llama" and name.endswith(("q_proj.weight", "k_proj.weight")):
            heads = c.num_attention_heads if "q_proj" in name else c.num_key_value_heads
            x = permute_rope_interleaved(x, heads)
        if kind == "gemma3" and name.endswith("norm.weight"):
            x = x + 1.0  # the converter stores Gemma's (1 + w)
        x = np.ascontiguousarray(x.numpy())
        if x.ndim == 2 and qtype != Q.F32:
            w.add_tensor(_gguf_name(kind, name), gguf.quants.quantize(x, qtype), raw_dtype=qtype)
        else:
            w.add_tensor(_gguf_name(kind, name), x)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


KINDS = ["llama", "qwen2", "qwen3", "gemma3"]


def _qwen2():
    """Qwen2 with q / k / v biases and no sliding window (llama.cpp's qwen2 has none)."""
    import transformers as tf

    from qwen35_tiny import DENSE_KW, randomize

    torch.manual_seed(0)
    model = tf.Qwen2ForCausalLM(tf.Qwen2Config(**DENSE_KW))
    randomize(model, 0)
    return model.eval()


@pytest.fixture(scope="module", params=KINDS)
def written(request, tmp_path_factory):
    kind = request.param
    ref = _qwen2() if kind == "qwen2" else hf_model(kind, tie=kind == "gemma3")
    if kind == "gemma3":  # norms whose 1 + w is exact in fp32, as in Google's file: the stored 1 + w loses nothing
        with torch.no_grad():
            for name, p in ref.named_parameters():
                if name.endswith("norm.weight"):
                    p.copy_((p + 1.0) - 1.0)
    d = tmp_path_factory.mktemp(kind)
    return kind, ref, write_gguf_like_llamacpp(ref, kind, d / "f32.gguf"), write_gguf_like_llamacpp(ref, kind, d / "q8.gguf", Q.Q8_0)


def _ids(n: int, seed: int = 0) -> torch.Tensor:
    return torch.randint(0, 96, (n,), generator=torch.Generator().manual_seed(seed))


def test_fp64_equals_transformers(written):
    """Prefill, a step and a 5-token window (past Gemma's 8-token sliding window): 1e-10 of the logits' scale."""
    kind, ref, f32, _ = written
    ours = load_gguf_model(f32, dtype=torch.float64)
    twin = hf_fp64_copy(ref)
    ids = _ids(40)
    with torch.no_grad():
        want = twin(ids[None]).logits[0]
    cache = ours.new_cache()
    got = torch.cat([ours.forward_tokens(ids[a:b], cache).logits for a, b in ((0, 34), (34, 35), (35, 40))])
    assert ((got - want).abs().max() / want.abs().max()).item() < 1e-10, kind


def test_blocks_greedy_equals_transformers_fp32(written):
    """F32 weights kept as blocks (the fp32 panel kernel, row-invariant attention): transformers' greedy text."""
    kind, ref, f32, _ = written
    ours = load_gguf_model(f32)
    q_proj = ours.model.layers[0].self_attn.q_proj
    assert isinstance(q_proj, Linear) and holds_blocks(q_proj)
    ids = _ids(12, 1)
    with torch.no_grad():
        want = ref.generate(ids[None], attention_mask=torch.ones(1, 12, dtype=torch.long), max_new_tokens=30,
                            do_sample=False, pad_token_id=0, eos_token_id=None)[0, 12:]
    cache, got = ours.new_cache(), []
    out = ours.forward_tokens(ids, cache)
    for _ in range(30):
        got.append(int(out.logits[-1].argmax()))
        out = ours.forward_tokens(torch.tensor(got[-1:]), cache)
    assert got == want.tolist(), kind


TREE = TreeLayout.of(torch.tensor([-1, 0, 0, 1, -1, 4]))  # 6 nodes under the root: two branches, one of depth 3


def test_row_plan_is_the_grid_path_bitwise(written, monkeypatch):
    """One sequence's rows in order on the row kernels take the flat RowPlan path (norm + rotation in one call, tables
    shared by the layers), a token tree's rows too: each logit bitwise what the general (B, W) grid path computes, past
    Gemma's window too."""
    from mtpspec.models import forward

    kind, _, _, q8 = written
    module = load_gguf_model(q8)
    assert module.config.row_kernels
    ids = _ids(40, 2)
    windows = ((0, 12), (12, 17), (17, 18), (18, 40))

    def logits():
        cache = module.new_cache()
        out = [module.forward_tokens(ids[a:b], cache).logits for a, b in windows]
        return torch.cat(out + [module.forward_tokens(ids[:7], cache, tree=TREE).logits])  # a token tree past the window

    planned = logits()
    monkeypatch.setattr(forward.RowPlan, "of", staticmethod(lambda fb: None))
    assert torch.equal(planned, logits()), kind


def test_row_stack_is_the_row_plan_bitwise(written):
    """A dense stack on block weights runs all its layers in one kernel call (kernels/rowstack.cpp): each logit and each
    tapped layer input bitwise what the row path computes layer by layer, a token tree's rows too, past Gemma's window."""
    kind, _, _, q8 = written
    module = load_gguf_model(q8)
    ids = _ids(40, 3)
    windows = ((0, 12), (12, 13), (13, 18), (18, 40))

    def run():
        cache = module.new_cache()
        outs = [module.forward_tokens(ids[a:b], cache, taps=(0, 1)) for a, b in windows]
        outs.append(module.forward_tokens(ids[:7], cache, tree=TREE, taps=(0, 1)))  # a token tree past the window
        return [o.logits for o in outs] + [o.layer_inputs[i] for o in outs for i in (0, 1)]

    stacked = run()
    assert (module.row_stack is not False) == (kind != "qwen2"), kind  # Qwen2's q / k / v biases keep the Python path
    module.row_stack = False
    assert all(torch.equal(a, b) for a, b in zip(stacked, run())), kind


@pytest.mark.parametrize("mode", ["inference", "grad enabled"])  # frozen weights: the row kernels either way
def test_a_batch_on_the_row_kernels_is_each_sequence_alone_bitwise(written, monkeypatch, mode):
    """A batch of sequences' chains takes the flat row path (the row stack where the layers fit), each row written at
    its own slot: every sequence's logits bitwise its own forward alone, and what the layer-by-layer row path and the
    (B, W) grid path (shorter sequences padded) compute, past Gemma's window too."""
    from mtpspec.batching import SlotKV, forward_batch
    from mtpspec.models import forward

    kind, _, _, q8 = written
    module = load_gguf_model(q8)
    ids = _ids(40, 4)
    prompts, steps = (30, 6, 21), ((1, 3, 2), (4, 1, 2))

    def alone():
        out = []
        for b, n in enumerate(prompts):
            cache = module.new_cache()
            module.forward_tokens(ids[:n], cache)
            out.append([module.forward_tokens(ids[n + sum(s[b] for s in steps[:i]) :][: w[b]], cache).logits
                        for i, w in enumerate(steps)])
        return [out[b][i] for i in range(len(steps)) for b in range(len(prompts))]

    def batched():
        caches = [module.new_cache() for _ in prompts]
        for c, n in zip(caches, prompts):
            module.forward_tokens(ids[:n], c)
        storage = SlotKV(caches[0].kv, len(prompts))
        for i, c in enumerate(caches):
            storage.bind(c.kv, i)
        outs, at = [], list(prompts)
        for w in steps:
            outs += forward_batch(module, storage, caches, [ids[a : a + n] for a, n in zip(at, w)])
            at = [a + n for a, n in zip(at, w)]
        return [o.logits for o in outs]

    ctx = torch.inference_mode() if mode == "inference" else torch.enable_grad()
    with ctx:
        want = alone()
        assert all(torch.equal(a, b) for a, b in zip(want, batched())), kind
        module.row_stack = False
        assert all(torch.equal(a, b) for a, b in zip(want, batched())), kind
        monkeypatch.setattr(forward.RowPlan, "of", staticmethod(lambda fb: None))
        assert all(torch.equal(a, b) for a, b in zip(want, batched())), kind


@pytest.mark.parametrize("zero_centred", [False, True])
@pytest.mark.parametrize("rot", [64, 32])
@pytest.mark.parametrize("normed", [True, False])
def test_norm_rope_is_the_norm_then_rope_bitwise(zero_centred, rot, normed):
    """attention.norm_rope on a column slice of a fused q|k|v product (partial rotation too): bitwise RMSNorm's row
    kernel then rope, each op rounded as torch rounds it."""
    from mtpspec.models.attention import norm_rope, rope
    from mtpspec.models.common import RMSNorm

    g = torch.Generator().manual_seed(rot)
    n, h, d = 5, 3, 64
    x = (torch.randn(n, 3 * h * d, generator=g) * 3)[:, h * d : 2 * h * d].view(n, h, d)
    norm = RMSNorm(d, 1e-6, zero_centred, row_kernel=True) if normed else None
    if normed:
        norm.weight.data = torch.randn(d, generator=g)
    cos, sin = torch.randn(n, rot, generator=g), torch.randn(n, rot, generator=g)
    with torch.no_grad():
        want = rope((x if norm is None else norm(x)).transpose(0, 1), cos, sin, rot).transpose(0, 1)
        assert torch.equal(norm_rope(x, norm, cos, sin), want)


@pytest.mark.parametrize("drafter,extra", [("ngram", {}), ("suffix", {}), ("ngram", {"tree": 5}), ("lookahead", {})])
def test_drafting_is_lossless_on_quantized_blocks(written, drafter, extra):
    """Q8_0 blocks, 8-bit activations: every drafter's greedy output is the loaded model's own plain greedy output."""
    from mtpspec.api import Model
    from qwen35_tiny import write_tokenizer

    kind, _, _, q8 = written
    module = load_gguf_model(q8)
    tok_dir = q8.parent / "tok"
    tok_dir.mkdir(exist_ok=True)
    write_tokenizer(tok_dir)
    from mtpspec.loading.tokenizer_hf import load_hf_tokenizer

    model = Model(module=module, tokenizer=load_hf_tokenizer(tok_dir, None), path=str(q8), threads=1)
    prompt = [3, 5, 7, 9, 11, 3, 5, 7, 9, 4, 8, 15, 16, 23]
    plain = model.generate(prompt, drafter="none", max_new_tokens=48).tokens
    res = model.generate(prompt, drafter=drafter, k=4, max_new_tokens=48, **extra)
    assert res.tokens == plain, (kind, drafter, extra)
    batch = model.generate_batch([prompt, prompt[:7], prompt[3:]], drafter=drafter, k=3, max_new_tokens=24, **extra)
    assert batch[0].tokens == plain[:24]


def test_llama_export_loads_back(tmp_path):
    """`mtpspec export --format gguf` of a llama2.c model loads back with the same greedy text (q / k rows put back)."""
    from mtpspec.export_gguf import export_gguf
    from mtpspec.loading import assets_dir

    a = assets_dir() / "models"
    model = mtpspec.load(str(a / "stories260K.bin"), tokenizer=str(a / "tok512.bin"))
    path = export_gguf(model.module, model.tokenizer, tmp_path / "stories.gguf")
    back = mtpspec.load(str(path))
    want = model.generate("Once upon a time", drafter="none", max_new_tokens=48)
    got = back.generate("Once upon a time", drafter="none", max_new_tokens=48)
    assert got.text == want.text and got.tokens == want.tokens


def test_a_kept_prefix_is_bitwise_a_prefill(written):
    """prefix.PrefixStore: a later prompt's longest kept prefix is copied, not prefilled, and the KV it ends with, then
    the text, are bitwise a fresh prefill's: a chat's next turn (the whole earlier context), a shared head of 20
    positions, a prompt sent again (nothing left to prefill), past Gemma's window; nothing under MIN_REUSE; the budget
    drops the least recently used."""
    from mtpspec.drafters import make_drafter
    from mtpspec.engine import Engine
    from mtpspec.prefix import MIN_REUSE, PrefixStore
    from mtpspec.sampling import Sampler, SamplingParams

    kind, _, _, q8 = written
    module = load_gguf_model(q8)
    ids = _ids(80, 5).tolist()

    def run(engine, prompt, **kw):
        sid = engine.add(prompt, make_drafter("ngram", module), Sampler(SamplingParams()), 3, 12, **kw)
        return engine.run()[sid]

    kept = Engine(module, max_batch=2, prefixes=PrefixStore(4096))
    first = run(kept, ids[:30])
    turn = ids[:30] + first.tokens + ids[30:36]  # the next turn: everything before, then new text
    head = ids[:20] + ids[50:70]  # a shared head of 20 positions
    short = ids[:MIN_REUSE - 1] + ids[60:70]
    for prompt, cached in ((turn, 30 + len(first.tokens) - 1), (head, 20), (short, 0), (ids[:30], 29)):  # the last: all of it
        got = run(kept, prompt)
        want = run(Engine(module, max_batch=2), prompt)
        assert got.stats.cached_tokens == cached and want.stats.cached_tokens == 0, kind
        assert got.tokens == want.tokens, kind
    logprobs = run(kept, turn, prompt_logprobs=1)  # something reads the prefill's rows: prefilled whole
    assert logprobs.stats.cached_tokens == 0
    for attr in ("prefill_hidden", "prefill_logits"):  # a drafter that reads the prompt's hidden states or logits too
        reader = make_drafter("ngram", module)
        setattr(reader, attr, True)
        sid = kept.add(turn, reader, Sampler(SamplingParams()), 3, 12)
        assert kept.run()[sid].stats.cached_tokens == 0, attr

    store, fresh = PrefixStore(4096), module.new_cache()
    module.forward_tokens(torch.tensor(turn[:-1]), fresh, prefill=True, logits=False)
    store.keep(torch.tensor(turn), fresh)
    copied = module.new_cache()
    assert store.reuse(torch.tensor(turn + [1]), copied) == len(turn) - 1
    assert all(k.shape[3] == v.shape[3] == t.shape[0] for t, k, v in store.entries.values())  # the kept positions only
    n = copied.length
    assert n == fresh.length and torch.equal(copied.k[:, :, :, :n], fresh.k[:, :, :, :n]) and torch.equal(copied.v[:, :, :, :n], fresh.v[:, :, :, :n])
    small = PrefixStore(50)
    small.keep(torch.tensor(ids[:30]), fresh)
    small.keep(torch.tensor(ids[40:70]), fresh)  # 60 positions: the first is dropped
    assert small.positions == 30 and small.reuse(torch.tensor(ids[:30]), module.new_cache()) == 0
    small.keep(torch.tensor(ids[40:75]), fresh)  # a longer context of the same tokens replaces it
    assert small.positions == 35 and len(small.entries) == 1


def test_no_prefix_is_kept_where_a_copy_is_not_a_prefill(assets):
    """A dense fp32 model's prefill runs F.linear over the prompt's rows (not row-invariant): nothing is kept. A store
    of no positions, or something else passed as one, is a one-line error."""
    from mtpspec.engine import Engine

    model = mtpspec.load(str(assets / "models" / "stories260K.bin"), str(assets / "models" / "tok512.bin"))
    from mtpspec.prefix import PrefixStore

    assert Engine(model.module, prefixes=PrefixStore(4096)).prefixes is None
    for bad, words in ((lambda: PrefixStore(0), "integer >= 1 of positions"), (lambda: PrefixStore(2.5), "integer >= 1"),
                       (lambda: model.generate("x", prefixes={}), "prefixes must be a mtpspec.PrefixStore, got dict")):
        with pytest.raises(mtpspec.ConfigError, match=words):
            bad()

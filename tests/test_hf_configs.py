"""config.json fields that change the function: implemented (Llama 3 / linear / dynamic rope scaling, sliding
windows of Mistral / Qwen2 / Qwen3, Llama / Qwen3 biases) and proven against transformers 5.24, or refused by
name. Plus the loader's errors for the near misses a user makes (a GPT-2 directory, one file of a checkpoint).
"""

from __future__ import annotations

import json
import math

import pytest
import torch

from mtpspec.cli import main
from mtpspec.errors import ModelLoadError
from mtpspec.hf_reference import float32_ops, hf_fp64_copy
from mtpspec.loading import load_checkpoint
from mtpspec.loading.hf import config_from_hf
from mtpspec.models.attention import attend, scale_inv_freq
from mtpspec.models.batch import ForwardBatch
from qwen35_tiny import EXTRA_KINDS, copy_ckpt, edit_config, save_hf

# -- the maths, in float64 / bit for bit ---------------------------------------------------------


def _reference_attention(q, k, v, start, window):
    """Softmax attention with an explicit mask (float64): query start+i sees keys j, start+i-window < j <= start+i."""
    t, s = q.shape[2], k.shape[2]
    rep = q.shape[1] // k.shape[1]
    k, v = k.repeat_interleave(rep, 1), v.repeat_interleave(rep, 1)
    pos_q = torch.arange(start, start + t)[:, None]
    pos_k = torch.arange(s)[None, :]
    ok = (pos_k <= pos_q) & ((pos_k > pos_q - window) if window else True)
    scores = (q @ k.transpose(-1, -2)) / math.sqrt(q.shape[-1])
    return torch.softmax(scores.masked_fill(~ok, -math.inf), -1) @ v


@pytest.mark.parametrize("window", [0, 1, 3, 8, 100])
@pytest.mark.parametrize("start,t", [(0, 1), (0, 12), (5, 1), (5, 7), (20, 1), (20, 9)])
@pytest.mark.parametrize("tensors", [False, True])
def test_sliding_window_attention_float64(window, start, t, tensors):
    """attention.attend with the rows at consecutive positions (eager) and with positions as tensors only (batches,
    compiled graphs: the whole buffer under a mask) against the definition."""
    g = torch.Generator().manual_seed(start * 100 + t)
    q = torch.randn(1, 4, t, 8, generator=g, dtype=torch.float64)
    k = torch.randn(1, 2, start + t, 8, generator=g, dtype=torch.float64)
    v = torch.randn(1, 2, start + t, 8, generator=g, dtype=torch.float64)
    want = _reference_attention(q, k, v, start, window)
    fb = ForwardBatch(torch.arange(start, start + t)[None]) if tensors else ForwardBatch.one(start, t)
    got = attend(q, k, v, fb, window)
    # float64: the same sums in another order differ by a few ulps of values of size ~1
    assert torch.allclose(got, want, rtol=0, atol=1e-12), (got - want).abs().max()


@torch.inference_mode()
def test_exact_rows_equal_one_token_steps_with_a_window():
    """exact mode with sliding-window layers: every row of a multi-position forward is bit-identical to the one-token
    step at its position."""
    from mtpspec.models.dense import DenseConfig, DenseLM

    torch.manual_seed(0)
    m = DenseLM(DenseConfig(vocab_size=64, hidden_size=32, num_layers=2, num_heads=4, num_kv_heads=2, intermediate_size=40,
                            max_seq_len=64, layer_windows=(8, 0))).eval()
    ids = torch.randint(0, 64, (26,), generator=torch.Generator().manual_seed(1))
    a, b = m.new_cache(), m.new_cache()
    for c in (a, b):
        m.forward_tokens(ids[:20], c, prefill=True)
    rows = m.forward_tokens(ids[20:], a, exact=True).logits  # (6, V)
    steps = torch.cat([m.forward_tokens(ids[20 + i : 21 + i], b).logits for i in range(6)])
    assert torch.equal(rows, steps)


@pytest.mark.parametrize("rope", [
    {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0, "original_max_position_embeddings": 8192},
    {"rope_type": "llama3", "factor": 32.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0, "original_max_position_embeddings": 8192},
    {"rope_type": "linear", "factor": 4.0},
], ids=["llama3.1", "llama3.2", "linear"])
def test_rope_scaling_matches_transformers_bit_for_bit(rope):
    """Llama 3.1's real shape (head_dim 128, theta 5e5): every band (kept, blended, stretched) is populated."""
    import transformers as tf
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    cfg = tf.LlamaConfig(hidden_size=4096, num_attention_heads=32, max_position_embeddings=131072,
                         rope_parameters={**rope, "rope_theta": 500000.0})
    want, attention_factor = ROPE_INIT_FUNCTIONS[rope["rope_type"]](cfg, "cpu")
    base = 1.0 / (500000.0 ** (torch.arange(0, 128, 2, dtype=torch.int64).float() / 128))
    got = scale_inv_freq(base, rope)
    assert attention_factor == 1.0 and torch.equal(got, want)
    if rope["rope_type"] == "llama3":
        wavelen = 2 * math.pi / base
        assert (wavelen < 8192 / 4).any() and (wavelen > 8192).any() and ((wavelen > 2048) & (wavelen < 8192)).any()


# -- parity with transformers on tiny random checkpoints ----------------------------------------

KINDS = [*EXTRA_KINDS, "gemma3"]  # llama3, llama-linear, llama-dynamic, llama-bias, mistral, qwen2, qwen3-swa, gemma3
# fp32 tolerance, relative to the largest |logit|: measured 0 for the Llama variants (same kernels, same order)
# and <= 2.6e-7 for the windowed ones (SDPA with a mask vs transformers' mask: a few fp32 ulps, eps 1.2e-7,
# through 2-3 layers). 1e-5 leaves 40x headroom and is still 1000x below what ignoring the feature costs
# (asserted below: > 1e-2 relative).
REL_TOL = 1e-5


@pytest.fixture(scope="module", params=KINDS)
def ckpt(request, tmp_path_factory):
    kind = request.param
    d = tmp_path_factory.mktemp(kind)
    ref = save_hf(kind, d, mtp=False)
    ours, tok = load_checkpoint(d, dtype="fp32")
    return kind, d, ref, ours, tok


def _steps(model_step, g):
    """Logits of a 40-token prefill then decode steps of 1, 1, 5, 1, 3 tokens (positions 0..50 > window 8)."""
    prompt = torch.randint(0, 96, (40,), generator=g)
    out = [model_step(prompt)]
    for t in (1, 1, 5, 1, 3):
        out.append(model_step(torch.randint(0, 96, (t,), generator=g)))
    return torch.cat(out)


def _ours(model):
    cache = model.new_cache()
    return lambda ids: model.forward_tokens(ids, cache).logits


def _theirs(ref):
    state = {"cache": None}

    def step(ids):
        with torch.no_grad():
            out = ref(ids[None], cache=state["cache"], use_cache=True)
        state["cache"] = out.past_key_values if getattr(out, "past_key_values", None) is not None else out.cache
        return out.logits[0]

    return step


def test_logits_match_transformers(ckpt):
    kind, d, ref, ours, _ = ckpt
    want = _steps(_theirs(ref), torch.Generator().manual_seed(0))
    got = _steps(_ours(ours), torch.Generator().manual_seed(0))
    scale = want.abs().max().item()
    err = (got - want).abs().max().item()
    assert err <= REL_TOL * scale, f"{kind}: max |diff| {err:.3g} vs logits up to {scale:.3g}"
    # the feature matters: the same checkpoint without it is far off (so the check above can fail)
    plain = dict(ours.config.__dict__, rope_scaling=None, layer_windows=())
    if kind in ("llama-dynamic", "llama-bias"):
        return  # dynamic is plain RoPE inside the context (asserted by the parity above); biases cannot be dropped
    from mtpspec.loading.hf import build_empty

    stripped = build_empty(type(ours.config)(**plain), torch.float32)
    stripped.load_state_dict(ours.state_dict())
    off = (_steps(_ours(stripped), torch.Generator().manual_seed(0)) - want).abs().max().item()
    assert off > 1e-2 * scale, f"{kind}: without the feature only {off:.3g} off"


def test_logits_match_transformers_in_float64(ckpt):
    """The proof: in float64 (transformers' fp64 twin, mtpspec.hf_reference: its rotary frequencies, scaled
    ones included, computed by its own functions in float64) the two agree to 1e-9 of the logits' scale.
    Measured <= 8e-16 for every kind, so summation order cannot decide it; the same checkpoint without its
    feature is > 1e-2 off (asserted above). The twin's rope tables take no float32 step (asserted here)."""
    kind, d, ref, _, _ = ckpt
    ref = hf_fp64_copy(ref)
    for m in ref.modules():
        if hasattr(m, "original_inv_freq"):
            assert float32_ops(type(m), config=m.config) == [], kind
            assert torch.equal(m.inv_freq, type(m)(config=m.config).inv_freq) and m.inv_freq.dtype == torch.float64
    ours, _ = load_checkpoint(d, dtype=torch.float64, with_tokenizer=False)
    want = _steps(_theirs(ref), torch.Generator().manual_seed(0))
    got = _steps(_ours(ours), torch.Generator().manual_seed(0))
    assert got.dtype == want.dtype == torch.float64
    err, scale = (got - want).abs().max().item(), want.abs().max().item()
    assert err <= 1e-9 * scale, f"{kind}: max |diff| {err:.3g} vs logits up to {scale:.3g}"


def _generate(capsys, d, *extra):
    args = ["generate", "w3 w5 w7 w9 w11", "--model", str(d), "--max-new-tokens", "40", "--json", *extra]
    assert main(args) == 0
    return json.loads(capsys.readouterr().out)


def test_greedy_equals_transformers_and_drafting_is_lossless(ckpt, capsys):
    """45 positions > window 8; n-gram drafting verifies windows of up to 5 tokens at a time."""
    kind, d, ref, _, tok = ckpt
    ids = torch.tensor([tok.encode("w3 w5 w7 w9 w11")])
    with torch.no_grad():
        hf = ref.generate(ids, max_new_tokens=40, do_sample=False, pad_token_id=0, eos_token_id=None)
    plain = _generate(capsys, d, "--drafter", "none")["tokens"]
    assert plain == hf[0, ids.shape[1]:].tolist(), kind
    for mode in ([], ["--exact"]):
        res = _generate(capsys, d, "--drafter", "ngram", "--k", "4", *mode)
        assert res["tokens"] == plain and res["stats"]["draft_tokens"] > 0, mode  # drafts were verified (and rolled back)


def test_saved_and_exported_checkpoints_keep_the_features(ckpt, tmp_path):
    """The project's own format (training, the demo) and `mtpspec export` carry rope scaling and windows
    along: the reloaded model computes the same function, or export refuses what Llama cannot say."""
    from mtpspec.errors import ConfigError
    from mtpspec.export import export_hf
    from mtpspec.loading.native import save_checkpoint

    kind, _, _, ours, tok = ckpt
    prompt = torch.randint(0, 96, (40,), generator=torch.Generator().manual_seed(3))
    want = ours.forward_tokens(prompt, ours.new_cache()).logits
    native, _ = load_checkpoint(save_checkpoint(ours, tok, tmp_path / "native"))
    assert native.config.rope_scaling == ours.config.rope_scaling
    assert tuple(native.config.layer_windows) == ours.config.layer_windows
    assert torch.equal(native.forward_tokens(prompt, native.new_cache()).logits, want)
    if kind.startswith("llama") and kind != "llama-bias":
        exported, _ = load_checkpoint(export_hf(ours, tmp_path / "hf", tokenizer=tok))
        assert exported.config.rope_scaling == ours.config.rope_scaling
        assert torch.equal(exported.forward_tokens(prompt, exported.new_cache()).logits, want)
    else:
        with pytest.raises(ConfigError, match="plain Llama"):
            export_hf(ours, tmp_path / "hf", tokenizer=tok)


# -- what config.json says, field by field --------------------------------------------------------

LLAMA = {"model_type": "llama", "vocab_size": 96, "hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 2,
         "num_attention_heads": 4, "num_key_value_heads": 2, "max_position_embeddings": 256}
QWEN3 = {**LLAMA, "model_type": "qwen3", "head_dim": 16}
QWEN35 = {**LLAMA, "model_type": "qwen3_5_text", "num_hidden_layers": 4, "head_dim": 16, "linear_key_head_dim": 8,
          "linear_value_head_dim": 8, "linear_num_key_heads": 2, "linear_num_value_heads": 4}
GEMMA3 = {**LLAMA, "model_type": "gemma3_text", "num_hidden_layers": 3, "head_dim": 16, "query_pre_attn_scalar": 16,
          "sliding_window": 8}
NEXT = {**QWEN35, "model_type": "qwen3_next", "num_experts": 4, "num_experts_per_tok": 2, "moe_intermediate_size": 16,
        "shared_expert_intermediate_size": 24}


def _cfg(base, **changes):
    return config_from_hf({**base, **changes}, "ckpt", mtp_layers=0)[0]


def _refused(base, **changes) -> str:
    with pytest.raises(ModelLoadError) as e:
        _cfg(base, **changes)
    msg = str(e.value)
    assert "\n" not in msg and msg.startswith("ckpt: ")
    return msg


LLAMA3 = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0}
REFUSED = [
    (LLAMA, {"rope_parameters": {"rope_type": "yarn", "factor": 4.0}}, "rope_type 'yarn' is not supported"),
    (LLAMA, {"rope_scaling": {"type": "longrope", "short_factor": [1.0], "long_factor": [2.0]}}, "rope_type 'longrope'"),
    (LLAMA, {"rope_parameters": {"rope_type": "proportional", "factor": 2.0}}, "rope_type 'proportional'"),
    (LLAMA, {"rope_parameters": {"rope_type": "default", "factor": 4.0}}, "rope_parameters.factor = 4.0"),
    (LLAMA, {"rope_parameters": {**LLAMA3, "attention_factor": 2.0}}, "rope_parameters.attention_factor"),
    (LLAMA, {"rope_parameters": {"rope_type": "llama3", "factor": 8.0, "high_freq_factor": 4.0}}, "rope_parameters.low_freq_factor"),
    (LLAMA, {"rope_parameters": {**LLAMA3, "high_freq_factor": 1.0}}, "must be greater than low_freq_factor"),
    (LLAMA, {"rope_parameters": LLAMA3, "original_max_position_embeddings": 64}, "belongs in rope_parameters"),
    (LLAMA, {"rope_parameters": {"rope_type": "mrope", "mrope_section": [1, 1, 2]}}, "rope_type 'mrope'"),
    (QWEN35, {"rope_parameters": {**LLAMA3, "rope_theta": 1e4}}, "rope_type 'llama3' is not supported for qwen3_5_text"),
    (LLAMA, {"partial_rotary_factor": 0.5}, "partial_rotary_factor 0.5 is not supported"),
    (LLAMA, {"rope_interleaved": True}, "'rope_interleaved' = true is not implemented"),
    (LLAMA, {"attn_logit_softcapping": 50.0}, "'attn_logit_softcapping' = 50.0"),
    (LLAMA, {"final_logit_softcapping": 30.0}, "'final_logit_softcapping' = 30.0"),
    (LLAMA, {"use_qk_norm": True}, "'use_qk_norm'"),
    (LLAMA, {"query_pre_attn_scalar": 256}, "'query_pre_attn_scalar'"),
    (LLAMA, {"hidden_act": "gelu_pytorch_tanh"}, "hidden_act 'gelu_pytorch_tanh' is not supported"),
    (LLAMA, {"sliding_window": 4096}, "'sliding_window' = 4096 is not implemented for model type 'llama'"),
    (LLAMA, {"layer_types": ["sliding_attention", "full_attention"]}, "'layer_types'"),
    (LLAMA, {"quantization_config": {"quant_method": "gptq"}}, "quantized checkpoints"),
    (LLAMA, {"num_key_value_heads": 3}, "not a multiple of num_key_value_heads"),
    (LLAMA, {"head_dim": 7}, "rotary dimension"),
    (LLAMA, {"hidden_size": "32"}, "'hidden_size' must be an integer"),
    (LLAMA, {"num_hidden_layers": 10**12}, "'num_hidden_layers' must be an integer from 1 to 10000"),
    ({"model_type": "llava", "text_config": LLAMA}, {}, "model type 'llava' is not supported"),
    (LLAMA, {"rms_norm_eps": -1}, "'rms_norm_eps' must be a positive number"),
    (LLAMA, {"tie_word_embeddings": "yes"}, "'tie_word_embeddings' must be true or false"),
    (QWEN3, {"layer_types": ["sliding_attention", "full_attention"]}, "the window is off"),
    (QWEN3, {"use_sliding_window": True, "sliding_window": 8, "layer_types": ["full_attention"]}, "one type per layer"),
    (QWEN3, {"use_sliding_window": True, "sliding_window": 8, "layer_types": ["chunked_attention"] * 2}, "'chunked_attention'"),
    ({**LLAMA, "model_type": "mistral"}, {"layer_types": ["full_attention"] * 2}, "'layer_types'"),
    (QWEN35, {"sliding_window": 8}, "'sliding_window'"),
    (QWEN35, {"num_experts": 8}, "'num_experts' = 8 is not implemented for model type 'qwen3_5_text'"),
    (QWEN35, {"attn_output_gate": False}, "attn_output_gate false"),
    (QWEN35, {"mtp_use_dedicated_embeddings": True}, "mtp_use_dedicated_embeddings"),
    (NEXT, {"routed_scaling_factor": 2.5}, "'routed_scaling_factor'"),
    (GEMMA3, {"final_logit_softcapping": 30.0}, "'final_logit_softcapping' = 30.0 is not implemented for gemma3_text"),
    (GEMMA3, {"attn_logit_softcapping": 50.0}, "'attn_logit_softcapping' = 50.0"),
    (GEMMA3, {"use_bidirectional_attention": True}, "'use_bidirectional_attention'"),
    (GEMMA3, {"query_pre_attn_scalar": 256}, "query_pre_attn_scalar 256 != head_dim 16"),
    (GEMMA3, {"hidden_activation": "silu"}, "hidden_activation 'silu' is not supported"),
    (GEMMA3, {"layer_types": ["full_attention"]}, "once per layer (3)"),
    (GEMMA3, {"rope_parameters": {"full_attention": {"rope_type": "default", "rope_theta": 1e6},
                                  "sliding_attention": {"rope_type": "linear", "factor": 2.0}}}, "only plain RoPE"),
    (GEMMA3, {"rope_parameters": {"chunked_attention": {"rope_type": "default"}}}, "rope_parameters.chunked_attention"),
    (NEXT, {"scoring_func": "sigmoid"}, "'scoring_func'"),
    (NEXT, {"num_experts_per_tok": 8}, "exceeds num_experts"),
]


@pytest.mark.parametrize("base,changes,needle", REFUSED, ids=[f"{b['model_type']}:{next(iter(c), '')}" for b, c, _ in REFUSED])
def test_function_changing_fields_are_refused_by_name(base, changes, needle):
    assert needle in _refused(base, **changes)


def test_fields_that_load_today_still_load():
    """What checkpoints in the wild set (Llama 3.1, Mistral v0.1, Qwen2.5, Qwen3, SmolLM2, Gemma 3), and transformers' own to_dict()."""
    import transformers as tf

    # google/gemma-3-270m's config.json (older field names: rope_theta, rope_local_base_freq, sliding_window_pattern)
    gemma = _cfg({**GEMMA3, "num_hidden_layers": 18, "head_dim": 256, "query_pre_attn_scalar": 256}, rope_theta=1_000_000.0,
                 rope_local_base_freq=10_000.0, rope_scaling=None, sliding_window=512, sliding_window_pattern=6,
                 _sliding_window_pattern=6, hidden_activation="gelu_pytorch_tanh", final_logit_softcapping=None,
                 attn_logit_softcapping=None, use_bidirectional_attention=False, attention_bias=False, pad_token_id=0)
    assert gemma.layer_windows == ((512,) * 5 + (0,)) * 3 and gemma.tie_embeddings
    assert (gemma.rope_theta, gemma.rope_local_theta) == (1_000_000.0, 10_000.0) and gemma.sandwich_norms

    llama31 = _cfg(LLAMA, rope_scaling={**LLAMA3, "original_max_position_embeddings": 64}, rope_theta=500000.0,
                   pretraining_tp=1, mlp_bias=False, attention_bias=False, torch_dtype="bfloat16", is_llama_config=True,
                   rope_interleaved=False, id2label={"0": "LABEL_0"}, temperature=0.6, top_p=0.9)
    assert llama31.rope_scaling["rope_type"] == "llama3" and llama31.rope_theta == 500000.0
    qwen25 = _cfg({**LLAMA, "model_type": "qwen2"}, use_sliding_window=False, sliding_window=131072, max_window_layers=28,
                  use_mrope=False, rope_scaling=None)
    assert qwen25.layer_windows == () and qwen25.attention_bias and not qwen25.o_proj_bias
    assert _cfg(QWEN3, attention_bias=True).o_proj_bias and _cfg(LLAMA, mlp_bias=True).mlp_bias
    for cls in (tf.LlamaConfig, tf.MistralConfig, tf.Qwen2Config, tf.Qwen3Config, tf.Qwen3_5TextConfig, tf.Qwen3NextConfig):
        small = dict(vocab_size=96, hidden_size=32, intermediate_size=64, num_hidden_layers=4, num_attention_heads=4,
                     num_key_value_heads=2, head_dim=8)
        config_from_hf(cls(**small).to_dict(), "ckpt", mtp_layers=0)
    config_from_hf(tf.Gemma3TextConfig(**small, query_pre_attn_scalar=8).to_dict(), "ckpt", mtp_layers=0)


WIDE = {**LLAMA, "hidden_size": 256, "num_attention_heads": 32}  # the default kv heads (8, 32) must divide the heads


@pytest.mark.parametrize("base,absent", [
    ({**WIDE, "model_type": "mistral"}, ["num_key_value_heads", "sliding_window"]),
    ({**WIDE, "model_type": "qwen2", "num_hidden_layers": 30, "use_sliding_window": True},
     ["num_key_value_heads", "sliding_window", "max_window_layers"]),
    ({**QWEN3, "num_hidden_layers": 30, "use_sliding_window": True, "sliding_window": 8}, ["head_dim", "max_window_layers"]),
    (QWEN35, ["head_dim", "num_key_value_heads"]),
    ({**NEXT, "num_attention_heads": 16}, ["head_dim", "num_key_value_heads", "num_experts", "num_experts_per_tok"]),
], ids=["mistral", "qwen2", "qwen3", "qwen3_5", "qwen3_next"])
def test_absent_fields_take_transformers_defaults(base, absent):
    """A field config.json leaves out means what transformers 5.24's config class says, not what we would guess."""
    import transformers as tf

    cfg = {k: v for k, v in base.items() if k not in absent}
    theirs = tf.AutoConfig.for_model(**cfg)
    ours = _cfg(cfg)
    assert ours.num_kv_heads == theirs.num_key_value_heads
    assert (ours.hd if hasattr(ours, "hd") else ours.head_dim) == (getattr(theirs, "head_dim", None) or theirs.hidden_size // theirs.num_attention_heads)
    if hasattr(ours, "layer_windows"):
        types = getattr(theirs, "layer_types", None) or ["sliding_attention" if theirs.sliding_window else "full_attention"] * theirs.num_hidden_layers
        want = tuple(theirs.sliding_window if t == "sliding_attention" else 0 for t in types)
        assert (ours.layer_windows or (0,) * len(types)) == want
    else:
        assert ours.partial_rotary_factor == theirs.rope_parameters["partial_rotary_factor"] == 0.25
        if cfg["model_type"] == "qwen3_next":
            assert (ours.num_experts, ours.num_experts_per_tok) == (theirs.num_experts, theirs.num_experts_per_tok)


# -- near misses: one clear line, never a misleading one -------------------------------------------


@pytest.fixture(scope="module")
def llama_dir(tmp_path_factory):
    d = tmp_path_factory.mktemp("llama")
    save_hf("llama", d, mtp=False)
    return d


def _load_error(path, capsys) -> str:
    with pytest.raises(ModelLoadError) as e:
        load_checkpoint(path)
    msg = str(e.value)
    assert "\n" not in msg
    assert main(["generate", "w1", "--model", str(path)]) == 2  # the CLI: one line, exit 2
    err = capsys.readouterr().err
    assert err.startswith("mtpspec: error:") and "Traceback" not in err and err.count("\n") == 1
    return msg


def test_gpt2_directory_says_the_type_is_unsupported(llama_dir, tmp_path, capsys):
    d = copy_ckpt(llama_dir, tmp_path)
    (d / "config.json").write_text(json.dumps({"model_type": "gpt2", "vocab_size": 96, "n_embd": 32, "n_layer": 2, "n_head": 4}))
    msg = _load_error(d, capsys)
    assert "model type 'gpt2' is not supported (supported: " in msg and "llama" in msg and "hidden_size" not in msg
    (d / "config.json").write_text(json.dumps({"vocab_size": 96}))
    assert "config.json has no model_type" in _load_error(d, capsys)


def test_a_safetensors_file_says_to_pass_its_directory(llama_dir, tmp_path, capsys):
    d = copy_ckpt(llama_dir, tmp_path)
    for f in (d / "model.safetensors", d / "config.json"):
        msg = _load_error(f, capsys)
        assert f"pass the directory ({d})" in msg and "implausible" not in msg
    renamed = d / "weights.bin"  # sniffed by content, whatever its name
    (d / "model.safetensors").rename(renamed)
    assert "pass the directory" in _load_error(renamed, capsys)


def test_directory_near_misses(llama_dir, tmp_path, capsys):
    d = copy_ckpt(llama_dir, tmp_path)
    (d / "config.json").unlink()
    assert "no config.json or mtpspec.json" in (msg := _load_error(d, capsys)) and "also needs its config.json" in msg
    d = copy_ckpt(llama_dir, tmp_path / "b")
    (d / "model.safetensors").unlink()
    assert "no .safetensors files" in _load_error(d, capsys)
    d = copy_ckpt(llama_dir, tmp_path / "c")
    (d / "model.safetensors").rename(d / "model-00001-of-00002.safetensors")
    (d / "model.safetensors.index.json").write_text(json.dumps({"weight_map": {
        "model.norm.weight": "model-00001-of-00002.safetensors", "lm_head.weight": "model-00002-of-00002.safetensors"}}))
    assert "shard model-00002-of-00002.safetensors named in the index is missing" in _load_error(d, capsys)
    (d / "model.safetensors.index.json").write_text(json.dumps({"weight_map": ["x"]}))
    assert "no weight_map" in _load_error(d, capsys)
    d = copy_ckpt(llama_dir, tmp_path / "e")
    (d / "tokenizer.json").unlink()
    assert "no tokenizer.json (give one with --tokenizer PATH)" in _load_error(d, capsys)
    heads = tmp_path / "head"
    heads.mkdir()
    (heads / "head.json").write_text("{}")
    assert "pass it as --draft-model" in _load_error(heads, capsys)


def test_foreign_model_files_are_named(tmp_path, capsys):
    """A PyTorch pickle or a damaged GGUF file as --model: say what it is, not 'implausible header'."""
    torch.save({"w": torch.zeros(2)}, tmp_path / "pytorch_model.bin")
    assert "PyTorch pickle checkpoints are not supported" in _load_error(tmp_path / "pytorch_model.bin", capsys)
    (tmp_path / "m.gguf").write_bytes(b"GGUF" + bytes(64))
    assert "m.gguf: GGUF version 0 is not supported" in _load_error(tmp_path / "m.gguf", capsys)


def test_a_config_far_bigger_than_its_checkpoint_allocates_nothing(llama_dir, tmp_path, capsys):
    """Sizes are checked against the tensors before any memory is allocated (no MemoryError, no hang)."""
    d = copy_ckpt(llama_dir, tmp_path)
    edit_config(d, num_hidden_layers=5000)
    assert "num_hidden_layers 5000 but the checkpoint holds tensors for 2 layers" in _load_error(d, capsys)
    edit_config(d, num_hidden_layers=2, vocab_size=10**12, intermediate_size=10**11)
    msg = _load_error(d, capsys)
    assert "wrong shapes: " in msg and "model.embed_tokens.weight (checkpoint [96, 32], model [1000000000000, 32])" in msg


def test_multimodal_wrapper_ties_by_its_outer_flag():
    """Qwen3_5ForConditionalGeneration holds the head: transformers ties it by the outer config's flag."""
    inner = {**QWEN35, "tie_word_embeddings": True}
    assert not config_from_hf({"model_type": "qwen3_5", "text_config": inner}, "ckpt", 0)[0].tie_embeddings
    assert config_from_hf({"model_type": "qwen3_5", "text_config": QWEN35, "tie_word_embeddings": True}, "ckpt", 0)[0].tie_embeddings

"""Hugging Face safetensors directories: Qwen3.5, Qwen3-Next, Llama, Mistral, Qwen2/Qwen3, Gemma 3 (+ MTP tensors).

config.json becomes a HybridConfig or a DenseConfig; every field that changes the function is implemented or
refused by name (HARMLESS / USED). Tensor names are mapped to ours (Qwen3.5's `model.language_model.*`,
Qwen3-Next's fused in_proj_qkvz / in_proj_ba, DeepSeek-V3-style MTP names) and loading is strict: every missing,
unexpected or misshapen tensor is named. Unlike transformers, the `mtp.*` tensors are kept (the MTP module).
"""

from __future__ import annotations

import json
import math
import re
from pathlib import Path
from typing import Callable, Iterator

import torch
from torch import Tensor

from ..errors import ModelLoadError
from ..models.dense import DenseConfig, DenseLM
from ..models.qwen35 import LAYER_TYPES, HybridConfig, HybridLM
from .meta import meta_device

MAX_CONTEXT = 8192  # KV caches are preallocated: cap the context of big-context checkpoints
MAX_LAYERS = 10_000  # more is a corrupt config.json (the biggest models have ~200)
HYBRID_TYPES = ("qwen3_5", "qwen3_5_text", "qwen3_next")
DENSE_TYPES = ("llama", "qwen2", "qwen3", "mistral", "gemma3_text")
IGNORED_PREFIXES = ("model.visual.", "visual.", "model.vision_tower.")


def read_json(path: Path) -> dict:
    try:
        return json.loads(path.read_text())
    except OSError as e:
        raise ModelLoadError(f"cannot read {path}: {e.strerror}") from None
    except json.JSONDecodeError as e:
        raise ModelLoadError(f"{path}: not valid JSON ({e.msg} at line {e.lineno})") from None


# Every config.json field is implemented (USED, as transformers 5.24 computes it), harmless (HARMLESS), or, when
# set (not null / false / 0 / empty), refused by name: an unknown field may change what the model computes.

HARMLESS = frozenset({
    "architectures", "model_type", "transformers_version", "torch_dtype", "dtype", "_name_or_path", "name_or_path",
    "_commit_hash", "_attn_implementation", "attn_implementation", "use_cache", "pad_token_id", "bos_token_id",
    "eos_token_id", "sep_token_id", "decoder_start_token_id", "initializer_range", "attention_dropout",
    "hidden_dropout", "embd_pdrop", "resid_pdrop", "attn_pdrop", "dropout", "output_router_logits",
    "router_aux_loss_coef", "router_jitter_noise", "pretraining_tp", "max_position_embeddings", "id2label",
    "label2id", "num_labels", "problem_type", "finetuning_task", "tokenizer_class", "prefix", "task_specific_params",
    "return_dict", "output_hidden_states", "output_attentions", "torchscript", "use_bfloat16",
    "chunk_size_feed_forward", "is_decoder", "is_llama_config", "keys_to_ignore_at_inference", "cache_implementation",
    # generate() defaults some older configs carry: they do not change the logits
    "max_length", "min_length", "max_new_tokens", "do_sample", "early_stopping", "num_beams", "num_beam_groups",
    "diversity_penalty", "temperature", "top_k", "top_p", "typical_p", "repetition_penalty", "length_penalty",
    "no_repeat_ngram_size", "encoder_no_repeat_ngram_size", "bad_words_ids", "num_return_sequences", "output_scores",
    "return_dict_in_generate", "forced_bos_token_id", "forced_eos_token_id", "remove_invalid_values",
    "exponential_decay_length_penalty", "suppress_tokens", "begin_suppress_tokens", "tf_legacy_loss",
})
_CORE = {"vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
         "num_key_value_heads", "head_dim", "hidden_act", "rms_norm_eps", "rope_theta", "rope_parameters",
         "rope_scaling", "partial_rotary_factor", "tie_word_embeddings", "original_max_position_embeddings"}
_WINDOWS = {"use_sliding_window", "sliding_window", "max_window_layers", "layer_types"}
_HYBRID = {"attention_bias", "layer_types", "full_attention_interval", "linear_conv_kernel_dim", "linear_key_head_dim",
           "linear_value_head_dim", "linear_num_key_heads", "linear_num_value_heads", "mtp_num_hidden_layers",
           "mtp_use_dedicated_embeddings", "attn_output_gate", "mtp_sparse_attention"}
_MOE = {"num_experts", "num_experts_per_tok", "norm_topk_prob", "decoder_sparse_step", "mlp_only_layers",
        "moe_intermediate_size", "shared_expert_intermediate_size"}
USED = {
    "llama": frozenset(_CORE | {"attention_bias", "mlp_bias"}),
    # transformers' Mistral and Qwen2 read neither bias flag (their biases are fixed): ignored as there
    "mistral": frozenset(_CORE | {"sliding_window", "attention_bias", "mlp_bias"}),
    "qwen2": frozenset(_CORE | _WINDOWS | {"attention_bias", "mlp_bias"}),
    "qwen3": frozenset(_CORE | _WINDOWS | {"attention_bias", "mlp_bias"}),
    "gemma3_text": frozenset(_CORE | {"layer_types", "sliding_window", "sliding_window_pattern", "_sliding_window_pattern",
                                      "query_pre_attn_scalar", "hidden_activation", "rope_local_base_freq", "attention_bias",
                                      "final_logit_softcapping", "attn_logit_softcapping", "use_bidirectional_attention"}),
    "qwen3_5": frozenset(_CORE | _HYBRID),
    "qwen3_5_text": frozenset(_CORE | _HYBRID),
    "qwen3_next": frozenset(_CORE | _HYBRID | _MOE),
}
_ABSENT = object()
# transformers 5.24's defaults for fields config.json may leave out (None: computed, see config_from_hf)
TYPE_DEFAULTS = {
    "llama": {"num_key_value_heads": None, "head_dim": None, "max_position_embeddings": 2048},
    "mistral": {"num_key_value_heads": 8, "head_dim": None, "sliding_window": 4096, "max_position_embeddings": 131072},
    "qwen2": {"num_key_value_heads": 32, "head_dim": None, "use_sliding_window": False, "sliding_window": 4096,
              "max_window_layers": 28, "max_position_embeddings": 32768},
    "qwen3": {"num_key_value_heads": 32, "head_dim": 128, "use_sliding_window": False, "sliding_window": 4096,
              "max_window_layers": 28, "max_position_embeddings": 32768},
    "qwen3_5_text": {"num_key_value_heads": 4, "head_dim": 256, "partial_rotary_factor": 0.25,
                     "max_position_embeddings": 32768},
    "gemma3_text": {"num_key_value_heads": 4, "head_dim": 256, "sliding_window": 4096, "max_position_embeddings": 131072,
                    "query_pre_attn_scalar": 256, "hidden_activation": "gelu_pytorch_tanh", "tie_word_embeddings": True,
                    "rope_theta": 1_000_000.0, "rope_local_base_freq": 10_000.0},
    "qwen3_next": {"num_key_value_heads": 2, "head_dim": 256, "partial_rotary_factor": 0.25,
                   "max_position_embeddings": 32768, "num_experts": 512, "num_experts_per_tok": 10,
                   "moe_intermediate_size": 512, "shared_expert_intermediate_size": 512},
}
ROPE_KEYS = {  # the rope_parameters keys each rope type reads (others must be unset)
    "default": {"rope_type", "type", "rope_theta", "partial_rotary_factor"},
    "linear": {"rope_type", "type", "rope_theta", "partial_rotary_factor", "factor"},
    "dynamic": {"rope_type", "type", "rope_theta", "partial_rotary_factor", "factor", "original_max_position_embeddings"},
    "llama3": {"rope_type", "type", "rope_theta", "partial_rotary_factor", "factor", "low_freq_factor",
               "high_freq_factor", "original_max_position_embeddings"},
    "mrope": {"rope_type", "type", "rope_theta", "partial_rotary_factor"},
}
MROPE_KEYS = {"mrope_section", "mrope_interleaved"}  # text-only positions are equal on every axis: plain RoPE


def _is_set(value) -> bool:
    return value not in (None, False, 0, "", [], {})


def _show(value) -> str:
    text = json.dumps(value) if not isinstance(value, str) else repr(value)
    return text if len(text) <= 60 else text[:57] + "..."


def _text_config(cfg: dict) -> dict:
    """The text model's fields: Qwen3.5's multimodal wrapper keeps them in text_config (other wrappers: unsupported)."""
    if cfg.get("model_type") == "qwen3_5" or ("text_config" in cfg and not cfg.get("model_type")):
        text = cfg.get("text_config") or {}
        text = dict(text) if isinstance(text, dict) else {}
        text.setdefault("model_type", "qwen3_5_text")
        for key in ("eos_token_id", "bos_token_id"):
            if key in cfg and key not in text:
                text[key] = cfg[key]
        # the head belongs to the outer model: transformers ties it by the outer flag (Qwen3_5Config: default false)
        text["tie_word_embeddings"] = cfg.get("tie_word_embeddings", False)
        return text
    return cfg


class _Fields:
    """Typed reads of one config.json (with transformers' defaults for absent fields) that name the field on error."""

    def __init__(self, cfg: dict, mtype: str, path: Path) -> None:
        self.cfg, self.mtype, self.path = cfg, mtype, path
        self.defaults = TYPE_DEFAULTS.get("qwen3_5_text" if mtype == "qwen3_5" else mtype, {})

    def error(self, msg: str) -> ModelLoadError:
        return ModelLoadError(f"{self.path}: config.json: {msg}")

    def get(self, key: str, default=_ABSENT):
        if key in self.cfg:
            return self.cfg[key]
        return self.defaults.get(key, None if default is _ABSENT else default)

    def int(self, key: str, default=_ABSENT, minimum: int = 1, maximum: int = 2**40) -> int:
        value = self.get(key, default)
        if value is None and default is _ABSENT and key not in self.defaults:
            raise self.error(f"lacks '{key}' (a {self.mtype} config needs it)")
        if isinstance(value, bool) or not isinstance(value, int) or not minimum <= value <= maximum:
            raise self.error(f"'{key}' must be an integer from {minimum} to {maximum}, not {_show(value)}")
        return value

    def float(self, key: str, default: float, src: dict | None = None, name: str | None = None) -> float:
        src = self.cfg if src is None else src
        value = src.get(key, default)
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value) or value <= 0:
            raise self.error(f"'{name or key}' must be a positive number, not {_show(value)}")
        return float(value)

    def flag(self, key: str, default: bool = False) -> bool:
        value = self.get(key, default)
        if value is None:
            return default
        if not isinstance(value, bool):
            raise self.error(f"'{key}' must be true or false, not {_show(value)}")
        return value


def _check_fields(f: _Fields) -> None:
    """Refuse any set field that is neither implemented for this model type nor harmless."""
    used = USED[f.mtype]
    for key, value in f.cfg.items():
        if key in used or key in HARMLESS or not _is_set(value):
            continue
        if key == "quantization_config":
            raise f.error("quantized checkpoints (quantization_config) are not supported; use a bf16 / fp32 checkpoint")
        raise f.error(f"'{key}' = {_show(value)} is not implemented for model type '{f.mtype}' "
                      "and may change the model's outputs; refusing rather than computing something else")


def _rope(f: _Fields, dense: bool) -> tuple[float, float, dict | None]:
    """(rope_theta, partial_rotary_factor, scaling for Rotary or None), as transformers reads them."""
    cfg = f.cfg
    # transformers: a non-empty rope_scaling (the old name) replaces rope_parameters
    key = "rope_scaling" if cfg.get("rope_scaling") else "rope_parameters"
    rp = cfg.get(key) or {}
    if not isinstance(rp, dict):
        raise f.error(f"'{key}' must be an object, not {_show(rp)}")
    rope_type = rp.get("rope_type", rp.get("type", "default"))
    kinds = ("default", "linear", "dynamic", "llama3") if dense else ("default", "mrope")
    if rope_type not in kinds:
        raise f.error(f"{key}.rope_type '{rope_type}' is not supported for {f.mtype} (supported: {', '.join(kinds)})")
    allowed = ROPE_KEYS[rope_type] | (set() if dense else MROPE_KEYS)
    extra = sorted(k for k, v in rp.items() if k not in allowed and _is_set(v))
    if extra:
        raise f.error(f"{key}.{extra[0]} = {_show(rp[extra[0]])} is not implemented for rope type '{rope_type}'")
    theta = f.float("rope_theta", f.float("rope_theta", 10000.0), src=rp, name=f"{key}.rope_theta")
    factor = rp.get("partial_rotary_factor", f.get("partial_rotary_factor", 1.0))
    if factor is None:
        factor = f.defaults.get("partial_rotary_factor", 1.0)
    factor = f.float("partial_rotary_factor", factor, src={}, name="partial_rotary_factor")
    if dense and factor != 1.0:
        raise f.error(f"partial_rotary_factor {factor} is not supported for {f.mtype} (only 1.0)")
    if rope_type in ("default", "mrope"):
        return theta, factor, None
    scale = f.float("factor", None, src=rp, name=f"{key}.factor")
    if rope_type == "linear":
        return theta, factor, {"rope_type": "linear", "factor": scale}
    # dynamic NTK changes the frequencies only for positions past max_position_embeddings; our context
    # (config_from_hf's ctx) never goes past it, so there it is plain RoPE.
    if rope_type == "dynamic":
        return theta, factor, None
    low = f.float("low_freq_factor", None, src=rp, name=f"{key}.low_freq_factor")
    high = f.float("high_freq_factor", None, src=rp, name=f"{key}.high_freq_factor")
    if high <= low:
        raise f.error(f"{key}.high_freq_factor ({high}) must be greater than low_freq_factor ({low})")
    if "original_max_position_embeddings" not in rp and "original_max_position_embeddings" in cfg:
        raise f.error(f"'original_max_position_embeddings' belongs in {key} (transformers ignores it at the top level)")
    original = rp.get("original_max_position_embeddings", f.get("max_position_embeddings"))
    f.float("original_max_position_embeddings", original, src={}, name=f"{key}.original_max_position_embeddings")
    return theta, factor, {"rope_type": "llama3", "factor": scale, "low_freq_factor": low, "high_freq_factor": high,
                           "original_max_position_embeddings": original}


def _windows(f: _Fields, n_layers: int) -> tuple[int, ...]:
    """Per-layer sliding-window sizes (0 = full attention) as transformers' Mistral / Qwen2 / Qwen3 choose them."""
    if f.mtype == "llama":
        return ()
    if f.mtype == "mistral":  # every layer, unless sliding_window is null
        w = f.get("sliding_window")
        return () if w is None else (f.int("sliding_window"),) * n_layers
    window = f.get("sliding_window") if f.flag("use_sliding_window") else None  # Qwen2Config.__post_init__
    if window is not None:
        window = f.int("sliding_window")
    types = f.get("layer_types")
    if types is None:  # Qwen2 / Qwen3: the layers from max_window_layers on slide (when the window is on)
        first = f.int("max_window_layers", minimum=0) if window is not None else n_layers
        types = ["sliding_attention" if i >= first else "full_attention" for i in range(n_layers)]
    if not isinstance(types, list) or len(types) != n_layers:
        raise f.error(f"layer_types must list one type per layer ({n_layers}), not {_show(types)}")
    bad = sorted({str(t) for t in types if t not in ("full_attention", "sliding_attention")})
    if bad:
        raise f.error(f"unknown layer type(s) {', '.join(map(repr, bad))} in layer_types (known: full_attention, sliding_attention)")
    if "sliding_attention" in types and window is None:
        raise f.error("layer_types has sliding_attention layers but the window is off (use_sliding_window false or sliding_window null)")
    return tuple(window if t == "sliding_attention" else 0 for t in types) if "sliding_attention" in types else ()


def config_from_hf(cfg: dict, path: Path, mtp_layers: int, max_seq_len: int | None = None):
    """HF config.json dict -> (our config, a name for messages); every function-changing field implemented or refused."""
    if not isinstance(cfg, dict):
        raise ModelLoadError(f"{path}: config.json is not a JSON object")
    cfg = _text_config(cfg)
    mtype = cfg.get("model_type")
    supported = ", ".join(HYBRID_TYPES + DENSE_TYPES)
    if not mtype:
        raise ModelLoadError(f"{path}: config.json has no model_type (supported: {supported})")
    if mtype not in HYBRID_TYPES + DENSE_TYPES:
        raise ModelLoadError(f"{path}: model type '{mtype}' is not supported (supported: {supported})")
    if mtype == "qwen3_5":
        mtype = "qwen3_5_text"
    f = _Fields(cfg, mtype, path)
    _check_fields(f)
    dense = mtype in DENSE_TYPES
    if mtype == "gemma3_text":
        act = f.get("hidden_activation")
        if act not in ("gelu_pytorch_tanh", "gelu_tanh"):
            raise f.error(f"hidden_activation '{act}' is not supported for gemma3_text (only gelu_pytorch_tanh)")
        theta, factor, scaling, local_theta = _gemma3_rope(f)
    else:
        act = f.get("hidden_act", "silu")
        if act not in ("silu", "swish"):
            raise f.error(f"hidden_act '{act}' is not supported (only silu)")
        theta, factor, scaling = _rope(f, dense)
    n_layers, n_heads = f.int("num_hidden_layers", maximum=MAX_LAYERS), f.int("num_attention_heads")
    n_kv = f.int("num_key_value_heads", n_heads) if f.get("num_key_value_heads") is not None else n_heads
    if n_heads % n_kv:
        raise f.error(f"num_attention_heads ({n_heads}) is not a multiple of num_key_value_heads ({n_kv})")
    hidden = f.int("hidden_size")
    head_dim = f.int("head_dim") if f.get("head_dim") is not None else hidden // n_heads
    rot_dim = int(head_dim * factor)
    if rot_dim % 2 or rot_dim == 0:
        raise f.error(f"the rotary dimension (head_dim {head_dim} x partial_rotary_factor {factor}) must be even and positive")
    ctx = min(f.int("max_position_embeddings", MAX_CONTEXT), max_seq_len or MAX_CONTEXT)
    common = dict(
        vocab_size=f.int("vocab_size"), hidden_size=hidden, num_heads=n_heads, num_kv_heads=n_kv,
        intermediate_size=f.int("intermediate_size"), max_seq_len=ctx,
        norm_eps=f.float("rms_norm_eps", 1e-6), rope_theta=theta,
        tie_embeddings=f.flag("tie_word_embeddings"), attention_bias=f.flag("attention_bias"),
    )
    if not dense:
        return _hybrid_config(f, n_layers, head_dim, factor, mtp_layers, common)
    if mtype == "gemma3_text":
        return _gemma3_config(f, n_layers, head_dim, local_theta, scaling, common), "Gemma 3"
    common["attention_bias"] = True if mtype == "qwen2" else (mtype != "mistral" and common["attention_bias"])
    dc = DenseConfig(
        num_layers=n_layers, head_dim=head_dim, qk_norm=mtype == "qwen3",
        o_proj_bias=mtype in ("llama", "qwen3") and common["attention_bias"],
        mlp_bias=mtype == "llama" and f.flag("mlp_bias"), rope_scaling=scaling, layer_windows=_windows(f, n_layers),
        **common,
    )
    return dc, mtype.capitalize()


def _gemma3_rope(f: _Fields) -> tuple[float, float, dict | None, float]:
    """(global theta, 1.0, global scaling, local theta): rope_parameters keyed by layer type (transformers 5), or the older
    rope_theta / rope_scaling / rope_local_base_freq fields. Sliding-window layers take plain RoPE at their own base."""
    rp = f.cfg.get("rope_parameters")
    if isinstance(rp, dict) and ("full_attention" in rp or "sliding_attention" in rp):
        unknown = sorted(set(rp) - {"full_attention", "sliding_attention"})
        if unknown:
            raise f.error(f"rope_parameters.{unknown[0]} is not a gemma3_text layer type (full_attention, sliding_attention)")
        full, local = rp.get("full_attention") or {}, rp.get("sliding_attention") or {}
        theta, factor, scaling = _rope(_Fields({**f.cfg, "rope_parameters": full, "rope_scaling": None}, f.mtype, f.path), True)
        if local.get("rope_type", local.get("type", "default")) != "default" or any(
                _is_set(v) for k, v in local.items() if k not in ("rope_type", "type", "rope_theta")):
            raise f.error(f"rope_parameters.sliding_attention = {_show(local)}: only plain RoPE is implemented there")
        local_theta = f.float("rope_theta", f.get("rope_local_base_freq"), src=local, name="rope_parameters.sliding_attention.rope_theta")
        return theta, factor, scaling, local_theta
    theta, factor, scaling = _rope(_Fields({**f.cfg, "rope_theta": f.get("rope_theta")}, f.mtype, f.path), True)
    return theta, factor, scaling, f.float("rope_local_base_freq", f.get("rope_local_base_freq"))


def _gemma3_config(f: _Fields, n_layers: int, head_dim: int, local_theta: float, scaling: dict | None, common: dict) -> DenseConfig:
    """Gemma 3's text model as a DenseConfig: every layer of the transformers class, or a refusal naming the field."""
    for key in ("final_logit_softcapping", "attn_logit_softcapping", "use_bidirectional_attention"):
        if _is_set(f.get(key)):
            raise f.error(f"'{key}' = {_show(f.get(key))} is not implemented for gemma3_text")
    if f.int("query_pre_attn_scalar") != head_dim:
        raise f.error(f"query_pre_attn_scalar {f.get('query_pre_attn_scalar')} != head_dim {head_dim}: "
                      "only the 1/sqrt(head_dim) query scale is implemented")
    window = f.int("sliding_window")
    types = f.get("layer_types")
    if types is None:  # Gemma3TextConfig: every sliding_window_pattern-th layer is global
        pattern = f.int("sliding_window_pattern", f.get("_sliding_window_pattern", 6))
        types = ["sliding_attention" if (i + 1) % pattern else "full_attention" for i in range(n_layers)]
    if not isinstance(types, list) or len(types) != n_layers or any(t not in ("full_attention", "sliding_attention") for t in types):
        raise f.error(f"layer_types must list full_attention / sliding_attention once per layer ({n_layers}), not {_show(types)}")
    return DenseConfig(
        num_layers=n_layers, head_dim=head_dim, qk_norm=True, o_proj_bias=common["attention_bias"], rope_scaling=scaling,
        layer_windows=tuple(window if t == "sliding_attention" else 0 for t in types), rope_local_theta=local_theta,
        norm_zero_centred=True, sandwich_norms=True, hidden_act="gelu_tanh", embed_scale=True, **common)


def _sparse_config(f: _Fields):
    """mtp_sparse_attention (our export's field for a block-sparse MTP layer), checked."""
    from ..errors import ConfigError
    from ..models.sparse_attention import SparseAttentionConfig

    try:
        return SparseAttentionConfig.parse(f.get("mtp_sparse_attention"))
    except ConfigError as e:
        raise f.error(f"mtp_sparse_attention: {e}") from None


def _hybrid_config(f: _Fields, n_layers: int, head_dim: int, factor: float, mtp_layers: int, common: dict):
    cfg, path, mtype = f.cfg, f.path, f.mtype
    if f.get("attn_output_gate") is not None and not f.flag("attn_output_gate"):
        raise f.error("attn_output_gate false is not supported (Qwen3.5 / Qwen3-Next attention is gated)")
    if f.flag("mtp_use_dedicated_embeddings"):
        raise f.error("mtp_use_dedicated_embeddings is not supported (the MTP module shares the model's embedding)")
    layer_types = cfg.get("layer_types")
    if layer_types is None:
        every = f.int("full_attention_interval", 4)
        layer_types = ["full_attention" if (i + 1) % every == 0 else "linear_attention" for i in range(n_layers)]
    if not isinstance(layer_types, list):
        raise f.error(f"layer_types must be a list, not {_show(layer_types)}")
    bad = sorted({str(t) for t in layer_types if t not in LAYER_TYPES})
    if bad:
        raise ModelLoadError(f"{path}: unknown layer type(s) {', '.join(map(repr, bad))} in layer_types (known: {', '.join(LAYER_TYPES)})")
    if len(layer_types) != n_layers:
        raise ModelLoadError(f"{path}: layer_types has {len(layer_types)} entries but num_hidden_layers is {n_layers}")
    moe = {}
    if mtype == "qwen3_next":
        only = f.get("mlp_only_layers") or []
        if not isinstance(only, list) or not all(isinstance(i, int) and not isinstance(i, bool) for i in only):
            raise f.error(f"mlp_only_layers must be a list of layer indices, not {_show(only)}")
        moe = dict(
            num_experts=f.int("num_experts", minimum=0), num_experts_per_tok=f.int("num_experts_per_tok"),
            moe_intermediate_size=f.int("moe_intermediate_size"),
            shared_expert_intermediate_size=f.int("shared_expert_intermediate_size", minimum=0),
            norm_topk_prob=f.flag("norm_topk_prob", True), decoder_sparse_step=f.int("decoder_sparse_step", 1),
            mlp_only_layers=tuple(only),
        )
        if moe["num_experts"] and moe["num_experts_per_tok"] > moe["num_experts"]:
            raise f.error(f"num_experts_per_tok ({moe['num_experts_per_tok']}) exceeds num_experts ({moe['num_experts']})")
    hc = HybridConfig(
        num_layers=n_layers, layer_types=tuple(layer_types), head_dim=head_dim, partial_rotary_factor=factor,
        linear_conv_kernel_dim=f.int("linear_conv_kernel_dim", 4), linear_key_head_dim=f.int("linear_key_head_dim", 128),
        linear_value_head_dim=f.int("linear_value_head_dim", 128), linear_num_key_heads=f.int("linear_num_key_heads", 16),
        linear_num_value_heads=f.int("linear_num_value_heads", 32), mtp_num_layers=mtp_layers, **moe, **common,
        mtp_sparse_attention=_sparse_config(f) if mtp_layers else None,
    )
    if hc.linear_num_value_heads % hc.linear_num_key_heads:
        raise f.error(f"linear_num_value_heads ({hc.linear_num_value_heads}) is not a multiple of linear_num_key_heads ({hc.linear_num_key_heads})")
    return hc, {"qwen3_next": "Qwen3-Next"}.get(mtype, "Qwen3.5")


# -- tensors ---------------------------------------------------------------------------------

def safetensor_files(path: Path) -> list[Path]:
    index = path / "model.safetensors.index.json"
    if index.exists():
        data = read_json(index)
        weight_map = data.get("weight_map") if isinstance(data, dict) else None
        if not isinstance(weight_map, dict) or not all(isinstance(n, str) for n in weight_map.values()):
            raise ModelLoadError(f"{index}: no weight_map of tensor names to shard files")
        names = sorted(set(weight_map.values()))
        files = [path / n for n in names]
    else:
        files = sorted(path.glob("*.safetensors"))
    if not files:
        other = " (its pytorch_model*.bin pickles are not supported)" if any(path.glob("pytorch_model*.bin")) else ""
        raise ModelLoadError(f"{path}: no .safetensors files (only safetensors checkpoints are supported){other}")
    for f in files:
        if not f.exists():
            raise ModelLoadError(f"{path}: shard {f.name} named in the index is missing")
    return files


def iter_tensors(files: list[Path]) -> Iterator[tuple[str, Callable[[], Tensor], tuple[int, ...]]]:
    """(name, loader, shape) for every tensor, reading each only when asked."""
    from safetensors import safe_open

    for f in files:
        try:
            handle = safe_open(str(f), framework="pt")
        except Exception as e:  # noqa: BLE001 - any parse failure is a bad file
            raise ModelLoadError(f"{f}: not a readable safetensors file ({e})") from None
        for name in handle.keys():
            yield name, (lambda h=handle, n=name: h.get_tensor(n)), tuple(handle.get_slice(name).get_shape())


def count_mtp_layers(names: list[str], n_layers: int) -> int:
    """MTP decoder layers present under Qwen (mtp.layers.N) or DeepSeek-V3 (model.layers.{n_layers+j}) names."""
    qwen = {int(m.group(1)) for n in names if (m := re.match(r"mtp\.layers\.(\d+)\.", n))}
    deepseek = {int(m.group(1)) - n_layers for n in names if (m := re.match(r"(?:model\.)?layers\.(\d+)\.", n)) and int(m.group(1)) >= n_layers}
    if qwen or any(n.startswith("mtp.") for n in names):
        return max(qwen, default=-1) + 1
    return max(deepseek, default=-1) + 1


_DEEPSEEK_MTP = {"enorm": "pre_fc_norm_embedding", "hnorm": "pre_fc_norm_hidden", "eh_proj": "fc", "shared_head.norm": "norm"}


def rename(name: str, n_layers: int) -> str | None:
    """An HF tensor name -> ours (None = deliberately ignored)."""
    if name.startswith(IGNORED_PREFIXES):
        return None
    if name.startswith("model.language_model."):
        name = "model." + name[len("model.language_model."):]
    m = re.match(r"model\.layers\.(\d+)\.(.+)$", name)
    if m and int(m.group(1)) >= n_layers:  # DeepSeek-V3 style: the MTP module is layer n_layers (+ j)
        j, rest = int(m.group(1)) - n_layers, m.group(2)
        if rest in ("embed_tokens.weight", "shared_head.head.weight"):
            return None  # DeepSeek stores copies of the shared embedding / head here
        for src, dst in _DEEPSEEK_MTP.items():
            if rest == f"{src}.weight":
                return f"mtp.{dst}.weight"
        return f"mtp.layers.{j}.{rest}"
    return name


def split_qwen3_next(name: str, t: Tensor, cfg: HybridConfig) -> list[tuple[str, Tensor]]:
    """Qwen3-Next's per-key-head grouped in_proj_qkvz / in_proj_ba -> Qwen3.5's in_proj_qkv/z/b/a."""
    nk, nv, dk, dv = cfg.linear_num_key_heads, cfg.linear_num_value_heads, cfg.linear_key_head_dim, cfg.linear_value_head_dim
    r, h = nv // nk, t.shape[-1]
    base = name.rsplit(".", 2)[0]
    if name.endswith("in_proj_qkvz.weight"):
        g = t.reshape(nk, 2 * dk + 2 * r * dv, h)
        q, k, v, z = g.split([dk, dk, r * dv, r * dv], dim=1)
        qkv = torch.cat([q.reshape(nk * dk, h), k.reshape(nk * dk, h), v.reshape(nv * dv, h)])
        return [(f"{base}.in_proj_qkv.weight", qkv), (f"{base}.in_proj_z.weight", z.reshape(nv * dv, h))]
    g = t.reshape(nk, 2 * r, h)
    b, a = g.split([r, r], dim=1)
    return [(f"{base}.in_proj_b.weight", b.reshape(nv, h)), (f"{base}.in_proj_a.weight", a.reshape(nv, h))]


def build_meta(cfg):
    """The model for `cfg` on the meta device (shapes only, no memory)."""
    cls = HybridLM if isinstance(cfg, HybridConfig) else DenseLM
    with meta_device():
        return cls(cfg)


def build_empty(cfg, dtype: torch.dtype):
    """The model for `cfg` with uninitialised weights (no random init: weights come from the checkpoint)."""
    cls = HybridLM if isinstance(cfg, HybridConfig) else DenseLM
    with meta_device():
        model = cls(cfg).to(dtype)
    model = model.to_empty(device="cpu")
    model.reset_buffers()  # to_empty left the rotary tables uninitialised
    if cfg.tie_embeddings:
        model.lm_head.weight = model.model.embed_tokens.weight
    return model.eval()


def load_state_strict(model, items, path: Path, arch: str) -> None:
    """Copy (name, loader, shape) items into the model; name every missing / unexpected / misshapen tensor."""
    params = dict(model.named_parameters(remove_duplicate=False))
    tied = model.config.tie_embeddings
    expected = {n for n in params if not (tied and n == "lm_head.weight")}
    seen, unexpected, shapes = set(), [], []
    for name, load, shape in items:
        if tied and name == "lm_head.weight":
            continue  # a tied head may be stored explicitly; the embedding is what we use
        p = params.get(name)
        if p is None or name not in expected:
            unexpected.append(name)
            continue
        if tuple(shape) != tuple(p.shape):
            shapes.append(f"{name} (checkpoint {list(shape)}, model {list(p.shape)})")
            continue
        with torch.no_grad():
            p.copy_(load())
        seen.add(name)
    missing = sorted(expected - seen - {s.split(" ")[0] for s in shapes})
    problems = []
    if missing:
        problems.append(f"missing tensors: {', '.join(missing)}")
    if unexpected:
        problems.append(f"unexpected tensors: {', '.join(sorted(unexpected))}")
    if shapes:
        problems.append(f"wrong shapes: {', '.join(shapes)}")
    if problems:
        raise ModelLoadError(f"{path}: checkpoint does not match the {arch} config; " + "; ".join(problems))


def load_hf_model(path: Path, dtype: torch.dtype, max_seq_len: int | None = None):
    raw = read_json(path / "config.json")
    config_from_hf(raw, path, 0, max_seq_len)  # an unsupported model type or field: say so before reading tensors
    text = _text_config(raw)
    files = safetensor_files(path)
    listing = list(iter_tensors(files))
    n_layers = int(text.get("num_hidden_layers", 0))
    names = [n.replace("model.language_model.", "model.", 1) for n, _, _ in listing]
    present = {m.group(1) for n in names if (m := re.match(r"model\.layers\.(\d+)\.", n))}
    if n_layers > len(present):  # before building anything: a config far bigger than its checkpoint
        raise ModelLoadError(f"{path}: config.json has num_hidden_layers {n_layers} but the checkpoint holds tensors for {len(present)} layers")
    mtp_layers = count_mtp_layers(names, n_layers) if text.get("model_type") in HYBRID_TYPES else 0
    declared = text.get("mtp_num_hidden_layers")
    if mtp_layers and isinstance(declared, int) and not isinstance(declared, bool) and 0 < declared <= MAX_LAYERS:
        mtp_layers = declared  # MTP tensors present: the config's layer count, so strict loading names any missing mtp.layers.N.*
    cfg, arch = config_from_hf(raw, path, mtp_layers, max_seq_len)
    items = []
    for name, load, shape in listing:
        new = rename(name, n_layers) if isinstance(cfg, HybridConfig) else (None if name.startswith(IGNORED_PREFIXES) else name)
        if new is None:
            continue
        if isinstance(cfg, HybridConfig) and re.search(r"linear_attn\.in_proj_(qkvz|ba)\.weight$", new):
            try:
                parts = split_qwen3_next(new, load(), cfg)
            except RuntimeError:
                items.append((new, load, shape))  # wrong shape: reported as unexpected below
                continue
            items += [(n, (lambda t=t: t), tuple(t.shape)) for n, t in parts]
            continue
        items.append((new, load, shape))
    # names and shapes checked on the meta device first: a config that does not match allocates nothing
    load_state_strict(build_meta(cfg), [(n, (lambda s=s: torch.empty(s, device="meta")), s) for n, _, s in items], path, arch)
    model = build_empty(cfg, dtype)
    load_state_strict(model, items, path, arch)
    return model

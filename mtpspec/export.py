"""`mtpspec export`: write a model as a Hugging Face transformers checkpoint.

- a dense Llama model (DenseLM, e.g. a llama2.c checkpoint) -> `LlamaForCausalLM`;
- a Qwen3.5-style hybrid (HybridLM with dense MLPs, e.g. the shipped demo model) -> transformers'
  Qwen3.5 text model `Qwen3_5ForCausalLM` (model_type qwen3_5_text).

Our parameter names and layouts already are Hugging Face's (the llama2.c loader permutes wq / wk
into the half-split rotary layout; loading/hf.py maps HF names 1:1 onto HybridLM), so export is the
state_dict plus a config.json, the reverse of loading/hf.py. A hybrid's `mtp.*` tensors are kept:
transformers ignores them, our own loader reads the exported folder back with its MTP module.
The export is verified by running transformers on the written directory and comparing logits with
ours (fp32; max |diff| <= 1e-5 for Llama, 1e-4 for the hybrid, whose chunked delta rule sums in
another order; per unit of the logits' scale when that exceeds 1), so peer benchmarks compare the
same function.
"""

from __future__ import annotations

import argparse
import json
from dataclasses import dataclass
from pathlib import Path

import torch

from .cli import add_model_args, command
from .errors import ConfigError


@dataclass(frozen=True)
class ExportCheck:
    """How closely transformers' logits on the exported directory match ours."""

    max_abs_diff: float  # max |logits_ours - logits_hf| over the checked positions
    positions: int  # tokens compared
    ok: bool  # max_abs_diff <= tolerance x max(1, max |logits_ours|)
    max_abs_logit: float = 0.0  # the logits' scale: fp32 summation-order differences grow with it


def _is_hybrid(module) -> bool:
    from .models.qwen35 import HybridLM

    return isinstance(module, HybridLM)


def hf_config(module, bos_id: int | None = 1, eos_id: int | list[int] | None = 2) -> dict:
    """config.json for transformers: Qwen3.5 text for a hybrid, else Llama."""
    return _qwen35_config(module, bos_id, eos_id) if _is_hybrid(module) else _llama_config(module, bos_id, eos_id)


def _common(bos_id: int | None, eos_id: int | list[int] | None) -> dict:
    """The config.json fields every export shares."""
    return {"bos_token_id": bos_id, "eos_token_id": eos_id, "pad_token_id": None, "use_cache": True, "dtype": "float32"}


def _qwen35_config(module, bos_id: int | None, eos_id: int | list[int] | None) -> dict:
    """config.json for transformers' Qwen3_5TextConfig (the reverse of loading/hf.py's config_from_hf)."""
    c = module.config
    if c.num_experts > 0:
        raise ConfigError("export supports Qwen3.5-style hybrids with dense MLPs; this model is a Qwen3-Next mixture of experts")
    return {
        "architectures": ["Qwen3_5ForCausalLM"],
        "model_type": "qwen3_5_text",
        "vocab_size": c.vocab_size,
        "hidden_size": c.hidden_size,
        "intermediate_size": c.intermediate_size,
        "num_hidden_layers": c.num_layers,
        "layer_types": list(c.layer_types),
        "num_attention_heads": c.num_heads,
        "num_key_value_heads": c.num_kv_heads,
        "head_dim": c.head_dim,
        "linear_conv_kernel_dim": c.linear_conv_kernel_dim,
        "linear_key_head_dim": c.linear_key_head_dim,
        "linear_value_head_dim": c.linear_value_head_dim,
        "linear_num_key_heads": c.linear_num_key_heads,
        "linear_num_value_heads": c.linear_num_value_heads,
        "hidden_act": "silu",
        "max_position_embeddings": c.max_seq_len,
        "rms_norm_eps": c.norm_eps,
        "rope_parameters": {"rope_theta": c.rope_theta, "partial_rotary_factor": c.partial_rotary_factor, "rope_type": "default"},
        "tie_word_embeddings": bool(c.tie_embeddings),
        "attention_bias": bool(c.attention_bias),
        "mtp_num_hidden_layers": c.mtp_num_layers,
        **_common(bos_id, eos_id),
    }


def _llama_config(module, bos_id: int | None, eos_id: int | list[int] | None) -> dict:
    """config.json for transformers' LlamaConfig (5.x: rope_parameters holds rope_theta)."""
    c = module.config
    if getattr(c, "qk_norm", False) or getattr(c, "attention_bias", False):
        raise ConfigError("export to a Llama checkpoint supports plain Llama models (no q/k norm, no attention bias)")
    if getattr(c, "mlp_bias", False) or any(getattr(c, "layer_windows", ())):
        raise ConfigError("export to a Llama checkpoint supports plain Llama models (no MLP bias, no sliding window)")
    return {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "vocab_size": c.vocab_size,
        "hidden_size": c.hidden_size,
        "intermediate_size": c.intermediate_size,
        "num_hidden_layers": c.num_layers,
        "num_attention_heads": c.num_heads,
        "num_key_value_heads": c.num_kv_heads,
        "head_dim": c.hd,
        "hidden_act": "silu",
        "max_position_embeddings": c.max_seq_len,
        "rms_norm_eps": c.norm_eps,
        "rope_parameters": {"rope_theta": c.rope_theta, "rope_type": "default", **(getattr(c, "rope_scaling", None) or {})},
        "tie_word_embeddings": bool(c.tie_embeddings),
        "attention_bias": False,
        "mlp_bias": False,
        **_common(bos_id, eos_id),
    }


def special_ids(tokenizer) -> tuple[int | None, int | list[int] | None]:
    """(bos, eos) for config.json: the tokenizer's BOS and EOS, or its stop ids when it names no EOS."""
    if tokenizer is None:
        return 1, 2  # llama2.c's
    bos = getattr(tokenizer, "bos_id", None)
    eos = getattr(tokenizer, "eos_id", None)
    if eos is None:
        stops = list(getattr(tokenizer, "stop_ids", ()) or ())
        eos = stops[0] if len(stops) == 1 else (stops or None)
    return bos, eos


def export_hf(module, out: str | Path, bos_id: int | None = 1, eos_id: int | list[int] | None = 2) -> Path:
    """Write config.json + model.safetensors (fp32) for `module` (a DenseLM or a HybridLM) into directory `out`."""
    from safetensors.torch import save_file

    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    cfg = hf_config(module, bos_id, eos_id)
    sd = {k: v.detach().to(torch.float32).contiguous().clone() for k, v in module.state_dict().items()}
    if cfg["tie_word_embeddings"]:
        sd.pop("lm_head.weight", None)  # tied: transformers re-ties it to model.embed_tokens
    (out / "config.json").write_text(json.dumps(cfg, indent=2) + "\n")
    (out / "generation_config.json").write_text(json.dumps({"bos_token_id": bos_id, "eos_token_id": eos_id}, indent=2) + "\n")
    save_file(sd, str(out / "model.safetensors"), metadata={"format": "pt"})
    return out


def load_hf(directory: str | Path):
    """transformers' causal LM for a directory (the class its config.json names), fp32, eval mode."""
    from transformers import AutoModelForCausalLM
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()
    hf_logging.set_verbosity_error()  # the hybrid's kept mtp.* tensors are "unused weights" to transformers
    return AutoModelForCausalLM.from_pretrained(str(directory), dtype=torch.float32).eval()


@torch.inference_mode()
def check_export(module, directory: str | Path, tokens: list[int], tol: float | None = None, hf_model=None) -> ExportCheck:
    """Compare our logits over `tokens` with transformers' on the exported checkpoint.

    tol: max |diff| allowed per unit of logit scale, max(1, max |logits|) (default 1e-5 for Llama,
    1e-4 for a hybrid)."""
    tol = tol if tol is not None else (1e-4 if _is_hybrid(module) else 1e-5)
    hf = hf_model if hf_model is not None else load_hf(directory)
    ids = torch.tensor(tokens, dtype=torch.long)
    ours = module.to(torch.float32).forward_tokens(ids, module.new_cache()).logits if module.dtype == torch.float32 else None
    if ours is None:
        raise ConfigError("export check runs in fp32; load the model with --dtype fp32")
    theirs = hf(ids[None]).logits[0].float()  # (T, V)
    diff, scale = float((ours - theirs).abs().max()), float(ours.abs().max())
    return ExportCheck(max_abs_diff=diff, positions=len(tokens), ok=diff <= tol * max(1.0, scale), max_abs_logit=scale)


def _args(p: argparse.ArgumentParser) -> None:
    p.add_argument("model_path", nargs="?", help="model to export (same as --model)")
    add_model_args(p)
    p.set_defaults(model=None)
    for a in p._actions:  # --model is optional here: the positional path works too
        if a.dest == "model":
            a.required = False
    p.add_argument("--out", required=True, help="output directory (config.json + model.safetensors)")
    p.add_argument("--no-check", action="store_true", help="skip the logits check against transformers")


@command("export")(_args)
def run_export(args: argparse.Namespace) -> int:
    from .api import load

    path = args.model or args.model_path
    if not path:
        raise ConfigError("export needs a model: mtpspec export MODEL --out DIR")
    model = load(path, args.tokenizer, "fp32")
    out = export_hf(model.module, args.out, *special_ids(model.tokenizer))
    print(f"wrote {out}/config.json and {out}/model.safetensors")
    if not args.no_check:
        ids = model.encode("Once upon a time, there was a little girl named Lily. She loved to play outside.")
        chk = check_export(model.module, out, ids)
        print(f"logits check vs transformers over {chk.positions} positions: max |diff| = {chk.max_abs_diff:.2e} ({'ok' if chk.ok else 'FAILED'})")
        if not chk.ok:
            return 1
    return 0

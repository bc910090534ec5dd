"""`mtpspec export`: write a model as a Hugging Face transformers checkpoint.

- a dense Llama model (DenseLM, e.g. a llama2.c checkpoint) -> `LlamaForCausalLM`;
- a Qwen3.5-style hybrid (HybridLM with dense MLPs, e.g. the shipped demo model) -> transformers'
  Qwen3.5 text model `Qwen3_5ForCausalLM` (model_type qwen3_5_text);
- a hybrid with a mixture of experts -> `Qwen3NextForCausalLM` (model_type qwen3_next).

The directory is complete for transformers (AutoModelForCausalLM + AutoTokenizer) and the serving
engines: config.json, model.safetensors (fp32), generation_config.json (BOS, EOS / stop ids, greedy
by default), tokenizer.json, tokenizer_config.json (special tokens, add_bos_token as our encoding,
chat template when the source has one, model_max_length) and special_tokens_map.json. A llama2.c
tokenizer becomes a byte-fallback BPE that encodes exactly as ours (Llama2cTokenizer.to_hf).

Our parameter names and layouts already are Hugging Face's (the llama2.c loader permutes wq / wk
into the half-split rotary layout; loading/hf.py maps HF names 1:1 onto HybridLM), so the weights
are the state_dict (Qwen3-Next: in_proj_qkvz / in_proj_ba fused back), the reverse of
loading/hf.py. A hybrid's MTP module is kept as `mtp.*` (`mtp.fc`, `mtp.pre_fc_norm_embedding`,
`mtp.pre_fc_norm_hidden`, `mtp.layers.{i}.*` per MTP layer, `mtp.norm`) with `mtp_num_hidden_layers` in
config.json, the names vLLM's Qwen3.5 / Qwen3-Next MTP loads; transformers
ignores them, our own loader reads the folder back with its MTP module. The export is verified by
running transformers on the written directory and comparing fp32 logits with ours (tolerance: see
FP32_FLOOR), and AutoTokenizer's encoding with ours, so peer benchmarks compare the same function.
"""

from __future__ import annotations

import argparse
import copy
import json
from dataclasses import dataclass
from pathlib import Path

import torch

from .cli import add_model_args, command
from .errors import ConfigError
from .export_layout import fuse_qwen3_next, is_hybrid


@dataclass(frozen=True)
class ExportCheck:
    """How closely transformers' logits on the exported directory match ours: fp32, and fp64."""

    max_abs_diff: float  # fp32: max |logits_ours - logits_hf| over the checked positions
    positions: int  # tokens compared
    ok: bool  # fp32 within tolerance at every position, and fp64 within FP64_TOL (when it ran)
    max_abs_logit: float = 0.0  # the logits' scale, max |logits_ours|
    fp32_error: float = 0.0  # max |ours fp32 - ours fp64|: our own rounding error on these tokens
    sensitivity: float = 0.0  # max s_t: how far eps32-sized weight changes move the exact logits
    worst_ratio: float = 0.0  # fp32: max over positions of |diff| / tolerance (ok: <= 1)
    fp64_rel_diff: float | None = None  # max |ours - hf| / max |logits|, both in fp64 (None: not run)


# fp64: our model and transformers' (its fp64 twin, see mtpspec.hf_reference) agree to a few fp64 ulps of the
# logits' scale (tens for a mixture of experts, whose routing weights sum in another order; rope-scaled Llamas
# only with their scaled rotary tables in fp64 too). FP64_TOL sits far above that and far below a real difference
# (a norm eps of 1e-5 for 1e-6 moves the tiny hybrid's logits by 0.5 of their scale); the measurements behind it:
# docs/decisions.d/cycles.md.
FP64_TOL = 1e-9

# fp32: the tolerance at position t is FP32_FLOOR * eps32 * max|logits| + FP32_SENS * s_t, where
# s_t is how far the exact (fp64) logits at t move when every weight is scaled by 1 +- eps32 (random
# signs, the largest of two seeded draws): the function's own sensitivity to fp32 rounding at these
# tokens (backward stability: a rounded matmul is an exact one on perturbed inputs). It does not
# depend on either fp32 path, so a slip in ours (a bf16 cast) is not excused by its own error.
# Conditioning varies a lot: a position where a DeltaNet head's output is near zero and its gated
# RMSNorm magnifies rounding has s_t of hundreds of eps32 * max|logits|, elsewhere s_t is ~1-5.
# FLOOR = SENS = 16 leaves a margin of about 2.5 over the worst error measured (each fp32 run's own, and
# |hf - ours|; docs/decisions.d/cycles.md); the weights rounded to bf16 exceed it ~1000x (tests/test_export.py).
# The same constants as the fp32 parity tests (tests/test_hf_parity.py).
FP32_FLOOR = 16.0
FP32_SENS = 16.0


def hf_config(module, bos_id: int | None = 1, eos_id: int | list[int] | None = 2) -> dict:
    """config.json for transformers: Qwen3.5 text for a hybrid, else Llama."""
    return _qwen35_config(module, bos_id, eos_id) if is_hybrid(module) else _llama_config(module, bos_id, eos_id)


def _common(bos_id: int | None, eos_id: int | list[int] | None) -> dict:
    """The config.json fields every export shares."""
    return {"bos_token_id": bos_id, "eos_token_id": eos_id, "pad_token_id": None, "use_cache": True, "dtype": "float32"}


def _qwen35_config(module, bos_id: int | None, eos_id: int | list[int] | None) -> dict:
    """config.json for transformers' Qwen3_5TextConfig, or Qwen3NextConfig for a mixture of experts
    (the reverse of loading/hf.py's config_from_hf)."""
    c = module.config
    if c.sparse_attention is not None:
        raise ConfigError("transformers' Qwen3.5 has no block-sparse attention: a model whose full-attention layers are sparse "
                          "would compute another function there; keep it in the project format (mtpspec.json)")
    cfg = {
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
        "mtp_num_hidden_layers": c.mtp_num_layers,  # vLLM's Qwen3_5MTP reads it; the mtp.* tensors are kept
        "mtp_use_dedicated_embeddings": False,  # the MTP module shares the target's embedding and head
        **_common(bos_id, eos_id),
    }
    if c.mtp_sparse_attention is not None:  # ours: the MTP layer's indexer (mtp.layers.0.self_attn.indexer.*); transformers skips mtp.*
        cfg["mtp_sparse_attention"] = c.mtp_sparse_attention.to_dict()
    if c.num_experts > 0:
        cfg.update(
            architectures=["Qwen3NextForCausalLM"], model_type="qwen3_next", num_experts=c.num_experts,
            num_experts_per_tok=c.num_experts_per_tok, moe_intermediate_size=c.moe_intermediate_size,
            shared_expert_intermediate_size=c.shared_expert_intermediate_size, norm_topk_prob=bool(c.norm_topk_prob),
            decoder_sparse_step=c.decoder_sparse_step, mlp_only_layers=list(c.mlp_only_layers),
        )
    return cfg


def hf_state_dict(module, cfg: dict) -> dict[str, torch.Tensor]:
    """The fp32 tensors under transformers' names: ours, except Qwen3-Next's fused per-key-head
    in_proj_qkvz / in_proj_ba (the reverse of loading/hf.py's split_qwen3_next) and no tied head."""
    sd = {k: v.detach().to(torch.float32).contiguous().clone() for k, v in module.state_dict().items()}
    if cfg["tie_word_embeddings"]:
        sd.pop("lm_head.weight", None)  # tied: transformers re-ties it to model.embed_tokens
    if cfg["model_type"] == "qwen3_next":
        for name in [k for k in sd if k.endswith("linear_attn.in_proj_qkv.weight")]:
            base = name.rsplit(".", 2)[0]
            qkv, z, b, a = (sd.pop(f"{base}.in_proj_{p}.weight") for p in ("qkv", "z", "b", "a"))
            sd[f"{base}.in_proj_qkvz.weight"], sd[f"{base}.in_proj_ba.weight"] = fuse_qwen3_next(module.config, qkv, z, b, a)
    return sd


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


def export_hf(module, out: str | Path, bos_id: int | None = 1, eos_id: int | list[int] | None = 2, tokenizer=None) -> Path:
    """Write `module` (a DenseLM or a HybridLM) as a Hugging Face directory `out`: config.json,
    model.safetensors (fp32), generation_config.json and, given our `tokenizer`, tokenizer.json,
    tokenizer_config.json and special_tokens_map.json."""
    from safetensors.torch import save_file

    out = Path(out)
    cfg = hf_config(module, bos_id, eos_id)
    try:
        out.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        raise ConfigError(f"cannot create the export directory {out}: {e.strerror or e}") from None
    sd = hf_state_dict(module, cfg)
    try:
        _write_json(out / "config.json", cfg)
        save_file(sd, str(out / "model.safetensors"), metadata={"format": "pt"})
        tok_cfg = write_tokenizer(tokenizer, out, module.max_seq_len) if tokenizer is not None else {}
    except OSError as e:
        raise ConfigError(f"cannot write the export in {out}: {e.strerror or e}") from None
    stops = list(getattr(tokenizer, "stop_ids", ()) or ())
    pad = tok_cfg.get("pad_token")
    if stops and eos_id in stops:  # EOS first, then the other stop ids (llama2.c stops at BOS too)
        stops = [eos_id] + [i for i in stops if i != eos_id]
    gen = {"bos_token_id": bos_id, "eos_token_id": _one_or_list(stops) if stops else eos_id, "do_sample": False}
    if pad is not None:
        gen["pad_token_id"] = tokenizer.to_hf().token_to_id(pad)
    try:
        _write_json(out / "generation_config.json", gen)
    except OSError as e:
        raise ConfigError(f"cannot write the export in {out}: {e.strerror or e}") from None
    return out


HF_FILES = ("config.json", "model.safetensors", "generation_config.json", "tokenizer.json", "tokenizer_config.json",
            "special_tokens_map.json")  # what export_hf writes


def refuse_overwrite(out: str | Path, fmt: str, force: bool) -> None:
    """`mtpspec export` never replaces an earlier export unless --force: a GGUF file that exists, or any file of
    HF_FILES in the output directory, is a ConfigError naming it (checked before the model loads)."""
    out = Path(out)
    if fmt == "gguf":
        taken = [out] if out.exists() and not out.is_dir() else []  # a directory: write_gguf's own error
    elif out.exists() and not out.is_dir():
        raise ConfigError(f"--out {out} is a file: --format hf writes a directory")
    else:
        taken = [out / f for f in HF_FILES if (out / f).exists()]
    if taken and not force:
        raise ConfigError(f"{taken[0]} exists: give --force to overwrite it, or another --out")


def write_tokenizer(tokenizer, out: Path, max_len: int) -> dict:
    """tokenizer.json (our tokenizer as a `tokenizers.Tokenizer`), tokenizer_config.json and
    special_tokens_map.json; returns the tokenizer_config written."""
    if not hasattr(tokenizer, "to_hf"):
        raise ConfigError(f"export cannot write a {type(tokenizer).__name__} as a Hugging Face tokenizer")
    tokenizer.to_hf().save(str(out / "tokenizer.json"))
    cfg = {**tokenizer.hf_tokenizer_config(), "model_max_length": max_len}
    _write_json(out / "tokenizer_config.json", cfg)
    names = ("bos_token", "eos_token", "unk_token", "pad_token")
    _write_json(out / "special_tokens_map.json", {n: cfg[n] for n in names if cfg.get(n) is not None})
    return cfg


def _one_or_list(ids: list[int]) -> int | list[int]:
    return ids[0] if len(ids) == 1 else ids


def _write_json(path: Path, obj: dict) -> None:
    path.write_text(json.dumps(obj, indent=2, ensure_ascii=False) + "\n")


def load_hf(directory: str | Path):
    """transformers' causal LM for a directory (the class its config.json names), fp32, eval mode."""
    from transformers import AutoModelForCausalLM

    _quiet_transformers()
    return AutoModelForCausalLM.from_pretrained(str(directory), dtype=torch.float32).eval()


def _hf_fp64_or_none(directory: str | Path):
    """transformers' causal LM for a directory as its fp64 twin (mtpspec.hf_reference: its fixed fp32
    casts made fp64, the maths untouched). None when this transformers' source cannot be twinned."""
    from .errors import ModelLoadError
    from .hf_reference import load_hf_fp64 as twin

    _quiet_transformers()
    try:
        return twin(directory)
    except ModelLoadError:  # another transformers version's source: no fp64 reference
        return None


def _quiet_transformers() -> None:
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()
    hf_logging.set_verbosity_error()  # the hybrid's kept mtp.* tensors are "unused weights" to transformers


@torch.inference_mode()
def check_export(module, directory: str | Path, tokens: list[int], hf_model=None, fp64: bool = True) -> ExportCheck:
    """Compare our logits over `tokens` with transformers' on the exported checkpoint: fp32, each
    position within FP32_FLOOR eps32 of the logits' scale plus FP32_SENS times the function's
    sensitivity there; and (fp64=True) both in fp64, within FP64_TOL."""
    if module.dtype != torch.float32:
        raise ConfigError("export check runs in fp32; load the model with --dtype fp32")
    hf = hf_model if hf_model is not None else load_hf(directory)
    ids = torch.tensor(tokens, dtype=torch.long)
    ours = module.forward_tokens(ids, module.new_cache()).logits  # (T, V) fp32
    m64 = _fp64_copy(module)
    exact = m64.forward_tokens(ids, m64.new_cache()).logits  # (T, V) fp64
    sens = _sensitivity(m64, ids, exact)  # (T,)
    theirs = hf(ids[None]).logits[0].float()  # (T, V)
    diff = (ours - theirs).abs().amax(-1).double()  # (T,)
    scale = float(ours.abs().max())
    tol = FP32_FLOOR * torch.finfo(torch.float32).eps * scale + FP32_SENS * sens  # (T,)
    ratio = float((diff / tol).max()) if scale > 0 else float(diff.max() > 0)
    rel64 = None
    hf64 = _hf_fp64_or_none(directory) if fp64 else None
    if hf64 is not None:
        rel64 = float((hf64(ids[None]).logits[0] - exact).abs().max()) / max(float(exact.abs().max()), 1e-300)
    ok = ratio <= 1.0 and (rel64 is None or rel64 <= FP64_TOL)
    return ExportCheck(max_abs_diff=float(diff.max()), positions=len(tokens), ok=ok, max_abs_logit=scale,
                       fp32_error=float((ours.double() - exact).abs().max()), sensitivity=float(sens.max()),
                       worst_ratio=ratio, fp64_rel_diff=rel64)


def _fp64_copy(module):
    """An fp64 copy of `module`; refuses one that still computes its logits in another dtype."""
    m64 = copy.deepcopy(module).to(torch.float64)
    probe = m64.forward_tokens(torch.zeros(1, dtype=torch.long), m64.new_cache()).logits
    if probe.dtype != torch.float64:
        raise ConfigError(f"export check: our model computed {probe.dtype} logits in fp64 (it has an fp32 cast left)")
    return m64


def _sensitivity(m64, ids: torch.Tensor, exact: torch.Tensor, draws: int = 2) -> torch.Tensor:
    """max |logits change| per position (T,) when every weight of the fp64 model is scaled by
    1 +- eps32 (random signs; the largest of `draws` seeded draws)."""
    eps = torch.finfo(torch.float32).eps
    gen = torch.Generator().manual_seed(0)
    out = torch.zeros(len(ids), dtype=torch.float64)
    for _ in range(draws):
        p = copy.deepcopy(m64)
        for w in p.parameters():
            w.mul_(1 + eps * (2 * torch.randint(0, 2, w.shape, generator=gen) - 1).to(torch.float64))
        out = torch.maximum(out, (p.forward_tokens(ids, p.new_cache()).logits - exact).abs().amax(-1))
    return out


def check_tokenizer(tokenizer, directory: str | Path, texts: list[str]) -> bool:
    """Whether transformers' AutoTokenizer on the exported directory encodes `texts` as we do."""
    from transformers import AutoTokenizer

    hf = AutoTokenizer.from_pretrained(str(directory))
    return all(hf(t)["input_ids"] == tokenizer.encode(t) for t in texts)


def _args(p: argparse.ArgumentParser) -> None:
    p.add_argument("model_path", nargs="?", help="model to export (same as --model)")
    add_model_args(p)
    p.set_defaults(model=None)
    for a in p._actions:  # --model is optional here: the positional path works too
        if a.dest == "model":
            a.required = False
    p.add_argument("--out", required=True, help="output: a directory (--format hf) or a file (--format gguf)")
    p.add_argument("--format", default="hf", choices=("hf", "gguf"),
                   help="hf: a Hugging Face checkpoint directory (default); gguf: one GGUF file for llama.cpp")
    p.add_argument("--outtype", default=None, help="GGUF tensor type: f32 (default), f16, bf16 or q8_0 (--format gguf only)")
    p.add_argument("--no-check", action="store_true", help="skip the logits and tokenizer checks against transformers (hf)")
    p.add_argument("--target", default=None,
                   help="exporting a trained eagle3 head (a `train head` folder): its target model, whose tokenizer the "
                        "GGUF carries and whose special ids config.json names")
    p.add_argument("--force", action="store_true",
                   help="overwrite an existing GGUF file, or an earlier export's files in the --out directory (default: refuse)")


CHECK_TEXTS = ["Once upon a time, there was a little girl named Lily. She loved to play outside.",
               "def parse_args(argv):\n    \"\"\"Parse the command line.\"\"\"\n    return argv[1:]  # caf\u00e9 \u2713"]


@command("export", help="write a model as a Hugging Face checkpoint directory (--format hf) or one GGUF file for "
                        "llama.cpp (--format gguf)")(_args)
def run_export(args: argparse.Namespace) -> int:
    from .api import load

    path = args.model or args.model_path
    if not path:
        raise ConfigError("export needs a model: mtpspec export MODEL --out DIR")
    from .models.heads import is_head_dir

    if is_head_dir(path):
        return _run_export_head(args, path)
    if args.target is not None:
        raise ConfigError("--target names the target of a trained head; the model exported here is not a head folder")
    if args.format == "gguf":
        return _run_export_gguf(args, path)
    if args.outtype is not None:
        raise ConfigError("--outtype sets the GGUF tensor type: use it with --format gguf")
    refuse_overwrite(args.out, "hf", args.force)
    model = load(path, args.tokenizer, "fp32")
    out = export_hf(model.module, args.out, *special_ids(model.tokenizer), tokenizer=model.tokenizer)
    print(f"wrote {out}: " + ", ".join(sorted(p.name for p in out.iterdir() if p.is_file())))
    if args.no_check:
        return 0
    import importlib.util

    if importlib.util.find_spec("transformers") is None:
        print("checks skipped: transformers is not installed (pip install 'mtpspec[hf]')")
        return 0
    ids = model.encode(CHECK_TEXTS[0])
    chk = check_export(model.module, out, ids)
    fp64 = "not run (transformers' source did not load in fp64)" if chk.fp64_rel_diff is None else f"{chk.fp64_rel_diff:.1e} of the logits' scale"
    print(f"logits check vs transformers over {chk.positions} positions: fp32 max |diff| = {chk.max_abs_diff:.2e} "
          f"(logits up to {chk.max_abs_logit:.1f}; {chk.worst_ratio:.2f} of the tolerance), fp64 {fp64}: {'ok' if chk.ok else 'FAILED'}")
    same = check_tokenizer(model.tokenizer, out, CHECK_TEXTS)
    print(f"tokenizer check: AutoTokenizer encodes as we do: {'ok' if same else 'FAILED'}")
    return 0 if chk.ok and same else 1


def _run_export_gguf(args: argparse.Namespace, path: str) -> int:
    """`export --format gguf`: one file for llama.cpp, then a one-line summary."""
    from .api import load
    from .export_gguf import OUTTYPES, write_gguf

    outtype = args.outtype or "f32"
    if outtype not in OUTTYPES:
        raise ConfigError(f"--outtype must be one of {', '.join(OUTTYPES)}, got {outtype!r}")
    refuse_overwrite(args.out, "gguf", args.force)
    model = load(path, args.tokenizer, "fp32")
    done = write_gguf(model.module, model.tokenizer, args.out, outtype)
    note = f"; {len(done.fallback_f16)} matrices f16 (rows not a multiple of 32)" if done.fallback_f16 else ""
    print(f"wrote {done.path}: GGUF {done.arch}, {done.tensors} tensors, {outtype}{note}, {done.bytes / 1e6:.1f} MB")
    return 0


def _run_export_head(args: argparse.Namespace, path: str) -> int:
    """`export HEAD_FOLDER --target MODEL`: an EAGLE-3 head as vLLM / SGLang load it (hf) or llama.cpp does (gguf)."""
    from .api import load
    from .export_eagle3 import export_eagle3_gguf, export_eagle3_hf
    from .models.heads import check_fits, load_head

    head = load_head(path)
    if head.config.kind != "eagle3":
        raise ConfigError(f"{path} is a {head.config.kind} head; `mtpspec export` writes eagle3 heads (vLLM / SGLang / llama.cpp layouts)")
    if args.target is None:
        raise ConfigError("exporting a head needs its target model: --target MODEL (its tokenizer and special ids)")
    refuse_overwrite(args.out, args.format, args.force)
    target = load(args.target, args.tokenizer, "fp32")
    check_fits(head, target.module)
    if args.format == "gguf":
        outtype = args.outtype or "f32"
        done = export_eagle3_gguf(head, target.tokenizer, args.out, outtype)
        print(f"wrote {done.path}: GGUF eagle3, {done.tensors} tensors, {outtype}, {done.bytes / 1e6:.1f} MB")
        return 0
    if args.outtype is not None:
        raise ConfigError("--outtype sets the GGUF tensor type: use it with --format gguf")
    out = export_eagle3_hf(head, args.out, *special_ids(target.tokenizer))
    print(f"wrote {out}: " + ", ".join(sorted(p.name for p in out.iterdir() if p.is_file())))
    return 0

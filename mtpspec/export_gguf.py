"""`mtpspec export --format gguf`: write a model as one GGUF file that llama.cpp loads and runs.

- a Qwen3.5-style hybrid with dense MLPs (HybridLM, e.g. the demo) -> llama.cpp arch `qwen35`, its
  MTP module kept as the extra block `blk.{L}.nextn.*` + `qwen35.nextn_predict_layers`, so
  `llama-server --spec-type draft-mtp` drafts with it;
- a hybrid with a mixture of experts in every layer -> arch `qwen3next` (same MTP layout);
- a dense Llama (DenseLM, e.g. a llama2.c checkpoint) -> arch `llama`.

The names, metadata keys and weight transformations are those of llama.cpp's own converter
(build 11434, convert_hf_to_gguf.py: Qwen3NextModel / Qwen3_5TextModel / LlamaModel) applied to our
Hugging Face export, so the file is the one the converter would write, without the round trip:

- zero-centred RMSNorm weights w are stored as 1 + w (llama.cpp's RMSNorm multiplies by the weight);
  the DeltaNet's gated norm (`ssm_norm`) is a plain one and stays;
- A_log -> `ssm_a` = -exp(A_log); dt_bias -> `ssm_dt.bias`; conv1d (C, 1, K) -> (C, K);
- qwen35 with fewer key than value heads: the value heads are reordered from grouped by key head
  (k0v0 k0v1 k1v0 k1v1) to tiled (k0v0 k1v0 k0v1 k1v1) in every tensor indexed by value head
  (the V rows of attn_qkv, attn_gate, ssm_beta, ssm_alpha, ssm_a, ssm_dt, the V channels of
  ssm_conv1d, the columns of ssm_out): ggml broadcasts the key heads in tiled order;
- qwen3next keeps the grouped order, b / a fused per key head (`ssm_ba`), experts stacked;
- q_proj keeps Qwen's [q | gate] per head (llama.cpp views it with a stride of 2 head_dim);
- llama: q / k rows are permuted from our half-split rotary layout back to llama.cpp's adjacent
  pairs (the inverse of the converter's permute; for a llama2.c checkpoint this is its own wq / wk).

Tensor types follow the converter too: 1-D tensors, norms, ssm_conv1d, ssm_a and biases stay F32;
every other matrix takes `outtype` (f32, f16, bf16, q8_0; q8_0 needs rows of a multiple of 32
values, and a matrix whose rows are not falls back to f16, as the converter does).

Tokenizers: a Hugging Face byte-level BPE (GPT-2 pre-tokenizer, as the demo's) -> "gpt2" with its
merges and pre-tokenizer "gpt-2"; a llama2.c tokenizer -> "llama" (SentencePiece) with its scores,
byte pieces typed as bytes, " " written as U+2581, so llama.cpp's tokenizer gives our ids.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from .errors import ConfigError
from .export_layout import fuse_qwen3_next, is_hybrid

OUTTYPES = ("f32", "f16", "bf16", "q8_0")

# general.file_type (llama.cpp's LLAMA_FTYPE_*): all F32, mostly F16, mostly Q8_0, mostly BF16
_FILE_TYPE = {"f32": 0, "f16": 1, "q8_0": 7, "bf16": 32}

# llama.cpp's token types (tokenizer.ggml.token_type)
NORMAL, UNKNOWN, CONTROL, USER_DEFINED, UNUSED, BYTE = 1, 2, 3, 4, 5, 6



def rope_sections(rot_dim: int) -> list[int]:
    """qwen35.rope.dimension_sections for `rot_dim` rotary dims (P = rot_dim / 2 pairs).

    llama.cpp's qwen35 rotates interleaved multi-axis (IMROPE): pair i takes the position of axis
    t, h or w when i % 3 is 0, 1 or 2 and i < 3 * sections[that axis], else the 4th axis, which
    holds 0 for text (a text token's positions are [p, p, p, 0]); and ggml asserts sum(sections)
    <= head_dim. [ceil(P/3), floor((P+1)/3), floor(P/3), 0] sums to P and gives every pair a text
    axis, so all pairs rotate by p, as ours do. For Qwen3.5's own shape (P = 32) it is the
    converter's [11, 11, 10, 0]; the converter writes that for every model, which a head_dim below
    32 fails (GGML_ASSERT(sect_dims <= ne0)).
    """
    pairs = rot_dim // 2
    return [-(-pairs // 3), (pairs + 1) // 3, pairs // 3, 0]


@dataclass(frozen=True)
class GGUFTensor:
    """One tensor as it goes into the file: llama.cpp's name, the fp32 values, the stored type."""

    name: str
    data: np.ndarray  # float32, in PyTorch's (row-major) shape; GGUF records it reversed (ggml's ne)
    qtype: str  # "f32", "f16", "bf16" or "q8_0"


@dataclass(frozen=True)
class GGUFExport:
    """What export_gguf wrote."""

    path: Path
    arch: str  # llama.cpp architecture name
    tensors: int
    bytes: int  # file size
    fallback_f16: tuple[str, ...] = ()  # matrices stored f16 because q8_0 did not fit their rows


def export_gguf(module, tokenizer, out: str | Path, outtype: str = "f32") -> Path:
    """Write `module` (DenseLM or HybridLM) with `tokenizer` as the GGUF file `out`; returns its path."""
    return write_gguf(module, tokenizer, out, outtype).path


def write_gguf(module, tokenizer, out: str | Path, outtype: str = "f32") -> GGUFExport:
    """export_gguf, returning what was written (tensor count, size, any f16 fallback)."""
    import gguf

    if outtype not in OUTTYPES:
        raise ConfigError(f"unknown GGUF outtype {outtype!r} (choose from: {', '.join(OUTTYPES)})")
    if tokenizer is None:
        raise ConfigError("GGUF export needs the model's tokenizer (llama.cpp reads it from the file): give --tokenizer")
    out = Path(out)
    if out.is_dir():
        raise ConfigError(f"GGUF export writes one file, and {out} is a directory: give a file path such as {out / 'model.gguf'}")
    arch, meta = gguf_metadata(module)
    tensors = gguf_tensors(module, outtype)
    meta.update(tokenizer_metadata(tokenizer, module.config.vocab_size))
    meta["general.file_type"] = _FILE_TYPE[outtype]
    meta["general.quantization_version"] = 2  # ggml's quantized-block format version, as the converter writes
    try:
        out.parent.mkdir(parents=True, exist_ok=True)
        writer = gguf.GGUFWriter(str(out), arch)
    except OSError as e:
        raise ConfigError(f"cannot write the GGUF file {out}: {e.strerror or e}") from None
    fallback = []
    for key, value in meta.items():
        _add_kv(writer, key, value)
    for t in tensors:
        data, qtype = _encode(t, gguf)
        if qtype != t.qtype:
            fallback.append(t.name)
        writer.add_tensor(t.name, data, raw_dtype=_QTYPE(gguf)[qtype])
    try:  # the file is opened here (GGUFWriter opens it on the first write)
        writer.write_header_to_file()
        writer.write_kv_data_to_file()
        writer.write_tensors_to_file()
    except OSError as e:
        raise ConfigError(f"cannot write the GGUF file {out}: {e.strerror or e}") from None
    finally:
        writer.close()
    return GGUFExport(path=out, arch=arch, tensors=len(tensors), bytes=out.stat().st_size, fallback_f16=tuple(fallback))


def _QTYPE(gguf) -> dict:
    q = gguf.GGMLQuantizationType
    return {"f32": q.F32, "f16": q.F16, "bf16": q.BF16, "q8_0": q.Q8_0}


def _encode(t: GGUFTensor, gguf) -> tuple[np.ndarray, str]:
    """The stored bytes (or float array) of `t` and the type they are in."""
    if t.qtype == "f32":
        return t.data, "f32"
    if t.qtype == "f16":
        return t.data.astype(np.float16), "f16"
    try:
        return gguf.quants.quantize(t.data, _QTYPE(gguf)[t.qtype]), t.qtype
    except gguf.QuantError:  # q8_0: rows of a multiple of 32 values only
        return t.data.astype(np.float16), "f16"


def _add_kv(writer, key: str, value) -> None:
    """One metadata key, typed as llama.cpp reads it: str, bool, uint32 (ints), float32, arrays."""
    if isinstance(value, str):
        writer.add_string(key, value)
    elif isinstance(value, bool):
        writer.add_bool(key, value)
    elif isinstance(value, int):
        writer.add_uint32(key, value)
    elif isinstance(value, float):
        writer.add_float32(key, value)
    elif isinstance(value, list):
        writer.add_array(key, value)
    else:
        raise TypeError(f"metadata {key}: unsupported value {value!r}")


# ---------------------------------------------------------------------------------------------
# metadata


def gguf_arch(module) -> str:
    """llama.cpp's architecture for `module`: qwen35, qwen3next or llama (or a clear refusal)."""
    if is_hybrid(module):
        return "qwen3next" if module.config.num_experts > 0 else "qwen35"
    from .models.dense import DenseLM

    if not isinstance(module, DenseLM):
        raise ConfigError(f"GGUF export supports Qwen3.5-style hybrids and dense Llama models, not a {type(module).__name__}")
    return "llama"


def gguf_metadata(module) -> tuple[str, dict]:
    """(architecture, {key: value}) for the model part of the file (the tokenizer's keys are separate)."""
    arch = gguf_arch(module)
    return arch, (_hybrid_metadata(module.config, arch) if arch != "llama" else _llama_metadata(module.config))


def _llama_metadata(c) -> dict:
    for flag, what in (("qk_norm", "q/k norms (Qwen3)"), ("attention_bias", "attention biases"), ("o_proj_bias", "an o_proj bias"),
                       ("mlp_bias", "MLP biases")):
        if getattr(c, flag, False):
            raise ConfigError(f"GGUF export of a dense model supports plain Llama models; this one has {what}")
    if any(c.layer_windows):
        raise ConfigError("GGUF export of a dense model supports plain Llama models; this one has sliding-window layers")
    kind = (c.rope_scaling or {}).get("rope_type", "default")
    if kind not in ("default", "linear"):
        raise ConfigError(f"GGUF export supports default and linear rope scaling, not {kind!r}")
    a = "llama"
    meta = {
        "general.type": "model",
        f"{a}.vocab_size": c.vocab_size,
        f"{a}.context_length": c.max_seq_len,
        f"{a}.embedding_length": c.hidden_size,
        f"{a}.block_count": c.num_layers,
        f"{a}.feed_forward_length": c.intermediate_size,
        f"{a}.attention.head_count": c.num_heads,
        f"{a}.attention.head_count_kv": c.num_kv_heads,
        f"{a}.attention.key_length": c.hd,
        f"{a}.attention.value_length": c.hd,
        f"{a}.attention.layer_norm_rms_epsilon": float(c.norm_eps),
        f"{a}.rope.freq_base": float(c.rope_theta),
        f"{a}.rope.dimension_count": c.hd,
    }
    if kind == "linear":
        meta[f"{a}.rope.scaling.type"] = "linear"
        meta[f"{a}.rope.scaling.factor"] = float(c.rope_scaling["factor"])
    return meta


def _hybrid_metadata(c, arch: str) -> dict:
    if c.linear_key_head_dim != c.linear_value_head_dim:
        raise ConfigError(f"llama.cpp's {arch} needs equal DeltaNet key and value head sizes "
                          f"(this model: {c.linear_key_head_dim} and {c.linear_value_head_dim})")
    if c.linear_num_value_heads % c.linear_num_key_heads:
        raise ConfigError("the DeltaNet's value heads must be a multiple of its key heads")
    if arch == "qwen3next":
        dense = [i for i in range(c.num_layers) if not c.is_sparse(i)]
        if dense:
            raise ConfigError(f"llama.cpp's qwen3next has experts in every layer; layers {dense} of this model have a dense MLP")
        if not c.norm_topk_prob:
            raise ConfigError("llama.cpp's qwen3next renormalises the top-k expert weights; this model has norm_topk_prob false")
    if c.sparse_attention is not None or c.mtp_sparse_attention is not None:
        raise ConfigError("llama.cpp has no tensor names for this model's block-sparse attention indexer "
                          "(export it in Hugging Face format instead: mtpspec export MODEL --out DIR)")
    if c.mtp_num_layers > 1:
        raise ConfigError(f"llama.cpp runs one MTP (nextn) layer; this model's MTP module has {c.mtp_num_layers} "
                          "(export it in Hugging Face format instead: mtpspec export MODEL --out DIR)")
    a = arch
    meta = {
        "general.type": "model",
        f"{a}.vocab_size": c.vocab_size,
        f"{a}.block_count": c.num_layers + c.mtp_num_layers,
        f"{a}.context_length": c.max_seq_len,
        f"{a}.embedding_length": c.hidden_size,
        f"{a}.feed_forward_length": c.intermediate_size,
        f"{a}.attention.head_count": c.num_heads,
        f"{a}.attention.head_count_kv": c.num_kv_heads,
        f"{a}.attention.key_length": c.head_dim,
        f"{a}.attention.value_length": c.head_dim,
        f"{a}.attention.layer_norm_rms_epsilon": float(c.norm_eps),
        f"{a}.rope.freq_base": float(c.rope_theta),
        f"{a}.rope.dimension_count": c.rot_dim,
        f"{a}.ssm.conv_kernel": c.linear_conv_kernel_dim,
        f"{a}.ssm.state_size": c.linear_key_head_dim,
        f"{a}.ssm.group_count": c.linear_num_key_heads,
        f"{a}.ssm.time_step_rank": c.linear_num_value_heads,
        f"{a}.ssm.inner_size": c.linear_value_head_dim * c.linear_num_value_heads,
        # one flag per block, the MTP block(s) last and not recurrent
        f"{a}.attention.recurrent_layers": [t == "linear_attention" for t in c.layer_types] + [False] * c.mtp_num_layers,
    }
    if c.mtp_num_layers:
        meta[f"{a}.nextn_predict_layers"] = c.mtp_num_layers
    if arch == "qwen35":
        meta[f"{a}.rope.dimension_sections"] = rope_sections(c.rot_dim)
    else:
        meta[f"{a}.expert_count"] = c.num_experts
        meta[f"{a}.expert_used_count"] = c.num_experts_per_tok
        meta[f"{a}.expert_feed_forward_length"] = c.moe_intermediate_size
        meta[f"{a}.expert_shared_feed_forward_length"] = c.shared_expert_intermediate_size
    return meta


# ---------------------------------------------------------------------------------------------
# tensors


def gguf_tensors(module, outtype: str = "f32") -> list[GGUFTensor]:
    """Every tensor of the file in order, under llama.cpp's names, transformed as its converter does."""
    if outtype not in OUTTYPES:
        raise ConfigError(f"unknown GGUF outtype {outtype!r} (choose from: {', '.join(OUTTYPES)})")
    arch = gguf_arch(module)
    sd = {k: v.detach().to(torch.float32).contiguous() for k, v in module.state_dict().items()}
    named = _llama_tensors(module.config, sd) if arch == "llama" else _hybrid_tensors(module.config, sd, arch)
    return [GGUFTensor(name, _numpy(t), stored_type(name, t.ndim, outtype)) for name, t in named]


def stored_type(name: str, ndim: int, outtype: str) -> str:
    """The converter's rule: vectors, norms, the DeltaNet's conv kernel, the router inputs and anything
    that is not a `.weight` stay F32; the other matrices take outtype."""
    keep = (ndim <= 1 or name.endswith("_norm.weight") or ".ssm_conv1d." in name or ".ffn_gate_inp" in name
            or not name.endswith(".weight"))
    return "f32" if keep else outtype


def _numpy(t: torch.Tensor) -> np.ndarray:
    return np.ascontiguousarray(t.numpy(), dtype=np.float32)


def permute_rope_interleaved(w: torch.Tensor, n_heads: int) -> torch.Tensor:
    """q / k rows (n_heads * hd, dim) from the half-split rotary layout to adjacent pairs (llama.cpp's
    "norm" rope): row i of a head's first half and row i of its second half become rows 2i, 2i + 1."""
    out_dim, dim = w.shape
    hd = out_dim // n_heads
    return w.reshape(n_heads, 2, hd // 2, dim).transpose(1, 2).reshape(out_dim, dim)


def _llama_tensors(c, sd: dict) -> list[tuple[str, torch.Tensor]]:
    out = [("token_embd.weight", sd["model.embed_tokens.weight"])]
    for i in range(c.num_layers):
        p = f"model.layers.{i}."
        out += [
            (f"blk.{i}.attn_norm.weight", sd[p + "input_layernorm.weight"]),
            (f"blk.{i}.attn_q.weight", permute_rope_interleaved(sd[p + "self_attn.q_proj.weight"], c.num_heads)),
            (f"blk.{i}.attn_k.weight", permute_rope_interleaved(sd[p + "self_attn.k_proj.weight"], c.num_kv_heads)),
            (f"blk.{i}.attn_v.weight", sd[p + "self_attn.v_proj.weight"]),
            (f"blk.{i}.attn_output.weight", sd[p + "self_attn.o_proj.weight"]),
            (f"blk.{i}.ffn_norm.weight", sd[p + "post_attention_layernorm.weight"]),
            (f"blk.{i}.ffn_gate.weight", sd[p + "mlp.gate_proj.weight"]),
            (f"blk.{i}.ffn_up.weight", sd[p + "mlp.up_proj.weight"]),
            (f"blk.{i}.ffn_down.weight", sd[p + "mlp.down_proj.weight"]),
        ]
    out.append(("output_norm.weight", sd["model.norm.weight"]))
    if not c.tie_embeddings:
        out.append(("output.weight", sd["lm_head.weight"]))
    return out


def tiled_order(nk: int, r: int, size: int) -> torch.Tensor:
    """Index (nk * r * size,) taking value heads grouped by key head (k0v0 k0v1 .. k1v0 ..) to the tiled
    order ggml broadcasts in (k0v0 k1v0 .. k0v1 k1v1 ..); `size` entries per value head."""
    return torch.arange(nk * r * size).reshape(nk, r, size).transpose(0, 1).reshape(-1)


def _hybrid_tensors(c, sd: dict, arch: str) -> list[tuple[str, torch.Tensor]]:
    out = [("token_embd.weight", sd["model.embed_tokens.weight"])]
    for i, lt in enumerate(c.layer_types):
        out += _hybrid_block(c, sd, f"model.layers.{i}.", i, lt, arch)
    out.append(("output_norm.weight", 1.0 + sd["model.norm.weight"]))
    if not c.tie_embeddings:
        out.append(("output.weight", sd["lm_head.weight"]))
    for j in range(c.mtp_num_layers):
        b = c.num_layers + j  # the MTP block follows the decoder's blocks
        out += [
            (f"blk.{b}.nextn.eh_proj.weight", sd["mtp.fc.weight"]),  # (H, 2H): [norm_e(embedding) | norm_h(hidden)]
            (f"blk.{b}.nextn.enorm.weight", 1.0 + sd["mtp.pre_fc_norm_embedding.weight"]),
            (f"blk.{b}.nextn.hnorm.weight", 1.0 + sd["mtp.pre_fc_norm_hidden.weight"]),
            (f"blk.{b}.nextn.shared_head_norm.weight", 1.0 + sd["mtp.norm.weight"]),
        ]
        out += _hybrid_block(c, sd, f"mtp.layers.{j}.", b, "full_attention", arch)
    return out


def _hybrid_block(c, sd: dict, p: str, b: int, layer_type: str, arch: str) -> list[tuple[str, torch.Tensor]]:
    out = [(f"blk.{b}.attn_norm.weight", 1.0 + sd[p + "input_layernorm.weight"])]
    if layer_type == "linear_attention":
        out += _deltanet(c, sd, p + "linear_attn.", b, arch)
    else:
        a = p + "self_attn."
        if a + "q_proj.bias" in sd:
            raise ConfigError("GGUF export of a hybrid does not support attention biases (llama.cpp's qwen35 has none)")
        out += [
            (f"blk.{b}.attn_q.weight", sd[a + "q_proj.weight"]),  # (nh * 2hd, H): [q | gate] per head
            (f"blk.{b}.attn_k.weight", sd[a + "k_proj.weight"]),
            (f"blk.{b}.attn_v.weight", sd[a + "v_proj.weight"]),
            (f"blk.{b}.attn_output.weight", sd[a + "o_proj.weight"]),
            (f"blk.{b}.attn_q_norm.weight", 1.0 + sd[a + "q_norm.weight"]),
            (f"blk.{b}.attn_k_norm.weight", 1.0 + sd[a + "k_norm.weight"]),
        ]
    out.append((f"blk.{b}.post_attention_norm.weight", 1.0 + sd[p + "post_attention_layernorm.weight"]))
    m = p + "mlp."
    if arch == "qwen35":
        out += [(f"blk.{b}.ffn_gate.weight", sd[m + "gate_proj.weight"]), (f"blk.{b}.ffn_up.weight", sd[m + "up_proj.weight"]),
                (f"blk.{b}.ffn_down.weight", sd[m + "down_proj.weight"])]
    else:
        stack = lambda w: torch.stack([sd[f"{m}experts.{e}.{w}.weight"] for e in range(c.num_experts)])  # noqa: E731  (E, out, in)
        out += [
            (f"blk.{b}.ffn_gate_inp.weight", sd[m + "gate.weight"]),  # (E, H)
            (f"blk.{b}.ffn_gate_exps.weight", stack("gate_proj")),
            (f"blk.{b}.ffn_up_exps.weight", stack("up_proj")),
            (f"blk.{b}.ffn_down_exps.weight", stack("down_proj")),
            (f"blk.{b}.ffn_gate_inp_shexp.weight", sd[m + "shared_expert_gate.weight"]),  # (1, H)
            (f"blk.{b}.ffn_gate_shexp.weight", sd[m + "shared_expert.gate_proj.weight"]),
            (f"blk.{b}.ffn_up_shexp.weight", sd[m + "shared_expert.up_proj.weight"]),
            (f"blk.{b}.ffn_down_shexp.weight", sd[m + "shared_expert.down_proj.weight"]),
        ]
    return out


def _deltanet(c, sd: dict, p: str, b: int, arch: str) -> list[tuple[str, torch.Tensor]]:
    nk, nv, dk, dv = c.linear_num_key_heads, c.linear_num_value_heads, c.linear_key_head_dim, c.linear_value_head_dim
    r = nv // nk
    qkv, z = sd[p + "in_proj_qkv.weight"], sd[p + "in_proj_z.weight"]  # (2 nk dk + nv dv, H), (nv dv, H)
    w_b, w_a = sd[p + "in_proj_b.weight"], sd[p + "in_proj_a.weight"]  # (nv, H) each
    conv = sd[p + "conv1d.weight"].reshape(qkv.shape[0], -1)  # (C, 1, K) -> (C, K)
    ssm_a = -torch.exp(sd[p + "A_log"])  # (nv,)
    dt = sd[p + "dt_bias"]  # (nv,)
    out_proj = sd[p + "out_proj.weight"]  # (H, nv dv)
    if arch == "qwen3next":
        _, ba = fuse_qwen3_next(c, qkv, z, w_b, w_a)  # (nk * 2r, H): [b | a] per key head
        proj = [(f"blk.{b}.ssm_ba.weight", ba)]
    else:
        if r > 1:  # value heads grouped by key head -> tiled
            qk = 2 * nk * dk
            qkv = torch.cat([qkv[:qk], qkv[qk:][tiled_order(nk, r, dv)]])
            conv = torch.cat([conv[:qk], conv[qk:][tiled_order(nk, r, dv)]])
            z = z[tiled_order(nk, r, dv)]
            heads = tiled_order(nk, r, 1)
            w_b, w_a, ssm_a, dt = w_b[heads], w_a[heads], ssm_a[heads], dt[heads]
            out_proj = out_proj[:, tiled_order(nk, r, dv)]
        proj = [(f"blk.{b}.ssm_beta.weight", w_b), (f"blk.{b}.ssm_alpha.weight", w_a)]
    return [
        (f"blk.{b}.attn_qkv.weight", qkv),
        (f"blk.{b}.attn_gate.weight", z),
        *proj,
        (f"blk.{b}.ssm_conv1d.weight", conv),
        (f"blk.{b}.ssm_a", ssm_a),
        (f"blk.{b}.ssm_dt.bias", dt),
        (f"blk.{b}.ssm_norm.weight", sd[p + "norm.weight"]),  # the gated norm: not zero-centred
        (f"blk.{b}.ssm_out.weight", out_proj),
    ]


# ---------------------------------------------------------------------------------------------
# tokenizer


def tokenizer_metadata(tokenizer, vocab_size: int) -> dict:
    """tokenizer.ggml.* keys for a llama2.c tokenizer ("llama") or a byte-level BPE ("gpt2")."""
    from .loading.tokenizer_hf import HFTokenizer
    from .loading.tokenizer_llama2c import Llama2cTokenizer

    if isinstance(tokenizer, Llama2cTokenizer):
        return _spm_metadata(tokenizer, vocab_size)
    if isinstance(tokenizer, HFTokenizer):
        return _bpe_metadata(tokenizer, vocab_size)
    raise ConfigError(f"GGUF export cannot write a {type(tokenizer).__name__} tokenizer")


def _spm_metadata(tok, vocab_size: int) -> dict:
    """llama.cpp's SentencePiece tokenizer merges the adjacent pair of the highest score, the leftmost
    on ties, with byte fallback and a dummy-prefix space: run.c's algorithm, so the scores carry over."""
    if tok.vocab_size != vocab_size:
        raise ConfigError(f"the tokenizer has {tok.vocab_size} tokens but the model's vocabulary is {vocab_size}")
    names = tok._hf_names()  # " " -> U+2581, the special ids named <unk> <s> </s>; refuses non-UTF-8 pieces
    types = []
    for i, piece in enumerate(tok.pieces):
        if i == 0:
            types.append(UNKNOWN)
        elif i in tok.HF_SPECIALS:
            types.append(CONTROL)
        elif tok._piece_bytes(piece) != piece:  # <0xNN>
            types.append(BYTE)
        else:
            types.append(NORMAL)
    for s in tok.scores:
        if not math.isfinite(s):
            raise ConfigError("a tokenizer score is not a finite number")
    return {
        "tokenizer.ggml.model": "llama",
        "tokenizer.ggml.pre": "default",
        "tokenizer.ggml.tokens": names,
        "tokenizer.ggml.scores": [float(s) for s in tok.scores],
        "tokenizer.ggml.token_type": types,
        "tokenizer.ggml.bos_token_id": tok.bos_id,
        "tokenizer.ggml.eos_token_id": tok.eos_id,
        "tokenizer.ggml.unknown_token_id": 0,
        "tokenizer.ggml.padding_token_id": 0,
        "tokenizer.ggml.add_bos_token": True,
        "tokenizer.ggml.add_eos_token": False,
        "tokenizer.ggml.add_space_prefix": True,
    }


def _bpe_metadata(tok, vocab_size: int) -> dict:
    spec = json.loads(tok.tokenizer.to_str())
    model, pre = spec.get("model") or {}, spec.get("pre_tokenizer") or {}
    if model.get("type") != "BPE" or model.get("byte_fallback"):
        raise ConfigError(f"GGUF export writes byte-level BPE tokenizers; this tokenizer.json has a {model.get('type')} model")
    if spec.get("normalizer") or pre.get("type") != "ByteLevel" or not pre.get("use_regex", True) or pre.get("add_prefix_space"):
        raise ConfigError("GGUF export supports the GPT-2 byte-level pre-tokenizer (ByteLevel, its regex, no prefix "
                          f"space, no normalizer); this tokenizer has {pre.get('type')} / normalizer {spec.get('normalizer')}")
    vocab = tok.tokenizer.get_vocab(with_added_tokens=True)  # token -> id
    n = len(vocab)
    if n > vocab_size or set(vocab.values()) != set(range(n)):
        raise ConfigError(f"the tokenizer's {n} ids do not fit the model's vocabulary of {vocab_size}")
    tokens = [f"[PAD{i}]" for i in range(vocab_size)]
    types = [UNUSED] * vocab_size
    for text, i in vocab.items():
        tokens[i], types[i] = text, NORMAL
    for i, added in tok.tokenizer.get_added_tokens_decoder().items():
        types[i] = CONTROL if added.special else USER_DEFINED
    merges = [m if isinstance(m, str) else " ".join(m) for m in model.get("merges", [])]
    meta = {
        "tokenizer.ggml.model": "gpt2",
        "tokenizer.ggml.pre": "gpt-2",
        "tokenizer.ggml.tokens": tokens,
        "tokenizer.ggml.token_type": types,
        "tokenizer.ggml.merges": merges,
        "tokenizer.ggml.add_bos_token": tok.bos_id is not None,
        "tokenizer.ggml.add_eos_token": False,
    }
    if tok.bos_id is not None:
        meta["tokenizer.ggml.bos_token_id"] = tok.bos_id
    if tok.stop_ids:
        meta["tokenizer.ggml.eos_token_id"] = tok.stop_ids[0]
        meta["tokenizer.ggml.padding_token_id"] = tok.stop_ids[0]
    return meta

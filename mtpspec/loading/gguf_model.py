"""A dense model (llama, qwen2, qwen3, gemma3) from a GGUF file, its weights kept in their block types.

The file's metadata becomes a DenseConfig; its tensors go into the DenseLM built for that config, matrices as
BlockLinear / BlockEmbedding (models/blocks.py: the GGUF block kernel), vectors (norms, biases) as fp32
parameters. Strict, as every loader here: an architecture, key or tensor that does not fit is named in one line.

What llama.cpp's converter changed (loading/gguf.py has the details): llama's q / k rows are permuted to adjacent
rotary pairs, put back here; gemma3's norm weights are stored with Gemma's + 1 folded in, so they are plain
(x / rms * w) norms here.
"""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

import gguf
import numpy as np
import torch
from torch import nn

from ..errors import ModelLoadError
from ..kernels import quantized
from ..models.blocks import block_layer, tie_head
from ..models.dense import DenseConfig, DenseLM
from ..models.qwen35 import HybridLM
from .gguf import MAX_CONTEXT, GGUFConfig, GGUFFile, GGUFTensor, hf_tensor_names, llama_qk_rows, read_gguf
from .gguf_hybrid import HYBRID_ARCHS, load_gguf_hybrid

DENSE_ARCHS = ("llama", "qwen2", "qwen3", "gemma3")


def dense_config(f: GGUFFile, c: GGUFConfig, max_seq_len: int | None = None, dequantize: bool = False) -> DenseConfig:
    """The DenseConfig of a llama / qwen2 / qwen3 / gemma3 file's typed config, or a refusal naming what is not implemented."""
    if c.architecture not in DENSE_ARCHS:
        raise f.error(f"architecture '{c.architecture}' does not load as a model yet (supported: {', '.join(DENSE_ARCHS)})")
    if c.value_head_dim != c.head_dim or c.rope_dim != c.head_dim:
        raise f.error(f"value / rotary head sizes ({c.value_head_dim}, {c.rope_dim}) that differ from the key head size "
                      f"{c.head_dim} are not implemented")
    if c.final_logit_softcapping:
        raise f.error(f"final_logit_softcapping {c.final_logit_softcapping} is not implemented")
    if abs(c.query_scale * c.head_dim**0.5 - 1) > 1e-12:
        raise f.error("a query scale other than 1/sqrt(head size) is not implemented")
    kind = (c.rope_scaling or {}).get("rope_type", "default")
    if kind not in ("default", "linear"):
        raise f.error(f"rope scaling '{kind}' is not implemented (none, linear)")
    scaling = None if c.rope_scaling is None else {"rope_type": "linear", "factor": c.rope_scaling["factor"]}
    windows = tuple(c.sliding_window if t == "sliding_attention" else 0 for t in c.layer_types)
    gemma = c.architecture == "gemma3"
    return DenseConfig(
        vocab_size=c.vocab_size, hidden_size=c.hidden_size, num_layers=c.num_layers, num_heads=c.num_heads,
        num_kv_heads=c.num_kv_heads, intermediate_size=c.intermediate_size, head_dim=c.head_dim,
        max_seq_len=min(c.context_length, max_seq_len or MAX_CONTEXT), norm_eps=c.norm_eps, rope_theta=c.rope_theta,
        rope_scaling=scaling, tie_embeddings=c.tie_word_embeddings, qk_norm=c.qk_norm, attention_bias=c.attention_bias,
        o_proj_bias="blk.0.attn_output.bias" in f.tensors, layer_windows=windows if any(windows) else (),
        rope_local_theta=c.rope_local_theta or 0.0, sandwich_norms=gemma, embed_scale=gemma,
        hidden_act="gelu_tanh" if c.hidden_act == "gelu_pytorch_tanh" else "silu",
        norm_zero_centred=False,  # gemma3's norms are stored as 1 + w: a plain x / rms * w_file norm
        row_kernels=not dequantize,  # the block kernels' 8-bit activations need rows computed alike
    )


def load_gguf_model(source: str | Path | GGUFFile, dtype: torch.dtype = torch.float32, max_seq_len: int | None = None,
                    dequantize: bool = False) -> DenseLM | HybridLM:
    """The model of a GGUF file (a DenseLM; a HybridLM for qwen35, loading/gguf_hybrid.py). fp32: the matrices stay in their block types (BlockLinear, the block kernel with
    8-bit activations: the quantized model, as llama.cpp runs it). dequantize=True, or fp64 / bf16: every matrix
    dequantized exactly into an ordinary layer of that dtype (the function transformers computes from the file)."""
    f = source if isinstance(source, GGUFFile) else read_gguf(source)
    dequantize = dequantize or dtype != torch.float32
    if f.architecture in HYBRID_ARCHS:  # qwen35 with its nextn MTP layer (qwen3next / qwen35moe refused there, by name)
        return load_gguf_hybrid(f, dtype, max_seq_len, dequantize)
    c = f.config()
    cfg = dense_config(f, c, max_seq_len, dequantize)
    names = hf_tensor_names(f, c)  # every tensor named, required ones present, shapes checked against the config
    with torch.device("meta"):
        model = DenseLM(cfg)
    for gname, hf in names.items():
        t = f.tensors[gname]
        if cfg.tie_embeddings and hf == "lm_head.weight":
            continue
        data = t.data
        if c.qk_rows_interleaved and gname.endswith((".attn_q.weight", ".attn_k.weight", ".attn_q.bias", ".attn_k.bias")):
            heads = c.num_heads if ".attn_q." in gname else c.num_kv_heads
            data = data.reshape(t.shape[0], -1)[llama_qk_rows(heads, c.head_dim)]  # back to the half-split rotary layout
        _place(model, hf, t, data, dtype if dequantize else None)
    if cfg.tie_embeddings:
        tie_head(model)
    model.reset_buffers()  # the rotary tables were built on the meta device
    _release_freed_memory()  # the packing's temporary copies: returned to the system, not kept as free heap
    meta = [n for n, p in model.named_parameters() if p.is_meta]
    if meta:  # hf_tensor_names checked the file against the config: a parameter left here is a loader bug
        raise f.error(f"no tensor filled {', '.join(meta[:4])}")
    return model.eval()


def _place(model: nn.Module, name: str, t: GGUFTensor, data: np.ndarray, dense: torch.dtype | None) -> None:
    """One tensor into the model: a matrix becomes a BlockLinear / BlockEmbedding (or, with `dense`, an exactly
    dequantized weight of that dtype), a vector a parameter (fp32, or `dense`)."""
    owner_name, _, kind = name.rpartition(".")  # kind: weight or bias
    parent_name, _, leaf = owner_name.rpartition(".")
    parent = model.get_submodule(parent_name)
    old = getattr(parent, leaf)
    if kind == "weight" and len(t.shape) == 2 and dense is not None:
        w = gguf.quants.dequantize(np.ascontiguousarray(data), gguf.GGMLQuantizationType(t.ggml_type))  # (N, K), exact
        old.weight = nn.Parameter(torch.from_numpy(np.array(w, dtype=np.float32)).to(dense), requires_grad=False)
        return
    if kind == "weight" and len(t.shape) == 2:
        # a linear layer's bias tensor may come before or after its weight: keep what was read, or its slot
        bias = getattr(old, "bias", None)
        bias = None if bias is None else bias.detach() if not bias.is_meta else torch.zeros(t.shape[0])
        setattr(parent, leaf, block_layer(old, quantized.from_gguf(data, t.ggml_type, t.shape), bias))
        return
    if t.qtype not in ("F32", "F16", "BF16"):
        raise ModelLoadError(f"tensor {name}: a {t.qtype} vector is not supported (norms and biases are F32 / F16 / BF16)")
    values = np.array(replace(t, data=np.ascontiguousarray(data).reshape(-1)).values(), dtype=np.float32)  # a copy: the map closes
    setattr(old, kind, nn.Parameter(torch.from_numpy(values).to(dense or torch.float32), requires_grad=False))  # a norm's weight, a bias


def _release_freed_memory() -> None:
    """glibc keeps freed heap pages (here ~70 MB of a Gemma 3 270M load's temporary copies) until malloc_trim."""
    try:
        import ctypes

        ctypes.CDLL("libc.so.6").malloc_trim(0)
    except (OSError, AttributeError):  # not glibc: nothing to do
        pass

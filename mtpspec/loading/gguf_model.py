"""A dense model (llama, qwen2, qwen3, gemma3) from a GGUF file, its weights kept in their block types.

The file's metadata becomes a DenseConfig; its tensors go into the DenseLM built for that config, matrices as
block Linear / BlockEmbedding (models/blocks.py: the GGUF block kernel), vectors (norms, biases) as fp32
parameters, placed by loading/gguf_hybrid.fill. Strict: an architecture, key or tensor that does not fit is
named in one line. llama's q / k rows are put back in the half-split rotary layout; gemma3's norms (stored as 1 + w)
are plain x / rms * w norms here (loading/gguf.py).
"""

from __future__ import annotations

from pathlib import Path

import torch

from ..models.dense import DenseConfig, DenseLM
from ..models.qwen35 import HybridLM
from .gguf import MAX_CONTEXT, GGUFConfig, GGUFFile, hf_tensor_names, llama_qk_rows, read_gguf
from .gguf_hybrid import HYBRID_ARCHS, Placement, fill, load_gguf_hybrid
from .meta import meta_device

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
    """The model of a GGUF file (a DenseLM; a HybridLM for qwen35, loading/gguf_hybrid.py). fp32: matrices stay in
    their block types (Linear.of_blocks: the block kernel with 8-bit activations, as llama.cpp runs the model).
    dequantize=True, or fp64 / bf16: every matrix dequantized exactly into an ordinary layer of that dtype."""
    f = source if isinstance(source, GGUFFile) else read_gguf(source)
    dequantize = dequantize or dtype != torch.float32
    if f.architecture in HYBRID_ARCHS:  # qwen35 with its nextn MTP layer (qwen3next / qwen35moe refused there, by name)
        return load_gguf_hybrid(f, dtype, max_seq_len, dequantize)
    c = f.config()
    cfg = dense_config(f, c, max_seq_len, dequantize)
    plan = []
    for gname, hf in hf_tensor_names(f, c).items():  # every tensor named and its shape checked against the config
        t = f.tensors[gname]
        qk = c.qk_rows_interleaved and gname.endswith((".attn_q.weight", ".attn_k.weight", ".attn_q.bias", ".attn_k.bias"))
        rows = llama_qk_rows(c.num_heads if ".attn_q." in gname else c.num_kv_heads, c.head_dim) if qk else None
        plan.append(Placement(gname, hf, t.shape, rows=rows))  # rows: back to the half-split rotary layout
    with meta_device():
        model = DenseLM(cfg)
    return fill(f, model, plan, dtype if dequantize else None, float_blocks=True)

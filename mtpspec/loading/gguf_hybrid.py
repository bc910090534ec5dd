"""A Qwen3.5 hybrid (llama.cpp arch `qwen35`) from a GGUF file, its MTP (`nextn`) layer included: a HybridLM.

The inverse of what llama.cpp's converter (and export_gguf) does to a Hugging Face Qwen3.5 checkpoint:

- names: `blk.{i}.*` -> `model.layers.{i}.*`; the last block (nextn_predict_layers = 1) is the MTP module:
  `nextn.eh_proj` -> `mtp.fc`, `nextn.enorm` / `hnorm` -> `mtp.pre_fc_norm_embedding` / `_hidden`,
  `nextn.shared_head_norm` -> `mtp.norm`, its attention block -> `mtp.layers.0`;
- zero-centred norms are stored as 1 + w: every norm but the gated `ssm_norm` loads as stored - 1, exact in fp32
  (Sterbenz), so the model's 1.0 + w gives back the stored value bit for bit;
- `ssm_a` = -exp(A_log) -> the fp32 A_log whose torch exp is -ssm_a exactly (a_log_of);
- value heads tiled (k0v0 k1v0 .. k0v1 ..) -> grouped by key head (k0v0 k0v1 .. k1v0 ..): V rows of attn_qkv and
  ssm_conv1d, rows of attn_gate / ssm_beta / ssm_alpha / ssm_a / ssm_dt.bias, columns of ssm_out;
  ssm_conv1d (C, K) -> (C, 1, K); attn_q keeps Qwen's [q | gate] rows per head.

F32 / F16 / BF16 matrices become fp32 layers (widened exactly); block types stay in their blocks (block Linear /
BlockEmbedding); a row permutation moves whole rows of blocks, and ssm_out's column permutation whole blocks when
a value head spans whole blocks, else that matrix is dequantized exactly into fp32. dequantize=True, or a dtype
other than fp32: every matrix dequantized exactly into an ordinary layer of that dtype.
"""

from __future__ import annotations

from dataclasses import dataclass

import gguf
import numpy as np
import torch
from torch import nn

from ..errors import ModelLoadError
from ..kernels import quantized
from ..models.blocks import block_layer, tie_head
from ..models.qwen35 import HybridConfig, HybridLM
from .gguf import MAX_CONTEXT, GGUFConfig, GGUFFile, GGUFTensor, check_names
from .meta import meta_device

HYBRID_ARCHS = ("qwen35", "qwen3next", "qwen35moe")  # the hybrids a GGUF may hold; qwen35 loads, the others are refused
FLOAT_QTYPES = ("F32", "F16", "BF16")
_A_LOG_SEARCH = 16  # fp32 steps either side of log(-ssm_a) searched for the A_log whose exp is ssm_a exactly


def _short(x: float) -> float:
    """A float32 metadata value as the shortest decimal that rounds to it (1e-06, not 9.99999997e-07): the
    checkpoint's value, for an fp64 model too."""
    return float(str(np.float32(x)))


def hybrid_config(f: GGUFFile, c: GGUFConfig, max_seq_len: int | None = None) -> HybridConfig:
    """The HybridConfig of a qwen35 file's typed config, or a refusal naming what does not fit."""
    if c.architecture != "qwen35":
        raise f.error(f"architecture '{c.architecture}' does not load as a hybrid model (supported: qwen35)")
    x = c.extra
    if x["nextn_predict_layers"] > 1:
        raise f.error(f"{x['nextn_predict_layers']} nextn (MTP) layers: one is supported")
    if c.value_head_dim != c.head_dim:
        raise f.error(f"attention value head size {c.value_head_dim} differs from the key head size {c.head_dim}")
    if c.rope_scaling is not None:
        raise f.error(f"rope scaling {c.rope_scaling.get('rope_type')!r} is not implemented for qwen35")
    rot = c.rope_dim
    if rot % 2 or rot > c.head_dim or int(c.head_dim * (rot / c.head_dim)) != rot:
        raise f.error(f"qwen35.rope.dimension_count {rot} does not fit the head size {c.head_dim}")
    sections = x.get("rope_sections")
    if sections is not None:  # IMROPE: pair i takes axis i % 3 while i < 3 * sections[i % 3], else the 4th (0 for text)
        padded = (list(sections) + [0] * 4)[:4]
        still = [i for i in range(rot // 2) if i >= 3 * padded[i % 3]]
        if still:
            raise f.error(f"qwen35.rope.dimension_sections {list(sections)} leaves rotary pair {still[0]} "
                          "without the text position (every pair rotates by the position here)")
    nk, nv, dk, inner = x["ssm_group_count"], x["ssm_time_step_rank"], x["ssm_state_size"], x["ssm_inner_size"]
    if nv % nk or inner % nv:
        raise f.error(f"DeltaNet heads do not fit: {nv} value heads over {nk} key heads, inner size {inner}")
    return HybridConfig(
        vocab_size=c.vocab_size, hidden_size=c.hidden_size, num_layers=c.num_layers, layer_types=c.layer_types,
        num_heads=c.num_heads, num_kv_heads=c.num_kv_heads, head_dim=c.head_dim, intermediate_size=c.intermediate_size,
        max_seq_len=min(c.context_length, max_seq_len or MAX_CONTEXT), norm_eps=_short(c.norm_eps),
        rope_theta=_short(c.rope_theta), partial_rotary_factor=rot / c.head_dim, tie_embeddings=c.tie_word_embeddings,
        linear_conv_kernel_dim=x["ssm_conv_kernel"], linear_key_head_dim=dk, linear_value_head_dim=inner // nv,
        linear_num_key_heads=nk, linear_num_value_heads=nv, mtp_num_layers=x["nextn_predict_layers"],
    )


@dataclass(frozen=True)
class Placement:
    """One file tensor into the model: the parameter it fills, its shape (torch order), the inverse transforms."""

    gguf: str
    target: str  # HF parameter name
    shape: tuple[int, ...]
    norm: bool = False
    rows: np.ndarray | None = None  # grouped = stored[rows]
    cols: np.ndarray | None = None  # grouped = stored[:, cols], value heads of `col_group` columns
    col_group: int = 0
    a_log: bool = False  # ssm_a -> A_log
    conv: bool = False  # (C, K) -> (C, 1, K)


def grouped_order(nk: int, r: int, size: int) -> np.ndarray:
    """Index (nk * r * size,) taking tiled value heads back to grouped by key head (export_gguf.tiled_order's inverse)."""
    return np.arange(nk * r * size).reshape(r, nk, size).transpose(1, 0, 2).reshape(-1)


def placements(c: HybridConfig) -> list[Placement]:
    """Every tensor a qwen35 file of config `c` holds (the optional output.weight only when untied), in file order."""
    h, hd, v = c.hidden_size, c.head_dim, c.vocab_size
    nk, nv, dk, dv = c.linear_num_key_heads, c.linear_num_value_heads, c.linear_key_head_dim, c.linear_value_head_dim
    r = nv // nk
    out = [Placement("token_embd.weight", "model.embed_tokens.weight", (v, h))]

    def block(b: int, p: str, layer_type: str) -> None:
        out.append(Placement(f"blk.{b}.attn_norm.weight", p + "input_layernorm.weight", (h,), norm=True))
        if layer_type == "linear_attention":
            a, qk, conv = p + "linear_attn.", 2 * nk * dk, 2 * nk * dk + nv * dv
            tiled = r > 1
            vrows = np.concatenate([np.arange(qk), qk + grouped_order(nk, r, dv)]) if tiled else None
            heads = grouped_order(nk, r, 1) if tiled else None
            out.extend([
                Placement(f"blk.{b}.attn_qkv.weight", a + "in_proj_qkv.weight", (conv, h), rows=vrows),
                Placement(f"blk.{b}.attn_gate.weight", a + "in_proj_z.weight", (nv * dv, h),
                          rows=grouped_order(nk, r, dv) if tiled else None),
                Placement(f"blk.{b}.ssm_beta.weight", a + "in_proj_b.weight", (nv, h), rows=heads),
                Placement(f"blk.{b}.ssm_alpha.weight", a + "in_proj_a.weight", (nv, h), rows=heads),
                Placement(f"blk.{b}.ssm_conv1d.weight", a + "conv1d.weight", (conv, c.linear_conv_kernel_dim), rows=vrows,
                          conv=True),
                Placement(f"blk.{b}.ssm_a", a + "A_log", (nv,), rows=heads, a_log=True),
                Placement(f"blk.{b}.ssm_dt.bias", a + "dt_bias", (nv,), rows=heads),
                Placement(f"blk.{b}.ssm_norm.weight", a + "norm.weight", (dv,)),  # the gated norm: stored as it is
                Placement(f"blk.{b}.ssm_out.weight", a + "out_proj.weight", (h, nv * dv),
                          cols=grouped_order(nk, r, dv) if tiled else None, col_group=dv),
            ])
        else:
            a = p + "self_attn."
            out.extend([
                Placement(f"blk.{b}.attn_q.weight", a + "q_proj.weight", (c.num_heads * 2 * hd, h)),  # [q | gate] per head
                Placement(f"blk.{b}.attn_k.weight", a + "k_proj.weight", (c.num_kv_heads * hd, h)),
                Placement(f"blk.{b}.attn_v.weight", a + "v_proj.weight", (c.num_kv_heads * hd, h)),
                Placement(f"blk.{b}.attn_output.weight", a + "o_proj.weight", (h, c.num_heads * hd)),
                Placement(f"blk.{b}.attn_q_norm.weight", a + "q_norm.weight", (hd,), norm=True),
                Placement(f"blk.{b}.attn_k_norm.weight", a + "k_norm.weight", (hd,), norm=True),
            ])
        m, i = p + "mlp.", c.intermediate_size
        out.extend([
            Placement(f"blk.{b}.post_attention_norm.weight", p + "post_attention_layernorm.weight", (h,), norm=True),
            Placement(f"blk.{b}.ffn_gate.weight", m + "gate_proj.weight", (i, h)),
            Placement(f"blk.{b}.ffn_up.weight", m + "up_proj.weight", (i, h)),
            Placement(f"blk.{b}.ffn_down.weight", m + "down_proj.weight", (h, i)),
        ])

    for i, lt in enumerate(c.layer_types):
        block(i, f"model.layers.{i}.", lt)
    out.append(Placement("output_norm.weight", "model.norm.weight", (h,), norm=True))
    if not c.tie_embeddings:
        out.append(Placement("output.weight", "lm_head.weight", (v, h)))
    for j in range(c.mtp_num_layers):
        b = c.num_layers + j  # the MTP block follows the decoder's blocks
        out.extend([
            Placement(f"blk.{b}.nextn.eh_proj.weight", "mtp.fc.weight", (h, 2 * h)),  # [norm_e(embedding) | norm_h(hidden)]
            Placement(f"blk.{b}.nextn.enorm.weight", "mtp.pre_fc_norm_embedding.weight", (h,), norm=True),
            Placement(f"blk.{b}.nextn.hnorm.weight", "mtp.pre_fc_norm_hidden.weight", (h,), norm=True),
            Placement(f"blk.{b}.nextn.shared_head_norm.weight", "mtp.norm.weight", (h,), norm=True),
        ])
        block(b, f"mtp.layers.{j}.", "full_attention")
    return out


def check_tensors(f: GGUFFile, plan: list[Placement], n_layers: int) -> None:
    """The file holds exactly the planned tensors, each of its planned shape; n_layers: decoder + nextn blocks."""
    check_names(f, {p.gguf for p in plan}, set(), f"qwen35 model of {n_layers} blocks")
    for p in plan:
        t = f.tensors[p.gguf]
        if t.shape != p.shape:
            raise f.error(f"tensor {p.gguf} has shape {list(t.shape)}, expected {list(p.shape)} from the metadata")


def load_gguf_hybrid(f: GGUFFile, dtype: torch.dtype = torch.float32, max_seq_len: int | None = None,
                     dequantize: bool = False) -> HybridLM:
    """A HybridLM (with its MTP module when the file has a nextn layer) from a parsed qwen35 GGUF file."""
    if f.architecture in ("qwen3next", "qwen35moe"):
        raise f.error(f"architecture '{f.architecture}' (experts in the MLPs) does not load from GGUF yet "
                      "(supported hybrid: qwen35; load the Hugging Face checkpoint instead)")
    dense = dtype if (dequantize or dtype != torch.float32) else None
    c = f.config()
    cfg = hybrid_config(f, c, max_seq_len)
    plan = placements(cfg)
    check_tensors(f, plan, cfg.num_layers + cfg.mtp_num_layers)
    with meta_device():
        model = HybridLM(cfg)
    return fill(f, model, plan, dense)


def fill(f: GGUFFile, model: nn.Module, plan: list[Placement], dense: torch.dtype | None, float_blocks: bool = False):
    """The meta-device `model` filled from `plan` (checked against the file): head tied, rotary tables built, eval.
    float_blocks: F32 / F16 / BF16 matrices become block layers too (the dense loader), not fp32 parameters."""
    for p in plan:
        try:
            _place(model, p, f.tensors[p.gguf], dense, float_blocks)
        except (ValueError, ModelLoadError) as e:  # a type the block kernel or a vector slot cannot take
            raise f.error(f"tensor {p.gguf}: {e}") from None
    if model.config.tie_embeddings:
        tie_head(model)
    model.reset_buffers()  # the rotary tables were built on the meta device
    _release_freed_memory()
    meta = [n for n, t in [*model.named_parameters(), *model.named_buffers()] if t.is_meta]
    if meta:  # the plan was checked against the file: a parameter left here is a loader bug
        raise f.error(f"no tensor filled {', '.join(meta[:4])}")
    return model.eval()


def _release_freed_memory() -> None:
    """glibc keeps the packing's freed temporary copies as heap until malloc_trim."""
    try:
        import ctypes

        ctypes.CDLL("libc.so.6").malloc_trim(0)
    except (OSError, AttributeError):  # not glibc
        pass


def _place(model: nn.Module, p: Placement, t: GGUFTensor, dense: torch.dtype | None, float_blocks: bool) -> None:
    """One tensor into the model, its inverse transforms applied (see Placement)."""
    owner_name, _, kind = p.target.rpartition(".")  # kind: weight, bias, A_log, dt_bias
    owner = model.get_submodule(owner_name)
    if len(p.shape) == 1:
        _set(owner, kind, _vector(t, p), dense)
        return
    if p.conv:  # (C, K) -> (C, 1, K): the Conv1d's weight (kept a parameter: the DeltaNet reads its values)
        _set(owner, kind, _rows(_values(t), p.rows)[:, None, :], dense)
        return
    blocks = dense is None and (float_blocks or t.qtype not in FLOAT_QTYPES)
    if blocks and (p.cols is None or p.col_group % _block_size(t) == 0):
        raw = _rows(t.data, p.rows)  # (N, row bytes): whole rows of blocks
        if p.cols is not None:  # value heads of whole blocks: move each head's bytes
            heads = p.cols[:: p.col_group] // p.col_group  # (heads,) stored head of each grouped head
            raw = raw.reshape(t.shape[0], len(heads), -1)[:, heads].reshape(t.shape[0], -1)
        w = quantized.from_gguf(np.ascontiguousarray(raw), t.ggml_type, t.shape)
        # a linear layer's bias may be placed before or after its weight: keep what was read, or its slot
        bias = getattr(owner, "bias", None)
        bias = None if bias is None else bias.detach() if not bias.is_meta else torch.zeros(t.shape[0])
        parent_name, _, leaf = owner_name.rpartition(".")
        setattr(model.get_submodule(parent_name), leaf, block_layer(owner, w, bias))
        return
    values = _rows(_values(t), p.rows)  # (N, K) exact
    if p.cols is not None:
        values = values[:, p.cols]
    _set(owner, kind, values, dense)


def _block_size(t: GGUFTensor) -> int:
    return gguf.GGML_QUANT_SIZES[gguf.GGMLQuantizationType(t.ggml_type)][0]


def _rows(a: np.ndarray, rows: np.ndarray | None) -> np.ndarray:
    return a if rows is None else a[rows]


def _values(t: GGUFTensor) -> np.ndarray:
    """The tensor's values, fp32 (shape): float types widened, block types dequantized exactly."""
    if t.qtype in FLOAT_QTYPES:
        return np.array(t.values(), dtype=np.float32)  # a copy: the map closes
    out = gguf.quants.dequantize(np.ascontiguousarray(t.data), gguf.GGMLQuantizationType(t.ggml_type))
    return np.ascontiguousarray(out, dtype=np.float32).reshape(t.shape)


def _vector(t: GGUFTensor, p: Placement) -> np.ndarray:
    if t.qtype not in FLOAT_QTYPES:
        raise ModelLoadError(f"a {t.qtype} vector is not supported (norms and biases are F32 / F16 / BF16)")
    v = _rows(_values(t), p.rows)
    if p.norm:
        return v - np.float32(1.0)  # exact in fp32 (module docstring)
    if p.a_log:
        return a_log_of(v)
    return v


def a_log_of(ssm_a: np.ndarray) -> np.ndarray:
    """A_log (nv,) fp32 with -torch.exp(A_log) == ssm_a bit for bit (one exists when ssm_a was written as -exp of a
    float32): the fp32 values nearest log(-ssm_a) tried outwards, exponentiated as the DeltaNet does, as a vector."""
    a = -ssm_a.astype(np.float32)
    if not (a > 0).all() or not np.isfinite(a).all():
        raise ModelLoadError("ssm_a must hold negative finite values (-exp(A_log))")
    x0 = np.log(a.astype(np.float64)).astype(np.float32)
    best, done = x0.copy(), np.zeros(a.shape, dtype=bool)
    target = torch.from_numpy(a)
    for step in range(_A_LOG_SEARCH + 1):
        for sign in ((1,) if step == 0 else (1, -1)):
            cand = x0.copy()
            for _ in range(step):
                cand = np.nextafter(cand, np.float32(np.inf) if sign > 0 else np.float32(-np.inf))
            hit = (torch.from_numpy(cand).exp() == target).numpy() & ~done
            best[hit], done[hit] = cand[hit], True
        if done.all():
            break
    return best


def _set(owner: nn.Module, kind: str, values: np.ndarray, dense: torch.dtype | None) -> None:
    t = torch.from_numpy(np.ascontiguousarray(values, dtype=np.float32)).to(dense or torch.float32)
    setattr(owner, kind, nn.Parameter(t, requires_grad=False))

"""GGUF files (llama.cpp's format): metadata, a typed model config and the tensors, read without dequantizing.

Parsed strictly from a memory map: every length, count, type id, offset and shape is checked before use, so a
truncated or corrupt file raises one ModelLoadError naming the file and the problem. (`gguf.GGUFReader` builds a
numpy view per array element: far too slow for a 262k-token vocabulary; only its constants are used.)

Layout (v2 / v3, little-endian): "GGUF", u32 version, u64 tensor count, u64 key count; keys (string key, u32 value
type, value; strings u64 length + UTF-8; arrays u32 element type + u64 count + elements); per tensor: name, u32
n_dims, n_dims u64 sizes (ggml order: fastest first), u32 ggml type, u64 offset; then the data, from the header's
end rounded up to `general.alignment` (32).

What the converter did to the values, undone by the loaders:
- llama (and Mistral): q / k rows permuted per head from the half-split rotary layout to adjacent pairs (k with
  the KV head count); `llama_qk_rows` undoes it (rows only: applies to packed blocks too). qwen2 / qwen3 / gemma3
  / qwen35 are stored unpermuted.
- gemma3: every `*norm.weight` is stored as 1 + w (transformers' Gemma3RMSNorm scales by 1 + w), so it is used as a
  plain x / rms * w_file norm (`norm_plus_one`).
"""

from __future__ import annotations

import math
import mmap
import struct
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from ..errors import ModelLoadError

MAGIC = b"GGUF"
MAX_CONTEXT = 8192  # KV caches are preallocated: the context of a long-context file is capped (as for HF checkpoints)
ARCHITECTURES = ("llama", "qwen2", "qwen3", "qwen35", "gemma3")
NAMED_ARCHITECTURES = ("llama", "qwen2", "qwen3", "gemma3")  # hf_tensor_names covers these

# ggml type id -> (name, values per block, bytes per block): gguf.GGML_QUANT_SIZES for the supported ones
QTYPES: dict[int, tuple[str, int, int]] = {
    0: ("F32", 1, 4), 1: ("F16", 1, 2), 30: ("BF16", 1, 2), 8: ("Q8_0", 32, 34), 2: ("Q4_0", 32, 18),
    6: ("Q5_0", 32, 22), 12: ("Q4_K", 256, 144), 13: ("Q5_K", 256, 176), 14: ("Q6_K", 256, 210),
}
SUPPORTED_QTYPES = tuple(v[0] for v in QTYPES.values())

# metadata value types: id -> (struct format, width); 8 = string, 9 = array
_SCALAR = {0: ("<B", 1), 1: ("<b", 1), 2: ("<H", 2), 3: ("<h", 2), 4: ("<I", 4), 5: ("<i", 4), 6: ("<f", 4),
           7: ("<B", 1), 10: ("<Q", 8), 11: ("<q", 8), 12: ("<d", 8)}
_NP = {0: "<u1", 1: "<i1", 2: "<u2", 3: "<i2", 4: "<u4", 5: "<i4", 6: "<f4", 10: "<u8", 11: "<i8", 12: "<f8"}
_INT_TYPES = frozenset({0, 1, 2, 3, 4, 5, 10, 11})
_MAX_DIMS = 4  # GGML_MAX_DIMS


@dataclass(frozen=True)
class GGUFTensor:
    """One tensor as stored: its bytes are a read-only view of the mapped file (not dequantized)."""

    name: str
    qtype: str  # "F32", "Q4_K", ...
    ggml_type: int
    shape: tuple[int, ...]  # torch order: (rows, columns) for a matrix (ggml's ne reversed)
    offset: int  # of the first byte, from the start of the file
    data: np.ndarray = field(repr=False)  # uint8 (*shape[:-1], row bytes): whole blocks per row

    @property
    def nbytes(self) -> int:
        return int(self.data.nbytes)

    def values(self) -> np.ndarray:
        """The values of an F32 / F16 tensor (a view, `shape`); BF16 as float32 (a copy)."""
        if self.qtype == "F32":
            return self.data.view("<f4").reshape(self.shape)
        if self.qtype == "F16":
            return self.data.view("<f2").reshape(self.shape)
        if self.qtype == "BF16":
            return (self.data.view("<u2").astype(np.uint32) << 16).view(np.float32).reshape(self.shape)
        raise ModelLoadError(f"tensor {self.name} is {self.qtype}: dequantize its blocks instead of reading values")


@dataclass(frozen=True)
class GGUFConfig:
    """A decoder's hyperparameters from `{arch}.*` keys, with llama.cpp's defaults where a key is optional."""

    architecture: str
    vocab_size: int
    context_length: int
    hidden_size: int
    num_layers: int
    intermediate_size: int
    num_heads: int
    num_kv_heads: int
    head_dim: int  # attention.key_length, default hidden_size / num_heads
    value_head_dim: int
    norm_eps: float
    rope_theta: float  # rope.freq_base (gemma3: the global layers')
    rope_dim: int  # rope.dimension_count, default head_dim
    rope_scaling: dict | None  # {"rope_type", "factor", "original_max_position_embeddings"} when the file has one
    tie_word_embeddings: bool  # no output.weight: the head is token_embd
    hidden_act: str  # "silu" (SwiGLU) or "gelu_pytorch_tanh" (gemma3's GeGLU)
    qk_norm: bool  # RMSNorm on each head's q and k (qwen3, gemma3, qwen35)
    attention_bias: bool  # q / k / v biases (qwen2)
    layer_types: tuple[str, ...]  # per layer: full_attention, sliding_attention or linear_attention
    sliding_window: int = 0  # 0: none
    rope_local_theta: float | None = None  # gemma3 sliding layers: rope.freq_base_swa, else llama.cpp's 10000
    embed_scale: float = 1.0  # gemma3 multiplies the embedding by sqrt(hidden_size)
    query_scale: float = 0.0  # the attention's q scale (1 / sqrt(head_dim); gemma3 27B: 1 / sqrt(hidden / heads))
    final_logit_softcapping: float = 0.0  # 0: none
    norm_plus_one: bool = False  # norms stored as 1 + w (gemma3: all; qwen35: all but ssm_norm): subtract 1 for a (1 + w) RMSNorm
    qk_rows_interleaved: bool = False  # llama: q / k rows in llama.cpp's rope order (undo with llama_qk_rows)
    extra: dict = field(default_factory=dict)  # qwen35: ssm_*, full_attention_interval, nextn_predict_layers, ...


@dataclass
class GGUFFile:
    path: Path
    version: int
    alignment: int
    metadata: dict[str, Any]  # every key; numeric arrays as numpy arrays, string arrays as lists
    tensors: dict[str, GGUFTensor]  # file order
    data_offset: int  # where the tensor data section starts

    @property
    def architecture(self) -> str:
        return self.metadata["general.architecture"]

    @property
    def name(self) -> str:
        return self.path.name

    def tensor(self, name: str) -> GGUFTensor:
        t = self.tensors.get(name)
        if t is None:
            raise ModelLoadError(f"{self.name}: missing tensor {name}")
        return t

    def config(self) -> GGUFConfig:
        return model_config(self)

    def error(self, what: str) -> ModelLoadError:
        return ModelLoadError(f"{self.name}: {what}")


# ---------------------------------------------------------------------------------------------
# parsing


class _Cursor:
    """Bounds-checked little-endian reads from the mapped file; every failure is a _Bad naming what was read."""

    def __init__(self, buf, size: int) -> None:
        self.buf, self.size, self.pos = buf, size, 0

    def need(self, n: int, what: str) -> None:
        if n < 0 or self.pos + n > self.size:
            raise _Bad(f"truncated or corrupt: {what} at byte {self.pos} needs {n} bytes, the file has {self.size}")

    def scalar(self, fmt: str, width: int, what: str):
        self.need(width, what)
        v = struct.unpack_from(fmt, self.buf, self.pos)[0]
        self.pos += width
        return v

    def u32(self, what: str) -> int:
        return self.scalar("<I", 4, what)

    def u64(self, what: str) -> int:
        return self.scalar("<Q", 8, what)

    def string(self, what: str) -> str:
        n = self.u64(f"length of {what}")
        self.need(n, what)
        raw = self.buf[self.pos : self.pos + n]
        self.pos += n
        try:
            return raw.decode("utf-8")
        except UnicodeDecodeError:
            raise _Bad(f"{what} at byte {self.pos - n} is not valid UTF-8") from None


class _Bad(Exception):
    """A parse failure inside this module; read_gguf turns it into one ModelLoadError with the file name."""


def read_gguf(path: str | Path) -> GGUFFile:
    """Parse a GGUF file's header and map its tensors (strict: see the module docstring)."""
    path = Path(path)
    try:
        size = path.stat().st_size
        if not path.is_file():
            raise ModelLoadError(f"{path}: not a file")
        with open(path, "rb") as fh:
            mm = mmap.mmap(fh.fileno(), 0, access=mmap.ACCESS_READ) if size else b""
    except FileNotFoundError:
        raise ModelLoadError(f"model not found: {path}") from None
    except OSError as e:
        raise ModelLoadError(f"cannot read {path}: {e.strerror or e}") from None
    try:
        return _parse(path, mm, size)
    except _Bad as e:
        raise ModelLoadError(f"{path.name}: {e}") from None
    except ModelLoadError:
        raise
    except Exception as e:  # noqa: BLE001 - a parse bug must still read as a bad file, not a crash
        raise ModelLoadError(f"{path.name}: unreadable GGUF ({type(e).__name__}: {e})") from None


def _parse(path: Path, mm, size: int) -> GGUFFile:
    cur = _Cursor(mm, size)
    cur.need(4, "magic")
    if bytes(mm[:4]) != MAGIC:
        raise _Bad(f"not a GGUF file (starts with {bytes(mm[:4])!r}, expected b'GGUF')")
    cur.pos = 4
    version = cur.u32("version")
    if version not in (2, 3):
        swapped = int.from_bytes(version.to_bytes(4, "little"), "big")
        hint = " (a big-endian file)" if swapped in (2, 3) else ""
        raise _Bad(f"GGUF version {version}{hint} is not supported (2 and 3 are)")
    n_tensors = cur.u64("tensor count")
    n_kv = cur.u64("key count")
    if n_kv * 13 > size - cur.pos:  # a key is at least 8 + 1 + 4 bytes (key length, key, type)
        raise _Bad(f"corrupt header: {n_kv} keys cannot fit in {size} bytes")
    if n_tensors * 25 > size - cur.pos:  # name length, a name byte, n_dims, one dim, type, offset
        raise _Bad(f"corrupt header: {n_tensors} tensors cannot fit in {size} bytes")

    metadata: dict[str, Any] = {}
    for i in range(n_kv):
        key = cur.string(f"key {i}")
        if key in metadata:
            raise _Bad(f"duplicate metadata key {key}")
        vtype = cur.u32(f"type of {key}")
        metadata[key] = _value(cur, vtype, key)

    alignment = metadata.get("general.alignment", 32)
    if not isinstance(alignment, int) or isinstance(alignment, bool) or alignment <= 0 or alignment & (alignment - 1):
        raise _Bad(f"general.alignment is {alignment!r}, expected a power of two")
    arch = metadata.get("general.architecture")
    if not isinstance(arch, str):
        raise _Bad("missing key general.architecture" if arch is None else "general.architecture is not a string")

    infos = []
    names: set[str] = set()
    for i in range(n_tensors):
        name = cur.string(f"name of tensor {i}")
        if name in names:
            raise _Bad(f"duplicate tensor {name}")
        names.add(name)
        n_dims = cur.u32(f"dimension count of {name}")
        if not 1 <= n_dims <= _MAX_DIMS:
            raise _Bad(f"tensor {name} has {n_dims} dimensions (1 to {_MAX_DIMS} allowed)")
        ne = [cur.u64(f"dimensions of {name}") for _ in range(n_dims)]
        ggml_type = cur.u32(f"type of {name}")
        offset = cur.u64(f"offset of {name}")
        infos.append((name, ne, ggml_type, offset))

    data_offset = -(-cur.pos // alignment) * alignment
    tensors: dict[str, GGUFTensor] = {}
    spans = []
    for name, ne, ggml_type, offset in infos:
        if ggml_type not in QTYPES:
            known = _ggml_type_name(ggml_type)
            what = f"type {known}" if known else f"unknown ggml type id {ggml_type}"
            raise _Bad(f"tensor {name} has {what}, not supported (supported: {', '.join(SUPPORTED_QTYPES)})")
        qtype, block, block_bytes = QTYPES[ggml_type]
        if any(d == 0 or d >= 1 << 40 for d in ne):
            raise _Bad(f"tensor {name} has implausible dimensions {ne}")
        if ne[0] % block:
            raise _Bad(f"tensor {name} ({qtype}) has rows of {ne[0]} values, not a multiple of its block of {block}")
        row_bytes = ne[0] // block * block_bytes
        nbytes = row_bytes * math.prod(ne[1:])
        if offset % alignment:
            raise _Bad(f"tensor {name} has offset {offset}, not a multiple of the alignment {alignment}")
        start = data_offset + offset
        if start + nbytes > size:
            raise _Bad(f"truncated: tensor {name} ends at byte {start + nbytes}, the file has {size}")
        shape = tuple(int(d) for d in reversed(ne))
        view = np.frombuffer(mm, dtype=np.uint8, count=nbytes, offset=start).reshape(*shape[:-1], row_bytes)
        tensors[name] = GGUFTensor(name, qtype, ggml_type, shape, start, view)
        spans.append((start, start + nbytes, name))
    spans.sort()
    for (_, end, a), (start, _, b) in zip(spans, spans[1:]):
        if start < end:
            raise _Bad(f"corrupt: tensors {a} and {b} overlap")
    return GGUFFile(path, version, alignment, metadata, tensors, data_offset)


def _value(cur: _Cursor, vtype: int, key: str):
    if vtype in _SCALAR:
        fmt, width = _SCALAR[vtype]
        v = cur.scalar(fmt, width, key)
        if vtype == 7:
            if v > 1:
                raise _Bad(f"metadata key {key}: boolean byte {v}")
            return bool(v)
        return v
    if vtype == 8:
        return cur.string(key)
    if vtype == 9:
        etype = cur.u32(f"element type of {key}")
        n = cur.u64(f"length of {key}")
        if etype in _NP:
            width = _SCALAR[etype][1]
            cur.need(n * width, key)
            arr = np.frombuffer(cur.buf, dtype=_NP[etype], count=n, offset=cur.pos).copy()
            cur.pos += n * width
            return arr
        if etype == 7:
            cur.need(n, key)
            raw = np.frombuffer(cur.buf, dtype=np.uint8, count=n, offset=cur.pos)
            if n and raw.max() > 1:
                raise _Bad(f"metadata key {key}: boolean byte {int(raw.max())}")
            cur.pos += n
            return [bool(b) for b in raw]
        if etype == 8:
            if n * 8 > cur.size - cur.pos:
                raise _Bad(f"truncated or corrupt: {key} has {n} strings, more than the file can hold")
            return _strings(cur, n, key)
        if etype == 9:
            raise _Bad(f"metadata key {key}: nested arrays are not supported")
        raise _Bad(f"metadata key {key}: unknown array element type {etype}")
    raise _Bad(f"metadata key {key}: unknown value type {vtype}")


def _strings(cur: _Cursor, n: int, key: str) -> list[str]:
    """n length-prefixed UTF-8 strings (a vocabulary: the hot loop of the header)."""
    buf, pos, size, unpack = cur.buf, cur.pos, cur.size, struct.Struct("<Q").unpack_from
    out = []
    for i in range(n):
        if pos + 8 > size:
            cur.pos = pos
            raise _Bad(f"truncated: {key}[{i}] at byte {pos}")
        m = unpack(buf, pos)[0]
        pos += 8
        if pos + m > size:
            cur.pos = pos
            raise _Bad(f"truncated or corrupt: {key}[{i}] at byte {pos} is {m} bytes long, the file has {size}")
        try:
            out.append(buf[pos : pos + m].decode("utf-8"))
        except UnicodeDecodeError:
            raise _Bad(f"{key}[{i}] at byte {pos} is not valid UTF-8") from None
        pos += m
    cur.pos = pos
    return out


def _ggml_type_name(type_id: int) -> str | None:
    try:
        from gguf import GGMLQuantizationType

        return GGMLQuantizationType(type_id).name
    except (ImportError, ValueError):
        return None


# ---------------------------------------------------------------------------------------------
# config


def model_config(f: GGUFFile) -> GGUFConfig:
    """The typed config of a llama / qwen2 / qwen3 / qwen35 / gemma3 file (strict about required keys)."""
    arch = f.architecture
    if arch not in ARCHITECTURES:
        raise f.error(f"unknown architecture '{arch}' (supported: {', '.join(ARCHITECTURES)})")
    md = f.metadata

    def get(key: str, kind: type, default=None, required: bool = True):
        full = f"{arch}.{key}"
        v = md.get(full)
        if v is None:
            if required and default is None:
                raise f.error(f"missing key {full}")
            return default
        if kind is int and (not isinstance(v, int) or isinstance(v, bool)):
            raise f.error(f"key {full} is {_kind(v)}, expected an integer")
        if kind is float:
            if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v):
                raise f.error(f"key {full} is {_kind(v)}, expected a finite number")
            v = float(v)
        return v

    def positive(key: str, default=None) -> int:
        v = get(key, int, default)
        if v <= 0:
            raise f.error(f"key {arch}.{key} is {v}, expected a positive integer")
        return v

    n_layers = positive("block_count")
    hidden = positive("embedding_length")
    ffn = positive("feed_forward_length")
    heads = positive("attention.head_count")
    kv_heads = positive("attention.head_count_kv", heads)
    if heads % kv_heads:
        raise f.error(f"{heads} attention heads are not a multiple of {kv_heads} KV heads")
    head_dim = positive("attention.key_length", hidden // heads if hidden % heads == 0 else None)
    value_dim = positive("attention.value_length", head_dim)
    rope_dim = positive("rope.dimension_count", head_dim)
    eps = get("attention.layer_norm_rms_epsilon", float)
    if not 0 < eps < 1:
        raise f.error(f"key {arch}.attention.layer_norm_rms_epsilon is {eps}, expected 0 < eps < 1")
    theta = get("rope.freq_base", float, 10000.0)
    if theta <= 0:
        raise f.error(f"key {arch}.rope.freq_base is {theta}, expected > 0")
    context = positive("context_length")
    vocab = _vocab_size(f, get("vocab_size", int, required=False))

    scaling = None
    kind = md.get(f"{arch}.rope.scaling.type")
    if kind not in (None, "none"):
        factor = get("rope.scaling.factor", float)
        scaling = {"rope_type": kind, "factor": factor}
        orig = get("rope.scaling.original_context_length", int, required=False)
        if orig:
            scaling["original_max_position_embeddings"] = orig
    tied = "output.weight" not in f.tensors
    softcap = get("final_logit_softcapping", float, 0.0)
    common = dict(architecture=arch, vocab_size=vocab, context_length=context, hidden_size=hidden, num_layers=n_layers,
                  intermediate_size=ffn, num_heads=heads, num_kv_heads=kv_heads, head_dim=head_dim, value_head_dim=value_dim,
                  norm_eps=eps, rope_theta=theta, rope_dim=rope_dim, rope_scaling=scaling, tie_word_embeddings=tied,
                  query_scale=1.0 / math.sqrt(head_dim), final_logit_softcapping=softcap)

    if arch == "gemma3":
        window = get("attention.sliding_window", int, 0)
        types = _gemma3_layer_types(f, n_layers, window)
        local = get("rope.freq_base_swa", float, 10000.0)  # llama.cpp: rope_freq_base_train_swa defaults to 10000
        scale = 1.0 / math.sqrt(hidden / heads) if n_layers == 62 else 1.0 / math.sqrt(head_dim)  # llama.cpp: 27B differs
        return GGUFConfig(**{**common, "query_scale": scale}, hidden_act="gelu_pytorch_tanh", qk_norm=True,
                          attention_bias=False, layer_types=types, sliding_window=window,
                          rope_local_theta=local if window else None, embed_scale=math.sqrt(hidden), norm_plus_one=True)
    if arch == "qwen35":
        extra = {k: positive(f"ssm.{k}") for k in ("conv_kernel", "state_size", "group_count", "time_step_rank", "inner_size")}
        extra = {f"ssm_{k}": v for k, v in extra.items()}
        interval = get("full_attention_interval", int, 4)
        recurrent = md.get(f"{arch}.attention.recurrent_layers")
        nextn = get("nextn_predict_layers", int, 0)
        n_main = n_layers - nextn
        if n_main <= 0:
            raise f.error(f"{arch}.nextn_predict_layers {nextn} is not below block_count {n_layers}")
        if recurrent is not None:
            flags = [bool(x) for x in recurrent][:n_main]
            if len(flags) != n_main:
                raise f.error(f"key {arch}.attention.recurrent_layers has {len(recurrent)} flags for {n_layers} blocks")
        else:
            flags = [(i + 1) % interval != 0 for i in range(n_main)]
        types = tuple("linear_attention" if r else "full_attention" for r in flags)
        sections = md.get(f"{arch}.rope.dimension_sections")
        extra.update(full_attention_interval=interval, nextn_predict_layers=nextn,
                     rope_sections=None if sections is None else [int(s) for s in sections])
        return GGUFConfig(**{**common, "num_layers": n_main}, hidden_act="silu", qk_norm=True, attention_bias=False,
                          layer_types=types, norm_plus_one=True, extra=extra)
    return GGUFConfig(**common, hidden_act="silu", qk_norm=arch == "qwen3", attention_bias="blk.0.attn_q.bias" in f.tensors,
                      layer_types=("full_attention",) * n_layers, qk_rows_interleaved=arch == "llama")


def _gemma3_layer_types(f: GGUFFile, n_layers: int, window: int) -> tuple[str, ...]:
    """llama.cpp's rule: with a window, sliding_window_pattern (a per-layer flag array, or n: every n-th
    layer global, 0: all local; default 6) picks the sliding layers; without one, all are global."""
    if not window:
        return ("full_attention",) * n_layers
    key = "gemma3.attention.sliding_window_pattern"
    pattern = f.metadata.get(key, 6)
    if isinstance(pattern, (list, np.ndarray)):
        if len(pattern) < n_layers:
            raise f.error(f"key {key} has {len(pattern)} flags for {n_layers} layers")
        swa = [bool(x) for x in pattern[:n_layers]]
    elif isinstance(pattern, int) and not isinstance(pattern, bool) and pattern >= 0:
        swa = [pattern == 0 or i % pattern < pattern - 1 for i in range(n_layers)]
    else:
        raise f.error(f"key {key} is {_kind(pattern)}, expected a non-negative integer or flags")
    return tuple("sliding_attention" if s else "full_attention" for s in swa)


def _vocab_size(f: GGUFFile, declared: int | None) -> int:
    emb = f.tensors.get("token_embd.weight")
    if emb is None:
        raise f.error("missing tensor token_embd.weight")
    rows = emb.shape[0]
    if declared is not None and declared != rows:
        raise f.error(f"{f.architecture}.vocab_size is {declared} but token_embd.weight has {rows} rows")
    return rows


def _kind(v) -> str:
    if isinstance(v, bool):
        return "a boolean"
    if isinstance(v, str):
        return "a string"
    if isinstance(v, (list, np.ndarray)):
        return "an array"
    return f"{type(v).__name__} {v!r}"


# ---------------------------------------------------------------------------------------------
# names


_BLOCK_NAMES = {
    # GGUF leaf -> HF name under model.layers.N (llama / qwen2 / qwen3)
    "attn_norm": "input_layernorm",
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "attn_q_norm": "self_attn.q_norm",
    "attn_k_norm": "self_attn.k_norm",
    "ffn_norm": "post_attention_layernorm",  # llama's pre-FFN norm is HF's post_attention_layernorm
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
}
_GEMMA3_BLOCK_NAMES = {
    **_BLOCK_NAMES,
    "post_attention_norm": "post_attention_layernorm",  # after attention, before the residual add
    "ffn_norm": "pre_feedforward_layernorm",
    "post_ffw_norm": "post_feedforward_layernorm",
}
_TOP_NAMES = {"token_embd": "model.embed_tokens", "output_norm": "model.norm", "output": "lm_head"}


def hf_tensor_name(arch: str, name: str) -> str | None:
    """The Hugging Face name of GGUF tensor `name` (llama / qwen2 / qwen3 / gemma3), None if it has none."""
    table = _GEMMA3_BLOCK_NAMES if arch == "gemma3" else _BLOCK_NAMES
    stem, dot, suffix = name.rpartition(".")
    if not dot or suffix not in ("weight", "bias"):
        return None
    if stem in _TOP_NAMES:
        return f"{_TOP_NAMES[stem]}.{suffix}"
    parts = stem.split(".")
    if len(parts) == 3 and parts[0] == "blk" and parts[1].isdigit() and parts[2] in table:
        if parts[2] in ("attn_q_norm", "attn_k_norm") and arch in ("llama", "qwen2"):
            return None
        return f"model.layers.{int(parts[1])}.{table[parts[2]]}.{suffix}"
    return None


def expected_tensors(cfg: GGUFConfig) -> tuple[set[str], set[str]]:
    """(required, optional) GGUF tensor names of a llama / qwen2 / qwen3 / gemma3 model."""
    leaves = ["attn_norm", "attn_q", "attn_k", "attn_v", "attn_output", "ffn_norm", "ffn_gate", "ffn_up", "ffn_down"]
    if cfg.qk_norm:
        leaves += ["attn_q_norm", "attn_k_norm"]
    if cfg.architecture == "gemma3":
        leaves += ["post_attention_norm", "post_ffw_norm"]
    required = {"token_embd.weight", "output_norm.weight"}
    optional = {"output.weight"}
    for i in range(cfg.num_layers):
        required |= {f"blk.{i}.{leaf}.weight" for leaf in leaves}
        for leaf in ("attn_q", "attn_k", "attn_v"):
            (required if cfg.attention_bias else optional).add(f"blk.{i}.{leaf}.bias")
        optional.add(f"blk.{i}.attn_output.bias")
    return required, optional


def hf_tensor_names(f: GGUFFile, cfg: GGUFConfig | None = None) -> dict[str, str]:
    """{GGUF name: HF name} for every tensor of a llama / qwen2 / qwen3 / gemma3 file, checked strictly:
    a missing required tensor, an unexpected one, or a shape that does not fit the config is an error."""
    cfg = cfg or f.config()
    if cfg.architecture not in NAMED_ARCHITECTURES:
        raise f.error(f"tensor names of architecture '{cfg.architecture}' are not mapped "
                      f"(supported: {', '.join(NAMED_ARCHITECTURES)})")
    check_names(f, *expected_tensors(cfg), f"{cfg.architecture} model of {cfg.num_layers} layers")
    shapes = _expected_shapes(cfg)
    out = {}
    for name, t in f.tensors.items():
        leaf = name.split(".")[-2] if name.startswith("blk.") else name.rsplit(".", 1)[0]
        want = shapes.get((leaf, name.rsplit(".", 1)[1]))
        if want is not None and t.shape != want:
            raise f.error(f"tensor {name} has shape {list(t.shape)}, expected {list(want)} from the config")
        hf = hf_tensor_name(cfg.architecture, name)
        if hf is None:
            raise f.error(f"tensor {name} has no Hugging Face name for {cfg.architecture}")
        out[name] = hf
    return out


def check_names(f: GGUFFile, required: set[str], optional: set[str], model: str) -> None:
    """The file holds every required tensor and no other but optional ones (one error naming the first miss)."""
    missing = sorted(required - f.tensors.keys(), key=natural_order)
    if missing:
        more = f" (and {len(missing) - 1} more)" if len(missing) > 1 else ""
        raise f.error(f"missing tensor {missing[0]}{more}")
    unexpected = sorted(f.tensors.keys() - required - optional, key=natural_order)
    if unexpected:
        raise f.error(f"unexpected tensor {unexpected[0]} for a {model}")


def _expected_shapes(c: GGUFConfig) -> dict[tuple[str, str], tuple[int, ...]]:
    q, kv = c.num_heads * c.head_dim, c.num_kv_heads * c.head_dim
    v = c.num_kv_heads * c.value_head_dim
    h = c.hidden_size
    return {
        ("token_embd", "weight"): (c.vocab_size, h), ("output", "weight"): (c.vocab_size, h), ("output_norm", "weight"): (h,),
        ("attn_norm", "weight"): (h,), ("ffn_norm", "weight"): (h,), ("post_attention_norm", "weight"): (h,),
        ("post_ffw_norm", "weight"): (h,), ("attn_q_norm", "weight"): (c.head_dim,), ("attn_k_norm", "weight"): (c.head_dim,),
        ("attn_q", "weight"): (q, h), ("attn_k", "weight"): (kv, h), ("attn_v", "weight"): (v, h),
        ("attn_q", "bias"): (q,), ("attn_k", "bias"): (kv,), ("attn_v", "bias"): (v,),
        ("attn_output", "weight"): (h, c.num_heads * c.value_head_dim), ("attn_output", "bias"): (h,),
        ("ffn_gate", "weight"): (c.intermediate_size, h), ("ffn_up", "weight"): (c.intermediate_size, h),
        ("ffn_down", "weight"): (h, c.intermediate_size),
    }


def natural_order(name: str):
    """Sort key: blk.2 before blk.10."""
    return [int(p) if p.isdigit() else p for p in name.split(".")]


def llama_qk_rows(n_heads: int, head_dim: int) -> np.ndarray:
    """Row order undoing llama.cpp's q / k permutation of a llama file: hf_rows = gguf_rows[order].

    The converter stores head h's row j * head_dim/2 + i (half j of rotary pair i, HF's rotate-half
    layout) at h * head_dim + 2i + j (adjacent pairs). Pass the KV head count for k.
    """
    half = head_dim // 2
    h, j, i = np.meshgrid(np.arange(n_heads), np.arange(2), np.arange(half), indexing="ij")  # (heads, 2, half)
    return (h * head_dim + 2 * i + j).reshape(-1)

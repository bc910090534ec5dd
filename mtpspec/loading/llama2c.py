"""Reader for llama2.c checkpoints: format v0 (legacy fp32), v1 (fp32 with header), v2 (Q8_0).

llama2.c rotates adjacent pairs (x0, x1), (x2, x3), ...; our Rotary uses the half-split layout of
Hugging Face. Permuting the rows of wq and wk per head (pair i -> rows i and i + hd/2) turns one
into the other exactly, so the loaded model is the same function with one RoPE implementation.
"""

from __future__ import annotations

import struct
from pathlib import Path

import numpy as np
import torch

from ..errors import ModelLoadError
from ..models.dense import DenseConfig, DenseLM
from .gguf import llama_qk_rows

MAGIC = 0x616B3432  # "ak42"
HEADER_V1 = 256
MAX_SEQ_LEN = 1 << 20  # beyond any llama2.c model; a corrupt header must not size RoPE tables and caches by it


def _permute_rope(w: torch.Tensor, n_heads: int) -> torch.Tensor:
    """(n_heads*hd, dim) in adjacent-pair layout -> half-split layout."""
    return w[torch.from_numpy(llama_qk_rows(n_heads, w.shape[0] // n_heads))]


class _Reader:
    def __init__(self, buf: memoryview, offset: int, path: Path) -> None:
        self.buf, self.off, self.path = buf, offset, path

    def take(self, dtype: np.dtype, count: int) -> np.ndarray:
        nbytes = count * np.dtype(dtype).itemsize
        if self.off + nbytes > len(self.buf):
            raise ModelLoadError(f"{self.path}: truncated llama2.c checkpoint (needs more than {len(self.buf)} bytes)")
        arr = np.frombuffer(self.buf, dtype=dtype, count=count, offset=self.off)
        self.off += nbytes
        return arr

    def fp32(self, *shape: int) -> torch.Tensor:
        return torch.from_numpy(self.take(np.float32, int(np.prod(shape))).copy()).view(*shape)

    def q80(self, group: int, *shape: int) -> torch.Tensor:
        n = int(np.prod(shape))
        if n % group:
            raise ModelLoadError(f"{self.path}: tensor of {n} values is not a multiple of group size {group}")
        q = torch.from_numpy(self.take(np.int8, n).astype(np.float32)).view(-1, group)  # (n/g, g)
        s = torch.from_numpy(self.take(np.float32, n // group).copy()).view(-1, 1)  # (n/g, 1)
        return (q * s).view(*shape)


def _config(dim, hidden, n_layers, n_heads, n_kv, vocab, seq_len, shared: bool, path: Path) -> DenseConfig:
    if min(dim, hidden, n_layers, n_heads, n_kv, vocab, seq_len) <= 0 or dim % n_heads or n_heads % n_kv:
        raise ModelLoadError(f"{path}: not a llama2.c checkpoint (implausible header {dim, hidden, n_layers, n_heads, n_kv, vocab, seq_len})")
    if seq_len > MAX_SEQ_LEN or (dim // n_heads) % 2:
        raise ModelLoadError(f"{path}: not a llama2.c checkpoint (context {seq_len}, head size {dim // n_heads}: implausible header)")
    return DenseConfig(
        vocab_size=vocab, hidden_size=dim, num_layers=n_layers, num_heads=n_heads, num_kv_heads=n_kv,
        intermediate_size=hidden, max_seq_len=seq_len, norm_eps=1e-5, rope_theta=10000.0,
        tie_embeddings=shared,
    )


def load_llama2c(path: str | Path, dtype: torch.dtype = torch.float32) -> DenseLM:
    path = Path(path)
    try:
        data = path.read_bytes()
    except OSError as e:
        raise ModelLoadError(f"cannot read model file {path}: {e.strerror}") from None
    if len(data) < 28:
        raise ModelLoadError(f"{path}: too small to be a llama2.c checkpoint ({len(data)} bytes)")
    buf = memoryview(data)
    magic = struct.unpack_from("<I", buf, 0)[0]
    if magic == MAGIC:
        version = struct.unpack_from("<i", buf, 4)[0]
        dims = struct.unpack_from("<7i", buf, 8)
        shared = bool(buf[36])
        if version == 1:
            group = 0
        elif version == 2:
            group = struct.unpack_from("<i", buf, 37)[0]
            if group <= 0:
                raise ModelLoadError(f"{path}: bad Q8_0 group size {group}")
        else:
            raise ModelLoadError(f"{path}: unsupported llama2.c format version {version} (supported: 0, 1, 2)")
        cfg = _config(*dims, shared=shared, path=path)
        sd = _read(_Reader(buf, HEADER_V1, path), cfg, group)
    else:
        dims = list(struct.unpack_from("<7i", buf, 0))
        shared = dims[5] > 0
        dims[5] = abs(dims[5])
        cfg = _config(*dims, shared=shared, path=path)
        sd = _read(_Reader(buf, 28, path), cfg, legacy=True)
    model = DenseLM(cfg)
    _assign(model, sd, cfg, path)
    return model.to(dtype).eval()


def _read(r: _Reader, c: DenseConfig, group: int = 0, legacy: bool = False) -> dict:
    """The tensors in file order: v0 (legacy) interleaves norms and matrices and keeps RoPE tables; v1 / v2 put the
    norms first; v2 stores Q8_0 groups of `group` values (int8 codes, then fp32 scales)."""
    L, H, F, V, hd = c.num_layers, c.hidden_size, c.intermediate_size, c.vocab_size, c.hd
    kv = c.num_kv_heads * hd
    q = (lambda *shape: r.q80(group, *shape)) if group else r.fp32
    mats = (("wq", (H, H)), ("wk", (kv, H)), ("wv", (kv, H)), ("wo", (H, H)))  # (out, in): (n_heads*hd, dim)
    ffn = (("w1", (F, H)), ("w2", (H, F)), ("w3", (F, H)))
    if legacy:
        sd = {"emb": r.fp32(V, H), "rms_att": [r.fp32(H) for _ in range(L)]}
        sd.update({name: [r.fp32(*shape) for _ in range(L)] for name, shape in mats})
        sd["rms_ffn"] = [r.fp32(H) for _ in range(L)]
        sd.update({name: [r.fp32(*shape) for _ in range(L)] for name, shape in ffn})
        sd["rms_final"] = r.fp32(H)
        r.take(np.float32, c.max_seq_len * hd // 2 * 2)  # RoPE tables (freq_cis_real, freq_cis_imag)
    else:
        sd = {"rms_att": [r.fp32(H) for _ in range(L)], "rms_ffn": [r.fp32(H) for _ in range(L)], "rms_final": r.fp32(H)}
        sd["emb"] = q(V, H)
        sd.update({name: [q(*shape) for _ in range(L)] for name, shape in mats + ffn})
    sd["wcls"] = None if c.tie_embeddings else q(V, H)
    _check_end(r)
    return sd


def _check_end(r: _Reader) -> None:
    left = len(r.buf) - r.off
    if left:
        raise ModelLoadError(f"{r.path}: {left} unexpected trailing bytes after the last tensor (wrong format or header?)")


def _assign(model: DenseLM, sd: dict, c: DenseConfig, path: Path) -> None:
    m = model.model
    with torch.no_grad():
        m.embed_tokens.weight.copy_(sd["emb"])
        m.norm.weight.copy_(sd["rms_final"])
        for i, layer in enumerate(m.layers):
            layer.input_layernorm.weight.copy_(sd["rms_att"][i])
            layer.post_attention_layernorm.weight.copy_(sd["rms_ffn"][i])
            layer.self_attn.q_proj.weight.copy_(_permute_rope(sd["wq"][i], c.num_heads))
            layer.self_attn.k_proj.weight.copy_(_permute_rope(sd["wk"][i], c.num_kv_heads))
            layer.self_attn.v_proj.weight.copy_(sd["wv"][i])
            layer.self_attn.o_proj.weight.copy_(sd["wo"][i])
            layer.mlp.gate_proj.weight.copy_(sd["w1"][i])
            layer.mlp.down_proj.weight.copy_(sd["w2"][i])
            layer.mlp.up_proj.weight.copy_(sd["w3"][i])
        if sd["wcls"] is not None:
            model.lm_head.weight.copy_(sd["wcls"])

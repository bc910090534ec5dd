"""The project's own checkpoint format: a directory with

    mtpspec.json        {"format": "mtpspec", "version": 1, "config": {"arch": "dense" | "qwen35", ...},
                         "tokenizer": "tokenizer.json" | "tokenizer.bin" | null, "stop_ids": [...]}
    model.safetensors   the state_dict under our (= Hugging Face) parameter names, tied head omitted
    tokenizer.json      a Hugging Face tokenizer (or tokenizer.bin, llama2.c format)

Written by `save_checkpoint` (training, the shipped demo model) and read strictly by `load_native`.
"""

from __future__ import annotations

import dataclasses
import itertools
import json
import math
import re
import struct
from pathlib import Path

import torch

from ..errors import ModelLoadError
from ..models.dense import DenseConfig
from ..models.draft_vocab import read_draft_vocab
from ..models.qwen35 import LAYER_TYPES, HybridConfig
from .hf import build_empty, build_meta, iter_tensors, load_state_strict, read_json
from .tokenizer_hf import HFTokenizer
from .tokenizer_llama2c import Llama2cTokenizer

FORMAT, VERSION = "mtpspec", 1
CONFIGS = {"dense": DenseConfig, "qwen35": HybridConfig}
NAMES = {"dense": "dense", "qwen35": "Qwen3.5 hybrid"}


def config_from_dict(d: dict, path: Path):
    d = dict(d)
    arch = d.pop("arch", None)
    cls = CONFIGS.get(arch) if isinstance(arch, str) else None
    if cls is None:
        raise ModelLoadError(f"{path}: unknown architecture '{arch}' (known: {', '.join(CONFIGS)})")
    fields = {f.name for f in dataclasses.fields(cls)}
    unknown = sorted(set(d) - fields)
    if unknown:
        raise ModelLoadError(f"{path}: unknown config field(s) for {arch}: {', '.join(unknown)}")
    types = {f.name: str(f.type) for f in dataclasses.fields(cls)}
    for key, value in d.items():
        t = types[key]
        ok = {"int": lambda v: isinstance(v, int) and not isinstance(v, bool) and v >= 0,
              "float": lambda v: isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v),
              "bool": lambda v: isinstance(v, bool), "dict | None": lambda v: v is None or isinstance(v, dict),
              "tuple[int, ...]": lambda v: isinstance(v, (list, tuple)) and all(isinstance(x, int) and not isinstance(x, bool) and x >= 0 for x in v),
              "tuple[str, ...]": lambda v: isinstance(v, (list, tuple)) and all(isinstance(x, str) for x in v),
              }.get(t, lambda v: True)
        if not ok(value):
            raise ModelLoadError(f"{path}: config field {key} must be {'a non-negative integer' if t == 'int' else 'a ' + t}, got {value!r}")
    windows = d.get("layer_windows")
    if windows and len(windows) != d.get("num_layers"):
        raise ModelLoadError(f"{path}: layer_windows has {len(windows)} entries for {d.get('num_layers')} layers")
    factor = d.get("partial_rotary_factor", 1.0)
    if not 0 < factor <= 1:
        raise ModelLoadError(f"{path}: partial_rotary_factor must be in (0, 1], got {factor}")
    if arch == "qwen35":
        bad = sorted({t for t in d.get("layer_types", ()) if t not in LAYER_TYPES})
        if bad:
            raise ModelLoadError(f"{path}: unknown layer type(s) {', '.join(map(repr, bad))} (known: {', '.join(LAYER_TYPES)})")
    try:
        return cls(**d)
    except (TypeError, ValueError) as e:
        raise ModelLoadError(f"{path}: incomplete config for {arch}: {e}") from None


MAX_SEQ_LEN = 1 << 22  # RoPE tables and KV caches are sized by the context: a corrupt value must not allocate


def _check_sizes(cfg, listing, path: Path, arch: str) -> None:
    """The config against the tensors before anything is allocated (a corrupt layer count or width is an error, not a
    hang or an out-of-memory crash): counts and context first (even a meta model of 10^9 layers hangs), then names
    and shapes on the meta device."""
    for prefix, n in (("model.layers", cfg.num_layers), ("mtp.layers", getattr(cfg, "mtp_num_layers", 0))):
        found = {int(m.group(1)) for name, _, _ in listing if (m := re.match(re.escape(prefix) + r"\.(\d+)\.", name))}
        if len(found) != n or (n and max(found) != n - 1):
            absent = list(itertools.islice((f"{prefix}.{i}.*" for i in range(n) if i not in found), 4))  # the first few (n may be huge)
            raise ModelLoadError(f"{path}: the config has {n} {prefix.split('.')[0]} layers, model.safetensors has {len(found)}"
                                 + (f" (no {', '.join(absent)} tensors)" if absent else ""))
    experts = {int(m.group(1)) for name, _, _ in listing if (m := re.search(r"\.experts\.(\d+)\.", name))}
    n_exp = getattr(cfg, "num_experts", 0)
    if n_exp and (len(experts) != n_exp or max(experts) != n_exp - 1):
        raise ModelLoadError(f"{path}: the config has {n_exp} experts, model.safetensors has {len(experts)}")
    if not 0 < cfg.max_seq_len <= MAX_SEQ_LEN:
        raise ModelLoadError(f"{path}: implausible max_seq_len {cfg.max_seq_len}")
    try:
        probe = build_meta(cfg)  # shapes only: nothing allocated
    except (ValueError, RuntimeError, TypeError, ZeroDivisionError, KeyError, IndexError, AttributeError, OverflowError, MemoryError) as e:
        raise ModelLoadError(f"{path}: inconsistent config ({e})") from None
    load_state_strict(probe, [(n, (lambda s=s: torch.empty(s, device="meta")), s) for n, _, s in listing], path, arch)


def _write_llama2c_tokenizer(tok: Llama2cTokenizer, path: Path) -> None:
    max_len = max(len(p) for p in tok.pieces)
    out = bytearray(struct.pack("<i", max_len))
    for piece, score in zip(tok.pieces, tok.scores):
        out += struct.pack("<fi", score, len(piece)) + piece
    path.write_bytes(bytes(out))


def save_checkpoint(model, tokenizer, directory: str | Path) -> Path:
    """Write model (+ tokenizer, may be None) in the project's format; returns the directory."""
    from safetensors.torch import save_file

    d = Path(directory)
    d.mkdir(parents=True, exist_ok=True)
    cfg = model.config
    state = {k: v.detach().contiguous() for k, v in model.state_dict().items()}
    if cfg.tie_embeddings:
        state.pop("lm_head.weight", None)
    save_file(state, str(d / "model.safetensors"))
    tok_name = None
    if isinstance(tokenizer, HFTokenizer):
        tok_name = "tokenizer.json"
        tokenizer.save(d / tok_name)
    elif isinstance(tokenizer, Llama2cTokenizer):
        tok_name = "tokenizer.bin"
        _write_llama2c_tokenizer(tokenizer, d / tok_name)
    elif tokenizer is not None:
        raise ModelLoadError(f"cannot save a tokenizer of type {type(tokenizer).__name__}")
    meta = {
        "format": FORMAT, "version": VERSION, "config": cfg.to_dict(), "tokenizer": tok_name,
        "stop_ids": list(getattr(tokenizer, "stop_ids", ()) or ()), "dtype": str(model.dtype).replace("torch.", ""),
    }
    (d / "mtpspec.json").write_text(json.dumps(meta, indent=2) + "\n")
    return d


def load_native(path: Path, tokenizer, dtype: torch.dtype, with_tokenizer: bool = True):
    meta = read_json(path / "mtpspec.json")
    if meta.get("format") != FORMAT:
        raise ModelLoadError(f"{path / 'mtpspec.json'}: not an mtpspec checkpoint (format {meta.get('format')!r})")
    if meta.get("version") != VERSION:
        raise ModelLoadError(f"{path}: mtpspec checkpoint version {meta.get('version')} is not supported (expected {VERSION})")
    if not isinstance(meta.get("config"), dict):
        raise ModelLoadError(f"{path / 'mtpspec.json'}: lacks 'config'")
    cfg = config_from_dict(meta["config"], path)
    weights = path / "model.safetensors"
    if not weights.exists():
        raise ModelLoadError(f"{path}: model.safetensors is missing")
    listing = list(iter_tensors([weights]))
    _check_sizes(cfg, listing, path, NAMES[meta["config"]["arch"]])
    model = build_empty(cfg, dtype)
    load_state_strict(model, listing, path, NAMES[meta["config"]["arch"]])
    model.token_ranking = read_draft_vocab(path, cfg.vocab_size)  # None without draft_vocab.json
    if not with_tokenizer:
        return model, None
    stop = meta.get("stop_ids") or ()
    if not isinstance(stop, (list, tuple)) or not all(isinstance(t, int) and not isinstance(t, bool) and 0 <= t < cfg.vocab_size for t in stop):
        raise ModelLoadError(f"{path / 'mtpspec.json'}: stop_ids must be token ids below {cfg.vocab_size}, got {meta.get('stop_ids')!r}")
    stop = tuple(stop)
    if meta.get("tokenizer") is not None and not isinstance(meta["tokenizer"], str):
        raise ModelLoadError(f"{path / 'mtpspec.json'}: 'tokenizer' must be a file name, got {meta['tokenizer']!r}")
    tok_path = Path(tokenizer) if tokenizer else (path / meta["tokenizer"] if meta.get("tokenizer") else None)
    if tok_path is None:
        raise ModelLoadError(f"{path}: the checkpoint carries no tokenizer (give one with --tokenizer PATH)")
    if not tok_path.exists():
        raise ModelLoadError(f"{path}: tokenizer {tok_path} not found")
    if tok_path.suffix == ".bin":
        return model, Llama2cTokenizer.load(tok_path, vocab_size=cfg.vocab_size)
    tok = HFTokenizer.load(tok_path, stop)
    return model, tok

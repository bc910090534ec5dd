"""The project's own checkpoint format: a directory with

    mtpspec.json        {"format": "mtpspec", "version": 1, "config": {"arch": "dense" | "qwen35", ...},
                         "tokenizer": "tokenizer.json" | "tokenizer.bin" | null, "stop_ids": [...]}
    model.safetensors   the state_dict under our (= Hugging Face) parameter names, tied head omitted
    tokenizer.json      a Hugging Face tokenizer (or tokenizer.bin, llama2.c format)

Written by `save_checkpoint` (training, the shipped demo model) and read strictly by `load_native`.
"""

from __future__ import annotations

import dataclasses
import json
import struct
from pathlib import Path

import torch

from ..drafters.draft_vocab import read_draft_vocab
from ..errors import ModelLoadError
from ..models.dense import DenseConfig
from ..models.qwen35 import LAYER_TYPES, HybridConfig
from .hf import build_empty, iter_tensors, load_state_strict, read_json
from .tokenizer_hf import HFTokenizer
from .tokenizer_llama2c import Llama2cTokenizer

FORMAT, VERSION = "mtpspec", 1
CONFIGS = {"dense": DenseConfig, "qwen35": HybridConfig}
NAMES = {"dense": "dense", "qwen35": "Qwen3.5 hybrid"}


def config_from_dict(d: dict, path: Path):
    d = dict(d)
    arch = d.pop("arch", None)
    cls = CONFIGS.get(arch)
    if cls is None:
        raise ModelLoadError(f"{path}: unknown architecture '{arch}' (known: {', '.join(CONFIGS)})")
    fields = {f.name for f in dataclasses.fields(cls)}
    unknown = sorted(set(d) - fields)
    if unknown:
        raise ModelLoadError(f"{path}: unknown config field(s) for {arch}: {', '.join(unknown)}")
    if arch == "qwen35":
        bad = sorted({t for t in d.get("layer_types", ()) if t not in LAYER_TYPES})
        if bad:
            raise ModelLoadError(f"{path}: unknown layer type(s) {', '.join(map(repr, bad))} (known: {', '.join(LAYER_TYPES)})")
    try:
        return cls(**d)
    except TypeError as e:
        raise ModelLoadError(f"{path}: incomplete config for {arch}: {e}") from None


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
    model = build_empty(cfg, dtype)
    load_state_strict(model, iter_tensors([weights]), path, NAMES[meta["config"]["arch"]])
    model.token_ranking = read_draft_vocab(path, cfg.vocab_size)  # None without draft_vocab.json
    if not with_tokenizer:
        return model, None
    stop = tuple(meta.get("stop_ids") or ())
    tok_path = Path(tokenizer) if tokenizer else (path / meta["tokenizer"] if meta.get("tokenizer") else None)
    if tok_path is None:
        raise ModelLoadError(f"{path}: the checkpoint carries no tokenizer (give one with --tokenizer PATH)")
    if not tok_path.exists():
        raise ModelLoadError(f"{path}: tokenizer {tok_path} not found")
    if tok_path.suffix == ".bin":
        return model, Llama2cTokenizer.load(tok_path, vocab_size=cfg.vocab_size)
    tok = HFTokenizer.load(tok_path, stop)
    return model, tok

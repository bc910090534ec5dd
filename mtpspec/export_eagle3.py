"""`mtpspec export HEAD --target MODEL`: an EAGLE-3 head (models/eagle3.py) in the layouts the serving engines load.

**Hugging Face directory** (vLLM's and SGLang's EAGLE-3 drafters; llama.cpp's converter):

- config.json: `architectures: ["LlamaForCausalLMEagle3"]`, model_type llama, one hidden layer, the layer's sizes,
  `vocab_size` (the target's), `draft_vocab_size`, `target_hidden_size`, `tie_word_embeddings: false` (SGLang
  ties the LM head to the embedding otherwise), `norm_before_residual`, and the feature layers twice:
  `eagle_aux_hidden_state_layer_ids` at the top level, ids of layer *inputs* (vLLM: vllm/v1/worker/gpu/spec_decode/
  eagle/eagle3_utils.py `get_eagle3_aux_layers_from_config`, whose target captures the residual entering layer id;
  llama.cpp: conversion/llama.py writes them as `eagle3.target_layers`, read by llama_get_embeddings_layer_inp), and
  `eagle_config: {use_aux_hidden_state: true, eagle_aux_hidden_state_layer_ids: [id - 1, ...]}`, SGLang's
  convention (python/sglang/srt/models/llama.py `set_eagle3_layers_to_capture` captures the input of layer id + 1);
  SGLang's ids are left out when a feature layer is layer 0 (the embedding has no SGLang id), its default
  (2, L // 2, L - 3) being then the only way there.
- model.safetensors: `fc.weight` (H, 3H), `midlayer.{input_layernorm, hidden_norm, post_attention_layernorm}.weight`,
  `midlayer.self_attn.{q,k,v,o}_proj.weight` (q / k / v 2H wide), `midlayer.mlp.{gate,up,down}_proj.weight`,
  `norm.weight`, `lm_head.weight` (N, H), `d2t` (N,) int64 offsets (target id = draft id + d2t), `t2d` (V,) bool;
  no embedding (the target's is shared). The names vLLM's model_executor/models/llama_eagle3.py
  (`Eagle3LlamaForCausalLM.load_weights`: midlayer. -> layers.0., d2t -> draft_id_to_target_id, t2d skipped) and
  SGLang's srt/models/llama_eagle3.py (`LlamaForCausalLMEagle3.load_weights`: model.midlayer.*, d2t -> hot token ids)
  load.

**GGUF** (llama.cpp's arch `eagle3`: src/models/eagle3.cpp, the keys of conversion/llama.py): `eagle3.target_layers`
(int32 array), `eagle3.target_hidden_size`, `eagle3.norm_before_residual`, the Llama keys of one block; tensors
`fc.weight`, `blk.0.attn_norm` (input_layernorm), `blk.0.attn_norm_2` (hidden_norm), `blk.0.attn_{q,k,v,output}`
(q / k rows permuted to llama.cpp's adjacent-pair rope, as the converter does), `blk.0.ffn_{norm,gate,up,down}`,
`output_norm`, `output` (N rows) and `d2t` as I64 absolute target ids (the converter adds arange); no token_embd
(llama.cpp reads the target's). The target's tokenizer goes in too: llama.cpp checks the draft's vocabulary
against the target's.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch

from .errors import ConfigError
from .models.eagle3_io import ARCH, GGUF_NAMES


def _check(head) -> None:
    if head.config.kind != "eagle3":
        raise ConfigError(f"this export writes EAGLE-3 heads; the head at hand is a {head.config.kind} head")


def hf_eagle3_config(head, bos_id: int | None = None, eos_id=None) -> dict:
    """config.json of an EAGLE-3 head (module docstring)."""
    _check(head)
    c = head.config
    layers = list(c.aux_layers)
    cfg = {
        "architectures": [ARCH], "model_type": "llama", "torch_dtype": "float32",
        "hidden_size": c.hidden_size, "intermediate_size": c.intermediate_size, "num_hidden_layers": 1,
        "num_attention_heads": c.num_heads, "num_key_value_heads": c.num_kv_heads, "head_dim": c.head_dim,
        "hidden_act": "silu", "rms_norm_eps": c.norm_eps, "rope_theta": c.rope_theta, "rope_scaling": None,
        "max_position_embeddings": c.max_seq_len, "attention_bias": False, "mlp_bias": False,
        "vocab_size": c.vocab_size, "draft_vocab_size": c.draft_vocab_size or c.vocab_size,
        "target_hidden_size": c.hidden_size, "tie_word_embeddings": False,
        "norm_before_residual": c.norm_before_residual,
        "eagle_aux_hidden_state_layer_ids": layers,  # inputs of these target layers (vLLM, llama.cpp)
        "eagle_config": {"use_aux_hidden_state": True},
    }
    if min(layers) >= 1:
        cfg["eagle_config"]["eagle_aux_hidden_state_layer_ids"] = [i - 1 for i in layers]  # SGLang: outputs of these
    if bos_id is not None:
        cfg["bos_token_id"] = bos_id
    if eos_id is not None:
        cfg["eos_token_id"] = eos_id
    return cfg


def hf_eagle3_tensors(head) -> dict[str, torch.Tensor]:
    """The head's tensors under the HF EAGLE-3 names (fp32; d2t int64, t2d bool)."""
    _check(head)
    out = {}
    for name, t in head.mtp.state_dict().items():
        name = name.replace("layers.0.", "midlayer.", 1) if name.startswith("layers.0.") else name
        out[name] = t.detach().float().contiguous() if t.is_floating_point() else t.detach().contiguous()
    return out


def export_eagle3_hf(head, out: str | Path, bos_id: int | None = None, eos_id=None) -> Path:
    """config.json + model.safetensors of `head` into the directory `out`."""
    from safetensors.torch import save_file

    d = Path(out)
    d.mkdir(parents=True, exist_ok=True)
    tensors = hf_eagle3_tensors(head)
    save_file(tensors, str(d / "model.safetensors"), metadata={"format": "pt"})
    (d / "config.json").write_text(json.dumps(hf_eagle3_config(head, bos_id, eos_id), indent=2) + "\n")
    return d


# ---------------------------------------------------------------------------------------------
# GGUF


def eagle3_gguf_metadata(head) -> dict:
    _check(head)
    c, a = head.config, "eagle3"
    return {
        "general.type": "model",
        f"{a}.vocab_size": c.vocab_size,
        f"{a}.context_length": c.max_seq_len,
        f"{a}.embedding_length": c.hidden_size,
        f"{a}.block_count": 1,
        f"{a}.feed_forward_length": c.intermediate_size,
        f"{a}.attention.head_count": c.num_heads,
        f"{a}.attention.head_count_kv": c.num_kv_heads,
        f"{a}.attention.key_length": c.head_dim,
        f"{a}.attention.value_length": c.head_dim,
        f"{a}.attention.layer_norm_rms_epsilon": float(c.norm_eps),
        f"{a}.rope.freq_base": float(c.rope_theta),
        f"{a}.rope.dimension_count": c.head_dim,
        f"{a}.target_layers": list(c.aux_layers),
        f"{a}.target_hidden_size": c.hidden_size,
        f"{a}.norm_before_residual": bool(c.norm_before_residual),
        f"{a}.norm_before_fc": False,
    }


def eagle3_gguf_tensors(head) -> list[tuple[str, torch.Tensor]]:
    """(llama.cpp name, tensor) of every stored tensor; d2t as absolute target ids (int64)."""
    from .export_gguf import permute_rope_interleaved

    _check(head)
    c, sd = head.config, head.mtp.state_dict()
    out = []
    for ours, name in GGUF_NAMES.items():
        w = sd[ours].detach().float().contiguous()
        if name == "blk.0.attn_q.weight":
            w = permute_rope_interleaved(w, c.num_heads)
        elif name == "blk.0.attn_k.weight":
            w = permute_rope_interleaved(w, c.num_kv_heads)
        out.append((name, w))
    return out + [("d2t", head.mtp.ids)]


def export_eagle3_gguf(head, tokenizer, out: str | Path, outtype: str = "f32"):
    """One GGUF file of `head` for llama.cpp's `--spec-type draft-eagle3`, with its target's tokenizer -> GGUFExport."""
    import gguf
    import numpy as np

    from .export_gguf import _FILE_TYPE, OUTTYPES, GGUFExport, GGUFTensor, _add_kv, _encode, _QTYPE, stored_type, tokenizer_metadata

    if outtype not in OUTTYPES:
        raise ConfigError(f"unknown GGUF outtype {outtype!r} (choose from: {', '.join(OUTTYPES)})")
    if tokenizer is None:
        raise ConfigError("an EAGLE-3 GGUF carries its target's tokenizer (llama.cpp compares the two): give --target")
    out = Path(out)
    if out.is_dir():
        raise ConfigError(f"GGUF export writes one file, and {out} is a directory: give a file path such as {out / 'eagle3.gguf'}")
    meta = eagle3_gguf_metadata(head)
    meta.update(tokenizer_metadata(tokenizer, head.config.vocab_size))
    meta["general.file_type"] = _FILE_TYPE[outtype]
    meta["general.quantization_version"] = 2
    try:
        out.parent.mkdir(parents=True, exist_ok=True)
        writer = gguf.GGUFWriter(str(out), "eagle3")
    except OSError as e:
        raise ConfigError(f"cannot write the GGUF file {out}: {e.strerror or e}") from None
    fallback, tensors = [], eagle3_gguf_tensors(head)
    for key, value in meta.items():
        _add_kv(writer, key, value)
    for name, t in tensors:
        if name == "d2t":
            writer.add_tensor(name, t.numpy().astype(np.int64), raw_dtype=gguf.GGMLQuantizationType.I64)
            continue
        g = GGUFTensor(name, np.ascontiguousarray(t.numpy(), dtype=np.float32), stored_type(name, t.ndim, outtype))
        data, qtype = _encode(g, gguf)
        if qtype != g.qtype:
            fallback.append(name)
        writer.add_tensor(name, data, raw_dtype=_QTYPE(gguf)[qtype])
    try:
        writer.write_header_to_file()
        writer.write_kv_data_to_file()
        writer.write_tensors_to_file()
    except OSError as e:
        raise ConfigError(f"cannot write the GGUF file {out}: {e.strerror or e}") from None
    finally:
        writer.close()
    return GGUFExport(path=out, arch="eagle3", tensors=len(tensors), bytes=out.stat().st_size, fallback_f16=tuple(fallback))


__all__ = ["export_eagle3_hf", "export_eagle3_gguf", "hf_eagle3_config", "eagle3_gguf_metadata", "eagle3_gguf_tensors"]

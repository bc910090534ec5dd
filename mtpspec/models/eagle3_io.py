"""Reading an exported EAGLE-3 head back (export_eagle3.py writes them): a Hugging Face directory in vLLM's / SGLang's
layout, or a llama.cpp GGUF of arch eagle3; `read_head` takes those and `train head` folders alike."""

from __future__ import annotations

import json
from pathlib import Path

import torch

from ..errors import ModelLoadError

ARCH = "LlamaForCausalLMEagle3"

GGUF_NAMES = {  # our module's names (Eagle3Module's state dict) -> llama.cpp's (conversion/llama.py's mapping)
    "fc.weight": "fc.weight",
    "layers.0.input_layernorm.weight": "blk.0.attn_norm.weight",
    "layers.0.hidden_norm.weight": "blk.0.attn_norm_2.weight",
    "layers.0.self_attn.q_proj.weight": "blk.0.attn_q.weight",
    "layers.0.self_attn.k_proj.weight": "blk.0.attn_k.weight",
    "layers.0.self_attn.v_proj.weight": "blk.0.attn_v.weight",
    "layers.0.self_attn.o_proj.weight": "blk.0.attn_output.weight",
    "layers.0.post_attention_layernorm.weight": "blk.0.ffn_norm.weight",
    "layers.0.mlp.gate_proj.weight": "blk.0.ffn_gate.weight",
    "layers.0.mlp.up_proj.weight": "blk.0.ffn_up.weight",
    "layers.0.mlp.down_proj.weight": "blk.0.ffn_down.weight",
    "norm.weight": "output_norm.weight",
    "lm_head.weight": "output.weight",
}


def read_head(path: str | Path, dtype: torch.dtype = torch.float32):
    """A draft head from a `train head` folder (heads.load_head), an exported EAGLE-3 directory or an EAGLE-3 GGUF."""
    from .heads import load_head

    p = Path(path)
    if is_eagle3_hf(p) and not (p / "head.json").exists():
        return load_eagle3_hf(p, dtype)
    if p.suffix == ".gguf" and p.is_file():
        return load_eagle3_gguf(p, dtype)
    return load_head(p, dtype)


def is_eagle3_hf(path: str | Path) -> bool:
    p = Path(path) / "config.json"
    if not p.is_file():
        return False
    try:
        return ARCH in json.loads(p.read_text()).get("architectures", [])
    except (ValueError, OSError, AttributeError):
        return False


def load_eagle3_hf(path: str | Path, dtype: torch.dtype = torch.float32):
    """An exported HF EAGLE-3 directory back as a DraftHead (strict: every missing or unexpected tensor named)."""
    from safetensors.torch import load_file

    from .heads import DraftHead, DraftHeadConfig, load_strict

    d = Path(path)
    try:
        c = json.loads((d / "config.json").read_text())
        n_vocab, n_draft = int(c["vocab_size"]), int(c.get("draft_vocab_size") or c["vocab_size"])
        cfg = DraftHeadConfig(
            kind="eagle3", hidden_size=int(c["hidden_size"]), vocab_size=n_vocab, max_seq_len=int(c["max_position_embeddings"]),
            num_heads=int(c["num_attention_heads"]), num_kv_heads=int(c["num_key_value_heads"]),
            head_dim=int(c.get("head_dim") or c["hidden_size"] // c["num_attention_heads"]),
            intermediate_size=int(c["intermediate_size"]), rope_theta=float(c.get("rope_theta", 10000.0)),
            aux_layers=tuple(int(i) for i in c["eagle_aux_hidden_state_layer_ids"]),
            draft_vocab_size=0 if n_draft == n_vocab else n_draft, norm_eps=float(c.get("rms_norm_eps", 1e-6)),
            norm_before_residual=bool(c.get("norm_before_residual", False)),
        )
        if int(c.get("num_hidden_layers", 1)) != 1 or c.get("target_hidden_size", cfg.hidden_size) != cfg.hidden_size:
            raise ValueError("one hidden layer, as wide as its target, expected")
        head = DraftHead(cfg)
    except (OSError, ValueError, KeyError, TypeError) as e:
        raise ModelLoadError(f"{d / 'config.json'}: not an EAGLE-3 head's config ({e})") from None
    try:
        state = load_file(str(d / "model.safetensors"))
    except Exception as e:  # safetensors raises its own error types
        raise ModelLoadError(f"{d / 'model.safetensors'}: cannot read the head's weights ({e})") from None
    own = {("mtp." + k.replace("midlayer.", "layers.0.", 1)): v for k, v in state.items()}
    load_strict(head, own, d, "EAGLE-3", "config.json")
    return head.to(dtype).eval()




def load_eagle3_gguf(path: str | Path, dtype: torch.dtype = torch.float32):
    """An exported EAGLE-3 GGUF back as a DraftHead (q / k rows permuted back, d2t back to offsets)."""
    import gguf

    from .heads import DraftHead, DraftHeadConfig, load_strict

    try:
        r = gguf.GGUFReader(str(path))
        arch = r.fields["general.architecture"].contents()
    except (ValueError, KeyError, OSError) as e:
        raise ModelLoadError(f"{path}: not a readable GGUF ({e.__class__.__name__}: {e})") from None
    if arch != "eagle3":
        raise ModelLoadError(f"{path}: a GGUF of arch {arch}, not an EAGLE-3 head (arch eagle3)")

    def kv(key):
        f = r.fields.get(key)
        if f is None:
            raise ModelLoadError(f"{path}: an eagle3 GGUF without {key}")
        return f.contents()

    a = "eagle3."
    ts = {t.name: t for t in r.tensors}
    n_draft = int(ts["output.weight"].shape[-1])
    v = int(kv(a + "vocab_size"))
    cfg = DraftHeadConfig(
        kind="eagle3", hidden_size=int(kv(a + "embedding_length")), vocab_size=v, max_seq_len=int(kv(a + "context_length")),
        num_heads=int(kv(a + "attention.head_count")), num_kv_heads=int(kv(a + "attention.head_count_kv")),
        head_dim=int(kv(a + "attention.key_length")), intermediate_size=int(kv(a + "feed_forward_length")),
        rope_theta=float(kv(a + "rope.freq_base")), aux_layers=tuple(int(i) for i in kv(a + "target_layers")),
        draft_vocab_size=0 if n_draft == v else n_draft, norm_eps=float(kv(a + "attention.layer_norm_rms_epsilon")),
        norm_before_residual=bool(kv(a + "norm_before_residual")),
    )
    head = DraftHead(cfg)

    def tensor(name):
        t = ts[name]
        data = torch.from_numpy(gguf.quants.dequantize(t.data, t.tensor_type).copy()) if t.tensor_type not in (
            gguf.GGMLQuantizationType.F32, gguf.GGMLQuantizationType.I64) else torch.from_numpy(t.data.copy())
        return data.reshape([int(x) for x in reversed(t.shape)]) if data.ndim > 1 or len(t.shape) > 1 else data

    def unpermute(w, n):  # adjacent pairs -> half-split: the inverse of permute_rope_interleaved
        out_dim, dim = w.shape
        return w.reshape(n, out_dim // n // 2, 2, dim).transpose(1, 2).reshape(out_dim, dim)

    names = {name: hf for hf, name in GGUF_NAMES.items()}
    state = {}
    for name in ts:
        if name == "d2t":
            ids = tensor(name).long()
            state["mtp.d2t"] = ids - torch.arange(ids.numel())
            continue
        if name not in names:
            raise ModelLoadError(f"{path}: unexpected tensor {name}")
        w = tensor(name).float()
        if name == "blk.0.attn_q.weight":
            w = unpermute(w, cfg.num_heads)
        elif name == "blk.0.attn_k.weight":
            w = unpermute(w, cfg.num_kv_heads)
        state["mtp." + names[name]] = w
    t2d = torch.zeros(v, dtype=torch.bool)
    t2d[torch.arange(n_draft) + state.get("mtp.d2t", torch.zeros(n_draft, dtype=torch.long))] = True
    state["mtp.t2d"] = t2d
    state.setdefault("mtp.d2t", torch.zeros(n_draft, dtype=torch.long))
    load_strict(head, state, path, "EAGLE-3", "the file's eagle3 metadata")  # (a wrong shape too: one line)
    return head.to(dtype).eval()


__all__ = ["read_head", "load_eagle3_hf", "load_eagle3_gguf", "is_eagle3_hf", "GGUF_NAMES", "ARCH"]

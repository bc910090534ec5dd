"""Hugging Face safetensors directories: Qwen3.5, Qwen3-Next, Llama, Qwen2/Qwen3 (+ their MTP tensors).

config.json is mapped to a HybridConfig (qwen3_5, qwen3_5_text, qwen3_next) or a DenseConfig (llama,
qwen2, qwen3); tensor names are mapped to ours (`model.language_model.*` of the multimodal Qwen3.5
checkpoint, Qwen3-Next's fused in_proj_qkvz / in_proj_ba, DeepSeek-V3-style MTP names), and loading
is strict: every missing, unexpected or wrongly shaped tensor is named in the error.

Unlike transformers, the `mtp.*` tensors are kept: the model gets its MTP module when they exist.
"""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Callable, Iterator

import torch
from torch import Tensor

from ..errors import ModelLoadError
from ..models.common import Rotary
from ..models.dense import DenseConfig, DenseLM
from ..models.qwen35 import LAYER_TYPES, HybridConfig, HybridLM

MAX_CONTEXT = 8192  # KV caches are preallocated: cap the context of big-context checkpoints
HYBRID_TYPES = ("qwen3_5", "qwen3_5_text", "qwen3_next")
DENSE_TYPES = ("llama", "qwen2", "qwen3", "mistral")
IGNORED_PREFIXES = ("model.visual.", "visual.", "model.vision_tower.")


def read_json(path: Path) -> dict:
    try:
        return json.loads(path.read_text())
    except OSError as e:
        raise ModelLoadError(f"cannot read {path}: {e.strerror}") from None
    except json.JSONDecodeError as e:
        raise ModelLoadError(f"{path}: not valid JSON ({e.msg} at line {e.lineno})") from None


def _text_config(cfg: dict) -> dict:
    if cfg.get("model_type") == "qwen3_5" or "text_config" in cfg:
        text = dict(cfg.get("text_config") or {})
        text.setdefault("model_type", "qwen3_5_text")
        for key in ("tie_word_embeddings", "eos_token_id", "bos_token_id"):
            if key in cfg and key not in text:
                text[key] = cfg[key]
        return text
    return cfg


def _rope(cfg: dict, path: Path) -> tuple[float, float]:
    rp = cfg.get("rope_parameters") or cfg.get("rope_scaling") or {}
    rope_type = rp.get("rope_type", rp.get("type", "default"))
    if rope_type not in ("default", "mrope", None):  # mrope: text positions are equal on all axes
        raise ModelLoadError(f"{path}: rope type '{rope_type}' is not supported (only plain RoPE)")
    theta = rp.get("rope_theta", cfg.get("rope_theta", 10000.0))
    factor = rp.get("partial_rotary_factor", cfg.get("partial_rotary_factor", 1.0))
    return float(theta), float(factor)


def _need(cfg: dict, key: str, path: Path):
    if key not in cfg:
        raise ModelLoadError(f"{path}: config.json lacks '{key}'")
    return cfg[key]


def config_from_hf(cfg: dict, path: Path, mtp_layers: int, max_seq_len: int | None = None):
    """HF config.json dict -> (our config, a name for messages)."""
    cfg = _text_config(cfg)
    mtype = cfg.get("model_type", "")
    if cfg.get("hidden_act", "silu") != "silu":
        raise ModelLoadError(f"{path}: activation '{cfg['hidden_act']}' is not supported (only silu)")
    ctx = min(int(cfg.get("max_position_embeddings", MAX_CONTEXT)), max_seq_len or MAX_CONTEXT)
    theta, factor = _rope(cfg, path)
    common = dict(
        vocab_size=_need(cfg, "vocab_size", path), hidden_size=_need(cfg, "hidden_size", path),
        num_heads=_need(cfg, "num_attention_heads", path),
        num_kv_heads=cfg.get("num_key_value_heads") or cfg["num_attention_heads"],
        intermediate_size=_need(cfg, "intermediate_size", path), max_seq_len=ctx,
        norm_eps=float(cfg.get("rms_norm_eps", 1e-6)), rope_theta=theta,
        tie_embeddings=bool(cfg.get("tie_word_embeddings", False)), attention_bias=bool(cfg.get("attention_bias", False)),
    )
    n_layers = _need(cfg, "num_hidden_layers", path)
    if mtype in HYBRID_TYPES:
        layer_types = cfg.get("layer_types")
        if layer_types is None:
            every = int(cfg.get("full_attention_interval", 4))
            layer_types = ["full_attention" if (i + 1) % every == 0 else "linear_attention" for i in range(n_layers)]
        bad = sorted({t for t in layer_types if t not in LAYER_TYPES})
        if bad:
            raise ModelLoadError(f"{path}: unknown layer type(s) {', '.join(map(repr, bad))} in layer_types (known: {', '.join(LAYER_TYPES)})")
        if len(layer_types) != n_layers:
            raise ModelLoadError(f"{path}: layer_types has {len(layer_types)} entries but num_hidden_layers is {n_layers}")
        hc = HybridConfig(
            num_layers=n_layers, layer_types=tuple(layer_types),
            head_dim=cfg.get("head_dim") or cfg["hidden_size"] // cfg["num_attention_heads"],
            partial_rotary_factor=factor,
            linear_conv_kernel_dim=cfg.get("linear_conv_kernel_dim", 4), linear_key_head_dim=cfg.get("linear_key_head_dim", 128),
            linear_value_head_dim=cfg.get("linear_value_head_dim", 128), linear_num_key_heads=cfg.get("linear_num_key_heads", 16),
            linear_num_value_heads=cfg.get("linear_num_value_heads", 32),
            num_experts=cfg.get("num_experts", 0) if mtype == "qwen3_next" else 0,
            num_experts_per_tok=cfg.get("num_experts_per_tok", 0), moe_intermediate_size=cfg.get("moe_intermediate_size", 0),
            shared_expert_intermediate_size=cfg.get("shared_expert_intermediate_size", 0),
            norm_topk_prob=cfg.get("norm_topk_prob", True), decoder_sparse_step=cfg.get("decoder_sparse_step", 1) or 1,
            mlp_only_layers=tuple(cfg.get("mlp_only_layers") or ()), mtp_num_layers=mtp_layers, **common,
        )
        return hc, {"qwen3_next": "Qwen3-Next"}.get(mtype, "Qwen3.5")
    if mtype in DENSE_TYPES:
        if cfg.get("mlp_bias"):
            raise ModelLoadError(f"{path}: mlp_bias is not supported")
        if mtype in ("llama", "mistral") and cfg.get("attention_bias"):
            raise ModelLoadError(f"{path}: Llama attention_bias (with an o_proj bias) is not supported")
        if mtype == "qwen2":
            common["attention_bias"] = True
        if factor != 1.0:
            raise ModelLoadError(f"{path}: partial rotary is not supported for {mtype}")
        dc = DenseConfig(num_layers=n_layers, head_dim=cfg.get("head_dim") or 0, qk_norm=mtype == "qwen3", **common)
        return dc, mtype.capitalize()
    raise ModelLoadError(
        f"{path}: model type '{mtype or '?'}' is not supported (supported: {', '.join(HYBRID_TYPES + DENSE_TYPES)})"
    )


# -- tensors ---------------------------------------------------------------------------------

def safetensor_files(path: Path) -> list[Path]:
    index = path / "model.safetensors.index.json"
    if index.exists():
        names = sorted(set(read_json(index).get("weight_map", {}).values()))
        files = [path / n for n in names]
    else:
        files = sorted(path.glob("*.safetensors"))
    if not files:
        raise ModelLoadError(f"{path}: no .safetensors files (only safetensors checkpoints are supported)")
    for f in files:
        if not f.exists():
            raise ModelLoadError(f"{path}: shard {f.name} named in the index is missing")
    return files


def iter_tensors(files: list[Path]) -> Iterator[tuple[str, Callable[[], Tensor], tuple[int, ...]]]:
    """(name, loader, shape) for every tensor, reading each only when asked."""
    from safetensors import safe_open

    for f in files:
        try:
            handle = safe_open(str(f), framework="pt")
        except Exception as e:  # noqa: BLE001 - any parse failure is a bad file
            raise ModelLoadError(f"{f}: not a readable safetensors file ({e})") from None
        for name in handle.keys():
            yield name, (lambda h=handle, n=name: h.get_tensor(n)), tuple(handle.get_slice(name).get_shape())


def count_mtp_layers(names: list[str], n_layers: int) -> int:
    """MTP decoder layers present under Qwen (mtp.layers.N) or DeepSeek-V3 (model.layers.{n_layers+j}) names."""
    qwen = {int(m.group(1)) for n in names if (m := re.match(r"mtp\.layers\.(\d+)\.", n))}
    deepseek = {int(m.group(1)) - n_layers for n in names if (m := re.match(r"(?:model\.)?layers\.(\d+)\.", n)) and int(m.group(1)) >= n_layers}
    if qwen or any(n.startswith("mtp.") for n in names):
        return max(qwen, default=-1) + 1
    return max(deepseek, default=-1) + 1


_DEEPSEEK_MTP = {"enorm": "pre_fc_norm_embedding", "hnorm": "pre_fc_norm_hidden", "eh_proj": "fc", "shared_head.norm": "norm"}


def rename(name: str, n_layers: int) -> str | None:
    """An HF tensor name -> ours (None = deliberately ignored)."""
    if name.startswith(IGNORED_PREFIXES):
        return None
    if name.startswith("model.language_model."):
        name = "model." + name[len("model.language_model."):]
    m = re.match(r"model\.layers\.(\d+)\.(.+)$", name)
    if m and int(m.group(1)) >= n_layers:  # DeepSeek-V3 style: the MTP module is layer n_layers (+ j)
        j, rest = int(m.group(1)) - n_layers, m.group(2)
        if rest in ("embed_tokens.weight", "shared_head.head.weight"):
            return None  # DeepSeek stores copies of the shared embedding / head here
        for src, dst in _DEEPSEEK_MTP.items():
            if rest == f"{src}.weight":
                return f"mtp.{dst}.weight"
        return f"mtp.layers.{j}.{rest}"
    return name


def split_qwen3_next(name: str, t: Tensor, cfg: HybridConfig) -> list[tuple[str, Tensor]]:
    """Qwen3-Next's per-key-head grouped in_proj_qkvz / in_proj_ba -> Qwen3.5's in_proj_qkv/z/b/a."""
    nk, nv, dk, dv = cfg.linear_num_key_heads, cfg.linear_num_value_heads, cfg.linear_key_head_dim, cfg.linear_value_head_dim
    r, h = nv // nk, t.shape[-1]
    base = name.rsplit(".", 2)[0]
    if name.endswith("in_proj_qkvz.weight"):
        g = t.reshape(nk, 2 * dk + 2 * r * dv, h)
        q, k, v, z = g.split([dk, dk, r * dv, r * dv], dim=1)
        qkv = torch.cat([q.reshape(nk * dk, h), k.reshape(nk * dk, h), v.reshape(nv * dv, h)])
        return [(f"{base}.in_proj_qkv.weight", qkv), (f"{base}.in_proj_z.weight", z.reshape(nv * dv, h))]
    g = t.reshape(nk, 2 * r, h)
    b, a = g.split([r, r], dim=1)
    return [(f"{base}.in_proj_b.weight", b.reshape(nv, h)), (f"{base}.in_proj_a.weight", a.reshape(nv, h))]


def build_empty(cfg, dtype: torch.dtype):
    """The model for `cfg` with uninitialised weights (no random init: weights come from the checkpoint)."""
    cls = HybridLM if isinstance(cfg, HybridConfig) else DenseLM
    with torch.device("meta"):
        model = cls(cfg).to(dtype)
    model = model.to_empty(device="cpu")
    rot_dim = cfg.rot_dim if isinstance(cfg, HybridConfig) else cfg.hd
    fresh = Rotary(rot_dim, cfg.max_seq_len, cfg.rope_theta)
    model.rotary.cos, model.rotary.sin = fresh.cos, fresh.sin
    if cfg.tie_embeddings:
        model.lm_head.weight = model.model.embed_tokens.weight
    return model.eval()


def load_state_strict(model, items, path: Path, arch: str) -> None:
    """Copy (name, loader, shape) items into the model; name every missing / unexpected / misshapen tensor."""
    params = dict(model.named_parameters(remove_duplicate=False))
    tied = model.config.tie_embeddings
    expected = {n for n in params if not (tied and n == "lm_head.weight")}
    seen, unexpected, shapes = set(), [], []
    for name, load, shape in items:
        if tied and name == "lm_head.weight":
            continue  # a tied head may be stored explicitly; the embedding is what we use
        p = params.get(name)
        if p is None or name not in expected:
            unexpected.append(name)
            continue
        if tuple(shape) != tuple(p.shape):
            shapes.append(f"{name} (checkpoint {list(shape)}, model {list(p.shape)})")
            continue
        with torch.no_grad():
            p.copy_(load())
        seen.add(name)
    missing = sorted(expected - seen - {s.split(" ")[0] for s in shapes})
    problems = []
    if missing:
        problems.append(f"missing tensors: {', '.join(missing)}")
    if unexpected:
        problems.append(f"unexpected tensors: {', '.join(sorted(unexpected))}")
    if shapes:
        problems.append(f"wrong shapes: {', '.join(shapes)}")
    if problems:
        raise ModelLoadError(f"{path}: checkpoint does not match the {arch} config; " + "; ".join(problems))


def load_hf_model(path: Path, dtype: torch.dtype, max_seq_len: int | None = None):
    raw = read_json(path / "config.json")
    text = _text_config(raw)
    files = safetensor_files(path)
    listing = list(iter_tensors(files))
    n_layers = int(text.get("num_hidden_layers", 0))
    names = [n.replace("model.language_model.", "model.", 1) for n, _, _ in listing]
    mtp_layers = count_mtp_layers(names, n_layers) if text.get("model_type") in HYBRID_TYPES else 0
    cfg, arch = config_from_hf(raw, path, mtp_layers, max_seq_len)
    items = []
    for name, load, shape in listing:
        new = rename(name, n_layers) if isinstance(cfg, HybridConfig) else (None if name.startswith(IGNORED_PREFIXES) else name)
        if new is None:
            continue
        if isinstance(cfg, HybridConfig) and re.search(r"linear_attn\.in_proj_(qkvz|ba)\.weight$", new):
            try:
                parts = split_qwen3_next(new, load(), cfg)
            except RuntimeError:
                items.append((new, load, shape))  # wrong shape: reported as unexpected below
                continue
            items += [(n, (lambda t=t: t), tuple(t.shape)) for n, t in parts]
            continue
        items.append((new, load, shape))
    model = build_empty(cfg, dtype)
    load_state_strict(model, items, path, arch)
    return model

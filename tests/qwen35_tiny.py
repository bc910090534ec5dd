"""Tiny random Hugging Face checkpoints (Qwen3.5, Qwen3-Next, Llama, Qwen3, Gemma 3) for the hybrid-model tests.

Weights are randomised well away from their init (zero-centred norms at 0, gated norms at 1 would
hide layout bugs), `mtp.*` tensors are appended to the safetensors for the hybrid models (transformers
drops them), and a small word-level tokenizer.json is written next to them.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import torch

VOCAB = 96
WORDS = [f"w{i}" for i in range(VOCAB)]


def write_tokenizer(d: Path, bos: bool = False, vocab: int = VOCAB) -> None:
    from tokenizers import Tokenizer, models, pre_tokenizers, processors, decoders

    words = [f"w{i}" for i in range(vocab)]
    if bos:
        words[1] = "<s>"
    tok = Tokenizer(models.WordLevel({w: i for i, w in enumerate(words)}, unk_token=words[0]))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tok.decoder = decoders.WordPiece(prefix="##", cleanup=False)  # joins words with spaces
    if bos:
        tok.post_processor = processors.TemplateProcessing(single="<s> $A", special_tokens=[("<s>", 1)])
        tok.add_special_tokens(["<s>"])
    tok.save(str(d / "tokenizer.json"))


@torch.no_grad()
def randomize(model: torch.nn.Module, seed: int = 0) -> None:
    g = torch.Generator().manual_seed(seed)
    for name, p in model.named_parameters():
        if "A_log" in name:
            continue
        noise = torch.randn(p.shape, generator=g)
        if p.ndim == 1:
            p.add_(0.2 * noise)  # norms, dt_bias: perturb around their init
        elif "embed_tokens" in name:
            p.copy_(noise)
        else:
            fan_in = p[0].numel()
            p.copy_(noise * (1.0 / fan_in**0.5))


HYBRID_KW = dict(
    vocab_size=VOCAB, hidden_size=32, intermediate_size=48, num_hidden_layers=4, num_attention_heads=4,
    num_key_value_heads=2, head_dim=16, linear_key_head_dim=8, linear_value_head_dim=8, linear_num_key_heads=2,
    linear_num_value_heads=4, max_position_embeddings=256, linear_conv_kernel_dim=4,
)


# More dense kinds: (config class, model class, config fields) for the config-field tests (tests/test_hf_configs.py):
# rope scaling, sliding windows (8 positions, so a 40-token prompt slides), biases
DENSE_KW = dict(vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
                num_key_value_heads=2, max_position_embeddings=256, bos_token_id=None, eos_token_id=None)
LLAMA3_ROPE = {"rope_type": "llama3", "rope_theta": 10000.0, "factor": 8.0, "low_freq_factor": 1.0,
               "high_freq_factor": 4.0, "original_max_position_embeddings": 64}  # wavelengths 6 | 63 | 628, 6283: all three bands
EXTRA_KINDS = {
    "llama3": ("LlamaConfig", "LlamaForCausalLM", dict(rope_parameters=LLAMA3_ROPE)),
    "llama-linear": ("LlamaConfig", "LlamaForCausalLM", dict(rope_parameters={"rope_type": "linear", "factor": 4.0})),
    "llama-dynamic": ("LlamaConfig", "LlamaForCausalLM", dict(rope_parameters={"rope_type": "dynamic", "factor": 4.0})),
    "llama-bias": ("LlamaConfig", "LlamaForCausalLM", dict(attention_bias=True, mlp_bias=True)),
    "mistral": ("MistralConfig", "MistralForCausalLM", dict(sliding_window=8)),
    "qwen2": ("Qwen2Config", "Qwen2ForCausalLM", dict(num_hidden_layers=3, use_sliding_window=True, sliding_window=8,
                                                      max_window_layers=1)),  # layer 0 full, layers 1-2 slide
    "qwen3-swa": ("Qwen3Config", "Qwen3ForCausalLM", dict(num_hidden_layers=3, head_dim=16, attention_bias=True,
                                                         layer_types=["sliding_attention", "full_attention", "sliding_attention"],
                                                         use_sliding_window=True, sliding_window=8)),
}


GEMMA3_KW = dict(num_hidden_layers=3, num_key_value_heads=1, head_dim=16, query_pre_attn_scalar=16, sliding_window=8,
                 layer_types=["sliding_attention", "sliding_attention", "full_attention"], pad_token_id=0,
                 rope_parameters={"full_attention": {"rope_type": "default", "rope_theta": 1_000_000.0},
                                  "sliding_attention": {"rope_type": "default", "rope_theta": 10_000.0}})


def tiny_hybrid(cfg, mtp_layers: int, seed: int):
    """An eval-mode HybridLM of `cfg` with `mtp_layers` MTP layers, built under seed 0 and randomize()d with `seed`."""
    from mtpspec.models.qwen35 import HybridConfig, HybridLM

    torch.manual_seed(0)
    m = HybridLM(HybridConfig(**{**cfg.__dict__, "mtp_num_layers": mtp_layers}))
    randomize(m, seed)
    return m.eval()


def hf_model(kind: str, tie: bool = False, seed: int = 0):
    """A randomised transformers model of `kind` in fp32 (qwen35, qwen3next, llama, qwen3, gemma3, or one of EXTRA_KINDS)."""
    import transformers as tf

    torch.manual_seed(seed)
    if kind == "qwen35":
        cfg = tf.Qwen3_5TextConfig(**HYBRID_KW, tie_word_embeddings=tie)
        model = tf.Qwen3_5ForCausalLM(cfg)
    elif kind == "qwen3next":
        cfg = tf.Qwen3NextConfig(**HYBRID_KW, tie_word_embeddings=tie, num_experts=4, num_experts_per_tok=2,
                                 moe_intermediate_size=16, shared_expert_intermediate_size=24, decoder_sparse_step=1,
                                 mlp_only_layers=[1])
        model = tf.Qwen3NextForCausalLM(cfg)
    elif kind == "llama":
        cfg = tf.LlamaConfig(vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                             num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
                             tie_word_embeddings=tie, bos_token_id=1, eos_token_id=None)
        model = tf.LlamaForCausalLM(cfg)
    elif kind == "qwen3":
        cfg = tf.Qwen3Config(vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                             num_attention_heads=4, num_key_value_heads=2, head_dim=16, max_position_embeddings=256,
                             tie_word_embeddings=tie)
        model = tf.Qwen3ForCausalLM(cfg)
    elif kind == "gemma3":  # two sliding-window layers (8 positions) then a global one, 1 KV head, as Gemma 3 270M
        cfg = tf.Gemma3TextConfig(**{**DENSE_KW, **GEMMA3_KW}, tie_word_embeddings=tie)
        model = tf.Gemma3ForCausalLM(cfg)
    elif kind in EXTRA_KINDS:
        cfg_cls, model_cls, fields = EXTRA_KINDS[kind]
        cfg = getattr(tf, cfg_cls)(**{**DENSE_KW, **fields}, tie_word_embeddings=tie)
        model = getattr(tf, model_cls)(cfg)
    else:
        raise ValueError(kind)
    randomize(model, seed)
    if tie:
        model.tie_weights()
    return model.eval()


def mtp_tensors(hf_cfg_dir: Path, seed: int = 1) -> dict[str, torch.Tensor]:
    """Random `mtp.*` tensors matching the hybrid checkpoint in hf_cfg_dir (one MTP decoder layer)."""
    from mtpspec.loading.hf import config_from_hf, read_json
    from mtpspec.models.qwen35 import HybridLM

    cfg, _ = config_from_hf(read_json(hf_cfg_dir / "config.json"), hf_cfg_dir, mtp_layers=1)
    torch.manual_seed(seed)
    model = HybridLM(cfg)
    randomize(model.mtp, seed)
    return {f"mtp.{k}": v.contiguous() for k, v in model.mtp.state_dict().items()}


def save_hf(kind: str, d: Path, mtp: bool = True, tie: bool = False, seed: int = 0, extra: dict | None = None):
    """Write a tiny checkpoint of `kind` to d (config.json, model.safetensors, tokenizer.json); return the HF model."""
    from safetensors.torch import load_file, save_file

    model = hf_model(kind, tie=tie, seed=seed)
    model.save_pretrained(d)
    write_tokenizer(d, bos=kind == "llama")
    if (mtp and kind in ("qwen35", "qwen3next")) or extra:
        f = d / "model.safetensors"
        state = load_file(str(f))
        if mtp and kind in ("qwen35", "qwen3next"):
            state.update(mtp_tensors(d, seed + 1))
        state.update(extra or {})
        save_file(state, str(f), metadata={"format": "pt"})
    return model


def edit_config(d: Path, **changes) -> None:
    p = d / "config.json"
    cfg = json.loads(p.read_text())
    cfg.update(changes)
    p.write_text(json.dumps(cfg))


def copy_ckpt(src: Path, parent: Path) -> Path:
    """A writable copy of checkpoint folder `src` at parent/ckpt (tests edit or damage it)."""
    d = parent / "ckpt"
    shutil.copytree(src, d)
    return d

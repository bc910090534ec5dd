"""T(1) at 1 vs 2 torch threads per model size: the measurements behind mtpspec.threads.default_threads.

T(1) = one plain decode forward (one new token over a `--cache`-token cache), median of `--reps`, the
thread counts interleaved rep by rep so machine-load drift hits both alike.

    python scripts/threads_t1.py [--reps 30] [--cache 128] [--ladder] [--big]
    # --ladder: random dense models shaped as stories15M / 42M / 110M; --big: the Qwen3.5-0.8B-shaped hybrid (bf16)
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch


def qwen35_08b(layers: int = 24, dtype: torch.dtype = torch.bfloat16, mtp: int = 1):
    """Our HybridLM with the Qwen3.5-0.8B shape and random weights (as scripts/qwen35_forward_cost.py, without transformers)."""
    from mtpspec.loading.hf import build_empty, config_from_hf

    hf = dict(model_type="qwen3_5_text", vocab_size=248320, hidden_size=1024, intermediate_size=3584, num_hidden_layers=layers,
              num_attention_heads=8, num_key_value_heads=2, head_dim=256, linear_num_key_heads=16, linear_num_value_heads=16,
              linear_key_head_dim=128, linear_value_head_dim=128, linear_conv_kernel_dim=4, rms_norm_eps=1e-6,
              tie_word_embeddings=True, max_position_embeddings=262144,
              layer_types=[("full_attention" if (i + 1) % 4 == 0 else "linear_attention") for i in range(layers)],
              rope_parameters={"rope_type": "default", "rope_theta": 10_000_000.0, "partial_rotary_factor": 0.25})
    cfg, _ = config_from_hf(hf, "qwen3.5-0.8b-shaped", mtp_layers=mtp, max_seq_len=2048)
    model = build_empty(cfg, dtype)
    g = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if p.ndim > 1:
                p.copy_(torch.randn(p.shape, generator=g) * 0.02)
            elif "norm" in name:
                p.zero_()  # zero-centred norms: weight 1 + 0
            else:
                p.copy_(torch.rand(p.shape, generator=g))  # A_log, dt_bias
    return model


def llama2c_shaped(dim: int, layers: int, heads: int, hidden: int, vocab: int = 32000):
    """A dense Llama with a llama2.c TinyStories model's shape (stories15M: 288/6/6/768, 42M: 512/8/8/1376,
    110M: 768/12/12/2048), random weights, fp32."""
    from mtpspec.models.dense import DenseConfig, DenseLM

    torch.manual_seed(0)
    cfg = DenseConfig(vocab_size=vocab, hidden_size=dim, num_layers=layers, num_heads=heads, num_kv_heads=heads,
                      intermediate_size=hidden, max_seq_len=512)
    return DenseLM(cfg).eval()


def t1_by_threads(module, threads=(1, 2), reps: int = 30, cache: int = 128) -> dict[int, float]:
    """threads -> median seconds of one one-token forward over a `cache`-token cache."""
    vocab = module.vocab_size
    g = torch.Generator().manual_seed(1)
    prompt = torch.randint(0, vocab, (cache,), generator=g)
    times: dict[int, list[float]] = {t: [] for t in threads}
    with torch.inference_mode():
        c = module.new_cache()
        module.forward_tokens(prompt, c)
        for t in threads:  # warm-up at each count
            torch.set_num_threads(t)
            module.forward_tokens(prompt[:1], c)
            c.crop(cache)
        for _ in range(reps):
            for t in threads:
                torch.set_num_threads(t)
                x = prompt[len(times[t]) % cache : len(times[t]) % cache + 1]
                s = time.perf_counter()
                module.forward_tokens(x, c)
                times[t].append(time.perf_counter() - s)
                c.crop(cache)
    return {t: statistics.median(v) for t, v in times.items()}


def main() -> None:
    import mtpspec
    from mtpspec.loading import assets_dir

    ap = argparse.ArgumentParser()
    ap.add_argument("--reps", type=int, default=30)
    ap.add_argument("--cache", type=int, default=128)
    ap.add_argument("--big", action="store_true", help="also the Qwen3.5-0.8B-shaped hybrid (bf16, ~1.6 GB)")
    ap.add_argument("--layers", type=int, default=24)
    ap.add_argument("--ladder", action="store_true", help="also random dense models shaped as stories15M / 42M / 110M")
    args = ap.parse_args()
    m = assets_dir() / "models"
    models = [("stories260K fp32", mtpspec.load(m / "stories260K.bin", m / "tok512.bin").module),
              ("demo fp32", mtpspec.load("demo").module), ("demo bf16", mtpspec.load("demo", dtype="bf16").module)]
    if args.ladder:
        models += [(f"stories{n}-shaped fp32 (random)", llama2c_shaped(*shape)) for n, shape in
                   (("15M", (288, 6, 6, 768)), ("42M", (512, 8, 8, 1376)), ("110M", (768, 12, 12, 2048)))]
    if args.big:
        models.append((f"qwen3.5-0.8B-shaped bf16 ({args.layers} layers)", qwen35_08b(args.layers)))
    print(f"| model | parameter MB | T(1) ms, 1 thread | T(1) ms, 2 threads | 2 / 1 |")
    print("|---|---|---|---|---|")
    for name, mod in models:
        mb = sum(p.numel() * p.element_size() for p in mod.parameters()) / 1e6
        t = t1_by_threads(mod, reps=args.reps if "0.8B" not in name else max(5, args.reps // 5), cache=args.cache)
        print(f"| {name} | {mb:.1f} | {t[1] * 1e3:.2f} | {t[2] * 1e3:.2f} | {t[2] / t[1]:.2f} |", flush=True)


if __name__ == "__main__":
    main()

"""Forward cost of the Qwen3.5-0.8B shape (random weights, bf16): our HybridLM vs transformers' Qwen3_5ForCausalLM.

For k = 1..9 new tokens over a 256-token cache, median seconds per forward, and T(k)/T(1) (k = D + 1).
Both models get the same weights (ours is loaded from transformers' state_dict by name).

    python scripts/qwen35_forward_cost.py [--threads 2] [--reps 5] [--cache 256] [--kmax 9] [--layers 24] [--draft-vocab 32768] [--compile]

It also times one MTP draft step with the full 248k-row head and with a draft-vocabulary head, and
prints the per-token time the cost model predicts for MTP at D = 1, 2 from these costs and the tokens
per target forward a real Qwen3.5 MTP head reaches (about 1.9 and 2.4, published).
"""

from __future__ import annotations

import argparse
import copy
import statistics
import time

import torch


def qwen35_08b_config(layers: int):
    from transformers import Qwen3_5TextConfig

    return Qwen3_5TextConfig(
        vocab_size=248320, hidden_size=1024, intermediate_size=3584, num_hidden_layers=layers, num_attention_heads=8,
        num_key_value_heads=2, head_dim=256, linear_num_key_heads=16, linear_num_value_heads=16, linear_key_head_dim=128,
        linear_value_head_dim=128, linear_conv_kernel_dim=4, rms_norm_eps=1e-6, tie_word_embeddings=True,
        max_position_embeddings=262144, rope_parameters={"rope_type": "default", "rope_theta": 10_000_000.0, "partial_rotary_factor": 0.25},
    )


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--cache", type=int, default=256)
    ap.add_argument("--kmax", type=int, default=9)
    ap.add_argument("--layers", type=int, default=24)
    ap.add_argument("--exact", action="store_true", help="our model in exact mode (DeltaNet position by position)")
    ap.add_argument("--draft-vocab", type=int, default=32768, help="rows of the draft-vocabulary head timed beside the full one")
    ap.add_argument("--compile", action="store_true", help="our forward through the compiled step (mtpspec.models.compiled; "
                    "each width compiles on first use: 1-2 min each on 2 cores, cold)")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    torch.manual_seed(0)

    from transformers import Qwen3_5ForCausalLM
    from transformers.cache_utils import DynamicCache

    from mtpspec.loading.hf import build_empty, config_from_hf, load_state_strict

    hf_cfg = qwen35_08b_config(args.layers)
    t0 = time.perf_counter()
    ref = Qwen3_5ForCausalLM(hf_cfg).to(torch.bfloat16).eval()
    ours_cfg, _ = config_from_hf(hf_cfg.to_dict(), "qwen3.5-0.8b", mtp_layers=1, max_seq_len=2048)
    ours = build_empty(ours_cfg, torch.bfloat16)
    state = ref.state_dict()
    with torch.no_grad():  # a random MTP head (transformers has none), then the shared weights by name
        for name, p in ours.named_parameters():
            if name.startswith("mtp."):
                p.normal_(0, 0.02) if p.ndim > 1 else p.zero_()
    mtp_items = [(k, (lambda v=v: v), tuple(v.shape)) for k, v in ours.state_dict().items() if k.startswith("mtp.")]
    items = [(k, (lambda v=v: v), tuple(v.shape)) for k, v in state.items()] + mtp_items
    load_state_strict(ours, items, "qwen3.5-0.8b", "Qwen3.5")
    print(f"built both models in {time.perf_counter() - t0:.0f} s; params {sum(p.numel() for p in ours.parameters()) / 1e6:.0f} M")

    prompt = torch.randint(0, hf_cfg.vocab_size, (args.cache,))
    ks = list(range(1, args.kmax + 1))
    with torch.inference_mode():
        if args.compile:
            from mtpspec.models.compiled import compile_model

            compile_model(ours, max_width=max(ks))
        our_cache = ours.new_cache()
        ours.forward_tokens(prompt, our_cache, prefill=True)  # as the engine's prefill: final state only
        our_cache.exact = args.exact
        hf_cache = DynamicCache(config=hf_cfg)
        ref(prompt[None], cache=hf_cache, use_cache=True)

        def run_ours(k: int) -> float:
            x = torch.randint(0, hf_cfg.vocab_size, (k,))
            t = time.perf_counter()
            ours.forward_tokens(x, our_cache)
            dt = time.perf_counter() - t
            our_cache.crop(args.cache)  # roll back to the 256-token cache (slot 0 of the last forward)
            return dt

        def run_hf(k: int) -> float:
            x = torch.randint(0, hf_cfg.vocab_size, (1, k))
            cache = copy.deepcopy(hf_cache)  # a fresh copy of the 256-token cache each time (not timed)
            t = time.perf_counter()
            ref(x, cache=cache, use_cache=True)
            return time.perf_counter() - t

        times = {("ours", k): [] for k in ks} | {("hf", k): [] for k in ks}
        for name, fn in (("ours", run_ours), ("hf", run_hf)):
            for k in ks if args.compile else (1, 4):  # warm up (compiled: every width built before timing)
                fn(k)
        for _ in range(args.reps):  # round robin, so drift in machine load hits every k alike
            for k in ks:
                times[("ours", k)].append(run_ours(k))
                times[("hf", k)].append(run_hf(k))
        # one MTP draft step (the MTP layer + the shared 248k head), as --drafter mtp runs it
        mtp_cache = ours.new_mtp_cache()
        hid = ours.forward_tokens(prompt[:32], ours.new_cache()).hidden
        ours.mtp_forward(hid[:-1], prompt[1:32], mtp_cache)
        # and with a draft vocabulary (--draft-vocab N: the head restricted to the N most frequent tokens; random
        # weights have no frequencies, so the first N ids stand in: the cost is the same)
        from mtpspec.models.draft_vocab import DraftHead

        sub = DraftHead(ours.lm_head.weight, torch.arange(args.draft_vocab))
        mtp_times, sub_times = [], []
        for _ in range(args.reps):
            for head, acc in ((lambda h: ours.head(h), mtp_times), (sub.logits, sub_times)):
                t = time.perf_counter()
                h = ours.mtp_forward(hid[-1:], prompt[5:6], mtp_cache)
                head(h).argmax(-1)
                acc.append(time.perf_counter() - t)
                mtp_cache.crop(31)
        # same function: argmax agreement of one fresh forward (bf16)
        c = ours.new_cache()
        a = ours.forward_tokens(prompt[:64], c).logits
        b = ref(prompt[None, :64]).logits[0].float()
        agree = (a.argmax(-1) == b.argmax(-1)).float().mean().item()

    med = {key: statistics.median(v) for key, v in times.items()}
    full, small, t1 = statistics.median(mtp_times), statistics.median(sub_times), med[("ours", 1)]
    print(f"one MTP draft step (layer + head): {full * 1e3:.1f} ms ({full / t1:.2f} T(1)); with a {args.draft_vocab}-token "
          f"draft vocabulary: {small * 1e3:.1f} ms ({small / t1:.2f} T(1))")
    for d, per_step in ((1, 1.9), (2, 2.4)):  # tokens per target forward a real Qwen3.5 MTP head reaches (published)
        if d + 1 in ks:
            pred = {name: (med[("ours", d + 1)] + d * draft) / per_step for name, draft in (("full head", full), ("draft vocab", small))}
            print(f"predicted MTP D={d} at {per_step} tokens/step: " + ", ".join(f"{k} {v * 1e3:.1f} ms/token" for k, v in pred.items()))
    print(f"exact={args.exact} threads={args.threads} cache={args.cache} reps={args.reps} layers={args.layers}; prefill-64 argmax agreement {agree:.3f}")
    print("| model | T(1) ms | " + " | ".join(f"T({k})/T(1)" for k in ks[1:]) + " |")
    print("|---|---|" + "---|" * (len(ks) - 1))
    for name, label in (("ours", "mtpspec HybridLM"), ("hf", "transformers Qwen3_5ForCausalLM")):
        t1 = med[(name, 1)]
        print(f"| {label} | {t1 * 1e3:.0f} | " + " | ".join(f"{med[(name, k)] / t1:.2f}" for k in ks[1:]) + " |")


if __name__ == "__main__":
    main()

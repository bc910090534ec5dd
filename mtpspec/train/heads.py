"""`mtpspec train head`: fit a draft head (MTP, Medusa, EAGLE) to a frozen target by self-distillation.

The target continues training prompts (never the held-out ones), half greedily, half sampled at `gen_temperature`;
one teacher pass gives its post-final-norm hiddens h (T, H), its distributions softmax(LM head(h)) recomputed on the
fly. The head is fitted to them (soft cross-entropy = KL up to a constant):
   - mtp: pairs (h_i, e(t_{i+1})) -> p_{i+1}; depth k chains on the head's own output hidden.
   - eagle: the same chain on predicted features, plus feature regression (smooth L1 to h_{i+k}).
   - medusa: block k on h_i -> p_{i+k} (the distribution of t_{i+k+1}).
"""

from __future__ import annotations

import json
import random
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import Tensor

from ..models.batch import ForwardBatch
from ..models.forward import module_forward
from ..models.heads import DraftHead, DraftHeadConfig, save_head


@dataclass
class HeadConfig:
    out: str  # output folder (head.json + head.safetensors + report.json)
    kind: str = "mtp"  # mtp | medusa | eagle
    prompts: str = "tinystories"  # tinystories | stdlib | a text file (one prompt per line)
    heldout_prompts: int = 50  # the first n prompts are never trained on (the evaluation set)
    train_prompts: int = 400
    gen_tokens: int = 160  # continuation length sampled from the target per prompt
    gen_temperature: float = 1.0  # for the sampled half (the other half is greedy)
    depth: int = 2  # chained depths trained (mtp, eagle)
    num_medusa: int = 3  # K (medusa)
    num_heads: int = 4
    num_kv_heads: int = 4
    head_dim: int = 16
    intermediate_size: int = 0  # 0 = 4 x hidden
    steps: int = 600
    batch_size: int = 16
    seq_len: int = 128
    lr: float = 3e-3
    feature_weight: float = 1.0  # eagle: weight of the feature regression next to the token loss
    depth_decay: float = 0.8  # weight of depth k is decay^(k-1)
    seed: int = 0
    threads: int = 1
    eval_prompts: int = 20  # held-out prompts measured at the end (greedy, D = depth or K)
    eval_tokens: int = 128
    data_cache: str = ""  # a .pt file: self-distillation data is loaded from it if present, else written to it


def training_prompts(cfg: HeadConfig, tokenizer) -> tuple[list[str], list[str]]:
    """(train, held-out) prompt texts; held-out = the first cfg.heldout_prompts of the set."""
    if cfg.prompts == "tinystories":
        from ..prompts import tinystories_prompts

        allp = tinystories_prompts(cfg.heldout_prompts + cfg.train_prompts)
    elif cfg.prompts == "stdlib":
        from . import data as D

        train_files, held_files = D.stdlib_files()
        held = D.code_prompts(held_files, cfg.heldout_prompts)
        return D.code_prompts(train_files, cfg.train_prompts, seed=1), held
    else:
        allp = [ln for ln in Path(cfg.prompts).read_text(encoding="utf-8").splitlines() if ln.strip()]
    return allp[cfg.heldout_prompts :], allp[: cfg.heldout_prompts]


@torch.inference_mode()
def self_distill_data(target, tokenizer, prompts: list[str], cfg: HeadConfig, progress_bar: bool = True) -> list[tuple[Tensor, Tensor]]:
    """[(tokens (T,), hidden (T, H))]: the target's own continuations and its teacher pass over them."""
    from tqdm import tqdm

    from ..drafters.base import NoDrafter
    from ..engine import generate_tokens
    from ..sampling import Sampler, SamplingParams

    seqs = []
    for i, p in enumerate(tqdm(prompts, desc="self-distillation data", disable=not progress_bar)):
        ids = tokenizer.encode(p)[-(target.max_seq_len // 2) :]
        temp = 0.0 if i % 2 == 0 else cfg.gen_temperature
        n = min(cfg.gen_tokens, target.max_seq_len - len(ids) - 1)
        r = generate_tokens(target, ids, NoDrafter(), 1, Sampler(SamplingParams(temperature=temp), seed=cfg.seed + i), n)
        toks = torch.tensor(ids + r.tokens, dtype=torch.long)
        out = target.forward_tokens(toks, target.new_cache())
        seqs.append((toks.clone(), out.hidden.clone()))
    return seqs


def cached_distill_data(target, tokenizer, prompts: list[str], cfg, progress_bar: bool = True) -> list[tuple[Tensor, Tensor]]:
    """`self_distill_data`, read from / written to cfg.data_cache when it names a file."""
    if cfg.data_cache and Path(cfg.data_cache).exists():
        return torch.load(cfg.data_cache)
    seqs = self_distill_data(target, tokenizer, prompts, cfg, progress_bar)
    if cfg.data_cache:
        torch.save(seqs, cfg.data_cache)
    return seqs


def _batch(seqs, n: int, length: int, rng: random.Random) -> tuple[Tensor, Tensor]:
    """(tokens (B, T), hidden (B, T, H)) windows of the same length from random sequences."""
    toks, hid = [], []
    for _ in range(n):
        t, h = seqs[rng.randrange(len(seqs))]
        L = min(length, t.shape[0])
        s = rng.randrange(t.shape[0] - L + 1)
        toks.append(t[s : s + L])
        hid.append(h[s : s + L])
    m = min(x.shape[0] for x in toks)
    return torch.stack([x[:m] for x in toks]), torch.stack([x[:m] for x in hid])


def _soft_ce(logits: Tensor, teacher_logits: Tensor) -> Tensor:
    return -(torch.softmax(teacher_logits, -1) * torch.log_softmax(logits, -1)).sum(-1).mean()


def head_losses(head: DraftHead, target, tokens: Tensor, hidden: Tensor, cfg: HeadConfig) -> tuple[Tensor, dict]:
    """tokens (B, T), hidden (B, T, H) target post-norm hiddens -> (loss, {per-part values})."""
    kind = head.config.kind
    with torch.no_grad():
        teacher = target.head(hidden)  # (B, T, V) p_i = distribution of t_{i+1}
        emb = target.embed(tokens)  # (B, T, H)
    parts, total = {}, 0.0
    if kind == "medusa":
        feats = head.medusa(hidden)  # (K, B, T, H)
        for k in range(1, feats.shape[0] + 1):
            T = tokens.shape[1] - k
            loss = _soft_ce(target.head(feats[k - 1, :, :T]), teacher[:, k:])
            parts[f"head_{k}"] = loss.item()
            total = total + cfg.depth_decay ** (k - 1) * loss
        return total, parts
    h = hidden
    for k in range(1, cfg.depth + 1):
        e = emb[:, k:]  # (B, T-k, H) e(t_{i+k})
        h = module_forward(head.mtp, h[:, : e.shape[1]], e, None, None, ForwardBatch.window(*e.shape[:2]), 0)  # MTP or EAGLE
        loss = _soft_ce(target.head(h), teacher[:, k:])  # position i predicts t_{i+k+1}
        parts[f"ce_{k}"] = loss.item()
        w = cfg.depth_decay ** (k - 1)
        total = total + w * loss
        if kind == "eagle":
            reg = F.smooth_l1_loss(h, hidden[:, k:])  # predicted feature f ~ h_{i+k}
            parts[f"feature_{k}"] = reg.item()
            total = total + w * cfg.feature_weight * reg
    return total, parts


def measure(target, tokenizer, head: DraftHead | None, prompts: list[str], k: int, new_tokens: int, drafter: str | None = None) -> dict:
    """Greedy on held-out prompts: mean accepted length, acceptance by position, identical to plain. drafter: the
    head's kind by default (head None + "mtp": the target's own MTP module)."""
    from ..drafters import make_drafter
    from ..engine import generate_tokens
    from ..metrics import Acceptance
    from ..sampling import Sampler, SamplingParams

    acceptance = Acceptance()
    identical = True
    for p in prompts:
        ids = tokenizer.encode(p)
        plain = generate_tokens(target, ids, make_drafter("none", target), 1, Sampler(SamplingParams()), new_tokens)
        d = make_drafter(drafter or head.config.kind, target, draft_model=head)
        r = generate_tokens(target, ids, d, k, Sampler(SamplingParams()), new_tokens)
        identical &= r.tokens == plain.tokens
        acceptance += Acceptance.from_steps(r.steps)
    return {
        "k": k, "prompts": len(prompts), "mean_accepted_length": round(acceptance.mean_accepted_length, 3),
        "acceptance_by_position": [None if a is None else round(a, 3) for a in acceptance.by_position(k)],
        "identical_to_plain": identical,
    }


def train_head(model: str | Path, cfg: HeadConfig, tokenizer=None, progress_bar: bool = True, target=None) -> dict:
    """Train a head for the frozen target at `model` (or the given (module, tokenizer) pair in `target`)."""
    from tqdm import tqdm

    from ..loading import load_checkpoint
    from .pretrain import optimizer_step

    torch.set_num_threads(cfg.threads)
    torch.manual_seed(cfg.seed)
    module, tok = target if target is not None else load_checkpoint(model, tokenizer)
    module.eval()
    for p in module.parameters():
        p.requires_grad_(False)
    train_p, held_p = training_prompts(cfg, tok)
    t0 = time.perf_counter()
    seqs = cached_distill_data(module, tok, train_p, cfg, progress_bar)
    gen_s = time.perf_counter() - t0
    h = module.config.hidden_size
    hc = DraftHeadConfig(
        kind=cfg.kind, hidden_size=h, vocab_size=module.vocab_size, max_seq_len=module.max_seq_len,
        num_heads=cfg.num_heads, num_kv_heads=cfg.num_kv_heads, head_dim=cfg.head_dim,
        intermediate_size=cfg.intermediate_size or 4 * h, num_medusa=cfg.num_medusa,
        rope_theta=getattr(module.config, "rope_theta", 10000.0),
    )
    head = DraftHead(hc)
    opt = torch.optim.AdamW(head.parameters(), lr=cfg.lr, weight_decay=0.0)
    rng = random.Random(cfg.seed)
    history = []
    bar = tqdm(range(cfg.steps), desc=f"train {cfg.kind} head", disable=not progress_bar)
    t1 = time.perf_counter()
    for step in bar:
        lr = cfg.lr * min(1.0, (step + 1) / 30) * (0.1 + 0.9 * 0.5 * (1 + torch.cos(torch.tensor(step / cfg.steps * 3.14159)).item()))
        toks, hid = _batch(seqs, cfg.batch_size, cfg.seq_len, rng)
        loss, parts = head_losses(head, module, toks, hid, cfg)
        optimizer_step(opt, head.parameters(), loss, lr)
        bar.set_postfix(loss=f"{loss.item():.3f}")
        if step % 50 == 0 or step == cfg.steps - 1:
            history.append({"step": step, "loss": round(loss.item(), 4), **{k: round(v, 4) for k, v in parts.items()}})
    train_s = time.perf_counter() - t1
    head.eval()
    save_head(head, cfg.out)
    k = cfg.num_medusa if cfg.kind == "medusa" else max(cfg.depth, 1)
    report = {
        "kind": cfg.kind, "target": str(model), "parameters": sum(p.numel() for p in head.parameters()),
        "train_prompts": len(train_p), "heldout_prompts_skipped": len(held_p), "distill_tokens": sum(t.shape[0] for t, _ in seqs),
        "generation_seconds": round(gen_s, 1), "train_seconds": round(train_s, 1), "steps": cfg.steps,
        "final_loss": history[-1] if history else None,
        "heldout_greedy": measure(module, tok, head, held_p[: cfg.eval_prompts], k, cfg.eval_tokens) if cfg.eval_prompts else None,
        "config": asdict(cfg), "history": history,
    }
    (Path(cfg.out) / "report.json").write_text(json.dumps(report, indent=2) + "\n")
    return report

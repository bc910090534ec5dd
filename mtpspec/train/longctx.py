"""`mtpspec train longctx`: continue training a hybrid model with an MTP module at a longer context.

Raises the context to `max_seq_len` (the weights unchanged), measures held-out next-token and MTP (t+2) loss by
position bucket, trains on random `seq_len` windows with pretraining's objective for `steps` or `max_minutes`
(whichever ends first), measures again and writes the checkpoint with report.json. Resumable (`train_state.pt`).
"""

from __future__ import annotations

import dataclasses
import json
import shutil
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import Tensor

from ..errors import ConfigError
from ..models.qwen35 import HybridLM
from . import data as D
from .pretrain import adamw, hybrid_hidden, losses, lr_at, mtp_hiddens, optimizer_step, resume, save_state

BUCKETS = (0, 512, 1024, 2048, 4096, 8192, 16384)  # position bucket edges of the loss table


@dataclass
class LongCtxConfig:
    out: str  # output folder: the checkpoint at the new context, report.json, train_state.pt, data.pt
    max_seq_len: int = 32768  # the new context (rotary tables and KV caches are built to it)
    seq_len: int = 4096  # training window (the training files concatenated, EOT between them)
    batch_size: int = 1
    steps: int = 100000  # schedule length; training also ends at max_minutes, whichever comes first
    max_minutes: float = 25.0  # 0 = no time limit; > 0: the schedule follows max(step/steps, time/max_minutes)
    lr: float = 3e-4
    min_lr_ratio: float = 0.1
    warmup_steps: int = 10
    weight_decay: float = 0.1
    mtp_lambda: float = 0.1  # loss = CE(next) + mtp_lambda * CE(MTP depth 1), as pretraining's last part
    eval_len: int = 16384  # held-out sequence length for the loss-by-position table
    eval_seqs: int = 4  # held-out sequences measured (the held-out stream is cut into non-overlapping ones)
    save_every: int = 10  # steps between train_state.pt saves
    seed: int = 0
    threads: int = 1
    data_files: list[str] = field(default_factory=list)  # training .py files; empty = the stdlib minus HELDOUT
    heldout_files: list[str] = field(default_factory=list)


def with_context(model: HybridLM, max_seq_len: int) -> HybridLM:
    """The same weights in a model built for `max_seq_len` positions (fresh rotary tables, strict load)."""
    raised = HybridLM(dataclasses.replace(model.config, max_seq_len=max_seq_len))
    raised.load_state_dict(model.state_dict(), strict=True)
    raised.token_ranking = getattr(model, "token_ranking", None)
    return raised


@dataclass
class BucketLoss:
    lo: int  # positions lo..hi-1 of the predicting token
    hi: int
    tokens: int  # predictions averaged
    next_token: float  # mean CE of t_{i+1}
    mtp: float  # mean CE of the MTP module's t_{i+2}


@torch.no_grad()
def position_losses(model: HybridLM, seq: Tensor) -> tuple[Tensor, Tensor]:
    """seq (1, T) -> next-token CE (T-1,) at positions 0..T-2 (scoring t_{i+1}) and MTP (depth 1) CE (T-2,) at
    positions 0..T-3 (reading h_i and e(t_{i+1}), scoring t_{i+2}), as pretrain.py `losses`."""
    h = hybrid_hidden(model, seq)  # (1, T, H)
    nxt = F.cross_entropy(model.head(h[0, :-1]), seq[0, 1:], reduction="none")  # (T-1,)
    hk = mtp_hiddens(model.mtp, model.embed, h, seq, 1)[0]  # (1, T-1, H)
    mtp = F.cross_entropy(model.head(hk[0, :-1]), seq[0, 2:], reduction="none")  # (T-2,)
    return nxt, mtp


def bucket_losses(model: HybridLM, seqs: Tensor, edges: tuple[int, ...] = BUCKETS) -> list[BucketLoss]:
    """seqs (N, T): mean losses over every sequence by position bucket (buckets past T are left out)."""
    model.eval()
    nxt_sum = torch.zeros(seqs.shape[1] - 1, dtype=torch.float64)
    mtp_sum = torch.zeros(seqs.shape[1] - 2, dtype=torch.float64)
    for s in seqs:
        nxt, mtp = position_losses(model, s[None])
        nxt_sum += nxt.double()
        mtp_sum += mtp.double()
    out = []
    for lo, hi in zip(edges, edges[1:]):
        hi = min(hi, mtp_sum.shape[0])  # the MTP row is one shorter: both averaged over the same positions
        if lo >= hi:
            break
        n = (hi - lo) * seqs.shape[0]
        out.append(BucketLoss(lo, hi, n, round(nxt_sum[lo:hi].sum().item() / n, 4), round(mtp_sum[lo:hi].sum().item() / n, 4)))
    return out


def _check(cfg: LongCtxConfig, model, name: str) -> None:
    if not isinstance(model, HybridLM) or model.mtp is None:
        raise ConfigError(f"{name}: `train longctx` needs a hybrid (qwen35) model with an MTP module; this one has none "
                          "(train one with `mtpspec train pretrain`)")
    old = model.config.max_seq_len
    if cfg.max_seq_len < old:
        raise ConfigError(f"--max-seq-len {cfg.max_seq_len} is smaller than the model's context {old}: longctx only raises it")
    if cfg.seq_len < 3 or cfg.seq_len > cfg.max_seq_len:
        raise ConfigError(f"--seq-len {cfg.seq_len} must be between 3 and --max-seq-len {cfg.max_seq_len}")
    if cfg.eval_len < 3 or cfg.eval_len > cfg.max_seq_len:
        raise ConfigError(f"--eval-len {cfg.eval_len} must be between 3 and --max-seq-len {cfg.max_seq_len}")
    if cfg.batch_size < 1 or cfg.eval_seqs < 1 or cfg.steps < 0 or cfg.max_minutes < 0 or cfg.save_every < 1:
        raise ConfigError("--batch-size, --eval-seqs and --save-every must be >= 1, --steps and --max-minutes >= 0")
    if cfg.steps == 0 and cfg.max_minutes == 0:
        raise ConfigError("give --steps or --max-minutes (both are 0: training would never end)")
    if not (cfg.lr > 0 and 0 <= cfg.min_lr_ratio <= 1):
        raise ConfigError(f"--lr must be > 0 and --min-lr-ratio in [0, 1], got {cfg.lr}, {cfg.min_lr_ratio}")


def _streams(cfg: LongCtxConfig, tok, out: Path) -> tuple[Tensor, Tensor]:
    """The encoded training and held-out streams (each file preceded by EOT), cached in out/data.pt."""
    if not hasattr(tok, "tokenizer"):
        raise ConfigError("`train longctx` encodes its text with a Hugging Face tokenizer (tokenizer.json); this model has another")
    if cfg.data_files:
        train_files, held_files = [Path(p) for p in cfg.data_files], [Path(p) for p in cfg.heldout_files]
    else:
        train_files, held_files = D.stdlib_files()
    key = {"train": [str(p) for p in train_files], "heldout": [str(p) for p in held_files]}
    path = out / "data.pt"
    if path.exists():
        cached = torch.load(path)
        if cached.get("files") == key:
            return cached["train"], cached["heldout"]
    train = D.encode_stream(tok, D.read_texts(train_files)) if train_files else torch.zeros(0, dtype=torch.int32)
    held = D.encode_stream(tok, D.read_texts(held_files)) if held_files else torch.zeros(0, dtype=torch.int32)
    torch.save({"files": key, "train": train, "heldout": held}, path)
    return train, held


def train_longctx(model: str | Path, cfg: LongCtxConfig, tokenizer=None, progress_bar: bool = True) -> dict:
    """Raise the context, measure, train (or resume), measure, write the checkpoint + report.json; returns the report."""
    from tqdm import tqdm

    from ..loading import load_checkpoint, resolve_demo
    from ..loading.native import save_checkpoint

    torch.set_num_threads(cfg.threads)
    torch.manual_seed(cfg.seed)
    src = resolve_demo()[0] if str(model) == "demo" else Path(model)
    loaded, tok = load_checkpoint(model, tokenizer)
    _check(cfg, loaded, str(model))
    old_len = loaded.config.max_seq_len
    net = with_context(loaded, cfg.max_seq_len)
    del loaded
    out = Path(cfg.out)
    out.mkdir(parents=True, exist_ok=True)
    train, held = _streams(cfg, tok, out)
    if train.shape[0] <= cfg.seq_len:
        raise ConfigError(f"the training text has {train.shape[0]} tokens: too few for --seq-len {cfg.seq_len}")
    if held.shape[0] < cfg.eval_len:
        raise ConfigError(f"the held-out text has {held.shape[0]} tokens: too few for one --eval-len {cfg.eval_len} sequence")
    evalseqs = D.eval_windows(held, cfg.eval_len, cfg.eval_seqs)  # (N, eval_len)
    (out / "longctx_config.json").write_text(json.dumps({"model": str(model), **asdict(cfg)}, indent=2) + "\n")

    before_path = out / "eval_before.json"  # measured once: a resumed run reuses it
    if before_path.exists():
        before = json.loads(before_path.read_text())
    else:
        t0 = time.perf_counter()
        before = {"buckets": [asdict(b) for b in bucket_losses(net, evalseqs)], "seconds": round(time.perf_counter() - t0, 1)}
        before_path.write_text(json.dumps(before, indent=2) + "\n")

    opt, gen = adamw(net, cfg.lr, cfg.weight_decay), torch.Generator().manual_seed(cfg.seed)
    state_path = out / "train_state.pt"
    step, elapsed, history = resume(state_path, net, opt, gen)

    def progress() -> float:
        p = step / cfg.steps if cfg.steps > 0 else 0.0
        return max(p, elapsed / (cfg.max_minutes * 60)) if cfg.max_minutes > 0 else p

    bar = tqdm(total=cfg.steps if cfg.max_minutes == 0 else None, initial=step, disable=not progress_bar, dynamic_ncols=True)
    net.train()
    t_last = time.perf_counter()
    while progress() < 1.0:
        lr = lr_at(cfg, progress(), step)
        batch = D.random_windows(train, cfg.batch_size, cfg.seq_len, gen)  # (B, seq_len)
        main, mtp = losses(net, batch, 1)
        optimizer_step(opt, net.parameters(), main + cfg.mtp_lambda * mtp[0], lr)
        now = time.perf_counter()
        dt, t_last = now - t_last, now
        elapsed += dt
        step += 1
        history.append({"step": step, "elapsed_s": round(elapsed, 1), "lr": round(lr, 7),
                        "next_token": round(main.item(), 4), "mtp_1": round(mtp[0].item(), 4)})
        bar.update(1)
        bar.set_postfix(loss=f"{main.item():.3f}", mtp=f"{mtp[0].item():.3f}", lr=f"{lr:.1e}", tok_s=f"{batch.numel() / dt:.0f}")
        if step % cfg.save_every == 0:
            save_state(state_path, net, opt, gen, step, elapsed, history)
    bar.close()
    save_state(state_path, net, opt, gen, step, elapsed, history)

    t0 = time.perf_counter()
    after = [asdict(b) for b in bucket_losses(net, evalseqs)]
    after_s = round(time.perf_counter() - t0, 1)
    save_checkpoint(net, tok, out)
    for name in ("tokenizer.json", "draft_vocab.json"):  # the source's own files, byte for byte
        if src.is_dir() and (src / name).exists():
            shutil.copy(src / name, out / name)
    tokens = step * cfg.batch_size * cfg.seq_len
    report = {
        "source": str(model), "old_max_seq_len": old_len, "max_seq_len": cfg.max_seq_len,
        "steps": step, "train_seconds": round(elapsed, 1), "tokens_seen": tokens,
        "tokens_per_second": round(tokens / elapsed, 1) if elapsed > 0 else None,
        "train_tokens_available": int(train.shape[0]),
        "eval": {"sequences": int(evalseqs.shape[0]), "length": cfg.eval_len, "heldout_tokens": int(held.shape[0]),
                 "seconds_before": before["seconds"], "seconds_after": after_s},
        "loss_by_position": [{"positions": f"{b['lo']}-{a['hi']}", "tokens": a["tokens"],
                              "next_token_before": b["next_token"], "next_token_after": a["next_token"],
                              "mtp_before": b["mtp"], "mtp_after": a["mtp"]} for b, a in zip(before["buckets"], after)],
        "config": asdict(cfg), "history": history,
    }
    (out / "report.json").write_text(json.dumps(report, indent=2) + "\n")
    return report


def loss_table(report: dict) -> str:
    """report.json's loss_by_position as a markdown table."""
    rows = ["| positions | predictions | next-token before | after | MTP (t+2) before | after |", "|---|---|---|---|---|---|"]
    for r in report["loss_by_position"]:
        rows.append(f"| {r['positions']} | {r['tokens']} | {r['next_token_before']:.3f} | {r['next_token_after']:.3f} "
                    f"| {r['mtp_before']:.3f} | {r['mtp_after']:.3f} |")
    return "\n".join(rows)

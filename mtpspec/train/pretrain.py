"""`mtpspec train pretrain`: a Qwen3.5-style hybrid trained from scratch with the DeepSeek-V3 objective

    loss = CE(next token) + lambda * mean_k CE(MTP depth k),   lambda = 0.3, then 0.1 for the last part.

MTP depth k at position i reads the depth-(k-1) hidden (the post-final-norm hidden for k = 1) and e(t_{i+k}), and
predicts t_{i+k+1} (layer (k-1) % n). Resumable from `train_state.pt`; the checkpoint is the project's own format
with `report.json` beside it.
"""

from __future__ import annotations

import json
import math
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import Tensor

from ..device import of as device_of, on, resolve
from ..errors import ConfigError
from ..models.batch import ForwardBatch
from ..models.forward import hybrid_forward, module_forward
from ..models.qwen35 import HybridConfig, HybridLM
from . import data as D
from .distributed import World, launch, train_device


@dataclass
class PretrainConfig:
    out: str  # output folder (checkpoint, tokenizer, train_state.pt, report.json)
    vocab_size: int = 4096  # byte-level BPE vocabulary
    hidden_size: int = 256
    num_layers: int = 4
    full_attention_every: int = 4  # layer i is full attention when (i + 1) % this == 0 (3:1 DeltaNet:attention)
    num_heads: int = 4
    num_kv_heads: int = 2
    head_dim: int = 64
    intermediate_size: int = 704
    linear_key_heads: int = 2
    linear_value_heads: int = 4
    linear_head_dim: int = 64
    max_seq_len: int = 1024  # context of the shipped model (full attention KV is preallocated to it)
    seq_len: int = 384  # training window
    batch_size: int = 8
    steps: int = 4000  # schedule length; training also ends at max_minutes, whichever comes first
    max_minutes: float = 0.0  # 0 = no time limit; > 0: the schedule follows max(step/steps, time/max_minutes)
    lr: float = 2e-3
    min_lr_ratio: float = 0.1
    warmup_steps: int = 100
    weight_decay: float = 0.1
    mtp_depth: int = 1  # MTP depths trained (>= 1), chained through the MTP module's layers
    mtp_num_layers: int = 1  # decoder layers of the MTP module: depth k trains layer (k-1) % n (needs mtp_depth >= n)
    mtp_lambda: float = 0.3
    mtp_lambda_final: float = 0.1
    lambda_switch: float = 0.8  # fraction of training after which lambda = mtp_lambda_final
    eval_every: int = 200
    eval_windows: int = 32
    save_every: int = 200
    seed: int = 0
    threads: int = 1
    data_files: list[str] = field(default_factory=list)  # training .py files; empty = the stdlib minus HELDOUT
    heldout_files: list[str] = field(default_factory=list)
    tokenizer_chars: int = 6_000_000  # characters of training text the BPE is fitted on
    device: str = "cpu"  # where the model trains: cpu, cuda or cuda:N (under torchrun on CUDA: each rank's LOCAL_RANK GPU)

    def model_config(self) -> HybridConfig:
        types = tuple("full_attention" if (i + 1) % self.full_attention_every == 0 else "linear_attention" for i in range(self.num_layers))
        return HybridConfig(
            vocab_size=self.vocab_size, hidden_size=self.hidden_size, num_layers=self.num_layers, layer_types=types,
            num_heads=self.num_heads, num_kv_heads=self.num_kv_heads, head_dim=self.head_dim,
            intermediate_size=self.intermediate_size, max_seq_len=self.max_seq_len, tie_embeddings=True,
            linear_key_head_dim=self.linear_head_dim, linear_value_head_dim=self.linear_head_dim,
            linear_num_key_heads=self.linear_key_heads, linear_num_value_heads=self.linear_value_heads,
            mtp_num_layers=self.mtp_num_layers,
        )


def hybrid_hidden(model: HybridLM, tokens: Tensor) -> Tensor:
    """tokens (B, T) -> post-final-norm hidden (B, T, H), with autograd: the model's forward over B windows from 0."""
    b, t = tokens.shape
    _, hid, _, _, _ = hybrid_forward(model, tokens, ForwardBatch.window(b, t), None, None, None, None)
    return hid.view(b, t, -1)


def mtp_hiddens(mtp, embed, hidden: Tensor, tokens: Tensor, depth: int) -> list[Tensor]:
    """Chained MTP depths over a window, hidden (B, T, H) post-final-norm, tokens (B, T): depth k's output (B, T-k, H)
    at position i predicts t_{i+k+1} (fed h^{k-1}_i and e(t_{i+k}))."""
    outs, h = [], hidden
    emb = embed(tokens)  # (B, T, H)
    for k in range(1, depth + 1):
        e = emb[:, k:]  # (B, T-k, H) e(t_{i+k})
        h = h[:, : e.shape[1]]
        h = module_forward(mtp, h, e, None, None, ForwardBatch.window(*e.shape[:2]), (k - 1) % len(mtp.layers))
        outs.append(h)
    return outs


def losses(model: HybridLM, tokens: Tensor, depth: int) -> tuple[Tensor, list[Tensor]]:
    """tokens (B, T) -> (next-token CE, [MTP CE at depth k = 1..depth])."""
    h = hybrid_hidden(model, tokens)
    v = model.config.vocab_size
    main = F.cross_entropy(model.head(h[:, :-1]).reshape(-1, v), tokens[:, 1:].reshape(-1))
    mtp = []
    for k, hk in enumerate(mtp_hiddens(model.mtp, model.embed, h, tokens, depth), 1):
        logits = model.head(hk[:, :-1])  # (B, T-k-1, V) predicts t_{i+k+1}
        mtp.append(F.cross_entropy(logits.reshape(-1, v), tokens[:, k + 1 :].reshape(-1)))
    return main, mtp


def lr_at(cfg, progress: float, step: int) -> float:
    """Linear warmup over cfg.warmup_steps, then cosine from cfg.lr to cfg.lr * cfg.min_lr_ratio over progress [0, 1]."""
    if step < cfg.warmup_steps:
        return cfg.lr * (step + 1) / cfg.warmup_steps
    cos = 0.5 * (1 + math.cos(math.pi * min(progress, 1.0)))
    return cfg.lr * (cfg.min_lr_ratio + (1 - cfg.min_lr_ratio) * cos)


def schedule(cfg: PretrainConfig, progress: float, step: int) -> tuple[float, float]:
    """(learning rate, MTP lambda) at training progress in [0, 1]."""
    return lr_at(cfg, progress, step), cfg.mtp_lambda if progress < cfg.lambda_switch else cfg.mtp_lambda_final


@torch.no_grad()
def evaluate(model: HybridLM, windows: Tensor, depth: int, batch: int = 8) -> dict:
    model.eval()
    main, mtp, n = 0.0, [0.0] * depth, 0
    dev = device_of(model)
    for i in range(0, windows.shape[0], batch):
        with on(dev):
            m, ks = losses(model, windows[i : i + batch].to(dev), depth)
        b = windows[i : i + batch].shape[0]
        main += m.item() * b
        mtp = [a + k.item() * b for a, k in zip(mtp, ks)]
        n += b
    model.train()
    return {"next_token": main / n, **{f"mtp_{k + 1}": v / n for k, v in enumerate(mtp)}}


def prepare_data(cfg: PretrainConfig, out: Path):
    """Tokenizer (trained once, then reused) and the encoded train / held-out streams (cached in out/data.pt)."""
    from ..loading.tokenizer_hf import HFTokenizer

    if cfg.data_files:
        train_files, held_files = [Path(p) for p in cfg.data_files], [Path(p) for p in cfg.heldout_files]
    else:
        train_files, held_files = D.stdlib_files()
    tok_path, data_path = out / "tokenizer.json", out / "data.pt"
    if tok_path.exists():
        tok = HFTokenizer.load(tok_path, stop_ids=(0,))
    else:
        texts = D.read_texts(train_files)
        sample, n = [], 0
        for t in texts:
            if n >= cfg.tokenizer_chars:
                break
            sample.append(t)
            n += len(t)
        tok = D.train_tokenizer(sample, cfg.vocab_size)
        tok.save(tok_path)
    if data_path.exists():
        streams = torch.load(data_path)
    else:
        streams = {"train": D.encode_stream(tok, D.read_texts(train_files)), "heldout": D.encode_stream(tok, D.read_texts(held_files))}
        torch.save(streams, data_path)
    return tok, streams["train"], streams["heldout"], held_files


def adamw(model: torch.nn.Module, lr: float, weight_decay: float) -> torch.optim.AdamW:
    """AdamW (0.9, 0.95) with weight decay on matrices only (not norms, not biases)."""
    decay = [p for p in model.parameters() if p.ndim >= 2]
    no_decay = [p for p in model.parameters() if p.ndim < 2]
    return torch.optim.AdamW([{"params": decay, "weight_decay": weight_decay}, {"params": no_decay, "weight_decay": 0.0}],
                             lr=lr, betas=(0.9, 0.95))


def resume(state_path: Path, model: torch.nn.Module, opt, gen: torch.Generator) -> tuple[int, float, list]:
    """(step, elapsed seconds, history) from a train_state.pt (model, optimizer and data RNG restored), or a fresh start."""
    if not state_path.exists():
        return 0, 0.0, []
    st = torch.load(state_path, weights_only=False, map_location="cpu")  # (a CUDA run's state resumes anywhere)
    model.load_state_dict(st["model"])
    opt.load_state_dict(st["optimizer"])
    gen.set_state(st["generator"])
    return st["step"], st["elapsed"], st["history"]


def save_state(state_path: Path, model: torch.nn.Module, opt, gen: torch.Generator, step: int, elapsed: float, history: list) -> None:
    """What resume() reads back."""
    torch.save({"model": model.state_dict(), "optimizer": opt.state_dict(), "generator": gen.get_state(),
                "step": step, "elapsed": elapsed, "history": history}, state_path)


def optimizer_step(opt, params, loss: Tensor, lr: float) -> None:
    """One update at learning rate lr, the gradients of `params` (those trained) clipped to norm 1."""
    for g in opt.param_groups:
        g["lr"] = lr
    opt.zero_grad(set_to_none=True)
    loss.backward()
    torch.nn.utils.clip_grad_norm_(params, 1.0)
    opt.step()


def pretrain(cfg: PretrainConfig, progress_bar: bool = True) -> dict:
    """Train (or resume, under any number of processes) and write the checkpoint + report; returns the report. Under
    torchrun: DDP over cfg.batch_size split among the ranks (distributed.py); rank 0 evaluates, writes and returns
    the report, the others return {}."""
    with launch(resolve(cfg.device).type) as world:
        return _pretrain(cfg, progress_bar, world)


def _pretrain(cfg: PretrainConfig, progress_bar: bool, world: World) -> dict:
    from tqdm import tqdm

    from ..loading.native import save_checkpoint
    from ..models.draft_vocab import write_draft_vocab

    if not 1 <= cfg.mtp_num_layers <= cfg.mtp_depth:
        raise ConfigError(f"--mtp-num-layers must be from 1 to --mtp-depth ({cfg.mtp_depth}): depth k trains MTP layer "
                          f"(k-1) % n, so with {cfg.mtp_num_layers} layers some would never be trained")
    world.check_batch(cfg.batch_size)
    dev = train_device(cfg.device, world)
    progress_bar = progress_bar and world.main
    torch.set_num_threads(cfg.threads)
    torch.manual_seed(cfg.seed)
    out = Path(cfg.out)
    with world.main_first():  # rank 0 trains the tokenizer and encodes the data; the others read them
        out.mkdir(parents=True, exist_ok=True)
        tok, train, held, held_files = prepare_data(cfg, out)
    if tok.vocab_size != cfg.vocab_size:
        cfg.vocab_size = tok.vocab_size
    model = HybridLM(cfg.model_config())
    _init(model)  # on the CPU: the same initial weights on every device
    model.to(dev)
    opt, gen = adamw(model, cfg.lr, cfg.weight_decay), torch.Generator().manual_seed(cfg.seed)
    state_path = out / "train_state.pt"
    step, elapsed, history = resume(state_path, model, opt, gen)
    evalw = D.eval_windows(held, cfg.seq_len, cfg.eval_windows)
    if world.main:
        write_draft_vocab(out, train, cfg.vocab_size, "token counts of the training split")  # the counts never change
        (out / "train_config.json").write_text(json.dumps(asdict(cfg), indent=2) + "\n")
    loss_fn = world.wrap(model, lambda batch: losses(model, batch, cfg.mtp_depth))

    def progress() -> float:
        p = step / cfg.steps
        return max(p, elapsed / (cfg.max_minutes * 60)) if cfg.max_minutes > 0 else p

    def save() -> None:
        if world.main:  # global state only: resumable under any number of processes
            save_state(state_path, model, opt, gen, step, elapsed, history)
            save_checkpoint(model, tok, out)
        world.barrier()

    bar = tqdm(total=cfg.steps, initial=step, disable=not progress_bar, dynamic_ncols=True)
    model.train()
    t_last = time.perf_counter()
    while progress() < 1.0:
        lr, lam = schedule(cfg, progress(), step)
        batch = D.random_windows(train, cfg.batch_size, cfg.seq_len, gen)  # the global batch: every rank draws it alike
        with on(dev):
            main, mtp = loss_fn(world.shard(batch).to(dev))
            optimizer_step(opt, model.parameters(), main + lam * torch.stack(mtp).mean(), lr)
        logged = world.mean({"main": main.item(), "mtp": mtp[0].item()})
        now = time.perf_counter()
        dt, t_last = now - t_last, now
        elapsed += dt
        if cfg.max_minutes > 0:
            elapsed = world.agree(elapsed)  # the schedule reads the clock: rank 0's, so every rank steps alike and stops together
        step += 1
        bar.update(1)
        bar.set_postfix(loss=f"{logged['main']:.3f}", mtp=f"{logged['mtp']:.3f}", lam=lam, tok_s=f"{batch.numel() / dt:.0f}")
        if world.main and (step % cfg.eval_every == 0 or progress() >= 1.0):
            ev = evaluate(model, evalw, cfg.mtp_depth)
            history.append({"step": step, "elapsed_s": round(elapsed, 1), "tokens": step * cfg.batch_size * cfg.seq_len,
                            "train_next_token": round(logged["main"], 4), **{k: round(v, 4) for k, v in ev.items()}})
            bar.write(f"step {step}: held-out " + ", ".join(f"{k} {v:.3f}" for k, v in ev.items()))
        if step % cfg.save_every == 0:
            save()
    bar.close()
    save()
    if not world.main:
        return {}
    report = final_report(model, tok, cfg, held, held_files, step, elapsed, history)
    (out / "report.json").write_text(json.dumps(report, indent=2) + "\n")
    return report


@torch.no_grad()
def _init(model: HybridLM) -> None:
    """GPT-2 style init: N(0, 0.02) for matrices, output projections scaled by 1/sqrt(2 * layers)."""
    n = len(model.config.layer_types) + 1
    for name, p in model.named_parameters():
        if p.ndim >= 2 and "conv1d" not in name:
            std = 0.02 / math.sqrt(2 * n) if name.endswith(("o_proj.weight", "out_proj.weight", "down_proj.weight")) else 0.02
            p.normal_(0.0, std)


def final_report(model, tok, cfg: PretrainConfig, held: Tensor, held_files: list[Path], step: int, elapsed: float,
                 history: list, n_prompts: int = 8, new_tokens: int = 128) -> dict:
    """Held-out loss per objective, and greedy MTP acceptance by position (D = 4) on held-out code prompts."""
    from ..drafters.mtp import MTPDrafter
    from ..engine import generate_tokens
    from ..metrics import Acceptance
    from ..sampling import Sampler, SamplingParams

    model.eval()
    ev = evaluate(model, D.eval_windows(held, cfg.seq_len, cfg.eval_windows), cfg.mtp_depth)
    prompts = D.code_prompts(held_files, n_prompts) if held_files else []
    acc = Acceptance()
    for p in prompts:
        ids = tok.encode(p)[-256:]
        with on(device_of(model)):  # (the drafter's folded copy is made beside the model)
            drafter = MTPDrafter(model)
        acc += Acceptance.from_steps(generate_tokens(model, ids, drafter, 4, Sampler(SamplingParams()), new_tokens).steps)
    params = sum(p.numel() for p in model.parameters())
    return {
        "steps": step, "train_seconds": round(elapsed, 1), "tokens_seen": step * cfg.batch_size * cfg.seq_len,
        "parameters": params, "heldout_loss": ev,
        "mtp_acceptance_by_position_greedy_D4": [None if a is None else round(a, 3) for a in acc.by_position(4)],
        "history": history,
    }

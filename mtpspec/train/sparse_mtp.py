"""`mtpspec train mtp --sparse`: give the MTP module block-sparse attention and train it, the model frozen.

The MTP layer's attention becomes block-sparse (models/sparse_attention.py): an indexer scores blocks of
`sparse_block` tokens and each query attends to the `sparse_top_k` best plus the last `sparse_window` positions.
The checkpoint's config gains `mtp_sparse_attention` and tensors `mtp.layers.N.self_attn.indexer.*`.

0. Data: `sparse_windows` random windows of `window_tokens` tokens of the training text (stdlib training modules,
   or a text file's first 90%) and the frozen model's post-norm hiddens over them, computed once (or `data_cache`);
   evaluation windows from the held-out text.
1. Indexer warm-up (`indexer_steps`, the indexer alone): its block scores, softmaxed over each row's candidate
   blocks, fitted by KL to the full attention's renormalised mass per block (heads averaged, row chunks). Recall
   (the full attention's mass inside the chosen blocks + window) is measured on held-out windows before and after,
   with the oracle's top_k blocks as the ceiling.
2. Tuning (`steps`): mtp.* but the indexer, by mtp_distill's self-distillation with the sparse attention on. The
   block selection is not differentiable, so the indexer keeps what phase 1 fitted.

A phase with 0 steps is skipped. Layer j's indexer is fitted at depth j + 1, its input chained through layers 0..j-1.
"""

from __future__ import annotations

import dataclasses
import math
import random
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import torch
from torch import Tensor

from ..errors import ConfigError, ModelLoadError
from ..models.attention import rope, rotary_at
from ..models.batch import ForwardBatch
from ..models.forward import module_forward
from ..models.qwen35 import GatedAttention, HybridLM
from ..models.sparse_attention import (
    SparseAttentionConfig, attention_mask, block_attention_mass, block_scores, candidates, select_blocks,
)
from . import data as D
from .mtp_distill import mtp_distill_loss
from .pretrain import hybrid_hidden, optimizer_step

ROW_CHUNK = 512  # rows of full-attention probabilities computed at once: (heads, 512, T) floats


def sparse_config(cfg) -> SparseAttentionConfig:
    """The MTPTuneConfig's --sparse-* fields as a checked SparseAttentionConfig."""
    try:
        return SparseAttentionConfig(block=cfg.sparse_block, top_k=cfg.sparse_top_k, window=cfg.sparse_window,
                                     heads=cfg.sparse_heads, dim=cfg.sparse_dim)
    except ConfigError as e:
        raise ConfigError(f"--sparse: {e} (from --sparse-block {cfg.sparse_block} --sparse-top-k {cfg.sparse_top_k} "
                          f"--sparse-window {cfg.sparse_window} --sparse-heads {cfg.sparse_heads} --sparse-dim {cfg.sparse_dim})") from None


def check_sparse(cfg, scfg: SparseAttentionConfig) -> None:
    """The sparse phases' own fields (the model-dependent checks are in tune_sparse_mtp)."""
    if cfg.window_tokens < scfg.window + scfg.block + 1:
        raise ConfigError(f"--window-tokens {cfg.window_tokens} is too short for --sparse-window {scfg.window} and --sparse-block "
                          f"{scfg.block}: no query would have a candidate block (use several thousand tokens)")
    if cfg.sparse_windows < 1 or cfg.heldout_windows < 1 or cfg.window_batch < 1 or cfg.long_prompts < 0:
        raise ConfigError("--sparse-windows, --heldout-windows and --window-batch must be >= 1, --long-prompts >= 0")
    if cfg.indexer_steps < 0 or not cfg.indexer_lr > 0:
        raise ConfigError(f"--indexer-steps must be >= 0 and --indexer-lr > 0, got {cfg.indexer_steps}, {cfg.indexer_lr}")


def with_sparse_mtp(model: HybridLM, scfg: SparseAttentionConfig, seed: int = 0) -> HybridLM:
    """The same weights in a model whose MTP layers have block-sparse attention `scfg`; an indexer of scfg's (heads,
    dim) is kept (block, top_k and window do not change its shape), else a new one is made (seeded)."""
    if not isinstance(model, HybridLM):
        raise ConfigError(f"--sparse makes a Qwen3.5-style hybrid model's MTP attention sparse; this model is a {type(model).__name__}")
    src = model.config.mtp_sparse_attention
    keep = src is not None and (src.heads, src.dim) == (scfg.heads, scfg.dim)
    state = {k: v for k, v in model.state_dict().items() if keep or not (k.startswith("mtp.") and ".indexer." in k)}
    torch.manual_seed(seed)
    net = HybridLM(dataclasses.replace(model.config, mtp_sparse_attention=scfg)).to(model.dtype)
    res = net.load_state_dict(state, strict=False)
    wrong = [k for k in res.missing_keys if not (k.startswith("mtp.") and ".indexer." in k)] + res.unexpected_keys
    if wrong:
        raise ModelLoadError(f"sparse MTP: the source's weights do not fit the sparse model: {', '.join(wrong)}")
    net.token_ranking = getattr(model, "token_ranking", None)
    return net.eval()


# ---- data --------------------------------------------------------------------------------------------------


@dataclass
class Windows:
    """Training-text windows and the frozen model's post-norm hiddens over them."""

    tokens: Tensor  # (N, T) int64
    hidden: Tensor  # (N, T, H)


def text_streams(cfg, tok) -> tuple[Tensor, Tensor]:
    """(training stream, held-out stream) of token ids, each file preceded by EOT (data.py's encoding)."""
    if not hasattr(tok, "tokenizer"):
        raise ConfigError("--sparse encodes its training text with a Hugging Face tokenizer (tokenizer.json); this model has another")
    if cfg.sparse_text == "stdlib":
        train_files, held_files = D.stdlib_files()
        return D.encode_stream(tok, D.read_texts(train_files)), D.encode_stream(tok, D.read_texts(held_files))
    try:
        text = Path(cfg.sparse_text).read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as e:
        raise ConfigError(f"--sparse-text {cfg.sparse_text}: cannot read it ({e.__class__.__name__}: {e})") from None
    ids = D.encode_stream(tok, [text])
    cut = int(0.9 * ids.shape[0])
    return ids[:cut], ids[cut:]


@torch.no_grad()
def frozen_hiddens(model: HybridLM, tokens: Tensor, progress_bar: bool = False) -> Windows:
    """tokens (N, T) -> Windows with the model's hiddens, one window per forward."""
    from tqdm import tqdm

    rows = tqdm(tokens, desc="frozen model over the windows", disable=not progress_bar)
    return Windows(tokens, torch.stack([hybrid_hidden(model, t[None])[0] for t in rows]))


def window_data(model: HybridLM, tok, cfg, progress_bar: bool) -> tuple[Windows, Windows, Tensor, float]:
    """(training windows, held-out windows, held-out stream, seconds of the frozen passes); read from / written to
    cfg.data_cache when it names a file made with the same settings."""
    key = {"text": cfg.sparse_text, "window_tokens": cfg.window_tokens, "windows": cfg.sparse_windows,
           "heldout": cfg.heldout_windows, "seed": cfg.seed,
           # which frozen model: its weights' sum outside the MTP module (the hiddens do not depend on it)
           "weights": float(sum(p.double().sum() for n, p in model.named_parameters() if not n.startswith("mtp.")))}
    if cfg.data_cache and Path(cfg.data_cache).exists():
        c = torch.load(cfg.data_cache)
        if c.get("key") == key:
            return Windows(*c["train"]), Windows(*c["held"]), c["stream"], c["seconds"]
    train, held = text_streams(cfg, tok)
    t = cfg.window_tokens
    if train.shape[0] <= t or held.shape[0] < t:
        raise ConfigError(f"--window-tokens {t}: the text has {train.shape[0]} training and {held.shape[0]} held-out tokens, "
                          "too few for one window of each")
    gen = torch.Generator().manual_seed(cfg.seed)
    toks = D.random_windows(train, cfg.sparse_windows, t, gen)  # (N, T)
    t0 = time.perf_counter()
    tw = frozen_hiddens(model, toks, progress_bar)
    hw = frozen_hiddens(model, D.eval_windows(held, t, cfg.heldout_windows))
    seconds = time.perf_counter() - t0
    if cfg.data_cache:
        torch.save({"key": key, "train": (tw.tokens, tw.hidden), "held": (hw.tokens, hw.hidden), "stream": held,
                    "seconds": seconds}, cfg.data_cache)
    return tw, hw, held, seconds


# ---- the MTP layer's attention, dense, as the teacher ----------------------------------------------------------


def mtp_layer_input(model: HybridLM, tokens: Tensor, hidden: Tensor, layer: int) -> Tensor:
    """tokens (T,), hidden (T, H) -> the normed input of MTP layer `layer`'s attention at depth layer + 1 (T - layer - 1, H),
    chained as pretrain.py mtp_hiddens."""
    mtp = model.mtp
    emb, h = model.embed(tokens[None]), hidden[None]  # (1, T, H)
    for k in range(1, layer + 2):
        e = emb[:, k:]  # (1, T-k, H)
        h = h[:, : e.shape[1]]
        x = mtp.fc(torch.cat([mtp.pre_fc_norm_embedding(e), mtp.pre_fc_norm_hidden(h)], dim=-1))
        if k == layer + 1:
            return mtp.layers[layer].input_layernorm(x)[0]
        h = module_forward(mtp, h, e, None, None, ForwardBatch.window(*e.shape[:2]), k - 1)
    raise AssertionError("unreachable")


def dense_qk(attn: GatedAttention, x: Tensor) -> tuple[Tensor, Tensor]:
    """x (T, H) the normed input -> the attention's rotated queries (nh, T, hd) and keys expanded to nh heads (nh, T, hd)."""
    t = x.shape[0]
    q = attn.q_proj(x).view(t, attn.nh, 2 * attn.hd).chunk(2, dim=-1)[0]  # (T, nh, hd): [q | gate] per head
    k = attn.k_proj(x).view(t, attn.nkv, attn.hd)
    rot = attn.rotary[0]
    cos, sin = rotary_at(rot, ForwardBatch.window(1, t), x.dtype)  # (1, 1, T, rot) at positions 0..T-1
    q = rope(attn.q_norm(q).transpose(0, 1)[None], cos, sin, rot.rot_dim)[0]  # (nh, T, hd)
    k = rope(attn.k_norm(k).transpose(0, 1)[None], cos, sin, rot.rot_dim)[0]  # (nkv, T, hd)
    return q, k.repeat_interleave(attn.nh // attn.nkv, dim=0)


def dense_probs(q: Tensor, k: Tensor, a: int, b: int) -> Tensor:
    """Rows a..b-1 of causal softmax(q k^T / sqrt(hd)), averaged over heads: q, k (nh, T, hd) -> (b - a, T)."""
    s = q[:, a:b] @ k.transpose(1, 2) / math.sqrt(q.shape[-1])  # (nh, c, T)
    pos = torch.arange(a, b)
    s = s.masked_fill(torch.arange(k.shape[1])[None, :] > pos[:, None], float("-inf"))
    return torch.softmax(s, dim=-1).mean(0)  # (c, T)


@torch.no_grad()
def block_targets(attn: GatedAttention, x: Tensor, cfg: SparseAttentionConfig) -> Tensor:
    """x (T, H) -> (T, nb) the full attention's mass per candidate block, renormalised (0 on rows without candidates)."""
    q, k = dense_qk(attn, x)
    t = x.shape[0]
    nb = t // cfg.block
    return torch.cat([block_attention_mass(dense_probs(q, k, a, min(a + ROW_CHUNK, t)), torch.arange(a, min(a + ROW_CHUNK, t)), nb, cfg)
                      for a in range(0, t, ROW_CHUNK)])


def indexer_scores(attn: GatedAttention, x: Tensor, nb: int, rows: Tensor | None = None) -> Tensor:
    """x (T, H) -> the indexer's block scores (T, nb) (or of `rows`: (R, nb)), as inference computes them."""
    ix = attn.indexer
    r = attn.sparse.block
    bk = ix.keys(x[: nb * r]).unflatten(0, (nb, r)).mean(1)  # (nb, dim)
    iq, iw = ix.queries(x if rows is None else x[rows])  # (R, heads, dim), (R, heads)
    return block_scores(iq, iw, bk)


@dataclass
class IndexerEval:
    """The indexer on held-out windows, mean over rows: KL to the full attention's block mass, and recall."""

    kl: float
    recall: float  # over the rows with at least one candidate block
    recall_selective: float | None  # over the rows with more than top_k candidates (where the choice matters)
    oracle_recall_selective: float | None  # the top_k blocks by true mass, on the same rows (the ceiling)
    rows: int
    selective_rows: int


@torch.no_grad()
def evaluate_indexer(model: HybridLM, windows: Windows, cfg: SparseAttentionConfig, layer: int = 0) -> IndexerEval:
    attn = model.mtp.layers[layer].self_attn
    kl_sum, n_kl, rec, sel, ora, n_rows, n_sel = 0.0, 0, 0.0, 0.0, 0.0, 0, 0
    for toks, hid in zip(windows.tokens, windows.hidden):
        x = mtp_layer_input(model, toks, hid, layer)  # (T, H)
        t = x.shape[0]
        nb = t // cfg.block
        q, k = dense_qk(attn, x)
        scores = indexer_scores(attn, x, nb)  # (T, nb)
        for a in range(0, t, ROW_CHUNK):
            b = min(a + ROW_CHUNK, t)
            pos = torch.arange(a, b)
            probs = dense_probs(q, k, a, b)[:, :b]  # (c, b)
            target = block_attention_mass(probs, pos, nb, cfg)  # (c, nb)
            has = pos >= cfg.window  # rows with a candidate block
            many = (pos - cfg.window) // cfg.block + 1 > cfg.top_k  # rows choosing among more than top_k
            if not has.any():
                continue
            kl = indexer_kl(scores[a:b], target, pos, cfg)
            kl_sum, n_kl = kl_sum + kl.sum().item(), n_kl + kl.shape[0]
            got = _recall(scores[a:b], probs, pos, cfg)
            rec, n_rows = rec + got[has].sum().item(), n_rows + int(has.sum())
            if many.any():
                best = _recall(target, probs, pos, cfg)
                sel, ora, n_sel = sel + got[many].sum().item(), ora + best[many].sum().item(), n_sel + int(many.sum())
    return IndexerEval(kl=round(kl_sum / max(n_kl, 1), 5), recall=round(rec / max(n_rows, 1), 4),
                       recall_selective=round(sel / n_sel, 4) if n_sel else None,
                       oracle_recall_selective=round(ora / n_sel, 4) if n_sel else None, rows=n_rows, selective_rows=n_sel)


def indexer_kl(scores: Tensor, target: Tensor, pos: Tensor, cfg: SparseAttentionConfig) -> Tensor:
    """KL(target || softmax of the scores over each row's candidate blocks) per row, for the rows at pos that have
    candidates: scores, target (c, nb) -> (rows,)."""
    cand = candidates(pos, scores.shape[1], cfg)  # (c, nb)
    rows = cand.any(1)
    cand, s, p = cand[rows], scores[rows], target[rows]
    logq = torch.log_softmax(s.masked_fill(~cand, float("-inf")), dim=-1).masked_fill(~cand, 0.0)
    logp = torch.where(p > 0, p, torch.ones_like(p)).log()  # 0 log 0 = 0
    return (p * (logp - logq)).sum(-1)


def _recall(scores: Tensor, probs: Tensor, pos: Tensor, cfg: SparseAttentionConfig) -> Tensor:
    """scores (c, nb), probs (c, s) rows at pos -> (c,) the probability mass inside the top_k blocks + window."""
    blocks, ok = select_blocks(scores, pos, cfg)
    mask = attention_mask(blocks, ok, pos, pos - cfg.window + 1, probs.shape[1], cfg)  # (c, s)
    return (probs * mask).sum(-1)


# ---- the two phases ----------------------------------------------------------------------------------------


def lr_at(base: float, step: int, steps: int) -> float:
    """Linear warmup over 20 steps, cosine to a tenth (native_mtp's schedule)."""
    return base * min(1.0, (step + 1) / 20) * (0.1 + 0.45 * (1 + math.cos(math.pi * step / max(steps, 1))))


@dataclass
class Phase:
    """Wall time and throughput of one phase."""

    steps: int
    seconds: float
    tokens: int  # window tokens processed

    def to_dict(self) -> dict:
        return {**asdict(self), "seconds": round(self.seconds, 1),
                "tokens_per_second": round(self.tokens / self.seconds, 1) if self.seconds > 0 else None}


def train_indexer(model: HybridLM, windows: Windows, cfg: SparseAttentionConfig, steps: int, lr: float, seed: int = 0,
                  progress_bar: bool = False, rows: int = 0) -> tuple[list[dict], Phase]:
    """Phase 1: fit every MTP layer's indexer to its full attention's block mass (KL), one window per step (`rows` > 0:
    that many random rows with candidates); each window's targets computed once and kept."""
    from tqdm import tqdm

    layers = range(len(model.mtp.layers))
    params = [p for j in layers for p in model.mtp.layers[j].self_attn.indexer.parameters()]
    for p in params:
        p.requires_grad_(True)
    opt = torch.optim.AdamW(params, lr=lr, weight_decay=0.0)
    rng, history, cached = random.Random(seed), [], {}
    gen = torch.Generator().manual_seed(seed)
    t0 = time.perf_counter()
    for step in (bar := tqdm(range(steps), desc="indexer warm-up (KL)", disable=not progress_bar)):
        i = rng.randrange(windows.tokens.shape[0])
        loss = 0.0
        for j in layers:
            if (i, j) not in cached:
                with torch.no_grad():
                    x = mtp_layer_input(model, windows.tokens[i], windows.hidden[i], j)  # (T, H)
                cached[i, j] = (x, block_targets(model.mtp.layers[j].self_attn, x, cfg))
            x, target = cached[i, j]
            pos = torch.arange(cfg.window, x.shape[0])  # the rows with candidates
            if 0 < rows < pos.shape[0]:
                pos = pos[torch.randperm(pos.shape[0], generator=gen)[:rows]]
            scores = indexer_scores(model.mtp.layers[j].self_attn, x, target.shape[1], pos)  # (R, nb)
            loss = loss + indexer_kl(scores, target[pos], pos, cfg).mean()
        optimizer_step(opt, params, loss, lr_at(lr, step, steps))
        bar.set_postfix(kl=f"{loss.item():.4f}")
        history.append({"step": step, "kl": round(loss.item(), 5)})
    for p in params:
        p.requires_grad_(False)
    return history, Phase(steps, time.perf_counter() - t0, steps * windows.tokens.shape[1])


def tune_mtp_sparse(model: HybridLM, windows: Windows, steps: int, batch: int, lr: float, depth: int, decay: float,
                    seed: int = 0, progress_bar: bool = False) -> tuple[list[dict], Phase]:
    """Phase 2: mtp.* except the indexer, self-distillation on `batch` long windows per step, sparse attention on."""
    from tqdm import tqdm

    params = [p for n, p in model.mtp.named_parameters() if ".indexer." not in n]
    for p in params:
        p.requires_grad_(True)
    opt = torch.optim.AdamW(params, lr=lr, weight_decay=0.0)
    rng, history = random.Random(seed), []
    n = windows.tokens.shape[0]
    t0 = time.perf_counter()
    for step in (bar := tqdm(range(steps), desc="tune the sparse MTP module", disable=not progress_bar)):
        idx = [rng.randrange(n) for _ in range(batch)]
        loss, parts = mtp_distill_loss(model, windows.tokens[idx], windows.hidden[idx], depth, decay)
        optimizer_step(opt, params, loss, lr_at(lr, step, steps))
        bar.set_postfix(loss=f"{loss.item():.3f}")
        history.append({"step": step, "loss": round(loss.item(), 4), **parts})
    for p in params:
        p.requires_grad_(False)
    return history, Phase(steps, time.perf_counter() - t0, steps * batch * windows.tokens.shape[1])


@torch.no_grad()
def distill_loss(model: HybridLM, windows: Windows, depth: int, decay: float) -> dict:
    """The self-distillation loss's parts on (held-out) windows, one window at a time."""
    parts = [mtp_distill_loss(model, t[None], h[None], depth, decay)[1] for t, h in zip(windows.tokens, windows.hidden)]
    return {k: round(sum(p[k] for p in parts) / len(parts), 4) for k in parts[0]}


def long_prompts(tok, held: Tensor, n: int, length: int) -> list[str]:
    """n held-out texts of about `length` tokens (decoded windows of the held-out stream) for acceptance at long context."""
    if n == 0:
        return []
    return [tok.decode(w.tolist()) for w in D.eval_windows(held, length, n)]


def tune_sparse_mtp(module: HybridLM, tok, cfg, progress_bar: bool = True) -> tuple[HybridLM, dict]:
    """The whole --sparse run on a loaded, frozen model with an MTP module -> (the sparse model, the report's fields)."""
    from .heads import measure, training_prompts

    scfg = sparse_config(cfg)
    check_sparse(cfg, scfg)
    if cfg.window_tokens > module.config.max_seq_len:
        raise ConfigError(f"--window-tokens {cfg.window_tokens} is longer than the model's context {module.config.max_seq_len}")
    k_eval = cfg.eval_k or cfg.depth
    held_p = training_prompts(cfg, tok)[1][: cfg.heldout_prompts]
    train_w, held_w, held_stream, frozen_s = window_data(module, tok, cfg, progress_bar)
    frozen = Phase(0, frozen_s, (train_w.tokens.shape[0] + held_w.tokens.shape[0]) * cfg.window_tokens)
    prompt_len = max(1, min(cfg.window_tokens, module.config.max_seq_len - cfg.eval_tokens - 64))
    long_p = long_prompts(tok, held_stream, cfg.long_prompts, prompt_len)

    t0 = time.perf_counter()
    full = {"short": measure(module, tok, None, held_p, k_eval, cfg.eval_tokens, drafter="mtp"),
            "long": measure(module, tok, None, long_p, k_eval, cfg.eval_tokens, drafter="mtp") if long_p else None,
            "distill_loss": distill_loss(module, held_w, cfg.depth, cfg.depth_decay)}
    net = with_sparse_mtp(module, scfg, cfg.seed)
    del module
    for p in net.parameters():
        p.requires_grad_(False)
    recall_before = [evaluate_indexer(net, held_w, scfg, j) for j in range(len(net.mtp.layers))]
    measure_s = time.perf_counter() - t0

    idx_hist, idx_phase = train_indexer(net, train_w, scfg, cfg.indexer_steps, cfg.indexer_lr, cfg.seed, progress_bar,
                                        cfg.indexer_rows)
    t0 = time.perf_counter()
    recall_after = [evaluate_indexer(net, held_w, scfg, j) for j in range(len(net.mtp.layers))] if cfg.indexer_steps else recall_before
    indexer_only = {"long": measure(net, tok, None, long_p, k_eval, cfg.eval_tokens, drafter="mtp") if long_p else None,
                    "distill_loss": distill_loss(net, held_w, cfg.depth, cfg.depth_decay)}
    measure_s += time.perf_counter() - t0

    tune_hist, tune_phase = tune_mtp_sparse(net, train_w, cfg.steps, cfg.window_batch, cfg.lr, cfg.depth, cfg.depth_decay,
                                            cfg.seed, progress_bar)
    t0 = time.perf_counter()
    tuned = {"short": measure(net, tok, None, held_p, k_eval, cfg.eval_tokens, drafter="mtp"),
             "long": measure(net, tok, None, long_p, k_eval, cfg.eval_tokens, drafter="mtp") if long_p else None,
             "distill_loss": distill_loss(net, held_w, cfg.depth, cfg.depth_decay) if cfg.steps else indexer_only["distill_loss"],
             "recall": [evaluate_indexer(net, held_w, scfg, j) for j in range(len(net.mtp.layers))] if cfg.steps else recall_after}
    measure_s += time.perf_counter() - t0
    n = len(net.mtp.layers)
    report = {
        "sparse_attention": scfg.to_dict(), "window_tokens": cfg.window_tokens,
        "train_windows": int(train_w.tokens.shape[0]), "heldout_windows": int(held_w.tokens.shape[0]),
        "trained": {"indexer": "mtp.layers.*.self_attn.indexer.* (phase 1)",
                    "tune": "mtp.* except the indexer (phase 2): the selection is not differentiable"},
        "phases": {"frozen_model_pass": frozen.to_dict(), "indexer": idx_phase.to_dict(), "tune": tune_phase.to_dict(),
                   "measurements_seconds": round(measure_s, 1)},
        "indexer": {"recall_before": [asdict(r) for r in recall_before], "recall_after": [asdict(r) for r in recall_after],
                    "recall_after_tune": [asdict(r) for r in tuned["recall"]],  # phase 2 moves the attention the indexer imitates
                    "kl_history": idx_hist[:: max(1, len(idx_hist) // 40)] + idx_hist[-1:]},
        "distill_loss_heldout_windows": {"full_attention": full["distill_loss"], "sparse_indexer_only": indexer_only["distill_loss"],
                                         "sparse_tuned": tuned["distill_loss"]},
        "heldout_greedy_before": full["short"], "heldout_greedy_after": tuned["short"],
        "long_context_greedy": {"prompt_tokens": prompt_len, "full_attention": full["long"],
                                "sparse_indexer_only": indexer_only["long"], "sparse_tuned": tuned["long"]},
        "history": tune_hist[:: max(1, len(tune_hist) // 40)] + tune_hist[-1:],
        "steps": cfg.steps, "train_seconds": round(tune_phase.seconds, 1),
        "mtp_layers": n, "mtp_layers_trained": sorted({k % n for k in range(cfg.depth)}),
    }
    return net, report

"""`mtpspec train head`: fit a draft head (MTP, Medusa, EAGLE, EAGLE-3) to a frozen target by self-distillation.

The target continues training prompts (never the held-out ones), half greedily, half sampled at `gen_temperature`;
one teacher pass gives its post-final-norm hiddens h (T, H), its distributions softmax(LM head(h)) recomputed on the
fly. The head is fitted to them (soft cross-entropy = KL up to a constant):
   - mtp: pairs (h_i, e(t_{i+1})) -> p_{i+1}; depth k chains on the head's own output hidden.
   - eagle: the same chain on predicted features, plus feature regression (smooth L1 to h_{i+k}).
   - medusa: block k on h_i -> p_{i+k} (the distribution of t_{i+k+1}).
   - eagle3: g_i = fc(the inputs of three target layers at i) (a second teacher pass records them, `layer_input_data`);
     EAGLE-3's training-time test (`eagle3_losses`): step k + 1 reads step k's own output and t_{i+k+1} and attends to
     the real pairs up to i and to its own chain's earlier steps, as a draft chain rooted at i does; its own LM head
     over the draft vocabulary (the teacher's distribution renormalised over it).
"""

from __future__ import annotations

import json
import math
import random
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import Tensor

from ..device import of as device_of, on, resolve
from ..errors import ConfigError
from ..models.batch import ForwardBatch
from ..models.draft_vocab import TokenRanking, ranking_from_counts
from ..models.forward import module_forward
from ..models.heads import DraftHead, DraftHeadConfig, load_head, save_head
from ..models.placement import place
from .distributed import World, launch, train_device


@dataclass
class HeadConfig:
    out: str  # output folder (head.json + head.safetensors + report.json)
    kind: str = "mtp"  # mtp | medusa | eagle | eagle3
    prompts: str = "tinystories"  # tinystories | stdlib | a text file (one prompt per line)
    heldout_prompts: int = 50  # the first n prompts are never trained on (the evaluation set)
    train_prompts: int = 400
    gen_tokens: int = 160  # continuation length sampled from the target per prompt
    gen_temperature: float = 1.0  # for the sampled continuations (round 0's even prompts are greedy)
    gen_rounds: int = 1  # continuations per prompt: round 0 half greedy, half sampled; later rounds all sampled
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
    # mtp: "own" = a Qwen3.5 gated-attention layer of the sizes above; "target" = one decoder layer of the target's own
    # kind (a dense target: Llama / Qwen3 / Gemma 3), initialised from its last layer, the output norm from its final norm
    layer: str = "own"
    draft_vocab: int = 0  # > 0: train (and draft) over the N tokens the target emits most in the data (FR-Spec); 0 = all
    gen_batch: int = 1  # continuations generated together (the batched engine)
    context_tokens: int = 0  # > 0: of each prompt only its last N tokens are kept in the data (before the continuation)
    text_tokens: int = 0  # > 0: teacher-forced windows over the stdlib's training modules, this many tokens in all
    checkpoint_every: int = 0  # > 0: a resumable checkpoint (out/train_state.pt) every N steps; a rerun continues from it
    save_dtype: str = "float32"  # the head's weights as written: float32 | bfloat16 (half the size; measured as written)
    device: str = "cpu"  # where the target runs and the head trains: cpu, cuda or cuda:N (the data is kept on the host)
    aux_layers: str = ""  # eagle3: the target layers whose inputs are its features, "low,mid,high"; "" = (2, L//2, L-3)
    # > 0: training stops after this many minutes (its own, resumed runs counted), the schedule's progress being
    # max(step / steps, minutes / max_minutes) as pretraining's
    max_minutes: float = 0.0
    # eagle3, > 0: only this many of the data's sequences (spread evenly over it) get the layer-input teacher pass (a
    # prefill each: on a real model the pass over a whole data cache can take longer than the training)
    feature_sequences: int = 0


REAL_SETS = ("humaneval", "mt_bench", "spec_bench")  # `--prompts realsets`: the shared benchmark sets


def real_prompts(heldout_per_category: int) -> tuple[list[str], list[str]]:
    """(train, held-out). The evaluation prompts are the first `heldout_per_category` of each category in each set's
    file order, the prompts `mtpspec bench --prompts SET --limit N` measures; train: every other prompt of the sets
    whose text is none of them, each text once; held-out: the code (HumanEval), chat (MT-bench) and summary
    (Spec-Bench) evaluation prompts, interleaved."""
    from ..prompts import load_prompts

    sets = {name: load_prompts(name) for name in REAL_SETS}
    firsts = {name: {} for name in REAL_SETS}  # set -> category -> its evaluation prompts
    for name, prompts in sets.items():
        for p in prompts:
            rows = firsts[name].setdefault(p.category, [])
            if len(rows) < heldout_per_category:
                rows.append(p.text)
    held = {t for cats in firsts.values() for rows in cats.values() for t in rows}
    train = list(dict.fromkeys(p.text for prompts in sets.values() for p in prompts if p.text not in held))
    groups = [firsts[name].get(cat, []) for name, cat in (("humaneval", "humaneval"), ("mt_bench", "mt_bench"),
                                                          ("spec_bench", "summarization"))]
    return train, [t for g in zip(*groups) for t in g]  # interleaved: code, chat, summary, code, ...


def training_prompts(cfg: HeadConfig, tokenizer) -> tuple[list[str], list[str]]:
    """(train, held-out) prompt texts; held-out = the first cfg.heldout_prompts of the set (realsets: of each category)."""
    if cfg.prompts == "realsets":
        train, held = real_prompts(cfg.heldout_prompts)
        return train[: cfg.train_prompts], held
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


def _teacher(target, toks: Tensor) -> tuple[Tensor, Tensor]:
    """One sequence's teacher pass: (tokens (T,), the target's post-norm hidden (T, H), in fp16 when the target is
    fp32: half the memory, within 2^-11 of each value)."""
    h = target.forward_tokens(toks, target.new_cache(toks.shape[0]), prefill=True, logits=False).hidden
    return toks, h.to(device="cpu", dtype=torch.float16 if target.dtype == torch.float32 else target.dtype).clone()


@torch.inference_mode()
def self_distill_data(target, tokenizer, prompts: list[str], cfg: HeadConfig, progress_bar: bool = True,
                      done: list | None = None, save=None, indices: list[int] | None = None) -> list[tuple[Tensor, Tensor]]:
    """[(tokens (T,), hidden (T, H))]: the target's own continuations (cfg.gen_batch at a time through the batched
    engine) and its teacher pass over prompt + continuation (`_teacher`). Continuation j is prompt j mod N's in round
    j // N (cfg.gen_rounds rounds): greedy in round 0 for even prompts, else sampled with seed cfg.seed + j.
    `done`: sequences of a run cut short, kept; `save(seqs)` is called after each batch (resumable data). indices:
    the continuations to generate (a rank's share), default all."""
    from tqdm import tqdm

    from ..drafters.base import NoDrafter
    from ..engine import Engine
    from ..sampling import Sampler, SamplingParams

    seqs = list(done or [])
    n = len(prompts)
    order = list(range(n * cfg.gen_rounds)) if indices is None else indices
    room = target.max_seq_len - cfg.gen_tokens - 1
    bar = tqdm(total=len(order), initial=len(seqs), desc="self-distillation data", disable=not progress_bar)
    for b0 in range(len(seqs), len(order), cfg.gen_batch):
        engine = Engine(target, min(cfg.gen_batch, len(order) - b0), prefill_chunk=4096)
        ids = {}
        for j in order[b0 : b0 + cfg.gen_batch]:
            x = tokenizer.encode(prompts[j % n])
            x = x[:1] + x[1:][-min(room, cfg.context_tokens or room) + 1 :]  # BOS and the prompt's end
            temp = 0.0 if j < n and j % 2 == 0 else cfg.gen_temperature
            ids[engine.add(x, NoDrafter(), Sampler(SamplingParams(temperature=temp), seed=cfg.seed + j), 1, cfg.gen_tokens)] = x
        for sid, r in sorted(engine.run().items()):
            seqs.append(_teacher(target, torch.tensor(ids[sid] + r.tokens, dtype=torch.long)))
            bar.update(1)
        if save is not None:
            save(seqs)
    bar.close()
    return seqs


def text_windows(tokenizer, n_tokens: int, length: int) -> list[list[int]]:
    """Windows of `length` tokens (BOS first) over the stdlib's training modules (never its held-out ones), at most
    two spread over each module, about n_tokens in all."""
    from . import data as D

    texts = D.read_texts(D.stdlib_files()[0])
    random.Random(0).shuffle(texts)
    out: list[list[int]] = []
    for text in texts:
        ids = tokenizer.encode(text)
        for s in range(1, len(ids) - length, max(length, (len(ids) - length) // 2 + 1)):
            if len(out) * length >= n_tokens:
                return out
            out.append(ids[:1] + ids[s : s + length - 1])
    return out


@torch.inference_mode()
def text_data(target, tokenizer, n_tokens: int, length: int, progress_bar: bool = True,
              world: World = World()) -> list[tuple[Tensor, Tensor]]:
    """The target's teacher pass over `text_windows`: [(tokens (T,), hidden (T, H))], each rank passing its share."""
    from tqdm import tqdm

    windows = text_windows(tokenizer, n_tokens, length)
    mine = world.mine(len(windows))
    out = [_teacher(target, torch.tensor(windows[i], dtype=torch.long)) for i in tqdm(mine, desc="teacher-forced text", disable=not progress_bar)]
    return world.gather(out)


def cached_distill_data(target, tokenizer, prompts: list[str], cfg, progress_bar: bool = True,
                        world: World = World()) -> list[tuple[Tensor, Tensor]]:
    """`self_distill_data` (+ `text_data` with cfg.text_tokens), read from / written to cfg.data_cache when it names a
    file; an interrupted generation continues from the sequences it had written. Under N processes each rank
    generates its share of the prompts (its own partial file: a generation cut short continues under the same N) and
    every rank gets all of it, in the one-process order; rank 0 writes the cache."""
    path = Path(cfg.data_cache) if cfg.data_cache else None
    if path is not None and path.exists():
        return torch.load(path)
    suffix = ".partial" if not world.distributed else f".partial-{world.rank}-of-{world.size}"
    partial = path.with_name(path.name + suffix) if path is not None else None
    done = torch.load(partial) if partial is not None and partial.exists() else None
    save = (lambda seqs: torch.save(seqs, partial)) if partial is not None else None
    seqs = world.gather(self_distill_data(target, tokenizer, prompts, cfg, progress_bar, done, save, world.mine(len(prompts) * cfg.gen_rounds)))
    if getattr(cfg, "text_tokens", 0):
        seqs += text_data(target, tokenizer, cfg.text_tokens, cfg.seq_len, progress_bar, world)
    if path is not None:
        if world.main:
            torch.save(seqs, path)
        world.barrier()  # the cache is whole before any rank drops its share
        if partial.exists():
            partial.unlink()
    return seqs


def _batch(seqs, n: int, length: int, rng: random.Random) -> tuple[Tensor, ...]:
    """(tokens (B, T), hidden (B, T, H)[, layer inputs (B, T, 3H)]) windows of the same length from random sequences
    (each a tuple (tokens, hidden[, layer inputs]))."""
    rows = []
    for _ in range(n):
        seq = seqs[rng.randrange(len(seqs))]
        L = min(length, seq[0].shape[0])
        s = rng.randrange(seq[0].shape[0] - L + 1)
        rows.append([x[s : s + L] for x in seq])
    m = min(r[0].shape[0] for r in rows)
    return (torch.stack([r[0][:m] for r in rows]), *(torch.stack([r[j][:m] for r in rows]).float() for j in range(1, len(rows[0]))))


def _soft_ce(logits: Tensor, teacher_logits: Tensor) -> Tensor:
    return -(torch.softmax(teacher_logits, -1) * torch.log_softmax(logits, -1)).sum(-1).mean()


def head_losses(head: DraftHead, target, tokens: Tensor, hidden: Tensor, cfg: HeadConfig, lm=None,
                layer_inputs: Tensor | None = None) -> tuple[Tensor, dict]:
    """tokens (B, T), hidden (B, T, H) target post-norm hiddens -> (loss, {per-part values}). lm: the LM head the
    teacher and the head are read through (a draft vocabulary's rows: both distributions over its tokens), else the
    target's. layer_inputs (B, T, 3H): an eagle3 head's features."""
    kind = head.config.kind
    lm = lm or target.head
    if kind == "eagle3":
        with torch.no_grad():
            teacher = lm(hidden)  # (B, T, N) over the draft vocabulary
        outs = eagle3_chain(head, target, tokens, layer_inputs, cfg.depth)
        parts, total = {}, 0.0
        for k, o in enumerate(outs):
            n = o.shape[1]
            loss = _soft_ce(head.mtp.lm_head(head.mtp.norm(o)), teacher[:, 1 + k : 1 + k + n])  # root i: t_{i+k+2}
            parts[f"ce_{k + 1}"] = loss.item()
            total = total + cfg.depth_decay**k * loss
        return total, parts
    with torch.no_grad():
        teacher = lm(hidden)  # (B, T, V) p_i = distribution of t_{i+1}
        emb = target.embed(tokens)  # (B, T, H)
    parts, total = {}, 0.0
    if kind == "medusa":
        feats = head.medusa(hidden)  # (K, B, T, H)
        for k in range(1, feats.shape[0] + 1):
            T = tokens.shape[1] - k
            loss = _soft_ce(lm(feats[k - 1, :, :T]), teacher[:, k:])
            parts[f"head_{k}"] = loss.item()
            total = total + cfg.depth_decay ** (k - 1) * loss
        return total, parts
    h = hidden
    for k in range(1, cfg.depth + 1):
        e = emb[:, k:]  # (B, T-k, H) e(t_{i+k})
        h = module_forward(head.mtp, h[:, : e.shape[1]], e, None, None, ForwardBatch.window(*e.shape[:2]), 0)  # MTP or EAGLE
        loss = _soft_ce(lm(h), teacher[:, k:])  # position i predicts t_{i+k+1}
        parts[f"ce_{k}"] = loss.item()
        w = cfg.depth_decay ** (k - 1)
        total = total + w * loss
        if kind == "eagle":
            reg = F.smooth_l1_loss(h, hidden[:, k:])  # predicted feature f ~ h_{i+k}
            parts[f"feature_{k}"] = reg.item()
            total = total + w * cfg.feature_weight * reg
    return total, parts


def eagle3_chain(head: DraftHead, target, tokens: Tensor, layer_inputs: Tensor, depth: int) -> list[Tensor]:
    """EAGLE-3's training-time test over windows: tokens (B, T), layer_inputs (B, T, 3H) -> per step k = 0..depth-1 the
    pre-norm outputs (B, T - 1 - k, H) of the chains rooted at i = 0..T-2-k: step 0 reads (fc(features_i), t_{i+1}),
    step k reads (step k-1's output at i, t_{i+1+k}) at position i + k, and attends to step 0's keys at positions
    <= i and to steps 1..k's keys of its own root (the draft chain's view: the real pairs, then its own entries)."""
    from ..models.attention import rope

    m = head.mtp
    blk = m.layers[0]
    att = blk.self_attn
    b, t = tokens.shape
    with torch.no_grad():
        emb = target.model.embed_tokens(tokens)  # (B, T, H) the raw rows
    g = m.fc(layer_inputs)  # (B, T, 3H) -> (B, T, H)
    emb = emb.to(g.dtype)
    cos_t, sin_t = att.rotary[0].tables(g.dtype)
    rep = att.nh // att.nkv
    keys, vals, outs = [], [], []
    for k in range(depth):
        n = t - 1 - k
        if n < 1:
            break
        gk = g[:, :n]  # (B, n, H)
        hn = blk.hidden_norm(gk)
        x = torch.cat([blk.input_layernorm(emb[:, 1 + k : 1 + k + n]), hn], dim=-1)  # (B, n, 2H)
        pos = torch.arange(k, k + n)
        cos, sin = cos_t[pos][None, None].to(g.dtype), sin_t[pos][None, None].to(g.dtype)  # (1, 1, n, hd)
        q = rope(att.q_proj(x).view(b, n, att.nh, att.hd).transpose(1, 2), cos, sin, att.hd)  # (B, nh, n, hd)
        kk = rope(att.k_proj(x).view(b, n, att.nkv, att.hd).transpose(1, 2), cos, sin, att.hd)  # (B, nkv, n, hd)
        v = att.v_proj(x).view(b, n, att.nkv, att.hd).transpose(1, 2)
        keys.append(kk.repeat_interleave(rep, 1))  # (B, nh, n, hd)
        vals.append(v.repeat_interleave(rep, 1))
        scale = att.hd**-0.5
        s0 = q @ keys[0][:, :, :n].transpose(-1, -2) * scale  # (B, nh, n, n) step 0's keys, causal
        s0 = s0.masked_fill(torch.ones(n, n, dtype=torch.bool).triu(1), float("-inf"))
        diag = [(q * kj[:, :, :n]).sum(-1, keepdim=True) * scale for kj in keys[1:]]  # k x (B, nh, n, 1)
        p = torch.softmax(torch.cat([s0, *diag], dim=-1), dim=-1)
        y = p[..., :n] @ vals[0][:, :, :n]  # (B, nh, n, hd)
        for j, vj in enumerate(vals[1:]):
            y = y + p[..., n + j : n + j + 1] * vj[:, :, :n]
        h = (hn if m.norm_before_residual else gk) + att.o_proj(y.transpose(1, 2).reshape(b, n, att.nh * att.hd))
        o = h + blk.mlp(blk.post_attention_layernorm(h))  # (B, n, H)
        outs.append(o)
        g = o
    return outs


@torch.inference_mode()
def layer_input_data(target, seqs: list[tuple[Tensor, Tensor]], layers: tuple[int, ...], path: Path | None = None,
                     progress_bar: bool = True) -> list[tuple[Tensor, Tensor, Tensor]]:
    """[(tokens, hidden, layer inputs (T, 3H))]: a teacher pass per sequence tapping the inputs of `layers` (bf16 for an
    fp32 target: half the memory, and the residual stream's range, which fp16's is not: Gemma 3's reaches 1e5 at its
    first position); read from / written to `path` when given."""
    from tqdm import tqdm

    if path is not None and path.exists():
        return [(t, h, a) for (t, h), a in zip(seqs, torch.load(path))]
    taps = tuple(sorted(set(layers)))
    feats = []
    for t, _ in tqdm(seqs, desc="target layer inputs", disable=not progress_bar):
        out = target.forward_tokens(t, target.new_cache(t.shape[0]), prefill=True, logits=False, taps=taps)
        a = torch.cat([out.layer_inputs[i] for i in layers], dim=-1)  # (T, 3H)
        feats.append(a.to(torch.bfloat16 if target.dtype == torch.float32 else target.dtype).clone())
    if path is not None:
        torch.save(feats, path)
    return [(t, h, a) for (t, h), a in zip(seqs, feats)]


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


def head_config(target, cfg: HeadConfig) -> DraftHeadConfig:
    """The head's shape for `target`: cfg's sizes (layer "own"), or one layer of the target's own dense kind."""
    h = target.config.hidden_size
    dense = None
    if cfg.layer == "target":
        from ..models.dense import DenseConfig

        if not isinstance(target.config, DenseConfig) or cfg.kind != "mtp":
            raise ConfigError("--layer target makes an MTP head with the target's own decoder layer: a dense target "
                              f"(Llama / Qwen3 / Gemma 3) and --kind mtp (got {type(target.config).__name__}, --kind {cfg.kind})")
        windows = target.config.layer_windows
        dense = {**asdict(target.config), "num_layers": 1, "layer_windows": list(windows[-1:]), "row_kernels": False}  # its last layer's
    elif cfg.layer != "own":
        raise ConfigError(f"--layer is 'own' or 'target', got {cfg.layer!r}")
    return DraftHeadConfig(
        kind=cfg.kind, hidden_size=h, vocab_size=target.vocab_size, max_seq_len=target.max_seq_len,
        num_heads=cfg.num_heads, num_kv_heads=cfg.num_kv_heads, head_dim=cfg.head_dim,
        intermediate_size=cfg.intermediate_size or 4 * h, num_medusa=cfg.num_medusa,
        rope_theta=getattr(target.config, "rope_theta", 10000.0), dense=dense, **(_eagle3_fields(target, cfg) if cfg.kind == "eagle3" else {}),
    )


def _eagle3_fields(target, cfg: HeadConfig) -> dict:
    """An eagle3 head's feature layers (cfg.aux_layers, else eagle3.default_layers), draft vocabulary size and norm eps."""
    from ..models.eagle3 import default_layers

    n = len(target.model.layers)
    try:
        layers = tuple(int(x) for x in cfg.aux_layers.split(",")) if cfg.aux_layers else default_layers(n)
    except ValueError:
        raise ConfigError(f"--aux-layers takes three target layer ids, e.g. 2,{n // 2},{n - 3}; got {cfg.aux_layers!r}") from None
    if len(layers) != 3 or any(not 0 <= i < n for i in layers):
        raise ConfigError(f"--aux-layers takes three target layer ids below {n} (its layers), got {cfg.aux_layers!r}")
    if cfg.layer != "own":
        raise ConfigError("--layer target is for MTP heads; an eagle3 head has its own Llama layer")
    return {"aux_layers": layers, "draft_vocab_size": cfg.draft_vocab if 0 < cfg.draft_vocab < target.vocab_size else 0,
            "norm_eps": float(getattr(target.config, "norm_eps", 1e-6))}


@torch.no_grad()
def init_from_target(head: DraftHead, target) -> None:
    """A dense-layer MTP head starts from the target's last decoder layer (its weights dequantized) and its final
    norm: the module's output then lives where the LM head reads."""
    src, dst = target.model.layers[-1], head.mtp.layers[0]
    own = dict(dst.named_modules())
    for name, m in src.named_modules():
        if name in own and hasattr(m, "weight"):
            own[name].weight.copy_(m.weight.float())
    head.mtp.norm.weight.copy_(target.model.norm.weight.float())


@torch.no_grad()
def init_eagle3(head: DraftHead, target, seqs, size: int):
    """An eagle3 head's draft vocabulary (the `size` tokens its data holds most, all when 0) and its LM head started
    from the target's rows of them -> (the teacher's LM head over them, or None for the target's; the share of the
    data's tokens inside them)."""
    m = head.mtp
    ids = torch.arange(target.vocab_size)
    if head.config.draft_vocab_size:
        ids = draft_vocabulary(seqs, target.vocab_size, size).top(size).sort().values
        m.set_vocab(ids)
    rows = target.lm_head.rows(ids).float().contiguous()  # (N, H)
    m.lm_head.weight.copy_(rows)
    if not head.config.draft_vocab_size:
        return None, 1.0
    coverage = round(float(sum(torch.isin(s[0], ids).sum() for s in seqs)) / sum(s[0].numel() for s in seqs), 4)
    return (lambda h: h @ rows.t()), coverage  # noqa: E731


def draft_vocabulary(seqs: list[tuple[Tensor, Tensor]], vocab_size: int, size: int) -> TokenRanking:
    """The target's tokens by how often its data holds them (prompts and continuations), `size` the default."""
    counts = torch.zeros(vocab_size, dtype=torch.long)
    for t, *_ in seqs:
        counts += torch.bincount(t, minlength=vocab_size)[:vocab_size]
    order, _ = ranking_from_counts(counts)
    return TokenRanking(order[: 4 * size], min(size, vocab_size))  # (a larger --draft-vocab than trained stays possible)


def train_head(model: str | Path, cfg: HeadConfig, tokenizer=None, progress_bar: bool = True, target=None) -> dict:
    """Train a head for the frozen target at `model` (or the given (module, tokenizer) pair in `target`). With
    cfg.checkpoint_every, a run cut short continues from out/train_state.pt (the head, the optimizer, the step), under
    any number of processes. Under torchrun: DDP over cfg.batch_size split among the ranks (distributed.py); rank 0
    returns the report, the others {}."""
    with launch(resolve(cfg.device).type) as world:
        return _train_head(model, cfg, tokenizer, progress_bar, target, world)


def _train_head(model, cfg: HeadConfig, tokenizer, progress_bar: bool, target, world: World) -> dict:
    from tqdm import tqdm

    from ..loading import load_checkpoint
    from .pretrain import optimizer_step

    if cfg.save_dtype not in ("float32", "bfloat16"):
        raise ConfigError(f"--save-dtype is float32 or bfloat16, got {cfg.save_dtype!r}")
    world.check_batch(cfg.batch_size)
    progress_bar = progress_bar and world.main
    torch.set_num_threads(cfg.threads)
    torch.manual_seed(cfg.seed)
    dev = train_device(cfg.device, world)
    module, tok = target if target is not None else load_checkpoint(model, tokenizer)
    if target is None:
        place(module, dev)
    elif device_of(module) != dev:
        raise ConfigError(f"the given target is on {device_of(module)}, the head would train on {dev}: "
                          f"give --device {device_of(module)}")
    module.eval()
    for p in module.parameters():
        p.requires_grad_(False)
    hc = head_config(module, cfg)
    train_p, held_p = training_prompts(cfg, tok)
    t0 = time.perf_counter()
    seqs = cached_distill_data(module, tok, train_p, cfg, progress_bar, world)
    gen_s = time.perf_counter() - t0
    head = DraftHead(hc)
    if hc.dense is not None:
        init_from_target(head, module)
    head.to(dev)
    lm, coverage = None, 1.0
    if cfg.kind == "eagle3":
        lm, coverage = init_eagle3(head, module, seqs, cfg.draft_vocab)  # (the vocabulary of the whole data)
        if 0 < cfg.feature_sequences < len(seqs):
            seqs = [seqs[i] for i in torch.linspace(0, len(seqs) - 1, cfg.feature_sequences).round().long().tolist()]
        cache = Path(cfg.data_cache) if cfg.data_cache else None
        tag = "-".join(map(str, hc.aux_layers)) + (f".n{cfg.feature_sequences}" if cfg.feature_sequences else "")
        cache = cache and cache.with_name(cache.stem + ".layers-" + tag + cache.suffix)
        seqs = layer_input_data(module, seqs, hc.aux_layers, cache, progress_bar)
    elif cfg.draft_vocab:
        head.token_ranking = draft_vocabulary(seqs, module.vocab_size, cfg.draft_vocab)
        ids = head.token_ranking.top(cfg.draft_vocab)
        rows = module.lm_head.rows(ids).float().contiguous()  # (N, H) the LM head's rows of the draft vocabulary
        lm = lambda h: h @ rows.t()  # noqa: E731
        coverage = round(float(sum(torch.isin(t, ids).sum() for t, _ in seqs)) / sum(t.numel() for t, _ in seqs), 4)
    opt = torch.optim.AdamW(head.parameters(), lr=cfg.lr, weight_decay=0.0)
    rng = random.Random(cfg.seed)
    history, first, train_s = [], 0, 0.0
    state_path = Path(cfg.out) / "train_state.pt"
    if cfg.checkpoint_every and state_path.exists():
        state = torch.load(state_path, weights_only=False, map_location="cpu")
        head.load_state_dict(state["head"])
        opt.load_state_dict(state["opt"])
        rng.setstate(state["rng"])
        history, first, train_s = state["history"], state["step"], state["train_seconds"]
    loss_fn = world.wrap(head, lambda toks, hid, aux=None: head_losses(head, module, toks, hid, cfg, lm, aux))
    bar = tqdm(range(first, cfg.steps), desc=f"train {cfg.kind} head", disable=not progress_bar, initial=first, total=cfg.steps)
    t1 = time.perf_counter() - train_s
    elapsed, steps_run = train_s, first  # (elapsed: the ranks' mean, so every rank stops at the same step)
    for step in bar:
        progress = max(step / cfg.steps, elapsed / (60 * cfg.max_minutes) if cfg.max_minutes else 0.0)
        if progress >= 1.0:
            break
        lr = cfg.lr * min(1.0, (step + 1) / 30) * (0.1 + 0.9 * 0.5 * (1 + math.cos(progress * math.pi)))
        batch = _batch(seqs, cfg.batch_size, cfg.seq_len, rng)  # the global batch: every rank draws it alike
        with on(dev):
            loss, parts = loss_fn(*(world.shard(x).to(dev) for x in batch))
            optimizer_step(opt, head.parameters(), loss, lr)
        logged = world.mean({"loss": loss.item(), **parts, "elapsed": time.perf_counter() - t1})
        elapsed, steps_run = logged.pop("elapsed"), step + 1
        bar.set_postfix(loss=f"{logged['loss']:.3f}")
        if step % 50 == 0 or step == cfg.steps - 1:
            history.append({"step": step, **{k: round(v, 4) for k, v in logged.items()}})
        if cfg.checkpoint_every and (step + 1) % cfg.checkpoint_every == 0 and step + 1 < cfg.steps:
            if world.main:  # global state only: resumable under any number of processes
                Path(cfg.out).mkdir(parents=True, exist_ok=True)
                torch.save({"head": head.state_dict(), "opt": opt.state_dict(), "rng": rng.getstate(), "history": history,
                            "step": step + 1, "train_seconds": time.perf_counter() - t1}, state_path)
            world.barrier()
    train_s = time.perf_counter() - t1
    world.barrier()
    if not world.main:
        return {}
    save_head(head, cfg.out, getattr(torch, cfg.save_dtype))
    head = load_head(cfg.out)  # measured as written
    if state_path.exists():
        state_path.unlink()
    k = cfg.num_medusa if cfg.kind == "medusa" else max(cfg.depth, 1)
    report = {
        "kind": cfg.kind, "target": str(model), "parameters": sum(p.numel() for p in head.parameters()),
        "train_prompts": len(train_p), "heldout_prompts_skipped": len(held_p), "distill_tokens": sum(s[0].shape[0] for s in seqs),
        "draft_vocab": cfg.draft_vocab, "draft_vocab_coverage": coverage,  # share of the data's tokens inside it
        "generation_seconds": round(gen_s, 1), "train_seconds": round(train_s, 1), "steps": steps_run,
        "final_loss": history[-1] if history else None,
        "heldout_greedy": measure(module, tok, head, held_p[: cfg.eval_prompts], k, cfg.eval_tokens) if cfg.eval_prompts else None,
        "config": asdict(cfg), "history": history,
    }
    (Path(cfg.out) / "report.json").write_text(json.dumps(report, indent=2) + "\n")
    return report

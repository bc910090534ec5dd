"""Draft heads trained for a frozen target (`mtpspec train head`): MTP, Medusa, EAGLE, EAGLE-3.

The first three read the target's post-final-norm hidden states and share the target's embedding and LM
head (frozen, not stored with the head):

- **mtp**: the native module (qwen35.MTPModule) added to a target that has none. Position i reads
  (h_i, e(t_{i+1})) and predicts t_{i+2}; chained for depth > 1 on its own output hidden.
- **eagle**: x = fc([e(t_{i+1}), h_i]) (with bias) -> one decoder layer -> a predicted *feature*
  f_{i+1} ~ h_{i+1} (no final norm: the target's hidden is already post-norm), logits = LM head(f).
  Autoregressive at the feature level: the next step reads (f_{i+1}, e(d)). Trained with feature
  regression + token cross-entropy.
- **medusa**: K residual blocks h + SiLU(W_k h + b_k), W_k zero-initialised (so each head starts as
  the target's own next-token head); block k at position i predicts t_{i+1+k}.

- **eagle3** (eagle3.py): the inputs of three target layers, fused by fc, through one Llama layer whose attention
  reads [norm(e(t_{i+1})), norm(g_i)]; its own final norm and LM head over a draft vocabulary (d2t / t2d); chained on
  its pre-norm output. Shares the target's embedding only.

MTP, EAGLE and EAGLE-3 run through the same forward (forward.module_forward: (hidden, emb) -> (T, H)), so one
drafter (drafters/mtp.py) runs both through `AttachedHead`: an MTPSource (mtp_source.py) made of
the head and its frozen target, as a target with a native MTP module is one.

Checkpoint: a folder with head.json {"format": "mtpspec-head", "kind", "config"} + head.safetensors.
"""

from __future__ import annotations

import copy
import json
from dataclasses import asdict, dataclass
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from ..cache import KVCache
from ..errors import ConfigError, ModelLoadError
from .common import DraftModule, Linear, RMSNorm, Rotary
from .dense import DenseMTPModule, layer_rotary
from .draft_vocab import read_draft_vocab, write_ranking
from .mtp_source import MTPSource
from .forward import module_tokens
from .qwen35 import HybridBlock, HybridConfig, MTPModule

KINDS = ("mtp", "medusa", "eagle", "eagle3")
FORMAT = "mtpspec-head"


@dataclass(frozen=True)
class DraftHeadConfig:
    kind: str  # one of KINDS
    hidden_size: int  # the target's
    vocab_size: int  # the target's
    max_seq_len: int  # the target's context (the head's KV cache is preallocated to it)
    num_heads: int = 4  # attention of the head's decoder layer (mtp, eagle)
    num_kv_heads: int = 4
    head_dim: int = 16
    intermediate_size: int = 256
    rope_theta: float = 10000.0
    num_medusa: int = 3  # K (medusa)
    # the decoder layer's kind: None = Qwen3.5's gated full attention of the fields above; else the fields of a
    # DenseConfig of one layer (mtp: its target's own layer kind, a Llama / Qwen3 / Gemma 3 target's)
    dense: dict | None = None
    # eagle3: the target layers whose inputs are its features (low, middle, high), its draft vocabulary's size (0 = the
    # target's V), its norms' epsilon, and whether the layer's residual is hidden_norm(g) rather than g (llama.cpp's
    # norm_before_residual; off by default there and here)
    aux_layers: tuple[int, ...] = ()
    draft_vocab_size: int = 0
    norm_eps: float = 1e-6
    norm_before_residual: bool = False

    @property
    def mtp_num_layers(self) -> int:  # what MTPDrafter reads from a target's config
        return 1

    def dense_config(self):
        from .dense import DenseConfig

        return DenseConfig(**{**self.dense, "layer_windows": tuple(self.dense.get("layer_windows", ()))})

    @property
    def kv_shape(self) -> tuple[int, int]:
        """(KV heads, head size) of the decoder layer's cache."""
        if self.dense is not None:
            d = self.dense_config()
            return d.num_kv_heads, d.hd
        return self.num_kv_heads, self.head_dim

    def eagle3_config(self):
        """The DenseConfig of an EAGLE-3 head's Llama layer."""
        from .dense import DenseConfig

        return DenseConfig(
            vocab_size=self.vocab_size, hidden_size=self.hidden_size, num_layers=1, num_heads=self.num_heads,
            num_kv_heads=self.num_kv_heads, intermediate_size=self.intermediate_size, max_seq_len=self.max_seq_len,
            head_dim=self.head_dim, norm_eps=self.norm_eps, rope_theta=self.rope_theta,
        )

    def layer_config(self) -> HybridConfig:
        return HybridConfig(
            vocab_size=self.vocab_size, hidden_size=self.hidden_size, num_layers=0, layer_types=(),
            num_heads=self.num_heads, num_kv_heads=self.num_kv_heads, head_dim=self.head_dim,
            intermediate_size=self.intermediate_size, max_seq_len=self.max_seq_len, rope_theta=self.rope_theta,
            partial_rotary_factor=1.0, mtp_num_layers=1,
        )


class EagleModule(DraftModule):
    """fc([emb, hidden]) -> one decoder layer -> predicted feature (T, H). Own KV cache."""

    def __init__(self, cfg: HybridConfig, rotary: Rotary) -> None:
        super().__init__()
        self.fc = Linear(2 * cfg.hidden_size, cfg.hidden_size, bias=True)
        self.layers = nn.ModuleList([HybridBlock(cfg, "full_attention", 0, rotary, False)])


class MedusaHeads(nn.Module):
    """K residual blocks on the last hidden state; block k (1-based) predicts the token k+1 ahead."""

    def __init__(self, hidden: int, k: int) -> None:
        super().__init__()
        self.blocks = nn.ModuleList(Linear(hidden, hidden) for _ in range(k))
        for b in self.blocks:
            nn.init.zeros_(b.weight)
            nn.init.zeros_(b.bias)

    def forward(self, hidden: Tensor) -> Tensor:
        """hidden (..., H) -> (K, ..., H) features for the target's LM head."""
        return torch.stack([hidden + F.silu(b(hidden)) for b in self.blocks])


class DraftHead(nn.Module):
    """The trainable part only (the target's embedding / LM head stay with the target)."""

    def __init__(self, cfg: DraftHeadConfig) -> None:
        super().__init__()
        if cfg.kind not in KINDS:
            raise ConfigError(f"unknown head kind '{cfg.kind}' (choose from: {', '.join(KINDS)})")
        self.config = cfg
        self.token_ranking = None  # its draft vocabulary (draft_vocab.json beside the head), when it has one
        if cfg.kind == "medusa":
            self.medusa = MedusaHeads(cfg.hidden_size, cfg.num_medusa)
            return
        if cfg.kind == "eagle3":
            if cfg.dense is not None:
                raise ConfigError("an eagle3 head has its own Llama layer; a dense layer is for MTP heads")
            from .eagle3 import Eagle3Module

            self.mtp = Eagle3Module(cfg.eagle3_config(), len(cfg.aux_layers), cfg.draft_vocab_size or cfg.vocab_size,
                                    cfg.norm_before_residual)
            return
        if cfg.dense is not None:
            if cfg.kind != "mtp":
                raise ConfigError(f"a {cfg.kind} head has the Qwen3.5 layer; a dense layer is for MTP heads")
            dc = cfg.dense_config()
            self.rotary = layer_rotary(dc, dc.layer_windows[0] if dc.layer_windows else 0)
            self.mtp = DenseMTPModule(dc, self.rotary)
            return
        lc = cfg.layer_config()
        self.rotary = Rotary(lc.rot_dim, lc.max_seq_len, lc.rope_theta)
        self.mtp = MTPModule(lc, self.rotary) if cfg.kind == "mtp" else EagleModule(lc, self.rotary)


def save_head(head: DraftHead, directory: str | Path, dtype: torch.dtype | None = None) -> Path:
    """head.json + head.safetensors (the weights in `dtype`, default their own) + draft_vocab.json when it has one."""
    from safetensors.torch import save_file

    d = Path(directory)
    d.mkdir(parents=True, exist_ok=True)
    save_file({k: v.detach().to(dtype if dtype is not None and v.is_floating_point() else v.dtype).contiguous()
               for k, v in head.state_dict().items()}, str(d / "head.safetensors"))
    meta = {"format": FORMAT, "version": 1, "kind": head.config.kind, "config": asdict(head.config)}
    (d / "head.json").write_text(json.dumps(meta, indent=2) + "\n")
    if head.token_ranking is not None:
        write_ranking(d, head.token_ranking)
    return d


def on_blocks(head: DraftHead) -> DraftHead:
    """A copy of `head` whose matrices are Q8_0 blocks on the block kernel and whose fp32 norms take the row kernel (a
    head drafting for a GGUF-block target: a quarter of fp32's bytes and one call per norm in a draft step; drafts
    only propose, the target's verify pass decides)."""
    from ..kernels.quantized import q8_0

    q = copy.deepcopy(head)
    for name, m in list(q.named_modules()):
        if isinstance(m, Linear) and m.qweight is None and m.in_features % 32 == 0:
            parent, _, attr = name.rpartition(".")
            bias = None if m.bias is None else m.bias.detach()
            setattr(q.get_submodule(parent), attr, Linear.of_blocks(q8_0(m.weight), bias, m.weight.dtype))
        elif isinstance(m, RMSNorm) and m.weight.dtype == torch.float32:
            m.row_kernel = True
    return q


def is_head_dir(path: str | Path) -> bool:
    """A `train head` folder (head.json)."""
    return Path(path).is_dir() and (Path(path) / "head.json").exists()


def load_strict(module: nn.Module, state: dict, where, what: str, config_name: str) -> None:
    """module.load_state_dict(state), every tensor named and shaped as the module's, else one ModelLoadError naming
    the missing / unexpected tensors or the first mismatched shape (against `config_name`)."""
    own = module.state_dict()
    missing, unexpected = sorted(set(own) - set(state)), sorted(set(state) - set(own))
    if missing or unexpected:
        raise ModelLoadError(f"{where}: {what} tensors missing: {missing or 'none'}; unexpected: {unexpected or 'none'}")
    try:
        module.load_state_dict(state)
    except RuntimeError as e:  # a tensor of the wrong shape
        raise ModelLoadError(f"{where}: {what} tensors do not match {config_name}: {str(e).splitlines()[-1].strip()}") from None


def load_head(path: str | Path, dtype: torch.dtype = torch.float32) -> DraftHead:
    """Strict: every missing or unexpected tensor is named."""
    from safetensors.torch import load_file

    d = Path(path)
    meta_path = d / "head.json"
    if not meta_path.exists():
        raise ModelLoadError(f"{d}: not a draft head (head.json missing; train one with `mtpspec train head`)")
    try:
        meta = json.loads(meta_path.read_text())
    except (OSError, UnicodeDecodeError, ValueError) as e:
        raise ModelLoadError(f"{meta_path}: not a readable head description ({e})") from None
    if not isinstance(meta, dict) or meta.get("format") != FORMAT:
        raise ModelLoadError(f"{meta_path}: not a draft head (format {meta.get('format')!r})")
    try:
        cfg = DraftHeadConfig(**{**meta["config"], "aux_layers": tuple(meta["config"].get("aux_layers", ()))})
        _check_config(cfg)
        head = DraftHead(cfg)
    except (TypeError, KeyError, ValueError, RuntimeError, ConfigError) as e:
        raise ModelLoadError(f"{meta_path}: bad head config: {e}") from None
    try:
        state = load_file(str(d / "head.safetensors"))
    except Exception as e:  # safetensors raises its own error types for a corrupt or missing file
        raise ModelLoadError(f"{d / 'head.safetensors'}: cannot read the head's weights ({e})") from None
    load_strict(head, state, d, "head", "head.json")
    head.token_ranking = read_draft_vocab(d, cfg.vocab_size)
    return head.to(dtype).eval()


def _check_config(cfg: DraftHeadConfig) -> None:
    for name in ("hidden_size", "vocab_size", "max_seq_len", "num_heads", "num_kv_heads", "head_dim", "intermediate_size", "num_medusa"):
        v = getattr(cfg, name)
        if not isinstance(v, int) or isinstance(v, bool) or v < 1:
            raise ValueError(f"{name} must be a positive integer, got {v!r}")
    if cfg.kind == "eagle3" and (len(cfg.aux_layers) != 3 or any(not isinstance(i, int) or i < 0 for i in cfg.aux_layers)):
        raise ValueError(f"aux_layers must be three target layer ids (low, middle, high), got {list(cfg.aux_layers)}")
    if not isinstance(cfg.draft_vocab_size, int) or not 0 <= cfg.draft_vocab_size <= cfg.vocab_size:
        raise ValueError(f"draft_vocab_size must be 0 (the full vocabulary) .. {cfg.vocab_size}, got {cfg.draft_vocab_size!r}")
    if cfg.num_heads % cfg.num_kv_heads or cfg.head_dim % 2:
        raise ValueError(f"num_heads {cfg.num_heads} / num_kv_heads {cfg.num_kv_heads} / head_dim {cfg.head_dim} do not fit")
    if cfg.dense is not None:
        if not isinstance(cfg.dense, dict):
            raise ValueError(f"dense must be a layer config (an object), got {cfg.dense!r}")
        d = cfg.dense_config()
        if d.num_layers != 1 or d.hidden_size != cfg.hidden_size or d.num_heads % d.num_kv_heads:
            raise ValueError(f"dense: one layer of width {cfg.hidden_size} expected, got {d.num_layers} of width {d.hidden_size}")


def check_fits(head: DraftHead, target) -> None:
    c, t = head.config, target.config
    if c.hidden_size != t.hidden_size or c.vocab_size != target.vocab_size:
        raise ConfigError(
            f"the {c.kind} head was trained for hidden {c.hidden_size} / vocabulary {c.vocab_size}; "
            f"this target has hidden {t.hidden_size} / vocabulary {target.vocab_size}"
        )
    n = len(target.model.layers) if c.aux_layers else 0
    if any(i >= n for i in c.aux_layers):
        raise ConfigError(f"the {c.kind} head reads the inputs of target layers {list(c.aux_layers)}; this target has {n} layers")


class AttachedHead(MTPSource):
    """A trained MTP or EAGLE head on its frozen target: the MTPSource the MTP drafter reads.

    The module, its config (mtp_num_layers) and its KV cache are the head's; the embedding, the LM
    head (vocab_size, lm_head, head()) and the draft vocabulary's token ranking are the target's.
    `target` is the frozen target itself (compiled.py reads it to find the target's compiled step)."""

    def __init__(self, target, head: DraftHead) -> None:
        if head.config.kind not in ("mtp", "eagle", "eagle3"):
            raise ConfigError(f"a {head.config.kind} head is not an MTP-style module")
        check_fits(head, target)
        self.target, self.module = target, head  # the frozen target; the trained head (its parameters)
        self.mtp: nn.Module = head.mtp  # MTPModule or EagleModule
        self.config: DraftHeadConfig = head.config  # mtp_num_layers = 1
        self.max_seq_len = min(target.max_seq_len, head.config.max_seq_len)
        self.vocab_size: int = target.vocab_size
        self.lm_head: nn.Linear = target.lm_head
        # the draft vocabulary: the head's own (its training text's), else the target's, if any
        self.token_ranking = head.token_ranking or getattr(target, "token_ranking", None)

    def new_mtp_cache(self) -> KVCache:
        return KVCache(1, *self.config.kv_shape, self.max_seq_len, self.target.dtype)

    def head(self, hidden: Tensor) -> Tensor:
        return self.target.head(hidden)

    def embed(self, tokens: Tensor) -> Tensor:
        return self.target.embed(tokens)

    def mtp_forward(self, hidden: Tensor, tokens: Tensor, cache: KVCache, layer: int = 0, tree=None,
                    sparse: str = "recompute") -> Tensor:
        return module_tokens(self.mtp, self.target.embed, hidden, tokens, cache, layer, tree, sparse)


class Eagle3Head(AttachedHead):
    """A trained EAGLE-3 head on its frozen target (eagle3.py): the MTPSource the MTP drafter reads, whose pairs'
    hidden states are g = fc(the target's layer inputs) (`pair_hidden`), whose embedding is the target's raw rows, and
    whose logits are its own LM head's over its draft vocabulary (`own_head`, -inf elsewhere in `head`).

    Attaching it sets nothing on the target: its `taps` (the head's layers, once each) are what its drafter asks the
    engine to pass to every target forward of its sequence (forward_tokens(..., taps), TargetOutput.layer_inputs);
    other sequences' forwards of the same target tap nothing."""

    def __init__(self, target, head: DraftHead) -> None:
        from .eagle3 import Eagle3Vocab

        super().__init__(target, head)
        self.token_ranking = None  # its draft vocabulary is the head's own (d2t), not a ranking of the target's
        self.own_head = Eagle3Vocab(head.mtp, target.vocab_size)
        self.layers = tuple(head.config.aux_layers)  # in fc's order (a layer may repeat)
        self.taps = tuple(sorted(set(self.layers)))  # the target layers whose inputs pair_hidden reads

    def pair_hidden(self, out) -> Tensor:
        """A target forward's output (T rows) -> g (T, H), the hidden state of the pairs at those positions."""
        if out.layer_inputs is None or any(i not in out.layer_inputs for i in self.layers):
            raise ConfigError(f"the eagle3 head needs the target's inputs of layers {list(self.layers)}; this forward gave none")
        return self.mtp.features(torch.cat([out.layer_inputs[i] for i in self.layers], dim=-1))  # (T, 3H) -> (T, H)

    def embed(self, tokens: Tensor) -> Tensor:
        return self.target.model.embed_tokens(tokens)  # (T, H) the raw rows (llama.cpp: get_rows of tok_embd)

    def head(self, hidden: Tensor) -> Tensor:
        return self.own_head.full(self.own_head.logits(hidden))

    def mtp_forward(self, hidden: Tensor, tokens: Tensor, cache: KVCache, layer: int = 0, tree=None,
                    sparse: str = "recompute") -> Tensor:
        return module_tokens(self.mtp, self.embed, hidden, tokens, cache, layer, tree, sparse)


def attach(target, head: DraftHead) -> AttachedHead:
    """The MTPSource of a trained MTP / EAGLE / EAGLE-3 head on its target."""
    return Eagle3Head(target, head) if head.config.kind == "eagle3" else AttachedHead(target, head)


__all__ = ["DraftHeadConfig", "DraftHead", "MedusaHeads", "EagleModule", "AttachedHead", "Eagle3Head", "attach",
           "save_head", "load_head", "KINDS"]

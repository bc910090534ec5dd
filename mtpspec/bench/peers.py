"""Peers on the same weights: Hugging Face transformers' generate() (plain, prompt lookup, assisted).

An HF directory is used as it is; any other model is exported first (`mtpspec export`, checked by equal logits). The
prompts are our token ids; generate() gets our stop ids, and a trailing stop token is dropped before comparing.
"""

from __future__ import annotations

import logging
import warnings
from dataclasses import dataclass
from pathlib import Path
from time import perf_counter, process_time

import torch

from ..errors import ConfigError
from ..prompts import Prompt
from .harness import Method, Run


@dataclass
class PeerModel:
    """A model as transformers runs it: its directory and the loaded model (loaded once)."""

    directory: Path
    model: object  # transformers' causal LM, fp32, eval mode
    export_diff: float | None  # max |logits diff| of the export check (None: the directory was used as it is)


def peer_model(model, out_dir: Path, name: str) -> PeerModel:
    """`model` for transformers: its own directory if it is an HF one, else an export checked by equal
    logits (the model loaded for the check is the one the peer runs)."""
    from ..export import check_export, export_hf, load_hf, special_ids

    _quiet()
    src = Path(model.path) if model.path else None
    if src is not None and src.is_dir() and (src / "config.json").exists():
        return PeerModel(src, load_hf(src), None)
    d = export_hf(model.module, out_dir / name, *special_ids(model.tokenizer))
    hf = load_hf(d)
    ids = list(range(1, min(64, model.max_seq_len) + 1))
    chk = check_export(model.module, d, [i % model.module.vocab_size for i in ids], hf_model=hf)
    if not chk.ok:
        raise ConfigError(f"export of {name} does not reproduce our logits (max |diff| {chk.max_abs_diff:.2e})")
    return PeerModel(d, hf, chk.max_abs_diff)


def _quiet() -> None:
    warnings.filterwarnings("ignore", module="transformers")
    from transformers.utils import logging as hf_logging

    hf_logging.set_verbosity_error()
    hf_logging.disable_progress_bar()
    logging.getLogger("transformers").setLevel(logging.ERROR)


class HFRunner:
    """transformers' generate() on exported (or native) checkpoints, each loaded by its own class."""

    def __init__(self, target: PeerModel, draft: PeerModel | None, stop_ids: tuple[int, ...]) -> None:
        self.target = target.model
        self.draft = draft.model if draft is not None else None
        self.stop_ids = list(stop_ids) or None
        # transformers crops no recurrent state: prompt lookup and assisted generation (both "assisted
        # generation" to it) refuse stateful models such as Qwen3.5's Gated DeltaNet hybrid
        self.stateful = bool(getattr(self.target, "_is_stateful", False))

    def unsupported(self, method: Method) -> str | None:
        """Why transformers cannot run `method` on this model (None: it can)."""
        if method.drafter != "none" and self.stateful:
            return f"transformers runs no assisted generation (prompt lookup, draft model) on the stateful {type(self.target).__name__}"
        return None

    def kwargs(self, method: Method) -> dict:
        if method.drafter == "none":
            return {}
        if method.drafter == "ngram":
            return {"prompt_lookup_num_tokens": int(method.k) if isinstance(method.k, int) else 10}
        if method.drafter == "draft":
            if self.draft is None:
                raise ConfigError("the assisted-generation peer needs --draft-model")
            return {"assistant_model": self.draft}  # its default schedule (heuristic, confidence threshold)
        raise ConfigError(f"transformers has no peer for drafter '{method.drafter}'")

    @torch.inference_mode()
    def run(self, method: Method, prompt: Prompt, ids: list[int], max_new_tokens: int, temperature: float, seed: int) -> Run:
        x = torch.tensor([ids], dtype=torch.long)
        sample = temperature > 0
        kw = dict(max_new_tokens=max_new_tokens, do_sample=sample, eos_token_id=self.stop_ids, pad_token_id=0,
                  attention_mask=torch.ones_like(x))
        if sample:
            kw.update(temperature=temperature, top_k=0, top_p=1.0)
            torch.manual_seed(seed)
        threads = torch.get_num_threads()
        c0, t0 = process_time(), perf_counter()
        out = self.target.generate(x, **kw, **self.kwargs(method))
        wall, cpu = perf_counter() - t0, process_time() - c0
        if torch.get_num_threads() != threads:  # whatever generate() changed must not reach our runs
            torch.set_num_threads(threads)
        new = out[0, len(ids) :].tolist()
        if new and self.stop_ids and new[-1] in self.stop_ids:
            new = new[:-1]
        return Run(method=method.label, prompt_id=prompt.id, category=prompt.category, prompt_tokens=len(ids), tokens=new, wall_seconds=wall, cpu_seconds=cpu)

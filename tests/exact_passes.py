"""Logits of every position computed in exact-mode verify passes of a given size (shared by the exact tests)."""

from __future__ import annotations

import torch

from mtpspec.engine import _verify_pass
from mtpspec.types import Draft


@torch.inference_mode()
def logits_in_passes(module, ids: torch.Tensor, p0: int, chunk: int, width: int) -> torch.Tensor:
    """Prefill ids[:p0], then feed the rest `chunk` positions per exact verify pass of `width` rows.

    chunk = 1 is plain decoding; every position's logits row, in order, (len(ids) - p0, V).
    """
    cache = module.new_cache()
    cache.exact = True
    module.forward_tokens(ids[:p0], cache)
    rows, j = [], p0
    while j < len(ids):
        toks = ids[j : j + chunk]
        start = cache.length
        out = _verify_pass(module, cache, toks[:1], Draft(tokens=toks[1:]), width)
        cache.crop(start + toks.shape[0])
        rows.append(out.logits)
        j += chunk
    return torch.cat(rows)

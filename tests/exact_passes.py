"""Logits of every position computed by exact-mode forwards of a given size (shared by the exact tests)."""

from __future__ import annotations

import torch


@torch.inference_mode()
def logits_in_passes(module, ids: torch.Tensor, p0: int, chunk: int) -> torch.Tensor:
    """Prefill ids[:p0], then feed the rest `chunk` positions per exact forward (teacher-forced: every row kept).

    chunk = 1 is plain decoding; every position's logits row, in order, (len(ids) - p0, V).
    """
    cache = module.new_cache()
    module.forward_tokens(ids[:p0], cache, exact=True, prefill=True)
    rows, j = [], p0
    while j < len(ids):
        out = module.forward_tokens(ids[j : j + chunk], cache, exact=True)
        rows.append(out.logits)
        j += chunk
    return torch.cat(rows)

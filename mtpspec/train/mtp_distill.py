"""The MTP module's self-distillation objective, shared by `train mtp` (native_mtp.py) and its --sparse phase 2
(sparse_mtp.py): chained depths fitted to the frozen model's own next-token distributions."""

from __future__ import annotations

import torch

from .heads import _soft_ce
from .pretrain import mtp_hiddens


def mtp_distill_loss(model, tokens: torch.Tensor, hidden: torch.Tensor, depth: int, decay: float) -> tuple[torch.Tensor, dict]:
    """tokens (B, T), hidden (B, T, H) the model's post-norm hiddens -> (loss, {ce_k}).

    Depth k (chained on the module's own output, pretrain.py `mtp_hiddens`) at position i is fitted to the model's
    distribution of t_{i+k+1} (soft cross-entropy), weighted decay^(k-1)."""
    with torch.no_grad():
        teacher = model.head(hidden)  # (B, T, V) p_i = distribution of t_{i+1}
    total, parts = 0.0, {}
    for k, h in enumerate(mtp_hiddens(model.mtp, model.embed, hidden, tokens, depth), 1):
        loss = _soft_ce(model.head(h), teacher[:, k:])  # (B, T-k): position i predicts t_{i+k+1}
        parts[f"ce_{k}"] = round(loss.item(), 4)
        total = total + decay ** (k - 1) * loss
    return total, parts

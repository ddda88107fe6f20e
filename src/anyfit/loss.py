"""The training loss: a *sum* of token cross-entropies, normalised by the caller.

Summing here and dividing by the trainable-token count of the whole accumulation window (across all
processes) in the loop is what makes every split of the same effective batch produce the same update;
a mean per micro-batch would weight short and long micro-batches differently.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from .batching import IGNORE_INDEX


def token_loss_sum(model: torch.nn.Module, batch: dict[str, torch.Tensor]) -> torch.Tensor:
    """Sum of next-token cross-entropy over the positions whose label is not IGNORE_INDEX (fp32)."""
    logits = model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"], use_cache=False).logits
    targets = batch["labels"][:, 1:]
    logits = logits[:, :-1]
    return F.cross_entropy(logits.reshape(-1, logits.size(-1)).float(), targets.reshape(-1),
                           ignore_index=IGNORE_INDEX, reduction="sum")

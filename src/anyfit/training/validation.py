"""Evaluation inside a training run: which records are held out, and the validation loss over them.

Generation accuracy comes from ``anyfit.evaluation.evaluate.generation_eval``; this module only decides the held-out
data and computes the loss the same way training does (summed token loss over all trainable tokens).
"""

from __future__ import annotations

import dataclasses
import random

import torch

from anyfit.data.batching import to_device

from anyfit.config import Config
from anyfit.data.sources import load_records


def split_eval_records(cfg: Config, records: list[dict]) -> tuple[list[dict], list[dict] | None]:
    """(training records, held-out records or None). ``eval.holdout`` takes a seeded sample of the
    training records out of training; ``eval.path``/``eval.split`` read separate data with the data.* settings."""
    if cfg.eval.holdout:
        order = list(range(len(records)))
        random.Random(cfg.train.seed).shuffle(order)
        held = set(order[:cfg.eval.holdout])
        return [r for i, r in enumerate(records) if i not in held], [records[i] for i in sorted(held)]
    if cfg.eval.path or cfg.eval.split:
        eval_data = dataclasses.replace(cfg.data, path=cfg.eval.path or cfg.data.path,
                                        split=cfg.eval.split or cfg.data.split, num_samples=None)
        return records, load_records(eval_data)
    return records, None


@torch.no_grad()
def validation_loss(accelerator, model, examples: list[dict], micro_batch: int, collate_fn, loss_fn) -> float:
    """Mean token loss over every trainable token of ``examples``, split over the processes."""
    mine = examples[accelerator.process_index::accelerator.num_processes]
    mine = sorted(mine, key=lambda e: -len(e["input_ids"]))  # similar lengths together: less padding
    totals = torch.zeros(2, device=accelerator.device)
    was_training = model.training
    model.eval()  # no dropout: the number does not depend on the RNG, and the RNG is not consumed
    try:
        for i in range(0, len(mine), micro_batch):
            batch = to_device(collate_fn(mine[i:i + micro_batch]), accelerator.device)
            totals[0] += loss_fn(model, batch).float()
            totals[1] += batch["keep_targets"].numel()
    finally:
        model.train(was_training)
    totals = accelerator.reduce(totals, reduction="sum")
    return (totals[0] / totals[1].clamp(min=1)).item()

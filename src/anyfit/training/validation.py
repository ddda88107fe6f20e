"""Evaluation inside a training run: the validation loss over held-out examples, and generation accuracy.

The held-out data are decided in ``anyfit.data.prepare``; generation accuracy comes from
``anyfit.evaluation.evaluate.generation_eval`` (its first few answers are kept in the run folder for the run's
report). The loss is computed the way training computes it
(summed token loss over all trainable tokens), without dropout and without touching the RNG.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch
from tqdm.auto import tqdm

from anyfit.backends import unwrapped
from anyfit.data.batching import to_device
from anyfit.data.formats import Example
from anyfit.data.images import thumbnail_uri
from anyfit.data.source_names import loss_sources, source_key
from anyfit.evaluation.evaluate import generation_eval
from anyfit.runfolder import write_generations
from anyfit.training.parts import Parts

GEN_FIELDS = ("accuracy", "format_rate", "fallback_rate", "mean_completion_tokens", "tokens_per_second", "n")


@torch.no_grad()
def validation_loss(parts: Parts, examples: list[dict], micro_batch: int, *, collate=None, loss_fn=None) -> float:
    """Mean token loss over every trainable token of ``examples`` (``validation_losses``)."""
    return validation_losses(parts, examples, micro_batch, collate=collate, loss_fn=loss_fn)[0]


@torch.no_grad()
def validation_losses(parts: Parts, examples: list[dict], micro_batch: int, sources: int = 0, *, collate=None,
                      loss_fn=None) -> tuple[float, list[float | None]]:
    """Mean token loss over every trainable token of ``examples`` (by ``loss_fn``, the run's token loss unless
    given; batches by ``collate``, the run's unless given), split over the data-parallel groups, and with
    ``sources`` (examples of ``data.mix``, each knowing its source) the mean over each source's tokens (None for a
    source without one). A sharded model needs every process in every forward (weights are gathered layer by
    layer), so there each process runs all examples; a sequence-parallel group runs the same examples, each
    process its part of them (``loss_fn`` is the split one), and one process per group counts the tokens. The sums
    over all processes then hold every example as often as every token count does."""
    backend, accelerator, model, split = parts.backend, parts.accelerator, parts.model, parts.split
    collate_fn, loss_fn = collate or parts.collate, loss_fn or parts.loss_fn
    mine = examples if backend.sharded else examples[split.data_rank::split.data_size]
    mine = sorted(mine, key=lambda e: -len(e["input_ids"]))  # similar lengths together: less padding
    totals = torch.zeros(2 + 2 * sources, device=accelerator.device)  # loss, tokens; per source: losses, tokens
    was_training = model.training
    model.eval()  # no dropout: the number does not depend on the RNG, and the RNG is not consumed
    try:
        starts = range(0, len(mine), micro_batch)
        for i in tqdm(starts, desc="validation", leave=False, disable=not accelerator.is_main_process or len(starts) < 20):
            batch = to_device(collate_fn(mine[i:i + micro_batch]), accelerator.device)
            loss = loss_fn(model, batch).float()
            totals[0] += loss.sum()
            if loss.ndim:  # one sum per source
                totals[2:2 + sources] += loss
            if split.counts():
                totals[1] += batch["keep_targets"].numel()
                if "keep_source" in batch:
                    totals[2 + sources:] += torch.bincount(batch["keep_source"], minlength=sources)
    finally:
        model.train(was_training)
        backend.after_eval(model)
    totals = accelerator.reduce(totals, reduction="sum")
    mean = (totals[0] / totals[1].clamp(min=1)).item()
    sums, counts = totals[2:2 + sources].tolist(), totals[2 + sources:].tolist()
    return mean, [total / n if n else None for total, n in zip(sums, counts)]


class InTrainingEval:
    """When and what to evaluate during a run (``eval.*``); ``run`` returns the record to log, or None."""

    def __init__(self, parts: Parts, watch=None):
        self.parts, self.cfg, self.data = parts, parts.cfg, parts.data
        self.watch = watch  # train.watch_base: a training.forgetting.BaseWatch measuring base_kl, or None

    def due(self, done: int, steps: int) -> tuple[bool, bool]:
        """(validation loss, generation) due after ``done`` of ``steps`` steps; step 0 is the 'before' check."""
        e = self.cfg.eval
        if done == 0:
            return e.every > 0 and e.generate_before, e.generate_before
        loss = bool(e.every) and (done % e.every == 0 or done == steps)
        generate = bool(e.generate_every and done % e.generate_every == 0) or (e.generate_at_end and done == steps)
        return loss, generate

    def run(self, done: int, micro_batch: int, loss: bool, generate: bool) -> dict[str, Any] | None:
        """Validation loss (all processes) and generation accuracy (main process; the others wait)."""
        record: dict[str, Any] = {"step": done}
        accelerator = self.parts.accelerator
        if loss and self.data.eval_examples:
            names = loss_sources(self.data.eval_examples)  # data.mix with eval.holdout: per source too
            mean, per_source = validation_losses(self.parts, self.data.eval_examples, micro_batch, len(names))
            record["val_loss"] = round(mean, 6)
            record.update({source_key("val_loss", name): round(v, 6) for name, v in zip(names, per_source)
                           if v is not None})
        if loss and self.watch is not None:  # drift from the base model (training.forgetting), beside val_loss
            kl = self.watch.measure(self.parts, micro_batch)
            record["base_kl"] = float(f"{kl:.6g}")  # significant digits: it starts at 0
        if generate and self.data.gen_examples:
            if accelerator.is_main_process:
                rows, summary = generation_eval(unwrapped(self.parts.model), self.parts.tokenizer,
                                                self.data.gen_examples, self.cfg, self.parts.images)
                record.update({f"gen_{k}": summary[k] for k in GEN_FIELDS})
                examples = {ex.index: ex for ex in self.data.gen_examples}
                write_generations(Path(self.cfg.train.output_dir),
                                  [example_answer(done, row, examples[row["index"]]) for row in rows[:EXAMPLES_KEPT]])
            accelerator.wait_for_everyone()
        return record if len(record) > 1 else None


EXAMPLES_KEPT = 3  # example answers kept per generation evaluation, for the run's report (runfolder.GENERATIONS)
THUMBNAILS_KEPT = 3  # images of one example answer shown in the report, as small thumbnails


def example_answer(step: int, row: dict[str, Any], example: Example | None = None) -> dict[str, Any]:
    """One line of ``generations.jsonl``: what the report shows of a graded answer; for an image record
    (``example``'s prompt images, ``row["images"]``), the first few images as thumbnails (PNG data URIs, at most
    160 pixels a side), so the report needs no image file."""
    kept = {"step": step, "index": row["index"], "prompt": row["prompt"], "gold": row["gold"],
            "answer": row["extracted"], "completion": row["completion"], "correct": bool(row["correct"]),
            "answer_form": row["how"]}
    if example is not None and row.get("images"):
        shown = example.images[:min(len(row["images"]), THUMBNAILS_KEPT)]
        kept["images"] = [thumbnail_uri(ref, f"{example.place}: image {k + 1}") for k, ref in enumerate(shown)]
    return kept

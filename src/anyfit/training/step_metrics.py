"""The per-step record as a loop feature: tokens, FLOPs and each data source's loss added up on the device every
step (``training.metrics.StepMeter``), the progress bar, the metrics line on logged steps; at the end, the count of
skipped updates."""

from __future__ import annotations

from tqdm.auto import tqdm

from anyfit.data.source_names import loss_sources
from anyfit.model.moe import router_balance_of
from anyfit.training.hooks import Hook, Loop, RunEnd, StepDone
from anyfit.training.metrics import StepMeter


class StepMetrics(Hook):
    """``metrics.jsonl``'s step lines and the progress bar."""

    def __init__(self, loop: Loop):
        super().__init__(loop)
        run = loop.run
        acc = run.parts.accelerator
        self.sources = loss_sources(run.parts.data.examples)  # data.mix: each source's loss is logged as well
        self.meter = StepMeter(acc.device, run.peak.flops_per_s if run.peak else 0.0,
                               router=router_balance_of(run.state.model), sources=self.sources)
        self.bar = tqdm(total=run.steps, initial=run.start, disable=not acc.is_main_process, desc="train",
                        dynamic_ncols=True)

    def after_step(self, step: StepDone) -> None:
        run, window = self.loop.run, step.window
        parts, sampler = run.parts, run.stream.batches.sampler
        # a sequence-parallel group shares its examples: one of its processes counts their tokens and FLOPs
        counts = parts.split.counts()
        real = counts * sum(len(parts.data.examples[i]["input_ids"]) for idx in window.indices for i in idx)
        flops = run.flops.of_window(sampler.lengths, sampler.trainable, window.indices) if run.flops and counts else 0.0
        by_source = ((window.by_source, parts.data.examples.trained_by_source(sampler.examples_of(step.done - 1)))
                     if self.sources else None)  # data.mix, data.source_column: each source's sum and tokens
        self.meter.add(window.loss_sum, step.finite, window.trainable_tokens, real_tokens=real, flops=flops,
                       by_source=by_source)
        self.bar.update(1)
        if not step.log_now:
            return
        record = self.meter.line(parts.accelerator, parts.policy.device, step=step.done,
                                 lr=float(run.state.scheduler.get_last_lr()[0]),
                                 grad_norm=round(float(step.grad_norm), 6),
                                 epoch=round((step.done - 1) / sampler.steps_per_epoch, 4),
                                 skipped_steps=self.loop.guard.skipped, micro_batch=run.stream.plan.micro_batch)
        self.loop.log.write(record)
        self.loop.result.losses.append(record["loss"])
        self.bar.set_postfix(loss=f"{record['loss']:.4f}", tok_s=f"{record['tokens_per_s']:.0f}",
                             **({"mfu": f"{record['mfu']:.1%}"} if "mfu" in record else {}))

    def at_end(self, end: RunEnd) -> None:
        self.bar.close()
        guard = self.loop.guard
        guard.flush()
        self.loop.result.skipped_steps = guard.skipped
        if guard.skipped:
            self.loop.run.parts.say(f"[anyfit] {guard.skipped} update(s) were skipped for a non-finite loss or "
                                    "gradient.")

"""Sizing the micro-batch to the machine: a measured probe at start, and halving on out-of-memory.

The effective batch never changes: only the split into micro-batch x accumulation does, and the loss is
normalised over the whole window, so a different split gives the same update. The candidate sizes come
from ``anyfit.data.batching.micro_batch_candidates``, the rule ``anyfit plan`` uses too.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch
from torch.profiler import record_function

from anyfit.config import ConfigError
from anyfit.data.batching import BatchPlan, StepStream, choose_micro_batch, example_lengths, to_device
from anyfit.hardware.memory import budget_bytes, is_oom, peak_bytes, release_cached, reset_peak
from anyfit.training.parts import Parts
from anyfit.units import GIB
from anyfit.training.step import backward_window


def probe_micro_batch(examples, plan: BatchPlan, budget: int, measure, echo=print, agree=None) -> int:
    """The largest micro-batch (``choose_micro_batch``) whose peak ``measure(micro)`` (bytes, None for out of
    memory: ``measured_peak``'s, or a test's stand-in) stays under ``budget``, longest sequences first.
    ``agree(peak)`` turns this process's peak into the one all processes use."""
    longest = int(example_lengths(examples).max())

    def peak(micro: int) -> int | None:
        if micro > len(examples):  # the same on every process: no agreement needed to stop here
            return None
        found = measure(micro)
        if agree is not None:
            found = agree(found)
        gib = f"{found / GIB:.2f} GiB" if found is not None else "out of memory"
        echo(f"[anyfit] micro_batch probe: {micro} x {longest} tokens -> {gib} (budget {budget / GIB:.2f} GiB)")
        return found

    return choose_micro_batch(plan.per_process, peak, budget) or 1


def measured_peak(parts: Parts, optimizer_bytes: int):
    """``micro -> peak bytes`` of one forward and backward of the ``micro`` longest examples (None: out of memory),
    counting the optimizer state the first step will allocate."""
    examples, device = parts.data.examples, parts.policy.device
    longest = np.argsort(-example_lengths(examples), kind="stable").tolist()  # longest first; ties in example order

    def measure(micro: int) -> int | None:
        batch = to_device(parts.collate([examples[i] for i in longest[:micro]]), device)
        reset_peak(device)
        try:
            parts.train_loss(parts.model, batch).sum().backward()  # the sum: a data.mix loss is one per source
            peak = peak_bytes(device) + optimizer_bytes
        except Exception as e:  # noqa: BLE001 - only out-of-memory is expected here
            if not is_oom(e):
                raise
            peak = None
        parts.model.zero_grad(set_to_none=True)
        del batch
        release_cached(device)
        return peak

    return measure


def auto_micro_batch(parts: Parts, plan: BatchPlan) -> BatchPlan:
    """``train.micro_batch=auto``: measured, not guessed, on every process; all take the smallest choice.

    No gradient reduction during the probe, and the RNG is left as it was (resume stays exact). A sharded
    model gathers weights in every forward (a collective), so its processes probe in lockstep: each candidate
    is judged by the largest peak of all processes, and each holds 1/N of the optimizer state. The forward of a
    sequence-parallel run is collective for another reason (its all-to-all), judged the same way.
    """
    backend, accelerator, device = parts.backend, parts.accelerator, parts.policy.device
    lockstep = parts.split.active or backend.sharded
    optimizer_bytes = 8 * parts.loaded.trainable // (accelerator.num_processes if backend.sharded else 1)
    rng_devices = [torch.cuda.current_device()] if device == "cuda" else []
    with backend.no_sync(accelerator, parts.model), torch.random.fork_rng(devices=rng_devices):
        micro = probe_micro_batch(parts.data.examples, plan, budget_bytes(device, parts.cfg.runtime.memory_fraction),
                                  measured_peak(parts, optimizer_bytes), echo=parts.say,
                                  agree=(lambda peak: _largest_of_all(accelerator, peak)) if lockstep else None)
    micro = int(accelerator.gather(torch.tensor([micro], device=accelerator.device)).min())
    plan = plan.with_micro_batch(micro)
    parts.say(f"[anyfit] micro_batch=auto chose {micro}: {plan.describe()}")
    return plan


def _largest_of_all(accelerator, peak: int | None) -> int | None:
    """The largest peak over the processes (out of memory anywhere counts as out of memory)."""
    value = torch.tensor([float("inf") if peak is None else float(peak)], device=accelerator.device)
    largest = float(accelerator.gather(value).max())
    return None if largest == float("inf") else int(largest)


def halve_micro_batch(plan: BatchPlan, processes: int, error: BaseException) -> BatchPlan:
    """After an out-of-memory error: the largest valid micro-batch at most half the current one, same
    effective batch. Refused with several processes (the others would wait forever in the gradient
    all-reduce) and at micro-batch 1 (nothing left to halve)."""
    if processes > 1:
        raise ConfigError(f"Out of memory with micro-batch {plan.micro_batch} in a {processes}-process run ({error}). "
                          "Set a smaller train.micro_batch (or train.micro_batch=auto), or enable "
                          "model.gradient_checkpointing=true.") from error
    smaller = [m for m in plan.candidates() if m <= plan.micro_batch // 2]
    if not smaller:
        raise ConfigError("Out of memory even with micro-batch 1: enable model.gradient_checkpointing=true, use "
                          "LoRA (lora.enabled=true), lower data.max_length, or run on a device with more memory "
                          "(see 'anyfit plan').") from error
    return plan.with_micro_batch(max(smaller))


@dataclass(frozen=True)
class Window:
    """One step's accumulation window, its forward and backward done (``backward_with_retry``)."""

    loss_sum: torch.Tensor  # this process's summed token loss (detached, on the device)
    indices: list[list[int]]  # the examples of each of this process's micro-batches
    trainable_tokens: int  # trainable tokens of the whole window, all processes (what the loss is divided by)
    by_source: torch.Tensor | None = None  # data.mix: this process's summed token loss per source


def backward_with_retry(parts: Parts, optimizer, stream: StepStream, step: int) -> Window:
    """``backward_window`` over the step's window (``parts.train_loss``); after an out-of-memory error the partial
    window is dropped and the step is redone whole with half the micro-batch."""
    backend, accelerator, model = parts.backend, parts.accelerator, parts.model
    while True:
        with record_function("anyfit.data_wait"):  # the phases anyfit.profiling reads from a trace
            indices, window_tokens, cpu_batches = stream.get(step)
        with record_function("anyfit.h2d"):
            batches = [to_device(b, accelerator.device, non_blocking=True) for b in cpu_batches]
        try:
            sums = backward_window(backend, accelerator, model, batches, window_tokens, parts.train_loss)
            return Window(loss_sum=sums.sum(), indices=indices, trainable_tokens=window_tokens,
                          by_source=sums if sums.ndim else None)
        except Exception as e:  # noqa: BLE001 - only out-of-memory is handled
            if not is_oom(e) or not backend.redo_after_oom:
                raise
            del batches
            optimizer.zero_grad(set_to_none=True)
            release_cached(parts.policy.device)
            plan = halve_micro_batch(stream.batches.sampler.plan, accelerator.num_processes, e)
            stream.replan(plan)
            parts.say(f"[anyfit] out of memory at step {step + 1}: retrying the step with {plan.describe()}")

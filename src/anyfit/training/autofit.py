"""Sizing the micro-batch to the machine: a measured probe at start, and halving on out-of-memory.

The effective batch never changes: only the split into micro-batch x accumulation does, and the loss is
normalised over the whole window, so a different split gives the same update.
"""

from __future__ import annotations

import gc
import resource
import sys

import torch

from anyfit.data.batching import BatchPlan, to_device


def is_oom(error: BaseException) -> bool:
    """CUDA raises torch.OutOfMemoryError; MPS and CPU allocators raise RuntimeError with a message."""
    if isinstance(error, torch.OutOfMemoryError):
        return True
    text = str(error).lower()
    return isinstance(error, RuntimeError) and ("out of memory" in text or "failed to allocate" in text
                                                or "can't allocate memory" in text)


def free_memory(device: str) -> None:
    gc.collect()
    if device == "cuda":
        torch.cuda.empty_cache()
    elif device == "mps":
        torch.mps.empty_cache()


def memory_budget_bytes(device: str, fraction: float) -> int:
    """How much the run may use: a fraction of the device total (host RAM available on CPU)."""
    if device == "cuda":
        return int(torch.cuda.mem_get_info()[1] * fraction)
    if device == "mps":
        return int(torch.mps.recommended_max_memory() * fraction)
    import psutil

    return int((psutil.virtual_memory().available + _rss_now()) * fraction)


def _rss_now() -> int:
    import psutil

    return psutil.Process().memory_info().rss


def _peak_bytes(device: str) -> int:
    if device == "cuda":
        return torch.cuda.max_memory_allocated()
    if device == "mps":
        return torch.mps.driver_allocated_memory()
    rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss  # a high-water mark: probes go small to large
    return rss if sys.platform == "darwin" else rss * 1024


def probe_micro_batch(model, examples: list[dict], plan: BatchPlan, collate_fn, loss_fn, device: str,
                      fraction: float, optimizer_bytes: int, echo=print) -> int:
    """The largest micro-batch (a divisor of the per-process share) whose forward+backward on the longest
    sequences stays under the budget, counting the optimizer state that the first step will allocate."""
    budget = memory_budget_bytes(device, fraction)
    longest = sorted(range(len(examples)), key=lambda i: -len(examples[i]["input_ids"]))
    chosen = 1
    for micro in plan.candidates():
        if micro > len(examples):
            break
        batch = to_device(collate_fn([examples[i] for i in longest[:micro]]), device)
        if device == "cuda":
            torch.cuda.reset_peak_memory_stats()
        try:
            loss_fn(model, batch).backward()
            peak = _peak_bytes(device) + optimizer_bytes
        except Exception as e:  # noqa: BLE001 - only out-of-memory is expected here
            if not is_oom(e):
                raise
            peak = None
        model.zero_grad(set_to_none=True)
        del batch
        free_memory(device)
        gib = f"{peak / 2**30:.2f} GiB" if peak is not None else "out of memory"
        echo(f"[anyfit] micro_batch probe: {micro} x {len(examples[longest[0]]['input_ids'])} tokens -> {gib} "
             f"(budget {budget / 2**30:.2f} GiB)")
        if peak is None or peak > budget:
            break
        chosen = micro
    return chosen


def halve_micro_batch(plan: BatchPlan, processes: int, error: BaseException) -> BatchPlan:
    """After an out-of-memory error: the largest valid micro-batch at most half the current one, same
    effective batch. Refused with several processes (the others would wait forever in the gradient
    all-reduce) and at micro-batch 1 (nothing left to halve)."""
    from anyfit.config import ConfigError

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

"""One optimizer step's pieces: the accumulation window's forward/backward, and the update guarded
against non-finite losses and gradients. Each is a small function with its own tests; the loop in
``anyfit.training.loop`` only calls them in order."""

from __future__ import annotations

import torch
from torch.profiler import record_function

from anyfit.training import deepspeed_engine
from anyfit.training.deepspeed_engine import is_deepspeed
from anyfit.training.loss import token_loss_sum
from anyfit.training.sharding import gradient_sync, is_sharded


def backward_window(accelerator, model, micro_batches: list[dict[str, torch.Tensor]], window_tokens: int,
                    loss_fn=token_loss_sum, reduce_every: bool = False) -> torch.Tensor:
    """Forward and backward over one accumulation window; returns this process's summed token loss (detached).

    Each micro-batch's summed loss is divided by the trainable tokens of the *global* window and
    multiplied by the process count (DDP averages gradients over processes), so the accumulated gradient
    is d(mean token loss over the window) whatever the split into micro-batches and processes (FSDP's
    reduce-scatter averages over processes as DDP's all-reduce does).

    ``reduce_every`` (runtime.fsdp_reduce_every_micro_batch; sharded models only): reduce-scatter after every
    micro-batch, FSDP2 adding each reduced shard into the sharded gradient, so no unsharded gradient outlives
    its micro-batch. The sum is the same up to fp32 round-off (the mean over processes is linear).
    """
    scale = accelerator.num_processes / max(1, window_tokens)
    total = torch.zeros((), device=accelerator.device)
    zero3 = is_deepspeed(model)  # ZeRO-3 reduce-scatters in every backward; its window ends at step()
    every = zero3 or reduce_every and is_sharded(model)  # replicated (DDP) gradients are whole either way
    for i, batch in enumerate(micro_batches):
        # Reduce gradients on the last micro-step only: before it they just accumulate locally.
        with gradient_sync(accelerator, model, sync=every or i == len(micro_batches) - 1):
            with record_function("anyfit.forward"):  # the phases anyfit.profiling reads from a trace
                loss_sum = loss_fn(model, batch)
            with record_function("anyfit.backward"):
                if zero3:
                    deepspeed_engine.backward(model, loss_sum * scale)
                else:
                    accelerator.backward(loss_sum * scale)
        total += loss_sum.detach()
    return total


def clip_gradients(accelerator, model, max_norm: float) -> torch.Tensor:
    """Clip the global gradient norm (over all processes' shards when sharded); returns the norm before clipping."""
    norm = accelerator.clip_grad_norm_(model.parameters(), max_norm)
    full_tensor = getattr(norm, "full_tensor", None)  # a DTensor under FSDP2: the same value on every process
    return full_tensor() if full_tensor is not None else norm


def is_finite_step(loss_sum: torch.Tensor, grad_norm: torch.Tensor, precision: str) -> torch.Tensor:
    """Whether the update may be applied (a device flag). Under fp16 a non-finite gradient is the loss
    scaler's business (it skips the step and lowers the scale), not a failure of the run."""
    if precision == "fp16":
        return torch.isfinite(loss_sum)
    return torch.isfinite(loss_sum) & torch.isfinite(grad_norm)


def skips_on_device(optimizer, precision: str) -> bool:
    """Whether ``guarded_step`` can skip on the device: the optimizer is fused and no GradScaler owns the
    ``found_inf`` protocol already (fp16)."""
    inner = getattr(optimizer, "optimizer", optimizer)  # Accelerate's AcceleratedOptimizer wraps the torch one
    return precision != "fp16" and bool(inner.defaults.get("fused"))


def guarded_step(optimizer, finite: torch.Tensor, on_device: bool) -> torch.Tensor | bool:
    """Apply the update unless ``finite`` is false; returns the flag (still on the device when ``on_device``).

    ``on_device``: torch's fused AdamW reads a ``found_inf`` tensor set on the optimizer (the protocol torch's
    GradScaler uses with fused optimizers) and skips the update, step count included, inside its kernel, so
    the host never waits for the GPU to learn whether the step was finite. Otherwise the flag is read here
    (a host sync) and a non-finite step is not taken.
    """
    if on_device:
        inner = getattr(optimizer, "optimizer", optimizer)
        inner.found_inf = (~finite).float()
        try:
            optimizer.step()
        finally:
            del inner.found_inf
        return finite
    finite = bool(finite)
    if finite:
        optimizer.step()
    return finite

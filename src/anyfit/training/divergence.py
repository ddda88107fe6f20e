"""Non-finite losses and gradients: skip the update, count, and stop with a diagnosis if it persists."""

from __future__ import annotations

import torch

from anyfit.config import Config
from anyfit.hardware.runtime import RuntimePolicy


class TrainingDiverged(RuntimeError):
    """Too many non-finite steps in a row; the message says what probably caused it and what to change."""


class NonFiniteGuard:
    """Counts skipped updates (``skipped`` starts from a resumed run's count)."""

    def __init__(self, limit: int, skipped: int = 0):
        self.limit = limit
        self.in_a_row = 0
        self.skipped = skipped
        self._pending: list[torch.Tensor] = []

    def add(self, finite: torch.Tensor | bool) -> None:
        """A step's flag: a device tensor (the step was already skipped on the device) is read at the next
        ``flush``; a host bool is counted now."""
        if isinstance(finite, torch.Tensor):
            self._pending.append(finite)
        else:
            self.record(finite)

    def flush(self) -> None:
        """Read the deferred flags (one device-to-host copy for all of them) in step order."""
        if self._pending:
            flags = torch.stack(self._pending).tolist()
            self._pending.clear()
            for finite in flags:
                self.record(finite)

    def record(self, finite: bool) -> None:
        if finite:
            self.in_a_row = 0
            return
        self.in_a_row += 1
        self.skipped += 1

    @property
    def exhausted(self) -> bool:
        return self.in_a_row >= self.limit


def diagnosis(cfg: Config, policy: RuntimePolicy, step: int, last_checkpoint: str | None) -> str:
    """What went wrong, the likely cause on this device/precision, and what to change."""
    causes = []
    if policy.device == "mps" and policy.precision != "fp32":
        causes.append(f"{policy.precision} on MPS has no loss scaling and overflows: set runtime.precision=fp32")
    if policy.precision == "fp16":
        causes.append("fp16 overflows in activations of some models even with loss scaling: use bf16 on Ampere+ "
                      "GPUs, or fp32 (runtime.precision=fp32)")
    lr = cfg.train.learning_rate
    if lr > (1e-3 if cfg.lora.enabled else 1e-4):
        causes.append(f"the learning rate {lr:g} is high for {'LoRA' if cfg.lora.enabled else 'full fine-tuning'}: "
                      f"try {lr / 10:g}, with warmup (train.warmup_ratio=0.03)")
    if cfg.train.max_grad_norm <= 0:
        causes.append("gradient clipping is off: set train.max_grad_norm=1.0")
    if not causes:
        causes.append("bad data (an example with only padding or extreme lengths) or a numerically unstable model: "
                      "inspect the data with 'anyfit render', lower train.learning_rate")
    where = (f"The last good checkpoint is {last_checkpoint} (resume with train.resume=auto after changing the config)."
             if last_checkpoint else "No checkpoint was written before it happened.")
    return (f"{cfg.train.max_nonfinite_steps} optimizer steps in a row ended with a non-finite loss or gradient "
            f"(last at step {step}; each was skipped). Device {policy.device}, precision {policy.precision}, "
            f"learning rate {lr:g}. Likely cause: " + "; ".join(causes) + ". " + where)

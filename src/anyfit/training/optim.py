"""The optimizer (``train.optimizer``) with decoupled weight decay on matrices only, and the learning-rate schedules.

- ``adamw``: torch's AdamW, fused wherever torch has the kernel (CUDA, MPS, CPU);
- ``adamw_8bit`` / ``paged_adamw_8bit``: bitsandbytes' block-wise 8-bit states (2 bytes per parameter for both
  moments instead of 8), CUDA only; the paged one lets the driver move states to host memory under pressure.
  Under FSDP2 ``adamw_8bit`` is torchao's ``AdamW8bit`` instead, on any device: bitsandbytes quantizes whole
  tensors and has no notion of a sharded (DTensor) parameter, where torchao's 8-bit states are tensor subclasses
  that FSDP2 and torch.distributed.checkpoint shard like any state (the pairing torchtune and torchtitan use);
- ``adafactor``: torch's Adafactor, factored second moments and no first moment: a small fraction of AdamW's
  state, on every device.
"""

from __future__ import annotations

import importlib.util
import math

import torch

from anyfit.config import ConfigError, TrainConfig
from anyfit.hardware.runtime import EIGHT_BIT_OPTIMIZERS


def check_optimizer(name: str, device: str, sharded: bool = False) -> None:
    """Refuse, before any heavy work, an optimizer that cannot run on the device (``sharded``: under FSDP2)."""
    if name == "adamw_8bit" and sharded:
        if importlib.util.find_spec("torchao") is None:
            raise ConfigError("train.optimizer=adamw_8bit with runtime.sharding=fsdp uses torchao's 8-bit AdamW, "
                              "which is not installed: pip install 'torchao>=0.18' (or anyfit[cuda]), or use "
                              "train.optimizer=adamw.")
        return
    if name in EIGHT_BIT_OPTIMIZERS and device != "cuda":
        raise ConfigError(f"train.optimizer={name} needs CUDA (bitsandbytes' 8-bit kernels), but the device is "
                          f"{device}. Use train.optimizer=adafactor for a small optimizer state here, or adamw.")


def build_optimizer(model: torch.nn.Module, cfg: TrainConfig, device: str, fused: bool,
                    sharded: bool = False) -> torch.optim.Optimizer:
    """``sharded``: the parameters are FSDP2's DTensors (picks the 8-bit AdamW that updates them)."""
    check_optimizer(cfg.optimizer, device, sharded)
    params = [p for p in model.parameters() if p.requires_grad]
    # Biases and norm weights (1-D) are not decayed: decaying them only hurts (the usual GPT practice).
    groups = [{"params": [p for p in params if p.ndim >= 2], "weight_decay": cfg.weight_decay},
              {"params": [p for p in params if p.ndim < 2], "weight_decay": 0.0}]
    groups = [g for g in groups if g["params"]]
    if cfg.optimizer == "adafactor":
        # torch's defaults (relative step decay -0.8, eps (None, 1e-3)); lr is the configured peak.
        return torch.optim.Adafactor(groups, lr=cfg.learning_rate)
    if cfg.optimizer == "adamw_8bit" and sharded:
        return _torchao_adamw_8bit(device)(groups, lr=cfg.learning_rate, betas=(cfg.adam_beta1, cfg.adam_beta2),
                                           eps=cfg.adam_eps)
    if cfg.optimizer in EIGHT_BIT_OPTIMIZERS:
        import bitsandbytes as bnb

        cls = bnb.optim.PagedAdamW8bit if cfg.optimizer == "paged_adamw_8bit" else bnb.optim.AdamW8bit
        return cls(groups, lr=cfg.learning_rate, betas=(cfg.adam_beta1, cfg.adam_beta2), eps=cfg.adam_eps)
    # Fused AdamW: one kernel over all parameters on CUDA and MPS, on CPU several times faster than the default
    # foreach implementation (BENCHMARKS.md, 'The kernels behind two defaults'). It also lets the loop skip a
    # non-finite update without a host sync.
    return torch.optim.AdamW(groups, lr=cfg.learning_rate, betas=(cfg.adam_beta1, cfg.adam_beta2), eps=cfg.adam_eps,
                             fused=fused or None)


def _torchao_adamw_8bit(device: str) -> type[torch.optim.Optimizer]:
    """torchao's AdamW8bit (block-wise signed/unsigned 8-bit moments, 256 values per fp32 scale, the update in fp32).
    Its step compiles one kernel per parameter shape: on CUDA that is its design (Triton); elsewhere it runs
    eagerly, as the same operations (compiling there needs a C++ toolchain and minutes for a step that only CPU
    test processes take)."""
    from torchao.optim import AdamW8bit

    if device == "cuda":
        return AdamW8bit

    class EagerAdamW8bit(AdamW8bit):
        def step(self, closure=None):
            with torch.compiler.set_stance("force_eager"):
                return super().step(closure)

    return EagerAdamW8bit


def lr_factor(step: int, total: int, warmup: int, schedule: str, min_ratio: float) -> float:
    """Multiplier of the peak learning rate for the update made at ``step`` (0-based)."""
    if warmup and step < warmup:
        return (step + 1) / warmup
    if schedule == "constant":
        return 1.0
    progress = min(1.0, (step - warmup) / max(1, total - warmup))
    if schedule == "linear":
        shape = 1.0 - progress
    else:
        shape = 0.5 * (1.0 + math.cos(math.pi * progress))
    return min_ratio + (1.0 - min_ratio) * shape


def build_scheduler(optimizer: torch.optim.Optimizer, cfg: TrainConfig, total_steps: int):
    warmup = cfg.warmup_steps or int(cfg.warmup_ratio * total_steps)
    return torch.optim.lr_scheduler.LambdaLR(
        optimizer, lambda s: lr_factor(s, total_steps, warmup, cfg.lr_schedule, cfg.min_lr_ratio))

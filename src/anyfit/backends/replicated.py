"""Every process holds the whole model and optimizer; gradients are averaged over processes by DDP
(Accelerate's ``prepare``). One process is the same with nothing to average."""

from __future__ import annotations

from pathlib import Path

import torch

from anyfit.backends import fsdp
from anyfit.backends.base import Backend
from anyfit.backends.reading import load_weights, torch_load

OPTIMIZER_FILE = "optimizer.pt"  # the optimizer's own state dict, keyed by parameter position


class Replicated(Backend):
    name = "none"
    layout = "replicated"

    def wrap(self, model, optimizer, accelerator, say):
        return accelerator.prepare(model, optimizer)

    def sync(self, accelerator, model, last: bool):
        # before the window's last micro-batch gradients only accumulate locally (Accelerate's no_sync)
        return super().sync(accelerator, model, last) if last else accelerator.no_sync(model)

    def save_states(self, accelerator, model, optimizer, folder: Path, save_weights) -> None:
        save_weights()
        if accelerator.is_main_process:
            torch.save(optimizer.state_dict(), folder / OPTIMIZER_FILE)

    def load_states(self, accelerator, model, optimizer, folder: Path) -> None:
        if fsdp.FSDP2.wrote(folder):  # DCP fills whole tensors from the slices of however many processes wrote them
            fsdp.load_sharded(accelerator.unwrap_model(model), getattr(optimizer, "optimizer", optimizer), folder)
            return
        load_weights(accelerator.unwrap_model(model), folder)
        optimizer.load_state_dict(torch_load(folder / OPTIMIZER_FILE, map_location="cpu"))

    @classmethod
    def wrote(cls, folder: Path) -> bool:
        return any(folder.glob("*.safetensors"))

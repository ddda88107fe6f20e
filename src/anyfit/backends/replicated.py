"""Every process holds the whole model and optimizer; gradients are averaged over processes by DDP
(Accelerate's ``prepare``). One process is the same with nothing to average.

Its checkpoints are an ordinary model folder (``*.safetensors``, only the adapter for LoRA) and ``optimizer.pt``
(the optimizer's own state dict, keyed by parameter position); this module alone reads them, into a replicated
run as written, or into a sharded one: the weights before the model is sharded (``read_whole``, the sharding
backend's ``load``), the optimizer's state after, re-keyed by parameter name (``load_optimizer_by_name``).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

from anyfit.backends.base import Backend, unwrapped
from anyfit.backends.reading import load_weights, torch_load
from anyfit.config import ConfigError

OPTIMIZER_FILE = "optimizer.pt"  # the optimizer's own state dict, keyed by parameter position
WEIGHTS = "the weights (*.safetensors)"


class Replicated(Backend):
    name = "none"
    layout = "replicated"

    def wrap(self, model, optimizer, accelerator, say):
        return accelerator.prepare(model, optimizer)

    def sync(self, accelerator, model, last: bool):
        # before the window's last micro-batch gradients only accumulate locally (Accelerate's no_sync)
        return super().sync(accelerator, model, last) if last else accelerator.no_sync(model)

    def full_state_dict(self, accelerator, model) -> dict[str, torch.Tensor]:
        # Every process holds the whole model and only the main one writes it: the others need no copy.
        return unwrapped(model).state_dict() if accelerator.is_main_process else {}

    def save_states(self, accelerator, model, optimizer, folder: Path, save_weights) -> None:
        save_weights()
        if accelerator.is_main_process:
            torch.save(optimizer.state_dict(), folder / OPTIMIZER_FILE)

    def load_states(self, accelerator, model, optimizer, folder: Path, writer: type[Backend]) -> None:
        writer.read_states(folder, unwrapped(model), optimizer, self)  # the model DDP wraps

    @classmethod
    def wrote(cls, folder: Path) -> bool:
        return any(folder.glob("*.safetensors"))

    @classmethod
    def wrote_files(cls, names: set[str]) -> bool:
        return any(name.endswith(".safetensors") for name in names)

    @classmethod
    def unlisted(cls, names: set[str]) -> list[str]:
        missing = [OPTIMIZER_FILE] if OPTIMIZER_FILE not in names else []
        return missing if cls.wrote_files(names) else [*missing, WEIGHTS]

    @classmethod
    def read_states(cls, folder: Path, model, optimizer, reader: Backend) -> None:
        if reader.sharded:  # the weights went in before the model was sharded (the reader's ``load``)
            load_optimizer_by_name(model, optimizer, folder)
            return
        load_weights(model, folder)
        optimizer.load_state_dict(torch_load(folder / OPTIMIZER_FILE, map_location="cpu"))

    @classmethod
    def read_whole(cls, folder: Path, model) -> None:
        load_weights(model, folder)


def load_optimizer_by_name(model, optimizer, directory: Path) -> None:
    """``optimizer.pt`` into a sharded run (collective): re-keyed by parameter name, then cut to this process's
    slices by ``set_optimizer_state_dict``. Memory-mapped, so the processes of one machine share the file's pages
    instead of each holding a copy."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, set_optimizer_state_dict

    saved = torch_load(directory / OPTIMIZER_FILE, map_location="cpu", mmap=True)
    set_optimizer_state_dict(model, optimizer, optimizer_by_name(model, optimizer, saved, directory),
                             options=StateDictOptions(full_state_dict=True))


def optimizer_by_name(model, optimizer, saved: dict[str, Any], directory: Path) -> dict[str, Any]:
    """A torch optimizer state dict keyed by parameter position turned into one keyed by parameter name (the one
    hand-written step: PyTorch reads only name-keyed full state dicts across layouts). Positions follow the
    parameter groups' order, which ``build_optimizer`` makes the same for every layout (FSDP2 keeps each
    parameter's name and place)."""
    names = {id(p): name for name, p in model.named_parameters()}
    groups = optimizer.param_groups
    shape = [len(g["params"]) for g in groups]
    saved_shape = [len(g["params"]) for g in saved["param_groups"]]
    if shape != saved_shape:
        raise ConfigError(f"checkpoint {directory}: its optimizer.pt holds parameter groups of {saved_shape} "
                          f"parameters, this run's optimizer {shape}; it was written for another model or "
                          "LoRA setting. Resume with the run's own config.yaml, or start again.")
    name_of = {i: names[id(p)] for saved_group, group in zip(saved["param_groups"], groups)
               for i, p in zip(saved_group["params"], group["params"])}
    return {"state": {name_of[i]: state for i, state in saved["state"].items()},
            "param_groups": [{**g, "params": [name_of[i] for i in g["params"]]} for g in saved["param_groups"]]}

"""A checkpoint on any layout: written by N processes, sharded or replicated, resumed by M processes in either
mode (1 <-> 2 <-> 4, FSDP2 <-> DDP, CPU <-> CUDA), continuing the same data order (which never depended on
the process count: ``anyfit.data.batching``).

The two formats a checkpoint's model and optimizer state come in:

- replicated (``runtime.sharding: none``): ``*.safetensors`` (what ``save_pretrained`` writes; only the adapter
  for LoRA) and ``optimizer.pt`` (the optimizer's own state dict, keyed by parameter position);
- sharded (FSDP2): ``sharded/``, every process's slices written by ``torch.distributed.checkpoint`` (DCP),
  keyed by parameter name.

Same mode: each is read back as written (bit-identical continuation; DCP re-cuts shards for another process
count by itself). Across modes, PyTorch's own tools do the moving, nothing here re-cuts a tensor by hand:

- sharded -> replicated: DCP loads into whole tensors as readily as into shards: the unsharded model's and
  optimizer's state dicts by name (``get_state_dict``) are filled from the slices, then set back.
- replicated -> sharded: the weights go into the model before it is sharded (on process 0 alone when the
  others receive their shards from it), read as a replicated resume reads them; ``optimizer.pt`` is re-keyed
  from positions to names (the one hand-written step: PyTorch reads only name-keyed full state dicts across
  layouts) and given to ``set_optimizer_state_dict`` as a full state dict, which keeps each process's slice.

What cannot be continued (a LoRA checkpoint into a full fine-tune or back, another rank or target modules,
another optimizer) is refused in one line by :func:`check_resumable` before any weights load.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import yaml

from anyfit.config import Config, ConfigError
from anyfit.runfolder import RUN_CONFIG, SHARDED_DIR
from anyfit.training.checkpoint_read import load_weights, torch_load
from anyfit.training.deepspeed_engine import saved_deepspeed, saved_processes
from anyfit.training.sharding import load_sharded


def saved_sharded(directory: Path) -> bool:
    """Whether the checkpoint was written by a sharded (FSDP2) run."""
    return (directory / SHARDED_DIR).is_dir()


def check_resumable(directory: Path, cfg: Config, processes: int) -> None:
    """Refuse, in one line and before any work, a checkpoint this run's config cannot continue: the settings
    that decide which tensors exist (full or LoRA, the adapters' rank and targets) and the optimizer's state.
    Everything about layout (processes, sharding, device, precision) may change, but for DeepSpeed ZeRO-3: its
    checkpoints continue under ZeRO-3 on as many processes as wrote them, and it continues only its own."""
    _check_deepspeed_layout(directory, cfg, processes)
    saved = _saved_config(directory)
    if saved is None:  # an older checkpoint without config.yaml: its files are checked when they load
        return
    lora, train = saved.get("lora") or {}, saved.get("train") or {}
    was_lora = bool(lora.get("enabled") or lora.get("qlora"))
    is_lora = cfg.lora.enabled or cfg.lora.qlora
    where = f"train.resume: checkpoint {directory} was written by a run"
    if was_lora != is_lora:
        kind = "training LoRA adapters (it holds the adapter only)" if was_lora else "fine-tuning every weight"
        fix = "lora.enabled=true" if was_lora else "lora.enabled=false"
        raise ConfigError(f"{where} {kind}; this run {'trains LoRA' if is_lora else 'fine-tunes every weight'}. "
                          f"Set {fix} to continue it, or start a new run in another train.output_dir.")
    if is_lora:
        for key, now in (("r", cfg.lora.r), ("target_modules", cfg.lora.target_modules)):
            if key in lora and lora[key] != now:
                raise ConfigError(f"{where} with lora.{key}={lora[key]}; this run has lora.{key}={now}. Set "
                                  f"lora.{key}={lora[key]} to continue it, or start a new run in another "
                                  "train.output_dir.")
    if "optimizer" in train and train["optimizer"] != cfg.train.optimizer:
        raise ConfigError(f"{where} with train.optimizer={train['optimizer']}; its state does not fit "
                          f"train.optimizer={cfg.train.optimizer}. Set train.optimizer={train['optimizer']} to "
                          "continue it, or start a new run in another train.output_dir.")


def _check_deepspeed_layout(directory: Path, cfg: Config, processes: int) -> None:
    where = f"train.resume: checkpoint {directory}"
    if saved_deepspeed(directory):
        wrote = saved_processes(directory)
        if cfg.runtime.sharding != "deepspeed":
            raise ConfigError(f"{where} was written by DeepSpeed ZeRO-3, which alone reads its optimizer states: set "
                              f"runtime.sharding=deepspeed and launch {wrote} process(es) to continue it, or 'anyfit "
                              "export' it for its weights.")
        if wrote != processes:
            raise ConfigError(f"{where} was written by {wrote} DeepSpeed ZeRO-3 process(es); ZeRO-3 continues it on "
                              f"exactly as many, and this run has {processes}. Launch {wrote}.")
    elif cfg.runtime.sharding == "deepspeed":
        layout = "sharded (FSDP2)" if saved_sharded(directory) else "replicated"
        raise ConfigError(f"{where} is {layout}; DeepSpeed ZeRO-3 continues only its own checkpoints. Continue it "
                          "with runtime.sharding=fsdp or none (any process count), or start a new run in another "
                          "train.output_dir.")


def _saved_config(directory: Path) -> dict[str, Any] | None:
    try:
        saved = yaml.safe_load((directory / RUN_CONFIG).read_text())
    except (OSError, UnicodeDecodeError, yaml.YAMLError):
        return None
    return saved if isinstance(saved, dict) else None


def weights_before_sharding(model, directory: Path) -> None:
    """A replicated checkpoint's weights into a model about to be sharded (a model built empty, on a process
    that will receive its shards, is left alone)."""
    if not any(p.is_meta for p in model.parameters()):
        load_weights(model, directory)


def load_sharded_into_replicated(model, optimizer, directory: Path) -> None:
    """A sharded checkpoint into an unsharded run (collective when several processes replicate): DCP fills
    whole tensors from the slices of however many processes wrote them."""
    load_sharded(model, getattr(optimizer, "optimizer", optimizer), directory)


def load_replicated_optimizer_into_sharded(model, optimizer, directory: Path) -> None:
    """``optimizer.pt`` of a replicated run into a sharded one (collective): re-keyed by parameter name, then
    cut to this process's slices by ``set_optimizer_state_dict``. Memory-mapped, so the processes of one
    machine share the file's pages instead of each holding a copy."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, set_optimizer_state_dict

    saved = torch_load(directory / "optimizer.pt", map_location="cpu", mmap=True)
    set_optimizer_state_dict(model, optimizer, optimizer_by_name(model, optimizer, saved, directory),
                             options=StateDictOptions(full_state_dict=True))


def optimizer_by_name(model, optimizer, saved: dict[str, Any], directory: Path) -> dict[str, Any]:
    """A torch optimizer state dict keyed by parameter position turned into one keyed by parameter name.
    Positions follow the parameter groups' order, which ``build_optimizer`` makes the same for every layout
    (FSDP2 keeps each parameter's name and place)."""
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

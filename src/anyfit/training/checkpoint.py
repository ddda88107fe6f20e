"""Checkpoints and the final model: writing them, and restoring a run from one.

A checkpoint is ``checkpoint-<step>/`` holding the model (safetensors; only the adapter for LoRA) and the
optimizer state (for a sharded run instead: every process's shards of both, written with
``torch.distributed.checkpoint`` under ``sharded/``), the scheduler state, each process's RNG state,
``trainer_state.json``, the resolved ``config.yaml`` and, written last, ``manifest.json``
(``anyfit.training.integrity``). The folder is written under a temporary name and renamed when complete, so a
crash mid-write never leaves a folder that looks like a finished checkpoint.
"""

from __future__ import annotations

import json
import random
import shutil
from pathlib import Path
from typing import Any

import numpy as np
import torch

from anyfit.model.source import record_base
from anyfit.data.stopping import write_generation_config
from anyfit.runfolder import (
    CHECKPOINT_PREFIX,
    RUN_CONFIG,
    TMP_CHECKPOINT_PREFIX,
    checkpoint_dirs,
    checkpoint_step,
    follow_umask,
)
from anyfit.training import deepspeed_engine
from anyfit.training.checkpoint_read import damaged, load_weights, torch_load
from anyfit.training.deepspeed_engine import is_deepspeed
from anyfit.training.integrity import STATE, checkpoint_problem, write_manifest
from anyfit.training.relayout import (
    load_replicated_optimizer_into_sharded,
    load_sharded_into_replicated,
    saved_sharded,
)
from anyfit.training.sharding import full_state_dict, is_sharded, load_sharded, save_sharded
from anyfit.training.storage import (
    agreed,
    bytes_to_write,
    is_write_error,
    not_written,
    remove_partial,
    room_problem,
    write_failure,
)


def rng_state() -> dict[str, Any]:
    state = {"python": random.getstate(), "numpy": np.random.get_state(), "torch": torch.get_rng_state()}
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def save_model(accelerator, model, tokenizer, directory: Path, model_cfg=None) -> list[str]:
    """The trainable weights as safetensors (LoRA: the adapter only), plus the tokenizer. Main process writes;
    every process must call this because gathering a sharded (FSDP/DeepSpeed) state dict is collective.

    With ``model_cfg`` (the run's ModelConfig), an adapter records a base others can load (see
    :func:`portable_base`) instead of the path the weights happened to be read from. A whole model's
    generation_config.json stops at the chat template's end of turn; returns those stop tokens (main process,
    whole model with its tokenizer; else [])."""
    stops: list[str] = []
    if is_deepspeed(model):
        state_dict = deepspeed_engine.full_state_dict(model, accelerator.is_main_process)
    else:
        state_dict = full_state_dict(model) if is_sharded(model) else accelerator.get_state_dict(model)
    if accelerator.is_main_process:
        unwrapped = accelerator.unwrap_model(model)
        unwrapped.save_pretrained(directory, state_dict=state_dict, safe_serialization=True)
        adapter = (directory / "adapter_config.json").is_file()
        if tokenizer is not None:
            tokenizer.save_pretrained(directory)
            if not adapter:  # an adapter is loaded on its base, with the base's generation config
                stops = write_generation_config(directory, unwrapped, tokenizer)
        if model_cfg is not None and adapter:
            record_base(directory, model_cfg)
        follow_umask(directory)
    return stops


def save_checkpoint(accelerator, output_dir: Path, step: int, model, optimizer, scheduler, tokenizer,
                    config_yaml: str, trainer_state: dict[str, Any], keep_last: int, model_cfg=None) -> Path:
    """Write ``checkpoint-<step>`` (collective). Raises ``NotWritten`` on every process alike when the disk has no
    room for it or a write fails: the temporary folder is removed, earlier checkpoints are untouched."""
    final = output_dir / f"{CHECKPOINT_PREFIX}{step}"
    tmp = output_dir / f"{TMP_CHECKPOINT_PREFIX}{step}"
    need = bytes_to_write(model, optimizer)
    problem = None
    if accelerator.is_main_process:
        shutil.rmtree(tmp, ignore_errors=True)
        tmp.mkdir(parents=True)
        problem = room_problem(output_dir, need)
    problem = agreed(accelerator, problem)
    if problem is None:
        problem = agreed(accelerator, _attempt(lambda: _write_checkpoint(
            accelerator, tmp, model, optimizer, scheduler, tokenizer, config_yaml, model_cfg), output_dir, need))
    if problem is None and accelerator.is_main_process:
        problem = _attempt(lambda: _finish_checkpoint(tmp, final, {**trainer_state, "step": step}), output_dir, need)
    problem = agreed(accelerator, problem)
    if problem is not None:
        if accelerator.is_main_process:
            shutil.rmtree(tmp, ignore_errors=True)
        raise not_written(final.name, output_dir, problem)
    if accelerator.is_main_process:
        prune(output_dir, keep_last)
    accelerator.wait_for_everyone()
    return final


def _attempt(write, folder: Path, need: int) -> str | None:
    """Run ``write``; a disk's failure becomes its one-line description (None: written)."""
    try:
        write()
    except BaseException as error:
        if not is_write_error(error):
            raise
        return write_failure(error, folder, need)
    return None


def _write_checkpoint(accelerator, tmp: Path, model, optimizer, scheduler, tokenizer, config_yaml: str,
                      model_cfg) -> None:
    """Every file of a checkpoint but its state and manifest, into ``tmp`` (collective)."""
    sharded = is_sharded(model) or is_deepspeed(model)
    if is_deepspeed(model):  # the engine's own files: every process its partitions and optimizer states
        deepspeed_engine.save_engine(model, tmp)
    elif sharded:  # every process writes its own shards of the weights and the optimizer states
        save_sharded(model, optimizer, tmp)
    else:
        save_model(accelerator, model, tokenizer, tmp, model_cfg)
    torch.save(rng_state(), tmp / f"rng_state_{accelerator.process_index}.pt")
    if accelerator.is_main_process:
        if not sharded:
            torch.save(optimizer.state_dict(), tmp / "optimizer.pt")
        torch.save(scheduler.state_dict(), tmp / "scheduler.pt")
        scaler = getattr(accelerator, "scaler", None)
        if scaler is not None:
            torch.save(scaler.state_dict(), tmp / "scaler.pt")
        (tmp / RUN_CONFIG).write_text(config_yaml)


def _finish_checkpoint(tmp: Path, final: Path, state: dict[str, Any]) -> None:
    """Main process, once every process's files are in: the state, the manifest last, then the rename."""
    (tmp / STATE).write_text(json.dumps(state, indent=2))
    write_manifest(tmp)
    if final.exists():
        shutil.rmtree(final)
    tmp.rename(final)


def save_final_model(accelerator, model, tokenizer, directory: Path, model_cfg=None) -> list[str]:
    """The final model into the run folder (collective); ``NotWritten`` when it cannot be, with its partly
    written files removed (the checkpoints stay). Returns the tokens its generation config stops at
    (``save_model``)."""
    before = set(directory.iterdir()) if accelerator.is_main_process else set()
    stops: list[str] = []
    problem = _attempt(lambda: stops.extend(save_model(accelerator, model, tokenizer, directory, model_cfg)),
                       directory, bytes_to_write(model, optimizer=None))
    problem = agreed(accelerator, problem)
    if problem is not None:
        if accelerator.is_main_process:
            remove_partial([p for p in directory.iterdir() if p not in before])
        raise not_written("the final model", directory, problem)
    return stops


def prune(output_dir: Path, keep_last: int) -> None:
    """Keep the newest ``keep_last`` intact checkpoints (sizes checked) and delete every older folder.
    Damaged ones newer than those are left for ``resume=auto`` to name and skip."""
    dirs = checkpoint_dirs(output_dir)
    intact = [p for p in dirs if checkpoint_problem(p, full=False) is None]
    if not intact:
        return
    oldest_kept = checkpoint_step(intact[-max(1, keep_last):][0])
    for old in dirs:
        if checkpoint_step(old) < oldest_kept:
            shutil.rmtree(old, ignore_errors=True)


def load_checkpoint(accelerator, directory: Path, model, optimizer, scheduler) -> dict[str, Any]:
    """Restore everything a checkpoint holds into the prepared objects; returns its trainer state.
    A file that cannot be read is a ConfigError naming it (resolve_resume has normally caught it already).

    Any layout (``anyfit.training.relayout``): a replicated checkpoint resumed sharded has had its weights read
    before sharding (``weights_before_sharding``); here its optimizer state follows."""
    if is_deepspeed(model):  # written by as many processes (check_resumable refused any other checkpoint)
        deepspeed_engine.load_engine(model, directory)
    elif saved_sharded(directory):  # shards written by any number of processes, re-cut for this run
        if is_sharded(model):
            load_sharded(model, optimizer, directory)
        else:
            load_sharded_into_replicated(accelerator.unwrap_model(model), optimizer, directory)
    elif is_sharded(model):
        load_replicated_optimizer_into_sharded(model, optimizer, directory)
    else:
        load_weights(accelerator.unwrap_model(model), directory)
        optimizer.load_state_dict(torch_load(directory / "optimizer.pt", map_location="cpu"))
    scheduler.load_state_dict(torch_load(directory / "scheduler.pt"))
    scaler = getattr(accelerator, "scaler", None)
    if scaler is not None and (directory / "scaler.pt").is_file():
        scaler.load_state_dict(torch_load(directory / "scaler.pt"))
    rng_file = directory / f"rng_state_{accelerator.process_index}.pt"
    if rng_file.is_file():  # absent when resuming with more processes than saved: those start from the seed
        set_rng_state(torch_load(rng_file))
    try:
        return json.loads((directory / STATE).read_text())
    except (OSError, UnicodeDecodeError, ValueError) as e:
        raise damaged(directory / STATE, e) from e


def set_rng_state(state: dict[str, Any]) -> None:
    random.setstate(state["python"])
    np.random.set_state(state["numpy"])
    torch.set_rng_state(state["torch"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])

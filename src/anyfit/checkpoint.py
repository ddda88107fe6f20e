"""Checkpoints and the final model.

A checkpoint is ``checkpoint-<step>/`` holding the model (safetensors; only the adapter for LoRA), the
optimizer and scheduler state, each process's RNG state, ``trainer_state.json`` and the resolved
``config.yaml``. It is written under a temporary name and renamed when complete, so a crash mid-write
never leaves a folder that looks like a finished checkpoint.
"""

from __future__ import annotations

import json
import random
import shutil
from pathlib import Path
from typing import Any

import numpy as np
import torch

PREFIX = "checkpoint-"
TMP_PREFIX = ".tmp-checkpoint-"


def complete_checkpoints(output_dir: Path) -> list[Path]:
    """Finished checkpoints, oldest first."""
    found = [p for p in output_dir.glob(f"{PREFIX}*") if p.is_dir() and (p / "trainer_state.json").is_file()]
    return sorted(found, key=lambda p: int(p.name[len(PREFIX):]))


def rng_state() -> dict[str, Any]:
    state = {"python": random.getstate(), "numpy": np.random.get_state(), "torch": torch.get_rng_state()}
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def save_model(accelerator, model, tokenizer, directory: Path) -> None:
    """The trainable weights as safetensors (LoRA: the adapter only), plus the tokenizer. Main process writes;
    every process must call this because gathering a sharded (FSDP/DeepSpeed) state dict is collective."""
    state_dict = accelerator.get_state_dict(model)
    if accelerator.is_main_process:
        unwrapped = accelerator.unwrap_model(model)
        unwrapped.save_pretrained(directory, state_dict=state_dict, safe_serialization=True)
        if tokenizer is not None:
            tokenizer.save_pretrained(directory)


def save_checkpoint(accelerator, output_dir: Path, step: int, model, optimizer, scheduler, tokenizer,
                    config_yaml: str, trainer_state: dict[str, Any], keep_last: int) -> Path:
    final = output_dir / f"{PREFIX}{step}"
    tmp = output_dir / f"{TMP_PREFIX}{step}"
    if accelerator.is_main_process:
        shutil.rmtree(tmp, ignore_errors=True)
        tmp.mkdir(parents=True)
    accelerator.wait_for_everyone()
    save_model(accelerator, model, tokenizer, tmp)
    torch.save(rng_state(), tmp / f"rng_state_{accelerator.process_index}.pt")
    if accelerator.is_main_process:
        torch.save(optimizer.state_dict(), tmp / "optimizer.pt")
        torch.save(scheduler.state_dict(), tmp / "scheduler.pt")
        scaler = getattr(accelerator, "scaler", None)
        if scaler is not None:
            torch.save(scaler.state_dict(), tmp / "scaler.pt")
        (tmp / "config.yaml").write_text(config_yaml)
    accelerator.wait_for_everyone()
    if accelerator.is_main_process:
        # trainer_state.json marks the folder complete; it is written last, then the folder is renamed.
        (tmp / "trainer_state.json").write_text(json.dumps({**trainer_state, "step": step}, indent=2))
        if final.exists():
            shutil.rmtree(final)
        tmp.rename(final)
        prune(output_dir, keep_last)
    accelerator.wait_for_everyone()
    return final


def prune(output_dir: Path, keep_last: int) -> None:
    """Delete all but the newest ``keep_last`` complete checkpoints (never the newest one)."""
    done = complete_checkpoints(output_dir)
    for old in done[:-max(1, keep_last)]:
        shutil.rmtree(old, ignore_errors=True)

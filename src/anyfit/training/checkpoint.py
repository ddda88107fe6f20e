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


def resolve_resume(spec: str | None, output_dir: Path) -> Path | None:
    """The checkpoint to resume from: None for a fresh run; 'auto' picks the newest complete one."""
    from anyfit.config import ConfigError

    if not spec:
        return None
    if spec == "auto":
        done = complete_checkpoints(output_dir) if output_dir.is_dir() else []
        return done[-1] if done else None
    path = Path(spec)
    if not (path / "trainer_state.json").is_file():
        found = [p.name for p in complete_checkpoints(path.parent)] if path.parent.is_dir() else []
        raise ConfigError(f"train.resume: {path} is not a complete checkpoint (no trainer_state.json). "
                          + (f"Complete ones there: {', '.join(found)}. " if found else "")
                          + "Use train.resume=auto to pick the newest complete checkpoint of train.output_dir.")
    return path


def _load_weights(model, directory: Path) -> None:
    """Load saved weights into the (unwrapped) model: the adapter for PEFT models, else every tensor."""
    from safetensors.torch import load_file

    files = sorted(directory.glob("*.safetensors"))
    if not files:
        raise FileNotFoundError(f"{directory} holds no .safetensors weights")
    state: dict[str, torch.Tensor] = {}
    for f in files:
        state.update(load_file(f))
    if hasattr(model, "peft_config"):
        from peft import set_peft_model_state_dict

        result = set_peft_model_state_dict(model, state)
        if result.unexpected_keys:
            raise RuntimeError(f"adapter checkpoint {directory} does not fit this model: {result.unexpected_keys[:5]}")
        return
    missing, unexpected = model.load_state_dict(state, strict=False)
    # save_pretrained leaves out tied copies (lm_head tied to the embeddings); anything else missing is an error.
    tied = {k for k in missing if k.endswith("lm_head.weight") and getattr(model.config, "tie_word_embeddings", False)}
    if set(missing) - tied or unexpected:
        raise RuntimeError(f"checkpoint {directory} does not fit this model: missing {sorted(set(missing) - tied)[:5]}, "
                           f"unexpected {sorted(unexpected)[:5]}")


def load_checkpoint(accelerator, directory: Path, model, optimizer, scheduler) -> dict[str, Any]:
    """Restore everything a checkpoint holds into the prepared objects; returns its trainer state."""
    _load_weights(accelerator.unwrap_model(model), directory)
    optimizer.load_state_dict(torch.load(directory / "optimizer.pt", map_location="cpu", weights_only=False))
    scheduler.load_state_dict(torch.load(directory / "scheduler.pt", weights_only=False))
    scaler = getattr(accelerator, "scaler", None)
    if scaler is not None and (directory / "scaler.pt").is_file():
        scaler.load_state_dict(torch.load(directory / "scaler.pt", weights_only=False))
    rng_file = directory / f"rng_state_{accelerator.process_index}.pt"
    if rng_file.is_file():  # absent when resuming with more processes than saved: those start from the seed
        set_rng_state(torch.load(rng_file, weights_only=False))
    return json.loads((directory / "trainer_state.json").read_text())


def set_rng_state(state: dict[str, Any]) -> None:
    random.setstate(state["python"])
    np.random.set_state(state["numpy"])
    torch.set_rng_state(state["torch"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])

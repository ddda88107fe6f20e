"""Reading a checkpoint's files: each damaged file is one line naming it, never the reader's traceback.

Shared by the backends' restores (``anyfit.backends``) and the training checkpoint's own files."""

from __future__ import annotations

import copy
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import load_file

from anyfit.config import ConfigError
from anyfit.model.unloaded import is_kept_file


def damaged(path: Path, error: Exception) -> ConfigError:
    """The error for a checkpoint file that cannot be read: one line naming it, not the reader's traceback."""
    reason = str(error).strip().splitlines()[0] if str(error).strip() else ""
    reason = reason if len(reason) <= 120 else reason[:117] + "..."
    return ConfigError(f"checkpoint file {path} cannot be read ({type(error).__name__}{': ' + reason if reason else ''}"
                       "); it is damaged. Resume from an earlier checkpoint: train.resume=auto skips damaged ones.")


def torch_load(path: Path, **kwargs) -> Any:
    try:
        return torch.load(path, weights_only=False, **kwargs)
    except Exception as e:  # a damaged pickle/zip raises almost anything (EOFError, UnpicklingError, ...)
        raise damaged(path, e) from e


def load_weights(model, directory: Path) -> None:
    """Load a replicated checkpoint's safetensors into the (unwrapped, unsharded) model: the adapter for PEFT
    models, else every tensor. A checkpoint of another model is one line, not a traceback. The source's tensors
    the model does not load, kept beside its weights (``anyfit.model.unloaded``), are not read."""
    files = sorted(f for f in directory.glob("*.safetensors") if not is_kept_file(f))
    if not files:
        raise ConfigError(f"checkpoint {directory} holds no .safetensors weights; it is not an anyfit checkpoint "
                          "of a replicated run. Resume from another checkpoint, or start again.")
    state: dict[str, torch.Tensor] = {}
    for f in files:
        try:
            state.update(load_file(f))
        except Exception as e:  # SafetensorError, or an OSError from a file cut short
            raise damaged(f, e) from e
    if hasattr(model, "peft_config"):
        from peft import set_peft_model_state_dict

        try:
            result = set_peft_model_state_dict(model, state)
        except RuntimeError as e:  # a size mismatch: another base model or another rank
            raise _misfit(directory, str(e).strip().splitlines()[-1]) from e
        if result.unexpected_keys:
            raise _misfit(directory, f"unexpected {sorted(result.unexpected_keys)[:3]}")
        return
    if not set(state) <= set(model.state_dict()):
        state = _read_as_held(model, directory)
    try:
        missing, unexpected = model.load_state_dict(state, strict=False)
    except RuntimeError as e:
        raise _misfit(directory, str(e).strip().splitlines()[-1]) from e
    # save_pretrained leaves out tied copies (lm_head tied to the embeddings); anything else missing is an error.
    tied = {k for k in missing if k.endswith("lm_head.weight") and getattr(model.config, "tie_word_embeddings", False)}
    if set(missing) - tied or unexpected:
        raise _misfit(directory, f"missing {sorted(set(missing) - tied)[:3]}, unexpected {sorted(unexpected)[:3]}")


def _read_as_held(model, directory: Path) -> dict[str, torch.Tensor]:
    """The checkpoint's weights under the names ``model`` holds them by. ``save_pretrained`` writes them under the
    checkpoint's own names (transformers reverses its conversion mapping: a composite's ``language_model.model.*``,
    one tensor per MoE expert where the model holds them fused), so they are read back as transformers reads any
    checkpoint: ``from_pretrained`` of the model's own class and config, into a second copy in host memory."""
    dtype = next(model.parameters()).dtype
    try:
        fresh = type(model).from_pretrained(directory, config=copy.deepcopy(model.config), dtype=dtype)
    except Exception as e:  # sizes of another model, a file cut short: the caller's one line
        raise _misfit(directory, f"{type(e).__name__}: {str(e).strip().splitlines()[0] if str(e).strip() else ''}"
                      ) from e
    return fresh.state_dict()


def _misfit(directory: Path, detail: str) -> ConfigError:
    detail = detail if len(detail) <= 200 else detail[:197] + "..."
    return ConfigError(f"checkpoint {directory} does not fit this model ({detail}): it was written for another "
                       "model.name_or_path or LoRA setting. Resume with the run's own config.yaml, or start again.")

"""An ``anyfit export`` request, every input checked before any weights load (``check_request``): the run or
model folder, the dtype (``default_dtype`` when none is asked), the GGUF types and whether the model converts,
the out folder, the eval summary for the card and the push target. Each problem is a one-line ExportError."""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from anyfit.export.errors import ExportError
from anyfit.export.gguf_support import check_gguf_support, parse_gguf_types
from anyfit.export.local_files import local_json
from anyfit.export.push import check_push
from anyfit.export.run_files import RunFiles
from anyfit.export.sharded import needs_gathering, sharded_location
from anyfit.model.source import ModelLocation, locate_model
from anyfit.runfolder import checkpoint_dirs, has_final_model, run_config_path

DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}
_DTYPE_NAMES = {"float32": "fp32", "bfloat16": "bf16", "float16": "fp16"}


@dataclass(frozen=True)
class ExportRequest:
    """An export request whose inputs have all been checked (before any weights are loaded)."""

    run: Path
    out: Path
    location: ModelLocation
    dtype: str
    dtype_reason: str
    gguf_types: tuple[str, ...]
    run_files: RunFiles
    eval_summary: dict[str, Any] | None
    push: str | None
    gather: bool = False  # a sharded checkpoint, to be gathered into an ordinary folder before it loads


def check_request(run, out=None, *, dtype=None, gguf=(), push=None, overwrite=False, eval_summary=None,
                  api=None) -> ExportRequest:
    """Every input checked, each problem a one-line ExportError, before anything heavy happens."""
    run_path = Path(run).expanduser()
    if not run_path.exists():
        raise ExportError(f"{run_path} does not exist: give a training output folder (train.output_dir) or a "
                          "model folder (config.json + weights).")
    if not run_path.is_dir():
        raise ExportError(f"{run_path} is not a folder: give a training output folder or a model folder "
                          "(a .gguf file is already an export).")
    gather = needs_gathering(run_path)  # a sharded checkpoint: gathered into safetensors first (export.sharded)
    if not gather:
        _refuse_unfinished_run(run_path)
    # a folder without config.json/adapter_config.json: one-line error
    location = sharded_location(run_path) if gather else locate_model(run_path)
    if dtype is not None and dtype not in DTYPES:
        raise ExportError(f"--dtype {dtype!r} is not one of {', '.join(DTYPES)}.")
    gguf_types = parse_gguf_types(gguf)
    run_files = RunFiles.find(run_path)
    if gguf_types:
        check_gguf_support(location)
    out_path = Path(out).expanduser() if out else run_path.parent / f"{run_path.name}-export"
    _check_out(out_path, run_path, overwrite)
    summary = _read_eval_summary(eval_summary) if eval_summary else None
    if push:
        check_push(push, api)
    name, reason = (dtype, "as asked") if dtype else default_dtype(run_path, location, run_files)
    return ExportRequest(run_path, out_path, location, name, reason, gguf_types, run_files, summary, push, gather)


def _refuse_unfinished_run(run: Path) -> None:
    if has_final_model(run):
        return
    checkpoints = checkpoint_dirs(run)
    if checkpoints or run_config_path(run) is not None:
        hint = (f" Export its newest checkpoint ({checkpoints[-1]}), or finish the run with train.resume=auto."
                if checkpoints else " Its final model is written when training ends.")
        raise ExportError(f"{run} is an unfinished training run: it holds no final model (config.json or "
                          f"adapter_config.json).{hint}")


def _check_out(out: Path, run: Path, overwrite: bool) -> None:
    out_r, run_r = out.resolve(), run.resolve()
    if out_r == run_r or out_r in run_r.parents:
        raise ExportError(f"--out {out} would replace the model being exported ({run}); choose another folder.")
    if out.exists() and not overwrite:
        raise ExportError(f"--out {out} already exists; choose another folder or pass --overwrite to replace it.")
    if out.exists() and not out.is_dir():
        raise ExportError(f"--out {out} is a file, not a folder.")
    existing = next(p for p in out.absolute().parents if p.exists())  # missing folders above are created
    if not existing.is_dir():
        raise ExportError(f"--out {out}: {existing} is a file, not a folder.")


def _read_eval_summary(path) -> dict[str, Any]:
    p = Path(path).expanduser()
    if not p.is_file():
        raise ExportError(f"--eval-summary {p}: no such file (anyfit eval writes summary.json in its --out folder).")
    try:
        summary = json.loads(p.read_text(encoding="utf-8"))
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise ExportError(f"--eval-summary {p} is not valid JSON ({e}).") from None
    if not isinstance(summary, dict) or "accuracy" not in summary:
        raise ExportError(f"--eval-summary {p} is not an anyfit eval summary (no 'accuracy').")
    return summary


def default_dtype(run: Path, location: ModelLocation, run_files: RunFiles) -> tuple[str, str]:
    """The dtype recorded in the base model's config.json (the adapter's base; the base a full fine-tune
    started from; a plain model folder's own), else bf16. ``(name, reason)``."""
    if location.adapter:
        base = location.base
    elif run_files.config is not None:
        base = run_files.config.model.name_or_path
    else:
        base = str(run)
    recorded = _recorded_dtype(base, run_files.config.model.revision if run_files.config else None)
    if recorded:
        return recorded, f"the base model's dtype ({base})"
    return "bf16", f"no dtype recorded for the base model ({base})"


def _recorded_dtype(base: str, revision: str | None) -> str | None:
    """``base``'s config.json dtype from its folder or the local hub cache (a hub id: only if cached)."""
    data = local_json(base, "config.json", revision=revision) or {}
    return _DTYPE_NAMES.get(data.get("dtype") or data.get("torch_dtype") or "")

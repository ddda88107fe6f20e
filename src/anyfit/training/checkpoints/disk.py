"""Writing checkpoints and the final model on a disk that can fill up: the room needed is checked before a
write, a write that fails anyway (no space, a quota, a file-size limit, a broken disk) is caught on every process
alike, and the caller gets one ``NotWritten`` line naming the folder, the space needed and free, and what is
still safe; nothing half-written is left behind.

A failure is agreed on by all processes before anyone acts on it: a process that raised alone would leave the
others waiting at the next collective until the process group times out.
"""

from __future__ import annotations

import shutil
from pathlib import Path

import torch
from safetensors import SafetensorError

from anyfit.runfolder import NotWritten
from anyfit.training.checkpoints.integrity import complete_checkpoints
from anyfit.units import GIB

HEADROOM = 1.05  # safetensors/pickle headers, the RNG and scheduler states, the manifest


def bytes_to_write(model, optimizer) -> int:
    """About what a checkpoint of ``model`` and ``optimizer`` takes on disk: the trainable weights (an adapter's
    only) and the optimizer's state tensors, whole (a sharded tensor's ``numel`` is its global size)."""
    # a DeepSpeed ZeRO-3 parameter is empty between uses: ds_numel is its whole size
    weights = sum(getattr(p, "ds_numel", p.numel()) * p.element_size() for p in model.parameters() if p.requires_grad)
    states = sum(v.numel() * v.element_size() for s in getattr(optimizer, "state", {}).values() for v in s.values()
                 if isinstance(v, torch.Tensor)) if optimizer is not None else 0
    return int((weights + states) * HEADROOM)


def room_problem(folder: Path, need: int) -> str | None:
    """Why ``need`` bytes do not fit in ``folder``'s file system now, or None."""
    free = shutil.disk_usage(folder).free
    if free >= need:
        return None
    return f"no room: it needs about {need / GIB:.2f} GiB and {free / GIB:.2f} GiB are free"


def agreed(accelerator, problem: str | None) -> str | None:
    """The first process's problem, if any process has one (collective when several processes run)."""
    if accelerator.num_processes == 1 or not torch.distributed.is_initialized():
        return problem
    every: list[str | None] = [None] * accelerator.num_processes
    torch.distributed.all_gather_object(every, problem)
    return next((f"process {rank}: {p}" if rank else p for rank, p in enumerate(every) if p), None)


def write_failure(error: BaseException, folder: Path, need: int) -> str:
    """One line for a write that failed part-way: what the writer said, and the space as it is now."""
    reason = " ".join(str(error).split())[:200] or type(error).__name__
    free = shutil.disk_usage(folder).free
    return f"writing failed ({reason}); it needs about {need / GIB:.2f} GiB and {free / GIB:.2f} GiB are free"


def not_written(what: str, folder: Path, problem: str) -> NotWritten:
    """The error for ``what`` (a checkpoint, the final model) not written into ``folder``, saying what is safe."""
    kept = complete_checkpoints(folder)
    safe = (f"the last complete checkpoint, {kept[-1].name}, is intact (train.resume=auto continues from it)"
            if kept else "no earlier checkpoint exists")
    return NotWritten(f"{what} was not written to {folder}: {problem}. Nothing half-written was kept; {safe}.")


def remove_partial(paths: list[Path]) -> None:
    for path in paths:
        if path.is_dir():
            shutil.rmtree(path, ignore_errors=True)
        else:
            path.unlink(missing_ok=True)


def is_write_error(error: BaseException) -> bool:
    """The errors a full or failing disk raises from the writers: OSError (ENOSPC, EDQUOT, EFBIG, EIO); from
    safetensors' Rust writer, SafetensorError ("I/O error: ..."); from torch.save's C++ stream, RuntimeError
    ("file write failed", "basic_ios::clear: iostream error")."""
    if isinstance(error, SafetensorError):
        return "I/O error" in str(error)
    return isinstance(error, OSError) or (isinstance(error, RuntimeError) and any(
        text in str(error) for text in ("write failed", "iostream error", "No space", "unexpected pos")))


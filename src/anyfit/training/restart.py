"""Restarts nobody has to do: inside a job the launcher restarted (``torchrun --max-restarts N`` after a worker
died, a SLURM job requeued after preemption), ``train.resume`` left unset means ``auto``: the run continues from
its newest complete checkpoint, and ends as the uninterrupted run would (``anyfit.training.checkpoint``).

Whether this is a restart is agreed by every process: torchrun counts restarts per node
(``TORCHELASTIC_RESTART_COUNT`` stays 0 on a node whose workers were healthy, pytorch#108158), so one node's
count above 0 makes the whole job a restart; a process deciding alone would start from scratch beside
processes that resume."""

from __future__ import annotations

import os
from pathlib import Path

import torch

from anyfit.runfolder import RUN_CONFIG

RESTART_COUNTS = ("TORCHELASTIC_RESTART_COUNT", "SLURM_RESTART_COUNT")  # torchrun's agent; SLURM's requeue


def local_restarts(environ=os.environ) -> int:
    """The restart count this process's launcher gave it (0 when it set none)."""
    counts = [environ.get(name, "0") for name in RESTART_COUNTS]
    return max(int(c) if c.strip().isdigit() else 0 for c in counts)


def job_restarts(accelerator) -> int:
    """The job's restart count, the same on every process (the largest any process was given)."""
    count = local_restarts()
    if accelerator.num_processes == 1:
        return count
    import torch.distributed as dist

    agreed = torch.tensor([count], device=accelerator.device)
    dist.all_reduce(agreed, op=dist.ReduceOp.MAX)
    return int(agreed.item())


def resume_spec(resume: str | None, restarts: int, say=print) -> str | None:
    """``train.resume`` as this attempt should read it: unset inside a restart means 'auto'."""
    if resume is not None or restarts == 0:
        return resume
    say(f"[anyfit] restart {restarts} of this job: resuming from the newest complete checkpoint "
        "(train.resume=auto is the default inside a restart)")
    return "auto"


def earlier_attempt(output_dir: Path, config_yaml: str, restarts: int) -> bool:
    """A restarted job whose earlier attempt died before its first checkpoint left this folder, with this very
    config: it may be started over (any other run in the folder is still protected)."""
    try:
        return restarts > 0 and (output_dir / RUN_CONFIG).read_text() == config_yaml
    except (OSError, UnicodeDecodeError):
        return False

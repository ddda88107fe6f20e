"""Where a run starts, and whether it may: one call (``where_to_start``) answers it before any heavy work, from
``train.resume``, the launcher's restart count, the run folder and the checkpoint's own config.

- fresh: ``train.output_dir`` must not hold another run (unless ``train.overwrite``);
- resumed: ``train.resume=auto`` (the newest complete checkpoint) or a path, checked by ``integrity``;
- restarted: inside a job the launcher restarted (``torchrun --max-restarts N`` after a worker died, a SLURM job
  requeued after preemption), ``train.resume`` left unset means ``auto``: the run continues from its newest
  complete checkpoint and ends as the uninterrupted run would. Whether this is a restart is agreed by every
  process: torchrun counts restarts per node (``TORCHELASTIC_RESTART_COUNT`` stays 0 on a node whose workers
  were healthy, pytorch#108158), so one node's count above 0 makes the whole job a restart;
- another layout or process count: the backend's rule (``anyfit.backends.continue_problem``); every other
  setting changed since the checkpoint is applied or refused by its rule (``anyfit.training.checkpoints.changes``).
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from pathlib import Path

import torch

from anyfit.backends import Backend, continue_problem
from anyfit.config import Config, ConfigError
from anyfit.runfolder import CHECKPOINT_PREFIX, METRICS, RUN_CONFIG
from anyfit.training.checkpoints.changes import Change, check_config
from anyfit.training.checkpoints.integrity import resolve_resume


@dataclass(frozen=True)
class Start:
    """Where this run starts: the checkpoint it continues (None: step 0) and the folder it writes."""

    resume_from: Path | None
    out: Path
    changes: list[Change] = field(default_factory=list)  # settings changed since the checkpoint, all applied


def where_to_start(cfg: Config, backend: Backend, accelerator, say=print) -> Start:
    """Where this run starts, refused in one line where it may not (collective: the restart count is agreed)."""
    restarts = job_restarts(accelerator)
    resume_from = resolve_resume(resume_spec(cfg.train.resume, restarts, say), Path(cfg.train.output_dir), warn=say)
    changes = [] if resume_from is None else check_resumable(resume_from, cfg, backend, accelerator.num_processes)
    out = check_output_dir(cfg, resuming=resume_from is not None or
                           earlier_attempt(Path(cfg.train.output_dir), cfg.to_yaml(), restarts))
    return Start(resume_from, out, changes)


def check_output_dir(cfg: Config, resuming: bool) -> Path:
    """Refuse to mix two runs in one folder unless asked to overwrite or resume (checked before heavy work)."""
    out = Path(cfg.train.output_dir)
    if out.exists() and not resuming:
        previous = [p for p in (RUN_CONFIG, METRICS) if (out / p).exists()]
        previous += [p.name for p in out.glob(f"{CHECKPOINT_PREFIX}*")]
        if previous and not cfg.train.overwrite:
            raise ConfigError(f"train.output_dir {out} already holds a run ({', '.join(sorted(previous)[:4])}). "
                              "Choose another train.output_dir, or pass train.overwrite=true to replace it.")
    return out



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


def check_resumable(directory: Path, cfg: Config, backend: Backend, processes: int) -> list[Change]:
    """Refuse, in one line and before any work, a checkpoint this run's config cannot continue: the backend's
    rule for layouts (everything about layout may change, but DeepSpeed ZeRO-3 checkpoints continue under ZeRO-3
    on as many processes as wrote them: ``anyfit.backends.continue_problem``), then every setting that differs
    from the checkpoint's config (``changes``: applied or refused). Returns the applied changes."""
    problem = continue_problem(backend, directory, processes)
    if problem:
        raise ConfigError(f"train.resume: checkpoint {directory} {problem}")
    return check_config(directory, cfg)

"""The run folder at the start of a run: cleared when overwriting (``training.checkpoints.start`` refused it
when it holds another run), and the files that describe the run (``config.yaml``, ``run_info.json``) written
before the first step.

The folder's layout is ``anyfit.runfolder``'s; checkpoints inside it are ``anyfit.training.checkpoints.checkpoint``'s;
the metrics file is appended to by the loop.
"""

from __future__ import annotations

import shutil
from pathlib import Path
from typing import Any

import torch

from anyfit.backends import local_bytes, local_numel
from anyfit.hardware.runtime import versions
from anyfit.runfolder import (
    CHECKPOINT_PREFIX,
    METRICS,
    RUN_CONFIG,
    TMP_CHECKPOINT_PREFIX,
    read_metrics,
    read_run_info,
    write_metrics,
    write_run_info,
)


def start_run_dir(out: Path, resumed_at: int | None, config_yaml: str, run_info: dict[str, Any]) -> None:
    """Main process only. A fresh run clears what a previous run left (reached only when overwriting is
    allowed); a resumed one drops the metric lines of the steps about to be redone."""
    if resumed_at is None:
        for p in [*out.glob(f"{CHECKPOINT_PREFIX}*"), *out.glob(f"{TMP_CHECKPOINT_PREFIX}*")]:
            shutil.rmtree(p)
        (out / METRICS).unlink(missing_ok=True)
        out.mkdir(parents=True, exist_ok=True)
    else:  # the steps after the checkpoint are logged again
        write_metrics(out, read_metrics(out, up_to_step=resumed_at))
    (out / RUN_CONFIG).write_text(config_yaml)
    write_run_info(out, run_info)


def describe_run(policy, sharding: str, plan, steps: int, report, trainable: int, total: int) -> dict[str, Any]:
    """``run_info.json``: the resolved policy with its reasons, the batch split, the data report, versions."""
    return {"policy": {"device": policy.device, "precision": policy.precision, "tf32": policy.tf32,
                       "num_workers": policy.num_workers, "reasons": [*policy.reasons, sharding]},
            "batch": plan.__dict__, "steps": steps, "data": report.__dict__, "versions": versions(),
            "parameters": {"trainable": trainable, "total": total}}


def record_held_per_process(out: Path, accelerator, model, optimizer, loaded: int) -> dict[str, list[int]]:
    """Add to ``run_info.json`` how many parameter and optimizer-state elements (and state bytes) each process
    holds (collective: every process calls it), and how many parameter elements it read from the weights
    (``loaded``). Sharded, each holds about 1/N and only process 0 read the model; replicated, each holds and read
    everything."""
    states = [v for s in optimizer.state.values() for v in s.values() if isinstance(v, torch.Tensor) and v.ndim > 0]
    mine = torch.tensor([local_numel(model.parameters()), local_numel(states), loaded, local_bytes(states)],
                        device=accelerator.device)
    every = accelerator.gather(mine.unsqueeze(0)).tolist()
    held = {"parameters": [row[0] for row in every], "optimizer_states": [row[1] for row in every],
            "loaded_parameters": [row[2] for row in every], "optimizer_state_bytes": [row[3] for row in every]}
    if accelerator.is_main_process:
        write_run_info(out, {**read_run_info(out), "held_per_process": held})
    return held

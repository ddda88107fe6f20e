"""The run folder at the start of a run: cleared when overwriting (``training.checkpoints.start`` refused it
when it holds another run), and the files that describe the run (``config.yaml``, ``run_info.json``) written
before the first step.

The folder's layout is ``anyfit.runfolder``'s; checkpoints inside it are ``anyfit.training.checkpoints.checkpoint``'s;
the metrics file is appended to by the loop.
"""

from __future__ import annotations

import dataclasses
import shutil
from pathlib import Path
from typing import Any

import torch

from anyfit.backends import local_bytes, local_numel
from anyfit.config import Config
from anyfit.hardware.runtime import versions
from anyfit.model.shape import shape_from_config
from anyfit.planning.memory import estimate_memory
from anyfit.planning.presets import this_machine
from anyfit.planning.setup import Workload
from anyfit.planning.time import flops_per_token, step_time
from anyfit.profiling.facts import run_setup
from anyfit.runfolder import (
    CHECKPOINT_PREFIX,
    GENERATIONS,
    METRICS,
    RUN_CONFIG,
    TMP_CHECKPOINT_PREFIX,
    read_generations,
    read_metrics,
    read_run_info,
    write_generations,
    write_metrics,
    write_run_info,
)
from anyfit.units import GIB


def start_run_dir(out: Path, resumed_at: int | None, config_yaml: str, run_info: dict[str, Any],
                  resume: dict[str, Any] | None = None) -> None:
    """Main process only. A fresh run clears what a previous run left (reached only when overwriting is
    allowed); a resumed one drops the metric lines of the steps about to be redone, and ``run_info.json`` keeps
    every resume of the run that the steps kept (``resumes``: from which step, what changed and what was done),
    ``resume`` last. ``config.yaml`` is the config the run goes on with."""
    if resumed_at is not None and resume is not None:
        earlier = [r for r in read_run_info(out).get("resumes", []) if r.get("step", 0) <= resumed_at]
        run_info = {**run_info, "resumes": [*earlier, resume]}
    if resumed_at is None:
        for p in [*out.glob(f"{CHECKPOINT_PREFIX}*"), *out.glob(f"{TMP_CHECKPOINT_PREFIX}*")]:
            shutil.rmtree(p)
        (out / METRICS).unlink(missing_ok=True)
        (out / GENERATIONS).unlink(missing_ok=True)
        out.mkdir(parents=True, exist_ok=True)
    else:  # the steps after the checkpoint are logged (and evaluated) again
        write_metrics(out, read_metrics(out, up_to_step=resumed_at))
        if (out / GENERATIONS).is_file():
            write_generations(out, read_generations(out, up_to_step=resumed_at), append=False)
    (out / RUN_CONFIG).write_text(config_yaml)
    write_run_info(out, run_info)


def describe_run(cfg: Config, policy, backend, plan, steps: int, report, loaded, processes: int) -> dict[str, Any]:
    """``run_info.json``: the resolved policy with its reasons, the batch split, the data report, versions, and
    what the planner predicts for the run (``planned_run``). ``loaded``: the backend's ``Loaded`` model."""
    return {"policy": {"device": policy.device, "precision": policy.precision, "tf32": policy.tf32,
                       "num_workers": policy.num_workers, "reasons": [*policy.reasons, backend.reason]},
            "batch": plan.__dict__, "steps": steps, "data": report.__dict__, "versions": versions(),
            "parameters": {"trainable": loaded.trainable, "total": loaded.total},
            "planned": planned_run(cfg, policy, plan, loaded.model.config, backend.sharded, report, processes)}


def planned_run(cfg: Config, policy, plan, model_config, sharded: bool, report, processes: int) -> dict[str, Any]:
    """What ``anyfit plan``'s estimates say of this run as it starts: its setup at the micro-batch it uses on this
    machine, peak memory per device at its longest example, step time and tokens/s at its mean length and share of
    trained tokens, and the
    model FLOP/s per device that time implies (the report divides them by the run's own MFU peak, so that measured
    and planned MFU share a denominator; recomputation is not counted, as in the run's MFU). Kept for the run's
    report, beside what the run measured. An estimate that fails is recorded as its reason, not raised: the
    prediction describes the run, it never steers it."""
    try:
        shape = shape_from_config(model_config)
        setup = run_setup(cfg, policy, plan.micro_batch, processes, sharded, report.max_length or cfg.data.max_length)
        target = this_machine(measure_cpu=True, dtype=policy.precision)  # measured once per machine, then cached
        mean = report.mean_length or cfg.data.max_length
        trained = report.trainable_tokens / report.total_tokens if report.total_tokens else 1.0
        seconds = step_time(shape, setup, target, Workload(mean, trained)).total
        model_setup = dataclasses.replace(setup, seq_len=max(1, round(mean)), gradient_checkpointing=False,
                                          tiled_mlp=False, fused_loss=False, trained_share=trained)
        device_tokens = setup.micro_batch * setup.accumulation * mean / setup.sequence_parallel
        return {"machine": target.label(), "micro_batch": setup.micro_batch, "seq_len": setup.seq_len,
                "peak_mem_gib": round(estimate_memory(shape, setup).peak / GIB, 3),
                "seconds_per_step": round(seconds, 6), "tokens_per_s": round(plan.effective_batch * mean / seconds, 1),
                "model_tflops_per_s_per_device": round(flops_per_token(shape, model_setup) * device_tokens / seconds
                                                       / 1e12, 6)}
    except Exception as e:  # noqa: BLE001 - a model the planner cannot size still trains
        return {"error": f"{type(e).__name__}: {e}"}


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

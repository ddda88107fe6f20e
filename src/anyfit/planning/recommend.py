"""What the training loop asks the planner at start-up, for the launched process count on this machine:
whether ``runtime.sharding=auto`` shards (``recommend_sharding``) and which degree
``runtime.sequence_parallel=auto`` splits each sequence over (``recommend_sequence_parallel``); each answer comes
with the one line the run prints."""

from __future__ import annotations

import os

from anyfit.config import Config, ConfigError
from anyfit.data.batching import BatchPlan
from anyfit.model.shape import ModelShape
from anyfit.planning.ladder import Planner
from anyfit.planning.memory import estimate_memory
from anyfit.planning.presets import Target
from anyfit.planning.savers import Option
from anyfit.planning.setup import SAFETY, Workload, setup_for
from anyfit.units import GIB


def recommend_sharding(cfg: Config, shape: ModelShape, target: Target, processes: int) -> tuple[bool, str]:
    """Whether a run with ``runtime.sharding=auto`` should shard (FSDP2) over ``processes``, and why, in one line.

    Asked by the training loop (``anyfit.backends.choose_backend``, with ``presets.this_machine()`` and the
    launched process count) and by ``anyfit plan``. The run is estimated as configured (its micro-batch, or the
    micro_batch=auto rule), unsharded, under the planner's safety share of one device's memory (CPU processes
    share the host RAM). It fits: no sharding (DDP is faster and simpler). It does not: shard where possible (not
    fp16, no generation eval during training, CUDA or CPU, not QLoRA), even when the sharded estimate is still
    over the budget (the reason says so): sharding only lowers the per-device memory. One process, or a
    DeepSpeed launch (ZeRO shards instead), never shards.
    """
    if processes <= 1:
        return False, "one process: nothing to shard over"
    if os.environ.get("ACCELERATE_USE_DEEPSPEED", "").lower() == "true":
        return False, "launched with DeepSpeed (accelerate config): ZeRO shards the model, not FSDP2"
    if cfg.train.effective_batch % processes:
        return False, (f"train.effective_batch={cfg.train.effective_batch} does not split over {processes} "
                       "processes (the run will refuse it)")
    try:
        run_micro = BatchPlan.from_config(cfg.train, processes).micro_batch
    except ConfigError as e:
        return False, f"the batch split is refused ({e})"
    p = Planner(cfg, shape, target, SAFETY, None, Workload.of(cfg), processes=processes)
    p.host_budget = None  # the device memory decides FSDP vs DDP here (sharded, the model is read only once)
    budget = f"{p.budget / GIB:.1f} GiB per {'process' if target.device == 'cpu' else 'device'}"

    def peak(option: Option) -> tuple[int | None, int]:
        """(peak bytes at the micro-batch the run will use, that micro-batch); None when none fits."""
        if cfg.train.micro_batch == "auto":
            found = p.fit(option)
            return (found[1].peak, found[0].micro_batch) if found else (None, 1)
        micro = run_micro  # what the run will use: BatchPlan.from_config's rule, not a copy of it
        precision = p.precision(option.method)
        # runtime.sequence_parallel as the config has it (setup_for's rule), not as the ladder would refuse it
        overrides = {key: value for key, value in option.overrides if key != "runtime.sequence_parallel"}
        setup = setup_for(cfg, method=option.method, device=target.device, precision=precision, micro_batch=micro,
                          processes=processes, overrides=overrides)
        return estimate_memory(shape, setup).peak, micro

    base = p.configured(processes).with_({"runtime.sharding": "none", "runtime.fsdp_offload": False})
    unsharded, micro = peak(base)
    if unsharded is not None and unsharded <= p.budget:
        return False, (f"the unsharded run fits: {unsharded / GIB:.1f} GiB of {budget} at micro-batch {micro}")
    need = "no micro-batch fits" if unsharded is None else f"{unsharded / GIB:.1f} GiB at micro-batch {micro}"
    blocked = p.blocker(p.method)
    if blocked:
        return False, f"the unsharded run does not fit ({need}, budget {budget}), but it cannot be sharded: {blocked}"
    sharded, micro = peak(base.with_({"runtime.sharding": "fsdp", "runtime.fsdp_reduce_every_micro_batch":
                                      p.asked["runtime.fsdp_reduce_every_micro_batch"]}))
    if sharded is not None and sharded <= p.budget:
        return True, (f"the unsharded run does not fit ({need}, budget {budget}); sharded over {processes}: "
                      f"{sharded / GIB:.1f} GiB at micro-batch {micro}")
    still = "no micro-batch fits" if sharded is None else f"{sharded / GIB:.1f} GiB at micro-batch {micro}"
    return True, (f"the unsharded run does not fit ({need}, budget {budget}); sharded over {processes} it is "
                  f"still over ({still}): see 'anyfit plan' for more savers")


def recommend_sequence_parallel(cfg: Config, shape: ModelShape, target: Target, processes: int) -> tuple[int, str]:
    """The degree ``runtime.sequence_parallel=auto`` uses over ``processes``, and why, in one line: 1 when the run
    as configured fits one device (the rest of the config's savers kept, micro-batch as the run will choose it),
    else the smallest degree the heads and the batch allow that fits (the all-to-alls grow with it), else the
    largest allowed (and the reason says it is still over: 'anyfit plan' has the other savers)."""
    if processes <= 1:
        return 1, "one process: nothing to split over"
    p = Planner(cfg, shape, target, SAFETY, None, Workload.of(cfg), processes=processes)
    p.host_budget = None
    base = p.configured(processes)
    budget = f"{p.budget / GIB:.1f} GiB per {'process' if target.device == 'cpu' else 'device'}"
    found = p.fit(base)
    if found:
        return 1, (f"the unsplit run fits: {found[1].peak / GIB:.1f} GiB of {budget} at micro-batch "
                   f"{found[0].micro_batch}")
    degrees = p.sp_degrees(processes)[1:]
    if not degrees:
        return 1, (f"the unsplit run does not fit ({budget}), and no degree splits {processes} processes, "
                   f"{shape.num_heads} heads and the batch: see 'anyfit plan'")
    for degree in degrees:
        found = p.fit(base.with_({"runtime.sequence_parallel": degree}))
        if found:
            return degree, (f"the unsplit run does not fit ({budget}); each sequence over {degree} processes: "
                            f"{found[1].peak / GIB:.1f} GiB at micro-batch {found[0].micro_batch}")
    return degrees[-1], (f"the unsplit run does not fit ({budget}), nor split {degrees[-1]} ways: see 'anyfit plan' "
                         "for more savers")

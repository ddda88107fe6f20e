"""The one place a run's backend is chosen (``runtime.sharding``, with its reasons), and the one place that
tells which backend wrote a checkpoint, so that backend is the one asked about its files (``unlisted_states``)
and the one that reads them (``load_states``). Adding a backend: its module, and a line in each of the two
below (``choose_backend``, ``WRITERS``)."""

from __future__ import annotations

import importlib.util

from pathlib import Path

from anyfit.backends.base import Backend
from anyfit.backends.fsdp import FSDP2
from anyfit.backends.replicated import Replicated
from anyfit.backends.zero3 import ZeRO3, deepspeed_missing, deepspeed_refusal, engine_config
from anyfit.config import Config, ConfigError
from anyfit.hardware.runtime import sequence_parallel_problem, sharding_refusal
from anyfit.model.shape import model_shape
from anyfit.planning.recommend import recommend_sequence_parallel, recommend_sharding
from anyfit.planning.presets import this_machine

WRITERS: tuple[type[Backend], ...] = (ZeRO3, FSDP2, Replicated)  # most specific folder first


def choose_backend(cfg: Config, policy, processes: int, micro_batch: int | None = None, accumulation: int = 1
                   ) -> Backend:
    """The backend this run uses, with the reason printed beside the runtime line; a setting it cannot honour
    is a ConfigError. ``micro_batch``/``accumulation``: the plan's, which DeepSpeed's engine fixes when built."""
    device, precision, mode = policy.device, policy.precision, cfg.runtime.sharding
    if cfg.runtime.deepspeed_offload and mode != "deepspeed":
        raise ConfigError("runtime.deepspeed_offload=true needs runtime.sharding=deepspeed (FSDP2's offload is "
                          "runtime.fsdp_offload).")
    if mode == "deepspeed":
        refusal = deepspeed_refusal(cfg, device, cfg.train.micro_batch == "auto") or \
            sharding_refusal(cfg, device, precision) or deepspeed_missing()
        if refusal:
            raise ConfigError(refusal)
        offload = cfg.runtime.deepspeed_offload
        config = engine_config(cfg, micro_batch or 1, accumulation, processes, precision, offload, policy.pin_memory)
        return ZeRO3("sharding deepspeed: ZeRO-3 partitions weights, gradients and optimizer states over "
                     f"{processes} process(es)" + (", offloaded to host RAM" if offload else "")
                     + " (asked for in the config)", offload, config)
    if mode == "none":
        for key in ("fsdp_offload", "fsdp_reduce_every_micro_batch"):
            if getattr(cfg.runtime, key):
                raise ConfigError(f"runtime.{key}=true needs sharding: set runtime.sharding=fsdp (or auto).")
        return Replicated("sharding none: asked for in the config")
    if mode == "auto" and not cfg.runtime.fsdp_offload:
        if processes == 1:
            return Replicated("sharding none: one process, nothing to shard over (auto)")
        use, why = recommend_sharding(cfg, model_shape(cfg.model), this_machine(), processes)
        if not use:
            return Replicated(f"sharding none (auto): {why}")
        reason = f"sharding fsdp (auto): {why}"
    else:
        reason = "sharding fsdp" + (" with CPU offload" if cfg.runtime.fsdp_offload else "") + \
            (": asked for in the config" if mode == "fsdp" else " (auto): runtime.fsdp_offload=true")
    refusal = sharding_refusal(cfg, device, precision)
    if refusal:
        raise ConfigError(refusal)
    offload = cfg.runtime.fsdp_offload and device != "cpu"
    if cfg.runtime.fsdp_offload and not offload:
        reason += " (offload has nothing to move on cpu: the weights are in host RAM already)"
    if cfg.runtime.fsdp_reduce_every_micro_batch:
        reason += "; gradients reduce-scattered after every micro-batch (runtime.fsdp_reduce_every_micro_batch)"
    return FSDP2(reason, offload=offload, reduce_every=cfg.runtime.fsdp_reduce_every_micro_batch)


def choose_sequence_parallel(cfg: Config, processes: int) -> tuple[int, str]:
    """How many processes share each sequence (``runtime.sequence_parallel``), with the reason printed; a degree
    that cannot run (or DeepSpeed missing for one) is a ConfigError, before any weights load."""
    asked = cfg.runtime.sequence_parallel
    if asked == 1:
        return 1, ""
    shape = model_shape(cfg.model)
    if asked == "auto":
        degree, why = recommend_sequence_parallel(cfg, shape, this_machine(), processes)
        reason = f"sequence parallel {degree} (auto): {why}"
    else:
        refusal = sequence_parallel_problem(cfg, processes, shape.num_heads, shape.num_kv_heads, state=shape.stateful)
        if refusal:
            raise ConfigError(refusal)
        degree, reason = asked, f"sequence parallel {asked}: asked for in the config"
    if degree > 1 and importlib.util.find_spec("deepspeed") is None:
        raise ConfigError(f"runtime.sequence_parallel={asked} uses DeepSpeed's Ulysses attention, and DeepSpeed is not "
                          "installed: pip install 'anyfit[deepspeed]', or set runtime.sequence_parallel=1.")
    return degree, reason


def writer_of(folder: Path) -> type[Backend]:
    """The backend whose files a checkpoint folder holds (replicated: ordinary safetensors)."""
    return next((b for b in WRITERS if b.wrote(folder)), Replicated)


def unlisted_states(names: set[str]) -> list[str]:
    """The files of the model and optimizer states that a checkpoint holding ``names`` (its manifest's paths)
    lacks, in words, as the backend whose files they are says ([]: none)."""
    writer = next((b for b in WRITERS if b.wrote_files(names)), Replicated)
    return writer.unlisted(names)


def load_states(backend: Backend, accelerator, model, optimizer, folder: Path) -> None:
    """A checkpoint's model and optimizer states into the objects ``backend`` holds (collective): the backend that
    wrote ``folder`` reads its own files, into this run's layout where it is another (relayout)."""
    backend.load_states(accelerator, model, optimizer, folder, writer_of(folder))


def continue_problem(backend: Backend, folder: Path, processes: int) -> str:
    """Why ``backend`` cannot continue the checkpoint in ``folder`` with ``processes`` ('' when it can): the
    writer's rule first (ZeRO-3's states are read by ZeRO-3 alone), then the reader's."""
    writer = writer_of(folder)
    problem = writer.refuse_other(folder, backend) if not isinstance(backend, writer) else ""
    return problem or backend.check_checkpoint(folder, processes, writer)

"""Sharded training with PyTorch's own FSDP2 (``torch.distributed.fsdp.fully_shard``), on CPU and CUDA alike.

Each decoder layer becomes one FSDP unit and the root module takes what is left (embeddings, final norm,
head): every process keeps 1/N of the weights, gradients and optimizer states, and gathers one layer's
weights at a time for its forward and backward.

Why anyfit applies FSDP2 itself instead of Accelerate's FSDP plugin: the plugin is ignored on CPU
(Accelerate keeps the MULTI_CPU distributed type there), so a code path that only shards through it cannot
be tested on a CPU, and a CPU run would silently train unsharded. ``fully_shard`` runs the same way over gloo
and NCCL; Accelerate stays the launcher and keeps the process group, devices and reductions.

Checkpoints of a sharded run are written with ``torch.distributed.checkpoint`` (each process writes its
shards; a checkpoint written by N processes loads on M), the final model as one ordinary safetensors folder
gathered on the main process.
"""

from __future__ import annotations

import contextlib
from pathlib import Path

import torch
from torch import nn

from anyfit.config import Config, ConfigError
from anyfit.hardware.memory import keep_host_heap_small, release_cached
from anyfit.hardware.runtime import sharding_refusal
from anyfit.model.loading import shared_parameter_names
from anyfit.model.shape import model_shape
from anyfit.planning.ladder import recommend_sharding
from anyfit.planning.presets import this_machine
from anyfit.runfolder import SHARDED_DIR
from anyfit.training.deepspeed_engine import deepspeed_missing, deepspeed_refusal


def is_sharded(model: nn.Module) -> bool:
    from torch.distributed.fsdp import FSDPModule

    return isinstance(model, FSDPModule)


def decoder_layers(model: nn.Module) -> list[nn.Module]:
    """The repeated blocks of a decoder: the largest ``nn.ModuleList`` whose entries share one class (found by
    structure, so it works for Llama/Qwen ``model.layers``, GPT-2 ``transformer.h`` and PEFT-wrapped models)."""
    best: list[nn.Module] = []
    for module in model.modules():
        if isinstance(module, nn.ModuleList) and len(module) > len(best) and len({type(m) for m in module}) == 1:
            best = list(module)
    if not best:
        raise ConfigError(f"runtime.sharding=fsdp: no stack of decoder layers found in {type(model).__name__}.")
    return best


def decide_sharding(cfg: Config, device: str, precision: str, processes: int) -> tuple[bool, bool, str]:
    """(shard, offload to host RAM, the reason printed with it)."""
    mode = cfg.runtime.sharding
    if cfg.runtime.deepspeed_offload and mode != "deepspeed":
        raise ConfigError("runtime.deepspeed_offload=true needs runtime.sharding=deepspeed (FSDP2's offload is "
                          "runtime.fsdp_offload).")
    if mode == "deepspeed":
        refusal = deepspeed_refusal(cfg, device, cfg.train.micro_batch == "auto") or \
            sharding_refusal(cfg, device, precision) or deepspeed_missing()
        if refusal:
            raise ConfigError(refusal)
        offload = cfg.runtime.deepspeed_offload
        return True, offload, ("sharding deepspeed: ZeRO-3 partitions weights, gradients and optimizer states over "
                               f"{processes} process(es)" + (", offloaded to host RAM" if offload else "")
                               + " (asked for in the config)")
    if mode == "none":
        for key in ("fsdp_offload", "fsdp_reduce_every_micro_batch"):
            if getattr(cfg.runtime, key):
                raise ConfigError(f"runtime.{key}=true needs sharding: set runtime.sharding=fsdp (or auto).")
        return False, False, "sharding none: asked for in the config"
    if mode == "auto" and not cfg.runtime.fsdp_offload:
        if processes == 1:
            return False, False, "sharding none: one process, nothing to shard over (auto)"
        use, why = recommend_sharding(cfg, model_shape(cfg.model), this_machine(), processes)
        if not use:
            return False, False, f"sharding none (auto): {why}"
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
    return True, offload, reason


def shard_model(model: nn.Module, compute_dtype: torch.dtype, offload: bool, device: torch.device,
                from_rank0: bool = False) -> nn.Module:
    """FSDP2 full sharding, one unit per decoder layer plus the root. Under bf16 the gathered weights are cast
    to bf16 for compute while gradients are reduced and weights updated in fp32 (FSDP2's mixed precision,
    which replaces autocast here); offload keeps parameters and optimizer states in host RAM.

    ``from_rank0`` (collective): only process 0 has read the weights (the others built ``load_model(...,
    empty=True)``); every process shards the empty model and receives its slices from process 0 (see
    ``_receive_from_rank0``), so no other process ever holds the whole model.

    Where the sharded state lives in host RAM (CPU processes, or offload), the C library is told to return
    freed tensors' memory at once (``keep_host_heap_small``): several processes share that RAM, and each
    otherwise keeps about a model's worth of freed gathers and gradients."""
    from torch.distributed.fsdp import CPUOffloadPolicy, MixedPrecisionPolicy, OffloadPolicy, fully_shard

    if device.type == "cpu" or offload:
        keep_host_heap_small()

    full: dict[str, torch.Tensor] = {}
    if from_rank0:
        full, buffers = _empty_out(model)
    elif not offload:
        model.to(device)
    mixed = MixedPrecisionPolicy(param_dtype=compute_dtype, reduce_dtype=torch.float32) \
        if compute_dtype != torch.float32 else MixedPrecisionPolicy()
    policy = dict(mp_policy=mixed, offload_policy=CPUOffloadPolicy() if offload else OffloadPolicy())
    for layer in decoder_layers(model):
        fully_shard(layer, **policy)
    fully_shard(model, **policy)
    if from_rank0:
        _receive_from_rank0(model, full, buffers, torch.device("cpu") if offload else device)
    return model


def _empty_out(model: nn.Module) -> tuple[dict[str, torch.Tensor], list[tuple[nn.Module, str, torch.Tensor]]]:
    """Move every weight to the meta device before ``fully_shard`` (which then shards shapes, not data), keeping
    what must survive: on process 0 the weights read (a state dict of the very tensors, no copy), on every
    process the buffers that no state dict holds (rotary frequencies: computed at build time, real on the
    processes that built an empty model too)."""
    import torch.distributed as dist

    full = model.state_dict() if dist.get_rank() == 0 else {}
    buffers = [(module, name, buf) for module in model.modules() for name, buf in module._buffers.items()
               if buf is not None and name in module._non_persistent_buffers_set]
    tied = shared_parameter_names(model)
    model.to("meta")
    _tie(model, tied)  # to() gives each module its own new parameter: tied embeddings would come apart
    return full, buffers


def _receive_from_rank0(model: nn.Module, full: dict[str, torch.Tensor],
                        buffers: list[tuple[nn.Module, str, torch.Tensor]], device: torch.device) -> None:
    """Give the sharded, empty model its storage, then its weights: PyTorch's ``set_model_state_dict`` with
    ``broadcast_from_rank0`` sends process 0's full state dict one tensor at a time and each process keeps
    its slice (what torchtitan and Accelerate's ``cpu_ram_efficient_loading`` do; Accelerate hand-writes the
    same loop for older torch). The computed buffers are put back afterwards (``to_empty`` left them empty)."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, set_model_state_dict

    model.to_empty(device=device)
    set_model_state_dict(model, full, options=StateDictOptions(full_state_dict=True, broadcast_from_rank0=True))
    full.clear()  # process 0's full weights go now, not when the caller's frame ends
    for module, name, buf in buffers:
        module.register_buffer(name, buf.to(device), persistent=False)
    release_cached(device.type)  # the broadcast's whole-tensor buffers (and process 0's model) were freed


def _tie(model: nn.Module, shared: list[list[str]]) -> None:
    """Make every name of each group refer to the first name's parameter again."""
    for names in shared:
        param = model.get_parameter(names[0])
        for name in names[1:]:
            owner, _, leaf = name.rpartition(".")
            setattr(model.get_submodule(owner), leaf, param)


@contextlib.contextmanager
def gradient_sync(accelerator, model: nn.Module, sync: bool):
    """Reduce gradients across processes in this backward or not. DDP: Accelerate's ``no_sync``; FSDP2:
    ``set_requires_gradient_sync`` (gradients stay unsharded and local until the last micro-step, which
    reduce-scatters once per window instead of once per micro-batch)."""
    if is_sharded(model):
        model.set_requires_gradient_sync(sync)
        try:
            yield
        finally:
            model.set_requires_gradient_sync(True)
    elif sync:
        yield
    else:
        with accelerator.no_sync(model):
            yield


def local_numel(tensors) -> int:
    """Elements this process holds (a DTensor counts its local shard only, a DeepSpeed ZeRO-3 parameter its
    partition)."""
    from torch.distributed.tensor import DTensor

    def held(t):
        return t.ds_tensor if hasattr(t, "ds_tensor") else t.to_local() if isinstance(t, DTensor) else t

    return sum(held(t).numel() for t in tensors)


def full_state_dict(model: nn.Module) -> dict[str, torch.Tensor]:
    """Every weight, gathered whole on the CPU of the main process (collective: all processes call it;
    the others get an empty dict)."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

    state = get_model_state_dict(model, options=StateDictOptions(full_state_dict=True, cpu_offload=True))
    # Gathered, tied weights (an output head sharing the embedding) come back as separate tensors; keep the
    # first name of each shared parameter so the folder is the one save_pretrained writes unsharded.
    for shared in shared_parameter_names(model):
        for name in shared[1:]:
            state.pop(name, None)
    return state


def save_sharded(model: nn.Module, optimizer, directory: Path) -> None:
    """Each process writes its shards of the weights and optimizer states (collective)."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict

    model_state, optim_state = get_state_dict(model, optimizer)
    dcp.save({"model": model_state, "optimizer": optim_state}, checkpoint_id=str(directory / SHARDED_DIR))


def load_sharded(model: nn.Module, optimizer, directory: Path) -> None:
    """Read shards written by any number of processes into this run's sharding (collective)."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

    model_state, optim_state = get_state_dict(model, optimizer)
    state = {"model": model_state, "optimizer": optim_state}
    dcp.load(state, checkpoint_id=str(directory / SHARDED_DIR))
    set_state_dict(model, optimizer, model_state_dict=state["model"], optim_state_dict=state["optimizer"])

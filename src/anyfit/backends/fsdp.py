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
gathered on the main process. One exception: 8-bit AdamW's states (torchao's, ``train.optimizer=adamw_8bit``) are
quantized per process in 256-value blocks of that process's shard, which DCP cannot cut again at other boundaries,
so such a checkpoint continues under FSDP2 on as many processes as wrote it.
"""

from __future__ import annotations

import contextlib
from pathlib import Path

import torch
import yaml
from torch import nn

from anyfit.backends.base import Backend, Loaded
from anyfit.backends.replicated import Replicated
from anyfit.config import ConfigError
from anyfit.hardware.memory import keep_host_heap_small, release_cached
from anyfit.model.layers import decoder_stack
from anyfit.model.loading import load_model, shared_parameter_names
from anyfit.runfolder import RUN_CONFIG

SHARDED_DIR = "sharded"  # inside a checkpoint of an FSDP2 run: every process's torch.distributed.checkpoint files


class FSDP2(Backend):
    """Sharded by FSDP2: a replicated checkpoint's weights go into the model before it is sharded, its
    optimizer state after (``Replicated.read_states``: re-keyed by name); a sharded one loads as written, re-cut
    by DCP for any process count, into a sharded model or a whole one (``read_states``)."""

    name = "fsdp"
    layout = "sharded (FSDP2)"
    folder = SHARDED_DIR
    sharded = True

    def check_checkpoint(self, folder: Path, processes: int, writer: type[Backend]) -> str:
        wrote = written_by(folder) if writer is FSDP2 and eight_bit_states(folder) else processes
        if wrote != processes:
            return (f"holds 8-bit AdamW states that {wrote} FSDP2 process(es) quantized block by block, each of its "
                    f"own shard; they cannot be cut again for this run's {processes}. Launch {wrote} processes to "
                    "continue it, or 'anyfit export' it and start a new run from its weights.")
        return ""

    @classmethod
    def refuse_other(cls, folder: Path, reader: Backend) -> str:
        if not eight_bit_states(folder):
            return ""
        return (f"holds 8-bit AdamW states that {written_by(folder)} FSDP2 process(es) quantized, each of its own "
                f"shard; only FSDP2 on as many processes reads them. Set runtime.sharding=fsdp and launch "
                f"{written_by(folder)}, or 'anyfit export' it and start a new run from its weights.")

    def load(self, cfg, policy, accelerator, resume_from: Path | None, say) -> Loaded:
        # Over several processes only process 0 reads the weights: the others build the model empty and
        # receive their shards from it (host RAM: one copy of the model, not one per process)
        from_rank0 = accelerator.num_processes > 1
        loaded = Loaded.of(load_model(cfg, policy, accelerator.local_process_index,
                                      empty=from_rank0 and not accelerator.is_main_process), cfg, say)
        if resume_from is not None and not self.wrote(resume_from) and loaded.read:
            # a replicated checkpoint (ZeRO-3's are refused before: ``continue_problem``): its weights are sharded
            # with the model below, its optimizer state follows in ``load_states``
            Replicated.read_whole(resume_from, loaded.model)
        loaded.model = shard_model(loaded.model, policy.compute_dtype, self.offload, accelerator.device, from_rank0)
        say(f"[anyfit] model sharded over {accelerator.num_processes} process(es)"
            + (": read once, by process 0; the others received their shards from it" if from_rank0 else ""))
        return loaded

    def sync(self, accelerator, model, last: bool):
        """``set_requires_gradient_sync``: gradients stay unsharded and local until the window's last
        micro-batch, which reduce-scatters once per window (or after every micro-batch: ``reduce_every``)."""
        return _gradient_sync(model, last or self.reduce_every)

    def no_sync(self, accelerator, model):
        return _gradient_sync(model, False)

    def after_eval(self, model) -> None:
        model.reshard()  # FSDP2 keeps the root's gathered weights after a forward (for the backward that follows)

    def full_state_dict(self, accelerator, model) -> dict[str, torch.Tensor]:
        return full_state_dict(model)

    def save_states(self, accelerator, model, optimizer, folder: Path, save_weights) -> None:
        save_sharded(model, optimizer, folder)  # every process writes its own shards of weights and states

    @classmethod
    def read_states(cls, folder: Path, model, optimizer, reader: Backend) -> None:
        # DCP fills a sharded model's slices or a whole model's tensors alike, from however many processes wrote them
        load_sharded(model, getattr(optimizer, "optimizer", optimizer), folder)  # the torch optimizer Accelerate wraps

    @classmethod
    def read_whole(cls, folder: Path, model) -> None:
        import torch.distributed.checkpoint as dcp

        # with no process group, one process plans and reads every process's slices into these very tensors
        dcp.load({"model": model.state_dict()}, checkpoint_id=str(folder / SHARDED_DIR))


def eight_bit_states(folder: Path) -> bool:
    """Whether a checkpoint's optimizer states are 8-bit (its config.yaml trained with adamw_8bit)."""
    try:
        saved = yaml.safe_load((folder / RUN_CONFIG).read_text())
    except (OSError, UnicodeDecodeError, yaml.YAMLError):
        return False
    train = saved.get("train") if isinstance(saved, dict) else None
    return isinstance(train, dict) and train.get("optimizer") == "adamw_8bit"


def written_by(folder: Path) -> int:
    """How many processes wrote a sharded checkpoint (DCP writes one ``__<rank>_0.distcp`` file per process)."""
    return len(list((folder / SHARDED_DIR).glob("__*_0.distcp")))


@contextlib.contextmanager
def _gradient_sync(model: nn.Module, sync: bool):
    """Reduce gradients across processes in this backward or not (FSDP2's switch, restored after)."""
    model.set_requires_gradient_sync(sync)
    try:
        yield
    finally:
        model.set_requires_gradient_sync(True)


def decoder_layers(model: nn.Module) -> list[nn.Module]:
    """The decoder layers, each one FSDP unit (``anyfit.model.layers``)."""
    stack = decoder_stack(model)
    if stack is None:
        raise ConfigError(f"runtime.sharding=fsdp: no stack of decoder layers found in {type(model).__name__}.")
    return list(stack[1])


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

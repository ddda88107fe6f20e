"""DeepSpeed ZeRO-3 through anyfit's own loop (``runtime.sharding: deepspeed``), on CUDA and on CPU alike.

anyfit builds DeepSpeed's engine itself (``deepspeed.initialize`` with a config written from anyfit's own
settings) instead of handing the run to Accelerate's DeepSpeed plugin: that plugin is dropped on CPU (the run
would train as plain DDP while saying ZeRO-3) and, where it engages, it owns the accumulation, loss scaling and
clipping. Here the engine holds the ZeRO-3 partitions and the update, and anyfit keeps what its guarantees rest on:

- the loss: each micro-batch's summed token loss is scaled once, by anyfit, to the mean over the whole window's
  trainable tokens on every process (``backward(..., scale_wrt_gas=False)``: DeepSpeed does not divide again);
- the window: ``managed_gradient_accumulation: false``, so anyfit's accumulation window, however many micro-batches
  it has, ends where anyfit calls ``step()`` (DeepSpeed's own counter never decides it);
- the clip: ``train.max_grad_norm`` is the engine's ``gradient_clipping``; the norm it measured is logged;
- non-finite windows: ZeRO-3 skips the update when the gradient norm is not finite (in every precision) and says
  so through ``was_step_applied``; anyfit counts it like any other skipped step;
- loading: the model is built partitioned (transformers' ``zero.Init`` loading, ``partitioned_loading``): process 0
  reads the weights, no process holds the whole model;
- checkpoints: the engine's own files under ``checkpoint-N/deepspeed/`` (exact resume, same process count),
  anyfit's scheduler, RNG and trainer state beside them; the final model gathered to one safetensors folder
  from the fp32 master weights.

Offload (``runtime.deepspeed_offload``): ZeRO-3's parameter and optimizer-state offload to host RAM (the hardware
guide's "ZeRO-3 + CPU offload"); on CUDA the update runs in DeepSpeed's CPU Adam.
"""

from __future__ import annotations

import contextlib
import importlib.util
import os
import sys
import warnings
from pathlib import Path

import torch

from anyfit.config import Config, ConfigError
from anyfit.runfolder import DEEPSPEED_DIR

_TAG = "state"  # the one tag under DEEPSPEED_DIR (anyfit's checkpoint folder already names the step)


def is_deepspeed(model) -> bool:
    """Whether ``model`` is a DeepSpeed engine (without importing DeepSpeed when no run has)."""
    ds = sys.modules.get("deepspeed")
    return ds is not None and isinstance(model, ds.DeepSpeedEngine)


def deepspeed_refusal(cfg: Config, device: str, micro_batch_auto: bool) -> str:
    """Why this run's config cannot use ``runtime.sharding=deepspeed`` ('' when it can); the rules FSDP2 shares
    (QLoRA, Adafactor, 8-bit optimizers, fp16, generation during training) and whether DeepSpeed is installed
    (``deepspeed_missing``) are checked by the caller, in that order."""
    if device not in ("cuda", "cpu"):
        return f"runtime.sharding=deepspeed runs on cuda or cpu, not {device}."
    if micro_batch_auto:
        return ("train.micro_batch=auto with runtime.sharding=deepspeed: DeepSpeed fixes the micro-batch when its "
                "engine is built, before anything can be measured. Set train.micro_batch to a number ('anyfit plan' "
                "suggests one).")
    if cfg.runtime.compile:
        return ("runtime.compile=true with runtime.sharding=deepspeed is not supported by anyfit: set "
                "runtime.compile=false.")
    if cfg.runtime.fsdp_offload or cfg.runtime.fsdp_reduce_every_micro_batch:
        return ("runtime.fsdp_* settings are FSDP2's: with runtime.sharding=deepspeed use runtime.deepspeed_offload "
                "(ZeRO-3 reduce-scatters every micro-batch already).")
    return ""


def deepspeed_missing() -> str:
    """Why DeepSpeed cannot be used here ('' when it is installed; not imported here: that takes seconds)."""
    if importlib.util.find_spec("deepspeed") is None:
        return ("runtime.sharding=deepspeed needs DeepSpeed: pip install 'anyfit[deepspeed]' (or use "
                "runtime.sharding=fsdp, PyTorch's own sharding, with runtime.fsdp_offload=true for CPU offload).")
    return ""


def select_accelerator(device: str) -> None:
    """Tell DeepSpeed which accelerator to use before it is first imported: on a CPU run DeepSpeed's CPU back end
    (which communicates over gloo when oneCCL is absent); on CUDA DeepSpeed finds the GPU itself."""
    if device == "cpu":
        os.environ.setdefault("DS_ACCELERATOR", "cpu")


def engine_config(cfg: Config, micro_batch: int, accumulation: int, processes: int, precision: str,
                  offload: bool, pin_memory: bool) -> dict:
    """The DeepSpeed config anyfit's settings amount to (recorded in run_info.json)."""
    zero: dict = {"stage": 3, "stage3_gather_16bit_weights_on_model_save": False}
    if offload:
        where = {"device": "cpu", "pin_memory": pin_memory}
        zero |= {"offload_param": dict(where), "offload_optimizer": dict(where)}
    return {
        "train_micro_batch_size_per_gpu": micro_batch,
        "gradient_accumulation_steps": accumulation,
        "train_batch_size": micro_batch * accumulation * processes,
        # anyfit's window is the boundary: the reduction is finished and the update taken where anyfit calls
        # step(), after however many micro-batches the window has
        "managed_gradient_accumulation": False,
        "gradient_clipping": max(0.0, cfg.train.max_grad_norm),
        "zero_optimization": zero,
        "bf16": {"enabled": precision == "bf16"},
        # anyfit's own optimizer (torch's AdamW) is what the config chose; DeepSpeed's check is for its own ones
        "zero_allow_untested_optimizer": True,
        "zero_force_ds_cpu_optimizer": False,
        "steps_per_print": 2**31 - 1,  # anyfit logs the steps
        "wall_clock_breakdown": False,
    }


def host_optimizer(optimizer: torch.optim.Optimizer, cfg: Config, device: str) -> torch.optim.Optimizer:
    """With offload on CUDA the update runs on host-RAM states: DeepSpeed's vectorised CPU Adam (AdamW mode, the
    same parameter groups and hyper-parameters) instead of torch's AdamW, several times slower there. Otherwise
    anyfit's optimizer as it is."""
    if not (cfg.runtime.deepspeed_offload and device == "cuda" and cfg.train.optimizer == "adamw"):
        return optimizer
    from deepspeed.ops.adam import DeepSpeedCPUAdam

    d = optimizer.defaults
    groups = [{"params": g["params"], "weight_decay": g["weight_decay"]} for g in optimizer.param_groups]
    return DeepSpeedCPUAdam(groups, lr=d["lr"], betas=d["betas"], eps=d["eps"], adamw_mode=True)


def _process_group(device: str) -> None:
    """One process without a launcher gets a one-process group of its own (PyTorch's in-memory store), which is
    all DeepSpeed's communication needs; under a launcher Accelerate has made the group already."""
    import torch.distributed as dist

    backend = "gloo" if device == "cpu" else "nccl"
    if not dist.is_initialized():
        dist.init_process_group(backend, store=dist.HashStore(), rank=0, world_size=1)
        os.environ.setdefault("LOCAL_RANK", "0")  # what a launcher sets; DeepSpeed reads it from the environment
    import deepspeed

    deepspeed.init_distributed(dist_backend=backend, dist_init_required=False, verbose=False)  # wraps the group


@contextlib.contextmanager
def partitioned_loading(config: dict, device: str):
    """Load the model inside this to have it partitioned as it is built: transformers' ``from_pretrained`` sees
    DeepSpeed's config (its ``HfDeepSpeedConfig``, what Accelerate and TRL use), builds the model under
    ``deepspeed.zero.Init`` and copies the weights in on process 0 alone (the others read only names and shapes),
    so no process ever holds the whole model. Collective: every process loads."""
    _process_group(device)
    from transformers.integrations import HfDeepSpeedConfig

    seen_by_transformers = HfDeepSpeedConfig(config)  # transformers holds a weak reference: alive while loading
    try:
        yield
    finally:
        del seen_by_transformers


def elements_read(model: torch.nn.Module, main: bool) -> int:
    """Parameter elements this process read from the weights after ``partitioned_loading``: process 0 read every
    partitioned weight, the others none; a parameter built outside ``zero.Init`` (LoRA adapters) is whole
    everywhere."""
    return sum((p.ds_numel if main else 0) if hasattr(p, "ds_numel") else p.numel() for p in model.parameters())


def build_engine(model: torch.nn.Module, optimizer: torch.optim.Optimizer, config: dict, device: str):
    """The ZeRO-3 engine over ``model`` (partitioned already, or whole) and ``optimizer`` (collective)."""
    _process_group(device)
    import deepspeed

    # DeepSpeed 0.19 calls torch.distributed collectives torch 2.13 renamed: one warning per call, every step
    warnings.filterwarnings("ignore", message=r"`torch\.distributed\.(all_gather_into_tensor|reduce_scatter_tensor)` "
                            "is deprecated", category=FutureWarning)
    engine, _, _, _ = deepspeed.initialize(model=model, optimizer=optimizer, config=config, dist_init_required=False)
    return engine


def backward(engine, loss: torch.Tensor) -> None:
    """One micro-batch's backward; ``loss`` is already scaled by anyfit (no division by the accumulation)."""
    engine.backward(loss, scale_wrt_gas=False)


def step(engine, loss_sum: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """End the window: reduce, clip to ``train.max_grad_norm``, update unless the gradient norm is not finite.
    Returns (the gradient norm before clipping, whether the update was applied and the loss finite), both as
    tensors the loop reads on logged steps only (DeepSpeed itself has read the norm to decide)."""
    engine.step()
    norm = engine.get_global_grad_norm()
    norm = norm.detach() if isinstance(norm, torch.Tensor) else torch.tensor(float("nan") if norm is None else norm)
    return norm, torch.isfinite(loss_sum) & bool(engine.was_step_applied())


def full_state_dict(engine, main: bool) -> dict[str, torch.Tensor]:
    """Every weight, whole, on the CPU of the main process (collective): trained weights from the fp32 master
    copy (under bf16 the module's own copy is bf16), frozen ones (a LoRA base) gathered as they are."""
    import deepspeed
    from deepspeed.utils import safe_get_full_fp32_param

    state: dict[str, torch.Tensor] = {}
    for name, param in engine.module.named_parameters():  # a tied weight once, under its first name
        if param.requires_grad:
            full = safe_get_full_fp32_param(param)
        else:
            with deepspeed.zero.GatheredParameters([param]):
                full = param.data.detach().clone()
        if main:
            state[name] = full.to("cpu", copy=True)
    for name, buf in engine.module.named_buffers():  # persistent buffers are never partitioned
        owner, _, leaf = name.rpartition(".")
        if main and leaf not in engine.module.get_submodule(owner)._non_persistent_buffers_set:
            state[name] = buf.detach().to("cpu", copy=True)
    return state


def save_engine(engine, directory: Path) -> None:
    """The engine's partitions and optimizer states, each process its own files (collective)."""
    engine.save_checkpoint(str(directory / DEEPSPEED_DIR), tag=_TAG, save_latest=False)


def saved_deepspeed(directory: Path) -> bool:
    return (directory / DEEPSPEED_DIR).is_dir()


def saved_processes(directory: Path) -> int:
    """How many processes wrote a DeepSpeed checkpoint (one model-state file each)."""
    return len(list((directory / DEEPSPEED_DIR / _TAG).glob("*_model_states.pt")))


def load_engine(engine, directory: Path) -> None:
    """Restore partitions and optimizer states written by the same number of processes (collective)."""
    path, _ = engine.load_checkpoint(str(directory / DEEPSPEED_DIR), tag=_TAG, load_optimizer_states=True,
                                     load_lr_scheduler_states=False, load_module_strict=True)
    if path is None:
        raise ConfigError(f"train.resume: DeepSpeed could not read {directory / DEEPSPEED_DIR}; resume from "
                          "another checkpoint or start a new run in another train.output_dir.")

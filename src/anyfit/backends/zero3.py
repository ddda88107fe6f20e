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
import warnings
from dataclasses import replace
from pathlib import Path

import torch

from anyfit.backends.base import Backend, Loaded
from anyfit.config import Config, ConfigError
from anyfit.model.loading import load_model, shared_parameter_names
from anyfit.model.source import dequantized

DEEPSPEED_DIR = "deepspeed"  # inside a checkpoint of a ZeRO-3 run: the engine's own files, every process's
_TAG = "state"  # the one tag under DEEPSPEED_DIR (anyfit's checkpoint folder already names the step)


class ZeRO3(Backend):
    """DeepSpeed's engine holds the partitions and the update; its checkpoints continue under ZeRO-3 on as many
    processes as wrote them."""

    name = "deepspeed"
    layout = "written by DeepSpeed ZeRO-3"
    folder = DEEPSPEED_DIR
    sharded = True
    redo_after_oom = False  # ZeRO-3 reduce-scatters in every backward: part of the window is reduced already

    def __init__(self, reason: str, offload: bool, config: dict):
        super().__init__(reason, offload=offload, reduce_every=True)
        self.config = config  # what anyfit's settings amount to (``engine_config``)

    def load(self, cfg, policy, accelerator, resume_from: Path | None, say) -> Loaded:
        select_accelerator(policy.device)
        # partitioned loading reads safetensors on process 0 alone, but a GGUF file whole on every process: a GGUF
        # model is converted once (process 0 first, the others reuse its folder) and loaded from safetensors
        with accelerator.local_main_process_first():
            from_folder = replace(cfg, model=dequantized(cfg.model))
        if from_folder.model is not cfg.model:
            say(f"[anyfit] GGUF model read from its safetensors conversion {from_folder.model.name_or_path}")
        with partitioned_loading(self.config, policy.device):
            model = load_model(from_folder, policy, accelerator.local_process_index)
        return Loaded.of(model, cfg, say, read=elements_read(model, accelerator.is_main_process))

    def optimizer(self, optimizer, cfg, device: str):
        return host_optimizer(optimizer, cfg, device)

    def wrap(self, model, optimizer, accelerator, say):
        engine = build_engine(model, optimizer, self.config, accelerator.device.type)
        say(f"[anyfit] model partitioned by DeepSpeed ZeRO-3 over {accelerator.num_processes} process(es) as it "
            "was built (process 0 read the weights)" + (", parameters and optimizer states in host RAM"
                                                         if self.offload else ""))
        return engine, engine.optimizer

    def backward(self, accelerator, model, loss) -> None:
        model.backward(loss, scale_wrt_gas=False)  # scaled by anyfit already: no division by the accumulation

    def update(self, accelerator, model, optimizer, loss_sum, max_norm: float, precision: str):
        """Reduce, clip to ``train.max_grad_norm`` and skip a non-finite update: DeepSpeed does each itself.
        Returns tensors the loop reads on logged steps only (DeepSpeed itself has read the norm to decide)."""
        model.step()
        norm = model.get_global_grad_norm()
        norm = norm.detach() if isinstance(norm, torch.Tensor) else torch.tensor(float("nan") if norm is None
                                                                                  else norm)
        return norm, torch.isfinite(loss_sum) & bool(model.was_step_applied())

    def full_state_dict(self, accelerator, model) -> dict[str, torch.Tensor]:
        return full_state_dict(model, accelerator.is_main_process)

    def save_states(self, accelerator, model, optimizer, folder: Path, save_weights) -> None:
        # the engine's partitions and optimizer states, each process its own files
        model.save_checkpoint(str(folder / DEEPSPEED_DIR), tag=_TAG, save_latest=False)

    @classmethod
    def read_states(cls, folder: Path, model, optimizer, reader: Backend) -> None:
        # only ZeRO-3 on as many processes reads these (``check_checkpoint``): ``model`` is its engine
        path, _ = model.load_checkpoint(str(folder / DEEPSPEED_DIR), tag=_TAG, load_optimizer_states=True,
                                        load_lr_scheduler_states=False, load_module_strict=True)
        if path is None:
            raise ConfigError(f"train.resume: DeepSpeed could not read {folder / DEEPSPEED_DIR}; resume from "
                              "another checkpoint or start a new run in another train.output_dir.")

    def check_checkpoint(self, folder: Path, processes: int, writer: type[Backend]) -> str:
        if writer is not ZeRO3:
            return (f"is {writer.layout}; DeepSpeed ZeRO-3 continues only its own checkpoints. Continue it with "
                    "runtime.sharding=fsdp or none (any process count), or start a new run in another "
                    "train.output_dir.")
        wrote = saved_processes(folder)
        if wrote != processes:
            return (f"was written by {wrote} DeepSpeed ZeRO-3 process(es); ZeRO-3 continues it on exactly as many, "
                    f"and this run has {processes}. Launch {wrote}.")
        return ""

    @classmethod
    def refuse_other(cls, folder: Path, reader: Backend) -> str:
        return (f"was written by DeepSpeed ZeRO-3, which alone reads its optimizer states: set "
                f"runtime.sharding=deepspeed and launch {saved_processes(folder)} process(es) to continue it, or "
                "'anyfit export' it for its weights.")

    @classmethod
    def read_whole(cls, folder: Path, model) -> None:
        """DeepSpeed's zero_to_fp32 (the fp32 master weights, every process's partitions joined), on the CPU."""
        os.environ.setdefault("DS_ACCELERATOR", "cpu")  # reading files needs no accelerator: DeepSpeed's CPU one
        try:
            from deepspeed.utils.zero_to_fp32 import get_fp32_state_dict_from_zero_checkpoint
        except ImportError:
            raise ConfigError(f"{folder / DEEPSPEED_DIR} was written by DeepSpeed ZeRO-3: reading it needs DeepSpeed "
                              "(pip install 'anyfit[deepspeed]').") from None

        state = get_fp32_state_dict_from_zero_checkpoint(str(folder / DEEPSPEED_DIR), tag=_TAG)
        missing_keys, unexpected = model.load_state_dict(state, strict=False)
        tied = {name for group in shared_parameter_names(model) for name in group[1:]}  # saved under the first name
        if [k for k in missing_keys if k not in tied] or unexpected:
            raise ConfigError(f"{folder / DEEPSPEED_DIR} does not hold this model's weights (missing "
                              f"{list(missing_keys)[:3]}, unexpected {list(unexpected)[:3]}); export a checkpoint "
                              "of this run.")


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


def saved_processes(directory: Path) -> int:
    """How many processes wrote a DeepSpeed checkpoint (one model-state file each)."""
    return len(list((directory / DEEPSPEED_DIR / _TAG).glob("*_model_states.pt")))

"""The one interface every way of spreading a run over processes implements, and the update they share.

A backend is chosen once per run (``anyfit.backends.choose``) and then asked, never branched on: the loop,
checkpointing, the micro-batch probe, validation, export and the profiler call these methods. Adding a way of
spreading the model and its states over processes is one subclass in its own module and its place in
``choose``. Sequence parallelism is not one: it splits each sequence over a group of processes
beside whichever backend holds the states (``anyfit.backends.sequence``, applied by the loop).

Each backend writes its checkpoints in its own format and is the only one that reads that format: it declares
what it writes (``folder``, ``wrote``, ``unlisted``), and ``read_states``/``read_whole`` read it into whatever
layout the reading run holds (relayout). Which backend wrote a folder is decided in one place
(``anyfit.backends.choose.writer_of``).

The update for backends whose optimizer is a torch optimizer (replicated and FSDP2): clip the global gradient
norm, then step unless the loss or the gradient is not finite; where the optimizer is fused, the skip happens in
its kernel (torch's ``found_inf`` protocol) so the host never waits for the device to learn it.
"""

from __future__ import annotations

import contextlib
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, ClassVar

import torch
from torch import nn

from anyfit.model.loading import count_parameters, load_model
from anyfit.model.moe import moe_summary
from anyfit.model.unloaded import UnloadedTensors, find_unloaded


@dataclass
class Loaded:
    """A model as a backend loaded it, with its sizes counted before any sharding."""

    model: nn.Module
    trainable: int  # parameters, whole-model counts
    total: int
    read: int  # parameter elements this process read from the weights (none on the meta device)
    # tensors of the source checkpoint the model does not load (mtp.*), written beside a full fine-tune's weights
    unloaded: UnloadedTensors | None = None

    @classmethod
    def of(cls, model: nn.Module, cfg, say, read: int | None = None) -> Loaded:
        trainable, total = count_parameters(model)
        lora = cfg.lora.enabled or cfg.lora.qlora
        say(f"[anyfit] model: {total / 1e6:.1f}M parameters, {trainable / 1e6:.2f}M trainable "
            f"({'LoRA' if lora else 'full fine-tuning'})")
        for line in moe_summary(model, trainable, lora, cfg.train.router_aux_loss_coef):  # a mixture of experts
            say(line)
        for line in getattr(model, "anyfit_parts", []):  # a composite: which of its parts train
            say(line)
        unloaded = None if lora else find_unloaded(model, cfg.model)  # an adapter is saved alone: it needs none
        if unloaded is not None:
            say(unloaded.line())
        return cls(model, trainable, total, read_elements(model) if read is None else read, unloaded)


class Backend:
    """How the model, gradients and optimizer states of one run live on its processes.

    Setup (collective): ``load`` (the model, read or received, sharded if this backend shards), ``optimizer``
    (the optimizer the update runs, from anyfit's), ``wrap`` (the objects the loop steps). A window: ``sync``
    around each micro-batch's forward/backward, ``backward``, then ``update``. States: ``full_state_dict``,
    ``save_states``/``load_states`` into a checkpoint folder, ``check_checkpoint`` before anything loads.
    The format it writes (class methods, asked by the backend that wrote a folder): ``wrote``/``wrote_files``
    (is it this backend's), ``unlisted`` (what a manifest lacks of it), ``read_states`` (into any reader's model
    and optimizer), ``read_whole`` (the weights in one process, without the ones that wrote them)."""

    name: ClassVar[str]  # runtime.sharding's value
    layout: ClassVar[str]  # how its checkpoints are laid out, in words
    folder: ClassVar[str | None] = None  # the checkpoint sub-folder its states are written under (None: none)
    sharded: ClassVar[bool] = False  # each process holds a part of the states; every forward is collective
    redo_after_oom: ClassVar[bool] = True  # a window cut short by out-of-memory may be redone whole

    def __init__(self, reason: str, offload: bool = False, reduce_every: bool = False):
        self.reason = reason  # printed with the runtime line: why this backend, as configured or chosen
        self.offload = offload  # states (and the update) in host RAM
        self.reduce_every = reduce_every  # gradients reduced after every micro-batch, not once per window

    # -- setup (collective) ---------------------------------------------------------------------------------
    def load(self, cfg, policy, accelerator, resume_from: Path | None, say) -> Loaded:
        """The model as this backend holds it. A resumed checkpoint's weights come in ``load_states``, unless
        this backend must read them before it shards."""
        return Loaded.of(load_model(cfg, policy, accelerator.local_process_index), cfg, say)

    def optimizer(self, optimizer: torch.optim.Optimizer, cfg, device: str) -> torch.optim.Optimizer:
        """The optimizer the update runs (anyfit's own, unless the backend's is faster where its states live)."""
        return optimizer

    def wrap(self, model: nn.Module, optimizer, accelerator, say) -> tuple[nn.Module, object]:
        """The model and optimizer the loop steps."""
        return model, optimizer

    # -- one window ---------------------------------------------------------------------------------------
    def sync(self, accelerator, model: nn.Module, last: bool):
        """Around one micro-batch's forward and backward: whether its gradients are reduced now (the window's
        last micro-batch, or every one where this backend reduces each)."""
        return contextlib.nullcontext()

    def no_sync(self, accelerator, model: nn.Module):
        """Around forwards and backwards whose gradients are never reduced (the micro-batch probe)."""
        return self.sync(accelerator, model, last=False)

    def backward(self, accelerator, model: nn.Module, loss: torch.Tensor) -> None:
        accelerator.backward(loss)

    def update(self, accelerator, model: nn.Module, optimizer, loss_sum: torch.Tensor, max_norm: float,
               precision: str) -> tuple[torch.Tensor, torch.Tensor | bool]:
        """End the window: (the gradient norm before clipping, whether the update was applied)."""
        norm = clip_gradients(accelerator, model, max_norm)
        return norm, guarded_step(optimizer, is_finite_step(loss_sum, norm, precision),
                                  skips_on_device(optimizer, precision))

    def after_eval(self, model: nn.Module) -> None:
        """After forwards with no backward (validation): free what the backend kept for a backward."""

    # -- states -------------------------------------------------------------------------------------------
    def full_state_dict(self, accelerator, model: nn.Module) -> dict[str, torch.Tensor]:
        """Every weight, whole, on the main process (collective; the others may get an empty dict)."""
        return accelerator.get_state_dict(model)

    def save_states(self, accelerator, model: nn.Module, optimizer, folder: Path, save_weights: Callable[[], None]
                    ) -> None:
        """The model and optimizer states into a checkpoint folder (collective). ``save_weights()`` writes the
        whole weights as an ordinary model folder (safetensors, the adapter for LoRA)."""
        raise NotImplementedError

    def load_states(self, accelerator, model: nn.Module, optimizer, folder: Path, writer: type[Backend]) -> None:
        """A checkpoint's model and optimizer states into this run's (collective): the backend that wrote
        ``folder`` reads them (``read_states``) into the objects this one holds."""
        writer.read_states(folder, model, optimizer, self)

    def check_checkpoint(self, folder: Path, processes: int, writer: type[Backend]) -> str:
        """Why this backend cannot continue, with ``processes``, the checkpoint ``writer`` wrote in ``folder``
        ('' when it can); the sentence follows "train.resume: checkpoint <folder>"."""
        return ""

    @classmethod
    def refuse_other(cls, folder: Path, reader: Backend) -> str:
        """Why another backend cannot continue the checkpoint this one wrote ('' when it can), as above."""
        return ""

    # -- the format it writes (class methods: asked of the backend that wrote a folder) -------------------------
    @classmethod
    def wrote(cls, folder: Path) -> bool:
        """Whether this backend wrote the checkpoint in ``folder``."""
        return cls.folder is not None and (folder / cls.folder).is_dir()

    @classmethod
    def wrote_files(cls, names: set[str]) -> bool:
        """Whether a checkpoint holding ``names`` (paths inside it, as its manifest lists them) is this backend's."""
        return cls.folder is not None and any(name.startswith(f"{cls.folder}/") for name in names)

    @classmethod
    def unlisted(cls, names: set[str]) -> list[str]:
        """The files of this backend's states that a checkpoint holding ``names`` lacks, in words ([]: none)."""
        return []

    @classmethod
    def read_states(cls, folder: Path, model: nn.Module, optimizer, reader: Backend) -> None:
        """The model and optimizer states this backend wrote in ``folder`` into ``reader``'s (collective): the
        objects as ``reader`` holds them, sharded or whole, on as many processes as it runs."""
        raise NotImplementedError

    @classmethod
    def read_whole(cls, folder: Path, model: nn.Module) -> None:
        """Read the checkpoint this backend wrote into ``model``'s whole tensors, in one process."""
        raise NotImplementedError


def read_elements(model: nn.Module) -> int:
    """Parameter elements a process holds real data for (none on the meta device: a model built empty)."""
    return sum(p.numel() for p in model.parameters() if not p.is_meta)


def local_numel(tensors) -> int:
    """Elements this process holds (a DTensor counts its local shard only, a DeepSpeed ZeRO-3 parameter its
    partition)."""
    from torch.distributed.tensor import DTensor

    def held(t):
        return t.ds_tensor if hasattr(t, "ds_tensor") else t.to_local() if isinstance(t, DTensor) else t

    return sum(held(t).numel() for t in tensors)


def local_bytes(tensors) -> int:
    """Bytes this process holds for ``tensors``: a tensor subclass (torchao's 8-bit optimizer states) counts
    the plain tensors it is made of (codes and scales), not its nominal shape times its nominal dtype."""
    from torch.distributed.tensor import DTensor
    from torch.utils._python_dispatch import is_traceable_wrapper_subclass

    def size(t) -> int:
        t = t.ds_tensor if hasattr(t, "ds_tensor") else t.to_local() if isinstance(t, DTensor) else t
        if is_traceable_wrapper_subclass(t):
            return sum(size(getattr(t, name)) for name in t.__tensor_flatten__()[0])
        return t.numel() * t.element_size()

    return sum(size(t) for t in tensors)


def clip_gradients(accelerator, model, max_norm: float) -> torch.Tensor:
    """Clip the global gradient norm (over all processes' shards when sharded); returns the norm before clipping."""
    norm = accelerator.clip_grad_norm_(model.parameters(), max_norm)
    full_tensor = getattr(norm, "full_tensor", None)  # a DTensor under FSDP2: the same value on every process
    return full_tensor() if full_tensor is not None else norm


def is_finite_step(loss_sum: torch.Tensor, grad_norm: torch.Tensor, precision: str) -> torch.Tensor:
    """Whether the update may be applied (a device flag). Under fp16 a non-finite gradient is the loss
    scaler's business (it skips the step and lowers the scale), not a failure of the run."""
    if precision == "fp16":
        return torch.isfinite(loss_sum)
    return torch.isfinite(loss_sum) & torch.isfinite(grad_norm)


def skips_on_device(optimizer, precision: str) -> bool:
    """Whether ``guarded_step`` can skip on the device: the optimizer is fused and no GradScaler owns the
    ``found_inf`` protocol already (fp16)."""
    inner = getattr(optimizer, "optimizer", optimizer)  # Accelerate's AcceleratedOptimizer wraps the torch one
    return precision != "fp16" and bool(inner.defaults.get("fused"))


def guarded_step(optimizer, finite: torch.Tensor, on_device: bool) -> torch.Tensor | bool:
    """Apply the update unless ``finite`` is false; returns the flag (still on the device when ``on_device``).

    ``on_device``: torch's fused AdamW reads a ``found_inf`` tensor set on the optimizer (the protocol torch's
    GradScaler uses with fused optimizers) and skips the update, step count included, inside its kernel, so
    the host never waits for the GPU to learn whether the step was finite. Otherwise the flag is read here
    (a host sync) and a non-finite step is not taken.
    """
    if on_device:
        inner = getattr(optimizer, "optimizer", optimizer)
        inner.found_inf = (~finite).float()
        try:
            optimizer.step()
        finally:
            del inner.found_inf
        return finite
    finite = bool(finite)
    if finite:
        optimizer.step()
    return finite


def unwrapped(model: nn.Module) -> nn.Module:
    """The model under the wrappers a run puts around it: DDP, torch.compile, DeepSpeed's engine. Accelerate's
    ``unwrap_model`` does the same, but imports DeepSpeed first wherever it is installed, only to test for its engine
    (2 s of CPU in every process that asks, with mlflow through DeepSpeed where both are installed); an engine can
    exist only once DeepSpeed is imported, so it is looked for only then."""
    wrappers: tuple[type, ...] = (nn.parallel.DistributedDataParallel,)
    if "deepspeed" in sys.modules:
        wrappers += (sys.modules["deepspeed"].DeepSpeedEngine,)
    while True:
        if isinstance(model, wrappers):
            model = model.module
        elif isinstance(getattr(model, "_orig_mod", None), nn.Module):  # torch.compile's OptimizedModule
            model = model._orig_mod
        else:
            return model

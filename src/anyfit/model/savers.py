"""The memory savers that change the model, one hook each: the config key that turns a saver on -> the function that
installs it on a loaded model. ``anyfit.model.loading.load_model`` runs them in this order, after the weights load and
before LoRA wraps the model (each wraps or hooks the model's own modules, which PEFT then finds as they were).

The planner's table of savers (``anyfit.planning.savers.SAVERS``) names each row's hook here by its key; the savers
not listed (the optimizer, sharding, the sequence split) are the training loop's and the backends', not the model's.
"""

from __future__ import annotations

from collections.abc import Callable

from torch import nn

from anyfit.config import Config
from anyfit.hardware.runtime import RuntimePolicy
from anyfit.model.head import fuse_head
from anyfit.model.offload import offload_activations
from anyfit.model.tiled import tile_mlps


def enable_checkpointing(model: nn.Module, every: int = 1) -> None:
    """Activation checkpointing through transformers' own layers, on every ``every``-th decoder layer.

    Non-reentrant checkpointing works with frozen inputs (LoRA) without enable_input_require_grads. Every
    decoder layer of transformers is a ``GradientCheckpointingLayer`` with its own ``gradient_checkpointing``
    switch: enabling it model-wide and switching it off on the layers in between keeps their activations
    (more memory, less recomputation).
    """
    from transformers.modeling_layers import GradientCheckpointingLayer

    if hasattr(model, "activation_checkpointing_enable"):  # transformers >= 5.2x renamed it
        model.activation_checkpointing_enable(activation_checkpointing_kwargs={"use_reentrant": False})
    else:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    model.config.use_cache = False
    layers = [m for m in model.modules() if isinstance(m, GradientCheckpointingLayer)]
    for i, layer in enumerate(layers):
        layer.gradient_checkpointing = i % every == 0


ModelHook = Callable[[nn.Module, Config, RuntimePolicy], object]

MODEL_HOOKS: dict[str, ModelHook] = {
    "model.gradient_checkpointing": lambda model, cfg, policy: enable_checkpointing(model, cfg.model.checkpoint_every),
    # pinned host buffers only where there is a device to copy from
    "model.activation_offload": lambda model, cfg, policy: offload_activations(model, pin=policy.device == "cuda"),
    "model.tiled_mlp": lambda model, cfg, policy: tile_mlps(model),
    "train.fused_loss": lambda model, cfg, policy: fuse_head(model),
}


def install_savers(model: nn.Module, cfg: Config, policy: RuntimePolicy) -> None:
    """Install every saver of ``MODEL_HOOKS`` that ``cfg`` turns on, in the table's order."""
    for key, hook in MODEL_HOOKS.items():
        if cfg.value(key):
            hook(model, cfg, policy)

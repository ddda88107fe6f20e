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
from anyfit.model.vision import checkpointed_stacks, frozen_encoders


def enable_checkpointing(model: nn.Module, every: int = 1, tower: bool = False) -> None:
    """Activation checkpointing through transformers' own layers, on every ``every``-th decoder layer, and on every
    ``every``-th layer of a composite's vision tower when it trains (``tower``).

    Non-reentrant checkpointing works with frozen inputs (LoRA) without enable_input_require_grads. Every
    decoder layer of transformers is a ``GradientCheckpointingLayer`` with its own ``gradient_checkpointing``
    switch: enabling it model-wide and switching it off on the layers in between keeps their activations
    (more memory, less recomputation). transformers' own ``every_n_layers`` counts the layers of the whole model,
    a vision tower's first (they come first in Qwen3.5, Gemma-3, Mistral-3, Llama-4): so each stack is counted
    here on its own, and the planner's "every N-th decoder layer" is the one that runs. A frozen tower's layers are
    off (``anyfit.model.vision.checkpointed_stacks``: no backward runs through them).
    """
    from transformers.modeling_layers import GradientCheckpointingLayer

    if hasattr(model, "activation_checkpointing_enable"):  # transformers >= 5.2x renamed it
        model.activation_checkpointing_enable(activation_checkpointing_kwargs={"use_reentrant": False})
    else:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    model.config.use_cache = False
    language, vision = checkpointed_stacks(model, tower)
    on = {id(layer) for stack in (language, vision) for i, layer in enumerate(stack) if i % every == 0}
    for layer in model.modules():
        if isinstance(layer, GradientCheckpointingLayer):
            layer.gradient_checkpointing = id(layer) in on
    # transformers also hooks the input embeddings of every sub-model, a vision tower's patch embedding included, to
    # make their output require a gradient (for reentrant checkpointing): through a frozen tower that built a graph,
    # kept its activations and ran its whole backward every step, for no gradient of anything
    frozen = {id(m._forward_hooks) for part in frozen_encoders(model, tower) for m in part.modules()}
    for handle in getattr(model, "_require_grads_hooks", []):
        if id(handle.hooks_dict_ref()) in frozen:
            handle.remove()


ModelHook = Callable[[nn.Module, Config, RuntimePolicy], object]

MODEL_HOOKS: dict[str, ModelHook] = {
    "model.gradient_checkpointing": lambda model, cfg, policy: enable_checkpointing(
        model, cfg.model.checkpoint_every, tower=cfg.model.train_vision != "frozen"),
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

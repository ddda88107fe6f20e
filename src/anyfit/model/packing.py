"""What in a model can carry information across an example boundary of a packed row, read from its config and modules.

Packing puts several examples in one row; it is exact only if nothing carries information across the boundary.
Attention is kept apart by ``anyfit.model.attention`` (or transformers' block mask). Layers with a state over the
sequence (linear attention, state spaces, short convolutions: Qwen3.5, Qwen3-Next, LFM2, Falcon-H1, Granite-4.0-H,
Jamba) are not by themselves: transformers' CPU implementations read no example boundaries, and on CUDA only some
kernels take them, so the second example of a row would start from the first one's state. ``state_modules`` finds
these layers; ``anyfit.model.state_layers`` hands them the boundaries (the kernels' keywords, or each example as a
row of its own), and ``anyfit.training.packing_check``'s start-up self-test decides which, if any, is exact. Their
sequences are never split over processes (the state would have to pass between them).
"""

from __future__ import annotations

from dataclasses import dataclass

from torch import nn
from transformers import PreTrainedModel
from transformers.modeling_layers import GradientCheckpointingLayer


@dataclass(frozen=True)
class LayerKind:
    """What packing needs to know of one kind of layer in ``config.layer_types`` (transformers' names)."""

    per_example: bool  # ``anyfit_varlen`` computes it one example at a time itself (else transformers' own attention)
    sliding: bool = False  # attends within ``config.sliding_window`` where the layer does not pass its window
    state: bool = False  # the layer also holds a state along the sequence (an attention and a state layer side by side)


# The kinds of layer that attend. Any other kind in ``config.layer_types`` (linear attention, mamba, conv, ...) holds
# a state along the sequence, as do the kinds marked ``state``.
LAYER_KINDS: dict[str, LayerKind] = {
    "full_attention": LayerKind(per_example=True),
    "sliding_attention": LayerKind(per_example=True, sliding=True),
    "chunked_attention": LayerKind(per_example=False),  # chunks: a pattern anyfit_varlen does not split per slice
    "attention": LayerKind(per_example=True),  # hybrids' name for full attention (Jamba, Granite-4.0-H before 5.2x)
    "hybrid": LayerKind(per_example=True, state=True),  # Falcon-H1, Zamba2: full attention beside a Mamba-2 mixer
}
# Class-name parts of layers with a state over the sequence (besides any module owning a depthwise convolution).
_STATEFUL = ("mamba", "gateddeltanet", "deltanet", "linearattention", "lightningattention", "deltaattention",
             "shortconv", "rwkv", "recurrentblock")


def _text(config):
    return config.get_text_config() if hasattr(config, "get_text_config") else config


def stateful_kinds(config) -> str:
    """The config's layer kinds that carry a state along the sequence, described ('' when every layer attends)."""
    kinds = sorted(k for k in set(getattr(_text(config), "layer_types", None) or [])
                   if k not in LAYER_KINDS or LAYER_KINDS[k].state)
    return f"its {', '.join(repr(k) for k in kinds)} layers" if kinds else ""


def stateful_layers(model: nn.Module) -> str:
    """What in the model carries a state along the sequence: the config's layer kinds, else its modules' classes."""
    found = stateful_kinds(model.config)
    if found:
        return found
    names = sorted({type(m).__name__ for m in state_modules(model)})
    return f"its {', '.join(names)} layers" if names else ""


def _holds_state(module: nn.Module) -> bool:
    """A layer that mixes positions through a state or a causal convolution: its class is named so, or it owns a
    depthwise 1-D convolution (every Mamba, Gated DeltaNet, KDA and short-convolution mixer does)."""
    name = type(module).__name__.lower()
    return any(s in name for s in _STATEFUL) or any(
        isinstance(c, nn.Conv1d) and c.groups == c.in_channels > 1 for c in module.children())


def state_modules(model: nn.Module) -> list[nn.Module]:
    """The outermost modules inside the model's layers that hold a state along the sequence (in module order).

    Containers (the model, its layer list, a decoder layer) are never taken: attention and MLPs beside a state layer
    run on the packed row. Taking a module that has no state costs speed, never exactness (it runs per example);
    one missed is what the packing self-test catches."""
    found: list[nn.Module] = []
    inside: set[int] = set()
    for module in model.modules():
        if id(module) in inside:
            continue
        if isinstance(module, (PreTrainedModel, GradientCheckpointingLayer, nn.ModuleList, nn.ModuleDict)):
            continue
        if _holds_state(module):
            found.append(module)
            inside.update(id(m) for m in module.modules())
    return found


def smallest_window(config) -> int | None:
    """The smallest sliding window or attention chunk the config names (None: none)."""
    sizes = [v for k, v in _text(config).to_dict().items()
             if ("window" in k or k.endswith("chunk_size")) and type(v) is int and v > 0]
    return min(sizes) if sizes else None

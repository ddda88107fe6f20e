"""What in a model can carry information across an example boundary of a packed row, read from its config and modules.

Packing puts several examples in one row; it is exact only if nothing carries information across the boundary.
Attention is kept apart by ``anyfit.model.attention`` (or transformers' block mask). Layers with a state over the
sequence (linear attention, state spaces, short convolutions: Qwen3.5, Qwen3-Next, LFM2, Falcon-H1, Granite-4.0-H,
Jamba) are not: transformers' implementations read no example boundaries on the CPU, and on CUDA only some kernels
take them, so the second example of a row would start from the first one's state. Such a model trains on padded
batches, and its sequences are not split over processes. ``anyfit.training.packing_check`` holds the start-up
self-test that catches what these rules do not name.
"""

from __future__ import annotations

from dataclasses import dataclass

from torch import nn


@dataclass(frozen=True)
class LayerKind:
    """What packing needs to know of one kind of layer in ``config.layer_types`` (transformers' names)."""

    per_example: bool  # ``anyfit_varlen`` computes it one example at a time itself (else transformers' own attention)
    sliding: bool = False  # attends within ``config.sliding_window`` where the layer does not pass its window


# The kinds of layer that attend. Any other kind in ``config.layer_types`` (linear attention, mamba, conv, ...) holds
# a state along the sequence: such a model is never packed.
LAYER_KINDS: dict[str, LayerKind] = {
    "full_attention": LayerKind(per_example=True),
    "sliding_attention": LayerKind(per_example=True, sliding=True),
    "chunked_attention": LayerKind(per_example=False),  # chunks: a pattern anyfit_varlen does not split per slice
    "attention": LayerKind(per_example=False),  # hybrids' name for full attention (their state layers keep them padded)
}
# Class-name parts of layers with a state over the sequence, for configs without ``layer_types``.
_STATEFUL = ("mamba", "gateddeltanet", "linearattention", "shortconv", "rwkv")


def _text(config):
    return config.get_text_config() if hasattr(config, "get_text_config") else config


def stateful_kinds(config) -> str:
    """The config's layer kinds that carry a state along the sequence, described ('' when every layer attends)."""
    kinds = sorted(set(getattr(_text(config), "layer_types", None) or []) - set(LAYER_KINDS))
    return f"its {', '.join(repr(k) for k in kinds)} layers" if kinds else ""


def stateful_layers(model: nn.Module) -> str:
    """What in the model carries a state along the sequence: the config's layer kinds, else its modules' classes."""
    found = stateful_kinds(model.config)
    if found:
        return found
    names = sorted({type(m).__name__ for m in model.modules()
                    if any(s in type(m).__name__.lower() for s in _STATEFUL)})
    return f"its {', '.join(names)} layers" if names else ""


def smallest_window(config) -> int | None:
    """The smallest sliding window or attention chunk the config names (None: none)."""
    sizes = [v for k, v in _text(config).to_dict().items()
             if ("window" in k or k.endswith("chunk_size")) and type(v) is int and v > 0]
    return min(sizes) if sizes else None

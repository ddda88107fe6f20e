"""The repeated blocks of a decoder, found by structure: the largest ``nn.ModuleList`` whose entries share one
class (Llama/Qwen ``model.layers``, GPT-2 ``transformer.h``, the same under a PEFT wrapper); in a composite
(vision-language) model, its language model's, however deep its vision tower. The one finder FSDP2's per-layer
units, activation offloading and the tiled MLP use."""

from __future__ import annotations

from torch import nn

from anyfit.model.composite import language_modules


def decoder_stack(model: nn.Module) -> tuple[nn.Module, nn.ModuleList] | None:
    """(the module holding the decoder layers, the layers), or None if ``model`` has no such stack."""
    best: tuple[nn.Module, nn.ModuleList] | None = None
    for _, module in language_modules(model):
        for child in module.children():
            if isinstance(child, nn.ModuleList) and len(child) > (len(best[1]) if best else 0) \
                    and len({type(m) for m in child}) == 1:
                best = (module, child)
    return best

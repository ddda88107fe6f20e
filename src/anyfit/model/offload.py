"""Activation offloading (``model.activation_offload``): the tensors the decoder body saves for its backward go to
host RAM as the forward saves them and come back when the backward unpacks them.

Built on PyTorch's saved-tensor hooks, the mechanism of its own ``torch.autograd.graph.save_on_cpu``, whose copy
this keeps. Not ``save_on_cpu`` itself: it moves every saved tensor, the weights a matmul keeps for its input
gradient and autocast's bf16 copies of them included (a model's worth of copies each way per micro-batch). TRL's
``OffloadActivations`` (torchtune's) skips weights and overlaps the copies on a second stream, but needs an
accelerator (it fails on a CPU-only machine, where anyfit's tests run) and is not among anyfit's dependencies.
Here the copies run on the compute stream, so they do not overlap: ``anyfit plan`` counts their time in full.

Scope: the decoder body (embeddings, layers, final norm), entered and left by forward hooks on the module that
holds the decoder layers. The logits and loss stay: the backward needs them first, so moving them would cost two
copies for no lower peak. With gradient checkpointing the body keeps each checkpointed layer's input (torch's
non-reentrant checkpoint saves it as a saved tensor): that moves, and the recomputation in the backward runs
outside these hooks, so one layer's activations are on the device at a time.
"""

from __future__ import annotations

import torch
from torch import nn

from anyfit.config import ConfigError
from anyfit.model.layers import decoder_stack

# Tensors smaller than this stay (per-head statistics, rsqrt of a norm): a copy costs more than they hold.
MIN_BYTES = 1 << 20


def _is_weight(t: torch.Tensor, shapes: set[tuple[int, ...]]) -> bool:
    """A parameter, a view of one (a matmul saves ``weight.t()``), autocast's cast of one, or a copy shaped like a
    frozen one: weights stay where the optimizer and the next micro-batch need them."""
    base = t._base if t._base is not None else t
    if isinstance(base, nn.Parameter):
        return True
    fn = base.grad_fn
    if fn is not None:  # autocast's cached cast of a trainable weight: a copy whose input is a leaf
        if fn.name() != "ToCopyBackward0" or not fn.next_functions:
            return False
        source = fn.next_functions[0][0]
        return source is not None and source.name().endswith("AccumulateGrad")
    return not base.requires_grad and tuple(base.shape) in shapes  # a cast of a frozen weight


class _ToHost(torch.autograd.graph.saved_tensors_hooks):
    def __init__(self, shapes: set[tuple[int, ...]], pin: bool):
        self.shapes, self.pin = shapes, pin
        super().__init__(self._pack, self._unpack)

    def _pack(self, t: torch.Tensor):
        if (type(t) is not torch.Tensor or t.numel() * t.element_size() < MIN_BYTES  # subclasses (NF4, DTensor) stay
                or _is_weight(t, self.shapes)):
            return t
        host = torch.empty(t.size(), dtype=t.dtype, layout=t.layout, pin_memory=self.pin)
        host.copy_(t, non_blocking=self.pin)
        return t.device, host

    def _unpack(self, packed):
        if isinstance(packed, torch.Tensor):
            return packed
        device, host = packed
        return host.to(device, non_blocking=self.pin)


def body_of(model: nn.Module) -> nn.Module:
    """The module holding the decoder layers: Llama's ``model``, GPT-2's ``transformer``, the same under PEFT."""
    stack = decoder_stack(model)
    if stack is None:
        raise ConfigError(f"model.activation_offload: no stack of decoder layers found in {type(model).__name__}; "
                          "set model.activation_offload=false.")
    return stack[0]


def offload_activations(model: nn.Module, pin: bool) -> None:
    """Every forward of ``model``'s decoder body with gradients on saves to host RAM (``pin``: page-locked, for
    CUDA); evaluation and generation save nothing, so they are unchanged."""
    body = body_of(model)
    shapes = {tuple(p.shape) for p in model.parameters() if p.dim() >= 2}
    active: list[_ToHost] = []

    def enter(module, args):
        if torch.is_grad_enabled():
            hooks = _ToHost(shapes, pin)
            hooks.__enter__()
            active.append(hooks)

    def leave(module, args, output):
        if active:
            active.pop().__exit__(None, None, None)

    body.register_forward_pre_hook(enter)
    body.register_forward_hook(leave, always_call=True)

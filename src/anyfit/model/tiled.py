"""Tiled MLP (``model.tiled_mlp``): each decoder layer's MLP runs over the sequence in tiles of about
``hidden_size`` tokens, and its backward recomputes one tile at a time, so the MLP's intermediate activations
(three ``tokens x intermediate_size`` tensors for a gated MLP, 2.7-4x the hidden size) never exist for the whole
sequence at once: only its input is kept. The cost: the MLP's forward runs once more in the backward.

The idea and the tile size are DeepSpeed's (``TiledMLP`` in ``deepspeed.runtime.sequence_parallel.ulysses_sp``,
the ALST work). Its autograd function is not used as it is, for two reasons measured here: its backward
accumulates each weight's gradient into ``.grad`` once per tile, which DDP and FSDP2 take for a finished gradient
("Expected to mark a variable ready only once", under torchrun even on one process; DeepSpeed's code notes "DDP,
FSDP will need something similar"); and it recomputes outside the forward's autocast and RNG state. ``_Tiles``
below hands the weights' gradients back as outputs of the backward, summed over the tiles, so each weight gets
one gradient as from the untiled MLP, and recomputes under the forward's autocast and RNG state (LoRA dropout
draws the same masks), as ``torch.utils.checkpoint`` does. DeepSpeed patches the MLP class's ``forward`` for the
whole process; here each MLP module is wrapped instead (``TiledMLP``), under the same attribute name and with the
same children, so parameter names, checkpoints, PEFT targets and exported weights are unchanged.
"""

from __future__ import annotations

import math

import torch
from torch import nn

from anyfit.config import ConfigError
from anyfit.model.layers import decoder_stack


class _Tiles(torch.autograd.Function):
    """``forward(x)`` over ``tiles`` slices of the sequence (dim -2) without keeping their activations; the
    backward recomputes each slice and returns the input's gradient and the trainable weights' (summed)."""

    @staticmethod
    def forward(ctx, forward, tiles: int, x: torch.Tensor, *weights: torch.Tensor) -> torch.Tensor:
        device = x.device.type
        ctx.forward, ctx.tiles, ctx.device = forward, tiles, device
        ctx.autocast = (torch.is_autocast_enabled(device), torch.get_autocast_dtype(device))
        ctx.rng = torch.get_rng_state(), (torch.cuda.get_rng_state() if device == "cuda" else None)
        ctx.save_for_backward(x, *weights)
        with torch.no_grad():
            return torch.cat([forward(tile) for tile in x.chunk(tiles, dim=-2)], dim=-2)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        x, *weights = ctx.saved_tensors
        enabled, dtype = ctx.autocast
        sums = [torch.zeros_like(w, dtype=torch.float32) for w in weights]
        x_grads = []
        devices = [torch.cuda.current_device()] if ctx.device == "cuda" else []
        with torch.random.fork_rng(devices=devices):
            torch.set_rng_state(ctx.rng[0])
            if ctx.rng[1] is not None:
                torch.cuda.set_rng_state(ctx.rng[1])
            for tile, tile_grad in zip(x.chunk(ctx.tiles, dim=-2), grad.chunk(ctx.tiles, dim=-2)):
                tile = tile.detach().requires_grad_(x.requires_grad)
                with torch.enable_grad(), torch.autocast(ctx.device, dtype=dtype, enabled=enabled):
                    out = ctx.forward(tile)
                inputs = ([tile] if x.requires_grad else []) + weights
                grads = torch.autograd.grad(out, inputs, tile_grad, allow_unused=True)
                if x.requires_grad:
                    x_grads.append(grads[0])
                    grads = grads[1:]
                for total, g in zip(sums, grads):
                    if g is not None:
                        total += g
        x_grad = torch.cat(x_grads, dim=-2) if x_grads else None
        return (None, None, x_grad, *(s.to(w.dtype) for s, w in zip(sums, weights)))


class TiledMLP(nn.Module):
    """``mlp`` run in sequence tiles, a drop-in for it: its children are this module's under the same names, its
    plain attributes (sizes, config) are copied, and its class's ``forward`` runs with this module as ``self``, so
    whatever later replaces a child here (PEFT's LoRA layers) is what the computation uses."""

    def __init__(self, mlp: nn.Module):
        super().__init__()
        if next(mlp.parameters(recurse=False), None) is not None:
            raise ConfigError(f"model.tiled_mlp: {type(mlp).__name__} holds weights of its own outside its layers, "
                              "which anyfit does not tile; set model.tiled_mlp=false.")
        for name, child in mlp.named_children():
            self.add_module(name, child)
        for name, value in vars(mlp).items():
            if not name.startswith("_") and name != "training":
                setattr(self, name, value)
        self.mlp_class = type(mlp)

    def mlp_forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.mlp_class.forward(self, x)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        tiles = math.ceil(x.shape[-2] / x.shape[-1])  # DeepSpeed's choice: tiles of about hidden_size tokens
        if tiles <= 1 or not torch.is_grad_enabled():  # short sequences, evaluation: nothing to save
            return self.mlp_forward(x)
        # the weights as this forward sees them (under FSDP2: the gathered ones), trainable ones only
        weights = [p for p in self.parameters() if p.requires_grad]
        return _Tiles.apply(self.mlp_forward, tiles, x, *weights)


def tile_mlps(model: nn.Module) -> int:
    """Wrap the ``mlp`` of each decoder layer of ``model``; returns how many were wrapped."""
    stack = decoder_stack(model)
    wrapped = 0
    for layer in stack[1] if stack else []:
        mlp = getattr(layer, "mlp", None)
        if isinstance(mlp, nn.Module) and not isinstance(mlp, TiledMLP):
            layer.mlp = TiledMLP(mlp)
            wrapped += 1
    if not wrapped:
        raise ConfigError(f"model.tiled_mlp: the decoder layers of {type(model).__name__} have no 'mlp' module to "
                          "tile; set model.tiled_mlp=false.")
    return wrapped

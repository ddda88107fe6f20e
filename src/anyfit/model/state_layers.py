"""The state layers of a packed row given its example boundaries, so that hybrids pack exactly.

A packed row is one sequence of several examples; a Gated DeltaNet, Mamba-2 or short-convolution layer run over it
would carry its state (or its convolution window) from one example into the next. Two ways keep them apart, both as
hooks on the model's own modules (no class changed, every parameter keeps its name):

- ``KERNELS``: transformers' own boundary keywords (``cu_seq_lens_q``/``_k``, ``max_length_q``/``_k``: what its
  FlashAttention and flash-linear-attention paths read) added to the model call from anyfit's ``cu_seq_lens``. Exact
  only where the layer's kernel honours them (flash-linear-attention's chunked gated delta rule on CUDA); transformers'
  CPU fallbacks ignore them or refuse them;
- ``PER_EXAMPLE``: each state layer (``anyfit.model.packing.state_modules``) takes the row's examples as rows of their
  own, right-padded to the longest, in one call, with the padding mask padded batches give it; its output is laid
  back into the packed row. Attention, MLPs and the output layer still run on the packed row. Exact for any causal
  layer: a position reads only its own example's earlier positions, and the padding comes after them. The padding
  is paid in these layers only, and is small: a micro-batch holds examples of similar lengths (``WindowSampler``).

``anyfit.training.packing_check`` tries them on the user's model and keeps the first that gives what one example at a
time gives. A wrapper module would rename the layer's parameters (checkpoints, PEFT targets, optimizer state); a
forward pre-hook can replace a module's inputs and a forward hook its output, which is all this needs. The boundaries
reach a state layer with its own keywords (transformers passes the model call's on), else from the nearest call that
carried ``packed_lengths`` (the model's, its decoder layer's: Jamba calls its mixer without keywords). Gradient
checkpointing recomputes a decoder layer in the backward with the keywords of its forward; a layer without keywords
then reads the latest row's, right where each micro-batch's backward follows its forward (anyfit's loop), and one
that cannot lay out the row it is given stops with an error rather than leak.
"""

from __future__ import annotations

import torch
from torch import nn
from transformers.modeling_layers import GradientCheckpointingLayer

from anyfit.model.packing import state_modules

KERNELS, PER_EXAMPLE = "kernels", "per_example"
# Keywords that describe the packed row: a layer that runs on the examples as rows must not read them.
_ROW_KEYWORDS = ("packed_lengths", "cu_seq_lens", "cu_seq_lens_q", "cu_seq_lens_k", "max_length_q", "max_length_k",
                 "seq_idx")


class BoundaryError(RuntimeError):
    """A state layer was handed a row its example boundaries do not describe."""


class _Layout:
    """Where each position of a packed row of ``lengths`` sits among the examples as right-padded rows."""

    def __init__(self, lengths: tuple[int, ...], device):
        self.lengths, self.rows, self.longest = lengths, len(lengths), max(lengths)
        slots = [r * self.longest + i for r, n in enumerate(lengths) for i in range(n)]
        self.slots = torch.tensor(slots, device=device)
        self.mask = torch.tensor([[1] * n + [0] * (self.longest - n) for n in lengths], device=device)

    def pad(self, x: torch.Tensor) -> torch.Tensor:
        """(1, T, ...) -> (rows, longest, ...), zeros after each example."""
        grid = x.new_zeros((self.rows * self.longest, *x.shape[2:]))
        return grid.index_copy(0, self.slots, x[0]).view(self.rows, self.longest, *x.shape[2:])

    def unpad(self, x: torch.Tensor) -> torch.Tensor:
        """(rows, longest, ...) -> (1, T, ...)."""
        return x.reshape(self.rows * self.longest, *x.shape[2:]).index_select(0, self.slots).unsqueeze(0)


class Boundaries:
    """The hooks of one way (``KERNELS`` or ``PER_EXAMPLE``) on ``model`` (the transformers model); ``remove()``
    takes them off. ``layers``: the state layers that run per example (empty for ``KERNELS``)."""

    def __init__(self, model: nn.Module, how: str):
        self.how, self.lengths = how, None
        self._layouts: dict[int, _Layout] = {}  # a state layer's call in flight -> its layout
        self._last: _Layout | None = None
        self.layers = state_modules(model) if how == PER_EXAMPLE else []
        self.handles = [model.register_forward_pre_hook(self._enter, with_kwargs=True)]
        inner = {id(m) for layer in self.layers for m in layer.modules()}
        for module in model.modules():  # decoder layers holding a state layer: they see the row's keywords again
            if isinstance(module, GradientCheckpointingLayer) and inner & {id(m) for m in module.modules()}:
                self.handles.append(module.register_forward_pre_hook(self._seen, with_kwargs=True))
        for layer in self.layers:
            self.handles.append(layer.register_forward_pre_hook(self._split, with_kwargs=True))
            self.handles.append(layer.register_forward_hook(self._merge))

    def remove(self) -> None:
        for handle in self.handles:
            handle.remove()
        self.handles = []

    def _enter(self, module, args, kwargs):
        """The model's call: the row's boundaries (None for padded rows and generation); for ``KERNELS``, also
        under transformers' names."""
        self.lengths = kwargs.get("packed_lengths")
        cu = kwargs.get("cu_seq_lens")
        if self.how != KERNELS or self.lengths is None or cu is None:
            return None
        longest = max(self.lengths)
        return args, {**kwargs, "cu_seq_lens_q": cu, "cu_seq_lens_k": cu, "max_length_q": longest,
                      "max_length_k": longest}

    def _seen(self, module, args, kwargs):
        if "packed_lengths" in kwargs:
            self.lengths = kwargs["packed_lengths"]

    def _layout(self, lengths: tuple[int, ...], device) -> _Layout:
        if self._last is None or self._last.lengths != lengths or self._last.slots.device != device:
            self._last = _Layout(tuple(lengths), device)
        return self._last

    def _split(self, module, args, kwargs):
        """The packed row's (1, T, ...) inputs as the examples' right-padded rows, with their padding mask."""
        lengths = kwargs.get("packed_lengths", self.lengths)
        if lengths is None or len(lengths) < 2:
            return None
        total = sum(lengths)
        row = [a for a in (*args, *kwargs.values()) if isinstance(a, torch.Tensor) and a.dim() >= 2
               and a.shape[0] == 1 and a.shape[1] == total]
        if not row:
            raise BoundaryError(f"{type(module).__name__} got no packed row of {total} tokens "
                               f"({len(lengths)} examples): its example boundaries are not those of its input")
        layout = self._layout(tuple(lengths), row[0].device)
        self._layouts[id(module)] = layout

        def split(value):
            return layout.pad(value) if any(value is r for r in row) else value

        kwargs = {k: split(v) for k, v in kwargs.items() if k not in _ROW_KEYWORDS}
        if "attention_mask" in kwargs:  # what padded batches give the layer (transformers zeroes padded states)
            kwargs["attention_mask"] = layout.mask
        return tuple(split(a) for a in args), kwargs

    def _merge(self, module, args, output):
        layout = self._layouts.pop(id(module), None)
        if layout is None:
            return None

        def merge(value):
            if isinstance(value, torch.Tensor) and value.dim() >= 2 and value.shape[:2] == (layout.rows,
                                                                                             layout.longest):
                return layout.unpad(value)
            return value

        return tuple(merge(v) for v in output) if type(output) is tuple else merge(output)

"""The state layers of a packed row given its example boundaries, so that hybrids pack exactly.

A packed row is one sequence of several examples; a Gated DeltaNet, Mamba-2 or short-convolution layer run over it
would carry its state (or its convolution window) from one example into the next. Two ways keep them apart, both as
hooks on the model's own modules (no class changed, every parameter keeps its name):

- ``KERNELS``: transformers' own boundary keywords (``cu_seq_lens_q``/``_k``, ``max_length_q``/``_k``: what its
  FlashAttention and flash-linear-attention paths read) added to the model call from anyfit's ``cu_seq_lens``. Exact
  only where the layer's kernel honours them (flash-linear-attention's chunked gated delta rule on CUDA); transformers'
  CPU fallbacks ignore them or refuse them;
- ``SEQ_IDX``: the same and ``seq_idx`` (each position's example, int32, as transformers' DataCollatorWithFlattening
  gives it with ``return_seq_idx``): what transformers' Mamba-2 mixers hand their fused kernels (mamba_ssm's chunked
  scan, causal-conv1d); its PyTorch fallbacks refuse it. Tried after ``KERNELS``: a kernel that reads the other
  keywords may refuse this one;
- ``PER_EXAMPLE``: each state layer (``anyfit.model.packing.state_modules``) takes the row's examples as rows of their
  own, right-padded, with the padding mask padded batches give it; its output is laid back into the packed row.
  Attention, MLPs and the output layer still run on the packed row. Exact for any causal layer: a position reads only
  its own example's earlier positions, and the padding comes after them. Examples that span the same number of the
  layer's chunks share a call (``_Layout``), so the padding stays small.

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

KERNELS, SEQ_IDX, PER_EXAMPLE = "kernels", "kernels_seq_idx", "per_example"
# The chunk of a state layer that names none: transformers' chunked gated delta rule (and flash-linear-attention's)
# works in chunks of 64 positions; a layer without chunks (a short convolution) loses nothing to the grouping by it.
CHUNK = 64
# Keywords that describe the packed row: a layer that runs on the examples as rows must not read them.
_ROW_KEYWORDS = ("packed_lengths", "cu_seq_lens", "cu_seq_lens_q", "cu_seq_lens_k", "max_length_q", "max_length_k",
                 "seq_idx")


class BoundaryError(RuntimeError):
    """A state layer was handed a row its example boundaries do not describe."""


class _Group:
    """Some examples of a packed row as right-padded rows of their own (``take``: their positions in the row, in the
    order of ``slots``, their places in the flattened rows)."""

    def __init__(self, examples: list[tuple[int, int]], device):  # (start in the row, length), longest first
        self.rows, self.longest = len(examples), examples[0][1]
        self.take = torch.tensor([s + i for s, n in examples for i in range(n)], device=device)
        self.slots = torch.tensor([r * self.longest + i for r, (_, n) in enumerate(examples) for i in range(n)],
                                  device=device)
        self.mask = torch.tensor([[1] * n + [0] * (self.longest - n) for _, n in examples], device=device)

    def pad(self, x: torch.Tensor) -> torch.Tensor:
        """(1, T, ...) -> (rows, longest, ...), zeros after each example."""
        grid = x.new_zeros((self.rows * self.longest, *x.shape[2:]))
        return grid.index_copy(0, self.slots, x[0].index_select(0, self.take)).view(self.rows, self.longest,
                                                                                    *x.shape[2:])

    def unpad(self, x: torch.Tensor) -> torch.Tensor:
        """(rows, longest, ...) -> (tokens, ...), in ``take``'s order."""
        return x.reshape(self.rows * self.longest, *x.shape[2:]).index_select(0, self.slots)


class _Layout:
    """A packed row of ``lengths`` as groups of right-padded rows, longest first. A group holds examples that span the
    same number of ``chunk``-token chunks, and a new one starts where padding would add more than a quarter
    (``PADDING``) to a group's tokens. Why: the chunked PyTorch paths of these layers (transformers' gated delta rule,
    Mamba-2's scan) pad every row to whole chunks and pay per chunk, and a call's own cost (its projections, its Python
    loop over chunks) is paid once per group; so grouping by chunk count computes no chunk that the example alone would
    not, in few calls. Measured on the state layers alone (``benchmarks/hybrid_profile.py``): 2.0x the padded rows'
    speed, where groups that stop only at double the padding were 1.2x (BENCHMARKS.md, 'Hybrid packing')."""

    PADDING = 1.25

    def __init__(self, lengths: tuple[int, ...], device, chunk: int = 1):
        self.lengths, self.chunk, self.total = lengths, chunk, sum(lengths)
        starts = [sum(lengths[:i]) for i in range(len(lengths))]
        order = sorted(range(len(lengths)), key=lambda i: -lengths[i])
        groups: list[list[tuple[int, int]]] = []
        for i in order:
            group = groups[-1] if groups else None
            if (group and -(-lengths[i] // chunk) == -(-group[0][1] // chunk)
                    and (len(group) + 1) * group[0][1] <= self.PADDING * (sum(n for _, n in group) + lengths[i])):
                group.append((starts[i], lengths[i]))
            else:
                groups.append([(starts[i], lengths[i])])
        self.groups = [_Group(g, device) for g in groups]
        self.device = self.groups[0].take.device
        self.order = torch.argsort(torch.cat([g.take for g in self.groups]))  # concatenated groups -> row order

    def merge(self, outputs: list[torch.Tensor]) -> torch.Tensor:
        """Each group's (rows, longest, ...) output -> the packed row's (1, T, ...)."""
        return torch.cat([g.unpad(out) for g, out in zip(self.groups, outputs)]).index_select(0, self.order)[None]


class Boundaries:
    """The hooks of one way (``KERNELS``, ``SEQ_IDX`` or ``PER_EXAMPLE``) on ``model`` (the transformers model);
    ``remove()`` takes them off. ``layers``: the state layers that run per example (empty for the kernels' ways)."""

    def __init__(self, model: nn.Module, how: str):
        self.how, self.lengths = how, None
        self._layouts: dict[int, tuple] = {}  # a state layer's call in flight -> its layout and inputs
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
        """The model's call: the row's boundaries (None for padded rows and generation); for the kernels' ways, also
        under transformers' names."""
        self.lengths = kwargs.get("packed_lengths")
        cu = kwargs.get("cu_seq_lens")
        if self.how not in (KERNELS, SEQ_IDX) or self.lengths is None or cu is None:
            return None
        longest = max(self.lengths)
        named = {"cu_seq_lens_q": cu, "cu_seq_lens_k": cu, "max_length_q": longest, "max_length_k": longest}
        if self.how == SEQ_IDX:
            examples = torch.arange(len(self.lengths), dtype=torch.int32, device=cu.device)
            # output_size: the row's length is known here, so no device-to-host sync in each step's forward
            named["seq_idx"] = torch.repeat_interleave(examples, torch.diff(cu), output_size=sum(self.lengths))[None]
        return args, {**kwargs, **named}

    def _seen(self, module, args, kwargs):
        if "packed_lengths" in kwargs:
            self.lengths = kwargs["packed_lengths"]

    def _layout(self, lengths: tuple[int, ...], device, chunk: int) -> _Layout:
        """The row's layout, built once per micro-batch and reused by every state layer with the same chunk."""
        last = self._last
        if last is None or last.lengths != lengths or last.device != device or last.chunk != chunk:
            self._last = _Layout(tuple(lengths), device, chunk)
        return self._last

    def _split(self, module, args, kwargs):
        """The packed row's (1, T, ...) inputs as the first group's right-padded rows, with their padding mask (the
        other groups run in ``_merge``)."""
        lengths = kwargs.get("packed_lengths", self.lengths)
        if lengths is None or len(lengths) < 2:
            return None
        total = sum(lengths)
        row = [a for a in (*args, *kwargs.values()) if isinstance(a, torch.Tensor) and a.dim() >= 2
               and a.shape[0] == 1 and a.shape[1] == total]
        if not row:
            raise BoundaryError(f"{type(module).__name__} got no packed row of {total} tokens "
                                f"({len(lengths)} examples): its example boundaries are not those of its input")
        chunk = getattr(module, "chunk_size", None)  # Mamba-2 mixers name theirs
        layout = self._layout(tuple(lengths), row[0].device, chunk if type(chunk) is int and chunk > 0 else CHUNK)
        kwargs = {k: v for k, v in kwargs.items() if k not in _ROW_KEYWORDS}
        self._layouts[id(module)] = (layout, args, kwargs, row)
        return _inputs(layout.groups[0], args, kwargs, row)

    def _merge(self, module, args, output):
        """The first group's output and the other groups' (the layer's own forward, its hooks already run for this
        call), laid back into the packed row."""
        layout, args, kwargs, row = self._layouts.pop(id(module), (None, None, None, None))
        if layout is None:
            return None
        outputs = [output] + [module.forward(*g_args, **g_kwargs) for g_args, g_kwargs in
                              (_inputs(g, args, kwargs, row) for g in layout.groups[1:])]
        first = layout.groups[0]

        def merged(i: int | None):
            values = [out if i is None else out[i] for out in outputs]
            head = values[0]
            if isinstance(head, torch.Tensor) and head.dim() >= 2 and head.shape[:2] == (first.rows, first.longest):
                return layout.merge(values)
            return head

        return tuple(merged(i) for i in range(len(output))) if type(output) is tuple else merged(None)


def _inputs(group: _Group, args: tuple, kwargs: dict, row: list[torch.Tensor]) -> tuple[tuple, dict]:
    """A state layer's call for ``group``: its packed-row tensors padded, its padding mask where it takes one."""
    def split(value):
        return group.pad(value) if any(value is r for r in row) else value

    kwargs = {k: split(v) for k, v in kwargs.items()}
    if "attention_mask" in kwargs:  # what padded batches give the layer (transformers zeroes padded states)
        kwargs["attention_mask"] = group.mask
    return tuple(split(a) for a in args), kwargs

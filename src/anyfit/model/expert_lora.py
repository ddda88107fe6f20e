"""LoRA on routed experts computed as base plus low-rank path ("split LoRA"): x·W_e + s·(x·A_e)·B_e for the tokens
routed to each expert, with grouped matrix products, so memory holds one copy of the experts and the adapter's own
activations.

PEFT 0.21 adapts a fused expert tensor (``target_parameters``) with ``ParamWrapper``, which forms W + s·BA for every
expert of the layer in each forward and autograd keeps it for the backward: a second copy of the experts. Here a
subclass of ``ParamWrapper`` (the same adapter weights, state dict, merge and unload: checkpoints stay PEFT's) goes in
through PEFT's own custom-module mapping (``LoraConfig._register_custom_module``) and overrides only ``forward``.

The forward is written by hand because transformers' experts functions (``transformers.integrations.moe``, the
``@use_experts_implementation`` classes) take each projection as one tensor, with no place for a low-rank path; it
follows their grouped_mm function (sort the token-expert pairs by expert, grouped products, the class's own gate,
activation, biases and layout) and reads the factors with PEFT's ``get_delta_factors``. Whether a model's experts
compute exactly this is decided by ``split_expert_classes``: a check on the model's first experts module of each
class against its own forward with the adapter folded in; the others keep PEFT's path, said in one line.
"""

from __future__ import annotations

import inspect
import math

import torch
from torch import nn

from anyfit.model.moe import moe_blocks

_DECORATED = ("has_gate", "has_bias", "is_transposed", "has_post_expert_norm")  # set by @use_experts_implementation


def _grouped_mm_works(x: torch.Tensor, w: torch.Tensor) -> bool:
    """Whether torch's grouped matmul takes these operands: its kernels want 16-byte aligned rows and strides, and
    exist on CPU (torch 2.9+) and on CUDA from compute capability 8.0, for float32, bfloat16 and float16."""
    if (not hasattr(torch.nn.functional, "grouped_mm") or x.dtype != w.dtype
            or x.dtype not in (torch.float32, torch.bfloat16, torch.float16)):
        return False
    if w.device.type == "cuda":
        if torch.cuda.get_device_capability(w.device) < (8, 0):
            return False
    elif w.device.type != "cpu":
        return False
    size = x.element_size()
    return all(t.data_ptr() % 16 == 0 and 1 in t.stride()[-2:]
               and all(s * size % 16 == 0 for s in t.stride() if s != 1) for t in (x, w))


def _spans(offsets: torch.Tensor):
    """(expert, its rows as a slice) for each expert with rows; one host sync for the whole loop."""
    start = 0
    for e, end in enumerate(offsets.tolist()):
        if end > start:
            yield e, slice(start, end)
        start = end


def grouped(x: torch.Tensor, w: torch.Tensor, offsets: torch.Tensor) -> torch.Tensor:
    """Rows of ``x`` (sorted by expert, group e ending at ``offsets[e]``) times ``w[e]`` (experts x in x out): torch's
    grouped matmul where it takes the operands, else one matmul per expert that has tokens."""
    x = x.to(w.dtype)
    if _grouped_mm_works(x, w):
        return torch.nn.functional.grouped_mm(x, w, offs=offsets)
    parts = [x[rows] @ w[e] for e, rows in _spans(offsets)]
    return torch.cat(parts) if parts else x.new_zeros(0, w.size(-1))


def grouped_outer(a: torch.Tensor, b: torch.Tensor, offsets: torch.Tensor) -> torch.Tensor:
    """(experts x a's width x b's width): aᵀ·b over each expert's rows (zeros for an expert without rows), the
    gradient of a factor; torch's grouped matmul (its 2-D x 2-D form) where it takes the operands, else a loop."""
    if _grouped_mm_works(a.t(), b):
        return torch.nn.functional.grouped_mm(a.t(), b, offs=offsets)
    out = a.new_zeros(offsets.numel(), a.size(-1), b.size(-1))
    for e, rows in _spans(offsets):
        out[e] = a[rows].t() @ b[rows]
    return out


class _Grouped:
    """The products of every expert's rows at once, with torch's grouped kernel (on CUDA one fused kernel per
    product), each in its operands' own dtypes: what the split path runs outside the CPU (see ``per_expert``)."""

    def __init__(self, offsets: torch.Tensor):
        self.offsets = offsets

    def mm(self, a: torch.Tensor, w: torch.Tensor, out=None) -> torch.Tensor:
        return grouped(a, w, self.offsets)

    def add_mm(self, y: torch.Tensor, a: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
        return y + grouped(a, w, self.offsets)

    def outer(self, a: torch.Tensor, b: torch.Tensor, out=None) -> torch.Tensor:
        return grouped_outer(a, b.to(a.dtype), self.offsets)


class _Expert:
    """The products of one expert's rows, written into slices of the whole (``out``) and summed in place: what the
    split path runs on the CPU (see ``per_expert``)."""

    def __init__(self, expert: int):
        self.e = expert

    def mm(self, a: torch.Tensor, w: torch.Tensor, out=None) -> torch.Tensor:
        return torch.mm(a, w[self.e], out=out)

    def add_mm(self, y: torch.Tensor, a: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
        return y.addmm_(a, w[self.e])

    def outer(self, a: torch.Tensor, b: torch.Tensor, out=None) -> torch.Tensor:
        return torch.mm(a.t(), b, out=out)


def per_expert(x: torch.Tensor, weight: torch.Tensor, first: torch.Tensor, second: torch.Tensor) -> bool:
    """Whether ``SplitProjection`` runs one expert's rows at a time (else all experts in one grouped call per
    product): on the CPU when the operands share one dtype. torch's grouped kernel on the CPU is itself a loop of
    one matmul per expert, so the loop costs no extra calls; what it saves is the full-width tensors the grouped
    form needs, the low-rank path's output and its input gradient, each as large as the base product's, written to
    freshly mapped pages and then added to the base's: the loop adds s·(x·A)·B into the base product's own rows and
    the input gradient's low-rank part into the base's (``addmm_``), and each expert's rows are still in cache for
    its thin products. Measured on the Qwen3-30B-A3B-sized experts, BENCHMARKS.md "Expert LoRA (issue 55)". On CUDA
    the grouped kernel is one launch per product and the caching allocator makes the full-width tensors cheap."""
    return x.device.type == "cpu" and x.dtype == weight.dtype == first.dtype == second.dtype


def _rows_forward(ops, x, weight, first, second, scaling, out=None) -> torch.Tensor:
    """x·W + s·(x·A)·B for the rows ``ops`` covers (the scaling on the r-wide product: 1/r-th of a full-width pass)."""
    return ops.add_mm(ops.mm(x, weight, out), ops.mm(x, first) * scaling, second)


def _rows_backward(ops, x, grad, weight, first, second, scaling, needs, outs=(None,) * 4) -> tuple:
    """The gradients (x, W, A, B; None where ``needs`` says not needed) of ``_rows_forward`` for the rows ``ops``
    covers, the r-wide product x·A recomputed."""
    low = ops.mm(x, first) * scaling
    grad_low = ops.mm(grad, second.transpose(-2, -1)) * scaling
    grad_x = ops.add_mm(ops.mm(grad, weight.transpose(-2, -1), outs[0]), grad_low,
                        first.transpose(-2, -1)) if needs[0] else None
    grad_w = ops.outer(x, grad, outs[1]) if needs[1] else None
    return grad_x, grad_w, ops.outer(x, grad_low, outs[2]), ops.outer(low, grad, outs[3])


class SplitProjection(torch.autograd.Function):
    """x·W + s·(x·first)·second over expert-sorted rows (W: experts x in x out, a view of the frozen experts
    tensor), keeping for the backward only W and the factors as given (views of the parameters) and the tensor ``x``
    is rebuilt from: the layer's token rows (``x = source[index]``, the routed copy is top_k times larger) or the
    projection's pre-activation that the activation's own backward keeps anyway (``x = act(source)``). Neither the
    routed rows, the r-wide product nor the factors' contiguous copies stay from the forward to the backward; the
    backward recomputes them (rank r: a few percent of the base product).

    Written by hand because autograd's grouped_mm keeps its inputs as they are, the very tensors this avoids;
    ``torch.utils.checkpoint`` would recompute the second product as well, and holds its inputs outside the
    saved-tensor hooks the planner's test and offloading read. The base product is inside so that, on the CPU, the
    low-rank path adds into its rows in place (``per_expert``). Axolotl's ScatterMoE LoRA and Unsloth's MoE LoRA
    write this backward by hand for the same reason. Checked against autograd in float64 (gradcheck), both forms."""

    @staticmethod
    def forward(ctx, x, weight, source, index, first, second, offsets, scaling, act, loop):
        ctx.save_for_backward(source, index, weight, first, second, offsets)
        ctx.scaling, ctx.act, ctx.dtype, ctx.loop = scaling, act, x.dtype, loop
        ctx.autocast = (x.device.type, torch.is_autocast_enabled(x.device.type),
                        torch.get_autocast_dtype(x.device.type))
        if not loop:
            return _rows_forward(_Grouped(offsets), x, weight, first.contiguous(), second.contiguous(), scaling)
        y = x.new_empty(x.size(0), weight.size(-1))
        for e, rows in _spans(offsets):
            _rows_forward(_Expert(e), x[rows], weight, first, second, scaling, y[rows])
        return y

    @staticmethod
    def backward(ctx, grad):
        source, index, weight, first, second, offsets = ctx.saved_tensors
        device, enabled, dtype = ctx.autocast
        needs = ctx.needs_input_grad[:2]
        with torch.no_grad(), torch.autocast(device, dtype=dtype, enabled=enabled):  # the forward's x, bit for bit
            # gathered rows: one expert's at a time in the loop (a copy, the same bits, and in cache for its
            # products); the activation once, as in the forward
            x = None if ctx.act is None and ctx.loop else (source[index] if ctx.act is None else ctx.act(source))
        if not ctx.loop:
            grad_x, grad_w, grad_first, grad_second = _rows_backward(
                _Grouped(offsets), x.to(first.dtype), grad, weight, first.contiguous(), second.contiguous(),
                ctx.scaling, needs)
        else:
            grad = grad.contiguous()
            grad_x = grad.new_empty(grad.size(0), weight.size(-2)) if needs[0] else None
            # contiguous (zeros: an expert without rows), whatever the layout of the views they are the gradients of
            grad_w = weight.new_zeros(weight.shape) if needs[1] else None
            grad_first, grad_second = first.new_zeros(first.shape), second.new_zeros(second.shape)
            for e, rows in _spans(offsets):
                rows_x = source[index[rows]] if x is None else x[rows]
                _rows_backward(_Expert(e), rows_x, grad[rows], weight, first, second, ctx.scaling, needs,
                               (grad_x[rows] if needs[0] else None, grad_w[e] if needs[1] else None, grad_first[e],
                                grad_second[e]))
        return (None if grad_x is None else grad_x.to(ctx.dtype), grad_w, None, None, grad_first, grad_second,
                None, None, None, None)


Factors = dict[str, tuple[torch.Tensor, torch.Tensor, float]]  # parameter -> (lhs, rhs, scaling): W + s·lhs@rhs


def _project(experts: nn.Module, name: str, x: torch.Tensor, offsets: torch.Tensor, ids: torch.Tensor,
             factors: Factors, rebuild: tuple) -> torch.Tensor:
    """One fused projection for expert-sorted rows: base product, bias, and the low-rank path of ``factors[name]``
    (``rebuild``: (source, index, act) that give ``x`` back in the backward, see ``SplitProjection``)."""
    w = getattr(experts, name)
    transposed = experts.is_transposed  # (experts, in, out) rather than (experts, out, in)
    w = w if transposed else w.transpose(-2, -1)
    if name in factors:
        lhs, rhs, scaling = factors[name]
        # the delta is lhs @ rhs in the tensor's own layout: x·(lhs·rhs) transposed, x·rhsᵀ·lhsᵀ otherwise
        first, second = (lhs, rhs) if transposed else (rhs.transpose(-2, -1), lhs.transpose(-2, -1))
        y = SplitProjection.apply(x, w, *rebuild[:2], first, second, offsets, scaling, rebuild[2],
                                  per_expert(x, w, first, second))
    else:
        y = grouped(x, w, offsets)
    if experts.has_bias:
        y = y + getattr(experts, f"{name}_bias")[ids]
    return y


def split_forward(experts: nn.Module, factors: Factors, hidden_states: torch.Tensor, top_k_index: torch.Tensor,
                  top_k_weights: torch.Tensor) -> torch.Tensor:
    """The experts' output for (tokens x hidden) inputs and the router's choice, with the adapters of ``factors``
    added as low-rank paths (none: the experts as they are)."""
    tokens, top_k = top_k_index.shape
    ids, order = torch.sort(top_k_index.reshape(-1), stable=True)
    offsets = torch.cumsum(torch.bincount(ids, minlength=experts.num_experts), 0).to(torch.int32)
    rows = order // top_k
    x = hidden_states[rows]
    pre = _project(experts, "gate_up_proj" if experts.has_gate else "up_proj", x, offsets, ids, factors,
                   (hidden_states, rows, None))
    act = experts._apply_gate if experts.has_gate else experts.act_fn
    y = _project(experts, "down_proj", act(pre), offsets, ids, factors, (pre, None, act))
    if experts.has_post_expert_norm:
        y = experts.post_expert_norm(y)
    y = y * top_k_weights.reshape(-1)[order].unsqueeze(-1).to(y.dtype)
    inverse = torch.empty_like(order)
    inverse[order] = torch.arange(order.numel(), device=order.device)
    unsorted = y[inverse]  # a gather keeps only the indices for its backward (index_copy would keep y)
    return unsorted.view(tokens, top_k, -1).sum(dim=1).to(hidden_states.dtype)


def _routing(args: tuple, kwargs: dict, experts: nn.Module, x: torch.Tensor) -> tuple | None:
    """(top_k_index, top_k_weights) from the experts' call, bound by the class's own signature; None if the call
    carries anything else."""
    try:
        bound = inspect.signature(type(experts).forward).bind(experts, x, *args, **kwargs)
    except TypeError:
        return None
    values = list(bound.arguments.values())[2:]
    return tuple(values) if len(values) == 2 and all(isinstance(v, torch.Tensor) for v in values) else None


def _lora_wrapper():
    """The ``ParamWrapper`` subclass (built on first use: importing PEFT costs seconds)."""
    from peft.tuners.lora import ParamWrapper

    class SplitExpertLora(ParamWrapper):
        """(Named ParamWrapper below: PEFT tells its parameter wrappers by class name when it nests them,
        peft/tuners/tuners_utils.py create_and_replace_param.) PEFT's ``ParamWrapper`` over a fused expert tensor whose forward never forms W + BA: the outermost wrapper
        of an experts module computes every adapted tensor of it as base plus low-rank path (``split_forward``).
        PEFT's own forward runs where this cannot: adapters disabled, merged, several active, or a dtype PEFT
        upcasts (float8)."""

        def forward(self, x: torch.Tensor, *args, **kwargs) -> torch.Tensor:
            experts = self.get_base_layer()
            factors = self._factors()
            routing = _routing(args, kwargs, experts, x) if factors is not None else None
            if routing is None:
                return super().forward(x, *args, **kwargs)
            return split_forward(experts, factors, x, *routing)

        def _factors(self) -> Factors | None:
            adapters = [a for a in self.active_adapters if a in self.lora_A]
            if len(adapters) != 1:
                return None
            factors, wrapper = {}, self
            while isinstance(wrapper, ParamWrapper):
                param = wrapper.get_param()
                if (not isinstance(wrapper, SplitExpertLora) or wrapper.disable_adapters or wrapper.merged
                        or param.dtype not in (torch.float32, torch.bfloat16, torch.float16)
                        or hasattr(param, "ds_id") or wrapper.num_experts < 2):  # DeepSpeed ZeRO-3 gathers in hooks
                    return None
                if adapters[0] in wrapper.lora_A:
                    factors[wrapper.parameter_name] = wrapper.get_delta_factors(adapters[0])
                wrapper = wrapper.base_layer
            return factors

    SplitExpertLora.__name__ = SplitExpertLora.__qualname__ = "ParamWrapper"
    return SplitExpertLora


_WRAPPER: list[type] = []


def split_wrapper() -> type:
    """The one ``SplitExpertLora`` class (PEFT's custom-module mapping and isinstance checks need one class)."""
    if not _WRAPPER:
        _WRAPPER.append(_lora_wrapper())
    return _WRAPPER[0]


def splits_in(model: nn.Module) -> bool:
    """Whether any adapter of ``model`` takes the split path (what the run's FLOPs count, ``ModelFlops.of``)."""
    return bool(_WRAPPER) and any(isinstance(m, _WRAPPER[0]) for m in model.modules())


def split_expert_classes(model: nn.Module, parameters: list[str], r: int) -> tuple[dict[type, type], list[str]]:
    """({experts class: SplitExpertLora} for PEFT's custom-module mapping, lines for the classes that keep PEFT's
    path): an experts class takes the split path when it is one of transformers' experts-interface classes and its
    first module, with random low-rank factors on the targeted ``parameters`` (``experts.gate_up_proj``), computes
    what its own forward computes with those factors folded into its weights (``check_split``)."""
    leaves = {p.rpartition(".")[2] for p in parameters}
    mapping: dict[type, type] = {}
    lines: list[str] = []
    seen: set[type] = set()
    modules = dict(model.named_modules())
    for block in moe_blocks(model):
        experts = modules[f"{block.path}.{block.experts}"]
        if type(experts) in seen:
            continue
        seen.add(type(experts))
        names = [n for n, _ in block.tensors if n in leaves]
        why = check_split(experts, names, r) if names else "not adapted"
        if why is None:
            mapping[type(experts)] = split_wrapper()
        elif names:
            lines.append(f"[anyfit] LoRA on {type(experts).__name__}: PEFT's path, which forms W + BA for every "
                         f"expert in each forward (the split low-rank path does not reproduce it exactly: {why})")
    return mapping, lines


def splits_lora(experts: nn.Module) -> bool:
    """Whether ``experts`` is one of transformers' experts-interface classes (``@use_experts_implementation``), the
    math ``split_forward`` follows: what the planner reads on the meta device; ``check_split`` confirms it."""
    return all(hasattr(experts, a) for a in _DECORATED) and not getattr(experts, "_is_expert_parallel", False)


def check_split(experts: nn.Module, names: list[str], r: int) -> str | None:
    """None if ``split_forward`` computes what ``experts`` computes, with and without low-rank factors on ``names``;
    else why not. Eight tokens routed to experts 0 and 1; the reference folds the factors into those two experts'
    weights in place and puts the weights back after (no copy of the layer). Tolerance: the round-off of the
    reductions in the weights' dtype (relative to the outputs' norms)."""
    if not splits_lora(experts):
        return "not transformers' experts interface, or expert parallel"
    params = dict(experts.named_parameters(recurse=False))
    if any(p.device.type == "meta" or hasattr(p, "ds_id") for p in params.values()):
        return "weights not materialised"
    first = params["gate_up_proj" if experts.has_gate else "up_proj"]
    hidden = first.shape[1] if experts.is_transposed else first.shape[2]
    gen = torch.Generator(first.device).manual_seed(0)  # the run's own random stream stays as it was
    top_k = min(2, experts.num_experts)
    index = torch.tensor([[i % top_k, (i + 1) % top_k][:top_k] for i in range(8)], device=first.device)
    weights = torch.rand(8, top_k, generator=gen, device=first.device, dtype=first.dtype)
    x = torch.randn(8, hidden, generator=gen, device=first.device, dtype=first.dtype)
    factors = {}
    for name in names:
        w = params[name]
        scale = math.sqrt(w.float().std().item() / math.sqrt(r)) or 1.0  # lhs @ rhs about the size of w
        factors[name] = (torch.randn(*w.shape[:2], r, generator=gen, device=w.device, dtype=w.dtype) * scale,
                         torch.randn(w.shape[0], r, w.shape[2], generator=gen, device=w.device, dtype=w.dtype) * scale,
                         1.0)
    try:
        with torch.no_grad():
            base, adapted = experts(x, index, weights), _folded(experts, factors, x, index, weights)
            split_base, split = split_forward(experts, {}, x, index, weights), split_forward(experts, factors, x,
                                                                                                index, weights)
    except Exception as error:  # noqa: BLE001 - any failure means this class keeps PEFT's path
        return f"{type(error).__name__}: {str(error)[:80]}"
    reduction = max(hidden, *(min(params[n].shape[1:]) for n in names))
    tol = min(0.25, 16 * torch.finfo(first.dtype).eps * math.sqrt(reduction))
    for what, got, want in (("base", split_base, base), ("adapter", split - split_base, adapted - base)):
        err = ((got.float() - want.float()).norm() / want.float().norm().clamp_min(1e-30)).item()
        if not err <= tol:
            return f"the {what} output differs by {err:.1e} of its norm, more than round-off ({tol:.1e})"
    return None


def _folded(experts: nn.Module, factors: Factors, x, index, weights) -> torch.Tensor:
    """The experts' own forward with the factors folded into experts 0 and 1 (in place, restored after)."""
    kept = {name: getattr(experts, name)[:2].clone() for name in factors}
    try:
        for name, (lhs, rhs, scaling) in factors.items():
            getattr(experts, name)[:2] += scaling * (lhs[:2] @ rhs[:2])
        return experts(x, index, weights)
    finally:
        for name, saved in kept.items():
            getattr(experts, name)[:2] = saved

"""The training loss: a *sum* of token cross-entropies, normalised by the caller.

Summing here and dividing by the trainable-token count of the whole accumulation window (across all
processes) in the loop is what makes every split of the same effective batch produce the same update;
a mean per micro-batch would weight short and long micro-batches differently.

Three things keep the output layer cheap, which matters with 150k-token vocabularies (Qwen: the logits of
8k tokens are 2.4 GB in bf16, 4.9 GB in fp32):
- logits are computed only at positions whose next token is trained (transformers' ``logits_to_keep``):
  prompt tokens and padding never reach the output layer;
- the cross-entropy is taken in fp32 one chunk of rows at a time, in forward and in backward, so fp32
  logits are never materialised for more than ``chunk_tokens`` rows;
- with ``train.fused_loss`` the head itself runs chunk by chunk too (``FusedHeadCrossEntropy``): no logits of
  all trained positions at all, for one more head matmul per token in the backward.

Loss per data source (``data.mix``): when a batch names the source of each trained position (``keep_source``,
and ``sources``, how many there are; ``batching.collate`` adds them), the loss is the vector of the sources'
summed cross-entropies, and the caller sums it for the objective. Every token's gradient is the one the scalar
loss gives (each row is scaled by its source's incoming gradient, all equal), so tracking the sources changes no
update; only the logged total is summed in another order.
"""

from __future__ import annotations

import functools

import torch
from torch.profiler import record_function

from anyfit.data.batching import IGNORE_INDEX
from anyfit.model.head import fused_head_of
from anyfit.model.loading import model_dtype

MODEL_INPUTS = ("input_ids", "attention_mask", "position_ids", "packed_lengths", "cu_seq_lens")


def model_inputs(batch: dict, dtype: torch.dtype | None = None) -> dict:
    """What the model's forward takes of a collated batch: the token inputs, and the processed images of image
    examples (``image_inputs``: pixel_values, image_grid_thw, ...; ``anyfit.data.image_batches``), their
    floating-point tensors in ``dtype`` (the model's) as transformers' image-text-to-text pipeline and anyfit's
    generation hand them to the model: a processor's dtype is not always the model's (Llama-4's gives bfloat16
    pixels, which an fp32 tower refuses; widening them is exact)."""
    images = {k: v.to(dtype) if dtype is not None and isinstance(v, torch.Tensor) and v.is_floating_point() else v
              for k, v in batch.get("image_inputs", {}).items()}
    return {k: batch[k] for k in MODEL_INPUTS if k in batch} | images


class ChunkedCrossEntropy(torch.autograd.Function):
    """Summed cross-entropy of (N, V) logits, computed in fp32 ``chunk`` rows at a time.

    Written by hand because ``F.cross_entropy`` on upcast logits saves an fp32 (N, V) log-softmax for
    backward; here only the logits (in their own dtype) and one fp32 log-sum-exp per row are kept, and
    backward recomputes softmax - one-hot chunk by chunk. (Liger's fused kernel does this too, on
    CUDA with Triton only; this runs on every device.)
    """

    @staticmethod
    def forward(ctx, logits: torch.Tensor, targets: torch.Tensor, chunk: int, groups: torch.Tensor | None = None,
                n_groups: int = 0) -> torch.Tensor:
        lse = torch.empty(logits.shape[0], dtype=torch.float32, device=logits.device)
        total = _sums(n_groups, logits.device)
        for start in range(0, logits.shape[0], chunk):
            x = logits[start:start + chunk].float()
            t = targets[start:start + chunk]
            lse[start:start + chunk] = row_lse = torch.logsumexp(x, dim=-1)
            picked = x.gather(1, t.clamp(min=0).unsqueeze(1)).squeeze(1)
            _add_rows(total, torch.where(t != IGNORE_INDEX, row_lse - picked, 0.0), groups, start)
        ctx.save_for_backward(logits, targets, lse, groups)
        ctx.chunk = chunk
        return total

    @staticmethod
    def backward(ctx, grad_total: torch.Tensor):
        logits, targets, lse, groups = ctx.saved_tensors
        grad = torch.empty_like(logits)
        for start in range(0, logits.shape[0], ctx.chunk):
            end = start + ctx.chunk
            t = targets[start:end].unsqueeze(1)
            row_scale = (t != IGNORE_INDEX).float() * _row_grad(grad_total, groups, start, end)  # 0: ignored rows
            # softmax - one-hot, scaled; written in place (straight into the result when it is fp32)
            in_place = grad.dtype == torch.float32
            g = grad[start:end] if in_place else torch.empty(grad[start:end].shape, device=grad.device)
            torch.sub(logits[start:end].float(), lse[start:end].unsqueeze(1), out=g).exp_()
            g.scatter_add_(1, t.clamp(min=0), -torch.ones_like(row_scale))
            g.mul_(row_scale)
            if not in_place:
                grad[start:end] = g
        return grad, None, None, None, None


class FusedHeadCrossEntropy(torch.autograd.Function):
    """Summed cross-entropy of ``hidden @ weight.T (+ bias)`` over (N, h) hidden states, ``chunk`` rows at a time,
    the logits never whole: the forward keeps one fp32 log-sum-exp per row, the backward recomputes each chunk's
    logits and turns softmax - one-hot into the hidden states' and the weight's gradients (the weight's summed in
    fp32 over the chunks and handed back once, which DDP and FSDP2 expect). The matmuls run in ``dtype`` (autocast's,
    or the weight's), as the head would. Written by hand for the reason ``ChunkedCrossEntropy`` is (Liger's fused
    linear cross-entropy is CUDA/Triton only; DeepSpeed's tiled loss hands gradients to ``.grad`` per chunk)."""

    @staticmethod
    def forward(ctx, hidden: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, targets: torch.Tensor,
                chunk: int, dtype: torch.dtype, sources: tuple[torch.Tensor | None, int] = (None, 0)) -> torch.Tensor:
        groups, n_groups = sources  # each row's source and their number (data.mix), or (None, 0): one sum
        w = weight.to(dtype)
        lse = torch.empty(hidden.shape[0], dtype=torch.float32, device=hidden.device)
        total = _sums(n_groups, hidden.device)
        for start in range(0, hidden.shape[0], chunk):
            x = _head_logits(hidden[start:start + chunk], w, bias)
            t = targets[start:start + chunk]
            lse[start:start + chunk] = row_lse = torch.logsumexp(x, dim=-1)
            picked = x.gather(1, t.clamp(min=0).unsqueeze(1)).squeeze(1)
            _add_rows(total, torch.where(t != IGNORE_INDEX, row_lse - picked, 0.0), groups, start)
        ctx.save_for_backward(hidden, weight, bias, targets, lse, groups)
        ctx.chunk, ctx.dtype = chunk, dtype
        return total

    @staticmethod
    def backward(ctx, grad_total: torch.Tensor):
        hidden, weight, bias, targets, lse, groups = ctx.saved_tensors
        w = weight.to(ctx.dtype)
        grad_hidden = torch.empty_like(hidden)
        grad_weight = torch.zeros(weight.shape, dtype=torch.float32, device=weight.device) \
            if ctx.needs_input_grad[1] else None
        grad_bias = torch.zeros(bias.shape, dtype=torch.float32, device=bias.device) \
            if bias is not None and ctx.needs_input_grad[2] else None
        for start in range(0, hidden.shape[0], ctx.chunk):
            end = start + ctx.chunk
            h = hidden[start:end]
            t = targets[start:end].unsqueeze(1)
            g = _head_logits(h, w, bias).sub_(lse[start:end].unsqueeze(1)).exp_()  # softmax
            g.scatter_add_(1, t.clamp(min=0), -torch.ones_like(t, dtype=g.dtype))  # - one-hot
            g.mul_((t != IGNORE_INDEX).float() * _row_grad(grad_total, groups, start, end))
            g_low = g.to(ctx.dtype)
            grad_hidden[start:end] = (g_low @ w).to(hidden.dtype)
            if grad_weight is not None:
                grad_weight += (g_low.t() @ h.to(ctx.dtype)).float()
            if grad_bias is not None:
                grad_bias += g.sum(dim=0)
        return (grad_hidden, None if grad_weight is None else grad_weight.to(weight.dtype),
                None if grad_bias is None else grad_bias.to(bias.dtype), None, None, None, None)


def _sums(n_groups: int, device) -> torch.Tensor:
    """The fp32 accumulator of a summed loss: one number, or one per source."""
    return torch.zeros(n_groups or (), dtype=torch.float32, device=device)


def _add_rows(total: torch.Tensor, rows: torch.Tensor, groups: torch.Tensor | None, start: int) -> None:
    """Add a chunk's row losses (rows ``start``...) to the total, or to their sources' sums."""
    if groups is None:
        total += rows.sum()
    else:
        total.index_add_(0, groups[start:start + rows.shape[0]], rows)


def _row_grad(grad_total: torch.Tensor, groups: torch.Tensor | None, start: int, end: int) -> torch.Tensor:
    """The incoming gradient of rows ``start:end``: the total's, or each row's source's, as a column."""
    return grad_total if groups is None else grad_total[groups[start:end]].unsqueeze(1)


def _head_logits(hidden: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """One chunk's logits in fp32 (the matmul in ``weight``'s dtype)."""
    x = hidden.to(weight.dtype) @ weight.t()
    if bias is not None:
        x = x + bias.to(x.dtype)
    return x.float()


def cross_entropy_sum(logits: torch.Tensor, targets: torch.Tensor, chunk_tokens: int,
                      groups: torch.Tensor | None = None, n_groups: int = 0) -> torch.Tensor:
    """Summed fp32 cross-entropy over rows whose target is not IGNORE_INDEX; chunked unless chunk_tokens=0. With
    ``groups`` (each row's source, of ``n_groups``): the (n_groups,) sums per source."""
    if chunk_tokens <= 0:
        if groups is None:
            return torch.nn.functional.cross_entropy(logits.float(), targets, ignore_index=IGNORE_INDEX,
                                                     reduction="sum")
        rows = torch.nn.functional.cross_entropy(logits.float(), targets, ignore_index=IGNORE_INDEX, reduction="none")
        return _sums(n_groups, logits.device).index_add(0, groups, rows)
    return ChunkedCrossEntropy.apply(logits, targets, chunk_tokens, groups, n_groups)


def source_groups(batch: dict) -> tuple[torch.Tensor | None, int]:
    """(each kept position's source, how many sources) of a batch that names them, else (None, 0)."""
    return (batch["keep_source"], batch["sources"]) if "keep_source" in batch else (None, 0)


def token_loss_sum(model: torch.nn.Module, batch: dict[str, torch.Tensor], chunk_tokens: int = 1024) -> torch.Tensor:
    """Sum of next-token cross-entropy over the trained positions of a batch made by ``batching.collate``: one
    number, or the sums per source when the batch names its sources (the module docstring)."""
    inputs = model_inputs(batch, model_dtype(model))
    groups, n_groups = source_groups(batch)
    head = fused_head_of(model)
    if head is None:
        logits = _kept_outputs(model, inputs, batch["keep"])
        with record_function("anyfit.loss"):  # the logits' share of a profiled step
            return cross_entropy_sum(logits.reshape(-1, logits.shape[-1]), batch["keep_targets"], chunk_tokens,
                                     groups, n_groups)
    # train.fused_loss: the head hands over its inputs, and head and loss run together chunk by chunk
    with head.handing_inputs():
        hidden = _kept_outputs(model, inputs, batch["keep"])
    hidden = hidden.reshape(-1, hidden.shape[-1])
    device = hidden.device.type
    dtype = torch.get_autocast_dtype(device) if torch.is_autocast_enabled(device) else head.weight.dtype
    with record_function("anyfit.loss"):
        return FusedHeadCrossEntropy.apply(hidden, head.weight, head.bias, batch["keep_targets"],
                                           chunk_tokens or 1024, dtype, (groups, n_groups))


def kept_logits(model: torch.nn.Module, batch: dict[str, torch.Tensor]) -> torch.Tensor:
    """(N, V) logits at a batch's kept positions (those whose next token is trained), in ``keep_targets``' order:
    what ``training.forgetting`` compares with the base model's."""
    logits = _kept_outputs(model, model_inputs(batch, model_dtype(model)), batch["keep"])
    return logits.reshape(-1, logits.shape[-1])


def _kept_outputs(model: torch.nn.Module, inputs: dict, keep: torch.Tensor) -> torch.Tensor:
    """The model's output (logits, or the head's inputs) at the positions whose next token is trained."""
    if keep.ndim == 2 and not _logits_to_keep_takes_a_mask():
        # transformers < 5.21 (the last on Python 3.10 is 5.20) keeps the same positions in every row: keep the
        # positions any row trains on, then pick each row's own from those outputs.
        columns = keep.any(dim=0).nonzero().squeeze(1)
        return model(**inputs, logits_to_keep=columns, use_cache=False).logits[keep[:, columns]]
    return model(**inputs, logits_to_keep=keep, use_cache=False).logits


@functools.cache
def _logits_to_keep_takes_a_mask() -> bool:
    """Whether this transformers reads a 2D boolean ``logits_to_keep`` as a per-row mask (5.21 and later)."""
    import transformers.modeling_utils

    return hasattr(transformers.modeling_utils, "slice_logits_to_keep")

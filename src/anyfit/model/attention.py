"""Attention over packed rows that never crosses an example boundary and never builds a dense mask of the row.

transformers already keeps packed examples apart when it is given ``position_ids`` that restart at 0:
for SDPA and eager it builds a block-diagonal (T x T) mask, and attention is computed over the whole
row and then masked. For a row of 8 examples that is about 8x the attention work, and the dense mask
keeps SDPA off its fastest kernels. FlashAttention's varlen kernels avoid both, but need the
flash-attn package. So anyfit registers one more implementation through transformers' documented
extension points (``AttentionInterface`` / ``AttentionMaskInterface``), named ``anyfit_varlen``, which runs
attention on each example's slice of the row:

- on CUDA in bf16/fp16: PyTorch's own varlen FlashAttention (``torch.nn.attention.varlen.varlen_attn``,
  torch >= 2.9), no extra package, its ``window_size`` for sliding-window layers;
- elsewhere (CPU, MPS, fp32): causal SDPA on each example's slice (a band mask where a sliding window binds);
- where the layer asks for more than SDPA computes (softcapping, attention sinks, any keyword this module does not
  know, or a model whose class does not support SDPA): the model's own ``eager_attention_forward`` on each slice,
  with the slice's causal (and windowed) mask: the model's own arithmetic, one example at a time.

What the layer hands the attention function decides the path (``sliding_window``, ``softcap``, ``s_aux``, ...), and
the layer's type in ``config.layer_types`` supplies a window the model applies only through its mask. A pattern
this module cannot compute per slice (chunked attention) raises ``NotExactPacked``; ``anyfit.model.packing_check``
then hands the model back to transformers' own implementation. That start-up self-test is what catches the
architecture released next month: it compares packed rows with one example at a time on the real model.

The example boundaries come from ``batching.collate`` as the ``packed_lengths`` keyword of the model
call (host integers, so no device sync is needed to split the row). Without that keyword (generation,
padded batches) the call is plain SDPA with transformers' usual mask.
"""

from __future__ import annotations

import contextlib
import functools
import inspect
import sys

import torch
import torch.nn.functional as F
from transformers import AttentionInterface
from transformers.integrations.sdpa_attention import sdpa_attention_forward
from transformers.masking_utils import AttentionMaskInterface, sdpa_mask

from anyfit.model.packing import LAYER_KINDS

NAME = "anyfit_varlen"

# Keywords transformers passes through to every attention function that do not change what it computes.
_NEUTRAL = frozenset({
    "position_ids", "cu_seq_lens_q", "cu_seq_lens_k", "max_length_q", "max_length_k", "seq_idx", "is_causal",
    "output_attentions", "output_hidden_states", "output_router_logits", "num_items_in_batch", "use_cache",
    "cache_position", "past_key_values", "position_embeddings", "token_type_ids", "return_dict",
})


class NotExactPacked(RuntimeError):
    """This module cannot compute the layer's attention per example exactly (the reason is the message)."""


_seen: set[str] | None = None  # the kernels packed rows ran on, while ``kernels_used`` watches


@contextlib.contextmanager
def kernels_used():
    """Collect, while open, which per-example kernel each packed attention call ran (for the start-up line)."""
    global _seen
    _seen = found = set()
    try:
        yield found
    finally:
        _seen = None


def _ran(kernel: str) -> None:
    if _seen is not None:
        _seen.add(kernel)


def _find_varlen_flash():
    """PyTorch's varlen FlashAttention (CUDA) and whether it takes a ``window_size``, or None if absent.

    Its signature moved between releases: ``is_causal=True`` first, then ``window_size=(-1, 0)``, whose
    default (-1, -1) means *full* attention, so the keyword is chosen from the signature, never assumed.
    """
    try:
        from torch.nn.attention.varlen import varlen_attn
    except ImportError:  # torch < 2.9
        return None
    params = inspect.signature(varlen_attn).parameters
    if "window_size" not in params and "is_causal" not in params:
        return None
    return varlen_attn, "window_size" in params, "enable_gqa" in params


_VARLEN_FLASH = _find_varlen_flash()  # resolved once at import (also keeps torch.compile from tracing it)


def _flash_dtype(query: torch.Tensor) -> torch.dtype | None:
    """The half dtype to run varlen FlashAttention in, if any (under autocast RoPE may have made q fp32)."""
    if not query.is_cuda:
        return None
    if query.dtype in (torch.bfloat16, torch.float16):
        return query.dtype
    if torch.is_autocast_enabled("cuda"):
        return torch.get_autocast_dtype("cuda")
    return None


def layer_window(module: torch.nn.Module, kwargs: dict) -> int | None:
    """The sliding window this layer attends within (None: full causal attention).

    The keyword the layer passes wins; otherwise the layer's type in ``config.layer_types`` (a model may apply its
    window through the mask alone). A layer type other than full or sliding attention raises ``NotExactPacked``."""
    if kwargs.get("sliding_window") is not None:
        return int(kwargs["sliding_window"])
    config, index = getattr(module, "config", None), getattr(module, "layer_idx", None)
    types = getattr(config, "layer_types", None) if config is not None else None
    if types is None or index is None or index >= len(types):
        return None
    kind = LAYER_KINDS.get(types[index])
    if kind is None or not kind.per_example:
        raise NotExactPacked(f"its '{types[index]}' layers")
    return int(config.sliding_window) if kind.sliding and config.sliding_window else None


def _eager_reason(module: torch.nn.Module, kwargs: dict) -> str:
    """Why SDPA would not compute this layer's attention as the model does ('' when it would): keywords that change
    the arithmetic (softcap, s_aux, any this module does not know), or a model that declares no SDPA support."""
    extra = sorted(k for k, v in kwargs.items() if v is not None and k not in _NEUTRAL and k != "sliding_window")
    if extra:
        return ", ".join(extra)
    return "" if _supports_sdpa(type(module)) else "its attention (the model does not support SDPA)"


@functools.lru_cache(maxsize=None)
def _supports_sdpa(layer: type) -> bool:
    """Whether the model classes defined beside this attention layer declare SDPA support (gpt-oss and Gemma-2 do
    not: sinks, softcapping). A layer does not know its model, so the flag is read from its module's classes."""
    found = sys.modules.get(layer.__module__)
    flags = [cls._supports_sdpa for cls in vars(found).values() if isinstance(cls, type)
             and cls.__module__ == layer.__module__ and isinstance(getattr(cls, "_supports_sdpa", None), bool)] \
        if found else []
    return all(flags)


def _band(length: int, window: int | None, device) -> torch.Tensor | None:
    """The (length x length) causal mask of one example, windowed (True: attend); None when plain causal does."""
    if window is None or length <= window:
        return None
    q = torch.arange(length, device=device)[:, None]
    kv = torch.arange(length, device=device)[None, :]
    return (kv <= q) & (kv > q - window)


def _additive(mask: torch.Tensor | None, dtype: torch.dtype) -> torch.Tensor | None:
    """A boolean mask (True: attend) as the additive float mask eager attention adds to its scores."""
    if mask is None or mask.dtype != torch.bool:
        return mask
    return torch.zeros(mask.shape, dtype=dtype, device=mask.device).masked_fill(~mask, torch.finfo(dtype).min)


def packed_attention(module: torch.nn.Module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                     attention_mask: torch.Tensor | None, dropout: float = 0.0, scaling: float | None = None,
                     packed_lengths: tuple[int, ...] | None = None, cu_seq_lens: torch.Tensor | None = None,
                     **kwargs) -> tuple[torch.Tensor, None]:
    """query (B, heads, T, dim), key/value (B, kv_heads, T, dim) -> output (B, T, heads, dim), like transformers'.

    Packed rows have B = 1; without ``packed_lengths`` and without a mask, each row is one whole example."""
    dropout = dropout if module.training else 0.0
    eager_reason = _eager_reason(module, kwargs)
    if packed_lengths is None:
        if attention_mask is not None or query.shape[2] != key.shape[2]:  # padded rows, or decoding with a cache
            if eager_reason:
                return _eager_of(module, eager_reason)(module, query, key, value,
                                                       _additive(attention_mask, query.dtype), dropout=dropout,
                                                       scaling=scaling, **kwargs)
            return sdpa_attention_forward(module, query, key, value, attention_mask, dropout=dropout,
                                          scaling=scaling, **kwargs)
        packed_lengths = (query.shape[2],)
    window = layer_window(module, kwargs)
    if eager_reason:
        _ran(f"the model's own eager attention ({eager_reason}; a length x length score matrix per example)")
        return _eager_per_example(module, query, key, value, dropout, scaling, packed_lengths, window, kwargs,
                                  eager_reason)
    gqa = query.shape[1] != key.shape[1]
    flash, dtype = _VARLEN_FLASH, _flash_dtype(query)
    if (flash is not None and dtype is not None and not dropout and query.shape[0] == 1 and cu_seq_lens is not None
            and (window is None or flash[1])):
        varlen_attn, has_window, has_gqa = flash
        q, k, v = (t[0].transpose(0, 1).to(dtype) for t in (query, key, value))  # (T, heads, dim)
        if gqa and not has_gqa:
            group = q.shape[1] // k.shape[1]
            k, v = k.repeat_interleave(group, dim=1), v.repeat_interleave(group, dim=1)
        extra = {"enable_gqa": True} if gqa and has_gqa else {}
        # window w: the token itself and w - 1 before it (transformers' sliding_window_overlay: kv > q - w)
        causal = {"window_size": (-1 if window is None else window - 1, 0)} if has_window else {"is_causal": True}
        longest = max(packed_lengths)
        _ran("varlen FlashAttention" + (f" (window {window})" if window else ""))
        out = varlen_attn(q, k, v, cu_seq_lens, cu_seq_lens, longest, longest, scale=scaling, **causal, **extra)
        return out.unsqueeze(0), None
    _ran("SDPA" + (f" (window {window}: a band mask where an example is longer)" if window else ""))
    outs, start = [], 0
    for length in packed_lengths:
        end = start + length
        band = _band(length, window, query.device)
        outs.append(F.scaled_dot_product_attention(query[:, :, start:end], key[:, :, start:end], value[:, :, start:end],
                                                   attn_mask=band, dropout_p=dropout, is_causal=band is None,
                                                   scale=scaling, enable_gqa=gqa))
        start = end
    return torch.cat(outs, dim=2).transpose(1, 2).contiguous(), None


def _eager_of(module: torch.nn.Module, reason: str):
    """The model's own eager attention function (defined next to its attention class)."""
    eager = getattr(sys.modules.get(type(module).__module__), "eager_attention_forward", None)
    if eager is None:
        raise NotExactPacked(f"its attention needs {reason}, and its module has no eager_attention_forward")
    return eager


def _eager_per_example(module, query, key, value, dropout, scaling, packed_lengths, window, kwargs, reason):
    """The model's own eager attention on each example's slice, with that slice's causal (windowed) mask."""
    eager = _eager_of(module, reason)
    outs, start = [], 0
    for length in packed_lengths:
        end = start + length
        band = _band(length, window, query.device)
        if band is None:
            band = torch.ones(length, length, dtype=torch.bool, device=query.device).tril()
        out, _ = eager(module, query[:, :, start:end], key[:, :, start:end], value[:, :, start:end],
                       _additive(band[None, None], query.dtype), dropout=dropout, scaling=scaling, **kwargs)
        outs.append(out)
        start = end
    return torch.cat(outs, dim=1), None


def packed_mask(*args, attention_mask: torch.Tensor | None = None, **kwargs):
    """No mask for packed rows or unpadded ones (``packed_attention`` applies the boundaries and windows itself);
    transformers' SDPA mask for padded rows."""
    if attention_mask is None:
        return None
    return sdpa_mask(*args, attention_mask=attention_mask, **kwargs)


def register() -> str:
    """Make ``anyfit_varlen`` a valid ``attn_implementation`` (idempotent); returns its name."""
    AttentionInterface.register(NAME, packed_attention)
    AttentionMaskInterface.register(NAME, packed_mask)
    return NAME

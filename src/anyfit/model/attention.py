"""Attention over packed rows that never crosses an example boundary and never builds a dense mask.

transformers already keeps packed examples apart when it is given ``position_ids`` that restart at 0:
for SDPA and eager it builds a block-diagonal (T x T) mask, and attention is computed over the whole
row and then masked. For a row of 8 examples that is about 8x the attention work, and the dense mask
keeps SDPA off its fastest kernels. FlashAttention's varlen kernels avoid both, but need the
flash-attn package. So anyfit registers one more implementation through transformers' documented
extension points (``AttentionInterface`` / ``AttentionMaskInterface``), named ``anyfit_varlen``:

- on CUDA in bf16/fp16: PyTorch's own varlen FlashAttention (``torch.nn.attention.varlen.varlen_attn``,
  torch >= 2.9), no extra package;
- elsewhere (CPU, MPS, fp32): causal SDPA on each example's slice of the row.

The example boundaries come from ``batching.collate`` as the ``packed_lengths`` keyword of the model
call (host integers, so no device sync is needed to split the row). Without that keyword (generation,
padded batches) the call is plain SDPA with transformers' usual mask.
"""

from __future__ import annotations

import inspect

import torch
import torch.nn.functional as F
from transformers import AttentionInterface
from transformers.integrations.sdpa_attention import sdpa_attention_forward
from transformers.masking_utils import AttentionMaskInterface, sdpa_mask

NAME = "anyfit_varlen"


def _find_varlen_flash():
    """PyTorch's varlen FlashAttention (CUDA) and how to ask it for causal attention, or None if absent.

    Its signature moved between releases: ``is_causal=True`` first, then ``window_size=(-1, 0)``, whose
    default (-1, -1) means *full* attention, so the keyword is chosen from the signature, never assumed.
    """
    try:
        from torch.nn.attention.varlen import varlen_attn
    except ImportError:  # torch < 2.9
        return None
    params = inspect.signature(varlen_attn).parameters
    if "window_size" in params:
        causal = {"window_size": (-1, 0)}
    elif "is_causal" in params:
        causal = {"is_causal": True}
    else:
        return None
    return varlen_attn, causal, "enable_gqa" in params


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


def packed_attention(module: torch.nn.Module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                     attention_mask: torch.Tensor | None, dropout: float = 0.0, scaling: float | None = None,
                     packed_lengths: tuple[int, ...] | None = None, cu_seq_lens: torch.Tensor | None = None,
                     **kwargs) -> tuple[torch.Tensor, None]:
    """query (1, heads, T, dim), key/value (1, kv_heads, T, dim) -> output (1, T, heads, dim), like transformers'."""
    if packed_lengths is None:
        return sdpa_attention_forward(module, query, key, value, attention_mask, dropout=dropout, scaling=scaling,
                                      **kwargs)
    dropout = dropout if module.training else 0.0
    gqa = query.shape[1] != key.shape[1]
    flash, dtype = _VARLEN_FLASH, _flash_dtype(query)
    if flash is not None and dtype is not None and not dropout:
        varlen_attn, causal, has_gqa = flash
        q, k, v = (t[0].transpose(0, 1).to(dtype) for t in (query, key, value))  # (T, heads, dim)
        if gqa and not has_gqa:
            group = q.shape[1] // k.shape[1]
            k, v = k.repeat_interleave(group, dim=1), v.repeat_interleave(group, dim=1)
        extra = {"enable_gqa": True} if gqa and has_gqa else {}
        longest = max(packed_lengths)
        out = varlen_attn(q, k, v, cu_seq_lens, cu_seq_lens, longest, longest, scale=scaling, **causal, **extra)
        return out.unsqueeze(0), None
    outs, start = [], 0
    for length in packed_lengths:
        end = start + length
        outs.append(F.scaled_dot_product_attention(query[:, :, start:end], key[:, :, start:end], value[:, :, start:end],
                                                   dropout_p=dropout, is_causal=True, scale=scaling, enable_gqa=gqa))
        start = end
    return torch.cat(outs, dim=2).transpose(1, 2).contiguous(), None


def packed_mask(*args, attention_mask: torch.Tensor | None = None, **kwargs):
    """No mask for packed rows (the boundaries are applied by ``packed_attention``); SDPA's mask otherwise."""
    if attention_mask is None:
        return None
    return sdpa_mask(*args, attention_mask=attention_mask, **kwargs)


def register() -> str:
    """Make ``anyfit_varlen`` a valid ``attn_implementation`` (idempotent); returns its name."""
    AttentionInterface.register(NAME, packed_attention)
    AttentionMaskInterface.register(NAME, packed_mask)
    return NAME

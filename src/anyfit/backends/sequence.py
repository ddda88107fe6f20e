"""Sequence parallelism (``runtime.sequence_parallel: N``): each sequence of a micro-batch is cut into N
consecutive parts, one per process of a group of N, so one process holds 1/N of its activations.

The engine is DeepSpeed's Ulysses (``deepspeed.runtime.sequence_parallel.ulysses_sp``, the ALST work), not a
home-made one: its attention wrapper trades the sequence split for a head split with one all-to-all before the
core attention and one after, so every process runs ordinary (SDPA, varlen, FlashAttention) attention over the
*whole* sequence for 1/N of the heads, and everything outside attention (norms, MLP, the loss) is per token and
needs no communication. Chosen over PyTorch's context parallel (ring attention): that one runs on CUDA only
(its SDPA ring needs the flash/efficient kernels), while Ulysses' all-to-all runs on gloo too, so the split run
is tested here against the unsplit one on CPU processes. DeepSpeed is already anyfit's ZeRO-3 engine; the
wrapper does not need a DeepSpeed engine, only its process groups (``parallel_state_sp``).

How anyfit uses it:
- the processes form groups of N consecutive ranks (DeepSpeed's layout); a group draws one data-parallel share
  of each window (``SequenceSplit.data_rank`` is the sampler's process index), so the data order depends on the
  number of groups only as any data-parallel run's does (it does not: windows are global);
- every micro-batch is collated whole on each process of the group, padded to a multiple of N, and cut
  (``shard_batch``): input ids, global position ids (restarting per packed example), and the positions whose
  next token is trained with their targets (``collate`` shifted labels per example already, so a cut never
  separates a position from its target). Packed boundaries (``packed_lengths``) stay whole: after the
  all-to-all the attention sees the whole row;
- the loss of a process is its part's summed token loss; the loop divides by the window's trained tokens and
  the gradient reduction sums over all processes, so the update is the mean over every trained token of the
  window, as without the split.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass

import torch

from anyfit.data.batching import IGNORE_INDEX


@dataclass(frozen=True)
class SequenceSplit:
    """Where this process sits: part ``rank`` of ``degree`` of each sequence, in data-parallel group
    ``data_rank`` of ``data_size``."""

    degree: int = 1
    rank: int = 0
    data_rank: int = 0
    data_size: int = 1

    @classmethod
    def of(cls, degree: int, process_index: int, processes: int) -> SequenceSplit:
        return cls(degree, process_index % degree, process_index // degree, processes // degree)

    @property
    def active(self) -> bool:
        return self.degree > 1

    def counts(self) -> bool:
        """Whether this process counts a group's shared numbers (tokens, FLOPs): one process per group does."""
        return self.rank == 0

    def loss(self, loss_fn):
        """``loss_fn(model, batch)`` on this process's part of the batch (the same function when not split)."""
        if not self.active:
            return loss_fn

        def split_loss(model, batch):
            return loss_fn(model, shard_batch(batch, self.degree, self.rank))

        return split_loss


def split_attention(model, degree: int) -> None:
    """Route the model's attention through DeepSpeed's Ulysses wrapper for groups of ``degree`` consecutive
    processes (collective: every process calls it once, before the first training forward; it swaps the function
    that transformers' registry holds for the model's attention implementation, so wrapping does not matter).

    What ``UlyssesSPAttentionHF.register_with_transformers`` does, written out for two reasons: its wrapper
    checks every call against one fixed number of rows (anyfit's micro-batches differ: a packed row is one,
    the micro-batch probe tries several), and it takes the implementation name to wrap from the caller, where
    here it is the one the model was loaded with."""
    import deepspeed
    import deepspeed.runtime.sequence_parallel.parallel_state_sp as groups
    import torch.distributed as dist
    from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

    deepspeed.init_distributed(dist_backend=dist.get_backend(), dist_init_required=False, verbose=False)
    groups.initialize_sequence_parallel(sequence_parallel_size=degree)
    config = model.config.get_text_config()
    implementation = model.config._attn_implementation
    heads = config.num_attention_heads
    uattn = _any_rows_ulysses()(
        attn=ALL_ATTENTION_FUNCTIONS[implementation], batch_size=1, attn_head_count=heads,
        attn_head_size=getattr(config, "head_dim", None) or config.hidden_size // heads,
        kv_head_count=config.num_key_value_heads, num_hidden_layers=config.num_hidden_layers,
        process_group=groups.get_sequence_parallel_group(), seq_length_is_variable=True)
    uattn.core_attn_implementation = implementation

    def ulysses(module, query, key, value, attention_mask, *args, **kwargs):
        # the mask transformers made is for this process's part; after the all-to-all the attention runs over
        # the whole sequence, causal by position (padding is only ever at the end of a row, and packed rows
        # carry their boundaries in packed_lengths)
        return uattn(module, query, key, value, None, *args, **kwargs)

    ALL_ATTENTION_FUNCTIONS[implementation] = ulysses


def _any_rows_ulysses():
    """The wrapper class below, built on first use (DeepSpeed is an optional dependency)."""
    from deepspeed.runtime.sequence_parallel.ulysses_sp import UlyssesSPAttentionHF

    class AnyRowsUlysses(UlyssesSPAttentionHF):
        """DeepSpeed's wrapper with the expected number of rows taken from each call (it re-reads the sequence
        length per call already, but fixes the rows at construction)."""

        def forward(self, module, query, key, value, attention_mask, *args, **kwargs):
            rows = query.shape[0]
            self.required_query_shape = torch.Size([1, rows, *self.required_query_shape[2:]])
            self.required_key_value_shape = torch.Size([1, rows, *self.required_key_value_shape[2:]])
            self.required_context_shape = torch.Size([1, rows, *self.required_context_shape[2:]])
            return super().forward(module, query, key, value, attention_mask, *args, **kwargs)

    return AnyRowsUlysses


def shard_batch(batch: dict, degree: int, rank: int) -> dict:
    """Part ``rank`` of ``degree`` of a batch made by ``batching.collate``: the sequence dimension padded to a
    multiple of ``degree`` and cut into consecutive parts; the trained positions and their targets that fall in
    this part. Packed rows keep their whole ``packed_lengths`` (the padding is one more, untrained, example)."""
    ids = batch["input_ids"]
    rows, length = ids.shape
    pad = -length % degree
    part = (length + pad) // degree
    start, end = rank * part, (rank + 1) * part
    device = ids.device
    out = {}
    if "packed_lengths" in batch:
        lengths = tuple(batch["packed_lengths"]) + ((pad,) if pad else ())
        positions = torch.cat([batch["position_ids"], torch.arange(pad, device=device).unsqueeze(0)], dim=1)
        keep, targets = batch["keep"], batch["keep_targets"]
        mine = (keep >= start) & (keep < end)
        out.update(packed_lengths=lengths, cu_seq_lens=torch.tensor([0, *itertools.accumulate(lengths)],
                                                                    dtype=torch.int32, device=device),
                   keep=keep[mine] - start, keep_targets=targets[mine])
        if "keep_source" in batch:  # data.mix: each kept position's source goes with it
            out.update(keep_source=batch["keep_source"][mine], sources=batch["sources"])
    else:
        positions = torch.arange(length + pad, device=device).expand(rows, -1)
        shifted = torch.full((rows, length + pad), IGNORE_INDEX, dtype=torch.long, device=device)
        shifted[:, :length][batch["keep"]] = batch["keep_targets"]
        keep = shifted[:, start:end] != IGNORE_INDEX
        out.update(keep=keep, keep_targets=shifted[:, start:end][keep])
        if "keep_source" in batch:
            source = torch.zeros((rows, length + pad), dtype=torch.long, device=device)
            source[:, :length][batch["keep"]] = batch["keep_source"]
            out.update(keep_source=source[:, start:end][keep], sources=batch["sources"])
    padded = torch.cat([ids, ids.new_zeros(rows, pad)], dim=1) if pad else ids
    out.update(input_ids=padded[:, start:end], position_ids=positions[:, start:end].contiguous())
    return out

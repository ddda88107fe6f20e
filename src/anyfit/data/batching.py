"""Which examples go into which optimizer step, micro-batch and process, and how they are padded.

Written by hand rather than using a DataLoader sampler sharded by Accelerate: the unit that must be
identical on every machine is the *accumulation window* (the effective batch of one optimizer step),
not the micro-batch. Every process draws the same seeded permutation, cuts it into windows of
``effective_batch`` examples and takes its own slice, so 1 process x 8 micro-steps and 2 processes x
4 micro-steps train on exactly the same examples per step. The position in the data is just the step
number, which is what makes exact resume simple.

A worked example, five examples over two processes, step by step: ``WindowSampler`` (which examples land in which
window, process and micro-batch) and ``collate`` (the tensors of one micro-batch, padded and packed).
"""

from __future__ import annotations

import itertools
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np
import torch

from anyfit.config import ConfigError, TrainConfig
from anyfit.data.tokenization import IGNORE_INDEX


@dataclass(frozen=True)
class BatchPlan:
    """effective_batch = micro_batch x accumulation x processes, checked once at start."""

    effective_batch: int
    micro_batch: int
    accumulation: int
    processes: int

    @staticmethod
    def from_config(cfg: TrainConfig, processes: int, micro_batch: int | None = None) -> "BatchPlan":
        """``micro_batch`` overrides the config's value (used once ``auto`` has been measured)."""
        requested = micro_batch if micro_batch is not None else cfg.micro_batch
        per_process, rem = divmod(cfg.effective_batch, processes)
        if rem:
            raise ConfigError(f"train.effective_batch={cfg.effective_batch} cannot be split evenly over {processes} "
                              f"processes; use a multiple of {processes} (e.g. {per_process * processes or processes}"
                              f" or {(per_process + 1) * processes}).")
        if requested == "auto":  # a placeholder until the probe has measured; the split is valid
            requested = 1
        micro = min(requested, per_process)
        accumulation, rem = divmod(per_process, micro)
        if rem:
            divisors = [d for d in range(1, per_process + 1) if per_process % d == 0]
            ok = max(d for d in divisors if d <= micro)
            raise ConfigError(f"train.micro_batch={requested} does not divide the {per_process} sequences each of "
                              f"the {processes} process(es) gets per step (effective_batch={cfg.effective_batch}); "
                              f"use train.micro_batch={ok} (valid: {divisors}).")
        return BatchPlan(cfg.effective_batch, micro, accumulation, processes)

    @property
    def per_process(self) -> int:
        return self.effective_batch // self.processes

    def with_micro_batch(self, micro: int) -> "BatchPlan":
        """The same effective batch with another micro-batch (it must divide the per-process share)."""
        assert self.per_process % micro == 0, (self.per_process, micro)
        return BatchPlan(self.effective_batch, micro, self.per_process // micro, self.processes)

    def candidates(self) -> list[int]:
        """Micro-batch sizes that keep the effective batch exactly (``micro_batch_candidates``)."""
        return micro_batch_candidates(self.per_process)

    def describe(self) -> str:
        return (f"effective batch {self.effective_batch} = micro-batch {self.micro_batch} x accumulation "
                f"{self.accumulation} x processes {self.processes}")


def micro_batch_candidates(per_process: int) -> list[int]:
    """Micro-batch sizes that keep the effective batch exactly: the divisors of the per-process share,
    ascending. The one rule behind ``micro_batch=auto`` (measured) and ``anyfit plan`` (estimated), so
    both choose among the same values."""
    return [d for d in range(1, per_process + 1) if per_process % d == 0]


def choose_micro_batch(per_process: int, peak_of: Callable[[int], int | None], budget: int) -> int | None:
    """The largest micro-batch among ``micro_batch_candidates`` whose peak memory (``peak_of``: measured by
    the probe, estimated by the planner; None for out of memory) stays within ``budget`` bytes. Candidates
    are tried in ascending order and the first that does not fit ends the search (memory grows with the
    micro-batch); None if even 1 does not fit."""
    chosen = None
    for micro in micro_batch_candidates(per_process):
        peak = peak_of(micro)
        if peak is None or peak > budget:
            break
        chosen = micro
    return chosen


def example_lengths(examples) -> np.ndarray:
    """Tokens per example, without materialising a token store's examples."""
    if hasattr(examples, "lengths"):
        return np.asarray(examples.lengths, dtype=np.int64)
    return np.fromiter((len(e["input_ids"]) for e in examples), dtype=np.int64, count=len(examples))


def trained_tokens(examples) -> np.ndarray:
    """Trained tokens (labels other than ``IGNORE_INDEX``) per example."""
    if hasattr(examples, "trainable"):
        return np.asarray(examples.trainable, dtype=np.int64)
    return np.fromiter((len(e["labels"]) - e["labels"].count(IGNORE_INDEX) for e in examples), dtype=np.int64,
                       count=len(examples))


class WindowSampler:
    """Deterministic accumulation windows: ``window(step)`` gives this process's micro-batches for that step.

    Lengths, trained-token counts and the epoch's permutation are arrays, not lists: as Python ints they cost
    every process tens of MiB at a million examples (BENCHMARKS.md, 'Data at scale (token store, issue 19)').

    A worked example (``tests/unit/data/test_batching_example.py`` runs it): five examples of 3, 5, 2, 4 and 1
    tokens, each trained on all but its first token (2, 4, 1, 3 and 0 trained tokens), effective batch 4 over
    2 processes with micro-batch 2 (so accumulation 1), seed 0:

    >>> plan = BatchPlan(effective_batch=4, micro_batch=2, accumulation=1, processes=2)
    >>> lengths, trained = [3, 5, 2, 4, 1], [2, 4, 1, 3, 0]
    >>> [WindowSampler(lengths, trained, plan, p, seed=0).window(0) for p in (0, 1)]
    [([[0, 4]], 9), ([[1, 3]], 9)]

    5 // 4 = 1 step per epoch. Step 0 is in epoch 0, whose permutation (seeded with seed + epoch) is
    [4, 0, 1, 3, 2]: the window is its first 4 examples, [4, 0, 1, 3], and example 2 sits this epoch out (a
    partial window would change the effective batch of its step). Process 0 takes the first half, [4, 0],
    process 1 the second, [1, 3]; each sorts its share longest first ([0, 4]: 3 and 1 tokens; [1, 3]: 5 and 4)
    and cuts it into micro-batches of 2. Both report the trained tokens of the whole window, 2 + 0 + 4 + 3 = 9:
    every micro-batch's summed loss, on every process, is divided by that one count. Step 1 is in epoch 1,
    permutation [0, 4, 2, 3, 1]: window [0, 4, 2, 3], 2 + 0 + 1 + 3 = 6 trained tokens, and process 1's
    share [2, 3] becomes [3, 2]:

    >>> [WindowSampler(lengths, trained, plan, p, seed=0).window(1) for p in (0, 1)]
    [([[0, 4]], 6), ([[3, 2]], 6)]

    With micro-batch 1 (accumulation 2) each process runs the same examples as two micro-batches:

    >>> plan = BatchPlan(effective_batch=4, micro_batch=1, accumulation=2, processes=2)
    >>> [WindowSampler(lengths, trained, plan, p, seed=0).window(0) for p in (0, 1)]
    [([[0], [4]], 9), ([[1], [3]], 9)]

    What ``collate`` makes of process 1's micro-batch [1, 3] at step 0: its docstring."""

    def __init__(self, lengths, trainable, plan: BatchPlan, process_index: int, seed: int):
        self.lengths = np.asarray(lengths, dtype=np.int64)
        self.trainable = np.asarray(trainable, dtype=np.int64)
        self.plan = plan
        self.process_index = process_index
        self.seed = seed
        # A partial last window would change the effective batch of that step; it is left out (and reported).
        self.steps_per_epoch = len(self.lengths) // plan.effective_batch
        if self.steps_per_epoch == 0:
            raise ConfigError(f"Only {len(self.lengths)} examples are left after filtering, fewer than one effective "
                              f"batch (train.effective_batch={plan.effective_batch}); lower it or add data.")
        self._epoch = -1
        self._perm = np.zeros(0, dtype=np.int64)

    @classmethod
    def of(cls, examples, plan: BatchPlan, process_index: int, seed: int) -> "WindowSampler":
        """The sampler over tokenized examples: a token store's (``anyfit.data.store.Examples``: lengths and
        trained-token counts read from its arrays) or a list of ``{"input_ids", "labels"}``."""
        return cls(example_lengths(examples), trained_tokens(examples), plan, process_index, seed)

    def _permutation(self, epoch: int) -> np.ndarray:
        if epoch != self._epoch:
            g = torch.Generator().manual_seed(self.seed + epoch)
            self._perm = torch.randperm(len(self.lengths), generator=g).numpy()
            self._epoch = epoch
        return self._perm

    def examples_of(self, step: int) -> np.ndarray:
        """The examples of step ``step``'s whole window, all processes' (in the epoch's permutation order)."""
        epoch, k = divmod(step, self.steps_per_epoch)
        e = self.plan.effective_batch
        return self._permutation(epoch)[k * e:(k + 1) * e]

    def window(self, step: int) -> tuple[list[list[int]], int]:
        """(micro-batches of example indices for this process, trainable tokens in the whole global window)."""
        window = self.examples_of(step).tolist()
        per_process = self.plan.effective_batch // self.plan.processes
        mine = window[self.process_index * per_process:(self.process_index + 1) * per_process]
        # Grouping similar lengths into the same micro-batch cuts padding; it cannot change the update
        # because the loss is normalised over the whole window, not per micro-batch.
        mine = sorted(mine, key=lambda i: -self.lengths[i])
        m = self.plan.micro_batch
        micro_batches = [mine[i:i + m] for i in range(0, len(mine), m)]
        return micro_batches, int(self.trainable[window].sum())


def collate(examples: list[dict], pad_id: int, packed: bool = False, images=None,
            positions: bool = True) -> dict[str, torch.Tensor]:
    """Tensors for one micro-batch; every example's labels are shifted here to next-token targets.

    - padded (``packed=False``): rows right-padded to the longest example, with an ``attention_mask``;
    - packed: all examples concatenated into one row without padding; ``position_ids`` restart at 0 for
      each example, which is how transformers' attention (SDPA/eager block mask, FlashAttention varlen,
      FlexAttention) keeps every token from attending across an example boundary.

    Shifting per example (the last token of each example predicts nothing) means no position learns to
    predict the first token of the next packed example. ``keep`` selects the positions whose next token is
    trained (a boolean mask for padded rows, positions for a packed row: transformers' ``logits_to_keep``)
    and ``keep_targets`` holds those tokens, so the output layer runs only where there is a loss. No
    ``labels`` tensor is returned: ``keep`` and ``keep_targets`` are the labels, in the form the loss takes them.

    A worked example: process 1's micro-batch at step 0 of ``WindowSampler``'s example, examples 1 and 3 (token
    ids chosen to be readable), each with its first token as the prompt (label -100, ``IGNORE_INDEX``):

    >>> ex1 = {"input_ids": [11, 12, 13, 14, 15], "labels": [-100, 12, 13, 14, 15]}
    >>> ex3 = {"input_ids": [31, 32, 33, 34], "labels": [-100, 32, 33, 34]}
    >>> padded = collate([ex1, ex3], pad_id=0)
    >>> padded["input_ids"].tolist(), padded["attention_mask"].tolist()
    ([[11, 12, 13, 14, 15], [31, 32, 33, 34, 0]], [[1, 1, 1, 1, 1], [1, 1, 1, 1, 0]])
    >>> padded["keep"].tolist()
    [[True, True, True, True, False], [True, True, True, False, False]]
    >>> padded["keep_targets"].tolist()
    [12, 13, 14, 15, 32, 33, 34]

    Token 11 at position 0 is trained to predict 12 (the labels shifted by one); the last token of each example
    (15, 34) and the padding predict nothing. Packed, the same two examples are one row of 9 tokens, the
    positions restarting at example 3:

    >>> packed = collate([ex1, ex3], pad_id=0, packed=True)
    >>> packed["input_ids"].tolist(), packed["position_ids"].tolist()
    ([[11, 12, 13, 14, 15, 31, 32, 33, 34]], [[0, 1, 2, 3, 4, 0, 1, 2, 3]])
    >>> packed["packed_lengths"], packed["cu_seq_lens"].tolist()
    ((5, 4), [0, 5, 9])
    >>> packed["keep"].tolist(), packed["keep_targets"].tolist()
    ([0, 1, 2, 3, 5, 6, 7], [12, 13, 14, 15, 32, 33, 34])

    Position 4 (token 15, the end of example 1) is not kept: it does not learn to predict 31, the first token
    of example 3. The trained targets are the same 7 tokens either way, in the same order.

    Examples of ``data.mix`` carry their ``source`` and how many ``sources`` there are; with more than one, the
    batch also names each kept position's source (``keep_source``, in ``keep_targets``' order) and ``sources``:
    the loss is then summed per source (``training.loss``). Say example 1 is of source 0 and example 3 of source 1:

    >>> mixed = [{**ex1, "source": 0, "sources": 2}, {**ex3, "source": 1, "sources": 2}]
    >>> collate(mixed, pad_id=0)["keep_source"].tolist()
    [0, 0, 0, 0, 1, 1, 1]

    Image examples (a ``vision`` entry: ``anyfit.data.image_tokens``) need ``images``
    (``anyfit.data.image_batches.ImageBatches``), which adds their processed images under ``image_inputs``. A packed
    row without ``positions`` leaves the positions to the model (Qwen's M-RoPE computes its 3-D positions from the
    images; the packing self-test decides which layout gives what one example at a time gives).
    """
    vision = any("vision" in ex for ex in examples)
    if vision and images is None:
        raise ValueError("image examples are collated with the model's processor (images=...)")
    targets = [ex["labels"][1:] + [IGNORE_INDEX] for ex in examples]
    sources = examples[0].get("sources", 1)
    if packed:
        ids = [t for ex in examples for t in ex["input_ids"]]
        flat = [t for row in targets for t in row]
        keep = [i for i, t in enumerate(flat) if t != IGNORE_INDEX]
        lengths = [len(ex["input_ids"]) for ex in examples]
        batch = {"input_ids": torch.tensor([ids]),
                 **({"position_ids": torch.tensor([[p for n in lengths for p in range(n)]])} if positions else {}),
                 # example boundaries for attention.packed_attention: host ints and their cumulative sums
                 "packed_lengths": tuple(lengths),
                 "cu_seq_lens": torch.tensor([0, *itertools.accumulate(lengths)], dtype=torch.int32),
                 "keep": torch.tensor(keep, dtype=torch.long),
                 "keep_targets": torch.tensor([flat[i] for i in keep], dtype=torch.long)}
        if vision:
            batch["image_inputs"] = images.packed(examples)
        return _with_sources(batch, examples, targets, sources) if sources > 1 else batch
    batch = _padded(examples, targets, pad_id, images)
    return _with_sources(batch, examples, targets, sources) if sources > 1 else batch


def _padded(examples: list[dict], targets: list[list[int]], pad_id: int, images) -> dict[str, torch.Tensor]:
    """``collate``'s padded rows (and their images' inputs)."""
    longest = max(len(ex["input_ids"]) for ex in examples)
    n = len(examples)
    input_ids = torch.full((n, longest), pad_id, dtype=torch.long)
    shifted = torch.full((n, longest), IGNORE_INDEX, dtype=torch.long)
    attention = torch.zeros((n, longest), dtype=torch.long)
    for row, (ex, tg) in enumerate(zip(examples, targets)):
        ids = ex["input_ids"]
        input_ids[row, :len(ids)] = torch.tensor(ids)
        shifted[row, :len(ids)] = torch.tensor(tg)
        attention[row, :len(ids)] = 1
    keep = shifted != IGNORE_INDEX
    batch = {"input_ids": input_ids, "attention_mask": attention, "keep": keep, "keep_targets": shifted[keep]}
    if images is not None and any("vision" in ex for ex in examples):
        batch["image_inputs"] = images(examples, longest)
    return batch


def _with_sources(batch: dict, examples: list[dict], targets: list[list[int]], sources: int) -> dict:
    """``batch`` with each kept position's source: padded or packed, the kept positions run example by example."""
    per_example = [len(row) - row.count(IGNORE_INDEX) for row in targets]  # list.count: C speed at 32k tokens
    keep_source = torch.repeat_interleave(torch.tensor([ex["source"] for ex in examples], dtype=torch.long),
                                          torch.tensor(per_example))
    return {**batch, "keep_source": keep_source, "sources": sources}


def to_device(batch: dict, device, non_blocking: bool = False) -> dict:
    """Move a collated batch's tensors to ``device`` (``packed_lengths`` stays host integers; ``image_inputs`` is
    moved tensor by tensor)."""
    return {k: v.to(device, non_blocking=non_blocking) if isinstance(v, torch.Tensor) else
            to_device(v, device, non_blocking) if isinstance(v, dict) else v for k, v in batch.items()}


class WindowBatches(torch.utils.data.Dataset):
    """Step number -> (example indices per micro-batch, window trainable tokens, collated micro-batches).

    Served by a ``DataLoader`` so that collating (and pinning, on CUDA) the next steps overlaps with
    the current one when ``runtime.num_workers`` > 0; the windows themselves still come from the
    deterministic ``WindowSampler``, so the order does not depend on the number of workers.
    """

    def __init__(self, sampler: WindowSampler, examples: list[dict], collate_fn):
        self.sampler, self.examples, self.collate_fn = sampler, examples, collate_fn

    def __getitem__(self, step: int):
        indices, window_tokens = self.sampler.window(step)
        return indices, window_tokens, [self.collate_fn([self.examples[i] for i in idx]) for idx in indices]


def window_loader(batches: WindowBatches, start: int, stop: int, workers: int, pin_memory: bool):
    """Windows ``start``..``stop - 1`` in order, prepared ``workers`` processes ahead (0: in this process)."""
    return torch.utils.data.DataLoader(batches, batch_size=None, sampler=range(start, stop), num_workers=workers,
                                       pin_memory=pin_memory, prefetch_factor=2 if workers else None,
                                       # its own generator: a DataLoader iterator otherwise draws a seed from the
                                       # global RNG, which would shift dropout after a resume (not bit-exact)
                                       generator=torch.Generator().manual_seed(0))


class StepStream:
    """``get(step)``: that step's (example indices per micro-batch, window trainable tokens, collated
    micro-batches), read in step order from a ``window_loader``; ``replan`` changes the micro-batch split
    (after an out-of-memory error) and drops what the workers had prepared with the old one."""

    def __init__(self, batches: WindowBatches, stop: int, workers: int, pin_memory: bool):
        self.batches, self.stop, self.workers, self.pin_memory = batches, stop, workers, pin_memory
        self._iter = None
        self._next: int | None = None

    def get(self, step: int):
        if step != self._next:  # the first call, a replan, or a jump: start reading at this step
            self._iter = iter(window_loader(self.batches, step, self.stop, self.workers, self.pin_memory))
        self._next = step + 1
        return next(self._iter)

    @property
    def plan(self) -> BatchPlan:
        return self.batches.sampler.plan

    def replan(self, plan: BatchPlan) -> None:
        self.batches.sampler.plan = plan
        self._next = None

"""The packing self-test: before the first step, packed rows against one example at a time, on the real model.

``anyfit.model.packing`` names what is known to carry information across an example boundary (layers with a
state); the self-test catches the rest, e.g. an attention pattern or keyword ``anyfit_varlen`` does not reproduce,
or the architecture released next month. ``choose_packing``:
1. a few probe examples (the data's longest, and one longer than the smallest sliding window or chunk) run packed,
   and one at a time through transformers' own attention, in the training dtype and autocast; if the outputs differ
   beyond what the dtype's round-off explains, the model is handed to transformers' own attention (its block mask per
   row: exact, a dense mask per row, slower) and tested again, then to padded batches;
2. a model with state layers (Gated DeltaNet, Mamba-2, short convolutions) is tested with its state layers run one
   example per row (``anyfit.model.state_layers.PER_EXAMPLE``), then with transformers' boundary keywords for the
   kernels that take them (``KERNELS``: kept where it is as exact as per example, e.g. flash-linear-attention on
   CUDA); such a model is always tested, and trains on padded batches where neither way passes.
Each outcome is one line, recorded in ``run_info.json``; ``train.packing_check=false`` skips step 1 for models
without state layers. It costs one forward of a few hundred tokens and one per probe example (two more for state
layers). No peer checks this at start-up.
"""

from __future__ import annotations

import contextlib
from dataclasses import asdict, dataclass

import numpy as np
import torch
from torch import nn

from anyfit.data.batching import to_device
from anyfit.model.attention import NotExactPacked, kernels_used
from anyfit.model.composite import language_attention
from anyfit.model.loading import model_dtype
from anyfit.model.packing import smallest_window, stateful_layers
from anyfit.model.state_layers import KERNELS, PER_EXAMPLE, SEQ_IDX, BoundaryError, Boundaries
from anyfit.training.loss import model_inputs

# Relative tolerance on the outputs of one example, packed against alone: a few hundred units of the compute
# dtype's round-off (the same matmuls over different row counts round differently, and that grows through the
# layers); a leaked window or state moves them by percents.
TOLERANCE = {torch.float32: 2e-4, torch.float16: 2e-2, torch.bfloat16: 6e-2}
PROBE_EXAMPLES = 3
KEPT_POSITIONS = 256
# Tokens of the probe row where no window asks for more: a few examples and boundaries, a second or two on a CPU.
PROBE_TOKENS = 256


@dataclass
class PackingVerdict:
    """What the run does with ``train.packing`` and why (recorded in run_info.json as ``packing``)."""

    packed: bool  # rows packed (False: padded batches)
    attention: str  # the attention implementation the run uses
    line: str  # the one line printed
    error: float | None = None  # the self-test's relative difference (packed against alone), if run
    tolerance: float | None = None
    positions: bool = True  # packed rows carry position ids (False: the model computes them, e.g. Qwen's M-RoPE)
    state: str = ""  # how state layers see the boundaries (state_layers' KERNELS, SEQ_IDX, PER_EXAMPLE; '' if none)

    def as_dict(self) -> dict:
        return asdict(self)


def probe_examples(examples, window: int | None, max_length: int) -> list[dict]:
    """Probe examples that fit one row of ``PROBE_TOKENS`` (or just past the window), at most ``max_length`` as a
    training micro-batch does: where a window binds within ``max_length``, first one example longer than it (the
    data's tokens, every position trained); then the longest of the data's first examples that still fit; last the
    shortest (cut to the room left where it does not fit), so there is always a boundary to look across."""
    lengths = np.asarray(examples.lengths[:1000])
    max_length = min(max_length, max(PROBE_TOKENS, (window or 0) + max(16, (window or 0) // 4) + int(lengths.min())))
    order = [int(i) for i in np.argsort(-lengths, kind="stable")]
    probes: list[dict] = []
    text = [i for i in order[:PROBE_EXAMPLES * 4] if "vision" not in examples[i]]  # image tokens need their images
    if window is not None and window + 2 <= max_length and text:
        ids: list[int] = []
        while len(ids) < window + 2:
            ids += [t for i in text[:PROBE_EXAMPLES] for t in examples[i]["input_ids"]]
        ids = ids[:min(max_length - int(lengths.min()), window + max(16, window // 4))]
        if len(ids) > window:
            probes.append({"input_ids": ids, "labels": list(ids)})
    room = max_length - sum(len(p["input_ids"]) for p in probes)
    shortest = order[-1]  # kept for last, so a boundary always follows the others
    room -= int(lengths[shortest])
    for i in order[:-1]:
        if len(probes) >= PROBE_EXAMPLES:
            break
        if lengths[i] <= room:
            probes.append(examples[i])
            room -= int(lengths[i])
    last = examples[shortest]
    if room < 0 and "vision" not in last:  # even the shortest does not fit: its first tokens still make a boundary
        keep = max(8, int(lengths[shortest]) + room)
        last = {"input_ids": list(last["input_ids"])[:keep], "labels": list(last["labels"])[:keep]}
    probes.append(last)
    return probes


def transformers_model(model: nn.Module) -> nn.Module:
    """The transformers model inside DDP's or DeepSpeed's ``.module`` and PEFT's wrapper (where
    ``set_attn_implementation`` lives; DeepSpeed's engine forwards attribute reads, but has a ``config`` of its own)."""
    from transformers import PreTrainedModel

    while not isinstance(model, PreTrainedModel) and isinstance(getattr(model, "module", None), nn.Module):
        model = model.module
    return model.get_base_model() if hasattr(model, "get_base_model") else model


def reshard(model: nn.Module) -> None:
    """FSDP2 keeps the root's gathered parameters registered after a forward without a backward (the root does not
    reshard after forward): register the shards again, which the optimizer and a resumed checkpoint address."""
    from torch.distributed.fsdp import FSDPModule

    for module in model.modules():
        if isinstance(module, FSDPModule):
            module.reshard()


def _own_attention(model: nn.Module) -> str:
    """transformers' own attention for this model: SDPA where the model supports it, else eager."""
    return "sdpa" if getattr(transformers_model(model), "_supports_sdpa", False) else "eager"


def _positions(length: int) -> list[int]:
    """Up to ``KEPT_POSITIONS`` positions of an example, evenly spread, first and last included: the logits of every
    position of a long probe would be tokens x vocabulary (10 GB in bf16 at 32k tokens of a 152k vocabulary)."""
    if length <= KEPT_POSITIONS:
        return list(range(length))
    return sorted({round(i * (length - 1) / (KEPT_POSITIONS - 1)) for i in range(KEPT_POSITIONS)})


def _logits(model: nn.Module, batch: dict, keep: list[int], device) -> torch.Tensor:
    inputs = to_device(model_inputs(batch, model_dtype(model)), device)
    kept = torch.tensor(keep, dtype=torch.long, device=device)
    return model(**inputs, logits_to_keep=kept, use_cache=False).logits[0].float()


def relative_error(model: nn.Module, probes: list[dict], rows, device, autocast,
                   positions: bool = True, alone: dict | None = None) -> tuple[float, list[str]]:
    """max |packed - alone| / max |alone| over the logits of the probe examples (at ``_positions`` of each), and the
    kernels ``anyfit_varlen`` ran them on; alone runs through transformers' own attention, packed through the
    model's current one (``rows``: ``batching.collate`` with the run's pad id and image processor bound;
    ``positions``: as ``collate`` takes it; ``alone``: a dict that keeps the alone logits for the next call)."""
    inner = transformers_model(model)
    current = inner.config._attn_implementation
    starts = np.cumsum([0] + [len(p["input_ids"]) for p in probes])
    kept = [_positions(len(p["input_ids"])) for p in probes]
    was_training = model.training
    model.eval()
    try:
        with torch.no_grad(), autocast(), kernels_used() as kernels:
            together = _logits(model, rows(probes, packed=True, positions=positions),
                               [int(start) + i for start, keep in zip(starts, kept) for i in keep], device)
            alone = {} if alone is None else alone
            if "logits" not in alone:
                inner.set_attn_implementation(language_attention(inner.config, _own_attention(model)))
                alone["logits"] = torch.cat([_logits(model, rows([p]), keep, device) for p, keep in zip(probes, kept)])
    finally:
        inner.set_attn_implementation(language_attention(inner.config, current))
        model.train(was_training)
        reshard(model)
    alone = alone["logits"]
    return float((together - alone).abs().max() / alone.abs().max().clamp(min=1e-6)), sorted(kernels)


def agreed_max(values: list[float]) -> list[float]:
    """Each value's largest over the processes (every process must decide the same)."""
    if torch.distributed.is_available() and torch.distributed.is_initialized():
        t = torch.tensor(values, dtype=torch.float64)
        backend = torch.distributed.get_backend()
        if backend == "nccl":
            t = t.cuda()
        torch.distributed.all_reduce(t, op=torch.distributed.ReduceOp.MAX)
        return t.tolist()
    return list(values)


def choose_packing(model: nn.Module, examples, rows, max_length: int, device, compute_dtype: torch.dtype,
                   autocast=contextlib.nullcontext, check: bool = True) -> PackingVerdict:
    """Whether and how the run packs its rows: the rule in this module's docstring. ``rows``: ``batching.collate``
    with the run's pad id (and, for image data, the batch workers' ``ImageBatches``) bound. Collective under several
    processes (every process runs the same probes and takes the largest error). Data with images is probed with its
    image examples, each layout also without position ids (the model's own, e.g. Qwen's M-RoPE from the images), and
    never packed untested; nor is a model with state layers (their hooks stay on the model where it packs)."""
    # Eagerly, under torch.compile's wrapper: through it, the no-grad probes and transformers' own attention would each
    # compile the whole model before the first step (three compilations instead of one; on an H100 the 0.5B model's
    # run had not reached step 1 after a minute). Both compute the same function: the verdict is about attention.
    if isinstance(getattr(model, "_orig_mod", None), nn.Module):
        model = model._orig_mod
    inner = transformers_model(model)
    attention = inner.config._attn_implementation
    state = stateful_layers(inner)
    with_images = bool(getattr(getattr(examples, "report", None), "images", 0))
    if not check and not with_images and not state:
        return PackingVerdict(True, attention,
                              f"packing: on ({attention}), not self-tested (train.packing_check=false)")
    tolerance = TOLERANCE.get(compute_dtype, 6e-2)
    probes = probe_examples(examples, smallest_window(inner.config), max_length)
    tokens = sum(len(p["input_ids"]) for p in probes)
    alone: dict = {}  # the probes' logits one at a time, computed once

    def attempt(positions: bool, refused=(NotExactPacked, BoundaryError)) -> tuple[float, list[str], str]:
        try:
            error, kernels = relative_error(model, probes, rows, device, autocast, positions, alone)
        except refused as why:
            error, kernels = float("inf"), []
            reason = (f"cannot split {why} per example" if isinstance(why, NotExactPacked)
                      else f"fails ({str(why).splitlines()[0] if str(why) else type(why).__name__})")
        else:
            reason = f"differs from one example at a time by {error:.1e} (tolerance {tolerance:.0e})"
        return agreed_max([error])[0], kernels, reason

    tried: list[str] = []
    layouts = [(a, p) for a in dict.fromkeys([attention, _own_attention(model)]) for p in (True, False)
               if p or with_images]
    hooks = Boundaries(inner, PER_EXAMPLE) if state else None
    found = _first_exact(inner, attempt, layouts, tolerance, tried)
    if found:
        candidate, positions, error, kernels = found
        how, note = "", ""
        if hooks is not None:
            how, error = _state_way(inner, hooks, attempt, positions, error, tolerance)
            note = (f"; {state.removeprefix('its ')} take the boundaries in their kernels"
                    f"{' (with seq_idx)' if how == SEQ_IDX else ''}" if how in (KERNELS, SEQ_IDX) else
                    f"; {state.removeprefix('its ')} run one example per row ({len(hooks.layers)} layers)")
        note += (f"; {', '.join(tried)}, so transformers' own {candidate} with a block mask per row (exact, "
                 "slower)") if tried and candidate != attention else f"; {', '.join(tried)}" if tried else \
            f"; per example: {', '.join(kernels)}" if kernels else ""
        return PackingVerdict(True, candidate, f"packing: self-test passed on {len(probes)} probe examples "
                              f"({tokens} tokens{', with images' if with_images else ''}"
                              f"{'' if positions else ', positions from the model'}; error {error:.1e}, "
                              f"tolerance {tolerance:.0e}){note}", error, tolerance, positions, how)
    if hooks is not None:
        hooks.remove()
        tried.append(f"with {state.removeprefix('its ')} run one example per row")
    # Padded rows gain nothing from anyfit_varlen, and its dispatch refuses a layer kind it cannot split even where
    # nothing is packed (Llama-4's chunked layers under generate's cache at transformers 5.18): transformers' own.
    own = _own_attention(model)
    inner.set_attn_implementation(language_attention(inner.config, own))
    return PackingVerdict(False, own, f"packing: off, padded batches through transformers' own {own} "
                          f"({'; '.join(tried)})", None if not found else error, tolerance)


def _first_exact(inner: nn.Module, attempt, layouts, tolerance: float, tried: list[str]):
    """The first (attention, positions) of ``layouts`` whose packed rows pass, with its error and kernels (None: none
    does; ``tried`` collects why each failed)."""
    for candidate, positions in layouts:
        inner.set_attn_implementation(language_attention(inner.config, candidate))
        error, kernels, reason = attempt(positions)
        if error <= tolerance:
            return candidate, positions, error, kernels
        tried.append(f"{candidate}{'' if positions else ' (positions from the model)'} {reason}")
    return None


def _state_way(inner: nn.Module, per_example: Boundaries, attempt, positions: bool, error: float,
               tolerance: float) -> tuple[str, float]:
    """A kernels' way (``KERNELS``, then ``SEQ_IDX``) where transformers' own state layers keep the examples apart as
    exactly as running them per example (which they then need not pad), else ``PER_EXAMPLE``; with the way's error.
    The per-example error is this model's round-off: a leak moves the outputs far beyond it, yet on a model with small
    weights (a fresh initialisation) can stay under the dtype's tolerance, so the kernels must stay within 4x of it
    (plus 1% of the tolerance)."""
    per_example.remove()
    for way in (KERNELS, SEQ_IDX):
        kernels = Boundaries(inner, way)
        kernel_error, _, _ = attempt(positions, refused=Exception)  # transformers refuses on CPU (no kernel), or fails
        if kernel_error <= min(tolerance, 4 * error + tolerance / 100):
            return way, kernel_error
        kernels.remove()
    Boundaries(inner, PER_EXAMPLE)  # the same hooks again, now for training (they live on the model's modules)
    return PER_EXAMPLE, error

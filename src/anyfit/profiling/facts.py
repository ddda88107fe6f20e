"""What the advice rules need besides the trace: the profiled windows cut other ways (``Layout``), the largest
micro-batch that fits (measured peak scaled, and the planner's estimate), and whether the planner says the run
fits without checkpointing or offload. Everything is counted on this run's own windows and model."""

from __future__ import annotations

import dataclasses

import numpy as np

from anyfit.config import Config
from anyfit.data.batching import micro_batch_candidates
from anyfit.hardware.memory import budget_bytes
from anyfit.hardware.runtime import Hardware, RuntimePolicy
from anyfit.model.shape import ModelShape
from anyfit.planning.memory import MemoryEstimate, estimate_memory, logits_bytes
from anyfit.planning.presets import cuda_peak
from anyfit.planning.setup import BYTES, Setup, setup_for
from anyfit.profiling.advice import Facts, Layout
from anyfit.profiling.memory import MeasuredMemory


def window_examples(sampler, steps: range) -> list[np.ndarray]:
    """This process's example lengths of each step's window, longest first (as the sampler groups them)."""
    return [sampler.lengths[_flat(sampler, step)] for step in steps]


def window_trained(sampler, steps: range) -> list[np.ndarray]:
    """The trained tokens of the same examples, in the same order."""
    return [sampler.trainable[_flat(sampler, step)] for step in steps]


def _flat(sampler, step: int) -> list[int]:
    indices, _ = sampler.window(step)
    return [i for micro in indices for i in micro]  # already longest first within the window


def micro_trained(trained: list[np.ndarray], micro: int) -> list[float]:
    """Trained tokens of each micro-batch, in loop order (the output head runs on these only)."""
    return [float(t[i:i + micro].sum()) for t in trained for i in range(0, len(t), micro)]


def layout(windows: list[np.ndarray], packed: bool, micro: int) -> Layout:
    """The windows cut into micro-batches of ``micro`` (padded to each one's longest, or packed), per step."""
    calls = positions = real = 0.0
    for lengths in windows:
        for i in range(0, len(lengths), micro):
            chunk = lengths[i:i + micro]
            calls += 1
            positions += chunk.sum() if packed else len(chunk) * chunk.max()
            real += chunk.sum()
    n = max(1, len(windows))
    return Layout(calls / n, positions / n, real / n)


def micro_positions(windows: list[np.ndarray], packed: bool, micro: int) -> list[float]:
    """Token positions of each micro-batch, in the order the loop runs them (for the cost fit)."""
    return [float(c.sum() if packed else len(c) * c.max()) for lengths in windows
            for c in (lengths[i:i + micro] for i in range(0, len(lengths), micro))]


def run_setup(cfg: Config, policy: RuntimePolicy, micro: int, processes: int, sharded: bool, seq_len: int) -> Setup:
    """The planner's ``Setup`` of this run, at the longest sequence of the profiled windows."""
    method = "qlora" if cfg.lora.qlora else "lora" if cfg.lora.enabled else "full"
    setup = setup_for(cfg, method=method, device=policy.device, precision=policy.precision, micro_batch=micro,
                      processes=processes, overrides={"runtime.sharding": "fsdp" if sharded else "none"})
    return dataclasses.replace(setup, seq_len=seq_len)


def _largest_fitting(shape: ModelShape, setup: Setup, measured: MeasuredMemory, windows, packed: bool,
                     budget: int) -> int | None:
    """The largest micro-batch candidate above the current one that fits by both the measurement (the measured
    peak, with the kept activations and logits scaled by the largest micro-batch's positions) and the planner."""
    now = max(micro_positions(windows, packed, setup.micro_batch) or [1.0])
    kept = measured.activations + measured.logits
    best = None
    for m in micro_batch_candidates(setup.micro_batch * setup.accumulation):
        if m <= setup.micro_batch:
            continue
        scaled = measured.peak + kept * (max(micro_positions(windows, packed, m)) / now - 1)
        planned = estimate_memory(shape, dataclasses.replace(setup, micro_batch=m, accumulation=1)).peak
        if scaled <= budget and planned <= budget:
            best = m
    return best


def gather_facts(cfg: Config, policy: RuntimePolicy, plan, shape: ModelShape, windows: list[np.ndarray],
                 measured: MeasuredMemory, sharded: bool) -> tuple[Facts, MemoryEstimate]:
    """The ``Facts`` of this run, and the planner's memory estimate of its setup as configured."""
    longest = int(max((w.max() for w in windows), default=cfg.data.max_length))
    setup = run_setup(cfg, policy, plan.micro_batch, plan.processes, sharded, longest)
    budget = budget_bytes(policy.device, cfg.runtime.memory_fraction)
    planned = estimate_memory(shape, setup)
    micros = {plan.micro_batch}
    proposed = _largest_fitting(shape, setup, measured, windows, cfg.train.packing, budget)
    if proposed:
        micros.add(proposed)
    layouts = {(packed, m): layout(windows, packed, m) for packed in (False, True) for m in micros}
    no_ckpt = dataclasses.replace(setup, gradient_checkpointing=False)
    extra = estimate_memory(shape, no_ckpt).activations - planned.activations
    hw = Hardware.detect() if policy.device == "cuda" else Hardware(cuda=False)
    peaks = cuda_peak(hw.cuda_name)[0] if hw.cuda else {}
    a = BYTES[policy.precision]
    trained = max(micro_positions(windows, True, plan.micro_batch) or [0.0])
    facts = Facts(
        device=policy.device, precision=policy.precision, processes=plan.processes, packing=cfg.train.packing,
        num_workers=policy.num_workers, micro_batch=plan.micro_batch, per_process=plan.per_process,
        accumulation=plan.accumulation, gradient_checkpointing=cfg.model.gradient_checkpointing,
        checkpoint_share=setup.checkpointed_layers(shape.num_layers) / max(1, shape.num_layers),
        offload=sharded and cfg.runtime.fsdp_offload, compile=cfg.runtime.compile, native_bf16=hw.native_bf16,
        bf16_speedup=peaks.get("bf16", 0) / peaks["fp32"] if peaks.get("fp32") else 1.0,
        loss_chunk_tokens=cfg.train.loss_chunk_tokens, layouts=layouts, proposed_micro=proposed,
        fits_without_checkpointing=(estimate_memory(shape, no_ckpt).peak <= budget
                                    and measured.peak + max(0, extra) <= budget),
        fits_without_offload=sharded and estimate_memory(
            shape, dataclasses.replace(setup, offload=False)).peak <= budget,
        logits_chunked_bytes=logits_bytes(shape, int(trained), a, 1024))
    return facts, planned

"""The plan in words and as data: ``anyfit plan``'s table, per-target notes and memory breakdown, and
``--json``."""

from __future__ import annotations

import dataclasses
from typing import Any

from anyfit.config import Config, ConfigError
from anyfit.model.shape import ModelShape, model_shape
from anyfit.planning.ladder import TargetPlan, plan_target
from anyfit.planning.presets import DEFAULT_MFU, MATMUL_SHARE, PRESETS, PRICE_NOTE, Target, default_targets
from anyfit.planning.savers import config_overrides, describe, short_words
from anyfit.planning.setup import OPTIMIZER_NAMES, SAFETY, Workload
from anyfit.planning.time import duration_text
from anyfit.units import GIB


def _resolve_targets(targets) -> list[Target]:
    if targets is None:
        return default_targets()
    out = []
    for t in targets:
        if isinstance(t, Target):
            out.append(t)
        elif t in PRESETS:
            out.append(PRESETS[t])
        else:
            raise ConfigError(f"Unknown target {t!r}; presets: {', '.join(PRESETS)}.")
    return out


def plan(cfg: Config, targets=None, workload: Workload | None = None, shape: ModelShape | None = None,
         safety: float = SAFETY, micro_batch: int | None = None) -> tuple[ModelShape, list[TargetPlan]]:
    """Plan the configured run on each target (default: this machine and every preset) for ``workload`` (default:
    the config's); ``micro_batch``: fixed."""
    shape = shape or model_shape(cfg.model)
    return shape, [plan_target(cfg, shape, t, workload, safety, micro_batch=micro_batch)
                   for t in _resolve_targets(targets)]


def plan_dict(cfg: Config, targets=None, workload: Workload | None = None, shape: ModelShape | None = None,
              safety: float = SAFETY, micro_batch: int | None = None) -> dict[str, Any]:
    """The plan as plain data (``anyfit plan --json``). Memory is per device (per rank); host RAM per machine."""
    workload = workload or Workload.of(cfg)
    shape, plans = plan(cfg, targets, workload, shape, safety, micro_batch)
    return {
        "model": {**{k: v for k, v in dataclasses.asdict(shape).items() if k != "projections"},
                  "active_params": shape.active_params,
                  "lora_params": shape.lora_params(cfg.lora.r, cfg.lora.target_modules, cfg.lora.experts),
                  "lora_params_in_experts": (shape.lora_params(cfg.lora.r, cfg.lora.target_modules, cfg.lora.experts)
                                             - shape.lora_params(cfg.lora.r, cfg.lora.target_modules, False)),
                  "lora_targets": shape.lora_targets(cfg.lora.target_modules, cfg.lora.experts)},
        "effective_batch": cfg.train.effective_batch, "seq_len": cfg.data.max_length,
        "tokens_per_sequence_for_time": workload.tokens_per_sequence,
        "trained_share_for_time": workload.trained_share, "safety": safety, "examples": workload.examples, "price_note": PRICE_NOTE,
        "targets": [p.as_dict() for p in plans],
    }


def _gib(b: int) -> str:
    return f"{b / GIB:.1f}"


def _money(value: float | None) -> str:
    if value is None:
        return "-"
    return f"${value:.2f}" if value < 100 else f"${value:,.0f}"


def plan_report(cfg: Config, targets=None, workload: Workload | None = None, shape: ModelShape | None = None,
                safety: float = SAFETY, micro_batch: int | None = None) -> str:
    """The printable plan: one row per target, each target's per-device breakdown, then the first target's
    memory in detail.

    Kept whole: the report is read in the order it prints (table, notes per target, the first
    target's breakdown); every number in it comes from ``plan``.
    """
    workload = workload or Workload.of(cfg)
    shape, plans = plan(cfg, targets, workload, shape, safety, micro_batch)
    examples = workload.examples
    lora_n = shape.lora_params(cfg.lora.r, cfg.lora.target_modules, cfg.lora.experts)
    in_experts = lora_n - shape.lora_params(cfg.lora.r, cfg.lora.target_modules, False)
    lines = [f"model {cfg.model.name_or_path or '(given shape)'}",
             f"  {shape.describe()}",
             f"  LoRA r={cfg.lora.r} on {', '.join(shape.lora_targets(cfg.lora.target_modules, cfg.lora.experts))}: "
             f"{lora_n / 1e6:,.2f}M adapter parameters"
             + (f" ({in_experts / 1e6:,.2f}M in the routed experts)" if shape.num_experts else ""),
             f"run: effective batch {cfg.train.effective_batch}, sequences up to {cfg.data.max_length} tokens "
             f"(memory uses the longest; time uses {workload.tokens_per_sequence:g} tokens per sequence, "
             f"{workload.trained_share:.0%} of them trained), "
             f"budget {safety:.0%} of each device's memory"
             + (f", {examples:,} examples per epoch" if examples is not None else ""), ""]
    header = ["target", "mem/dev", "precision", "micro x accum x procs", "method", "savers", "peak GiB/dev",
              "host GiB", "per 100 steps", "$/100 steps", "$/epoch", "verdict"]
    rows = []
    for p in plans:
        s, m = p.setup, p.memory
        rows.append([p.target.label(), f"{p.target.memory_gib:.0f} GiB",
                     s.precision if s else "-",
                     f"{s.micro_batch} x {s.accumulation} x {s.processes}" if s else "-",
                     {"full": "full", "lora": "LoRA", "qlora": "QLoRA"}[s.method] if s else "-",
                     short_words(s) if s else "-",
                     f"{_gib(m.peak)} / {p.budget_bytes / GIB:.0f}" if m else "-",
                     (_gib(m.host) + (f" / {p.host_budget_bytes / GIB:.0f}" if p.host_budget_bytes else ""))
                     if m and m.host else "-",
                     duration_text(p.seconds_per_100_steps), _money(p.cost_per_100_steps), _money(p.cost_per_epoch),
                     p.verdict])
    widths = [max(len(str(r[i])) for r in [header, *rows]) for i in range(len(header))]
    fmt = " | ".join(f"{{:{w}}}" for w in widths)
    lines += [fmt.format(*header), "-+-".join("-" * w for w in widths), *(fmt.format(*r) for r in rows)]
    lines.append("savers: FSDP/N = sharded over N GPUs, offload/N = FSDP with CPU offload, 8-bit = 8-bit AdamW "
                 "states, ckpt/k = gradient checkpointing every k-th layer (ckpt: every layer), act-offload = "
                 "activations in host RAM; host GiB = host RAM the machine needs (each process loads the model "
                 "there; offloaded state)")
    if examples is None:
        lines.append("$/epoch needs the data size: pass --examples N or set data.num_samples (only per 100 steps here)")
    lines.append(PRICE_NOTE)

    lines.append("")
    for p in plans:
        extra = [*p.notes, *p.alternatives]
        if p.target.note:
            extra.insert(0, p.target.note)
        m, s = p.memory, p.setup
        if m is not None:
            parts = " + ".join(f"{name} {value / GIB:.1f}" for name, value in (
                ("weights", m.weights), ("grads", m.gradients), (OPTIMIZER_NAMES[s.optimizer], m.optimizer),
                ("activations", m.activations), ("logits", m.logits), ("transient", m.transient),
                ("overhead", m.overhead)) if value)
            time = p.time
            extra.insert(0, f"per {'GPU' if p.target.device == 'cuda' else 'device'}: {parts} = {m.peak / GIB:.1f} GiB"
                            f" ({m.phase})" + (f"; host RAM {m.host / GIB:.1f} GiB" if m.host else "")
                            + (f"; step {time.compute:.2f} s compute + {time.optimizer:.2f} s optimizer + "
                               f"{time.communication:.2f} s communication" if time and time.communication else ""))
        if extra:
            lines.append(f"{p.target.label()}: " + "; ".join(extra))
    first = next((p for p in plans if p.memory), None)
    if first:
        m, s = first.memory, first.setup
        lines += ["", f"memory at the peak on {first.target.label()}, per device ({describe(s)}; peak during the "
                      f"{m.phase}):"]
        parts = [("weights", m.weights), ("gradients", m.gradients), (f"optimizer ({OPTIMIZER_NAMES[s.optimizer]})",
                 m.optimizer), ("activations", m.activations), ("logits + loss", m.logits),
                 ("transient copies", m.transient), ("runtime overhead", m.overhead)]
        for name, value in parts:
            lines.append(f"  {name:<22} {value / GIB:8.2f} GiB")
        lines.append(f"  {'total':<22} {m.peak / GIB:8.2f} GiB   (budget {first.budget_bytes / GIB:.1f} GiB)")
        if m.host:
            lines.append(f"  {'host RAM (machine)':<22} {m.host / GIB:8.2f} GiB"
                         + (f"   (budget {first.host_budget_bytes / GIB:.1f} GiB)" if first.host_budget_bytes else ""))
        lines.append(f"  eval generation KV cache (batch {s.micro_batch} x {s.seq_len} tokens): "
                     f"{m.eval_kv_cache / GIB:.2f} GiB, on top of the weights when evaluating")
        for note in m.notes:
            lines.append(f"  - {note}")
        lines.append("  config: " + " ".join(config_overrides(s)))
    shares = ", ".join(f"{k} {v:.0%}" for k, v in MATMUL_SHARE.items())
    lines.append("Estimates: see anyfit.planning's docstrings; held against CPU runs and published GPU runs in "
                 "benchmarks/PLAN_VS_MEASURED.md. Time on CUDA = matmul FLOPs / (peak x matmul share: "
                 f"{shares}) + the bytes the other operations stream / memory bandwidth; on this CPU or Mac the same "
                 "at its measured matmul rate and bandwidth + its measured cost per eager operation (`anyfit env`); "
                 "on other Macs and CPUs = FLOPs / (peak x MFU: "
                 + ", ".join(f"{d} {v:.0%}" for d, v in DEFAULT_MFU.items() if d != "cuda")
                 + "); + the optimizer update + communication compute cannot hide.")
    return "\n".join(lines)

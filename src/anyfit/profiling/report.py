"""The profile in words: the step's wall time by phase, the top operators, padding and truncation, memory by
kind beside the planner's estimate, MFU, and the advice with its reasons and expected effects."""

from __future__ import annotations

from typing import Any

PHASE_NAMES = {"data_wait": "waiting for data", "h2d": "host-to-device copies", "forward": "forward",
               "backward": "backward", "optimizer": "optimizer (clip, step, zero)", "other": "outside the phases"}
KINDS = ("weights", "gradients", "optimizer", "activations", "logits")


def _ms(seconds: float | None) -> str:
    return "-" if seconds is None else f"{seconds * 1e3:9.1f} ms"


def _breakdown(p: dict[str, Any]) -> list[str]:
    wall = p["step_s"] or 1e-9
    lines = [f"  step wall time {_ms(p['step_s'])} (mean of {len(p['steps'])} profiled steps; the slowest of "
             f"{len(p.get('step_s_per_process') or [1])} process(es): {p.get('step_s_per_process') or ''})"]
    for key, name in PHASE_NAMES.items():
        seconds = p["phases_s"][key]
        lines.append(f"    {name:30s} {_ms(seconds)}  {seconds / wall:6.1%}")
    lines.append(f"    {'of which communication':30s} {_ms(p['communication_s'])}  {p['communication_s'] / wall:6.1%}"
                 "  (all-reduce / reduce-scatter / all-gather; may overlap backward)")
    if p.get("exchange_s"):
        lines.append(f"    {'  of which sequence all-to-all':30s} {_ms(p['exchange_s'])}  {p['exchange_s'] / wall:6.1%}"
                     "  (sequence parallelism: q, k, v and the attention output between processes)")
    lines.append(f"    {'of which host syncs':30s} {_ms(p['host_sync_s'])}  {p['host_sync_s'] / wall:6.1%}"
                 f"  ({p['host_syncs']} per step)")
    lines.append(f"    {'of which logits and loss':30s} {_ms(p['loss_s'])}  {p['loss_s'] / wall:6.1%}")
    if p["device_idle_s"] is not None:
        lines.append(f"    {'GPU idle gaps':30s} {_ms(p['device_idle_s'])}  {p['device_idle_s'] / wall:6.1%}")
    return lines


def _size(gib: float) -> str:
    return f"{gib:8.2f} GiB" if gib >= 1 else f"{gib * 1024:8.1f} MiB"


def _memory(p: dict[str, Any]) -> list[str]:
    measured, planned = p["memory_measured_gib"], p["memory_planned_gib"]
    lines = ["  memory per process             measured      planned (anyfit plan)"]
    for kind in KINDS:
        lines.append(f"    {kind:26s} {_size(measured[kind])} {_size(planned[kind + '_gib'])}")
    lines.append(f"    {'peak':26s} {_size(measured['peak'])} {_size(planned['peak_gib'])}   budget {p['budget_gib']} GiB"
                 + ("  (CPU: the process's peak resident set)" if p["device"] == "cpu" else ""))
    return lines


def report_text(p: dict[str, Any]) -> str:
    """The printed profile of one process (the slowest), from its ``profile.json`` record."""
    mfu = f"{p['mfu']:.2%}" if p.get("mfu") is not None else "-"
    peak = p.get("peak") or {}
    lines = [f"[anyfit] profile ({p['device']}, {p['precision']}): {p['tokens_per_s']:.0f} tokens/s, MFU {mfu} "
             f"of {peak.get('peak_tflops_per_device', '-')} TFLOP/s per device ({peak.get('source', '')})"]
    lines += _breakdown(p)
    lines.append("  top operators (self time per step)" + (" - GPU kernels" if p["device"] == "cuda" else ""))
    for op in p["top_operators"]:
        lines.append(f"    {op['name'][:60]:60s} {op['ms_per_step']:9.2f} ms  {op['share']:6.1%}  "
                     f"x{op['calls_per_step']:.0f}")
    truncated = p["truncated_examples"] / max(1, p["kept_examples"])
    cut = p.get("truncated_tokens", 0)
    lost = cut / max(1, cut + p.get("data_tokens", 0))
    lines.append(f"  tokens: {p['padding_share']:.1%} of the positions computed are padding; {truncated:.1%} of the "
                 f"examples were cut to data.max_length={p['max_length']}, {cut:,} tokens ({lost:.1%} of the data) "
                 "cut away")
    lines += _memory(p)
    if p["advice"]:
        lines.append("  advice (each measured in this run):")
        for a in p["advice"]:
            lines.append(f"    - {a['setting']}: {a['reason']}.\n      expected: {a['effect']}.")
        if p.get("combined_factor"):
            lines.append(f"    together (the layout and data advice): about x{p['combined_factor']:.2f} tokens/s")
    else:
        lines.append("  advice: none; no rule's measured share reached its threshold.")
    lines.append(f"  traces (Perfetto: ui.perfetto.dev; TensorBoard: tensorboard --logdir <folder>): "
                 f"{', '.join(p.get('traces') or [])}")
    return "\n".join(lines)

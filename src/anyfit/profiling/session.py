"""``runtime.profile=N``: N training steps under ``torch.profiler`` after a warm-up, turned into a breakdown,
memory by kind beside the planner's, and advice (printed, and written to ``OUTPUT/profile/``).

The loop wraps its steps in ``profiled(ProfiledRun(...), say)`` (what the profiler reads, handed over
explicitly, by name) and calls ``step()`` after each one; with profiling off that is a no-op. The schedule:
``runtime.profile_warmup`` steps untraced (the first allocates the optimizer state; the last of them is traced but dropped, and its memory is counted by kind, see
``anyfit.profiling.memory``), then N traced steps. At the end of the traced steps every process writes its
own trace (``OUTPUT/profile/rank<R>...pt.trace.json``: Perfetto and TensorBoard's profiler open it), every
process analyses its own, the summaries are gathered, and the main process prints the slowest process's.
"""

from __future__ import annotations

import json
import time
from dataclasses import dataclass
from pathlib import Path

import torch
from torch.profiler import ProfilerActivity, profile, schedule, tensorboard_trace_handler

from anyfit.hardware.memory import budget_bytes, peak_bytes
from anyfit.model.shape import shape_from_config
from anyfit.profiling.advice import Profile, advise, combined_factor, micro_cost
from anyfit.profiling.facts import gather_facts, micro_positions, micro_trained, window_examples, window_trained
from anyfit.profiling.memory import MemoryCensus
from anyfit.profiling.report import report_text
from anyfit.profiling.trace import mean_step, spans_of, step_times, top_operators
from anyfit.units import GIB

PROFILE_DIR = "profile"
SUMMARY = "profile.json"


@dataclass(frozen=True, kw_only=True)
class ProfiledRun:
    """What the profiler reads of a run, handed over by the training loop (by keyword)."""

    cfg: object  # the run's Config
    policy: object  # its RuntimePolicy
    accelerator: object
    model: torch.nn.Module  # as the loop steps it (wrapped, sharded)
    bare: torch.nn.Module  # the same model as loaded, without the wrapper (its config)
    optimizer: object
    sampler: object  # the WindowSampler: which examples each step's windows hold
    report: object  # the data report (tokens kept, cut)
    out: Path
    start: int  # the first step this run takes (after a resume)
    sharded: bool  # each process holds a part of the states (the backend's)
    flops: object = None  # ModelFlops of a window, for MFU
    peak: object = None  # DevicePeak of one device


class _Off:
    """Profiling off: the loop's calls cost nothing."""

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return False

    def step(self) -> None:
        pass


def profiled(run: ProfiledRun, say=print):
    """The profiler of ``run`` when ``runtime.profile`` > 0, else a no-op."""
    return StepProfiler(run, say) if run.cfg.runtime.profile > 0 else _Off()


@dataclass
class _Window:
    first: int  # the first traced step (0-based)
    steps: int


class StepProfiler:
    """torch.profiler over the configured steps of a run, with the memory census on the step before them."""

    def __init__(self, run: ProfiledRun, say=print):
        self.run, self.say = run, say
        cfg = run.cfg.runtime
        warmup = max(1, cfg.profile_warmup)
        self.window = _Window(run.start + warmup, cfg.profile)
        self.calls = 0
        self.clock: list[float] = []  # perf_counter at each step's end: the untraced steps' wall times
        self.warmup = warmup
        self.census: MemoryCensus | None = None
        self.done = False
        self.dir = Path(run.out) / PROFILE_DIR
        for old in self.dir.glob(f"rank{run.accelerator.process_index}.*.pt.trace.json*"):  # a previous profile's
            old.unlink()
        activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if run.policy.device == "cuda" else [])
        self.profiler = profile(activities=activities, profile_memory=True, record_shapes=False,
                                schedule=schedule(wait=warmup - 1, warmup=1, active=cfg.profile, repeat=1),
                                on_trace_ready=self._ready)

    def __enter__(self):
        self.profiler.__enter__()
        self._census_if_due()
        return self

    def __exit__(self, *exc):
        if self.census is not None:
            self.census.close()
        self.profiler.__exit__(*exc)
        if not self.done and exc[0] is None:
            self.say(f"[anyfit] profile: the run ended before its {self.window.steps} profiled steps (they start after "
                     f"{self.warmup} warm-up steps); raise train.max_steps or lower runtime.profile_warmup.")
        return False

    def _census_if_due(self) -> None:
        if self.calls == self.warmup - 1:  # the profiler's own warm-up step: traced, dropped, and measured here
            run = self.run
            self.census = MemoryCensus(run.model, run.optimizer, run.bare.config.get_text_config().vocab_size)
            self.census.watch()
        elif self.calls == self.warmup and self.census is not None:
            self.measured = self.census.close()
            self.measured.peak = peak_bytes(self.run.policy.device)
            self.census = None

    def step(self) -> None:
        self.clock.append(time.perf_counter())
        self.calls += 1
        self._census_if_due()
        self.profiler.step()

    def _ready(self, prof) -> None:
        """At the end of the traced steps, on every process: trace, analysis, the slowest's report (collective)."""
        self.done = True
        acc = self.run.accelerator
        self.dir.mkdir(parents=True, exist_ok=True)
        tensorboard_trace_handler(str(self.dir), worker_name=f"rank{acc.process_index}")(prof)
        summary = self._summary(prof)
        every = [summary]
        if acc.num_processes > 1 and torch.distributed.is_initialized():
            every = [None] * acc.num_processes
            torch.distributed.all_gather_object(every, summary)
        if acc.is_main_process:
            slowest = max(every, key=lambda s: s["step_s"])
            slowest["step_s_per_process"] = [round(s["step_s"], 4) for s in every]
            slowest["traces"] = sorted(str(p) for p in self.dir.glob("*.pt.trace.json*"))
            (self.dir / SUMMARY).write_text(json.dumps(slowest, indent=2, default=str))
            self.say(report_text(slowest))

    def _untraced_step(self) -> float | None:
        """The fastest wall time of the untraced warm-up steps after the first (which allocates the optimizer state):
        the same steps take the same work, and what else runs on the machine only ever adds to it (``micro_fit``)."""
        gaps = [b - a for a, b in zip(self.clock, self.clock[1:])][: max(0, self.warmup - 2)]
        return min(gaps) if gaps else None

    def _summary(self, prof) -> dict:
        """This process's profile as plain data (what is gathered, printed and written to profile.json)."""
        run = self.run
        mean = mean_step(step_times(spans_of(prof.events())))
        sampler = run.sampler
        steps = range(self.window.first, self.window.first + self.window.steps)
        windows = window_examples(sampler, steps)
        shape = shape_from_config(run.bare.config)
        facts, planned = gather_facts(run.cfg, run.policy, sampler.plan, shape, windows, self.measured, run.sharded)
        packing, micro = run.cfg.train.packing, sampler.plan.micro_batch
        p = Profile(step=mean.wall, phases=mean.phases, micro_seconds=mean.micro,
                    micro_positions=micro_positions(windows, packing, micro) if mean.micro else [],
                    micro_trained=micro_trained(window_trained(sampler, steps), micro) if mean.micro else [],
                    communication=mean.communication, device_busy=mean.device_busy, device_matmul=mean.device_matmul,
                    device_communication=mean.device_communication, activations=self.measured.activations,
                    logits=self.measured.logits, untraced_step=self._untraced_step())
        advice = advise(p, facts)
        now = facts.layouts[(packing, micro)]
        flops = sum(run.flops.of_window(sampler.lengths, sampler.trainable, sampler.window(s)[0]) for s in steps)
        seconds = mean.wall * len(steps)
        return {
            "rank": run.accelerator.process_index, "device": run.policy.device, "precision": run.policy.precision,
            "steps": list(steps), "step_s": mean.wall, "untraced_step_s": p.untraced_step, "phases_s": mean.phases,
            "communication_s": mean.communication, "exchange_s": mean.exchange, "host_sync_s": mean.host_sync,
            "host_syncs": mean.host_syncs,
            "device_idle_s": mean.device_idle, "loss_s": mean.loss,
            "top_operators": top_operators(prof.key_averages(), len(steps), mean.wall, run.policy.device == "cuda"),
            # data-parallel groups: under sequence parallelism a group's processes share their examples
            "tokens_per_s": now.real_tokens * sampler.plan.processes / mean.wall if mean.wall else 0.0,
            "mfu": (flops * sampler.plan.processes / run.accelerator.num_processes / seconds / run.peak.flops_per_s
                    if seconds and run.peak else None),
            "peak": run.peak.as_dict() if run.peak else None,
            "padding_share": now.padding, "truncated_examples": run.report.truncated,
            "truncated_tokens": run.report.truncated_tokens, "data_tokens": run.report.total_tokens,
            "kept_examples": run.report.kept, "max_length": run.cfg.data.max_length,
            "memory_measured_gib": self.measured.as_dict(), "memory_planned_gib": planned.as_dict(),
            "budget_gib": round(budget_bytes(run.policy.device, run.cfg.runtime.memory_fraction) / GIB, 3),
            "micro_cost_s": dict(zip(("per_call", "per_position"), micro_cost(p)[:2])),  # the advice's fitted costs
            "advice": [a.__dict__ | {"setting": a.setting} for a in advice],
            "combined_factor": combined_factor(p, facts, advice),
        }

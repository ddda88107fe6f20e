"""From a torch.profiler trace to where a step's wall time went.

The training step marks its phases with ``torch.profiler.record_function`` ranges (``anyfit.data_wait``,
``anyfit.h2d``, ``anyfit.forward``, ``anyfit.backward``, ``anyfit.optimizer``, and ``anyfit.loss`` inside the
forward); torch.profiler's schedule marks each profiled step (``ProfilerStep#N``). This module reads the
profiler's events as plain ``Span`` records (so the arithmetic is tested on hand-made spans) and sums, per step:

- the phases (host wall time of each range; they do not overlap), and what lies outside them (``other``:
  the loop's own bookkeeping, metrics, the scheduler);
- communication: the union of the collectives' intervals (c10d/gloo host ops, NCCL kernels), which may
  overlap the backward pass (DDP reduces buckets while it runs); of which ``exchange``: sequence parallelism's
  all-to-alls (on the attention's critical path: never overlapped);
- host syncs: the host waiting for the device (``aten::_local_scalar_dense`` behind ``.item()``/``bool()``,
  ``cuda*Synchronize``);
- on CUDA, the device's idle gaps (the step's wall time not covered by any kernel) and the kernels' split into
  matmuls, communication and the rest (elementwise, norms, softmax: what ``torch.compile`` fuses);
- the logits and loss: the cross-entropy's forward range and its backward functions;
- each micro-batch's forward+backward seconds, in order (the loop runs them in window order), which the
  advice fits against the micro-batches' token positions.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field

from torch.autograd import DeviceType

PHASES = ("data_wait", "h2d", "forward", "backward", "optimizer")
PREFIX = "anyfit."
STEP = re.compile(r"^ProfilerStep[#*]")
COMMUNICATION = re.compile(r"all_?reduce|reduce_?scatter|all_?gather|allgather|broadcast|^nccl|^gloo|c10d::", re.I)
EXCHANGE = re.compile(r"all_?to_?all|SendRecv", re.I)  # NCCL runs an all-to-all as grouped send/recv kernels
HOST_SYNC = re.compile(r"^(aten::_local_scalar_dense|cuda(Stream|Device|Event)Synchronize)$")
MATMUL_KERNEL = re.compile(r"gemm|matmul|cutlass|xmma|cublas|_mma|wgmma", re.I)
LOSS_BACKWARD = re.compile(r"CrossEntropy.*Backward|NllLossBackward|LogSoftmaxBackward")


@dataclass(frozen=True)
class Span:
    """One profiler event: a host range/operator, or a device kernel (``device``); times in seconds."""

    name: str
    start: float
    end: float
    device: bool = False

    @property
    def seconds(self) -> float:
        return self.end - self.start


def spans_of(events) -> list[Span]:
    """torch.profiler's ``FunctionEvent`` list as spans (host events and CUDA kernels)."""
    out = []
    for e in events:
        device = e.device_type != DeviceType.CPU
        out.append(Span(e.name, e.time_range.start / 1e6, e.time_range.end / 1e6, device))
    return out


def union_seconds(spans: list[Span]) -> float:
    """Length of the union of the spans' intervals (nested or overlapping ranges count once)."""
    total, end = 0.0, float("-inf")
    for s in sorted(spans, key=lambda s: s.start):
        if s.end <= end:
            continue
        total += s.end - max(s.start, end)
        end = s.end
    return total


@dataclass
class StepTimes:
    """Seconds of one profiled step, by what they were spent on."""

    wall: float
    phases: dict[str, float]  # PHASES and "other"
    communication: float = 0.0
    exchange: float = 0.0  # of communication: sequence parallelism's all-to-alls
    host_sync: float = 0.0
    host_syncs: int = 0
    loss: float = 0.0
    device_busy: float | None = None  # CUDA: union of the kernels; None where no device events are recorded
    device_matmul: float = 0.0
    device_communication: float = 0.0
    micro: list[float] = field(default_factory=list)  # forward+backward seconds of each micro-batch

    @property
    def device_idle(self) -> float | None:
        return None if self.device_busy is None else max(0.0, self.wall - self.device_busy)


def _inside(spans: list[Span], start: float, end: float) -> list[Span]:
    return [s for s in spans if s.start >= start and s.end <= end]


def step_times(spans: list[Span]) -> list[StepTimes]:
    """One ``StepTimes`` per ``ProfilerStep#N`` range, in step order."""
    steps = sorted((s for s in spans if STEP.match(s.name) and not s.device), key=lambda s: s.start)
    out = []
    for i, step in enumerate(steps):
        # Kernels of this step may finish after the host range ends: they belong to it until the next step starts.
        device_end = steps[i + 1].start if i + 1 < len(steps) else float("inf")
        host = [s for s in _inside(spans, step.start, step.end) if not s.device]
        kernels = [s for s in spans if s.device and step.start <= s.start < device_end]
        out.append(_one_step(step, host, kernels))
    return out


def _one_step(step: Span, host: list[Span], kernels: list[Span]) -> StepTimes:
    ranges = {p: [s for s in host if s.name == PREFIX + p] for p in PHASES}
    phases = {p: sum(s.seconds for s in ranges[p]) for p in PHASES}
    phases["other"] = max(0.0, step.seconds - sum(phases.values()))
    forwards, backwards = ranges["forward"], ranges["backward"]
    micro = [f.seconds + b.seconds for f, b in zip(forwards, backwards)]
    syncs = [s for s in host if HOST_SYNC.match(s.name)]
    loss = union_seconds([s for s in host if s.name == PREFIX + "loss" or LOSS_BACKWARD.search(s.name)])
    comm_host = [s for s in host if COMMUNICATION.search(s.name)]
    times = StepTimes(step.seconds, phases, host_sync=union_seconds(syncs), host_syncs=len(syncs), loss=loss,
                      micro=micro)
    if kernels:
        comm_kernels = [k for k in kernels if COMMUNICATION.search(k.name)]
        times.device_busy = union_seconds(kernels)
        times.device_matmul = union_seconds([k for k in kernels if MATMUL_KERNEL.search(k.name)])
        times.device_communication = union_seconds(comm_kernels)
        times.communication = union_seconds(comm_kernels) or union_seconds(comm_host)
        exchange = [k for k in comm_kernels if EXCHANGE.search(k.name)] or \
            [s for s in comm_host if EXCHANGE.search(s.name)]
    else:
        times.communication = union_seconds(comm_host)
        exchange = [s for s in comm_host if EXCHANGE.search(s.name)]
    times.exchange = union_seconds(exchange)
    return times


def mean_step(steps: list[StepTimes]) -> StepTimes:
    """The average profiled step (micro-batch times kept per step, concatenated)."""
    n = max(1, len(steps))

    def avg(values):
        values = list(values)
        return sum(values) / n if values else 0.0

    busy = [s.device_busy for s in steps if s.device_busy is not None]
    return StepTimes(
        wall=avg(s.wall for s in steps),
        phases={p: avg(s.phases[p] for s in steps) for p in (*PHASES, "other")},
        communication=avg(s.communication for s in steps), exchange=avg(s.exchange for s in steps),
        host_sync=avg(s.host_sync for s in steps),
        host_syncs=round(avg(s.host_syncs for s in steps)), loss=avg(s.loss for s in steps),
        device_busy=sum(busy) / len(busy) if busy else None,
        device_matmul=avg(s.device_matmul for s in steps),
        device_communication=avg(s.device_communication for s in steps),
        micro=[m for s in steps for m in s.micro])


def top_operators(key_averages, steps: int, wall: float, on_device: bool, limit: int = 10) -> list[dict]:
    """The operators (or, on CUDA, kernels) that took the most self time, per step and as a share of the step."""
    rows = []
    for e in key_averages:
        if e.key.startswith(PREFIX) or STEP.match(e.key):
            continue
        us = e.self_device_time_total if on_device else e.self_cpu_time_total
        if us > 0:
            rows.append({"name": e.key, "ms_per_step": us / 1e3 / max(1, steps),
                         "calls_per_step": e.count / max(1, steps)})
    rows.sort(key=lambda r: -r["ms_per_step"])
    for r in rows:
        r["share"] = r["ms_per_step"] / 1e3 / wall if wall > 0 else 0.0
    return rows[:limit]

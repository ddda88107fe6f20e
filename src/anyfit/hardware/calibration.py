"""This machine's measured rates, for the step-time model on CPU and MPS, where no datasheet describes what an SFT
step reaches: dense matmul throughput at the widths a model's projections have, element-wise memory bandwidth at
the sizes its activations have (a small model's activations stay in the CPU's caches, a large model's stream
from DRAM), and the fixed cost of one eager autograd operation (forward and backward), which dominates tiny models.

Measured once per machine by a bounded micro-benchmark (about three seconds) in the compute dtype, on the threads the
run uses, and kept in anyfit's cache (``machine_rates.json``) under a key naming the processor, the core count, the
thread count, torch's version, the device and the dtype: another machine, another torch or another thread count
measures again. A shared machine measures low while other work holds its cores, so the cache keeps, rate by rate,
the best measurement seen under the key (``anyfit env --recalibrate`` forgets it and measures afresh).
"""

from __future__ import annotations

import itertools
import json
import math
import os
import platform
import time
from dataclasses import asdict, dataclass

import torch

from anyfit.cache import cache_root

RATES_FILE = "machine_rates.json"

# Widths of the matmul grid: projections [tokens, w] @ [w, w] and [tokens, w] @ [w, 3w] (attention's and a gated
# MLP's shapes) on MATMUL_TOKENS tokens; a model between two widths gets the log-linear
# interpolation, one outside the grid the nearest end (a wider model: the rate at 1024, which large CPU matmuls
# exceed by little; wider ones would make the measurement several seconds long).
MATMUL_WIDTHS = (128, 256, 512, 1024)
MATMUL_TOKENS = 1024
# Ranks of the thin matmuls of a LoRA adapter at width 1024: x @ A, (x A) @ B and A's gradient x^T @ g, which run
# far under the rate of square ones (a rank-16 operand keeps the vector units idle); a rank between two ranks gets
# the log-linear interpolation.
LORA_RANKS = (8, 16, 64)
LORA_WIDTH = 1024
# Sizes (bytes of one operand) of the element-wise grid: an add reading two tensors and writing a third.
STREAM_BYTES = (1 << 18, 1 << 20, 1 << 22, 1 << 24, 1 << 26)
OP_CHAIN = 200  # tiny autograd operations timed together for the per-operation cost


@dataclass(frozen=True)
class MachineRates:
    """What the micro-benchmark measured: matmul TFLOP/s by width, element-wise GB/s by operand bytes (read and
    written bytes over the time), seconds per eager autograd operation (its forward plus its backward), and the
    TFLOP/s of a LoRA adapter's thin matmuls by rank."""

    key: str
    matmul_tflops: dict[int, float]
    stream_gbs: dict[int, float]
    op_seconds: float
    adapter_tflops: dict[int, float]
    measured_at: str = ""

    def adapter_at(self, rank: float) -> float:
        return _interpolate(self.adapter_tflops, rank)

    def matmul_at(self, width: float) -> float:
        return _interpolate(self.matmul_tflops, width)

    def bandwidth_at(self, nbytes: float) -> float:
        return _interpolate(self.stream_gbs, nbytes)

    @property
    def dram_gbs(self) -> float:
        """The bandwidth of the largest operand measured: what streams from main memory (the optimizer step)."""
        return self.stream_gbs[max(self.stream_gbs)]

    def as_dict(self) -> dict:
        return asdict(self)

    @staticmethod
    def from_dict(d: dict) -> MachineRates:
        return MachineRates(d["key"], {int(k): float(v) for k, v in d["matmul_tflops"].items()},
                            {int(k): float(v) for k, v in d["stream_gbs"].items()}, float(d["op_seconds"]),
                            {int(k): float(v) for k, v in d["adapter_tflops"].items()}, d.get("measured_at", ""))

    def best_with(self, other: MachineRates) -> MachineRates:
        """Rate by rate, the better of two measurements of the same machine (the lower cost per operation)."""
        return MachineRates(self.key,
                            {w: max(v, other.matmul_tflops.get(w, 0.0)) for w, v in self.matmul_tflops.items()},
                            {b: max(v, other.stream_gbs.get(b, 0.0)) for b, v in self.stream_gbs.items()},
                            min(self.op_seconds, other.op_seconds),
                            {r: max(v, other.adapter_tflops.get(r, 0.0)) for r, v in self.adapter_tflops.items()},
                            self.measured_at)

    def summary(self) -> str:
        mm = ", ".join(f"{w}: {v:.3g}" for w, v in sorted(self.matmul_tflops.items()))
        bw = ", ".join(f"{b / 2**20:g} MiB: {v:.3g}" for b, v in sorted(self.stream_gbs.items()))
        thin = ", ".join(f"{r}: {v:.3g}" for r, v in sorted(self.adapter_tflops.items()))
        return (f"matmul TFLOP/s by width {{{mm}}}; LoRA adapter matmul TFLOP/s by rank {{{thin}}}; element-wise "
                f"GB/s by operand size {{{bw}}}; {self.op_seconds * 1e6:.1f} us per eager autograd operation")


def _interpolate(table: dict[int, float], x: float) -> float:
    """Log-linear in x between the two measured points around it; the nearest end outside them."""
    points = sorted(table.items())
    if x <= points[0][0]:
        return points[0][1]
    for (x0, y0), (x1, y1) in itertools.pairwise(points):
        if x <= x1:
            t = (math.log(x) - math.log(x0)) / (math.log(x1) - math.log(x0))
            return y0 + t * (y1 - y0)
    return points[-1][1]


def processor_name() -> str:
    """The CPU model as the OS names it (``/proc/cpuinfo``'s model name on Linux, sysctl's brand on macOS)."""
    try:
        with open("/proc/cpuinfo", encoding="utf-8") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    if platform.system() == "Darwin":
        import subprocess

        try:
            return subprocess.run(["sysctl", "-n", "machdep.cpu.brand_string"], capture_output=True, text=True,
                                  timeout=2, check=False).stdout.strip() or platform.machine()
        except (OSError, subprocess.SubprocessError):
            pass
    return platform.processor() or platform.machine()


def machine_key(device: str, dtype: str) -> str:
    """What the rates depend on: the device, the dtype, the processor, its cores, the threads and torch."""
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
    return (f"{device}|{dtype}|{processor_name()}|{cores} cores|{torch.get_num_threads()} threads|"
            f"torch {torch.__version__}")


_DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}


def _timed(fn, device: str, budget: float, trials: int = 1) -> float:
    """The fastest single call of ``fn`` among as many as fit in ``budget`` seconds (at least ``trials``, after
    warm-up calls for a quarter of it): on a machine whose cores other work takes now and then, the fastest call is
    the one no other work interrupted, and threads that slept take a while to come back. The device is synchronized
    before the clock is read (MPS runs asynchronously)."""
    sync = torch.mps.synchronize if device == "mps" else (lambda: None)
    best, calls, start = math.inf, 0, time.perf_counter()
    while calls < trials or time.perf_counter() - start < budget:
        t0 = time.perf_counter()
        fn()
        sync()
        if t0 - start >= budget / 4:
            best = min(best, time.perf_counter() - t0)
            calls += 1
    return best


def _benchmarks(device: str, dt: torch.dtype) -> dict[tuple[str, int], tuple[float, object]]:
    """Each measurement as (its work: FLOPs, bytes or operations; the call that does it)."""
    calls: dict[tuple[str, int], tuple[float, object]] = {}
    for w in MATMUL_WIDTHS:
        x = torch.full((MATMUL_TOKENS, w), 0.01, device=device, dtype=dt)
        sq, up = (torch.full(s, 0.01, device=device, dtype=dt) for s in ((w, w), (w, 3 * w)))
        calls["matmul", w] = (2 * MATMUL_TOKENS * w * w * 4, lambda x=x, sq=sq, up=up: (x @ sq, x @ up))
    x = torch.full((MATMUL_TOKENS, LORA_WIDTH), 0.01, device=device, dtype=dt)
    for r in LORA_RANKS:
        a, b, g = (torch.full(s, 0.01, device=device, dtype=dt) for s in ((LORA_WIDTH, r), (r, LORA_WIDTH),
                                                                             (MATMUL_TOKENS, r)))
        calls["adapter", r] = (2 * MATMUL_TOKENS * LORA_WIDTH * r * 3,
                               lambda a=a, b=b, g=g: ((x @ a) @ b, x.t() @ g))
    for nbytes in STREAM_BYTES:
        a, b, out = (torch.full((nbytes * 8 // torch.finfo(dt).bits,), 0.5, device=device, dtype=dt) for _ in range(3))
        calls["stream", nbytes] = (3 * nbytes, lambda a=a, b=b, out=out: torch.add(a, b, out=out))
    leaf = torch.ones(8, device=device, dtype=dt, requires_grad=True)

    def chain():  # OP_CHAIN element-wise autograd operations on a tiny tensor, forward and backward
        y = leaf
        for _ in range(OP_CHAIN // 2):
            y = (y * 1.0001) + 0.0001
        y.sum().backward()

    calls["ops", 0] = (OP_CHAIN, chain)
    return calls


def measure_rates(device: str = "cpu", dtype: str = "fp32", seconds: float = 2.5, passes: int = 3) -> MachineRates:
    """Run the micro-benchmark now (about ``seconds`` in all): ``passes`` rounds over every measurement, keeping
    each one's fastest call, so that a while when other work holds the cores spoils one round of a few, not one
    measurement. Operands are constants: a dense kernel's time does not depend on the values, and random ones would
    advance the RNG a training run is seeded with."""
    calls = _benchmarks(device, _DTYPES[dtype])
    best = dict.fromkeys(calls, math.inf)
    for _ in range(passes):
        for name, (_, fn) in calls.items():
            best[name] = min(best[name], _timed(fn, device, seconds / passes / len(calls)))
    matmul = {w: calls["matmul", w][0] / best["matmul", w] / 1e12 for w in MATMUL_WIDTHS}
    stream = {b: calls["stream", b][0] / best["stream", b] / 1e9 for b in STREAM_BYTES}
    adapter = {r: calls["adapter", r][0] / best["adapter", r] / 1e12 for r in LORA_RANKS}
    return MachineRates(machine_key(device, dtype), matmul, stream, best["ops", 0] / OP_CHAIN, adapter,
                        time.strftime("%Y-%m-%d %H:%M"))


def _load() -> dict[str, dict]:
    try:
        data = json.loads((cache_root() / RATES_FILE).read_text(encoding="utf-8"))
        return data if isinstance(data, dict) else {}
    except (OSError, ValueError):  # none yet, or unreadable: the next measurement starts it
        return {}


def record_rates(rates: MachineRates, keep_best: bool = True) -> MachineRates:
    """Keep ``rates`` in the cache under its key (rate by rate the best with what is there, unless ``keep_best`` is
    off); returns what is kept. Also how a test gives the planner a machine of its choosing."""
    known = _load()
    if keep_best and (earlier := _parse(known.get(rates.key))) is not None:
        rates = rates.best_with(earlier)
    path = cache_root() / RATES_FILE
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_name(f".{path.name}.{os.getpid()}")
        tmp.write_text(json.dumps({**known, rates.key: rates.as_dict()}, indent=1), encoding="utf-8")
        tmp.replace(path)
    except OSError:  # a read-only cache: the measurement still stands for this process
        pass
    return rates


def known_rates(device: str = "cpu", dtype: str = "fp32") -> MachineRates | None:
    """The cached rates of this machine, without measuring; None before the first measurement."""
    return _parse(_load().get(machine_key(device, dtype)))


def _parse(entry) -> MachineRates | None:
    try:
        return MachineRates.from_dict(entry) if entry else None
    except (KeyError, TypeError, ValueError, AttributeError):  # an older or damaged entry: measured again
        return None


def machine_rates(device: str = "cpu", dtype: str = "fp32", refresh: bool = False) -> MachineRates:
    """This machine's rates: the cached ones, or measured now (and cached) when there are none or ``refresh``."""
    if not refresh and (known := known_rates(device, dtype)) is not None:
        return known
    return record_rates(measure_rates(device, dtype), keep_best=not refresh)

"""Machines the planner can plan for: named presets, a custom size, or the machine this runs on.

A ``Target`` is what the memory/time planner needs to know about a machine: the memory one process
can use, how many such devices there are, and the dense matmul throughput in each precision anyfit
would run there. Peak numbers are vendor datasheet figures for dense (non-sparse) tensor-core math;
the planner multiplies them by a model-FLOPs utilisation (``mfu``) to get a realistic speed.
"""

from __future__ import annotations

import os
import time
from dataclasses import dataclass, field, replace

from anyfit.config import ConfigError
from anyfit.hardware.runtime import Hardware

GIB = 2**30

# Utilisation of the datasheet peak that a plain PyTorch SFT step reaches. 35% is typical for CUDA bf16
# with SDPA and no torch.compile; Apple's MPS backend lands lower. The CPU figure is relative to a fp32
# matmul throughput *measured* on the machine (or CPU_TFLOPS_PER_CORE), so it stands for the non-matmul
# work (norms, softmax over the vocabulary, SiLU, dropout, AdamW, fresh pages): 0.26-0.50 in the
# single-thread runs of benchmarks/PLAN_VS_MEASURED.md.
DEFAULT_MFU = {"cuda": 0.35, "mps": 0.25, "cpu": 0.35}

# Sustained fp32 GEMM per CPU core when not measured (AVX2/AVX-512 server cores, shared machines).
# Two cores of the EPYC this was developed on measured 0.04-0.07 TFLOP/s on 1024-2048 matmuls.
CPU_TFLOPS_PER_CORE = 0.03

# What the OS, Python and the frameworks take in the same memory the model uses (Apple unified memory),
# or the per-process CUDA context that torch's allocator does not count.
APPLE_USABLE_SHARE = 0.70


@dataclass(frozen=True)
class Target:
    """One machine (or node) to plan for; memory and throughput are per device."""

    key: str
    name: str
    device: str  # "cuda" | "mps" | "cpu"
    memory_gib: float  # what one process can allocate on one device
    peak_tflops: dict[str, float]  # dense TFLOP/s per device, by anyfit precision (fp32 means TF32 on Ampere+)
    bandwidth_gbs: float  # memory bandwidth per device (the optimizer step is bandwidth-bound)
    num_devices: int = 1
    cuda_capability: tuple[int, int] = (0, 0)
    mfu: float | None = None  # None: DEFAULT_MFU[device]
    note: str = ""
    measured: dict[str, float] = field(default_factory=dict)  # e.g. {"fp32": 0.07} measured on this machine

    @property
    def efficiency(self) -> float:
        return self.mfu if self.mfu is not None else DEFAULT_MFU[self.device]

    def hardware(self) -> Hardware:
        """The ``Hardware`` record the runtime policy would see on this target."""
        if self.device == "cuda":
            return Hardware(cuda=True, cuda_name=self.name, cuda_capability=self.cuda_capability,
                            cuda_count=self.num_devices)
        return Hardware(cuda=False, mps=self.device == "mps")

    def tflops(self, precision: str) -> float:
        """Dense throughput per device for a precision (falls back to fp32 for precisions the device lacks)."""
        table = {**self.peak_tflops, **self.measured}
        return table.get(precision) or table["fp32"]

    def label(self) -> str:
        return f"{self.num_devices}x {self.name}" if self.num_devices > 1 else self.name


def _apple(key: str, gb: int, chip: str, tflops: float, bandwidth: float) -> Target:
    return Target(key, f"Apple {chip} {gb} GB", "mps", gb * APPLE_USABLE_SHARE,
                  {"fp32": tflops, "bf16": tflops, "fp16": tflops}, bandwidth,
                  note=f"unified memory: ~{APPLE_USABLE_SHARE:.0%} of {gb} GB usable by the GPU (Metal working-set "
                       f"limit); GPU fp32 ~{tflops:g} TFLOP/s")


_H100 = {"bf16": 989.0, "fp16": 989.0, "fp32": 495.0}

PRESETS: dict[str, Target] = {t.key: t for t in [
    _apple("m-16", 16, "M-series (M2/M3/M4 base)", 4.0, 100.0),
    _apple("m-36", 36, "M-series (M3 Pro/Max, M4 Pro)", 10.0, 300.0),
    _apple("m-128", 128, "M-series (M3/M4 Max)", 16.0, 546.0),
    Target("t4", "NVIDIA T4 16 GB", "cuda", 14.7, {"fp16": 65.0, "fp32": 8.1}, 320.0, cuda_capability=(7, 5),
           note="Turing: fp16 tensor cores with loss scaling, no native bf16, no TF32"),
    Target("a100-40", "NVIDIA A100 40 GB", "cuda", 39.4, {"bf16": 312.0, "fp16": 312.0, "fp32": 156.0}, 1555.0,
           cuda_capability=(8, 0)),
    Target("a100-80", "NVIDIA A100 80 GB", "cuda", 79.1, {"bf16": 312.0, "fp16": 312.0, "fp32": 156.0}, 2039.0,
           cuda_capability=(8, 0)),
    Target("h100", "NVIDIA H100 80 GB", "cuda", 79.1, _H100, 3350.0, cuda_capability=(9, 0),
           note="SXM datasheet 989 TFLOP/s bf16 dense; a dense bf16 matmul measured 789 on the H100 this project used"),
    Target("8xh100", "NVIDIA H100 80 GB", "cuda", 79.1, _H100, 3350.0, num_devices=8, cuda_capability=(9, 0),
           note="one node, NVLink; data parallel (DDP) or FSDP full-shard over the 8 GPUs"),
]}

# Known CUDA GPUs by a substring of torch.cuda.get_device_name(): dense bf16/fp16 and fp32 (TF32) TFLOP/s.
_CUDA_PEAKS: list[tuple[str, dict[str, float]]] = [
    ("H200", _H100), ("H100 PCIe", {"bf16": 756.0, "fp16": 756.0, "fp32": 378.0}), ("H100", _H100),
    ("A100", {"bf16": 312.0, "fp16": 312.0, "fp32": 156.0}), ("L40S", {"bf16": 362.0, "fp16": 362.0, "fp32": 183.0}),
    ("L4", {"bf16": 121.0, "fp16": 121.0, "fp32": 60.0}), ("A10", {"bf16": 125.0, "fp16": 125.0, "fp32": 62.5}),
    ("4090", {"bf16": 165.0, "fp16": 165.0, "fp32": 82.6}), ("3090", {"bf16": 71.0, "fp16": 71.0, "fp32": 35.6}),
    ("V100", {"fp16": 125.0, "fp32": 15.7}), ("T4", {"fp16": 65.0, "fp32": 8.1}),
]
_GENERIC_CUDA = {"bf16": 312.0, "fp16": 312.0, "fp32": 156.0}  # assumed A100-class when the GPU is unknown


def cuda_peak(name: str) -> tuple[dict[str, float], str]:
    for key, peak in _CUDA_PEAKS:
        if key.lower() in name.lower():
            return peak, ""
    return _GENERIC_CUDA, f"unknown GPU '{name}': A100-class throughput assumed for the time estimate"


def measure_cpu_tflops(seconds: float = 0.3, n: int = 1024) -> float:
    """fp32 matmul throughput of this process's CPU threads (a short timing, not a benchmark)."""
    import torch

    a, b = torch.randn(n, n), torch.randn(n, n)
    a @ b  # warm up the BLAS threads
    calls, start = 0, time.perf_counter()
    while (elapsed := time.perf_counter() - start) < seconds:
        a @ b
        calls += 1
    return 2 * n**3 * calls / elapsed / 1e12


def _apple_chip_tflops() -> float:
    """Rough Apple GPU fp32 throughput from the chip name (Max/Ultra have 2-4x the GPU cores of the base chip)."""
    import subprocess

    try:
        brand = subprocess.run(["sysctl", "-n", "machdep.cpu.brand_string"], capture_output=True, text=True,
                               timeout=2).stdout
    except (OSError, subprocess.SubprocessError):
        brand = ""
    for word, tflops in (("Ultra", 27.0), ("Max", 16.0), ("Pro", 8.0)):
        if word in brand:
            return tflops
    return 4.0


def this_machine(measure_cpu: bool = False) -> Target:
    """The machine this runs on: the device the runtime policy would pick, with its memory.

    CPU: the memory now *available* (other processes count), throughput measured when ``measure_cpu``.
    """
    from anyfit.hardware.memory import free_bytes, total_bytes

    hw = Hardware.detect()
    if hw.cuda:
        total = total_bytes("cuda:0") / GIB
        peak, note = cuda_peak(hw.cuda_name)
        return Target("local", hw.cuda_name, "cuda", round(total, 1), peak, 2000.0, num_devices=hw.cuda_count,
                      cuda_capability=hw.cuda_capability, note=("this machine; " + note).rstrip("; "))
    if hw.mps:
        tflops = _apple_chip_tflops()
        return Target("local", "this Mac (MPS)", "mps", total_bytes("mps") / GIB,
                      {"fp32": tflops, "bf16": tflops, "fp16": tflops}, 200.0,
                      note="this machine; Metal's recommended working set")
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
    measured = {"fp32": measure_cpu_tflops()} if measure_cpu else {}
    available = free_bytes("cpu") / GIB
    return Target("local", f"this CPU ({cores} cores)", "cpu", round(available, 1),
                  {"fp32": CPU_TFLOPS_PER_CORE * cores}, 20.0, measured=measured,
                  note="this machine: available RAM; " + ("matmul throughput measured" if measured else
                                                          f"~{CPU_TFLOPS_PER_CORE} TFLOP/s per core assumed"))


def custom_target(device: str, memory_gb: float, gpus: int = 1) -> Target:
    """A machine given only by its device kind and memory (``anyfit plan --device cuda --memory-gb 24``)."""
    if device == "cuda":
        return Target("custom", f"CUDA GPU {memory_gb:g} GB", "cuda", memory_gb * 1e9 / GIB, _GENERIC_CUDA, 1500.0,
                      num_devices=gpus, cuda_capability=(8, 0),
                      note="custom size; A100-class throughput and native bf16 assumed")
    if device == "mps":
        return replace(_apple("custom", int(memory_gb), "M-series", 8.0, 200.0), name=f"Apple Mac {memory_gb:g} GB")
    if device == "cpu":
        cores = os.cpu_count() or 1
        return Target("custom", f"CPU {memory_gb:g} GB", "cpu", memory_gb * 1e9 / GIB,
                      {"fp32": CPU_TFLOPS_PER_CORE * cores}, 20.0, note=f"custom size; {cores} cores assumed")
    raise ConfigError(f"--device {device!r}: use a preset ({', '.join(PRESETS)}), 'local', "
                      "or cuda/mps/cpu with --memory-gb.")


def targets_from_args(device: str | None = None, memory_gb: float | None = None, gpus: int | None = None,
                      measure_cpu: bool = True) -> list[Target] | None:
    """The targets named by ``anyfit plan``'s --device/--memory-gb/--gpus; None means the default table.

    --device is a preset key (t4, a100-40, a100-80, h100, 8xh100, m-16, m-36, m-128), 'local' (this
    machine), or a device kind (cuda, mps, cpu) that needs --memory-gb. --memory-gb and --gpus override
    the memory per device and the device count of whatever was picked.
    """
    if device is None and memory_gb is None and gpus is None:
        return None
    if device is None or device in ("local", "this", "auto"):
        target = this_machine(measure_cpu=measure_cpu)
    elif device in PRESETS:
        target = PRESETS[device]
    elif device in ("cuda", "mps", "cpu"):
        if memory_gb is None:
            raise ConfigError(f"--device {device} needs --memory-gb (or pick a preset: {', '.join(PRESETS)}).")
        target = custom_target(device, memory_gb, gpus or 1)
    else:
        import difflib

        close = difflib.get_close_matches(device, list(PRESETS), n=1)
        hint = f" Did you mean '{close[0]}'?" if close else ""
        raise ConfigError(f"--device {device!r} is not a preset.{hint} Presets: {', '.join(PRESETS)}; "
                          "or 'local', or cuda/mps/cpu with --memory-gb.")
    if memory_gb is not None and target.key != "custom":
        usable = memory_gb * (APPLE_USABLE_SHARE if target.device == "mps" else 1.0)
        target = replace(target, memory_gib=usable * 1e9 / GIB, name=f"{target.name} (as {memory_gb:g} GB)")
    if gpus is not None:
        if gpus < 1:
            raise ConfigError(f"--gpus must be at least 1, got {gpus}.")
        if gpus > 1 and target.device != "cuda":
            raise ConfigError(f"--gpus {gpus}: multi-device plans are for CUDA GPUs, not {target.device}.")
        target = replace(target, num_devices=gpus)
    return [target]


def default_targets(measure_cpu: bool = True) -> list[Target]:
    """This machine first, then every preset."""
    return [this_machine(measure_cpu=measure_cpu), *PRESETS.values()]

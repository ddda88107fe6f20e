"""Machines the planner can plan for: named presets, a custom size, or the machine this runs on.

A ``Target`` is what the memory/time planner needs to know about a machine: the memory one process
can use, how many such devices there are, the dense matmul throughput in each precision anyfit would run
there, how fast the devices talk to each other and to the host (the communication term of multi-GPU
plans and of CPU offload), the host RAM, and an hourly price. Peak numbers are vendor datasheet figures
for dense (non-sparse) tensor-core math; the planner scales them by the share its matmuls reach on CUDA
(``MATMUL_SHARE``) or by a model-FLOPs utilisation elsewhere (``mfu``) to get a realistic speed.

Sources (looked up 2026-11):
- H100 SXM: 989 TFLOP/s bf16 dense, 3.35 TB/s HBM3 (NVIDIA H100 datasheet); NVLink 4.0 900 GB/s
  bidirectional, A100 SXM NVLink 3.0 600 GB/s (https://www.aiminingco.com/glossary/nvlink,
  https://cyfuture.ai/blog/h100-vs-a100-vs-l40s-gpu-rental-guide).
- A100 SXM4: 312 TFLOP/s bf16, 1,555 GB/s (40 GB) / 2,039 GB/s (80 GB) (NVIDIA A100 datasheet).
- L40S: 362.05 TFLOP/s bf16/fp16 and 183 TF32 dense (733 / 366 with sparsity), 48 GB GDDR6 with ECC,
  864 GB/s, "PCIe Gen4 x16: 64 GB/s bidirectional", no NVLink (NVIDIA's L40S datasheet table as quoted at
  https://www.mullet.se/product.html?product_id=355414 and https://www.itcreations.com/nvidia-gpu/nvidia-l40s-gpu-accelerator).
- RTX 4090: 165.15 TFLOP/s fp16/bf16 tensor (330.3 with sparsity; NVIDIA's 330 dense figure is with fp16
  accumulate, which PyTorch does not use), 82.58 TF32, 24 GB GDDR6X at 1,008 GB/s
  (https://waredb.com/processor/nvidia-geforce-rtx-4090, after NVIDIA's Ada architecture whitepaper).
- M2 Ultra: up to 76 GPU cores, "up to 27.2 teraflops", up to 192 GB unified memory at 800 GB/s (Apple's
  Mac Pro page, June 2023, https://www.apple.com/mac-pro; M3 Ultra: 819 GB/s, up to 512 GB).
- Interconnect seen by NCCL's ring collectives, per direction per GPU: NVLink 450 GB/s (H100 SXM) and
  300 GB/s (A100 SXM) are the halves of the bidirectional figures, an upper bound that large messages
  approach; PCIe 4.0 x16 is 32 GB/s raw per direction (the L40S datasheet's 64 GB/s bidirectional), ~25 GB/s
  effective after protocol overhead (used for L40S, RTX 4090 and unknown PCIe GPUs); PCIe 5.0 x16 ~50 GB/s
  effective; PCIe 3.0 x16 (T4) ~12 GB/s.
"""

from __future__ import annotations

import json
import os
import platform
import time
from dataclasses import dataclass, field, replace

from anyfit.cache import cache_root
from anyfit.config import ConfigError
from anyfit.hardware.calibration import MachineRates, known_rates, machine_rates
from anyfit.hardware.memory import free_bytes, total_bytes
from anyfit.hardware.runtime import Hardware
from anyfit.units import GIB


# Utilisation of the datasheet peak that a plain PyTorch SFT step reaches, where the time model has one term
# (CUDA has two, with MATMUL_SHARE below; its entry here is for a target given an explicit ``mfu``). Apple's MPS
# backend lands lower than CUDA. CPU and MPS use it only before this machine's rates are measured (the time
# model then has measured terms: ``anyfit.planning.time.measured_compute_seconds``); the CPU figure is relative to
# CPU_TFLOPS_PER_CORE and stands for the non-matmul work (benchmarks/PLAN_VS_MEASURED.md, 'Summary').
DEFAULT_MFU = {"cuda": 0.35, "mps": 0.25, "cpu": 0.35}

# CUDA: the share of the datasheet dense peak an SFT step's matmuls reach, by architecture; the operations between
# the matmuls are counted apart, as the bytes they stream (anyfit.planning.time.streamed_bytes_per_token), so the
# share does not change with the model's width. Each value is the median, over the published runs of that class,
# of what their step time leaves for the matmuls once those bytes, the optimizer and the exposed communication are
# taken out (`uv run python benchmarks/published_speed.py`; benchmarks/PLAN_VS_MEASURED.md, 'Against published
# throughput'): 15 A100 runs (torchtune, llm-foundry) for Ampere, and for the classes no compared run covers (Ada,
# Turing: an assumption); 7 H100 runs (torchtitan, llm-foundry) for Hopper, whose share sits far under the 80% a
# lone large bf16 matmul reached on this project's H100. Two constants for 22 runs, none per run.
MATMUL_SHARE = {"ampere": 0.86, "hopper": 0.53}

# Sustained fp32 GEMM per CPU core when not measured (AVX2/AVX-512 server cores, shared machines; BENCHMARKS.md,
# 'Measurements that were quoted in code comments (moved 2026-11-26)').
CPU_TFLOPS_PER_CORE = 0.03

# What the OS, Python and the frameworks take in the same memory the model uses (Apple unified memory),
# or the per-process CUDA context that torch's allocator does not count.
APPLE_USABLE_SHARE = 0.70

# Effective per-direction bandwidths in GB/s (see the module docstring for the sources).
NVLINK_H100_GBS = 450.0
NVLINK_A100_GBS = 300.0
PCIE4_GBS = 25.0
PCIE5_GBS = 50.0
PCIE3_GBS = 12.0

# Hourly prices are APPROXIMATE on-demand list prices in USD for the whole machine (all its GPUs), typical of
# specialist GPU clouds (Lambda, RunPod, CoreWeave and the like) as of 2026-11; hyperscalers (AWS, GCP, Azure)
# list 1.5-2x more, spot/community offers less. Ranges seen: H100 SXM $2.50-3.50 and A100 80 GB $1.10-1.50 per
# GPU-hour at specialist clouds (https://www.mercatus-ai.com/blog/cloud-gpu-pricing, May 2026); L40S $0.86
# (RunPod) to $1.86 (AWS g6e.xlarge) (https://modal.com/blog/nvidia-l40s-price-article, Aug 2025); RTX 4090
# $0.34 spot / $0.60 on-demand (https://deploybase.ai/articles/runpod-gpu-pricing, Mar 2026). Check your
# provider, or pass `anyfit plan --price-per-hour`.
PRICE_DATE = "2026-11"
PRICE_NOTE = (f"prices: approximate on-demand USD/hour for the whole machine, typical of specialist GPU clouds in "
              f"{PRICE_DATE} (hyperscalers list 1.5-2x more); override with --price-per-hour")


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
    interconnect_gbs: float = 0.0  # device-to-device GB/s per direction per device (NVLink, PCIe); 0: one device
    host_link_gbs: float = PCIE4_GBS  # device <-> host GB/s per direction (what CPU offload streams over)
    host_memory_gib: float | None = None  # host RAM of the machine (all processes share it); None: unknown
    price_per_hour: float | None = None  # USD per hour for the whole target (all devices); None: no price
    rates: MachineRates | None = None  # this machine's measured rates (CPU, MPS): the time model's measured branch

    @property
    def efficiency(self) -> float:
        return self.mfu if self.mfu is not None else DEFAULT_MFU[self.device]

    @property
    def matmul_share(self) -> float | None:
        """CUDA without a given ``mfu``: the share of the peak its matmuls reach (``MATMUL_SHARE``); None elsewhere
        (the time model then uses ``efficiency`` as an MFU)."""
        if self.device != "cuda" or self.mfu is not None:
            return None
        return MATMUL_SHARE["hopper" if self.cuda_capability >= (9, 0) else "ampere"]

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
    # Unified memory: the host RAM *is* the device memory (no separate host budget, nothing to offload to).
    return Target(key, f"Apple {chip} {gb} GB", "mps", gb * APPLE_USABLE_SHARE,
                  {"fp32": tflops, "bf16": tflops, "fp16": tflops}, bandwidth,
                  note=f"unified memory: ~{APPLE_USABLE_SHARE:.0%} of {gb} GB usable by the GPU (Metal working-set "
                       f"limit); GPU fp32 ~{tflops:g} TFLOP/s")


_H100 = {"bf16": 989.0, "fp16": 989.0, "fp32": 495.0}
_A100 = {"bf16": 312.0, "fp16": 312.0, "fp32": 156.0}
_L40S = {"bf16": 362.0, "fp16": 362.0, "fp32": 183.0}
_RTX4090 = {"bf16": 165.2, "fp16": 165.2, "fp32": 82.6}

# Host RAM of the preset machines: a typical cloud instance with that GPU (GCP a2-highgpu-1g 85 GB and
# a2-ultragpu-1g 170 GB for one A100, n1-standard-8 30 GB with a T4, AWS g6e.2xlarge 64 GiB with one L40S and
# g6e.48xlarge 1,536 GiB with eight, AWS p5.48xlarge 2 TiB with eight H100, ~225 GiB on one-H100 instances), and
# 64 GiB for a desktop with an RTX 4090; the values below are in GiB). It bounds CPU offload and the model
# loading of every process.
PRESETS: dict[str, Target] = {t.key: t for t in [
    _apple("m-16", 16, "M-series (M2/M3/M4 base)", 4.0, 100.0),
    _apple("m-36", 36, "M-series (M3 Pro/Max, M4 Pro)", 10.0, 300.0),
    _apple("m-128", 128, "M-series (M3/M4 Max)", 16.0, 546.0),
    replace(_apple("m-ultra-192", 192, "M2/M3 Ultra", 27.2, 800.0), name="Apple Mac Studio M2/M3 Ultra 192 GB"),
    Target("t4", "NVIDIA T4 16 GB", "cuda", 14.7, {"fp16": 65.0, "fp32": 8.1}, 320.0, cuda_capability=(7, 5),
           note="Turing: fp16 tensor cores with loss scaling, no native bf16, no TF32",
           interconnect_gbs=PCIE3_GBS, host_link_gbs=PCIE3_GBS, host_memory_gib=28.0, price_per_hour=0.35),
    Target("rtx4090", "NVIDIA RTX 4090 24 GB", "cuda", 23.6, _RTX4090, 1008.0, cuda_capability=(8, 9),
           note="Ada consumer card: 165 TFLOP/s bf16/fp16 with fp32 accumulate (the 330 figure is fp16 accumulate); "
                "PCIe only (GeForce cards do not do peer-to-peer, so multi-GPU collectives are likely slower than "
                "the 25 GB/s assumed)",
           interconnect_gbs=PCIE4_GBS, host_memory_gib=64.0, price_per_hour=0.60),
    Target("l40s", "NVIDIA L40S 48 GB", "cuda", 44.5, _L40S, 864.0, cuda_capability=(8, 9),
           note="Ada data-center card, GDDR6 with ECC (~45 GiB usable), PCIe 4.0, no NVLink",
           interconnect_gbs=PCIE4_GBS, host_memory_gib=64.0, price_per_hour=1.00),
    Target("8xl40s", "NVIDIA L40S 48 GB", "cuda", 44.5, _L40S, 864.0, num_devices=8, cuda_capability=(8, 9),
           note="one node, PCIe 4.0 between the GPUs (no NVLink): collectives run at ~25 GB/s per GPU, so "
                "gradient all-reduce and FSDP gathers can dominate the step",
           interconnect_gbs=PCIE4_GBS, host_memory_gib=1536.0, price_per_hour=8.00),
    Target("a100-40", "NVIDIA A100 40 GB", "cuda", 39.4, _A100, 1555.0, cuda_capability=(8, 0),
           interconnect_gbs=NVLINK_A100_GBS, host_memory_gib=79.0, price_per_hour=1.30),
    Target("a100-80", "NVIDIA A100 80 GB", "cuda", 79.1, _A100, 2039.0, cuda_capability=(8, 0),
           interconnect_gbs=NVLINK_A100_GBS, host_memory_gib=158.0, price_per_hour=1.50),
    Target("h100", "NVIDIA H100 80 GB", "cuda", 79.1, _H100, 3350.0, cuda_capability=(9, 0),
           note="SXM datasheet 989 TFLOP/s bf16 dense; a dense bf16 matmul measured 789 on the H100 this project used",
           interconnect_gbs=NVLINK_H100_GBS, host_link_gbs=PCIE5_GBS, host_memory_gib=225.0, price_per_hour=3.00),
    Target("8xh100", "NVIDIA H100 80 GB", "cuda", 79.1, _H100, 3350.0, num_devices=8, cuda_capability=(9, 0),
           note="one node, NVLink; data parallel (DDP) or FSDP full-shard over the 8 GPUs",
           interconnect_gbs=NVLINK_H100_GBS, host_link_gbs=PCIE5_GBS, host_memory_gib=2048.0, price_per_hour=24.00),
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


def cuda_interconnect(name: str) -> float:
    """GPU-to-GPU GB/s per direction guessed from torch.cuda.get_device_name(): the SXM parts (NVLink) report
    "H100 80GB HBM3", "H200", "A100-SXM4-..."; PCIe cards ("H100 PCIe", "A100 80GB PCIe", L40S, RTX) get PCIe 4.0.
    A guess from the name only: a PCIe-only node with SXM-named GPUs does not exist, NVLink bridges on PCIe
    cards are not seen."""
    n = name.upper()
    if "PCIE" in n or "NVL" in n.replace("NVLINK", ""):
        return PCIE4_GBS
    if "H100" in n or "H200" in n or "H800" in n:
        return NVLINK_H100_GBS
    if "A100" in n or "A800" in n:
        return NVLINK_A100_GBS
    return PCIE4_GBS


def best_matmul_tflops(device: str = "cpu", dtype: str = "fp32") -> float:
    """This machine's dense matmul peak on ``device`` in ``dtype``: the best of a measurement now and every earlier
    one, kept in the cache (``machine_peaks.json``, per processor, thread count and torch). A timing taken while
    other work shares the cores (the data workers, another job) reads low, and an MFU measured against it reads
    above 100% (the quickstart's did); the best one seen is the machine's."""
    measured = measure_matmul_tflops(device, dtype)
    known = _known_peaks()
    key = _peak_key(device, dtype)
    best = max(measured, known.get(key, 0.0))
    if best > known.get(key, 0.0):
        path = cache_root() / _PEAKS_FILE
        try:
            path.parent.mkdir(parents=True, exist_ok=True)
            tmp = path.with_name(f".{path.name}.{os.getpid()}")
            tmp.write_text(json.dumps({**known, key: best}, indent=1), encoding="utf-8")
            tmp.replace(path)
        except OSError:  # a read-only cache: the measurement still stands for this run
            pass
    return best


_PEAKS_FILE = "machine_peaks.json"


def _peak_key(device: str, dtype: str) -> str:
    import torch

    return f"{device}|{dtype}|{platform.processor() or platform.machine()}|{torch.get_num_threads()}|{torch.__version__}"


def _known_peaks() -> dict[str, float]:
    try:
        return {k: float(v) for k, v in json.loads((cache_root() / _PEAKS_FILE).read_text(encoding="utf-8")).items()}
    except (OSError, ValueError, AttributeError):  # none yet, or unreadable: the next measurement starts it
        return {}


def measure_matmul_tflops(device: str = "cpu", dtype: str = "fp32", seconds: float = 0.3, n: int = 1024) -> float:
    """Dense matmul throughput on ``device`` (cpu, mps) in ``dtype``: the peak MFU is measured against where no
    datasheet figure applies. The device is synchronized before the clock is read (MPS runs asynchronously)."""
    import torch

    torch_dtype = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}[dtype]
    # Constant operands: a dense matmul's time does not depend on the values, and drawing random ones would
    # advance the global RNG a training run is seeded with (LoRA dropout masks, data order), changing its losses.
    a = torch.full((n, n), 1.0 / n, device=device, dtype=torch_dtype)
    b = torch.full((n, n), 1.0 / n, device=device, dtype=torch_dtype)
    sync = torch.mps.synchronize if device == "mps" else (lambda: None)
    a @ b  # warm up the BLAS threads (or the Metal kernels)
    sync()
    calls, start = 0, time.perf_counter()
    while (elapsed := time.perf_counter() - start) < seconds:
        a @ b
        calls += 1
        if device == "mps" and calls % 8 == 0:
            sync()
    sync()
    elapsed = time.perf_counter() - start
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


def this_machine(measure_cpu: bool = False, dtype: str = "fp32") -> Target:
    """The machine this runs on: the device the runtime policy would pick, with its memory.

    CPU and MPS: this machine's measured rates in ``dtype`` (``anyfit.hardware.calibration``: matmul, element-wise
    bandwidth, per-operation cost), the cached ones, or measured now (once per machine) when ``measure_cpu``;
    without either, the assumed per-core (CPU) or per-chip (MPS) throughput at an MFU. CPU memory: what is now
    *available* (other processes count).
    """
    hw = Hardware.detect()
    if hw.cuda:
        import psutil  # a dependency of accelerate

        total = total_bytes("cuda:0") / GIB
        peak, note = cuda_peak(hw.cuda_name)
        return Target("local", hw.cuda_name, "cuda", round(total, 1), peak, 2000.0, num_devices=hw.cuda_count,
                      cuda_capability=hw.cuda_capability, note=("this machine; " + note).rstrip("; "),
                      interconnect_gbs=cuda_interconnect(hw.cuda_name),
                      host_memory_gib=round(psutil.virtual_memory().total / GIB, 1))
    device = "mps" if hw.mps else "cpu"
    rates = machine_rates(device, dtype) if measure_cpu else known_rates(device, dtype)
    calibrated = {} if rates is None else {"measured": {dtype: rates.matmul_at(1024)}, "rates": rates,
                                           "bandwidth_gbs": rates.dram_gbs}
    how = (f"measured rates ({dtype}; `anyfit env` shows them, `anyfit env --recalibrate` measures again)"
           if rates else "")
    if hw.mps:
        tflops = _apple_chip_tflops()
        target = Target("local", "this Mac (MPS)", "mps", total_bytes("mps") / GIB,
                        {"fp32": tflops, "bf16": tflops, "fp16": tflops}, 200.0,
                        note="this machine; Metal's recommended working set; "
                             + (how or f"~{tflops:g} TFLOP/s assumed"))
        return replace(target, **calibrated)
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
    available = free_bytes("cpu") / GIB
    target = Target("local", f"this CPU ({cores} cores)", "cpu", round(available, 1),
                    {"fp32": CPU_TFLOPS_PER_CORE * cores}, 20.0,
                    note="this machine: available RAM; " + (how or f"~{CPU_TFLOPS_PER_CORE} TFLOP/s per core assumed"))
    return replace(target, **calibrated)


def custom_target(device: str, memory_gb: float, gpus: int = 1) -> Target:
    """A machine given only by its device kind and memory (``anyfit plan --device cuda --memory-gb 24``)."""
    if device == "cuda":
        return Target("custom", f"CUDA GPU {memory_gb:g} GB", "cuda", memory_gb * 1e9 / GIB, _GENERIC_CUDA, 1500.0,
                      num_devices=gpus, cuda_capability=(8, 0), interconnect_gbs=PCIE4_GBS,
                      note="custom size; A100-class throughput, native bf16 and PCIe 4.0 between GPUs assumed")
    if device == "mps":
        return replace(_apple("custom", int(memory_gb), "M-series", 8.0, 200.0), name=f"Apple Mac {memory_gb:g} GB")
    if device == "cpu":
        cores = os.cpu_count() or 1
        return Target("custom", f"CPU {memory_gb:g} GB", "cpu", memory_gb * 1e9 / GIB,
                      {"fp32": CPU_TFLOPS_PER_CORE * cores}, 20.0, note=f"custom size; {cores} cores assumed")
    raise ConfigError(f"--device {device!r}: use a preset ({', '.join(PRESETS)}), 'local', "
                      "or cuda/mps/cpu with --memory-gb.")


def targets_from_args(device: str | None = None, memory_gb: float | None = None, gpus: int | None = None,
                      measure_cpu: bool = True, price_per_hour: float | None = None) -> list[Target] | None:
    """The targets named by ``anyfit plan``'s --device/--memory-gb/--gpus/--price-per-hour; None means the
    default table.

    --device is a preset key (see ``PRESETS``), 'local' (this machine), or a device kind (cuda, mps, cpu)
    that needs --memory-gb. --memory-gb and --gpus override the memory per device and the device count of
    whatever was picked (a preset's price and host RAM scale with the GPU count). --price-per-hour sets the price of
    the whole picked machine; given alone it prices this machine in the default table (presets keep theirs).
    """
    if price_per_hour is not None and price_per_hour < 0:
        raise ConfigError(f"--price-per-hour must be 0 or more, got {price_per_hour}.")
    if memory_gb is not None and not memory_gb > 0:  # `not >`: NaN too
        raise ConfigError(f"--memory-gb must be more than 0 (the memory of one device in GB), got {memory_gb}.")
    if gpus is not None and gpus < 1:
        raise ConfigError(f"--gpus must be at least 1, got {gpus}.")
    if device is None and memory_gb is None and gpus is None:
        if price_per_hour is None:
            return None
        local, *presets = default_targets(measure_cpu=measure_cpu)
        return [replace(local, price_per_hour=price_per_hour), *presets]
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
        # A machine with more (or fewer) GPUs of this kind: its price and host RAM scale with the GPU count.
        scale = gpus / target.num_devices
        target = replace(target, num_devices=gpus,
                         price_per_hour=None if target.price_per_hour is None else target.price_per_hour * scale,
                         host_memory_gib=None if target.host_memory_gib is None else target.host_memory_gib * scale)
    if price_per_hour is not None:
        target = replace(target, price_per_hour=price_per_hour)
    return [target]


def default_targets(measure_cpu: bool = True) -> list[Target]:
    """This machine first, then every preset."""
    return [this_machine(measure_cpu=measure_cpu), *PRESETS.values()]

"""The machines a launch can rent, as planner ``Target``s: Hugging Face Jobs' flavors and SkyPilot's accelerators.

Hugging Face Jobs (``--on hf-jobs``): every GPU flavor of ``huggingface_hub.JobHardware`` (huggingface_hub 2.4.0)
with the GPU memory, host RAM and hourly price of the Hub's pricing page (huggingface/hub-docs
docs/hub/jobs-pricing.md at commit 0b8c07f, read 2026-11; also ``hf jobs hardware`` or ``GET /api/jobs/hardware``).
Jobs bill by the minute while starting or running. There is no H100 flavor: the Hopper flavors are H200.

SkyPilot (``--on skypilot``): the accelerator names SkyPilot's catalogs use (``sky show-gpus``); SkyPilot picks
the cloud and region itself and prints its own price before launching, so the prices here are the planner's
approximate specialist-cloud prices (``anyfit.planning.presets.PRICE_NOTE``), for choosing only.

Both tables are dated; ``--price-per-hour`` overrides the price of the machine chosen (as for ``anyfit plan``).
"""

from __future__ import annotations

from dataclasses import dataclass, replace

from anyfit.planning.presets import PCIE4_GBS, PCIE5_GBS, PRESETS, PRICE_NOTE, Target
from anyfit.units import GIB

HF_PRICE_DATE = "2026-11"
HF_PRICE_NOTE = (f"prices: Hugging Face Jobs' list prices (huggingface.co/docs/hub/jobs-pricing, read {HF_PRICE_DATE}), "
                 "billed per minute while the job starts or runs; override with --price-per-hour")

# GPUs the planner's presets do not have. Dense bf16/fp16 and TF32 TFLOP/s from the vendors' datasheets (L4: 121
# bf16 dense, 300 GB/s; A10G (AWS's A10 variant): 125 / 62.5, 600 GB/s; H200 SXM: the H100's compute, 4.8 TB/s;
# RTX PRO 6000 Blackwell Server: ~500 bf16 dense (an estimate: half its sparse figure), 1,597 GB/s). Usable memory:
# what nvidia-smi reports less ~0.5 GiB of CUDA context, as the presets take it.
_L4 = Target("l4", "NVIDIA L4 24 GB", "cuda", 22.0, {"bf16": 121.0, "fp16": 121.0, "fp32": 60.0}, 300.0,
             cuda_capability=(8, 9), interconnect_gbs=PCIE4_GBS, note="Ada inference card, PCIe 4.0, no NVLink")
_A10G = Target("a10g", "NVIDIA A10G 24 GB", "cuda", 22.0, {"bf16": 125.0, "fp16": 125.0, "fp32": 62.5}, 600.0,
               cuda_capability=(8, 6), interconnect_gbs=PCIE4_GBS, note="Ampere (AWS g5), PCIe 4.0, no NVLink")
_H200 = replace(PRESETS["h100"], key="h200", name="NVIDIA H200 141 GB", memory_gib=139.8, bandwidth_gbs=4800.0,
                note="Hopper with 141 GB HBM3e: the H100's compute, 4.8 TB/s")
_RTX_PRO_6000 = Target("rtx-pro-6000", "NVIDIA RTX PRO 6000 96 GB", "cuda", 94.5,
                       {"bf16": 500.0, "fp16": 500.0, "fp32": 125.0}, 1597.0, cuda_capability=(12, 0),
                       interconnect_gbs=PCIE5_GBS, host_link_gbs=PCIE5_GBS,
                       note="Blackwell server card, PCIe 5.0; throughput estimated from the datasheet's sparse figure")
GPUS = {"t4": PRESETS["t4"], "l4": _L4, "l40s": PRESETS["l40s"], "a10g": _A10G, "a100-80": PRESETS["a100-80"],
        "h200": _H200, "rtx-pro-6000": _RTX_PRO_6000, "a100-40": PRESETS["a100-40"], "h100": PRESETS["h100"],
        "rtx4090": PRESETS["rtx4090"]}


@dataclass(frozen=True)
class Machine:
    """One machine of a provider's offer: the name the provider takes (a flavor, or SkyPilot's ``GPU:count``)
    and the planner's ``Target`` for it (its price is for the whole machine)."""

    provider: str  # "hf-jobs" | "skypilot"
    name: str
    target: Target

    @property
    def gpus(self) -> int:
        return self.target.num_devices


def _flavor(name: str, gpu: str, count: int, host_gb: float, price: float) -> Machine:
    base = GPUS[gpu]
    return Machine("hf-jobs", name, replace(base, key=name, num_devices=count, price_per_hour=price,
                                            host_memory_gib=round(host_gb * 1e9 / GIB, 1),
                                            interconnect_gbs=base.interconnect_gbs or PCIE4_GBS))


# (flavor, GPU, GPUs, host RAM GB, USD/hour): the Hub's pricing table, in its order.
HF_JOBS: dict[str, Machine] = {m.name: m for m in [
    _flavor("t4-small", "t4", 1, 15, 0.40), _flavor("t4-medium", "t4", 1, 30, 0.60),
    _flavor("l4x1", "l4", 1, 30, 0.80), _flavor("l4x4", "l4", 4, 186, 3.80),
    _flavor("l40sx1", "l40s", 1, 62, 1.80), _flavor("l40sx4", "l40s", 4, 382, 8.30),
    _flavor("l40sx8", "l40s", 8, 1534, 23.50),
    _flavor("a10g-small", "a10g", 1, 15, 1.00), _flavor("a10g-large", "a10g", 1, 46, 1.50),
    _flavor("a10g-largex2", "a10g", 2, 92, 3.00), _flavor("a10g-largex4", "a10g", 4, 184, 5.00),
    _flavor("a100-large", "a100-80", 1, 142, 2.50), _flavor("a100x4", "a100-80", 4, 568, 10.00),
    _flavor("a100x8", "a100-80", 8, 1136, 20.00),
    _flavor("h200", "h200", 1, 256, 5.00), _flavor("h200x2", "h200", 2, 512, 10.00),
    _flavor("h200x4", "h200", 4, 1024, 20.00), _flavor("h200x8", "h200", 8, 2048, 40.00),
    _flavor("rtx-pro-6000", "rtx-pro-6000", 1, 256, 2.75), _flavor("rtx-pro-6000x2", "rtx-pro-6000", 2, 512, 5.50),
    _flavor("rtx-pro-6000x4", "rtx-pro-6000", 4, 1024, 11.00),
    _flavor("rtx-pro-6000x8", "rtx-pro-6000", 8, 2048, 22.00),
]}

# SkyPilot's accelerator names for the planner's GPUs, and the approximate price of one such GPU per hour
# (the presets' specialist-cloud prices; L4, A10G and H200 at the same kind of offer, 2026-11).
SKYPILOT_GPUS: dict[str, tuple[str, float]] = {
    "T4": ("t4", 0.35), "L4": ("l4", 0.70), "A10G": ("a10g", 1.00), "L40S": ("l40s", 1.00),
    "RTX4090": ("rtx4090", 0.60), "A100": ("a100-40", 1.30), "A100-80GB": ("a100-80", 1.50), "H100": ("h100", 3.00),
    "H200": ("h200", 3.80),
}
SKYPILOT_COUNTS = (1, 2, 4, 8)


def skypilot_machine(accelerator: str, count: int) -> Machine:
    gpu, price = SKYPILOT_GPUS[accelerator]
    base = GPUS[gpu]
    scale = count / base.num_devices
    return Machine("skypilot", f"{accelerator}:{count}",
                   replace(base, key=f"{accelerator}:{count}", num_devices=count, price_per_hour=price * count,
                           host_memory_gib=None if base.host_memory_gib is None else base.host_memory_gib * scale,
                           interconnect_gbs=base.interconnect_gbs or PCIE4_GBS))


def offer(provider: str) -> list[Machine]:
    """Every machine of ``provider``'s offer, in the table's order."""
    if provider == "hf-jobs":
        return list(HF_JOBS.values())
    return [skypilot_machine(a, n) for a in SKYPILOT_GPUS for n in SKYPILOT_COUNTS]


def price_note(provider: str) -> str:
    return HF_PRICE_NOTE if provider == "hf-jobs" else PRICE_NOTE

"""Runtime policy: which device, precision, weight dtype and batch workers a run uses, decided once,
with the reason printed. Training and inference (``anyfit eval``/``generate``) ask the same function,
so a model is never run in a precision on one path that the other refuses.

The hardware is read through a small ``Hardware`` record so the decision itself is a pure function
that tests can drive with any machine (a T4, an H100, a Mac) without having one.
"""

from __future__ import annotations

import os
import platform
import sys
from dataclasses import dataclass, field

import torch

from anyfit.config import Config, ConfigError, RuntimeConfig
from anyfit.hardware.elastic import init_restarted_process_group
from anyfit.units import GIB


@dataclass(frozen=True)
class Hardware:
    """What the machine offers, as far as the policy cares."""

    cuda: bool
    cuda_name: str = ""
    cuda_capability: tuple[int, int] = (0, 0)
    cuda_count: int = 0
    mps: bool = False

    @staticmethod
    def detect() -> "Hardware":
        if torch.cuda.is_available():
            return Hardware(cuda=True, cuda_name=torch.cuda.get_device_name(0),
                            cuda_capability=torch.cuda.get_device_capability(0),
                            cuda_count=torch.cuda.device_count(),
                            mps=False)
        mps = bool(getattr(torch.backends, "mps", None) and torch.backends.mps.is_available())
        return Hardware(cuda=False, mps=mps)

    @property
    def native_bf16(self) -> bool:
        # torch.cuda.is_bf16_supported() says True on a T4 (sm_75) because bf16 is emulated there,
        # at a fraction of fp16 speed. Native bf16 tensor cores start with Ampere (sm_80).
        return self.cuda and self.cuda_capability >= (8, 0)


@dataclass(frozen=True)
class RuntimePolicy:
    """The resolved decision. ``mixed_precision`` is what HF Accelerate is told."""

    device: str  # "cuda" | "mps" | "cpu"
    precision: str  # "fp32" | "bf16" | "fp16"
    tf32: bool
    reasons: tuple[str, ...] = field(default_factory=tuple)
    num_workers: int = 0  # processes preparing the next steps' batches
    pin_memory: bool = False  # page-locked host batches: asynchronous copies to a CUDA device

    @property
    def mixed_precision(self) -> str:
        return {"fp32": "no", "bf16": "bf16", "fp16": "fp16"}[self.precision]

    @property
    def compute_dtype(self) -> torch.dtype:
        return PRECISION_DTYPE[self.precision]

    def describe(self) -> str:
        lines = [f"device={self.device} precision={self.precision} tf32={'on' if self.tf32 else 'off'} "
                 f"batch workers={self.num_workers}"]
        lines += [f"  - {r}" for r in self.reasons]
        return "\n".join(lines)


DEVICES = ("auto", "cuda", "mps", "cpu")
PRECISIONS = ("auto", "fp32", "bf16", "fp16")
# torch dtype names (``--dtype`` of inference, ``model.dtype``) and the precisions they are
DTYPE_PRECISION = {"float32": "fp32", "bfloat16": "bf16", "float16": "fp16"}


# bitsandbytes quantizes to NF4 and runs its 4-bit matmul, forward and backward, on the CPU in the releases checked
# here (0.50: transformers' BitsAndBytesConfig loading, PEFT's LoRA on top, anyfit's tests); CUDA has had it since
# 0.39. Slow on a CPU, and not what QLoRA is for there: it lets the QLoRA path run where anyfit's tests run.
BNB_CPU = (0, 50)


def bitsandbytes_cpu_problem() -> str:
    """Why the installed bitsandbytes cannot run QLoRA on the CPU ('' when it can)."""
    import re
    from importlib.metadata import PackageNotFoundError, version

    try:
        installed = version("bitsandbytes")
    except PackageNotFoundError:
        return "bitsandbytes is not installed"
    numbers = tuple(int(x) for x in re.findall(r"\d+", installed)[:2])
    return "" if numbers >= BNB_CPU else f"bitsandbytes {installed} is installed"


def resolve_runtime(cfg: RuntimeConfig, hw: Hardware | None = None, qlora: bool = False,
                    inference: bool = False) -> RuntimePolicy:
    """Pick device, precision and batch workers from the config and the hardware; refuse impossible requests.

    ``inference``: the policy for generation (no gradients): the same automatic choices, but an explicit
    fp16 or bf16 off CUDA is allowed there, since the reasons training refuses them (no loss scaling,
    slow bf16 autocast on CPU) concern the backward pass.

    Kept whole: the decision reads top to bottom as the README's hardware table, device first, then
    precision, TF32 and batch workers, each with the reason it prints.
    """
    hw = hw or Hardware.detect()
    reasons: list[str] = []
    if cfg.device not in DEVICES:
        raise ConfigError(f"runtime.device={cfg.device!r}: use one of {', '.join(DEVICES)}.")
    if cfg.precision not in PRECISIONS:
        raise ConfigError(f"runtime.precision={cfg.precision!r}: use one of {', '.join(PRECISIONS)}.")

    if cfg.device == "auto":
        if hw.cuda:
            device = "cuda"
            reasons.append(f"device cuda: {hw.cuda_name or 'a CUDA GPU'} found (auto prefers cuda > mps > cpu)")
        elif hw.mps:
            device = "mps"
            reasons.append("device mps: Apple GPU found, no CUDA (auto prefers cuda > mps > cpu)")
        else:
            device = "cpu"
            reasons.append("device cpu: no CUDA or MPS device found")
    else:
        device = cfg.device
        if device == "cuda" and not hw.cuda:
            raise ConfigError("runtime.device=cuda but no CUDA GPU is visible (torch.cuda.is_available() is False). "
                              "Use runtime.device=auto, or install a CUDA build of torch on a machine with a GPU.")
        if device == "mps" and not hw.mps:
            raise ConfigError("runtime.device=mps but the MPS backend is not available (Apple Silicon with macOS 12.3+ "
                              "is needed). Use runtime.device=auto or cpu.")
        reasons.append(f"device {device}: asked for in the config")

    if cfg.compile and device == "mps" and not inference:
        # torch.compile's inductor has only an early-prototype Metal back end (its own source says so:
        # torch/_inductor/codegen/mps.py), and anyfit compiles with dynamic shapes through the backward pass,
        # which nobody has checked on MPS; eager mode is what the MPS numbers and tests here are for.
        raise ConfigError("runtime.compile=true on mps: torch.compile's inductor back end for Apple GPUs is an early "
                          f"prototype in torch {torch.__version__.split('+')[0]} and anyfit does not support training "
                          "through it. Use runtime.compile=false (eager mode) on MPS.")

    if qlora and device == "mps":
        raise ConfigError("lora.qlora=true needs CUDA or the CPU (bitsandbytes' 4-bit kernels), but the device is mps. "
                          "Use plain LoRA (lora.qlora=false) here; on a Mac, LoRA in fp32 fits models up to ~3B in 16 GB.")
    if qlora and device == "cpu" and (problem := bitsandbytes_cpu_problem()):
        raise ConfigError(f"lora.qlora=true on the CPU needs bitsandbytes>={'.'.join(map(str, BNB_CPU))} (its 4-bit CPU "
                          f"kernels), but {problem}: pip install 'bitsandbytes>={'.'.join(map(str, BNB_CPU))}', or use "
                          "plain LoRA (lora.qlora=false).")

    precision = cfg.precision
    if precision == "auto":
        if device == "cuda":
            if hw.native_bf16:
                precision = "bf16"
                reasons.append(f"precision bf16: compute capability {hw.cuda_capability[0]}.{hw.cuda_capability[1]} "
                               "has native bf16; same range as fp32, no loss scaling needed")
            else:
                precision = "fp16"
                reasons.append(f"precision fp16 with loss scaling: compute capability {hw.cuda_capability[0]}."
                               f"{hw.cuda_capability[1]} has no native bf16 (emulated bf16 is slow)")
        else:
            precision = "fp32"
            reasons.append(f"precision fp32: mixed precision on {device} gives NaNs (fp16) or little speed; "
                           "bf16 on MPS only when asked")
    elif inference:
        if precision == "bf16" and device == "cuda" and not hw.native_bf16:
            raise ConfigError(f"bf16 on {hw.cuda_name or 'this GPU'} is only emulated before Ampere (8.0) and runs "
                              "very slowly; use float16 or auto.")
        reasons.append(f"precision {precision}: asked for")
    else:
        if precision == "fp16" and device != "cuda":
            raise ConfigError(f"runtime.precision=fp16 on {device}: fp16 training needs CUDA's loss scaling and gives "
                              "NaN losses on MPS/CPU. Use runtime.precision=fp32 (or bf16 on MPS if you accept the risk).")
        if precision == "bf16" and device == "cuda" and not hw.native_bf16:
            raise ConfigError(f"runtime.precision=bf16 on {hw.cuda_name or 'this GPU'} (compute capability "
                              f"{hw.cuda_capability[0]}.{hw.cuda_capability[1]}): bf16 is only emulated before Ampere "
                              "(8.0) and runs very slowly. Use runtime.precision=fp16 (loss-scaled) or auto.")
        if precision == "bf16" and device == "cpu":
            raise ConfigError("runtime.precision=bf16 on cpu is not supported by anyfit: CPU autocast in bf16 is slow "
                              "on most CPUs and loses precision. Use runtime.precision=fp32.")
        reasons.append(f"precision {precision}: asked for in the config")

    tf32 = bool(cfg.tf32 and device == "cuda" and hw.cuda_capability >= (8, 0))
    if device == "cuda":
        reasons.append("tf32 " + ("on: fp32 matmuls use TF32 tensor cores" if tf32 else
                                  "off: " + ("disabled in the config" if not cfg.tf32 else "GPU has no TF32")))
    workers, pin = _batch_workers(cfg.num_workers, device, reasons)
    return RuntimePolicy(device=device, precision=precision, tf32=tf32, reasons=tuple(reasons), num_workers=workers,
                         pin_memory=pin)


def _batch_workers(requested: int | str, device: str, reasons: list[str]) -> tuple[int, bool]:
    """(worker processes, pin memory). Workers pay where the device computes apart from the host's cores."""
    pin = device == "cuda"
    if requested != "auto":
        reasons.append(f"batch workers {requested}: asked for in the config")
        return int(requested), pin
    if device == "cuda":
        reasons.append("batch workers 2, pinned memory: the next steps' batches are collated and copied while the "
                       "GPU computes")
        return 2, pin
    reasons.append(f"batch workers 0: on {device} worker processes would compete with training for the host's cores")
    return 0, pin


def weight_dtype(model_dtype: str, lora: bool, device: str, precision: str) -> torch.dtype:
    """The dtype base weights are loaded in (``model.dtype`` unless auto).

    Full fine-tuning keeps fp32 master weights (autocast computes in bf16/fp16); a frozen LoRA base on CUDA
    can live in the compute dtype, halving its memory; a QLoRA base is quantized by bitsandbytes, and
    what stays unquantized is kept in the compute dtype. Used by model loading and by the planner.
    """
    if model_dtype != "auto":
        return getattr(torch, model_dtype)
    if lora and device == "cuda":
        return PRECISION_DTYPE[precision]
    return torch.float32


PRECISION_DTYPE = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}


# Block-wise 8-bit AdamW: bitsandbytes' on CUDA, torchao's under FSDP2 (training.optim), 2 B/param (planning.setup).
EIGHT_BIT_OPTIMIZERS = ("adamw_8bit", "paged_adamw_8bit")


def sharding_refusal(cfg: Config, device: str, precision: str, optimizer: str | None = None) -> str:
    """Why this run cannot be sharded with FSDP2 on ``device`` in ``precision`` ('' when it can).

    The one owner of these rules: the training loop refuses a sharded run with this text
    (``anyfit.backends.choose_backend``), and the planner leaves sharding out of its saver ladder for
    the same reasons (``optimizer`` there is the one the ladder tries instead of ``train.optimizer``)."""
    optimizer = optimizer or cfg.train.optimizer
    if device not in ("cuda", "cpu"):
        return f"FSDP2 needs a process group backend (NCCL on CUDA, gloo on CPU); {device} has none"
    if cfg.lora.qlora:
        return ("lora.qlora=true with sharding: QLoRA's 4-bit weights are not sharded by anyfit. Use "
                "runtime.sharding=none, or plain LoRA (lora.qlora=false), which shards")
    if optimizer == "adafactor":
        # torch's Adafactor takes norms of whole rows and columns in place, which sharded (DTensor) weights
        # refuse ("in-place operations that require placement changes are not supported").
        return ("train.optimizer=adafactor with sharding: torch's Adafactor cannot update sharded weights. "
                "Use train.optimizer=adamw (sharding already divides its state by the process count) or "
                "adamw_8bit on CUDA, or runtime.sharding=none.")
    if optimizer == "paged_adamw_8bit":
        # bitsandbytes pages whole, unsharded states; the sharded 8-bit AdamW is torchao's (training.optim)
        return ("train.optimizer=paged_adamw_8bit with sharding: paged states are bitsandbytes' and unsharded. "
                "Use train.optimizer=adamw_8bit (torchao's 8-bit states, sharded with the weights), or "
                "runtime.sharding=none.")
    if precision == "fp16":
        return ("runtime.sharding with fp16: loss scaling of sharded gradients is not supported by anyfit. "
                "Use runtime.precision=bf16 (Ampere or newer) or fp32, or runtime.sharding=none.")
    if cfg.eval.generate_before or cfg.eval.generate_every or cfg.eval.generate_at_end:
        return ("eval.generate_* during a sharded run: generation runs on one process, which cannot hold "
                "the sharded model. Keep the validation loss (eval.every) and run 'anyfit eval' on the "
                "output afterwards, or set runtime.sharding=none.")
    return ""



def sequence_parallel_problem(cfg: Config, processes: int, heads: int, kv_heads: int, degree: int | None = None,
                              state: str = "") -> str:
    """Why sequence parallelism over ``degree`` processes (default ``runtime.sequence_parallel``) cannot run
    ('' when it can), before any weights load: the loop refuses with this text (``anyfit.backends.choose_backend``,
    which also needs DeepSpeed installed) and the planner offers only the degrees it allows (for the machine it
    plans, whatever is installed here). Ulysses gives each process whole attention heads."""
    n = degree or cfg.runtime.sequence_parallel
    if n == 1:
        return ""
    fix = "set runtime.sequence_parallel=1"
    if processes == 1:
        return (f"runtime.sequence_parallel={n} on a single process: the split needs {n} processes. Launch with "
                f"torchrun --nproc_per_node {n} (or accelerate launch), or {fix}.")
    if processes % n:
        return (f"runtime.sequence_parallel={n} does not divide the {processes} processes into groups. Use a "
                f"degree that divides {processes}, or launch a multiple of {n} processes.")
    if heads % n or not (kv_heads % n == 0 or n % kv_heads == 0):
        fitting = [d for d in range(2, processes + 1) if processes % d == 0 and heads % d == 0
                   and (kv_heads % d == 0 or d % kv_heads == 0)]
        return (f"runtime.sequence_parallel={n}: the model's {heads} attention heads ({kv_heads} key/value heads) "
                f"cannot be split {n} ways (Ulysses gives each process whole heads). "
                + (f"Degrees that fit {processes} processes: {', '.join(map(str, fitting))}." if fitting
                   else f"No degree fits {processes} processes: {fix}."))
    if state:  # the model's anyfit.model.packing.stateful_kinds
        return (f"runtime.sequence_parallel={n}: this model's {state.removeprefix('its ')} carry a state along the "
                f"sequence, which Ulysses' split attention does not pass between processes. {fix}.")
    if cfg.runtime.sharding == "deepspeed":
        return (f"runtime.sequence_parallel={n} with runtime.sharding=deepspeed is not supported by anyfit: use "
                "runtime.sharding=fsdp or none with it.")
    if cfg.model.attn_implementation == "eager":
        return (f"runtime.sequence_parallel={n} with model.attn_implementation=eager: eager attention builds a "
                "full (T x T) mask the split cannot carry. Use auto, sdpa or flash_attention_2.")
    if cfg.eval.generate_before or cfg.eval.generate_every or cfg.eval.generate_at_end:
        return (f"eval.generate_* with runtime.sequence_parallel={n}: generation runs on one process, and every "
                "attention call of a split model waits for its whole group. Keep the validation loss (eval.every) "
                "and run 'anyfit eval' on the output afterwards.")
    if cfg.train.watch_base is True:  # 'auto' turns base_kl off under a split with a line (training.forgetting)
        return (f"train.watch_base is not available with runtime.sequence_parallel={n} yet: set "
                "train.watch_base=false.")
    if cfg.train.base_kl_weight:
        return (f"train.base_kl_weight > 0 is not available with runtime.sequence_parallel={n} yet: set "
                "train.base_kl_weight=0.")
    return ""


def inference_policy(device: str = "auto", dtype: str | torch.dtype = "auto", hw: Hardware | None = None) -> RuntimePolicy:
    """Device and dtype for generation: ``dtype`` is auto, a torch dtype or its name (float32, bfloat16, float16)."""
    if isinstance(dtype, torch.dtype):
        dtype = str(dtype).removeprefix("torch.")
    if dtype != "auto" and dtype not in DTYPE_PRECISION:
        raise ConfigError(f"dtype {dtype!r}: use auto, {', '.join(DTYPE_PRECISION)}.")
    precision = "auto" if dtype == "auto" else DTYPE_PRECISION[dtype]
    return resolve_runtime(RuntimeConfig(device=device, precision=precision, num_workers=0), hw, inference=True)


def make_accelerator(policy: RuntimePolicy, compile_model: bool = False, trackers: list[str] = (),
                     logging_dir: str | None = None, unused_parameters: bool = False):
    """HF Accelerate told the policy: the device, mixed precision, torch.compile settings when asked (inductor
    with dynamic shapes: packed rows change length every step), and the experiment trackers to log to.
    ``unused_parameters``: trained weights that some micro-batches do not reach (a vision tower that trains, under
    a batch of text records), which DDP must be told of (its ``find_unused_parameters``)."""
    from accelerate import Accelerator
    from accelerate.utils import DistributedDataParallelKwargs, TorchDynamoPlugin

    refusal = deepspeed_launch_refusal()
    if refusal:
        raise ConfigError(refusal)
    apply_policy(policy)
    # a torchrun restart on one machine: the process group on this attempt's own keys (anyfit.hardware.elastic)
    init_restarted_process_group("gloo" if policy.device == "cpu" else "nccl")
    dynamo = TorchDynamoPlugin(backend="inductor", dynamic=True) if compile_model else None
    handlers = [DistributedDataParallelKwargs(find_unused_parameters=True)] if unused_parameters else None
    accelerator = Accelerator(cpu=policy.device == "cpu", mixed_precision=policy.mixed_precision, dynamo_plugin=dynamo,
                              log_with=list(trackers) or None, project_dir=logging_dir if trackers else None,
                              kwargs_handlers=handlers)
    # Accelerate keeps one state per Python process: a Trainer built earlier in the same process (a notebook)
    # fixes the mixed precision for every later Accelerator, which would silently train in another precision.
    if accelerator.mixed_precision != policy.mixed_precision:
        raise ConfigError(f"HF Accelerate was already set up in this Python process with mixed precision "
                          f"{accelerator.mixed_precision!r} (for example by a transformers Trainer), but this run needs "
                          f"{policy.mixed_precision!r}: run anyfit in a fresh process (or restart the notebook kernel).")
    return accelerator


def end_process_group() -> None:
    """Destroy the process group a run started, once the run's objects (the wrapped model) are gone.

    Not earlier: DDP's reducer holds the group from C++, and when the reducer is the group's last holder it destroys
    the group with the GIL held. gloo's destructor then waits for its worker threads, and one of them may still be
    freeing the run's last collective, which needs the GIL to release that collective's tensors: a hang at exit,
    seen once in a two-process run (rank 0 stuck in ``~ProcessGroupGloo`` under ``~Reducer``, 2026-11-27). Destroyed
    here from Python, the group's binding lets go of the GIL first (torch's no-GIL destructor for process groups)."""
    if torch.distributed.is_available() and torch.distributed.is_initialized():
        torch.distributed.destroy_process_group()


def deepspeed_launch_refusal(environ=os.environ) -> str:
    """Why a launch through a DeepSpeed ``accelerate config`` is refused ('' for any other launch).

    anyfit drives DeepSpeed's engine itself (``runtime.sharding: deepspeed``); through Accelerate's plugin the
    engine would not be anyfit's: on CPU Accelerate drops DeepSpeed and the run would train as plain DDP while the
    config says ZeRO-3, and on CUDA the plugin would take over the accumulation, loss scaling and clipping anyfit
    does itself."""
    if environ.get("ACCELERATE_USE_DEEPSPEED", "").lower() not in ("true", "1"):
        return ""
    return ("launched with a DeepSpeed accelerate config: anyfit builds DeepSpeed's engine itself, so that its "
            "accumulation, loss scaling and clipping stay anyfit's. Set runtime.sharding=deepspeed (and "
            "runtime.deepspeed_offload=true for ZeRO-3's CPU offload) and launch with torchrun or a plain "
            "accelerate launch.")


def apply_policy(policy: RuntimePolicy) -> None:
    """Process-wide switches that follow from the policy (TF32; DeepSpeed told there is no GPU)."""
    if policy.device == "cuda":
        torch.backends.cuda.matmul.allow_tf32 = policy.tf32
        torch.backends.cudnn.allow_tf32 = policy.tf32
    quiet_deepspeed()


def quiet_deepspeed() -> None:
    """Where DeepSpeed is installed, Accelerate's ``unwrap_model`` (which transformers' ``save_pretrained`` calls)
    imports it in every run, DeepSpeed or not; without CUDA it then warns on the terminal that it found no GPU.
    Telling it the CPU is the accelerator, which it would pick anyway, keeps that import quiet (DeepSpeed runs
    only on CUDA or CPU in anyfit, so nothing else is changed by it)."""
    if not torch.cuda.is_available():
        os.environ.setdefault("DS_ACCELERATOR", "cpu")


def memory_summary() -> list[str]:
    """Total/available memory of the host and of each accelerator."""
    import psutil  # a dependency of accelerate

    vm = psutil.virtual_memory()
    lines = [f"host memory: {vm.total / GIB:.1f} GiB total, {vm.available / GIB:.1f} GiB available, "
             f"{os.cpu_count()} CPU cores"]
    if torch.cuda.is_available():
        for i in range(torch.cuda.device_count()):
            free, total = torch.cuda.mem_get_info(i)
            lines.append(f"cuda:{i} {torch.cuda.get_device_name(i)}: {total / GIB:.1f} GiB total, "
                         f"{free / GIB:.1f} GiB free, capability {torch.cuda.get_device_capability(i)}")
    elif getattr(torch.backends, "mps", None) and torch.backends.mps.is_available():
        lines.append(f"mps: unified memory, recommended max {torch.mps.recommended_max_memory() / GIB:.1f} GiB")
    return lines


def versions() -> dict[str, str]:
    """Versions of Python, the platform and the stack; from the installed packages' metadata, because importing
    peft and transformers only to ask costs seconds."""
    from importlib.metadata import version

    out = {"python": sys.version.split()[0], "platform": platform.platform(), "torch": torch.__version__,
           **{name: version(name) for name in ("transformers", "accelerate", "peft")}}
    if torch.cuda.is_available():
        out["cuda"] = str(torch.version.cuda)
    return out

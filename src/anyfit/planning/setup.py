"""The quantities the memory and time model take (``Setup``: one way to run the training step; ``Workload``: the
data it runs on) and the one mapping from a run config to them (``setup_for``), with the constants of the
libraries anyfit runs on."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from anyfit.config import Config
from anyfit.hardware.runtime import weight_dtype

BYTES = {"fp32": 4, "bf16": 2, "fp16": 2}

# 4-bit NF4 with double quantization (bitsandbytes): 4 bits per weight, an 8-bit absmax per block of 64
# weights, and an fp32 absmax (plus offset) per 256 of those blocks.
NF4_BYTES_PER_PARAM = 0.5 + 1 / 64 + 8 / (64 * 256)

# bitsandbytes' blockwise 8-bit AdamW (AdamW8bit, PagedAdamW8bit): state1 and state2 are uint8, each with an
# fp32 absmax per block of 256 elements (bitsandbytes/optim/optimizer.py, Optimizer2State.init_state:
# ``blocks = n // 256``; releases before 0.45 used 2048), so 2 + 2 * 4 / 256 bytes per parameter instead of
# AdamW's 8. Tensors under ``min_8bit_size`` = 4,096 elements keep two fp32 states: the planner counts every
# 1-D tensor (norms, biases) so, which overstates by at most a few MB. The 2 x 256 floats of quantization maps
# are shared and ignored. Paged 8-bit AdamW has the same device footprint until memory runs short.
BNB_BLOCK = 256
EIGHT_BIT_STATE_BYTES = 2 + 2 * 4 / BNB_BLOCK
OPTIMIZER_NAMES = {"adamw": "AdamW", "adamw_8bit": "8-bit AdamW", "paged_adamw_8bit": "paged 8-bit AdamW",
                   "adafactor": "Adafactor"}

# Bytes the optimizer update streams per trainable parameter (reads + writes), which bounds its time:
# fused AdamW on fp32 reads parameter, gradient and two states and writes three back (28); 8-bit AdamW the
# same with 1-byte states (16); torch's Adafactor (single-tensor path, its default) reads the gradient twice
# for the row/column norms, builds a full-size variance estimate and update in place (~4 passes), reads the
# parameter for its RMS and writes it (~40).
OPTIMIZER_STREAM_BYTES = {"adamw": 28, "adamw_8bit": 16, "paged_adamw_8bit": 16, "adafactor": 40}

# CPU offload runs the optimizer step on the host (FSDP2 keeps the sharded parameters, gradients and states
# there). Assumed sustained host memory throughput for that update, shared by the processes of a node: an
# assumption (not measured here) for a multi-channel server; a desktop has about half.
CPU_OPTIMIZER_GBS = 50.0

# DDP reduces gradients in 25 MiB buckets (torch's default bucket_cap_mb) while the backward pass runs; the last
# bucket cannot overlap with compute.
DDP_BUCKET_BYTES = 25 * 2**20

# Fixed memory a process needs besides tensors: the CUDA context and library workspaces (not counted by
# torch.cuda.max_memory_allocated, but taken from the GPU); on Apple unified memory and on the CPU the
# Python process itself (interpreter, torch, transformers, the tokenizer, the data). The CPU figure is the
# process before the model, library code paged in by the first step, and glibc's heap slack (freed activations
# it keeps), as measured in benchmarks/PLAN_VS_MEASURED.md, 'Summary'.
RUNTIME_OVERHEAD_GIB = {"cuda": 0.5, "mps": 1.0, "cpu": 1.25}

# Share of the target's memory the plan may use: the rest absorbs allocator fragmentation and estimate error.
# The same share bounds the host RAM of CPU offload and model loading.
SAFETY = 0.9

# The pieces of a LoRA target's input that PEFT keeps per adapter, by where dropout runs: the fused CUDA/MPS
# dropout saves a 1-byte mask; the CPU one multiplies by a noise tensor of the input's dtype (fp32 in PEFT).
_DROPOUT_MASK_BYTES = {"cuda": 1, "mps": 1, "cpu": 4}


@dataclass(frozen=True)
class Setup:
    """One way to run the training step: what the planner varies and the estimates depend on."""

    method: str  # "full" | "lora" | "qlora"
    device: str  # "cuda" | "mps" | "cpu"
    precision: str  # "fp32" | "bf16" | "fp16": the compute dtype (autocast when weights are fp32)
    weight_bytes: int  # bytes per base weight as loaded (4: fp32 master weights, 2: bf16/fp16)
    micro_batch: int
    seq_len: int  # tokens per sequence in the longest micro-batch (data.max_length for a bound)
    gradient_checkpointing: bool = False
    accumulation: int = 1
    processes: int = 1
    fsdp: bool = False  # FSDP2 full shard of weights, gradients and optimizer states over the processes
    lora_r: int = 16
    lora_targets: list[str] | str = "auto"
    lora_experts: bool = True  # lora.experts: a mixture of experts' routed experts carry adapters too
    lora_split_experts: bool = True  # lora.split_experts: their adapters as base plus low-rank path
    lora_dropout: float = 0.05
    padding: bool = True  # micro-batches padded to their longest (the attention then takes a mask)
    fused_optimizer: bool = True
    loss_chunk_tokens: int = 0  # train.loss_chunk_tokens: 0 is torch's cross-entropy on fp32 logits
    optimizer: str = "adamw"  # train.optimizer: adamw | adamw_8bit | paged_adamw_8bit | adafactor
    checkpoint_every: int = 1  # model.checkpoint_every: with checkpointing, every N-th decoder layer recomputes
    offload: bool = False  # runtime.fsdp_offload: FSDP2 CPU offload of sharded weights, gradients and states
    activation_offload: bool = False  # model.activation_offload: the decoder body's saved tensors in host RAM
    qlora_upcast: bool = True  # lora.qlora_upcast: QLoRA's unquantized weights (and so the residual stream) in fp32
    tiled_mlp: bool = False  # model.tiled_mlp: the MLPs keep their input only, and run their forward twice
    sequence_parallel: int = 1  # runtime.sequence_parallel: each sequence over this many of the processes
    fused_loss: bool = False  # train.fused_loss: head and loss chunk by chunk, no logits of all trained positions
    # What anyfit's loop does under FSDP with accumulation > 1 (anyfit.training.step.backward_window): no
    # reduce-scatter before the last micro-batch, so FSDP2 keeps an unsharded fp32 gradient on each rank; off
    # with runtime.fsdp_reduce_every_micro_batch (a reduce-scatter per micro-batch, only shards persist).
    fsdp_unsharded_accumulation: bool = True
    train_vision: str = "frozen"  # model.train_vision: a composite's vision tower frozen | lora | full
    train_projector: bool = False  # model.train_projector: a composite's projector trained whole
    # The share of positions whose next token trains: the head and the loss run there only (logits_to_keep). Time
    # counts it (the data's mean); memory plans every position, since one micro-batch can be all answer.
    trained_share: float = 1.0

    def __post_init__(self):
        if self.offload and not self.fsdp:
            raise ValueError("Setup.offload is FSDP2's CPU offload: it needs fsdp=True")
        if self.checkpoint_every < 1:
            raise ValueError(f"checkpoint_every must be at least 1, got {self.checkpoint_every}")
        if self.sequence_parallel < 1 or self.processes % self.sequence_parallel:
            raise ValueError(f"sequence_parallel {self.sequence_parallel} does not divide {self.processes} processes")

    @property
    def local_tokens(self) -> int:
        """Tokens of one micro-batch on one process: its part of each sequence under sequence parallelism."""
        return -(-self.micro_batch * self.seq_len // self.sequence_parallel)

    @property
    def lora(self) -> bool:
        return self.method in ("lora", "qlora")

    @property
    def reduces_every_micro_batch(self) -> bool:
        """runtime.fsdp_reduce_every_micro_batch where it changes anything: sharded, with accumulation."""
        return self.fsdp and not self.fsdp_unsharded_accumulation and self.accumulation > 1

    @property
    def shards(self) -> int:
        """How many ways weights, gradients and optimizer states are split."""
        return self.processes if self.fsdp else 1

    @property
    def mixed_fsdp(self) -> bool:
        """FSDP2 mixed precision: weights stored in ``weight_bytes``, gathered and computed in the compute dtype."""
        return self.fsdp and BYTES[self.precision] < self.weight_bytes

    @property
    def compute_weight_bytes(self) -> int:
        """Bytes per weight as the forward pass sees it (FSDP2 casts the gathered weights; autocast does not)."""
        return BYTES[self.precision] if self.mixed_fsdp else self.weight_bytes

    def checkpointed_layers(self, num_layers: int) -> int:
        """Layers whose activations are recomputed: those with index % checkpoint_every == 0
        (anyfit.model.savers.enable_checkpointing)."""
        if not self.gradient_checkpointing:
            return 0
        return len(range(0, num_layers, self.checkpoint_every))



@dataclass(frozen=True)
class Workload:
    """The data a plan's time and epoch estimates are for. Memory plans the longest sequence (``Setup.seq_len``,
    data.max_length), since one micro-batch can hold it; time plans the mean."""
    tokens_per_sequence: float  # the mean length: what a step computes on
    trained_share: float = 1.0  # of the positions, those whose next token trains: where the head and loss run
    examples: int | None = None  # per epoch, for the steps per epoch (None: unknown)

    def __post_init__(self):
        if not 0 < self.trained_share <= 1:
            raise ValueError(f"Workload.trained_share is a share of the positions in (0, 1], got {self.trained_share}")

    @classmethod
    def of(cls, cfg: Config, mean_tokens: float | None = None, trained_share: float = 1.0,
           examples: int | None = None) -> Workload:
        """The workload a config describes where the data is not measured: sequences of data.max_length tokens,
        data.num_samples examples."""
        return cls(mean_tokens or cfg.data.max_length, trained_share,
                   examples if examples is not None else cfg.data.num_samples)

def setup_for(cfg: Config, *, method: str, device: str, precision: str, micro_batch: int, processes: int = 1,
              overrides: Mapping[str, Any] | None = None) -> Setup:
    """``cfg`` run as ``method`` (full | lora | qlora) on ``device`` in ``precision``, at ``micro_batch`` per
    process over ``processes``: the one place config keys become the planner's ``Setup``.

    ``overrides`` (config key -> value) replace the config's memory savers, as a saver-ladder option applies them
    (``anyfit.planning.savers``: model.gradient_checkpointing, model.checkpoint_every, model.activation_offload,
    model.tiled_mlp, train.fused_loss, train.optimizer, runtime.sharding, runtime.fsdp_offload,
    runtime.fsdp_reduce_every_micro_batch, runtime.sequence_parallel). Sharded means ``runtime.sharding`` is
    ``fsdp`` (the config's ``auto`` or ``deepspeed`` are the ladder's to resolve: unsharded here); the configured
    sequence-parallel degree applies where it divides the processes ("auto" is the ladder's to choose). Under
    sequence parallelism the processes form groups that each draw one data-parallel share of the batch. Weights are
    sized as model loading loads them (the runtime policy's ``weight_dtype``); the accumulation keeps the effective
    batch."""
    overrides = overrides or {}

    def value(key: str) -> Any:
        return overrides[key] if key in overrides else cfg.value(key)

    checkpointing = value("model.gradient_checkpointing")
    sharded = value("runtime.sharding") == "fsdp"
    sequence_parallel = value("runtime.sequence_parallel")
    if "runtime.sequence_parallel" not in overrides:
        divides = isinstance(sequence_parallel, int) and processes % sequence_parallel == 0
        sequence_parallel = sequence_parallel if divides else 1
    per_process = cfg.train.effective_batch // (processes // sequence_parallel)
    return Setup(method=method, device=device, precision=precision,
                 weight_bytes=weight_dtype(cfg.model.dtype, method != "full", device, precision).itemsize,
                 micro_batch=micro_batch, seq_len=cfg.data.max_length, gradient_checkpointing=checkpointing,
                 checkpoint_every=value("model.checkpoint_every") if checkpointing else 1,
                 accumulation=max(1, per_process // micro_batch), processes=processes, fsdp=sharded,
                 offload=sharded and value("runtime.fsdp_offload"), optimizer=value("train.optimizer"),
                 lora_r=cfg.lora.r, lora_targets=cfg.lora.target_modules, lora_experts=cfg.lora.experts,
                 lora_split_experts=cfg.lora.split_experts,
                 lora_dropout=cfg.lora.dropout, fused_optimizer=cfg.runtime.fused_optimizer,
                 padding=not cfg.train.packing, loss_chunk_tokens=cfg.train.loss_chunk_tokens,
                 fsdp_unsharded_accumulation=not value("runtime.fsdp_reduce_every_micro_batch"),
                 activation_offload=value("model.activation_offload"), qlora_upcast=cfg.lora.qlora_upcast,
                 tiled_mlp=value("model.tiled_mlp"), sequence_parallel=sequence_parallel,
                 fused_loss=value("train.fused_loss"), train_vision=cfg.model.train_vision,
                 train_projector=cfg.model.train_projector)

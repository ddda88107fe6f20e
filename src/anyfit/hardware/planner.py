"""Memory and time planning: will this config fit on that machine, with which batch split, and how fast?

Everything is computed from the model's *config* (no weights are read) and the run config:

1. ``anyfit.model.shape.model_shape``: the architecture's sizes and exact parameter count (a closed formula
   for the Llama family and GPT-2; other architectures are counted on PyTorch's meta device).
2. ``estimate_memory``: the peak bytes per device (per rank) of one training step, as the sum of what is
   alive at the peak: weights, gradients, optimizer states, saved activations, the logits and their
   gradient, transient copies, and a fixed runtime overhead; plus the host RAM the run needs besides. The
   activation term counts the tensors autograd saves in a Hugging Face decoder layer (see
   ``activation_bytes``); it was checked tensor by tensor against ``torch.autograd.graph.saved_tensors_hooks``
   (tests/unit/test_planner.py) and end to end against the peak RSS of real CPU runs
   (benchmarks/PLAN_VS_MEASURED.md). The memory savers are modelled one by one:
   - gradient checkpointing, on every layer or every N-th (``model.checkpoint_every``): the checkpointed
     layers keep only their input, the others everything; one layer is recomputed at a time;
   - optimizer states (``train.optimizer``): AdamW 2 states in the parameter dtype; bitsandbytes' 8-bit
     AdamW 1 byte per state plus an fp32 absmax per 256-element block (vectors under 4,096 elements keep fp32
     states); torch's Adafactor a factored second moment (rows + columns per matrix) and no first moment;
   - FSDP2 full sharding (``runtime.sharding``): weights, gradients and states divided by the processes; one
     decoder layer gathered unsharded at a time plus the prefetched next, the root unit (embeddings, head)
     gathered for the whole step, the layer's unsharded gradients and fp32 reduce-scatter buffer in flight;
     under bf16 the gathered copies are bf16 (FSDP2's MixedPrecisionPolicy replaces autocast, so there are
     no autocast weight copies and the residual stream is bf16); while accumulating, anyfit's loop skips the
     reduce-scatter (``set_requires_gradient_sync(False)``), so each rank holds a full unsharded fp32 gradient
     until the last micro-batch;
   - CPU offload (``runtime.fsdp_offload``, FSDP2's CPUOffloadPolicy): sharded fp32 weights, gradients and
     optimizer states live in host RAM and the optimizer step runs on the CPU; the device holds the gathered
     layers, activations and gradients in flight. The host RAM this needs is reported and checked.
3. ``plan_target``: for one machine, the largest micro-batch that fits under a safety margin (the rule of
   ``micro_batch=auto``), the accumulation that keeps the configured effective batch, and, when the run as
   configured does not fit, the cheapest combination of savers that does (see ``plan_target`` for the
   ladder and its order), then LoRA, QLoRA, more GPUs. ``recommend_sharding`` answers
   ``runtime.sharding=auto`` for the training loop with the same estimates.
4. ``step_time``: training FLOPs per token (6N for full fine-tuning, 4N with a frozen base, plus attention
   and checkpointing's recomputation) over the device's dense peak times a model-FLOPs utilisation, the
   bandwidth-bound optimizer update, and the communication that compute cannot hide: the gradient
   all-reduce of data parallel, FSDP's all-gathers and reduce-scatter, and CPU offload's host<->device copies,
   at the target's interconnect bandwidth (NVLink, PCIe). With a price per hour, the cost per 100 steps and
   per epoch follow.

The estimates describe anyfit's own loop and policies: fp32 master weights with bf16/fp16 autocast for
full fine-tuning (FSDP2 mixed precision when sharded), a frozen base in the compute dtype for LoRA on CUDA
(fp32 on CPU/MPS), fp32 adapters (PEFT upcasts them), token-sum loss (chunked fp32 cross-entropy by
default), the configured optimizer (fused AdamW by default, on every device); every process reads the whole
model into host RAM before moving or sharding it.
"""

from __future__ import annotations

import dataclasses
import os
from dataclasses import dataclass
from typing import Any

from anyfit.config import Config, ConfigError
from anyfit.data.batching import choose_micro_batch
from anyfit.hardware.runtime import weight_dtype
from anyfit.model.shape import ModelShape, Projection, kv_cache_bytes, model_shape
from anyfit.hardware.presets import GIB, PCIE4_GBS, PRESETS, PRICE_NOTE, Target, default_targets

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
EIGHT_BIT = ("adamw_8bit", "paged_adamw_8bit")
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
# Python process itself (interpreter, torch, transformers, the tokenizer, the data). The CPU figure comes
# from benchmarks/plan_vs_measured.py: ~0.75 GiB RSS before the model is loaded, ~0.25 GiB more once a step
# has run (library code paged in), and ~0.25 GiB of glibc heap slack (freed activations the allocator keeps:
# 0.15 GiB measured for full fine-tuning, 0.45-0.5 GiB for LoRA, about constant in the batch size).
RUNTIME_OVERHEAD_GIB = {"cuda": 0.5, "mps": 1.0, "cpu": 1.25}

# Share of the target's memory the plan may use: the rest absorbs allocator fragmentation and estimate error.
# The same share bounds the host RAM of CPU offload and model loading.
SAFETY = 0.9

# The pieces of a LoRA target's input that PEFT keeps per adapter, by where dropout runs: the fused CUDA/MPS
# dropout saves a 1-byte mask; the CPU one multiplies by a noise tensor of the input's dtype (fp32 in PEFT).
_DROPOUT_MASK_BYTES = {"cuda": 1, "mps": 1, "cpu": 4}


# ----------------------------------------------------------------------------------------------------
# 2. Memory of one training step
# ----------------------------------------------------------------------------------------------------


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
    lora_dropout: float = 0.05
    padding: bool = True  # micro-batches padded to their longest (the attention then takes a mask)
    fused_optimizer: bool = True
    loss_chunk_tokens: int = 0  # train.loss_chunk_tokens: 0 is torch's cross-entropy on fp32 logits
    optimizer: str = "adamw"  # train.optimizer: adamw | adamw_8bit | paged_adamw_8bit | adafactor
    checkpoint_every: int = 1  # model.checkpoint_every: with checkpointing, every N-th decoder layer recomputes
    offload: bool = False  # runtime.fsdp_offload: FSDP2 CPU offload of sharded weights, gradients and states
    # What anyfit's loop does under FSDP with accumulation > 1 (anyfit.training.sharding.gradient_sync): no
    # reduce-scatter before the last micro-batch, so FSDP2 keeps an unsharded fp32 gradient on each rank.
    fsdp_unsharded_accumulation: bool = True

    def __post_init__(self):
        if self.offload and not self.fsdp:
            raise ValueError("Setup.offload is FSDP2's CPU offload: it needs fsdp=True")
        if self.checkpoint_every < 1:
            raise ValueError(f"checkpoint_every must be at least 1, got {self.checkpoint_every}")

    @property
    def lora(self) -> bool:
        return self.method in ("lora", "qlora")

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
        (anyfit.model.loading.enable_checkpointing)."""
        if not self.gradient_checkpointing:
            return 0
        return len(range(0, num_layers, self.checkpoint_every))

    def savers(self) -> list[str]:
        """The memory savers this setup uses, in words."""
        out = []
        if self.offload:
            out.append(f"CPU offload (FSDP over {self.processes})")
        elif self.fsdp:
            out.append(f"sharding over {self.processes}")
        if self.optimizer != "adamw":
            out.append(OPTIMIZER_NAMES[self.optimizer])
        if self.gradient_checkpointing:
            out.append("checkpointing every layer" if self.checkpoint_every == 1
                       else f"checkpointing every {self.checkpoint_every} layers")
        return out

    def describe(self) -> str:
        what = {"full": "full fine-tuning", "lora": f"LoRA r={self.lora_r}", "qlora": f"QLoRA r={self.lora_r}"}
        parts = [what[self.method], self.precision, f"micro {self.micro_batch} x accum {self.accumulation} x procs "
                 f"{self.processes}", f"seq {self.seq_len}", OPTIMIZER_NAMES[self.optimizer]]
        if self.gradient_checkpointing:
            parts.append("gradient checkpointing" + ("" if self.checkpoint_every == 1
                                                     else f" every {self.checkpoint_every} layers"))
        if self.fsdp:
            parts.append(f"FSDP over {self.processes}" + (" with CPU offload" if self.offload else ""))
        return ", ".join(parts)


@dataclass(frozen=True)
class MemoryEstimate:
    """Bytes per device (per rank) at the peak of a training step; the device fields sum to ``peak``.
    ``host`` is the host RAM of the whole machine the run needs besides (not part of ``peak``)."""

    weights: int
    gradients: int  # the gradients alive at the peak moment
    optimizer: int
    activations: int
    logits: int
    transient: int  # autocast weight copies, DDP buckets, FSDP gathers, the optimizer step's temporaries
    overhead: int
    phase: str  # when the peak happens: "forward/backward" or "optimizer step"
    eval_kv_cache: int = 0  # KV cache of evaluation generation (not part of the training peak)
    trainable_params: int = 0
    notes: tuple[str, ...] = ()
    host: int = 0  # host RAM on the machine: every process's copy of the model at load, or CPU-offloaded state

    @property
    def peak(self) -> int:
        return (self.weights + self.gradients + self.optimizer + self.activations + self.logits + self.transient
                + self.overhead)

    def as_dict(self) -> dict[str, Any]:
        fields = ("weights", "gradients", "optimizer", "activations", "logits", "transient", "overhead")
        out: dict[str, Any] = {f"{k}_gib": round(getattr(self, k) / GIB, 3) for k in fields}
        out.update(peak_gib=round(self.peak / GIB, 3), phase=self.phase, per="device (rank)",
                   host_gib=round(self.host / GIB, 3), eval_kv_cache_gib=round(self.eval_kv_cache / GIB, 3),
                   trainable_params=self.trainable_params, notes=list(self.notes))
        return out


@dataclass(frozen=True)
class Activations:
    """Saved-activation bytes per token: per decoder layer, after the last layer, and per checkpointed layer."""

    per_layer: float
    head: float
    checkpoint_input: float


def activation_bytes(shape: ModelShape, setup: Setup) -> Activations:
    """Bytes autograd keeps per token for the backward pass, tensor by tensor.

    A Korthikanti et al. ("Reducing Activation Recomputation in Large Transformer Models", 2022) count
    adapted to what Hugging Face decoders and PyTorch actually save:

    - no s^2 attention-probability term: SDPA (flash / memory-efficient kernels) saves q, k, v, the output
      and a log-sum-exp per head. With a padding mask, k and v are first repeated to all heads (GQA is only
      passed natively to SDPA without a mask) and the boolean mask is converted to the compute dtype in
      every layer: ``a x seq`` bytes per token per layer.
    - RMSNorm computes in fp32: it keeps an fp32 copy of its input; its output is kept only when the norm
      weight trains.
    - SwiGLU keeps the gate output, SiLU output and up output, plus the product as the down projection's
      input.
    - under autocast each linear casts its input separately (autocast caches casts of weights only), so a
      normalised hidden state read by q, k and v is kept three times in bf16.
    - a frozen linear keeps no input; a LoRA adapter keeps its dropout output (or mask/noise) and the
      rank-r intermediate.

    With gradient checkpointing a checkpointed layer keeps only its input (``checkpoint_input``), and one
    layer is recomputed at a time during the backward pass.
    """
    a = BYTES[setup.precision]  # compute dtype
    # The residual stream has the embedding's dtype: the weight dtype, except QLoRA (PEFT upcasts
    # non-quantized weights to fp32) and FSDP2 mixed precision (the gathered embedding is already in the
    # compute dtype). Adding a bf16 branch to an fp32 residual stays fp32.
    rs = 4 if setup.method == "qlora" else setup.compute_weight_bytes
    casts = a < rs  # autocast casts each linear's input
    h, inter, q = shape.hidden_size, shape.intermediate_size, shape.q_dim
    repeat_kv = setup.padding and setup.device != "mps"  # torch >= 2.13 MPS takes GQA with a mask
    kv = q if repeat_kv else shape.kv_dim
    full = setup.method == "full"

    norm = 4 * h + 4 + (rs * h if full else 0)  # fp32 input copy + rsqrt (+ normalised input for the weight grad)
    attention = a * (2 * q + 2 * kv) + 4 * shape.num_heads + (a * setup.seq_len if setup.padding else 0)
    mlp = (3 if shape.gated_mlp else 1) * a * inter

    # Inputs of the linear layers, grouped by the tensor they read (``count / layers`` modules per layer).
    # The attention output is SDPA's own output, already counted: SDPA lays it out as (batch, seq, heads,
    # dim), so the reshape before o_proj copies nothing.
    groups: dict[str, list[Projection]] = {}
    for p in shape.projections:
        groups.setdefault(p.group, []).append(p)
    layers = max(1, shape.num_layers)
    inputs = 0.0
    if full:
        for group, projs in groups.items():
            d = projs[0].d_in
            if group in ("attn_in", "mlp_in"):
                # The norm's output: kept once for all its readers, or one cast copy per reader under autocast.
                inputs += sum(p.count for p in projs) / layers * a * d if casts else rs * d
            elif group == "mlp_mid":
                inputs += a * d  # the MLP's inner activation, read by the down projection
            elif group == "other":  # a layout without a formula: every module's input counted
                inputs += a * sum(p.count * p.d_in for p in projs) / layers
    else:
        targets = set(shape.lora_targets(setup.lora_targets))
        separate = a < 4  # PEFT casts the input to the fp32 adapter, autocast back to `a`: one copy per adapter
        mask = _DROPOUT_MASK_BYTES.get(setup.device, 1)
        for group, projs in groups.items():
            hit = [p for p in projs if p.name in targets]
            if not hit:
                continue
            readers = sum(p.count for p in hit) / layers
            d = hit[0].d_in
            if setup.lora_dropout > 0:
                inputs += readers * (mask + a) * d  # dropout mask (or noise) + dropout output, per adapter
            elif separate or group == "other":
                inputs += readers * a * d
            elif group != "attn_out":  # fp32 without dropout: the adapters keep the very tensor the base reads
                inputs += a * d
            inputs += readers * a * setup.lora_r  # lora_A's output, kept by lora_B
    per_layer = 2 * norm + attention + mlp + inputs

    head = 4 * h + 4  # final norm's fp32 input copy
    if full:  # normalised input for the norm weight, and the head's input (cast under autocast)
        head += rs * h + (a if casts else rs) * h
    return Activations(per_layer=per_layer, head=head, checkpoint_input=rs * h)


def logits_bytes(shape: ModelShape, tokens: int, logit_bytes: int = 4, chunk: int = 0) -> int:
    """Peak bytes of the logits and the loss over ``tokens`` trained positions.

    ``chunk`` = 0 (train.loss_chunk_tokens=0, torch's cross-entropy on upcast logits): 12 bytes per logit.
    In the backward pass three fp32 (n, V) tensors are alive at once: the saved log-softmax, the NLL
    gradient and the log-softmax gradient. With a 152k vocabulary that is 1.8 MB per token.

    ``chunk`` > 0 (anyfit's chunked cross-entropy, the default): the logits (kept for backward) and their
    gradient in the logits' own dtype. fp32 logits need nothing more (backward writes softmax - one-hot
    straight into the gradient); half-precision ones add one fp32 chunk of rows: the upcast copy and the
    softmax. Measured on CPU (benchmarks/PLAN_VS_MEASURED.md): 8 bytes per fp32 logit.
    """
    if chunk <= 0:
        return 12 * tokens * shape.vocab_size
    transient = 0 if logit_bytes == 4 else 8 * min(tokens, chunk) * shape.vocab_size
    return 2 * logit_bytes * tokens * shape.vocab_size + transient



def _trainable_tensors(shape: ModelShape, setup: Setup) -> tuple[list[tuple[int, int, int]], int]:
    """The trainable matrices as (rows, cols, count), and the elements of trainable 1-D tensors."""
    if setup.lora:
        targets = set(shape.lora_targets(setup.lora_targets))
        r = setup.lora_r
        mats = [m for p in shape.projections if p.name in targets for m in ((r, p.d_in, p.count), (p.d_out, r, p.count))]
        return mats, 0
    h = shape.hidden_size
    mats = [(p.d_out, p.d_in, p.count) for p in shape.projections] + [(shape.vocab_size, h, 1)]
    if shape.embedding_params > shape.vocab_size * h:  # learned positions (GPT-2)
        mats.append(((shape.embedding_params - shape.vocab_size * h) // h, h, 1))
    if shape.head_params:
        mats.append((shape.head_params // h, h, 1))
    return mats, max(0, shape.params - sum(r * c * n for r, c, n in mats))


def optimizer_state_bytes(shape: ModelShape, setup: Setup) -> int:
    """Optimizer-state bytes per rank (``train.optimizer``, divided over the shards under FSDP).

    - AdamW: two states (exp_avg, exp_avg_sq) in the parameter dtype: 8 bytes per fp32 parameter.
    - 8-bit AdamW (bitsandbytes): 1 byte per state + an fp32 absmax per 256 elements per state
      (``EIGHT_BIT_STATE_BYTES`` = 2.03 bytes per parameter); 1-D tensors keep fp32 states.
    - Adafactor (torch.optim.Adafactor with its defaults, read in torch/optim/_adafactor.py): no first moment;
      a matrix keeps a row factor (rows x 1) and a column factor (1 x cols) of its second moment, a vector a
      full second moment, all in the gradient's dtype. FSDP2 shards dim 0, so a rank's row factor covers its
      rows and the column factor spans all columns.
    """
    shard = setup.shards
    trainable = shape.lora_params(setup.lora_r, setup.lora_targets) if setup.lora else shape.params
    grad_bytes = 4 if setup.lora else setup.weight_bytes
    if setup.optimizer == "adamw":
        return int(2 * trainable * grad_bytes / shard)
    mats, vectors = _trainable_tensors(shape, setup)
    if setup.optimizer in EIGHT_BIT:
        return int(((trainable - vectors) * EIGHT_BIT_STATE_BYTES + vectors * 8) / shard)
    if setup.optimizer == "adafactor":
        factored = sum(n * (r / shard + c) for r, c, n in mats)
        return int((factored + vectors / shard) * grad_bytes)
    raise ValueError(f"unknown optimizer {setup.optimizer!r}")


def estimate_memory(shape: ModelShape, setup: Setup, overhead_gib: float | None = None,
                    eval_tokens: int | None = None) -> MemoryEstimate:
    """Peak memory per device (per rank) of one training step (see the module docstring for the policy assumed).

    The peak is the larger of two moments:
    - forward/backward: weights + optimizer states + activations + logits and loss (+ the gradients of the
      earlier micro-batches of the step, none with a single micro-batch) + autocast's weight copies or
      FSDP's gathered layers and gradients in flight;
    - the optimizer step: weights + optimizer states + all gradients + the step's temporaries
      (foreach AdamW allocates one fp32 copy of the trainable parameters, fused AdamW none, Adafactor a
      full-size variance estimate of one tensor at a time). Under CPU offload the step runs on the host.
    """
    notes: list[str] = []
    n = setup.processes
    shard = setup.shards
    a = BYTES[setup.precision]
    layers = max(1, shape.num_layers)

    # --- weights and what trains ---
    if setup.method == "qlora":
        quantized = shape.body_linear_params
        loaded = quantized * NF4_BYTES_PER_PARAM + (shape.params - quantized) * 4  # PEFT upcasts the rest to fp32
        notes.append("QLoRA: body linears in NF4 (0.52 B/param with constants); embeddings, head and norms "
                     "upcast to fp32 by PEFT's prepare_model_for_kbit_training")
    else:
        loaded = shape.params * setup.weight_bytes
    if setup.lora:
        trainable = shape.lora_params(setup.lora_r, setup.lora_targets)
        loaded += trainable * 4  # PEFT keeps adapters in fp32
        grad_bytes = 4
        head_trains = False  # the head is frozen: no weight gradient
    else:
        trainable = shape.params
        grad_bytes = setup.weight_bytes  # gradients and AdamW states take the parameter dtype
        head_trains = True
    weights = int(loaded / shard)
    gradients = trainable * grad_bytes // shard
    optimizer = optimizer_state_bytes(shape, setup)
    if setup.optimizer in EIGHT_BIT:
        notes.append(f"{OPTIMIZER_NAMES[setup.optimizer]} (bitsandbytes, CUDA): both moments in 1 byte + an fp32 "
                     f"absmax per {BNB_BLOCK} values, {EIGHT_BIT_STATE_BYTES:.2f} B/param instead of 8")
    elif setup.optimizer == "adafactor":
        notes.append("Adafactor (torch): no first moment, second moment factored into rows + columns per matrix")

    # --- activations and logits of one micro-batch ---
    tokens = setup.micro_batch * setup.seq_len
    act = activation_bytes(shape, setup)
    # The loss and the output head: 12 bytes per logit while the loss's backward runs; right after, the
    # head's weight gradient (a new V x h tensor, accumulated into .grad) next to the logits' gradient.
    logit_bytes = 4 if setup.loss_chunk_tokens <= 0 else a  # the head's output dtype (autocast: a)
    head_grad = shape.vocab_size * shape.hidden_size * grad_bytes if head_trains else 0
    if setup.fsdp:  # the head's gradient is an unsharded root-unit gradient: counted with FSDP's transients
        logits = logits_bytes(shape, tokens, logit_bytes, setup.loss_chunk_tokens)
    else:
        logits = max(logits_bytes(shape, tokens, logit_bytes, setup.loss_chunk_tokens),
                     tokens * shape.vocab_size * logit_bytes + head_grad)
    recomputed = setup.checkpointed_layers(shape.num_layers)
    if recomputed:
        # Checkpointed layers keep their input only, the others everything, and the head's tensors stay; the
        # backward pass recomputes one layer at a time, whose saved tensors plus their gradients (~ the same
        # again) come on top once the logits are gone.
        kept = tokens * (recomputed * act.checkpoint_input + (shape.num_layers - recomputed) * act.per_layer
                         + act.head)
        recompute = 2 * tokens * act.per_layer
        activations = int(kept + max(0, recompute - logits))
    else:
        activations = int(tokens * (shape.num_layers * act.per_layer + act.head))

    # --- transients at the forward/backward peak ---
    transient = 0
    if not setup.fsdp:
        if not setup.lora and a < setup.weight_bytes:
            transient += shape.matmul_params * a  # autocast's cached low-precision copy of every matmul weight
            notes.append(f"autocast keeps a {setup.precision} copy of each matmul weight until its backward")
        if setup.lora and a < 4:
            transient += trainable * a  # the same for the fp32 adapters
        if n > 1:
            transient += trainable * grad_bytes  # DDP gradient buckets (gradient_as_bucket_view off)
            notes.append("DDP: gradient buckets hold a second copy of the gradients")
    else:
        # FSDP2, one unit per decoder layer plus the root (embeddings, final norm, head): the layer being
        # computed and the prefetched next one are gathered unsharded; the root unit stays gathered from the
        # start of the forward to the end of the backward (fully_shard does not reshard the root after
        # forward); the layer's unsharded gradients and its fp32 reduce-scatter input coexist while it reduces
        # (one reduce-scatter buffer in flight: FSDP2's default); the root's unsharded head/embedding gradient
        # waits for the root's reduce-scatter at the end of the backward.
        cw = setup.compute_weight_bytes
        root = shape.params - layers * shape.layer_params
        adapters = trainable / layers if setup.lora else 0
        gathered = (2 * (shape.layer_params + adapters) + root) * cw
        grad_compute = a if setup.mixed_fsdp else grad_bytes
        in_flight = (adapters if setup.lora else shape.layer_params) * (grad_compute + 4)
        root_grad = shape.vocab_size * shape.hidden_size * grad_compute if head_trains else 0
        transient += int(gathered + in_flight + root_grad)
        notes.append(f"FSDP full shard over {n}: weights, gradients and optimizer states divided by {n}; one layer "
                     f"(plus the prefetched next and the embedding/head unit) gathered "
                     f"{'in ' + setup.precision + ' ' if setup.mixed_fsdp else ''}at a time")
    if setup.method == "qlora":
        largest = max(p.d_in * p.d_out for p in shape.projections)
        transient += 2 * largest * a  # a dequantized weight (and its transposed use in backward)
    if setup.device == "cpu":
        notes.append("CPU: the runtime overhead includes ~0.25 GiB of glibc heap slack; on Linux, "
                     "MALLOC_MMAP_THRESHOLD_=131072 makes freed activations go back to the OS")

    # --- the optimizer step's temporaries ---
    if setup.optimizer == "adamw":
        step_temp = 0 if setup.fused_optimizer else trainable * grad_bytes // shard
    elif setup.optimizer == "adafactor":  # the single-tensor path's full-size variance estimate, one tensor at a time
        step_temp = max(r * c for r, c, _ in _trainable_tensors(shape, setup)[0]) * grad_bytes // shard
    else:
        step_temp = 0  # bitsandbytes updates in place, block by block

    # --- gradients accumulated over the earlier micro-batches of the window ---
    accumulated = 0
    if setup.accumulation > 1:
        if setup.fsdp and setup.fsdp_unsharded_accumulation:
            accumulated = trainable * 4  # FSDP2 keeps unsharded gradients in the fp32 reduce dtype on the device
            notes.append(f"FSDP with accumulation: anyfit reduce-scatters only at the window's last micro-batch, so "
                         f"each rank holds an unsharded fp32 gradient ({accumulated / GIB:.1f} GiB) meanwhile")
        elif not setup.offload:
            accumulated = gradients

    # --- host RAM: each process reads the whole model before moving or sharding it; offloaded state ---
    host = 0 if setup.method == "qlora" else int(n * loaded)  # QLoRA loads straight onto the GPU
    if setup.offload:
        offloaded = n * (weights + gradients + optimizer + step_temp)
        host = max(host, offloaded)
        notes.append(f"CPU offload: sharded fp32 weights, gradients and optimizer states in host RAM "
                     f"({offloaded / GIB:.1f} GiB on the machine); the optimizer step runs on the CPU")
        weights = gradients = optimizer = step_temp = 0
    if setup.device in ("cpu", "mps"):
        host = 0  # the device memory is the host memory: already in the peak

    fwd_bwd = accumulated + activations + logits + transient
    step = gradients + step_temp
    overhead = int((RUNTIME_OVERHEAD_GIB[setup.device] if overhead_gib is None else overhead_gib) * GIB)
    kv = kv_cache_bytes(shape, eval_tokens or setup.seq_len, setup.micro_batch, a)
    common = dict(weights=weights, optimizer=optimizer, overhead=overhead, eval_kv_cache=kv,
                  trainable_params=trainable, notes=tuple(notes), host=host)
    if fwd_bwd >= step:
        return MemoryEstimate(gradients=accumulated, activations=activations, logits=logits, transient=transient,
                              phase="forward/backward", **common)
    return MemoryEstimate(gradients=gradients, activations=0, logits=0, transient=step_temp, phase="optimizer step",
                          **common)


# ----------------------------------------------------------------------------------------------------
# 3. Time
# ----------------------------------------------------------------------------------------------------


def flops_per_token(shape: ModelShape, setup: Setup) -> float:
    """Training FLOPs per token.

    Matmuls: 2N forward, 2N for the input gradients, 2N for the weight gradients (6N for full fine-tuning,
    N = body projection weights + the output head). A frozen base skips the weight gradients: 4N plus 6x the
    adapter parameters. Gradient checkpointing repeats the forward of the checkpointed layers (+2 N_body on
    every layer, +2 N_body / k with ``checkpoint_every`` = k).
    Attention (PaLM's count, no causal discount): 4 x layers x q_dim x seq forward, twice that backward,
    + the forward again on the checkpointed layers.
    """
    n_mm = shape.matmul_params
    mm = (4 * n_mm + 6 * shape.lora_params(setup.lora_r, setup.lora_targets)) if setup.lora else 6 * n_mm
    attn_fwd = 4 * shape.num_layers * shape.q_dim * setup.seq_len
    attention = 3 * attn_fwd
    recomputed = setup.checkpointed_layers(shape.num_layers)
    if recomputed:
        share = recomputed / max(1, shape.num_layers)
        mm += 2 * shape.body_linear_params * share
        attention += attn_fwd * share
    return mm + attention


@dataclass(frozen=True)
class StepTime:
    """Seconds of one optimizer step, by what they are spent on."""

    compute: float  # matmul FLOPs / (peak x MFU)
    optimizer: float  # the bandwidth-bound update (on the CPU under offload)
    communication: float  # collectives and offload copies that compute does not hide

    @property
    def total(self) -> float:
        return self.compute + self.optimizer + self.communication

    def as_dict(self) -> dict[str, float]:
        return {"compute_s": round(self.compute, 4), "optimizer_s": round(self.optimizer, 4),
                "communication_s": round(self.communication, 4), "total_s": round(self.total, 4)}


def communication_seconds(shape: ModelShape, setup: Setup, target: Target, micro_compute: float,
                          forward_share: float = 1 / 3) -> float:
    """Collective and host-copy time per optimizer step that the compute cannot hide.

    Ring collectives over N ranks move (N-1)/N of the data through each rank's link (2(N-1)/N for an
    all-reduce), at the target's ``interconnect_gbs`` per direction; CPU offload copies over
    ``host_link_gbs``. Overlap: a transfer issued during a pass is hidden up to that pass's compute
    (``micro_compute`` seconds per micro-batch, ``forward_share`` of it in the forward: 1/3 for full
    fine-tuning, 1/2 with a frozen base); what exceeds it is exposed, and so is the part that cannot overlap
    at all (DDP's last bucket, FSDP's first all-gather and last reduce-scatter). An optimistic model: NCCL
    kernels also take SMs and memory bandwidth from the compute they overlap.

    - DDP: one all-reduce of the gradients per step (anyfit skips it before the window's last micro-batch).
    - FSDP: every micro-batch all-gathers the weights in the forward (root unit included) and the layers
      again in the backward; the gradients are reduce-scattered in fp32 at the window's last micro-batch
      (every micro-batch when ``fsdp_unsharded_accumulation`` is off).
    - CPU offload: each gather first copies the rank's fp32 shard host-to-device, and the reduced gradient
      shard goes back device-to-host.
    """
    n = setup.processes
    if n == 1 and not setup.offload:
        return 0.0
    bw = (target.interconnect_gbs or PCIE4_GBS) * 1e9
    host_bw = target.host_link_gbs * 1e9
    fwd = micro_compute * forward_share
    bwd = micro_compute - fwd
    trainable = shape.lora_params(setup.lora_r, setup.lora_targets) if setup.lora else shape.params
    grad_bytes = 4 if setup.lora else setup.weight_bytes
    if not setup.fsdp:
        ring = 2 * (n - 1) / n
        allreduce = ring * trainable * grad_bytes / bw
        return max(0.0, allreduce - bwd) + ring * min(DDP_BUCKET_BYTES, trainable * grad_bytes) / bw
    frac = (n - 1) / n
    cw = setup.compute_weight_bytes
    layers = max(1, shape.num_layers)
    root = shape.params - layers * shape.layer_params
    layer_trainable = trainable / layers if setup.lora else shape.layer_params
    gather_fwd = frac * shape.params * cw / bw
    gather_bwd = frac * (shape.params - root) * cw / bw
    reduce = frac * trainable * 4 / bw
    first_gather = frac * shape.layer_params * cw / bw
    last_reduce = frac * layer_trainable * 4 / bw
    up_fwd = up_bwd = down = first_up = 0.0
    if setup.offload:  # the shards stay in their stored dtype on the host (fp32 master weights, a bf16 LoRA base)
        stored = shape.params * setup.weight_bytes + (trainable * 4 if setup.lora else 0)
        up_fwd = stored / n / host_bw
        up_bwd = stored * (shape.params - root) / shape.params / n / host_bw
        down = trainable * 4 / n / host_bw
        first_up = stored / layers * (1 - root / shape.params) / n / host_bw
    syncing = 1 if setup.fsdp_unsharded_accumulation else setup.accumulation
    forward = max(0.0, gather_fwd + up_fwd - fwd) + first_gather + first_up
    backward = max(0.0, gather_bwd + up_bwd - bwd)
    backward_sync = max(0.0, gather_bwd + up_bwd + reduce + down - bwd) + last_reduce
    return setup.accumulation * forward + (setup.accumulation - syncing) * backward + syncing * backward_sync


def step_time(shape: ModelShape, setup: Setup, target: Target, tokens_per_sequence: float) -> StepTime:
    """One optimizer step: FLOPs / (peak x MFU x devices), the bandwidth-bound optimizer update, and the
    exposed communication (``communication_seconds``)."""
    tokens = setup.micro_batch * setup.accumulation * setup.processes * tokens_per_sequence
    seq_setup = dataclasses.replace(setup, seq_len=max(1, round(tokens_per_sequence)))
    flops = flops_per_token(shape, seq_setup) * tokens
    compute = flops / (target.tflops(setup.precision) * 1e12 * target.efficiency * setup.processes)
    trainable = shape.lora_params(setup.lora_r, setup.lora_targets) if setup.lora else shape.params
    streamed = trainable * OPTIMIZER_STREAM_BYTES[setup.optimizer]
    if setup.offload:  # every rank's shard is updated by the same host's memory system
        optimizer = streamed / (CPU_OPTIMIZER_GBS * 1e9)
    else:
        optimizer = streamed / setup.shards / (target.bandwidth_gbs * 1e9)
    forward = 2 * shape.matmul_params + 4 * shape.num_layers * shape.q_dim * seq_setup.seq_len
    communication = communication_seconds(shape, setup, target, compute / max(1, setup.accumulation),
                                          forward / flops_per_token(shape, seq_setup))
    return StepTime(compute, optimizer, communication)


def step_seconds(shape: ModelShape, setup: Setup, target: Target, tokens_per_sequence: float) -> float:
    """Seconds per optimizer step (``step_time``'s total)."""
    return step_time(shape, setup, target, tokens_per_sequence).total


# ----------------------------------------------------------------------------------------------------
# 4. The plan for one target
# ----------------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class TargetPlan:
    """What the planner decided for one machine."""

    target: Target
    verdict: str
    setup: Setup | None  # the chosen way to run (None when nothing fits)
    memory: MemoryEstimate | None
    seconds_per_100_steps: float | None
    budget_bytes: int
    notes: tuple[str, ...] = ()
    alternatives: tuple[str, ...] = ()
    time: StepTime | None = None  # one optimizer step of the chosen setup
    steps_per_epoch: int | None = None  # None: the data size is unknown (--examples / data.num_samples)
    host_budget_bytes: int | None = None  # None: the target's host RAM is unknown (or is its device memory)

    @property
    def savers(self) -> list[str]:
        """The memory savers of the chosen setup (configured or added), in words."""
        return [] if self.setup is None else self.setup.savers()

    @property
    def price_per_hour(self) -> float | None:
        return self.target.price_per_hour

    @property
    def cost_per_100_steps(self) -> float | None:
        if self.price_per_hour is None or self.seconds_per_100_steps is None:
            return None
        return self.price_per_hour * self.seconds_per_100_steps / 3600

    @property
    def seconds_per_epoch(self) -> float | None:
        if self.steps_per_epoch is None or self.seconds_per_100_steps is None:
            return None
        return self.steps_per_epoch * self.seconds_per_100_steps / 100

    @property
    def cost_per_epoch(self) -> float | None:
        if self.price_per_hour is None or self.seconds_per_epoch is None:
            return None
        return self.price_per_hour * self.seconds_per_epoch / 3600

    def as_dict(self) -> dict[str, Any]:
        s = self.setup

        def r(x, nd=1):
            return None if x is None else round(x, nd)

        return {
            "target": self.target.key, "name": self.target.label(), "device": self.target.device,
            "devices": self.target.num_devices, "memory_gib_per_device": round(self.target.memory_gib, 2),
            "budget_gib": round(self.budget_bytes / GIB, 2),
            "host_memory_gib": self.target.host_memory_gib,
            "host_budget_gib": None if self.host_budget_bytes is None else round(self.host_budget_bytes / GIB, 2),
            "interconnect_gbs": self.target.interconnect_gbs, "verdict": self.verdict, "savers": self.savers,
            "setup": None if s is None else {
                "method": s.method, "precision": s.precision, "weight_bytes": s.weight_bytes,
                "micro_batch": s.micro_batch, "accumulation": s.accumulation, "processes": s.processes,
                "seq_len": s.seq_len, "gradient_checkpointing": s.gradient_checkpointing,
                "checkpoint_every": s.checkpoint_every if s.gradient_checkpointing else None,
                "optimizer": s.optimizer, "fsdp": s.fsdp, "fsdp_offload": s.offload,
                "config": _config_overrides(s)},
            "memory": None if self.memory is None else self.memory.as_dict(),
            "step_time": None if self.time is None else self.time.as_dict(),
            "seconds_per_100_steps": r(self.seconds_per_100_steps),
            "price_per_hour": self.price_per_hour, "cost_per_100_steps": r(self.cost_per_100_steps, 2),
            "steps_per_epoch": self.steps_per_epoch, "seconds_per_epoch": r(self.seconds_per_epoch),
            "cost_per_epoch": r(self.cost_per_epoch, 2),
            "notes": list(self.notes), "alternatives": list(self.alternatives),
        }


def _config_overrides(s: Setup) -> list[str]:
    """The config keys that select this setup (what to put in the YAML or on the command line)."""
    out = [f"lora.enabled={str(s.lora).lower()}"]
    if s.method == "qlora":
        out.append("lora.qlora=true")
    out.append(f"model.gradient_checkpointing={str(s.gradient_checkpointing).lower()}")
    if s.gradient_checkpointing:
        out.append(f"model.checkpoint_every={s.checkpoint_every}")
    out += [f"train.optimizer={s.optimizer}", f"runtime.sharding={'fsdp' if s.fsdp else 'none'}",
            f"runtime.fsdp_offload={str(s.offload).lower()}", f"train.micro_batch={s.micro_batch}"]
    return out


def _precision(cfg: Config, target: Target, qlora: bool) -> tuple[str, list[str]]:
    """The precision anyfit's runtime policy picks on the target (the configured one when it is allowed there)."""
    from anyfit.hardware.runtime import resolve_runtime

    rc = dataclasses.replace(cfg.runtime, device=target.device)
    try:
        return resolve_runtime(rc, target.hardware(), qlora=qlora).precision, []
    except ConfigError:
        policy = resolve_runtime(dataclasses.replace(rc, precision="auto"), target.hardware(), qlora=qlora)
        return policy.precision, [f"runtime.precision={cfg.runtime.precision} is not allowed on {target.device}; "
                                  f"planned with {policy.precision}"]


def _weight_bytes(cfg: Config, method: str, device: str, precision: str) -> int:
    """Bytes per base weight as model loading will load it (the runtime policy's ``weight_dtype``)."""
    return weight_dtype(cfg.model.dtype, method != "full", device, precision).itemsize


def _processes(effective: int, devices: int) -> int:
    """Use as many devices as split the effective batch evenly."""
    return max(p for p in range(1, devices + 1) if effective % p == 0)


def _sharding_blocker(cfg: Config, precision: str, device: str, method: str, optimizer: str) -> str:
    """Why this run cannot be sharded on this device ('' when it can): the training loop's own rule
    (``anyfit.training.sharding.decide_sharding`` with sharding forced on and this optimizer), plus what
    FSDP2 needs."""
    from anyfit.training.sharding import decide_sharding

    if device not in ("cuda", "cpu"):
        return f"FSDP2 needs a process group backend (NCCL on CUDA, gloo on CPU); {device} has none"
    if method == "qlora":
        return "QLoRA's 4-bit weights are not sharded by anyfit"
    forced = dataclasses.replace(cfg, runtime=dataclasses.replace(cfg.runtime, sharding="fsdp", fsdp_offload=False),
                                 train=dataclasses.replace(cfg.train, optimizer=optimizer))
    try:
        decide_sharding(forced, device=device, precision=precision, processes=2)
    except ConfigError as e:
        return str(e)
    return ""


@dataclass(frozen=True)
class _Option:
    """One combination of savers the ladder may try."""

    method: str  # full | lora | qlora
    ckpt: int  # 0: no checkpointing, else checkpoint_every
    optimizer: str
    sharding: str  # none | fsdp | offload
    processes: int
    tier: tuple[int, int]  # (method: 0 configured, 1 LoRA, 2 QLoRA; savers: 0 cheap, 1 CPU offload, 2 Adafactor)


# The saver ladder, cheapest first. What costs speed least, on the targets anyfit plans for:
# - 8-bit AdamW states: 6 of AdamW's 8 bytes per parameter gone for an update that streams fewer bytes; the
#   results match 32-bit AdamW (Dettmers et al. 2022, "8-bit Optimizers via Block-wise Quantization"). CUDA only.
# - checkpointing every 4th / 2nd layer: recomputes 1/4 / 1/2 of the forward, ~8% / ~17% of a step, and keeps
#   the activations of the other layers; every layer ~33% (the forward is about 1/3 of a full fine-tuning step,
#   1/2 with a frozen LoRA base, so there every layer costs ~50%).
# - FSDP sharding: free in memory terms (1/N of everything), costs the all-gathers and reduce-scatter the compute
#   cannot hide: little over NVLink, a lot over PCIe (8x L40S).
# - CPU offload: all weights cross PCIe twice per micro-batch and the optimizer runs on the CPU: the slowest.
# The first three keep the configured run's math (8-bit states almost) at a cost the time model can weigh, so
# they form the first tier, and among its combinations that fit the planner takes the shortest *estimated* step
# on this target: their costs are weighed with this machine's FLOPs, memory bandwidth and interconnect instead
# of a fixed order (on NVLink sharding usually beats dense checkpointing; on PCIe dense checkpointing can beat
# sharding). Equal estimates fall back to the order of _Planner.options (fewer and cheaper savers first).
# CPU offload keeps the math too but is a tier of its own, tried only when nothing in the first fits: its cost
# is the least certain part of the time model (the CPU optimizer's throughput is assumed, the copies are taken
# as perfectly overlapped), and in practice it is the slowest saver.
# Then Adafactor: no first moment and relative step sizes (the configured learning rate no longer means the
# same), so it changes the optimizer. Then LoRA (changes what trains), then QLoRA (also quantizes the base,
# CUDA), each again with the savers above in the same order. Last, more GPUs of this kind, sharded (offered as
# an alternative when the choice is slow or changes the run). Savers the config already names are kept:
# checkpointing may only get denser, a configured optimizer or sharding mode is not swapped (and costs no
# tier), and an explicit runtime.sharding=none is never overridden.
_CKPT_LEVELS = (4, 2, 1)


class _Planner:
    """The ladder's state for one target: the budget, the configured run, and a cache of fits."""

    def __init__(self, cfg: Config, shape: ModelShape, target: Target, safety: float, overhead_gib: float | None,
                 tokens_per_sequence: float, processes: int | None = None):
        self.cfg, self.shape, self.target = cfg, shape, target
        self.overhead_gib = overhead_gib
        self.tokens_per_sequence = tokens_per_sequence
        self.notes: list[str] = []
        self.effective = cfg.train.effective_batch
        self.seq = cfg.data.max_length
        self.cuda = target.device == "cuda"
        procs = processes if processes is not None else _processes(self.effective, target.num_devices)
        self.procs = procs
        # CPU processes share the host RAM: each may use its share.
        share = procs if target.device == "cpu" else 1
        self.budget = int(target.memory_gib * GIB * safety) // share
        self.host_budget = (int(target.host_memory_gib * GIB * safety)
                            if target.host_memory_gib is not None and self.cuda else None)
        self.host_short: dict[_Option, int] = {}
        self._fits: dict[_Option, tuple[Setup, MemoryEstimate] | None] = {}
        self._blockers: dict[tuple[str, str], str] = {}

        method = "qlora" if cfg.lora.qlora else ("lora" if cfg.lora.enabled else "full")
        if method == "qlora" and not self.cuda:
            self.notes.append("QLoRA needs CUDA (bitsandbytes); planned as LoRA here")
            method = "lora"
        self.method = method
        optimizer = cfg.train.optimizer
        if optimizer in EIGHT_BIT and not self.cuda:
            self.notes.append(f"train.optimizer={optimizer} needs CUDA (bitsandbytes); planned with adamw here")
            optimizer = "adamw"
        self.optimizer = optimizer
        self.ckpt = cfg.model.checkpoint_every if cfg.model.gradient_checkpointing else 0
        sharding = cfg.runtime.sharding
        if cfg.runtime.fsdp_offload and sharding != "none" and self.cuda:
            sharding = "offload"
        elif cfg.runtime.fsdp_offload:
            self.notes.append("runtime.fsdp_offload needs CUDA and sharding; planned without it")
        self.sharding_mode = sharding  # auto | none | fsdp | offload

    def precision(self, method: str) -> str:
        precision, notes = _precision(self.cfg, self.target, qlora=method == "qlora")
        for note in notes:
            if note not in self.notes:
                self.notes.append(note)
        return precision

    def blocker(self, method: str, optimizer: str | None = None) -> str:
        key = (method, optimizer or self.optimizer)
        if key not in self._blockers:
            self._blockers[key] = _sharding_blocker(self.cfg, self.precision(method), self.target.device, *key)
        return self._blockers[key]

    def configured(self, processes: int | None = None) -> _Option:
        """The run exactly as configured (runtime.sharding=auto starts unsharded: it shards only when that
        does not fit, which is what the ladder decides)."""
        sharding = {"auto": "none"}.get(self.sharding_mode, self.sharding_mode)
        if sharding != "none" and self.blocker(self.method):
            note = f"runtime.sharding={self.cfg.runtime.sharding} is refused for this run: {self.blocker(self.method)}"
            if note not in self.notes:
                self.notes.append(note)
            sharding = "none"
        return _Option(self.method, self.ckpt, self.optimizer, sharding, processes or self.procs, (0, 0))

    def options(self, method: str, rank: int, processes: int, shardings: tuple[str, ...] | None = None) -> list[_Option]:
        """The saver combinations for ``method`` (``rank``: 0 the configured method, 1 LoRA, 2 QLoRA), in ladder
        order (cheapest first where the estimates tie)."""
        if self.ckpt:  # configured checkpointing: only denser
            ckpts = [self.ckpt] + [k for k in _CKPT_LEVELS if k < self.ckpt]
        else:
            ckpts = [0, *_CKPT_LEVELS]
        seen, unique = set(), []
        for k in ckpts:  # every 4 and every 2 recompute the same layers of a 2-layer model
            layers = len(range(0, self.shape.num_layers, k)) if k else 0
            if layers not in seen:
                seen.add(layers)
                unique.append(k)
        if self.optimizer != "adamw" or method != "full":  # a configured optimizer is kept; LoRA states are tiny
            optimizers = [self.optimizer]
        else:
            optimizers = ["adamw"] + (["adamw_8bit"] if self.cuda else []) + ["adafactor"]
        if shardings is None:
            shardings = {"none": ("none",), "fsdp": ("fsdp",), "offload": ("offload",)}.get(
                self.sharding_mode, ("none",) + (("fsdp",) if processes > 1 else ()) + (("offload",) if self.cuda else ()))
        def saver_rank(sharding: str, optimizer: str) -> int:
            if optimizer == "adafactor" and self.optimizer != "adafactor":
                return 2
            return 1 if sharding == "offload" and self.sharding_mode != "offload" else 0

        def allowed(optimizer: str) -> list[str]:
            # What the loop would refuse is left out: sharding with fp16, generation eval or Adafactor (its
            # in-place row/column norms do not run on sharded weights), on MPS, or of QLoRA; and 8-bit states
            # with CPU offload (bitsandbytes' kernels need the states on the GPU).
            ok = [sh for sh in shardings if (sh == "none" or not self.blocker(method, optimizer))
                  and not (sh == "offload" and optimizer in EIGHT_BIT)]
            return ok or ["none"]  # a configured sharding the loop would refuse: planned unsharded (and noted)

        return [_Option(method, k, opt, sh, processes, (rank, saver_rank(sh, opt)))
                for opt in optimizers for sh in allowed(opt) for k in unique]

    def fit(self, option: _Option) -> tuple[Setup, MemoryEstimate] | None:
        """The largest micro-batch that fits ``option`` (the rule micro_batch=auto follows, with estimated
        instead of measured peaks), or None; a plan over the host RAM does not fit either."""
        if option in self._fits:
            return self._fits[option]
        cfg, method = self.cfg, option.method
        precision = self.precision(method)
        wb = _weight_bytes(cfg, method, self.target.device, precision)
        per_process = self.effective // option.processes
        fsdp = option.sharding != "none"

        def setup(micro: int) -> Setup:
            return Setup(method=method, device=self.target.device, precision=precision, weight_bytes=wb,
                         micro_batch=micro, seq_len=self.seq, gradient_checkpointing=option.ckpt > 0,
                         checkpoint_every=option.ckpt or 1, accumulation=per_process // micro,
                         processes=option.processes, fsdp=fsdp, offload=option.sharding == "offload",
                         optimizer=option.optimizer, lora_r=cfg.lora.r, lora_targets=cfg.lora.target_modules,
                         lora_dropout=cfg.lora.dropout, fused_optimizer=cfg.runtime.fused_optimizer,
                         padding=not cfg.train.packing, loss_chunk_tokens=cfg.train.loss_chunk_tokens)

        micro = choose_micro_batch(
            per_process, lambda m: estimate_memory(self.shape, setup(m), overhead_gib=self.overhead_gib).peak,
            self.budget)
        found = None
        if micro is not None:
            mem = estimate_memory(self.shape, setup(micro), overhead_gib=self.overhead_gib)
            # A node with more GPUs of this kind (the "more GPUs" alternative) has proportionally more host RAM.
            host_budget = None if self.host_budget is None else \
                self.host_budget * max(1.0, option.processes / self.target.num_devices)
            if host_budget is not None and mem.host > host_budget:
                self.host_short[option] = mem.host
            else:
                found = (setup(micro), mem)
        self._fits[option] = found
        return found

    def seconds(self, setup: Setup) -> float:
        return step_seconds(self.shape, setup, self.target, self.tokens_per_sequence)

    def best(self, options: list[_Option]) -> tuple[_Option, Setup, MemoryEstimate] | None:
        """The fitting option of the lowest tier with the shortest estimated step (ties: the earlier option)."""
        scored = []
        for i, option in enumerate(options):
            found = self.fit(option)
            if found:
                scored.append(((option.tier, self.seconds(found[0]), i), option, *found))
        if not scored:
            return None
        _, option, setup, mem = min(scored, key=lambda x: x[0])
        return option, setup, mem


_CHEAP = ("8-bit AdamW", "paged 8-bit AdamW", "checkpointing")


def _verdict(setup: Setup, configured: _Option) -> str:
    """'fits', 'fits with <cheap savers>' (checkpointing, 8-bit states) or 'needs <the biggest change>[ with
    <the other savers>]', naming what differs from the config."""
    added = []
    method = {"lora": "LoRA", "qlora": "QLoRA"}.get(setup.method) if setup.method != configured.method else None
    if method:
        added.append(method)
    if setup.optimizer == "adafactor" and configured.optimizer != "adafactor":
        added.append("Adafactor")
    want = "offload" if setup.offload else ("fsdp" if setup.fsdp else "none")
    if want != configured.sharding or setup.processes != configured.processes:
        if setup.offload:
            added.append(f"CPU offload (FSDP over {setup.processes} GPU{'s' if setup.processes > 1 else ''})")
        elif setup.fsdp:
            added.append(f"sharding over {setup.processes} GPUs")
    if setup.optimizer in EIGHT_BIT and configured.optimizer not in EIGHT_BIT:
        added.append(OPTIMIZER_NAMES[setup.optimizer])
    ckpt = setup.checkpoint_every if setup.gradient_checkpointing else 0
    if ckpt != configured.ckpt:
        added.append("gradient checkpointing" if ckpt == 1 else f"checkpointing every {ckpt} layers")
    if not added:
        return "fits"
    if all(a.startswith(_CHEAP) or a == "gradient checkpointing" for a in added):
        return "fits with " + " + ".join(added)
    first, rest = added[0], added[1:]
    return f"needs {first}" + (" with " + " + ".join(rest) if rest else "")


def plan_target(cfg: Config, shape: ModelShape, target: Target, mean_tokens: float | None = None,
                safety: float = SAFETY, overhead_gib: float | None = None,
                examples: int | None = None) -> TargetPlan:
    """Find how the configured run fits on ``target``, with the cheapest memory savers that make it fit.

    First the run as configured; then the cheap savers (8-bit AdamW states, checkpointing every 4th / 2nd /
    every layer, FSDP over the target's GPUs, and their combinations: the one with the shortest estimated step
    wins); then CPU offload; then Adafactor; then LoRA, then QLoRA (each with the savers that help them); then
    a full shard over more GPUs of this kind; else a bigger GPU. The order and why: the comment above
    ``_Planner``.
    At each option the micro-batch is chosen as ``micro_batch=auto`` chooses it (the largest divisor of the
    per-process share of the effective batch that fits), here under ``safety`` x the target's memory;
    accumulation keeps the effective batch. ``examples`` (or data.num_samples) gives the steps per epoch.
    """
    tokens_per_sequence = mean_tokens or cfg.data.max_length
    p = _Planner(cfg, shape, target, safety, overhead_gib, tokens_per_sequence)
    procs, effective, cuda = p.procs, p.effective, p.cuda
    if procs < target.num_devices:
        p.notes.append(f"train.effective_batch={effective} does not split over {target.num_devices} GPUs; "
                       f"planned on {procs}")
    configured = p.configured()
    chosen = None
    if p.fit(configured):
        chosen = (configured, *p.fit(configured))
    else:
        options = p.options(p.method, 0, procs)
        if p.method == "full":
            options += p.options("lora", 1, procs)
        if cuda and p.method != "qlora":
            options += p.options("qlora", 2, procs, shardings=("none",))
        chosen = p.best(options)

    alternatives: list[str] = []
    slow = chosen is not None and chosen[0].tier != (0, 0)  # offload, Adafactor, LoRA, QLoRA
    if cuda and (chosen is None or slow) and not p.blocker(p.method):
        # How many GPUs of this kind a full shard of the configured method would need.
        for gpus in range(max(2, procs + 1), 65):
            if effective % gpus:
                continue
            found = p.best([o for o in p.options(p.method, 0, gpus, shardings=("fsdp",)) if o.optimizer != "adafactor"
                            or p.optimizer == "adafactor"])
            if found:
                text = _verdict(found[1], p.configured(gpus))
                if chosen is None:
                    chosen = found
                else:
                    extra = f" ({_duration(100 * p.seconds(found[1]))} per 100 steps)"
                    alternatives.append(f"or keep {p.method} fine-tuning on {gpus} GPUs of this kind: "
                                        f"{text.removeprefix('needs ')}{extra}")
                break
    if chosen is not None and chosen[1].offload and chosen[0].tier[0] == 0:
        lora = p.best([o for o in p.options("lora", 1, procs) if o.sharding == "none"]) if p.method == "full" else None
        if lora:
            alternatives.append(f"or LoRA on {'these GPUs' if procs > 1 else 'this GPU'} without offload: "
                                f"{_duration(100 * p.seconds(lora[1]))} per 100 steps")
    for option, host in p.host_short.items():
        if option.sharding == "offload" and (chosen is None or not chosen[1].offload):
            p.notes.append(f"CPU offload would fit the GPU memory but needs {host / GIB:.0f} GiB of host RAM "
                           f"(budget {p.host_budget / GIB:.0f} GiB)")
            break

    steps_per_epoch = None
    examples = examples if examples is not None else cfg.data.num_samples
    if examples is not None:
        steps_per_epoch = examples // effective  # a partial last window is left out, as the training loop does
        if steps_per_epoch == 0:
            p.notes.append(f"{examples} examples are fewer than one effective batch ({effective})")

    if chosen is None:
        verdict = "needs a bigger GPU" if target.device != "cpu" else "needs more memory"
        method = "qlora" if cuda else "lora"
        precision = p.precision(method)
        smallest = estimate_memory(shape, Setup(method=method, device=target.device, precision=precision,
                                                weight_bytes=_weight_bytes(cfg, method, target.device, precision),
                                                micro_batch=1, seq_len=p.seq, gradient_checkpointing=True,
                                                lora_r=cfg.lora.r, lora_targets=cfg.lora.target_modules),
                                   overhead_gib=overhead_gib)
        p.notes.append(f"even {'QLoRA' if cuda else 'LoRA'} with micro-batch 1 and checkpointing needs "
                       f"{smallest.peak / GIB:.1f} GiB (budget {p.budget / GIB:.1f} GiB)")
        return TargetPlan(target, verdict, None, None, None, p.budget, tuple(p.notes), tuple(alternatives),
                          steps_per_epoch=steps_per_epoch, host_budget_bytes=p.host_budget)

    option, setup, mem = chosen
    verdict = _verdict(setup, configured)
    notes = p.notes
    if verdict == "fits" and cfg.model.gradient_checkpointing:
        without = p.fit(dataclasses.replace(configured, ckpt=0))
        if without:
            notes.append("gradient checkpointing is not needed here (turning it off saves the recomputation, "
                         f"{_duration(100 * (p.seconds(setup) - p.seconds(without[0])))} per 100 steps)")
    if setup.micro_batch != cfg.train.micro_batch:
        notes.append(f"micro-batch {setup.micro_batch} (config has {cfg.train.micro_batch})")
    time = step_time(shape, setup, target, tokens_per_sequence)
    if time.communication > 0.25 * time.total:
        notes.append(f"communication is {time.communication / time.total:.0%} of the step "
                     f"({target.interconnect_gbs or PCIE4_GBS:g} GB/s between GPUs, "
                     f"{target.host_link_gbs:g} GB/s to the host)")
    return TargetPlan(target, verdict, setup, mem, 100 * time.total, p.budget, tuple(notes), tuple(alternatives),
                      time=time, steps_per_epoch=steps_per_epoch, host_budget_bytes=p.host_budget)


def recommend_sharding(cfg: Config, shape: ModelShape, target: Target, processes: int) -> tuple[bool, str]:
    """Whether a run with ``runtime.sharding=auto`` should shard (FSDP2) over ``processes``, and why, in one line.

    The training loop asks this (``anyfit.training.sharding.decide_sharding``) with ``presets.this_machine()``
    and the launched process count; ``anyfit plan`` makes the same estimate. The run is estimated as
    configured (method, optimizer, checkpointing, ``train.micro_batch`` when it is a number, else the
    micro_batch=auto rule), unsharded, under the planner's safety share of one device's memory (CPU
    processes share the host RAM). It fits: no sharding (DDP is faster and simpler). It does not: shard,
    when sharding is possible for this run (not fp16, no generation eval during training, CUDA or CPU, not
    QLoRA) - sharding only lowers the per-device memory, so it is the better bet even when the sharded
    estimate is still over the budget (the reason says so). One process, or a DeepSpeed launch (ZeRO
    shards instead), is never sharded.
    """
    if processes <= 1:
        return False, "one process: nothing to shard over"
    if os.environ.get("ACCELERATE_USE_DEEPSPEED", "").lower() == "true":
        return False, "launched with DeepSpeed (accelerate config): ZeRO shards the model, not FSDP2"
    if cfg.train.effective_batch % processes:
        return False, (f"train.effective_batch={cfg.train.effective_batch} does not split over {processes} "
                       "processes (the run will refuse it)")
    p = _Planner(cfg, shape, target, SAFETY, None, cfg.data.max_length, processes=processes)
    p.host_budget = None  # every process loads the model either way: host RAM does not decide FSDP vs DDP
    budget = f"{p.budget / GIB:.1f} GiB per {'process' if target.device == 'cpu' else 'device'}"

    def peak(option: _Option) -> tuple[int | None, int]:
        """(peak bytes at the micro-batch the run will use, that micro-batch); None when none fits."""
        micro = cfg.train.micro_batch
        if micro == "auto":
            found = p.fit(option)
            return (found[1].peak, found[0].micro_batch) if found else (None, 1)
        per_process = cfg.train.effective_batch // processes
        if per_process % micro:
            micro = 1
        precision = p.precision(option.method)
        setup = Setup(method=option.method, device=target.device, precision=precision,
                      weight_bytes=_weight_bytes(cfg, option.method, target.device, precision), micro_batch=micro,
                      seq_len=p.seq, gradient_checkpointing=option.ckpt > 0, checkpoint_every=option.ckpt or 1,
                      accumulation=per_process // micro, processes=processes, fsdp=option.sharding != "none",
                      optimizer=option.optimizer, lora_r=cfg.lora.r, lora_targets=cfg.lora.target_modules,
                      lora_dropout=cfg.lora.dropout, fused_optimizer=cfg.runtime.fused_optimizer,
                      padding=not cfg.train.packing, loss_chunk_tokens=cfg.train.loss_chunk_tokens)
        return estimate_memory(shape, setup).peak, micro

    base = dataclasses.replace(p.configured(processes), sharding="none")
    unsharded, micro = peak(base)
    if unsharded is not None and unsharded <= p.budget:
        return False, (f"the unsharded run fits: {unsharded / GIB:.1f} GiB of {budget} at micro-batch {micro}")
    need = "no micro-batch fits" if unsharded is None else f"{unsharded / GIB:.1f} GiB at micro-batch {micro}"
    blocked = p.blocker(p.method)
    if blocked:
        return False, f"the unsharded run does not fit ({need}, budget {budget}), but it cannot be sharded: {blocked}"
    sharded, micro = peak(dataclasses.replace(base, sharding="fsdp"))
    if sharded is not None and sharded <= p.budget:
        return True, (f"the unsharded run does not fit ({need}, budget {budget}); sharded over {processes}: "
                      f"{sharded / GIB:.1f} GiB at micro-batch {micro}")
    still = "no micro-batch fits" if sharded is None else f"{sharded / GIB:.1f} GiB at micro-batch {micro}"
    return True, (f"the unsharded run does not fit ({need}, budget {budget}); sharded over {processes} it is "
                  f"still over ({still}): see 'anyfit plan' for more savers")


# ----------------------------------------------------------------------------------------------------
# 5. Reports
# ----------------------------------------------------------------------------------------------------


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


def plan(cfg: Config, targets=None, mean_tokens: float | None = None, shape: ModelShape | None = None,
         safety: float = SAFETY, examples: int | None = None) -> tuple[ModelShape, list[TargetPlan]]:
    """Plan the configured run on each target (default: this machine and every preset)."""
    shape = shape or model_shape(cfg.model)
    return shape, [plan_target(cfg, shape, t, mean_tokens, safety, examples=examples)
                   for t in _resolve_targets(targets)]


def plan_dict(cfg: Config, targets=None, mean_tokens: float | None = None, shape: ModelShape | None = None,
              safety: float = SAFETY, examples: int | None = None) -> dict[str, Any]:
    """The plan as plain data (``anyfit plan --json``). Memory is per device (per rank); host RAM per machine."""
    shape, plans = plan(cfg, targets, mean_tokens, shape, safety, examples)
    examples = examples if examples is not None else cfg.data.num_samples
    return {
        "model": {**{k: v for k, v in dataclasses.asdict(shape).items() if k != "projections"},
                  "lora_params": shape.lora_params(cfg.lora.r, cfg.lora.target_modules),
                  "lora_targets": shape.lora_targets(cfg.lora.target_modules)},
        "effective_batch": cfg.train.effective_batch, "seq_len": cfg.data.max_length,
        "tokens_per_sequence_for_time": mean_tokens or cfg.data.max_length, "safety": safety,
        "examples": examples, "price_note": PRICE_NOTE,
        "targets": [p.as_dict() for p in plans],
    }


def _gib(b: int) -> str:
    return f"{b / GIB:.1f}"


def _duration(seconds: float | None) -> str:
    if seconds is None:
        return "-"
    if seconds < 120:
        return f"{seconds:.0f} s"
    if seconds < 7200:
        return f"{seconds / 60:.0f} min"
    return f"{seconds / 3600:.1f} h"


def _money(value: float | None) -> str:
    if value is None:
        return "-"
    return f"${value:.2f}" if value < 100 else f"${value:,.0f}"


def _short_savers(s: Setup) -> str:
    """The savers for the table, abbreviated (the notes and --json spell them out)."""
    out = []
    if s.offload:
        out.append(f"offload/{s.processes}")
    elif s.fsdp:
        out.append(f"FSDP/{s.processes}")
    if s.optimizer != "adamw":
        out.append({"adamw_8bit": "8-bit", "paged_adamw_8bit": "paged 8-bit", "adafactor": "Adafactor"}[s.optimizer])
    if s.gradient_checkpointing:
        out.append("ckpt" if s.checkpoint_every == 1 else f"ckpt/{s.checkpoint_every}")
    return " ".join(out) or "-"


def plan_report(cfg: Config, targets=None, mean_tokens: float | None = None, shape: ModelShape | None = None,
                safety: float = SAFETY, examples: int | None = None) -> str:
    """The printable plan: one row per target, each target's per-device breakdown, then the first target's
    memory in detail."""
    shape, plans = plan(cfg, targets, mean_tokens, shape, safety, examples)
    examples = examples if examples is not None else cfg.data.num_samples
    lora_n = shape.lora_params(cfg.lora.r, cfg.lora.target_modules)
    lines = [f"model {cfg.model.name_or_path or '(given shape)'}",
             f"  {shape.describe()}",
             f"  LoRA r={cfg.lora.r} on {', '.join(shape.lora_targets(cfg.lora.target_modules))}: "
             f"{lora_n / 1e6:,.2f}M adapter parameters",
             f"run: effective batch {cfg.train.effective_batch}, sequences up to {cfg.data.max_length} tokens "
             f"(memory uses the longest; time uses {mean_tokens or cfg.data.max_length:g} tokens per sequence), "
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
                     _short_savers(s) if s else "-",
                     f"{_gib(m.peak)} / {p.budget_bytes / GIB:.0f}" if m else "-",
                     (_gib(m.host) + (f" / {p.host_budget_bytes / GIB:.0f}" if p.host_budget_bytes else ""))
                     if m and m.host else "-",
                     _duration(p.seconds_per_100_steps), _money(p.cost_per_100_steps), _money(p.cost_per_epoch),
                     p.verdict])
    widths = [max(len(str(r[i])) for r in [header, *rows]) for i in range(len(header))]
    fmt = " | ".join(f"{{:{w}}}" for w in widths)
    lines += [fmt.format(*header), "-+-".join("-" * w for w in widths), *(fmt.format(*r) for r in rows)]
    lines.append("savers: FSDP/N = sharded over N GPUs, offload/N = FSDP with CPU offload, 8-bit = 8-bit AdamW "
                 "states, ckpt/k = gradient checkpointing every k-th layer (ckpt: every layer); host GiB = host RAM "
                 "the machine needs (each process loads the model there; offloaded state)")
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
        lines += ["", f"memory at the peak on {first.target.label()}, per device ({s.describe()}; peak during the "
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
        lines.append("  config: " + " ".join(_config_overrides(s)))
    lines.append("Estimates: see anyfit.hardware.planner's docstrings; validated against CPU runs in "
                 "benchmarks/PLAN_VS_MEASURED.md. Time = FLOPs / (peak x MFU) + optimizer update + communication "
                 "compute cannot hide; MFU " + ", ".join(f"{d} {v:.0%}" for d, v in _mfu_defaults().items()) + ".")
    return "\n".join(lines)


def _mfu_defaults() -> dict[str, float]:
    from anyfit.hardware.presets import DEFAULT_MFU

    return DEFAULT_MFU

"""Memory and time planning: will this config fit on that machine, with which batch split, and how fast?

Everything is computed from the model's *config* (no weights are read) and the run config:

1. ``anyfit.model.shape.model_shape``: the architecture's sizes and exact parameter count (a closed formula
   for the Llama family and GPT-2; other architectures are counted on PyTorch's meta device).
2. ``estimate_memory``: the peak bytes of one training step, as the sum of what is alive at the peak:
   weights, gradients, AdamW states, saved activations, the logits and their gradient, transient copies,
   and a fixed runtime overhead. The activation term counts the tensors autograd saves in a Hugging Face
   decoder layer (see ``activation_bytes``); it was checked tensor by tensor against
   ``torch.autograd.graph.saved_tensors_hooks`` (tests/test_planner.py) and end to end against the peak
   RSS of real CPU runs (benchmarks/PLAN_VS_MEASURED.md).
3. ``plan_target``: for one machine, the largest micro-batch that fits under a safety margin, the
   accumulation that keeps the configured effective batch, and what has to change when nothing fits
   (gradient checkpointing, LoRA, QLoRA, FSDP sharding, a bigger GPU).
4. ``step_seconds``: training FLOPs per token (6N for full fine-tuning, 4N with a frozen base, plus
   attention) over the device's dense peak times a model-FLOPs utilisation.

The estimates describe anyfit's own loop and policies: fp32 master weights with bf16/fp16 autocast for
full fine-tuning, a frozen base in the compute dtype for LoRA on CUDA (fp32 on CPU/MPS), fp32 adapters
(PEFT upcasts them), token-sum loss (chunked fp32 cross-entropy by default), fused AdamW on every device.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any

from anyfit.config import Config, ConfigError
from anyfit.data.batching import choose_micro_batch
from anyfit.hardware.runtime import weight_dtype
from anyfit.model.shape import ModelShape, Projection, kv_cache_bytes, model_shape
from anyfit.hardware.presets import GIB, PRESETS, Target, default_targets

BYTES = {"fp32": 4, "bf16": 2, "fp16": 2}

# 4-bit NF4 with double quantization (bitsandbytes): 4 bits per weight, an 8-bit absmax per block of 64
# weights, and an fp32 absmax (plus offset) per 256 of those blocks.
NF4_BYTES_PER_PARAM = 0.5 + 1 / 64 + 8 / (64 * 256)

# Fixed memory a process needs besides tensors: the CUDA context and library workspaces (not counted by
# torch.cuda.max_memory_allocated, but taken from the GPU); on Apple unified memory and on the CPU the
# Python process itself (interpreter, torch, transformers, the tokenizer, the data). The CPU figure comes
# from benchmarks/plan_vs_measured.py: ~0.75 GiB RSS before the model is loaded, ~0.25 GiB more once a step
# has run (library code paged in), and ~0.25 GiB of glibc heap slack (freed activations the allocator keeps:
# 0.15 GiB measured for full fine-tuning, 0.45-0.5 GiB for LoRA, about constant in the batch size).
RUNTIME_OVERHEAD_GIB = {"cuda": 0.5, "mps": 1.0, "cpu": 1.25}

# Share of the target's memory the plan may use: the rest absorbs allocator fragmentation and estimate error.
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
    fsdp: bool = False  # full-shard weights, gradients and optimizer states over the processes
    lora_r: int = 16
    lora_targets: list[str] | str = "auto"
    lora_dropout: float = 0.05
    padding: bool = True  # micro-batches padded to their longest (the attention then takes a mask)
    fused_optimizer: bool = True
    loss_chunk_tokens: int = 0  # train.loss_chunk_tokens: 0 is torch's cross-entropy on fp32 logits

    @property
    def lora(self) -> bool:
        return self.method in ("lora", "qlora")

    def describe(self) -> str:
        what = {"full": "full fine-tuning", "lora": f"LoRA r={self.lora_r}", "qlora": f"QLoRA r={self.lora_r}"}
        parts = [what[self.method], self.precision, f"micro {self.micro_batch} x accum {self.accumulation} x procs "
                 f"{self.processes}", f"seq {self.seq_len}"]
        if self.gradient_checkpointing:
            parts.append("gradient checkpointing")
        if self.fsdp:
            parts.append(f"FSDP over {self.processes}")
        return ", ".join(parts)


@dataclass(frozen=True)
class MemoryEstimate:
    """Bytes per device at the peak of a training step; the fields sum to ``peak``."""

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

    @property
    def peak(self) -> int:
        return (self.weights + self.gradients + self.optimizer + self.activations + self.logits + self.transient
                + self.overhead)

    def as_dict(self) -> dict[str, Any]:
        fields = ("weights", "gradients", "optimizer", "activations", "logits", "transient", "overhead")
        out: dict[str, Any] = {f"{k}_gib": round(getattr(self, k) / GIB, 3) for k in fields}
        out.update(peak_gib=round(self.peak / GIB, 3), phase=self.phase,
                   eval_kv_cache_gib=round(self.eval_kv_cache / GIB, 3), trainable_params=self.trainable_params,
                   notes=list(self.notes))
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

    With gradient checkpointing only each layer's input is kept (``checkpoint_input``), and one layer is
    recomputed at a time during the backward pass.
    """
    a = BYTES[setup.precision]  # compute dtype
    # The residual stream has the embedding's dtype: the weight dtype, except QLoRA (PEFT upcasts
    # non-quantized weights to fp32). Adding a bf16 branch to an fp32 residual stays fp32.
    rs = 4 if setup.method == "qlora" else setup.weight_bytes
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


def estimate_memory(shape: ModelShape, setup: Setup, overhead_gib: float | None = None,
                    eval_tokens: int | None = None) -> MemoryEstimate:
    """Peak memory per device of one training step (see the module docstring for the policy assumed).

    The peak is the larger of two moments:
    - forward/backward: weights + optimizer states + activations + logits and loss (+ the gradients of the
      earlier micro-batches of the step, none with a single micro-batch) + autocast's weight copies;
    - the optimizer step: weights + optimizer states + all gradients + the step's temporaries
      (foreach AdamW allocates one fp32 copy of the trainable parameters; fused AdamW none).
    """
    notes: list[str] = []
    n = setup.processes
    shard = n if setup.fsdp else 1
    a = BYTES[setup.precision]

    # --- weights and what trains ---
    if setup.method == "qlora":
        quantized = shape.body_linear_params
        weights = quantized * NF4_BYTES_PER_PARAM + (shape.params - quantized) * 4  # PEFT upcasts the rest to fp32
        notes.append("QLoRA: body linears in NF4 (0.52 B/param with constants); embeddings, head and norms "
                     "upcast to fp32 by PEFT's prepare_model_for_kbit_training")
    else:
        weights = shape.params * setup.weight_bytes
    if setup.lora:
        trainable = shape.lora_params(setup.lora_r, setup.lora_targets)
        weights += trainable * 4  # PEFT keeps adapters in fp32
        grad_bytes = 4
        head_grads = 0  # the head is frozen: no weight gradient
    else:
        trainable = shape.params
        grad_bytes = setup.weight_bytes  # gradients and AdamW states take the parameter dtype
        head_grads = shape.vocab_size * shape.hidden_size * grad_bytes
    weights = int(weights / shard)
    gradients = trainable * grad_bytes // shard
    optimizer = 2 * trainable * grad_bytes // shard

    # --- activations and logits of one micro-batch ---
    tokens = setup.micro_batch * setup.seq_len
    act = activation_bytes(shape, setup)
    # The loss and the output head: 12 bytes per logit while the loss's backward runs; right after, the
    # head's weight gradient (a new V x h tensor, accumulated into .grad) next to the logits' gradient.
    logit_bytes = 4 if setup.loss_chunk_tokens <= 0 else a  # the head's output dtype (autocast: a)
    logits = max(logits_bytes(shape, tokens, logit_bytes, setup.loss_chunk_tokens),
                 tokens * shape.vocab_size * logit_bytes + head_grads // shard)
    if setup.gradient_checkpointing:
        # Layer inputs and the head's tensors stay; the backward pass recomputes one layer at a time, whose
        # saved tensors plus their gradients (~ the same again) come on top once the logits are gone.
        kept = tokens * (shape.num_layers * act.checkpoint_input + act.head)
        recompute = 2 * tokens * act.per_layer
        activations = int(kept + max(0, recompute - logits))
    else:
        activations = int(tokens * (shape.num_layers * act.per_layer + act.head))

    # --- transients at the forward/backward peak ---
    transient = 0
    if not setup.lora and a < setup.weight_bytes:
        transient += shape.matmul_params * a  # autocast's cached low-precision copy of every matmul weight
        notes.append(f"autocast keeps a {setup.precision} copy of each matmul weight until its backward")
    if setup.lora and a < 4:
        transient += trainable * a  # the same for the fp32 adapters
    if n > 1 and not setup.fsdp:
        transient += trainable * grad_bytes  # DDP gradient buckets (gradient_as_bucket_view off)
        notes.append("DDP: gradient buckets hold a second copy of the gradients")
    if setup.fsdp:
        # The unit being computed and the prefetched next one, plus the root unit (embeddings and head).
        gathered = 2 * shape.layer_params + shape.embedding_params + shape.head_params
        transient += gathered * min(a, setup.weight_bytes) + shape.layer_params * grad_bytes
        notes.append("FSDP full shard: weights, gradients and AdamW states divided by the GPU count; one layer "
                     "(plus the prefetched next and the embedding/head unit) gathered at a time")
    if setup.method == "qlora":
        largest = max(p.d_in * p.d_out for p in shape.projections)
        transient += 2 * largest * a  # a dequantized weight (and its transposed use in backward)
    if setup.device == "cpu":
        notes.append("CPU: the runtime overhead includes ~0.25 GiB of glibc heap slack; on Linux, "
                     "MALLOC_MMAP_THRESHOLD_=131072 makes freed activations go back to the OS")

    accumulated = gradients if setup.accumulation > 1 else 0  # grads of earlier micro-batches of the step
    fwd_bwd = accumulated + activations + logits + transient
    step_temp = 0 if setup.fused_optimizer else trainable * grad_bytes // shard
    step = gradients + step_temp
    overhead = int((RUNTIME_OVERHEAD_GIB[setup.device] if overhead_gib is None else overhead_gib) * GIB)
    kv = kv_cache_bytes(shape, eval_tokens or setup.seq_len, setup.micro_batch, a)
    common = dict(weights=weights, optimizer=optimizer, overhead=overhead, eval_kv_cache=kv,
                  trainable_params=trainable, notes=tuple(notes))
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
    adapter parameters. Gradient checkpointing repeats the layers' forward (+2 N_body).
    Attention (PaLM's count, no causal discount): 4 x layers x q_dim x seq forward, twice that backward,
    +1 forward with checkpointing.
    """
    n_mm = shape.matmul_params
    mm = (4 * n_mm + 6 * shape.lora_params(setup.lora_r, setup.lora_targets)) if setup.lora else 6 * n_mm
    attn_fwd = 4 * shape.num_layers * shape.q_dim * setup.seq_len
    attention = 3 * attn_fwd
    if setup.gradient_checkpointing:
        mm += 2 * shape.body_linear_params
        attention += attn_fwd
    return mm + attention


def step_seconds(shape: ModelShape, setup: Setup, target: Target, tokens_per_sequence: float) -> float:
    """Seconds per optimizer step: FLOPs / (peak x MFU x devices), plus the bandwidth-bound AdamW update."""
    tokens = setup.micro_batch * setup.accumulation * setup.processes * tokens_per_sequence
    seq_setup = dataclasses.replace(setup, seq_len=max(1, round(tokens_per_sequence)))
    flops = flops_per_token(shape, seq_setup) * tokens
    compute = flops / (target.tflops(setup.precision) * 1e12 * target.efficiency * setup.processes)
    trainable = shape.lora_params(setup.lora_r, setup.lora_targets) if setup.lora else shape.params
    # AdamW reads parameter, gradient and two states and writes three of them back: ~28 bytes per fp32 parameter.
    optimizer = trainable * 28 / (setup.processes if setup.fsdp else 1) / (target.bandwidth_gbs * 1e9)
    return compute + optimizer


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

    def as_dict(self) -> dict[str, Any]:
        s = self.setup
        return {
            "target": self.target.key, "name": self.target.label(), "device": self.target.device,
            "devices": self.target.num_devices, "memory_gib_per_device": round(self.target.memory_gib, 2),
            "budget_gib": round(self.budget_bytes / GIB, 2), "verdict": self.verdict,
            "setup": None if s is None else {
                "method": s.method, "precision": s.precision, "weight_bytes": s.weight_bytes,
                "micro_batch": s.micro_batch, "accumulation": s.accumulation, "processes": s.processes,
                "seq_len": s.seq_len, "gradient_checkpointing": s.gradient_checkpointing, "fsdp": s.fsdp},
            "memory": None if self.memory is None else self.memory.as_dict(),
            "seconds_per_100_steps": (None if self.seconds_per_100_steps is None
                                      else round(self.seconds_per_100_steps, 1)),
            "notes": list(self.notes), "alternatives": list(self.alternatives),
        }


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


def plan_target(cfg: Config, shape: ModelShape, target: Target, mean_tokens: float | None = None,
                safety: float = SAFETY, overhead_gib: float | None = None) -> TargetPlan:
    """Find how the configured run fits on ``target``, escalating only as far as needed.

    Ladder: as configured -> + gradient checkpointing -> FSDP over the target's GPUs -> LoRA -> QLoRA ->
    full shard over more GPUs of this kind -> a bigger GPU. At each rung the micro-batch is chosen as
    ``micro_batch=auto`` chooses it (the largest divisor of the per-process share of the effective batch
    that fits), here under ``safety`` x the target's memory; accumulation keeps the effective batch.
    """
    budget = int(target.memory_gib * GIB * safety)
    notes: list[str] = []
    configured = "qlora" if cfg.lora.qlora else ("lora" if cfg.lora.enabled else "full")
    if configured == "qlora" and target.device != "cuda":
        notes.append("QLoRA needs CUDA (bitsandbytes); planned as LoRA here")
        configured = "lora"
    effective = cfg.train.effective_batch
    seq = cfg.data.max_length
    tokens_per_sequence = mean_tokens or seq
    cuda = target.device == "cuda"

    def fit(method: str, ckpt: bool, processes: int, fsdp: bool) -> tuple[Setup, MemoryEstimate] | None:
        precision, prec_notes = _precision(cfg, target, qlora=method == "qlora")
        for note in prec_notes:
            if note not in notes:
                notes.append(note)
        wb = _weight_bytes(cfg, method, target.device, precision)
        per_process = effective // processes

        def setup(micro: int) -> Setup:
            return Setup(method=method, device=target.device, precision=precision, weight_bytes=wb, micro_batch=micro,
                         seq_len=seq, gradient_checkpointing=ckpt, accumulation=per_process // micro,
                         processes=processes, fsdp=fsdp, lora_r=cfg.lora.r, lora_targets=cfg.lora.target_modules,
                         lora_dropout=cfg.lora.dropout, fused_optimizer=cfg.runtime.fused_optimizer,
                         padding=not cfg.train.packing, loss_chunk_tokens=cfg.train.loss_chunk_tokens)

        # The rule micro_batch=auto follows, with estimated instead of measured peaks.
        micro = choose_micro_batch(per_process, lambda m: estimate_memory(shape, setup(m), overhead_gib=overhead_gib).peak,
                                   budget)
        if micro is None:
            return None
        return setup(micro), estimate_memory(shape, setup(micro), overhead_gib=overhead_gib)

    procs = _processes(effective, target.num_devices)
    if procs < target.num_devices:
        notes.append(f"train.effective_batch={effective} does not split over {target.num_devices} GPUs; "
                     f"planned on {procs}")
    rungs: list[tuple[str, str, bool, int, bool]] = [
        ("fits", configured, False, procs, False),
        ("fits with gradient checkpointing", configured, True, procs, False)]
    if procs > 1:
        rungs += [(f"needs sharding over {procs} GPUs", configured, ckpt, procs, True) for ckpt in (False, True)]
    if configured == "full":
        rungs += [("needs LoRA", "lora", ckpt, procs, False) for ckpt in (False, True)]
    if cuda and configured != "qlora":
        rungs += [("needs QLoRA", "qlora", ckpt, procs, False) for ckpt in (False, True)]

    chosen = None
    for verdict, method, ckpt, processes, fsdp in rungs:
        found = fit(method, ckpt, processes, fsdp)
        if found:
            chosen = (verdict, *found)
            break

    alternatives: list[str] = []
    if cuda and (chosen is None or chosen[0] in ("needs LoRA", "needs QLoRA")):
        # How many GPUs of this kind a full shard of the configured run would need.
        for gpus in range(max(2, procs + 1), 65):
            if effective % gpus == 0 and fit(configured, True, gpus, True):
                text = f"needs sharding over {gpus} GPUs"
                if chosen is None:
                    found = fit(configured, True, gpus, True)
                    chosen = (text, *found)
                else:
                    alternatives.append(f"or keep {configured} fine-tuning: {text} of this kind (FSDP)")
                break
    if chosen is None:
        verdict = "needs a bigger GPU" if target.device != "cpu" else "needs more memory"
        method = "qlora" if cuda else "lora"
        precision = _precision(cfg, target, cuda)[0]
        smallest = estimate_memory(shape, Setup(method=method, device=target.device, precision=precision,
                                                weight_bytes=_weight_bytes(cfg, method, target.device, precision),
                                                micro_batch=1, seq_len=seq, gradient_checkpointing=True,
                                                lora_r=cfg.lora.r, lora_targets=cfg.lora.target_modules),
                                   overhead_gib=overhead_gib)
        notes.append(f"even {'QLoRA' if cuda else 'LoRA'} with micro-batch 1 and checkpointing needs "
                     f"{smallest.peak / GIB:.1f} GiB (budget {budget / GIB:.1f} GiB)")
        return TargetPlan(target, verdict, None, None, None, budget, tuple(notes), tuple(alternatives))

    verdict, setup, mem = chosen
    if verdict == "fits" and cfg.model.gradient_checkpointing:
        notes.append("gradient checkpointing is not needed here (turning it off is ~30% faster)")
    if setup.micro_batch != cfg.train.micro_batch:
        notes.append(f"micro-batch {setup.micro_batch} (config has {cfg.train.micro_batch})")
    seconds = 100 * step_seconds(shape, setup, target, tokens_per_sequence)
    return TargetPlan(target, verdict, setup, mem, seconds, budget, tuple(notes), tuple(alternatives))


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
         safety: float = SAFETY) -> tuple[ModelShape, list[TargetPlan]]:
    """Plan the configured run on each target (default: this machine and every preset)."""
    shape = shape or model_shape(cfg.model)
    return shape, [plan_target(cfg, shape, t, mean_tokens, safety) for t in _resolve_targets(targets)]


def plan_dict(cfg: Config, targets=None, mean_tokens: float | None = None, shape: ModelShape | None = None,
              safety: float = SAFETY) -> dict[str, Any]:
    """The plan as plain data (``anyfit plan --json``)."""
    shape, plans = plan(cfg, targets, mean_tokens, shape, safety)
    return {
        "model": {**{k: v for k, v in dataclasses.asdict(shape).items() if k != "projections"},
                  "lora_params": shape.lora_params(cfg.lora.r, cfg.lora.target_modules),
                  "lora_targets": shape.lora_targets(cfg.lora.target_modules)},
        "effective_batch": cfg.train.effective_batch, "seq_len": cfg.data.max_length,
        "tokens_per_sequence_for_time": mean_tokens or cfg.data.max_length, "safety": safety,
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


def plan_report(cfg: Config, targets=None, mean_tokens: float | None = None, shape: ModelShape | None = None,
                safety: float = SAFETY) -> str:
    """The printable plan: one row per target, then the memory breakdown of the first target."""
    shape, plans = plan(cfg, targets, mean_tokens, shape, safety)
    lora_n = shape.lora_params(cfg.lora.r, cfg.lora.target_modules)
    lines = [f"model {cfg.model.name_or_path or '(given shape)'}",
             f"  {shape.describe()}",
             f"  LoRA r={cfg.lora.r} on {', '.join(shape.lora_targets(cfg.lora.target_modules))}: "
             f"{lora_n / 1e6:,.2f}M adapter parameters",
             f"run: effective batch {cfg.train.effective_batch}, sequences up to {cfg.data.max_length} tokens "
             f"(memory uses the longest; time uses {mean_tokens or cfg.data.max_length:g} tokens per sequence), "
             f"budget {safety:.0%} of each device's memory", ""]
    header = ["target", "mem/dev", "precision", "micro x accum x procs", "ckpt", "method", "FSDP", "peak GiB",
              "per 100 steps", "verdict"]
    rows = []
    for p in plans:
        s = p.setup
        rows.append([p.target.label(), f"{p.target.memory_gib:.0f} GiB",
                     s.precision if s else "-",
                     f"{s.micro_batch} x {s.accumulation} x {s.processes}" if s else "-",
                     ("yes" if s.gradient_checkpointing else "no") if s else "-",
                     {"full": "full", "lora": "LoRA", "qlora": "QLoRA"}[s.method] if s else "-",
                     ("yes" if s.fsdp else "no") if s else "-",
                     f"{_gib(p.memory.peak)} / {p.budget_bytes / GIB:.0f}" if p.memory else "-",
                     _duration(p.seconds_per_100_steps), p.verdict])
    widths = [max(len(str(r[i])) for r in [header, *rows]) for i in range(len(header))]
    fmt = " | ".join(f"{{:{w}}}" for w in widths)
    lines += [fmt.format(*header), "-+-".join("-" * w for w in widths), *(fmt.format(*r) for r in rows)]

    lines.append("")
    for p in plans:
        extra = [*p.notes, *p.alternatives]
        if p.target.note:
            extra.insert(0, p.target.note)
        if extra:
            lines.append(f"{p.target.label()}: " + "; ".join(extra))
    first = next((p for p in plans if p.memory), None)
    if first:
        m, s = first.memory, first.setup
        lines += ["", f"memory at the peak on {first.target.label()} ({s.describe()}; peak during the {m.phase}):"]
        parts = [("weights", m.weights), ("gradients", m.gradients), ("optimizer (AdamW)", m.optimizer),
                 ("activations", m.activations), ("logits + loss", m.logits), ("transient copies", m.transient),
                 ("runtime overhead", m.overhead)]
        for name, value in parts:
            lines.append(f"  {name:<18} {value / GIB:8.2f} GiB")
        lines.append(f"  {'total':<18} {m.peak / GIB:8.2f} GiB   (budget {first.budget_bytes / GIB:.1f} GiB)")
        lines.append(f"  eval generation KV cache (batch {s.micro_batch} x {s.seq_len} tokens): "
                     f"{m.eval_kv_cache / GIB:.2f} GiB, on top of the weights when evaluating")
        for note in m.notes:
            lines.append(f"  - {note}")
    lines.append("Estimates: see anyfit.hardware.planner's docstrings; validated against CPU runs in "
                 "benchmarks/PLAN_VS_MEASURED.md. Time = FLOPs / (peak x MFU); MFU "
                 + ", ".join(f"{d} {v:.0%}" for d, v in _mfu_defaults().items()) + ".")
    return "\n".join(lines)


def _mfu_defaults() -> dict[str, float]:
    from anyfit.hardware.presets import DEFAULT_MFU

    return DEFAULT_MFU



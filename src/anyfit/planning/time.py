"""Time of one training step on a target machine: the compute (on CUDA: the matmul FLOPs at the share of the
peak matmuls reach, plus the bytes the non-matmul operations stream through memory; on a CPU or Mac whose rates
were measured (``anyfit.hardware.calibration``): the same two terms at the measured matmul rate and element-wise
bandwidth, plus the fixed cost of each eager operation; elsewhere: FLOPs over the peak times a model-FLOPs
utilisation), the bandwidth-bound optimizer update, and the communication compute cannot hide."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from anyfit.hardware.calibration import MachineRates
from anyfit.model.shape import ModelShape
from anyfit.planning.memory import offloaded_activation_bytes, trained_parameters
from anyfit.planning.presets import PCIE4_GBS, Target
from anyfit.planning.setup import (
    BYTES,
    CPU_OPTIMIZER_GBS,
    DDP_BUCKET_BYTES,
    OPTIMIZER_STREAM_BYTES,
    Setup,
    Workload,
)


def flops_per_token(shape: ModelShape, setup: Setup) -> float:
    """Training FLOPs per token.

    Matmuls: 2N forward, 2N for the input gradients, 2N for the weight gradients (6N for full fine-tuning,
    N = body projection weights + the output head; in a mixture of experts the token's top_k routed experts, not
    all: ``ModelShape.active_matmul_params``). A frozen base skips the weight gradients: 4N plus 6x the adapter
    parameters (``ModelShape.lora_flops``: LoRA on fused experts as base plus low-rank path costs 6x its active adapter
    parameters plus a recompute of x·A; PEFT's folded path their weight gradient instead). Gradient
    checkpointing repeats the forward of the checkpointed layers (+2 N_body on every layer, +2 N_body / k with
    ``checkpoint_every`` = k).
    Attention (PaLM's count, no causal discount): 4 x layers x q_dim x seq forward, twice that backward,
    + the forward again on the checkpointed layers. A tiled MLP runs the MLP's forward once more (+2 N_mlp).
    Under sequence parallelism these are per token of a process's part (attention over the whole sequence for
    1/N of the heads is 1/N of the whole attention). The fused loss computes the head's logits again in the
    backward (+2 x vocab x hidden). The head runs at trained positions only (``Setup.trained_share`` of the
    tokens), as anyfit's loss and its MFU count it (``anyfit.profiling.flops``).
    """
    n_mm = shape.active_matmul_params  # a mixture of experts: the token's top_k experts only
    head = shape.vocab_size * shape.hidden_size
    mm = 6 * n_mm
    if setup.lora:
        split = setup.lora_split_experts and shape.experts_split  # expert LoRA as base plus low-rank path
        mm = 4 * n_mm + shape.lora_flops(setup.lora_r, setup.lora_targets, setup.lora_experts, split)
    mm -= (1 - setup.trained_share) * (4 if setup.lora else 6) * head  # no logits at untrained positions
    attn_fwd = 4 * shape.num_layers * shape.q_dim * setup.seq_len
    attention = 3 * attn_fwd
    recomputed = setup.checkpointed_layers(shape.num_layers)
    if recomputed:
        share = recomputed / max(1, shape.num_layers)
        mm += 2 * shape.active_body_params * share
        attention += attn_fwd * share
    if setup.tiled_mlp:
        mm += 2 * sum(p.d_in * p.d_out * p.count for p in shape.projections if p.group in ("mlp_in", "mlp_mid"))
    if setup.fused_loss:  # the head's logits computed again in the backward
        mm += 2 * head * setup.trained_share
    return mm + attention


def streamed_bytes_per_token(shape: ModelShape, setup: Setup) -> float:
    """Bytes per token that the step's non-matmul operations read and write in device memory, as eager
    transformers runs them (one kernel per operation, each reading its inputs and writing its output; counted
    from the Llama modeling code, in activations of the compute dtype, ``a`` bytes):

    - per layer, forward: two RMSNorms (transformers computes them in fp32: the cast up, the square, the mean, the
      scale, the cast down and the weight, ~36 bytes per hidden unit at a = 2), rotary embedding of q and k
      (six element-wise passes, read and write), the attention output made contiguous, two residual adds, the
      gated MLP's SiLU and product (5 passes over the intermediate width); each LoRA target reads its input
      again (and writes and reads a dropout copy when dropout is on) and adds its output into the base output;
    - the backward pass about twice the forward; checkpointed layers run their forward again;
    - the output: the logits written, cast to fp32 for the loss, log-softmax and its gradient, cast back
      (4a + 28 bytes per vocabulary entry; the same with chunked cross-entropy, which bounds memory, not traffic),
      at trained positions only (``Setup.trained_share``);
    - fp32 master weights cast to the compute dtype by autocast once per micro-batch (and again in a
      checkpointed layer's recompute), spread over the micro-batch's tokens.

    Attention's own FLOPs stay in ``flops_per_token`` (SDPA's flash and memory-efficient kernels do not write
    the score matrix). A compiled or fused stack streams less; this counts what anyfit runs by default.
    """
    a = BYTES[setup.precision]
    h, i, q, kv = shape.hidden_size, shape.intermediate_size, shape.q_dim, shape.kv_dim
    layer = (2 * 18 * a * h + 12 * a * (q + kv) + 2 * a * q + 6 * a * h
             + (5 if shape.gated_mlp else 2) * a * i)
    if setup.lora:
        targets = set(shape.lora_targets(setup.lora_targets))
        copies = 1 + (2 if setup.lora_dropout > 0 else 0)
        layer += sum(a * (copies * p.d_in + 4 * p.d_out) * p.count for p in shape.projections
                     if p.name in targets) / max(1, shape.num_layers)
    layers = max(1, shape.num_layers)
    recomputed = setup.checkpointed_layers(layers) / layers
    body = layers * layer * (3 + recomputed)
    output = shape.vocab_size * (4 * a + 28) * setup.trained_share
    casts = 0.0
    if setup.weight_bytes > a and not setup.mixed_fsdp:  # autocast's copy of fp32 weights, per micro-batch
        casts = (shape.matmul_params * (setup.weight_bytes + a) * (1 + recomputed)
                 / max(1, setup.micro_batch * setup.seq_len))
    return body + output + casts


# Eager autograd operations per decoder layer in one forward (counted from transformers' Llama modeling code: two
# RMSNorms of 8 operations each, q/k/v with their views and transposes, rotary embedding of q and k (7 each), SDPA,
# the output's transpose/reshape and projection, two residual adds, the gated MLP's 5), each with its backward; a
# LoRA target adds its dropout, A, B, scaling and add. The output adds the head, the loss and their bookkeeping.
LAYER_OPS = 50
LORA_OPS = 5
OUTPUT_OPS = 20


def eager_operations(shape: ModelShape, setup: Setup) -> float:
    """Eager autograd operations (each a forward and its backward) in one micro-batch: what a tiny model's step
    time is made of, whatever its FLOPs. Checkpointed layers run their forward again."""
    layers = max(1, shape.num_layers)
    per_layer = LAYER_OPS
    if setup.lora:
        per_layer += LORA_OPS * sum(p.count for p in shape.projections
                                    if p.name in set(shape.lora_targets(setup.lora_targets))) / layers
    return layers * per_layer * (1 + setup.checkpointed_layers(layers) / layers / 2) + OUTPUT_OPS


def measured_compute_seconds(shape: ModelShape, setup: Setup, tokens: float, rates: MachineRates) -> float:
    """Forward and backward seconds of ``tokens`` (per device, ``setup.seq_len`` long, in micro-batches of
    ``setup.micro_batch``) from this machine's measured rates, each term counted, none fitted: the FLOPs at the
    matmul rate measured at the model's width (a LoRA adapter's at the rate of its thin matmuls at its rank), the
    bytes the other operations stream (``streamed_bytes_per_token``) at the element-wise bandwidth measured at the
    size of one activation of a micro-batch (a small model's stay in the caches), and the fixed cost of every eager
    operation (``eager_operations``) per micro-batch."""
    micro_tokens = max(1.0, setup.micro_batch * setup.seq_len / setup.sequence_parallel)
    activation = micro_tokens * shape.hidden_size * BYTES[setup.precision]
    adapter = 6.0 * shape.lora_params(setup.lora_r, setup.lora_targets, experts=False) if setup.lora else 0.0
    matmuls = ((flops_per_token(shape, setup) - adapter) / (rates.matmul_at(shape.hidden_size) * 1e12)
               + adapter / (rates.adapter_at(setup.lora_r) * 1e12)) * tokens
    streamed = streamed_bytes_per_token(shape, setup) * tokens / (rates.bandwidth_at(activation) * 1e9)
    operations = eager_operations(shape, setup) * rates.op_seconds * tokens / micro_tokens
    return matmuls + streamed + operations


@dataclass(frozen=True)
class StepTime:
    """Seconds of one optimizer step, by what they are spent on."""

    compute: float  # the forward and backward passes (matmuls and the operations between them)
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
    trainable = sum(trained_parameters(shape, setup))  # a composite's whole tower/projector counted as adapters
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


def sequence_exchange_seconds(shape: ModelShape, setup: Setup, target: Target) -> float:
    """Sequence parallelism's all-to-alls for one micro-batch (DeepSpeed Ulysses): in every layer's forward q, k
    and v go from a sequence split to a head split and the attention output comes back, and the backward moves
    their gradients the same way; a checkpointed layer's recompute runs its forward exchange again. Each process
    sends (N-1)/N of its part over its link; on the attention's critical path, so not hidden. (With fewer
    key/value heads than N, DeepSpeed repeats them first: more bytes than counted here.)"""
    n = setup.sequence_parallel
    if n == 1:
        return 0.0
    a = BYTES[setup.precision]
    layers = max(1, shape.num_layers)
    passes = 2 + setup.checkpointed_layers(layers) / layers
    per_layer = a * setup.local_tokens * (2 * shape.q_dim + 2 * shape.kv_dim) * (n - 1) / n
    return passes * layers * per_layer / ((target.interconnect_gbs or PCIE4_GBS) * 1e9)


def step_time(shape: ModelShape, setup: Setup, target: Target, workload: Workload) -> StepTime:
    """One optimizer step: the compute of each device's tokens, the bandwidth-bound optimizer update, and the
    exposed communication (``communication_seconds``).

    Compute on a target with a calibrated ``matmul_share`` (CUDA): FLOPs / (peak x matmul_share) + the streamed
    bytes (``streamed_bytes_per_token``) / memory bandwidth, so a small hidden size or a large vocabulary costs
    what its memory traffic costs; elsewhere FLOPs / (peak x MFU), the CPU's MFU measured against its own runs
    (benchmarks/PLAN_VS_MEASURED.md). A CPU or Mac with measured rates: ``measured_compute_seconds``.
    ``workload``: the data's mean length and share of trained positions."""
    tokens_per_sequence, trained_share = workload.tokens_per_sequence, workload.trained_share
    tokens = setup.micro_batch * setup.accumulation * tokens_per_sequence / setup.sequence_parallel  # per device
    seq_setup = dataclasses.replace(setup, seq_len=max(1, round(tokens_per_sequence)), trained_share=trained_share)
    flops = flops_per_token(shape, seq_setup) * tokens
    peak = target.tflops(setup.precision) * 1e12
    if target.rates is not None and target.mfu is None:
        compute = measured_compute_seconds(shape, seq_setup, tokens, target.rates)
    elif target.matmul_share is not None:
        compute = (flops / (peak * target.matmul_share)
                   + streamed_bytes_per_token(shape, seq_setup) * tokens / (target.bandwidth_gbs * 1e9))
    else:
        compute = flops / (peak * target.efficiency)
    trainable = sum(trained_parameters(shape, setup))
    streamed = trainable * OPTIMIZER_STREAM_BYTES[setup.optimizer]
    if setup.offload:  # every rank's shard is updated by the same host's memory system
        optimizer = streamed / (CPU_OPTIMIZER_GBS * 1e9)
    else:
        optimizer = streamed / setup.shards / (target.bandwidth_gbs * 1e9)
    head = shape.vocab_size * shape.hidden_size * (1 - trained_share)  # not run at untrained positions
    forward = 2 * (shape.active_matmul_params - head) + 4 * shape.num_layers * shape.q_dim * seq_setup.seq_len
    communication = communication_seconds(shape, setup, target, compute / max(1, setup.accumulation),
                                          forward / flops_per_token(shape, seq_setup))
    communication += setup.accumulation * sequence_exchange_seconds(shape, seq_setup, target)
    if setup.activation_offload and setup.device == "cuda":  # out and back, on the compute stream: not hidden
        micro_tokens = round(setup.micro_batch * tokens_per_sequence / setup.sequence_parallel)
        moved = offloaded_activation_bytes(shape, seq_setup, micro_tokens)
        communication += setup.accumulation * 2 * moved / (target.host_link_gbs * 1e9)
    return StepTime(compute, optimizer, communication)


def step_seconds(shape: ModelShape, setup: Setup, target: Target, workload: Workload) -> float:
    """Seconds per optimizer step (``step_time``'s total)."""
    return step_time(shape, setup, target, workload).total


def duration_text(seconds: float | None) -> str:
    if seconds is None:
        return "-"
    if seconds < 120:
        return f"{seconds:.0f} s"
    if seconds < 7200:
        return f"{seconds / 60:.0f} min"
    return f"{seconds / 3600:.1f} h"

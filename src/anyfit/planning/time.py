"""Time of one training step on a target machine: training FLOPs over the device's peak times a model-FLOPs
utilisation, the bandwidth-bound optimizer update, and the communication compute cannot hide."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from anyfit.model.shape import ModelShape
from anyfit.planning.presets import PCIE4_GBS, Target
from anyfit.planning.setup import CPU_OPTIMIZER_GBS, DDP_BUCKET_BYTES, OPTIMIZER_STREAM_BYTES, Setup


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


def duration_text(seconds: float | None) -> str:
    if seconds is None:
        return "-"
    if seconds < 120:
        return f"{seconds:.0f} s"
    if seconds < 7200:
        return f"{seconds / 60:.0f} min"
    return f"{seconds / 3600:.1f} h"

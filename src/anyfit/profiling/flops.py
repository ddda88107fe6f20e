"""Model FLOPs utilisation (MFU): the FLOPs a training step needs, over the time it took and the device's peak.

The FLOPs of one step, counted per example of the window (so padding, which is no useful work, never counts):

- **Body matmuls**, per real token. A linear layer of ``n`` weights costs ``2n`` FLOPs forward, ``2n`` for the
  gradient of its input and ``2n`` for the gradient of its weight. Full fine-tuning: ``6 N_body``. LoRA: the
  frozen base still runs forward and still passes the gradient to the layers below it (the adapters there
  need it), but computes no weight gradient: ``4 N_body``; each adapter parameter trains: ``+ 6 N_lora``.
  So ``N`` in "6N" is every matmul weight the token passes through, trainable or frozen, and only the
  weight-gradient third depends on what trains. In a mixture of experts that is the active weights: the linear
  layers (shared experts, dense layers) and the top_k routed experts the router sends the token to, not all.
- **Output head** (``vocab x hidden``), per *trained* token only: anyfit computes logits only where a loss is
  taken (transformers' ``logits_to_keep``), so prompt tokens never reach the head. ``6 V h`` when the head
  (or the tied embedding) trains, ``4 V h`` under LoRA.
- **Attention** (PaLM's count, no causal discount, as ``anyfit.planning.time.flops_per_token``): ``QK^T`` and
  ``AV`` are ``4 x layers x q_dim x len^2`` FLOPs forward per example, twice that backward: ``12 L q len^2``.
  Per example, because a packed row attends within each example only.
- Not counted: the recomputation of gradient checkpointing (MFU counts the model's FLOPs, not the hardware's:
  a checkpointed run does more work for the same MFU), norms, activations, softmax, the optimizer.

The peak: the dense throughput of the GPU in the run's precision from ``anyfit.planning.presets.cuda_peak``
(bf16/fp16 tensor cores; fp32 means TF32), or, on CPU and MPS where no datasheet figure applies, a dense
matmul measured on the device, the best seen on this machine (``best_matmul_tflops``: a timing taken while
the cores are shared reads low). Every process has one device: the run's
peak is the per-device peak times the process count.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from anyfit.model.shape import ModelShape
from anyfit.planning.presets import best_matmul_tflops, cuda_peak


@dataclass(frozen=True)
class ModelFlops:
    """FLOPs of a training step, from the lengths and trained tokens of its examples (see the module docstring)."""

    body_per_token: float  # matmul FLOPs per real token through the decoder body, forward and backward
    head_per_trained_token: float  # through the output head, per token that carries a loss
    attention_per_square: float  # x len^2 of each example

    @classmethod
    def of(cls, shape: ModelShape, lora_params: int = 0, in_experts: int = 0, split: bool = False) -> "ModelFlops":
        """``lora_params``: trainable adapter parameters (0: full fine-tuning, every weight trains); ``in_experts``:
        those on fused MoE expert tensors (``anyfit.model.moe.adapter_in_experts``): computed as base plus low-rank
        path (``split``, ``ModelShape.split_lora_flops``) or folded into the weight by PEFT, where the token's
        experts cost their weight gradient, and those adapters nothing per token (``ModelShape.lora_flops``)."""
        head = shape.vocab_size * shape.hidden_size
        body_weights = shape.active_body_params  # a mixture of experts: the token's top_k experts
        if lora_params:
            experts = shape.split_lora_flops(in_experts) if split else 2 * shape.folded_expert_params() * bool(in_experts)
            body, head_flops = 4 * body_weights + 6 * (lora_params - in_experts) + experts, 4 * head
        else:
            body, head_flops = 6 * body_weights, 6 * head
        return cls(float(body), float(head_flops), 12.0 * shape.num_layers * shape.q_dim)

    def of_examples(self, lengths, trained) -> float:
        """FLOPs of forward+backward over examples of these lengths with these trained-token counts."""
        lengths = np.asarray(lengths, dtype=np.float64)
        return float(self.body_per_token * lengths.sum() + self.head_per_trained_token * np.sum(trained)
                     + self.attention_per_square * np.square(lengths).sum())

    def of_window(self, lengths: np.ndarray, trained: np.ndarray, indices: list[list[int]]) -> float:
        """FLOPs of one process's accumulation window (``indices``: example indices per micro-batch)."""
        flat = [i for micro in indices for i in micro]
        return self.of_examples(lengths[flat], trained[flat])


@dataclass(frozen=True)
class DevicePeak:
    """The dense FLOP/s one device can do in the run's precision, and where the number comes from."""

    tflops: float
    source: str

    @property
    def flops_per_s(self) -> float:
        return self.tflops * 1e12

    def as_dict(self) -> dict:
        return {"peak_tflops_per_device": round(self.tflops, 4), "source": self.source}


def device_peak(device: str, precision: str, cuda_name: str = "") -> DevicePeak:
    """The peak MFU is measured against: the datasheet table for CUDA GPUs, a measured matmul on CPU and MPS."""
    if device == "cuda":
        cuda_name = cuda_name or torch.cuda.get_device_name()
        table, note = cuda_peak(cuda_name)
        tflops = table.get(precision) or table["fp32"]
        what = "TF32" if precision == "fp32" else precision
        return DevicePeak(tflops, f"{cuda_name}: dense {what} datasheet peak" + (f" ({note})" if note else ""))
    dtype = precision if device == "mps" else "fp32"  # the CPU trains in fp32 (the runtime policy's rule)
    tflops = best_matmul_tflops(device, dtype)
    return DevicePeak(tflops, f"{device}: {dtype} 1024x1024 matmul, the best measured on this machine")

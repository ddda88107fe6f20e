"""Micro-benchmarks behind two defaults: fused AdamW on CPU, and the chunked fp32 cross-entropy.

    uv run python benchmarks/kernels_cpu.py

1. One AdamW step over SmolLM2-135M-shaped fp32 parameters (30 x 7 matrices + a 49152 x 576 embedding),
   torch's default (foreach) implementation against ``fused=True``.
2. Forward + backward of the summed cross-entropy over N x 49152 logits: ``F.cross_entropy`` on upcast
   logits (what ``train.loss_chunk_tokens=0`` runs) against anyfit's chunked implementation: time (fp32
   logits) and the bytes autograd keeps for backward (bf16 logits, as under CUDA autocast).
Prints the mean of a few repetitions after a warm-up; run it on an otherwise idle machine.
"""

from __future__ import annotations

import time

import torch

from anyfit.training.loss import cross_entropy_sum


def timed(fn, reps: int) -> float:
    fn()  # warm-up (first-step state allocation, allocator)
    start = time.perf_counter()
    for _ in range(reps):
        fn()
    return (time.perf_counter() - start) / reps


def adamw_step() -> None:
    hidden, inter, layers, vocab = 576, 1536, 30, 49152
    shapes = [(hidden, hidden)] * 2 + [(hidden // 3, hidden)] * 2 + [(inter, hidden)] * 2 + [(hidden, inter)]
    params = [torch.nn.Parameter(torch.randn(s)) for _ in range(layers) for s in shapes]
    params.append(torch.nn.Parameter(torch.randn(vocab, hidden)))
    for p in params:
        p.grad = torch.randn_like(p)
    n = sum(p.numel() for p in params) / 1e6
    for fused in (False, True):
        opt = torch.optim.AdamW(params, lr=1e-5, fused=fused or None)
        print(f"AdamW step, {n:.0f}M fp32 parameters, {'fused' if fused else 'foreach (default)'}: "
              f"{timed(opt.step, 5):.3f} s")


def cross_entropy(vocab: int = 49152) -> None:
    for rows in (300, 2000):
        logits = torch.randn(rows, vocab, requires_grad=True)
        targets = torch.randint(0, vocab, (rows,))
        for chunk in (0, 4096, 1024):
            seconds = timed(lambda: cross_entropy_sum(logits, targets, chunk).backward(), 3)
            name = "F.cross_entropy" if chunk == 0 else f"chunked ({chunk} rows)"
            print(f"cross-entropy fwd+bwd, {rows} x {vocab} fp32 logits, {name}: {seconds:.3f} s")


def saved_bytes(rows: int = 2000, vocab: int = 151936) -> None:
    """Bytes held for backward by the loss on bf16 logits (Qwen's vocabulary), counted with autograd's hooks."""
    for chunk in (0, 4096):
        held = []

        def pack(t: torch.Tensor) -> torch.Tensor:
            held.append(t.numel() * t.element_size())
            return t

        logits = torch.randn(rows, vocab, dtype=torch.bfloat16, requires_grad=True)
        targets = torch.randint(0, vocab, (rows,))
        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            cross_entropy_sum(logits, targets, chunk)
        name = "F.cross_entropy on .float()" if chunk == 0 else f"chunked ({chunk} rows)"
        print(f"saved for backward, {rows} x {vocab} bf16 logits, {name}: {sum(held) / 2**30:.2f} GiB "
              f"(the logits themselves: {logits.numel() * 2 / 2**30:.2f} GiB)")


if __name__ == "__main__":
    print(f"torch {torch.__version__}, {torch.get_num_threads()} threads")
    adamw_step()
    cross_entropy()
    saved_bytes()

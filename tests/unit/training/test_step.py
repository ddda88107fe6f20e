"""The guarded optimizer step: a non-finite step is skipped, on the device with fused AdamW (no host sync)
or on the host otherwise, and counted."""

from __future__ import annotations

import pytest
import torch
from accelerate import Accelerator
from accelerate.optimizer import AcceleratedOptimizer

from anyfit.training.divergence import NonFiniteGuard
from anyfit.backends.base import guarded_step, is_finite_step, skips_on_device


@pytest.mark.parametrize("fused", [True, False])
def test_a_flagged_step_is_skipped_and_counted(fused):
    w = torch.nn.Parameter(torch.ones(3))
    opt = torch.optim.AdamW([w], lr=0.1, fused=fused or None)
    on_device = skips_on_device(opt, "fp32")
    assert on_device == fused
    guard = NonFiniteGuard(limit=2)
    for grad in (torch.tensor([1.0, 2.0, 3.0]), torch.tensor([float("nan"), 0.0, 0.0])):
        w.grad = grad
        before = w.detach().clone()
        flag = guarded_step(opt, is_finite_step(grad.sum(), grad.norm(), "fp32"), on_device)
        assert isinstance(flag, torch.Tensor) == on_device  # on the device, nothing was read back
        guard.add(flag)
    assert torch.equal(w.detach(), before)  # the flagged update left the weights alone
    assert opt.state[w]["step"].item() == 1  # and did not count as a step
    assert not hasattr(opt, "found_inf")  # the protocol attribute does not outlive the step
    guard.flush()
    assert (guard.skipped, guard.in_a_row, guard.exhausted) == (1, 1, False)


def test_accelerate_wrapped_optimizer_and_fp16():
    w = torch.nn.Parameter(torch.ones(2))
    wrapped = Accelerator(cpu=True).prepare(torch.optim.AdamW([w], lr=0.1, fused=True))
    assert isinstance(wrapped, AcceleratedOptimizer)
    assert skips_on_device(wrapped, "bf16") and not skips_on_device(wrapped, "fp16")  # fp16: the scaler's job
    w.grad = torch.tensor([float("inf"), 1.0])
    guarded_step(wrapped, is_finite_step(torch.tensor(1.0), w.grad.norm(), "bf16"), on_device=True)
    assert torch.equal(w.detach(), torch.ones(2))
    # under fp16 only the loss decides: a non-finite gradient norm is the loss scaler's to handle
    assert bool(is_finite_step(torch.tensor(1.0), torch.tensor(float("inf")), "fp16"))

"""A run killed with SIGKILL and resumed ends bit-identical to one never interrupted."""

from __future__ import annotations

import signal

import pytest
import torch
from launches import run_here
from tiny_runs import (
    STEPS,
    final_weights,
    metric_steps,
    resume_config,
    start_train,
    wait_for,
)

pytestmark = [pytest.mark.multirun]


@pytest.mark.parametrize("lora", [False, True], ids=["full", "lora"])
def test_sigkill_then_resume_is_bit_identical(lora, tiny_llama_dir, tmp_path):
    cfg = resume_config(tmp_path, tiny_llama_dir, lora)
    killed_out = tmp_path / "killed"
    victim = start_train(cfg, killed_out)
    # Kill hard as soon as a second checkpoint is complete: the process is somewhere in a later step.
    wait_for(lambda: (killed_out / "checkpoint-4" / "trainer_state.json").exists(), victim)
    victim.send_signal(signal.SIGKILL)
    victim.wait()
    assert victim.returncode == -signal.SIGKILL
    assert not (killed_out / "model.safetensors").exists() and not (killed_out / "adapter_model.safetensors").exists()

    # the resumed run and the one never interrupted: the same train() in this process (one torch thread, as the
    # killed process had), without two more interpreters' imports
    assert "resumed from" in run_here(cfg, killed_out, "train.resume=auto")
    run_here(cfg, tmp_path / "ref")
    a, b = final_weights(tmp_path / "ref"), final_weights(killed_out)
    assert a.keys() == b.keys()
    for k in a:
        assert torch.equal(a[k], b[k]), k  # bit-identical, not just close
    assert metric_steps(killed_out) == list(range(1, STEPS + 1))  # no step logged twice or lost


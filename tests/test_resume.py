"""Exact resume after a real SIGKILL, clean stop on SIGTERM, and non-finite steps skipped then diagnosed."""

from __future__ import annotations

import json
import math
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from anyfit.config import ConfigError, load_config
from anyfit.divergence import TrainingDiverged
from anyfit.loss import token_loss_sum
from anyfit.train import train

from test_train_e2e import write_dataset

ENV = {**os.environ, "OMP_NUM_THREADS": "1", "TOKENIZERS_PARALLELISM": "false"}
STEPS = 12


def _config(tmp_path: Path, model_dir: Path, lora: bool) -> Path:
    data = write_dataset(tmp_path / "d.jsonl", n=24)
    lora_yaml = "lora: {enabled: true, dropout: 0.2}\n" if lora else ""  # dropout: the RNG state matters
    p = tmp_path / "c.yaml"
    p.write_text(f"model: {{name_or_path: {model_dir}}}\ndata: {{path: {data}, template: plain}}\n{lora_yaml}"
                 f"train: {{effective_batch: 4, micro_batch: 2, max_steps: {STEPS}, learning_rate: 1.0e-3, "
                 "save_every: 2, keep_last: 2, seed: 0, log_every: 1}\n")
    return p


def _start(cfg: Path, out: Path, *extra: str) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-m", "anyfit", "train", str(cfg), f"train.output_dir={out}", *extra],
                            env=ENV, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def _weights(out: Path) -> dict[str, torch.Tensor]:
    name = "adapter_model.safetensors" if (out / "adapter_model.safetensors").exists() else "model.safetensors"
    return load_file(out / name)


def _wait_for(predicate, proc: subprocess.Popen, timeout: float = 120.0) -> None:
    t0 = time.time()
    while not predicate():
        assert proc.poll() is None, f"run ended before the event: {proc.communicate()[1][-2000:]}"
        assert time.time() - t0 < timeout, "timed out waiting"
        time.sleep(0.05)


def _metric_steps(out: Path) -> list[int]:
    path = out / "metrics.jsonl"
    return [json.loads(line)["step"] for line in path.read_text().splitlines()] if path.exists() else []


@pytest.mark.parametrize("lora", [False, True], ids=["full", "lora"])
def test_sigkill_then_resume_is_bit_identical(lora, tiny_llama_dir, tmp_path):
    cfg = _config(tmp_path, tiny_llama_dir, lora)
    ref = _start(cfg, tmp_path / "ref")
    killed_out = tmp_path / "killed"
    victim = _start(cfg, killed_out)
    # Kill hard as soon as a second checkpoint is complete: the process is somewhere in a later step.
    _wait_for(lambda: (killed_out / "checkpoint-4" / "trainer_state.json").exists(), victim)
    victim.send_signal(signal.SIGKILL)
    victim.wait()
    assert victim.returncode == -signal.SIGKILL
    assert not (killed_out / "model.safetensors").exists() and not (killed_out / "adapter_model.safetensors").exists()

    resumed = _start(cfg, killed_out, "train.resume=auto")
    out, err = resumed.communicate(timeout=300)
    assert resumed.returncode == 0, err[-3000:]
    assert "resumed from" in out
    ref.communicate(timeout=300)
    assert ref.returncode == 0
    a, b = _weights(tmp_path / "ref"), _weights(killed_out)
    assert a.keys() == b.keys()
    for k in a:
        assert torch.equal(a[k], b[k]), k  # bit-identical, not just close
    assert _metric_steps(killed_out) == list(range(1, STEPS + 1))  # no step logged twice or lost


def test_sigterm_saves_and_exits_cleanly_then_resumes(tiny_llama_dir, tmp_path):
    cfg = _config(tmp_path, tiny_llama_dir, lora=False)
    out = tmp_path / "run"
    proc = _start(cfg, out, "train.save_every=0")
    _wait_for(lambda: len(_metric_steps(out)) >= 3, proc)
    proc.send_signal(signal.SIGTERM)
    stdout, stderr = proc.communicate(timeout=120)
    assert proc.returncode == 0, stderr[-2000:]
    assert "SIGTERM received" in stdout and "train.resume=auto" in stdout
    ckpts = sorted(out.glob("checkpoint-*"))
    assert len(ckpts) == 1
    stopped_at = int(ckpts[0].name.split("-")[1])
    assert 3 <= stopped_at < STEPS and _metric_steps(out)[-1] == stopped_at
    # a plain restart into the same folder is refused; resuming finishes the run
    again = _start(cfg, out)
    assert again.wait(timeout=60) == 2 and "already holds a run" in again.stderr.read()
    done = _start(cfg, out, "train.resume=auto", "train.save_every=0")
    assert done.wait(timeout=300) == 0
    assert _metric_steps(out) == list(range(1, STEPS + 1))


def test_resume_from_a_bad_path_is_explained(tmp_path):
    cfg = load_config(None, ["model.name_or_path=x", "data.path=y.jsonl", f"train.output_dir={tmp_path}",
                             f"train.resume={tmp_path / 'checkpoint-9'}"])
    with pytest.raises(ConfigError, match="not a complete checkpoint"):
        train(cfg)


def _nan_at(steps: set[int]):
    calls = {"n": 0}

    def loss_fn(model, batch):
        calls["n"] += 1
        loss = token_loss_sum(model, batch)
        return loss * float("nan") if calls["n"] in steps else loss

    return loss_fn


def test_nonfinite_steps_are_skipped(tiny_qwen2_dir, tmp_path):
    data = write_dataset(tmp_path / "d.jsonl")
    cfg = load_config(None, [f"model.name_or_path={tiny_qwen2_dir}", f"data.path={data}", "data.template=plain",
                             f"train.output_dir={tmp_path / 'o'}", "train.effective_batch=4", "train.micro_batch=4",
                             "train.max_steps=6", "train.log_every=1"])
    result = train(cfg, loss_fn=_nan_at({3, 4}))
    assert result.skipped_steps == 2
    assert all(torch.isfinite(p).all() for p in result.model.parameters())
    metrics = [json.loads(x) for x in (tmp_path / "o" / "metrics.jsonl").read_text().splitlines()]
    assert math.isnan(metrics[2]["loss"]) and math.isfinite(metrics[4]["loss"]) and metrics[-1]["skipped_steps"] == 2


def test_persistent_nonfinite_stops_with_a_diagnosis(tiny_qwen2_dir, tmp_path):
    data = write_dataset(tmp_path / "d.jsonl")
    cfg = load_config(None, [f"model.name_or_path={tiny_qwen2_dir}", f"data.path={data}", "data.template=plain",
                             f"train.output_dir={tmp_path / 'o'}", "train.effective_batch=4", "train.micro_batch=4",
                             "train.max_steps=10", "train.save_every=2", "train.learning_rate=0.5",
                             "train.log_every=1"])
    with pytest.raises(TrainingDiverged) as e:
        train(cfg, loss_fn=_nan_at(set(range(5, 100))))
    msg = str(e.value)
    assert "3 optimizer steps in a row" in msg and "Device cpu" in msg and "learning rate 0.5" in msg
    # the newest checkpoint (written during the streak, whose updates were all skipped) is named and kept
    assert "checkpoint-6" in msg and (tmp_path / "o" / "checkpoint-6" / "trainer_state.json").exists()


def test_fused_adamw_skips_a_flagged_step_on_the_device():
    """The protocol the loop relies on to skip non-finite updates without a host sync (fused AdamW)."""
    from anyfit.divergence import NonFiniteGuard

    w = torch.nn.Parameter(torch.ones(3))
    opt = torch.optim.AdamW([w], lr=0.1, fused=True)
    guard = NonFiniteGuard(limit=2)
    for grad in (torch.tensor([1.0, 2.0, 3.0]), torch.tensor([float("nan"), 0.0, 0.0])):
        w.grad = grad
        finite = torch.isfinite(grad).all()
        opt.found_inf = (~finite).float()
        before = w.detach().clone()
        opt.step()
        del opt.found_inf
        guard.defer(finite)
    assert torch.equal(w.detach(), before)  # the flagged update left the weights alone
    assert opt.state[w]["step"].item() == 1  # and did not count as a step
    assert guard.skipped == 0
    guard.flush()
    assert (guard.skipped, guard.in_a_row, guard.exhausted) == (1, 1, False)

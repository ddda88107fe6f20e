"""Stopping: SIGTERM saves and resumes, bad resume paths, non-finite steps skipped or diagnosed."""

from __future__ import annotations

import json
import math
import signal

import pytest
import torch
from tiny_runs import (
    HANG_S,
    STEPS,
    metric_steps,
    resume_config,
    start_train,
    wait_for,
    write_dataset,
)

from anyfit.config import ConfigError, load_config
from anyfit.training.divergence import TrainingDiverged
from anyfit.training.loop import train
from anyfit.training.loss import token_loss_sum


@pytest.mark.multirun
def test_sigterm_saves_and_exits_cleanly_then_resumes(tiny_llama_dir, tmp_path):
    """The signal to a real process; the resume through the CLI in this process (its exit status)."""
    from anyfit.cli import main

    cfg = resume_config(tmp_path, tiny_llama_dir, lora=False)
    out = tmp_path / "run"
    proc = start_train(cfg, out, "train.save_every=0")
    wait_for(lambda: len(metric_steps(out)) >= 3, proc)
    proc.send_signal(signal.SIGTERM)
    stdout, stderr = proc.communicate(timeout=HANG_S)
    assert proc.returncode == 0, stderr[-2000:]
    assert "SIGTERM received" in stdout and "train.resume=auto" in stdout
    ckpts = sorted(out.glob("checkpoint-*"))
    assert len(ckpts) == 1
    stopped_at = int(ckpts[0].name.split("-")[1])
    assert 3 <= stopped_at < STEPS and metric_steps(out)[-1] == stopped_at
    # resuming finishes the run (a plain restart into the folder is refused: tests/integration/test_bad_input.py)
    assert main(["train", str(cfg), f"train.output_dir={out}", "train.resume=auto", "train.save_every=0"]) == 0
    assert metric_steps(out) == list(range(1, STEPS + 1))



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



@pytest.mark.slow
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



@pytest.mark.slow
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


@pytest.mark.slow
def test_resume_auto_skips_a_damaged_newest_checkpoint(tiny_llama_dir, tmp_path, capsys):
    """The newest checkpoint cut short (a full disk, a copy interrupted): resume=auto names it, takes the one
    before and finishes the run."""
    cfg, steps = resume_config(tmp_path, tiny_llama_dir, lora=False), 6
    out = tmp_path / "run"
    args = [f"train.output_dir={out}", f"train.max_steps={steps}"]
    train(load_config(cfg, args), echo=lambda *a: None)
    assert {p.name for p in out.glob("checkpoint-*")} == {"checkpoint-2", "checkpoint-4"}
    newest = out / "checkpoint-4" / "model.safetensors"
    newest.write_bytes(newest.read_bytes()[:1000])
    # naming the damaged checkpoint explicitly is refused in one line
    with pytest.raises(ConfigError, match="model.safetensors has 1000 bytes"):
        train(load_config(cfg, [*args, f"train.resume={newest.parent}"]))
    lines = []
    result = train(load_config(cfg, [*args, "train.resume=auto"]), echo=lines.append)
    said = "\n".join(lines) + capsys.readouterr().err
    assert f"skipping checkpoint {newest.parent}: model.safetensors has 1000 bytes" in said
    assert f"resumed from {out / 'checkpoint-2'} at step 2" in said
    assert result.steps == steps and metric_steps(out) == list(range(1, steps + 1))

"""Watching a run: the metrics go to experiment trackers (through Accelerate's), and the curves to a picture."""

from __future__ import annotations

import json

import pytest
from tiny_runs import config_for, write_dataset

from anyfit.cli import main
from anyfit.config import ConfigError
from anyfit.training.loop import train
from anyfit.training.metrics import requested_trackers


def _png(path) -> bool:
    return path.is_file() and path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and path.stat().st_size > 5000


@pytest.mark.slow
def test_tensorboard_gets_the_metrics_lines_and_the_run_draws_its_curves(tiny_qwen2_dir, tmp_path, capsys):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    data = write_dataset(tmp_path / "d.jsonl", n=20)
    out = tmp_path / "run"
    train(config_for(tiny_qwen2_dir, data, out, "train.effective_batch=4", "train.micro_batch=2",
                     "train.max_steps=4", "train.report_to=tensorboard", "eval.holdout=4", "eval.every=2"),
          echo=lambda *a: None)
    events = list((out / "logs").rglob("events.out.tfevents.*"))
    assert events, list(out.rglob("*"))
    acc = EventAccumulator(str(events[0].parent))
    acc.Reload()
    logged = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    losses = [(r["step"], r["loss"]) for r in logged if "loss" in r]
    assert [(e.step, round(e.value, 4)) for e in acc.Scalars("loss")] == [(s, round(v, 4)) for s, v in losses]
    assert [e.step for e in acc.Scalars("val_loss")] == [2, 4]
    assert {"cpu_percent", "peak_mem_gib", "tokens_per_s"} <= set(acc.Tags()["scalars"])
    assert _png(out / "loss.png")  # drawn at the end of the run

    assert main(["plot", str(out), "--out", str(tmp_path / "again.png")]) == 0
    assert _png(tmp_path / "again.png")


def test_tracker_choices_are_checked_before_anything_loads(tmp_path, capsys, monkeypatch):
    assert requested_trackers("none") == [] and requested_trackers(["tensorboard"]) == ["tensorboard"]
    monkeypatch.setattr("accelerate.utils.is_wandb_available", lambda: False)  # as where wandb is not installed
    with pytest.raises(ConfigError, match="wandb is not installed.*anyfit\\[wandb\\]"):
        requested_trackers(["tensorboard", "wandb"])
    assert main(["plot", str(tmp_path)]) == 2
    assert "no metrics.jsonl" in capsys.readouterr().err

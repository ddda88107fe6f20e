"""Faults that lose nothing, made for real: a second run on a live run's folder, a killed run's leftover lock."""

from __future__ import annotations

import signal

import pytest
from tiny_runs import STEPS, metric_steps, resume_config, start_train, wait_for

from anyfit.runfolder import LOCK


@pytest.mark.multirun
def test_a_second_run_on_a_live_runs_folder_is_refused_and_a_killed_runs_lock_blocks_nothing(tiny_llama_dir,
                                                                                            tmp_path):
    cfg = resume_config(tmp_path, tiny_llama_dir, lora=False)
    out = tmp_path / "run"
    first = start_train(cfg, out, "train.max_steps=100000")  # long enough to be live whatever the machine's speed
    wait_for(lambda: len(metric_steps(out)) >= 2, first)
    config_before = (out / "config.yaml").read_text()
    # overwrite=true would clear the folder: the lock is checked before anything is touched
    second = start_train(cfg, out, "train.overwrite=true")
    assert second.wait(timeout=120) == 2
    lines = second.stderr.read().strip().splitlines()
    assert lines[-1].startswith(f"anyfit: error: train.output_dir {out} is in use by a run that is still going "
                                f"(process {first.pid} on ")
    assert not any("Traceback" in line for line in lines)
    logged = len(metric_steps(out))
    wait_for(lambda: len(metric_steps(out)) > logged + 1, first)  # the first run goes on, its files untouched
    assert (out / "config.yaml").read_text() == config_before
    first.send_signal(signal.SIGKILL)  # a crash: the lock file stays, the kernel drops the lock
    first.wait(timeout=60)
    assert (out / LOCK).exists()
    done = start_train(cfg, out, "train.overwrite=true", "train.save_every=0")
    assert done.wait(timeout=300) == 0, done.stderr.read()[-2000:]
    assert metric_steps(out) == list(range(1, STEPS + 1))

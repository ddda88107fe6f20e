"""Faults that lose nothing, made for real: a second run on a live run's folder, a killed run's leftover lock, a
full disk (a real small tmpfs where one can be mounted) and writes that fail part-way (a file-size limit)."""

from __future__ import annotations

import os
import resource
import signal
import subprocess
import sys
from pathlib import Path

import pytest
from tiny_runs import ENV, HANG_S, metric_steps, resume_config, start_train, wait_for

from anyfit.runfolder import LOCK, RunLock
from anyfit.training.checkpoints.integrity import checkpoint_problem


@pytest.mark.multirun
def test_a_second_run_on_a_live_runs_folder_is_refused_and_a_killed_runs_lock_blocks_nothing(tiny_llama_dir,
                                                                                            tmp_path, capsys):
    """The first run a real process (it is paused, then killed); the second ``anyfit train`` through the CLI in this
    process, refused by the first's lock."""
    from anyfit.cli import main

    cfg = resume_config(tmp_path, tiny_llama_dir, lora=False)
    out = tmp_path / "run"
    first = start_train(cfg, out, "train.max_steps=100000")  # long enough to be live whatever the machine's speed
    wait_for(lambda: len(metric_steps(out)) >= 2, first)
    config_before = (out / "config.yaml").read_text()
    # Paused while the second run starts (a live process holds its lock whether it runs or not; running, it would
    # take a core from the second's start-up for nothing)
    first.send_signal(signal.SIGSTOP)
    # overwrite=true would clear the folder: the lock is checked before anything is touched
    capsys.readouterr()
    assert main(["train", str(cfg), f"train.output_dir={out}", "train.overwrite=true"]) == 2
    first.send_signal(signal.SIGCONT)
    lines = capsys.readouterr().err.strip().splitlines()
    assert lines[-1].startswith(f"anyfit: error: train.output_dir {out} is in use by a run that is still going "
                                f"(process {first.pid} on ")
    assert not any("Traceback" in line for line in lines)
    logged = len(metric_steps(out))
    wait_for(lambda: len(metric_steps(out)) > logged + 1, first)  # the first run goes on, its files untouched
    assert (out / "config.yaml").read_text() == config_before
    first.send_signal(signal.SIGKILL)  # a crash: the lock file stays, the kernel drops the lock
    first.wait(timeout=HANG_S)
    assert (out / LOCK).exists()
    with RunLock(out):  # what the next run takes first: the leftover file blocks nothing
        assert str(os.getpid()) in (out / LOCK).read_text()


def _file_size_limit(limit: int):
    """In the child: files can grow to ``limit`` bytes, then a write fails with EFBIG (SIGXFSZ ignored), as a
    full disk's ENOSPC fails it: the same writers, the same error paths, no root needed."""
    def apply() -> None:
        resource.setrlimit(resource.RLIMIT_FSIZE, (limit, limit))
        signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
    return apply


def _small_filesystem(path: Path, size: int) -> bool:
    """A real tmpfs of ``size`` bytes at ``path`` (needs root: False where it cannot be mounted)."""
    path.mkdir()
    if os.geteuid() != 0:
        return False
    return subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", str(path)],
                          capture_output=True).returncode == 0


@pytest.fixture(scope="module")
def sizes(full_vocab_llama_dir, tmp_path_factory):
    """What a checkpoint of the tiny model with Qwen's whole vocabulary takes on disk, from its weights file: the
    weights again (fp32, as loaded) and AdamW's two fp32 states per weight, plus small files (about 1 MB with the
    tokenizer; the weights, 20 MB, are most of it, so the file system below can be sized between checkpoints)."""
    weights = (full_vocab_llama_dir / "model.safetensors").stat().st_size
    cfg = resume_config(tmp_path_factory.mktemp("sizes"), full_vocab_llama_dir, lora=False)
    return {"cfg": cfg, "weights": weights, "checkpoint": 3 * weights + 2**20}


def _train_with(cfg: Path, out: Path, steps: int, preexec=None) -> subprocess.CompletedProcess:
    """``steps`` steps with a checkpoint every 2 (none at the end: the final model is written instead)."""
    return subprocess.run([sys.executable, "-m", "anyfit", "train", str(cfg), f"train.output_dir={out}",
                           f"train.max_steps={steps}"], env=ENV, capture_output=True, text=True, preexec_fn=preexec,
                          timeout=HANG_S)


@pytest.mark.multirun
def test_a_full_disk_skips_a_checkpoint_in_one_line_and_keeps_the_earlier_one(sizes, tmp_path, capsys):
    """``anyfit train`` in this process (the CLI's own entry point: its exit status and what it prints), on a real
    small file system."""
    from anyfit.cli import main

    mount = tmp_path / "small"
    # room for one checkpoint and the final model, not for a second checkpoint beside them
    if not _small_filesystem(mount, sizes["checkpoint"] + sizes["weights"] + sizes["checkpoint"] // 2):
        pytest.skip("no small file system can be mounted here (not root): the write-failure cases still run")
    try:
        out = mount / "run"
        assert main(["train", str(sizes["cfg"]), f"train.output_dir={out}", "train.max_steps=6"]) == 0
        done = capsys.readouterr()
        warning = [line for line in done.out.splitlines() if "[anyfit] warning: checkpoint-4" in line]
        assert len(warning) == 1 and f"checkpoint-4 was not written to {out}: no room: it needs about" in warning[0]
        assert "checkpoint-2, is intact" in warning[0] and "anyfit: error" not in done.err
        assert sorted(p.name for p in out.iterdir() if "checkpoint" in p.name) == ["checkpoint-2"]
        assert checkpoint_problem(out / "checkpoint-2", full=True) is None  # what a resume checks, every byte
        assert (out / "model.safetensors").is_file()  # the run went on to its end
    finally:
        subprocess.run(["umount", str(mount)], capture_output=True)


@pytest.mark.multirun
def test_a_write_that_fails_midway_is_one_line_and_leaves_nothing_half_written(sizes, tmp_path):
    """Files capped below the weights' size: the checkpoint fails part-way (a warning, training goes on), then
    the final model cannot be written either: that loss is said in one line, exit 1. (A cap that only the
    optimizer state passes would end well: the small file system case shows a run going on to its end.)"""
    out = tmp_path / "run"
    done = _train_with(sizes["cfg"], out, 4, _file_size_limit(sizes["weights"] // 2))
    assert "Traceback" not in done.stderr, done.stderr[-3000:]
    assert not list(out.glob(".tmp-checkpoint-*"))
    warnings = [line for line in done.stdout.splitlines() if "[anyfit] warning: checkpoint-" in line]
    assert len(warnings) == 1 and "was not written" in warnings[0] and "writing failed (" in warnings[0]
    assert "no earlier checkpoint exists" in warnings[0]
    assert done.returncode == 1
    line = done.stderr.strip().splitlines()[-1]
    assert line.startswith(f"anyfit: error: the final model was not written to {out}: writing failed (")
    assert not (out / "model.safetensors").exists() and (out / "metrics.jsonl").is_file()

"""keep-last-K deletes an old checkpoint whole or not at all: renamed to ``.deleting-checkpoint-N`` first, then
removed. Every state a kill can leave (renamed and whole, renamed and half-removed) is taken for a checkpoint by
nothing (listing, resume=auto, export's advice, a model path), and is removed by the next prune or run."""

from __future__ import annotations

import json
import os
import signal
from pathlib import Path

import pytest

from anyfit.runfolder import RunLock, checkpoint_dirs
from anyfit.training.checkpoints.checkpoint import prune
from anyfit.training.checkpoints.integrity import complete_checkpoints, resolve_resume, write_manifest

FILES = ("model.safetensors", "optimizer.pt", "scheduler.pt", "rng_state_0.pt", "config.yaml")


def checkpoint(run: Path, step: int) -> Path:
    """A checkpoint's files (their bytes do not matter here) and its manifest, written last as anyfit does."""
    folder = run / f"checkpoint-{step}"
    folder.mkdir(parents=True)
    for name in FILES:
        (folder / name).write_bytes(os.urandom(64))
    (folder / "trainer_state.json").write_text(json.dumps({"step": step}))
    write_manifest(folder)
    return folder


def leftover(run: Path, step: int, files: tuple[str, ...] = FILES) -> Path:
    """What a prune killed after its rename leaves: the hidden folder, whole or with only ``files`` still in it."""
    folder = checkpoint(run, step)
    for path in folder.iterdir():
        if path.name not in (*files, "manifest.json"):
            path.unlink()
    return folder.rename(run / f".deleting-checkpoint-{step}")


@pytest.mark.parametrize("files", [FILES, ("model.safetensors",), ()], ids=["renamed", "half-removed", "emptied"])
def test_a_killed_prunes_leftover_is_no_checkpoint_and_goes_at_the_next_prune(tmp_path, files):
    from anyfit.export.request import _refuse_unfinished_run
    from anyfit.model.source import locate_model

    run = tmp_path / "run"
    kept = checkpoint(run, 4)
    hidden = leftover(run, 2, files)
    (run / "config.yaml").write_text("train: {max_steps: 8}\n")
    assert checkpoint_dirs(run) == complete_checkpoints(run, full=True) == [kept]
    assert resolve_resume("auto", run) == kept
    with pytest.raises(Exception, match=r"newest complete checkpoint \(.*checkpoint-4\)") as refused:
        _refuse_unfinished_run(run)
    assert "deleting" not in str(refused.value)
    with pytest.raises(Exception, match=r"the newest is .*checkpoint-4"):
        locate_model(run)
    checkpoint(run, 6)
    prune(run, keep_last=1)
    assert sorted(p.name for p in run.iterdir()) == ["checkpoint-6", "config.yaml"] and not hidden.exists()


def test_the_next_run_removes_what_a_killed_prune_or_save_left(tmp_path):
    run = tmp_path / "run"
    kept = checkpoint(run, 4)
    leftover(run, 2, ("model.safetensors",))
    (run / ".tmp-checkpoint-6").mkdir()  # a save killed before its rename
    (run / ".tmp-checkpoint-6" / "model.safetensors").write_bytes(b"part")
    with RunLock(run):
        assert sorted(p.name for p in run.iterdir()) == [".anyfit-run.lock", kept.name]


def _prune_killed_after_one_file(run: Path) -> int:
    """``prune(run, keep_last=1)`` in a forked child that SIGKILLs itself right after it deletes its first file
    (forked: it has every module imported already); the child's wait status."""
    pid = os.fork()
    if pid == 0:  # the child: never returns into pytest
        try:
            unlink = os.unlink

            def unlink_then_die(*args, **kwargs):
                unlink(*args, **kwargs)
                os.kill(os.getpid(), signal.SIGKILL)

            os.unlink = unlink_then_die
            prune(run, keep_last=1)
        finally:
            os._exit(3)  # reached only when nothing was deleted
    return os.waitpid(pid, 0)[1]


def test_a_prune_killed_in_the_middle_leaves_no_checkpoint_without_its_files(tmp_path):
    """A real SIGKILL after the first file is deleted (before: a checkpoint-2 with its manifest and weights but not
    all of its files, which other tools take for a checkpoint)."""
    run = tmp_path / "run"
    old, kept = checkpoint(run, 2), checkpoint(run, 4)
    status = _prune_killed_after_one_file(run)
    assert os.WIFSIGNALED(status) and os.WTERMSIG(status) == signal.SIGKILL, status
    hidden = run / ".deleting-checkpoint-2"
    assert not old.exists() and hidden.is_dir() and 0 < len(list(hidden.iterdir())) < len(FILES) + 2
    assert checkpoint_dirs(run) == [kept] and resolve_resume("auto", run) == kept
    prune(run, keep_last=1)
    assert sorted(p.name for p in run.iterdir()) == ["checkpoint-4"]

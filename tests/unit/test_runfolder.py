"""The run folder's one reader: metrics lines cut short by a crash, checkpoint names, run_info."""

from __future__ import annotations

import json
import os

import pytest

from anyfit.config import ConfigError
from anyfit.durable import follow_umask
from anyfit.runfolder import (
    LOCK,
    RunLock,
    checkpoint_dirs,
    checkpoint_step,
    read_metrics,
    read_run_info,
    run_of,
    write_metrics,
)


def write_lines(folder, *lines):
    (folder / "metrics.jsonl").write_text("".join(line + "\n" for line in lines))


def test_a_last_line_cut_short_by_a_crash_is_skipped(tmp_path):
    write_lines(tmp_path, '{"step": 1, "loss": 2.0}', '{"step": 2, "loss": 1.5}', '{"step": 3, "lo')
    assert [r["step"] for r in read_metrics(tmp_path)] == [1, 2]


def test_a_bad_line_in_the_middle_names_file_and_line(tmp_path):
    write_lines(tmp_path, '{"step": 1, "loss": 2.0}', "not json", '{"step": 3, "loss": 1.0}')
    with pytest.raises(ConfigError, match=r"metrics.jsonl:2: not a JSON line"):
        read_metrics(tmp_path)
    write_lines(tmp_path, '{"step": 1}', "[1, 2]", '{"step": 3}')
    with pytest.raises(ConfigError, match=r"metrics.jsonl:2: not a metrics record"):
        read_metrics(tmp_path)


def test_up_to_a_checkpoint_and_rewritten(tmp_path):
    assert read_metrics(tmp_path) == []  # no file yet
    write_lines(tmp_path, *(json.dumps({"step": s, "loss": 1.0 / s}) for s in range(1, 6)), '{"step": 6, "l')
    kept = read_metrics(tmp_path, up_to_step=3)
    assert [r["step"] for r in kept] == [1, 2, 3]
    write_metrics(tmp_path, kept)  # what a resumed run does: the cut line is gone too
    assert (tmp_path / "metrics.jsonl").read_text().count("\n") == 3
    assert read_metrics(tmp_path) == kept


def test_checkpoint_names(tmp_path):
    for name in ("checkpoint-10", "checkpoint-2", "checkpoint-x", ".tmp-checkpoint-12"):
        (tmp_path / name).mkdir()
    (tmp_path / "checkpoint-3").write_text("a file, not a checkpoint")
    assert [p.name for p in checkpoint_dirs(tmp_path)] == ["checkpoint-2", "checkpoint-10"]
    assert checkpoint_step(tmp_path / "checkpoint-10") == 10 and checkpoint_step(tmp_path / "model") is None
    assert run_of(tmp_path / "checkpoint-10") == (tmp_path, 10) and run_of(tmp_path) == (tmp_path, None)
    assert checkpoint_dirs(tmp_path / "missing") == []


def test_run_info_that_cannot_be_read_is_empty(tmp_path):
    assert read_run_info(tmp_path) == {}
    (tmp_path / "run_info.json").write_text("{cut")
    assert read_run_info(tmp_path) == {}
    (tmp_path / "run_info.json").write_text('{"steps": 4}')
    assert read_run_info(tmp_path) == {"steps": 4}


def test_the_run_lock_is_held_once_and_gone_when_released(tmp_path):
    out = tmp_path / "run"
    with RunLock(out):
        assert "process" in (out / LOCK).read_text()
        with pytest.raises(ConfigError, match=r"is in use by a run that is still going \(process \d+ on "):
            with RunLock(out):
                pass
    assert not out.exists()  # created for the run, and the run wrote nothing: no folder left
    out.mkdir()
    (out / "keep.txt").write_text("x")
    with RunLock(out):
        pass
    assert [p.name for p in out.iterdir()] == ["keep.txt"]  # a folder that was there stays as it was
    with RunLock(out, enabled=False):  # the other processes of a run take no lock
        with RunLock(out):
            pass


def test_follow_umask_opens_up_a_private_folder_and_its_files(tmp_path):
    folder = tmp_path / "model"
    folder.mkdir(mode=0o700)
    (folder / "w.safetensors").write_bytes(b"x")
    (folder / "w.safetensors").chmod(0o600)
    (folder / "checkpoint-2").mkdir(mode=0o700)  # below the top level: written under the umask, left alone
    mask = os.umask(0o027)
    try:
        follow_umask(folder)
    finally:
        os.umask(mask)
    assert folder.stat().st_mode & 0o777 == 0o750
    assert (folder / "w.safetensors").stat().st_mode & 0o777 == 0o640
    assert (folder / "checkpoint-2").stat().st_mode & 0o777 == 0o700

"""Inside a restarted job an unset train.resume means auto, and a folder the dead attempt left before its first
checkpoint may be started over only when it holds this very config."""

from __future__ import annotations

from anyfit.training.checkpoints.start import earlier_attempt, local_restarts, resume_spec


def test_the_restart_count_of_torchrun_or_slurm():
    assert local_restarts({}) == 0
    assert local_restarts({"TORCHELASTIC_RESTART_COUNT": "1"}) == 1
    assert local_restarts({"SLURM_RESTART_COUNT": "3", "TORCHELASTIC_RESTART_COUNT": "0"}) == 3
    assert local_restarts({"SLURM_RESTART_COUNT": "x"}) == 0


def test_unset_resume_is_auto_only_inside_a_restart():
    said = []
    assert resume_spec(None, 0, said.append) is None
    assert resume_spec("path/checkpoint-4", 1, said.append) == "path/checkpoint-4"  # what the user set wins
    assert not said
    assert resume_spec(None, 1, said.append) == "auto"
    assert "restart 1" in said[0]


def test_an_earlier_attempts_folder_is_recognised_by_its_config(tmp_path):
    (tmp_path / "config.yaml").write_text("a: 1\n")
    assert earlier_attempt(tmp_path, "a: 1\n", restarts=1)
    assert not earlier_attempt(tmp_path, "a: 1\n", restarts=0)
    assert not earlier_attempt(tmp_path, "a: 2\n", restarts=1)  # another run's folder stays protected
    assert not earlier_attempt(tmp_path / "none", "a: 1\n", restarts=1)

"""A resume that knows what changed: edited or appended data is refused with what differs (or continued on the new
data when asked, with the note recorded), every changed setting is named and applied as the README says (a new
learning rate or length: the new schedule from the resumed step on, checked against a fresh run's logged
learning rates) or refused in one line, and config.yaml / run_info.json record what the run did.

One short run with a checkpoint at step 2 is made once; each test continues a copy of it."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import yaml
from tiny_runs import read_metrics, write_dataset

from anyfit.cli import main

pytestmark = pytest.mark.slow

RUN = ["data.template=plain", "train.seed=0", "train.log_every=1", "train.effective_batch=4", "train.micro_batch=2",
       "train.max_steps=4", "train.save_every=2", "train.keep_last=5", "train.learning_rate=1e-2",
       "train.lr_schedule=cosine", "train.warmup_steps=1"]


def _train(model_dir: Path, data: Path, out: Path, *extra: str) -> int:
    return main(["train", f"model.name_or_path={model_dir}", f"data.path={data}", f"train.output_dir={out}", *RUN,
                 *extra])


@pytest.fixture(scope="module")
def original(tiny_llama_dir, tmp_path_factory) -> tuple[Path, Path, Path]:
    """(model, data, run folder) of a finished 4-step run with checkpoints at steps 2 and 4... (the last step writes
    the final model instead): checkpoint-2."""
    folder = tmp_path_factory.mktemp("original")
    data = write_dataset(folder / "d.jsonl", n=16)
    assert _train(tiny_llama_dir, data, folder / "run") == 0
    assert (folder / "run" / "checkpoint-2").is_dir()
    return tiny_llama_dir, data, folder / "run"


def _copy(original, tmp_path: Path, data_lines: list[str] | None = None) -> tuple[Path, Path]:
    """A copy of the original run folder to resume, and its data (a copy edited to ``data_lines``, if given). The
    copy is in another folder, which the resume names (``train.output_dir``: the run goes on there)."""
    _, data, run = original
    out = tmp_path / "run"
    shutil.copytree(run, out)
    if data_lines is None:
        return out, data
    new_data = tmp_path / "d.jsonl"
    new_data.write_text("".join(data_lines))
    return out, new_data


def _resume(original, out: Path, data: Path, *extra: str) -> int:
    return _train(original[0], data, out, f"train.resume={out / 'checkpoint-2'}", *extra)


def _lines(text: str, prefix: str) -> list[str]:
    return [line for line in text.splitlines() if line.startswith(prefix)]


def _changed(line: str) -> list[str]:
    """The settings a resume line names (``key old -> new``), without the copied folder's train.output_dir."""
    said = line.split("changed since the checkpoint: ", 1)[1]
    return sorted(w for w in said.replace(",", " ").split() if "." in w and w.split(".")[0] in
                  ("model", "data", "lora", "train", "eval", "runtime") and w != "train.output_dir")


def test_an_unchanged_resume_names_nothing_and_continues_the_run(original, tmp_path, capsys):
    out, data = _copy(original, tmp_path)
    capsys.readouterr()
    assert _resume(original, out, data) == 0
    (line,) = _lines(capsys.readouterr().out, "[anyfit] resume:")  # the copy's folder: the run goes on there
    assert _changed(line) == [] and "train.output_dir" in line
    assert read_metrics(out) == read_metrics(original[2])[:2] + read_metrics(out)[2:]
    assert [m["loss"] for m in read_metrics(out)] == [m["loss"] for m in read_metrics(original[2])]
    assert json.loads((out / "run_info.json").read_text())["resumes"] == [
        {"step": 2, "from": str(out / "checkpoint-2"), "changed": {"train.output_dir": {
            "before": str(original[2]), "after": str(out), "done": "the run goes on in the new folder"}}}]


def test_a_new_learning_rate_and_length_follow_the_new_schedule_from_the_resumed_step(original, tmp_path, capsys):
    out, data = _copy(original, tmp_path)
    new = ["train.learning_rate=5e-3", "train.max_steps=6"]
    capsys.readouterr()
    assert _resume(original, out, data, *new) == 0
    (line,) = _lines(capsys.readouterr().out, "[anyfit] resume:")
    assert "train.learning_rate 0.01 -> 0.005" in line and "train.max_steps 4 -> 6" in line
    assert _changed(line) == ["train.learning_rate", "train.max_steps"]
    assert "new schedule from the resumed step on" in line
    # the learning rate of every step after the resume is the one a run configured so from the start logs
    fresh = tmp_path / "fresh"
    assert _train(original[0], data, fresh, *new) == 0
    resumed, reference = read_metrics(out), read_metrics(fresh)
    assert [m["step"] for m in resumed] == list(range(1, 7))
    assert [m["lr"] for m in resumed[2:]] == [m["lr"] for m in reference[2:]]
    assert [m["lr"] for m in resumed[:2]] == [m["lr"] for m in read_metrics(original[2])[:2]]  # kept as they were
    # what the run did is what it records: the config it went on with, and the resume with its changes
    assert yaml.safe_load((out / "config.yaml").read_text())["train"]["learning_rate"] == 5e-3
    assert yaml.safe_load((out / "checkpoint-4" / "config.yaml").read_text())["train"]["max_steps"] == 6
    (resume,) = json.loads((out / "run_info.json").read_text())["resumes"]
    assert resume["step"] == 2 and resume["changed"]["train.learning_rate"]["after"] == 5e-3
    assert set(resume["changed"]) == {"train.learning_rate", "train.max_steps", "train.output_dir"}


@pytest.mark.parametrize("change, named", [
    ("train.effective_batch=8", "train.effective_batch=4"),
    ("train.seed=1", "train.seed=0"),
    ("eval.holdout=2", "eval.holdout=0"),
])
def test_a_change_that_cannot_continue_the_run_is_one_line_and_touches_nothing(original, tmp_path, capsys, change,
                                                                               named):
    out, data = _copy(original, tmp_path)
    before = {p.name: p.read_bytes() for p in out.iterdir() if p.is_file()}
    capsys.readouterr()
    assert _resume(original, out, data, change) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("anyfit: error: train.resume:") and f"Set {named}" in err[0]
    assert {p.name: p.read_bytes() for p in out.iterdir() if p.is_file()} == before


def _edited(original) -> list[str]:
    lines = original[1].read_text().splitlines(keepends=True)
    record = json.loads(lines[5])
    record["completion"] += " and more"
    return lines[:5] + [json.dumps(record) + "\n"] + lines[6:]


@pytest.mark.parametrize("kind", ["edited", "appended", "cut shorter"])
def test_changed_data_is_refused_with_what_differs(original, tmp_path, capsys, kind):
    lines = original[1].read_text().splitlines(keepends=True)
    new_lines, extra, said = {
        "edited": (_edited(original), [], "15 are unchanged and 1 gone, and 1 records are new"),
        "appended": (lines + lines[:2], [], "16 are unchanged and 0 gone, and 2 records are new"),
        "cut shorter": (lines, ["data.max_length=8"], "the same 16 records tokenize differently now"),
    }[kind]
    out, data = _copy(original, tmp_path, new_lines)
    capsys.readouterr()
    assert _resume(original, out, data, *extra) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "the training data differs from what checkpoint" in err[0] and said in err[0], err
    assert "train.resume_changed_data=true" in err[0]


def test_changed_data_resumed_on_request_draws_from_the_new_data_and_records_it(original, tmp_path, capsys):
    lines = original[1].read_text().splitlines(keepends=True)
    out, data = _copy(original, tmp_path, lines + [line.replace("#", "# again") for line in lines])  # 16 more
    capsys.readouterr()
    assert _resume(original, out, data, "train.resume_changed_data=true", "train.max_steps=6") == 0
    (changed, line) = _lines(capsys.readouterr().out, "[anyfit] resume:")
    assert _changed(changed) == ["data.path", "train.max_steps"] and "16 records are new" in line
    (resume,) = json.loads((out / "run_info.json").read_text())["resumes"]
    assert "16 records are new" in resume["data"] and set(resume["changed"]) == {"data.path", "train.max_steps",
                                                                    "train.output_dir"}
    unchanged = [m["loss"] for m in read_metrics(original[2])]
    losses = [m["loss"] for m in read_metrics(out)]
    assert losses[:2] == unchanged[:2] and losses[2:4] != unchanged[2:4]  # steps 3 and 4 drew from the new data
    # the next checkpoint holds the new data's fingerprint: resuming from it again needs no permission
    assert _train(original[0], data, out, f"train.resume={out / 'checkpoint-4'}", "train.max_steps=6") == 0

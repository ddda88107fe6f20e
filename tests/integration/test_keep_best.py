"""train.keep_best on real tiny runs: the best checkpoint is written when its evaluation beats the best (between
save_every steps too), kept outside keep_last's rotation, named in best.json, and kept across a resume.

The metric is chosen so that the best step is known: max:val_loss (the worst validation loss) is the first
evaluation's on a run whose validation loss falls, which keep_last=1 would otherwise have deleted long ago."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from tiny_runs import read_metrics, write_dataset

from anyfit.cli import main

pytestmark = pytest.mark.slow

RUN = ["data.template=plain", "train.seed=0", "train.log_every=1", "train.effective_batch=4", "train.micro_batch=2",
       "train.learning_rate=1e-2", "train.lr_schedule=constant", "eval.holdout=4", "eval.every=2", "train.save_every=4", "train.keep_last=1"]


def _train(model: Path, data: Path, out: Path, *extra: str) -> int:
    return main(["train", f"model.name_or_path={model}", f"data.path={data}", f"train.output_dir={out}", *RUN, *extra])


def _best(out: Path) -> dict:
    return json.loads((out / "best.json").read_text())


@pytest.fixture(scope="module")
def data(tmp_path_factory) -> Path:
    return write_dataset(tmp_path_factory.mktemp("keep_best") / "d.jsonl", n=24)


@pytest.fixture(scope="module")
def whole(tiny_llama_dir, data, tmp_path_factory) -> Path:
    """A 10-step run keeping the worst validation loss's checkpoint (step 2's)."""
    out = tmp_path_factory.mktemp("whole") / "run"
    assert _train(tiny_llama_dir, data, out, "train.max_steps=10", "train.keep_best=max:val_loss") == 0
    return out


def test_the_best_checkpoint_is_kept_outside_keep_last_and_named(whole):
    evals = [m for m in read_metrics(whole) if "val_loss" in m and m["step"] > 0]
    worst = max(evals, key=lambda m: m["val_loss"])
    assert worst["step"] == 2  # the validation loss falls: the first evaluation is the worst
    assert _best(whole) == {"metric": "val_loss", "lower_is_better": False, "value": worst["val_loss"], "step": 2,
                            "checkpoint": "checkpoint-2"}
    # written at step 2 although save_every is 4; checkpoint-4 came and went with keep_last=1, checkpoint-8 stays
    assert sorted(p.name for p in whole.glob("checkpoint-*")) == ["checkpoint-2", "checkpoint-8"]
    state = json.loads((whole / "checkpoint-8" / "trainer_state.json").read_text())
    assert state["best"]["step"] == 2
    page = (whole / "report.html").read_text()
    assert "best checkpoint" in page and "checkpoint-2: val_loss" in page


def test_the_best_is_the_final_model_when_the_last_evaluation_is_best(tiny_llama_dir, data, tmp_path, capsys):
    out = tmp_path / "run"  # max:step: every evaluation beats the one before, so the last one is the best
    assert _train(tiny_llama_dir, data, out, "train.max_steps=6", "train.keep_best=max:step") == 0
    assert _best(out)["step"] == 6 and _best(out)["checkpoint"] == "final"
    assert "best step: 6 at step 6 (the final model)" in capsys.readouterr().out


def test_a_resume_keeps_the_best_and_its_checkpoint(tiny_llama_dir, data, whole, tmp_path):
    cut = tmp_path / "cut"
    # the same run ended after step 6 (a constant learning rate: its length changes nothing else), then continued
    assert _train(tiny_llama_dir, data, cut, "train.max_steps=6", "train.keep_best=max:val_loss") == 0
    assert _train(tiny_llama_dir, data, cut, "train.max_steps=10", "train.keep_best=max:val_loss",
                  f"train.resume={cut / 'checkpoint-4'}") == 0
    assert _best(cut) == _best(whole)
    assert sorted(p.name for p in cut.glob("checkpoint-*")) == ["checkpoint-2", "checkpoint-8"]


def test_export_takes_the_best_checkpoint_unless_last(whole, tmp_path, capsys):
    from safetensors.torch import load_file

    from anyfit.export.folder import best_of

    assert main(["export", str(whole), "--out", str(tmp_path / "best"), "--dtype", "fp32"]) == 0
    assert "--last exports the final model" in capsys.readouterr().out
    exported, kept = load_file(tmp_path / "best" / "model.safetensors"), load_file(whole / "checkpoint-2" /
                                                                                   "model.safetensors")
    assert exported.keys() == kept.keys() and all(exported[k].equal(kept[k]) for k in kept)
    assert best_of(whole, last=True) == whole
    assert best_of(whole / "checkpoint-8", last=False) == whole / "checkpoint-8"  # a checkpoint is what it is

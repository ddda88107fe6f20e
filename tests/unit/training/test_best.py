"""train.keep_best's comparison: the direction of each named metric, min:/max: for any other, step 0 (the base
model) and non-finite values never best, a resumed record continued only for the same metric."""

from __future__ import annotations

import math

import pytest

from anyfit.config import ConfigError, load_config
from anyfit.training.checkpoints.best import Best


def _seen(best: Best, *values: float) -> list[int | None]:
    kept = []
    for step, value in enumerate(values, start=1):
        best.saw({"step": step, best.key: value})
        kept.append(best.pending[0] if best.pending else None)
        best.kept()
    return kept


def test_lower_or_higher_is_better_by_the_metric():
    assert _seen(Best.of("validation_loss", None), 3.0, 2.0, 2.5, 1.0) == [1, 2, None, 4]
    assert _seen(Best.of("accuracy", None), 0.1, 0.3, 0.2) == [1, 2, None]
    assert Best.of("max:gen_format_rate", None).key == "gen_format_rate"
    assert _seen(Best.of("min:custom", None), 5.0, 5.0, 4.0) == [1, None, 3]  # a tie is not better


def test_step_zero_and_non_finite_values_are_never_best():
    best = Best.of("validation_loss", None)
    best.saw({"step": 0, "val_loss": 0.1})
    best.saw({"step": 1, "val_loss": math.nan})
    best.saw({"step": 2, "gen_accuracy": 1.0})
    assert best.pending is None and best.step is None


def test_a_resume_continues_the_record_of_the_same_metric_only():
    saved = {"metric": "val_loss", "value": 1.5, "step": 4, "checkpoint": "checkpoint-4"}
    best = Best.of("validation_loss", saved)
    assert (best.step, best.value) == (4, 1.5)
    best.saw({"step": 6, "val_loss": 1.6})
    assert best.pending is None
    assert Best.of("accuracy", saved).step is None


def test_a_metric_without_direction_or_without_evaluation_is_refused_in_one_line():
    with pytest.raises(ConfigError, match="min:KEY or max:KEY"):
        Best.of("perplexity", None)
    with pytest.raises(ConfigError, match="set eval.every > 0"):
        load_config(None, ["model.name_or_path=m", "data.path=d.jsonl", "train.keep_best=validation_loss"])
    with pytest.raises(ConfigError, match="eval.generate_every"):
        load_config(None, ["model.name_or_path=m", "data.path=d.jsonl", "train.keep_best=accuracy", "eval.every=2"])

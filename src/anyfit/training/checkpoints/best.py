"""``train.keep_best``: the checkpoint with the best validation metric, kept outside keep-last's rotation.

After every evaluation that measured the metric, a value better than the best so far makes the run write a
checkpoint at that step (also between ``train.save_every`` steps) and remember it; pruning never deletes it. At
the last step the final model is that checkpoint. What is best is recorded in three places: each checkpoint's
``trainer_state.json`` (so a resume continues the comparison from the value it had then), the run folder's
``best.json`` (what ``anyfit export`` reads: it exports the best by default) and ``run_info.json`` at the end.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from anyfit.config import best_metric
from anyfit.runfolder import CHECKPOINT_PREFIX

BEST_FILE = "best.json"
FINAL = "final"  # best.json's checkpoint when the last step was the best: the final model in the run folder


@dataclass
class Best:
    """The best value of one metric so far, and the step (and checkpoint) that had it."""

    key: str
    lower: bool
    step: int | None = None
    value: float | None = None
    pending: tuple[int, float] | None = None  # (step, value) that beat the best: its checkpoint is written next

    @staticmethod
    def of(setting: str | None, saved: dict[str, Any] | None) -> Best | None:
        """``train.keep_best``'s tracker, continuing a resumed checkpoint's record when it is of the same metric."""
        if not setting:
            return None
        key, lower = best_metric(setting)
        best = Best(key, lower)
        if saved and saved.get("metric") == key:
            best.step, best.value = saved.get("step"), saved.get("value")
        return best

    def saw(self, record: dict[str, Any]) -> None:
        """An evaluation line: when its value beats the best, its step is ``pending`` (its checkpoint is due)."""
        value = record.get(self.key)
        if record.get("step", 0) == 0 or not isinstance(value, (int, float)) or not math.isfinite(value):
            return  # step 0 is the base model, not a checkpoint of this run
        if self.value is None or (value < self.value if self.lower else value > self.value):
            self.pending = (record["step"], float(value))

    def protected(self) -> tuple[int, ...]:
        """The step whose checkpoint pruning must keep: the one about to be written for a better value, else the
        best so far (none before the first measured value)."""
        if self.pending is not None:
            return (self.pending[0],)
        return (self.step,) if self.step is not None else ()

    def kept(self) -> None:
        """The pending step's checkpoint is written (or is the final model): it is the best now."""
        if self.pending is not None:
            (self.step, self.value), self.pending = self.pending, None

    def as_dict(self, final_step: int | None = None) -> dict[str, Any]:
        checkpoint = FINAL if final_step is not None and self.step == final_step else f"{CHECKPOINT_PREFIX}{self.step}"
        return {"metric": self.key, "lower_is_better": self.lower, "value": self.value, "step": self.step,
                "checkpoint": checkpoint}

    def write(self, out: Path, final_step: int | None = None) -> None:
        """``best.json`` in the run folder (main process)."""
        if self.step is not None:
            (out / BEST_FILE).write_text(json.dumps(self.as_dict(final_step), indent=1))


def read_best(run_dir: Path) -> dict[str, Any] | None:
    """A run's ``best.json`` (None: the run kept no best, or the file is unreadable)."""
    try:
        best = json.loads((Path(run_dir) / BEST_FILE).read_text())
    except (OSError, ValueError):
        return None
    return best if isinstance(best, dict) and isinstance(best.get("checkpoint"), str) else None

"""What a training run left next to its model (config.yaml, metrics.jsonl, run_info.json), read for the
export's default dtype and its model card; a plain model folder has none of them."""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from anyfit.config import ConfigError, load_config
from anyfit.export.errors import ExportError
from anyfit.runfolder import CHECKPOINT_PREFIX


@dataclass
class RunFiles:
    """The files a training run left next to its model (absent for a plain model folder)."""

    config_path: Path | None = None
    config: Any = None  # anyfit.config.Config
    metrics: list[dict[str, Any]] = field(default_factory=list)
    run_info: dict[str, Any] = field(default_factory=dict)

    @staticmethod
    def find(folder: Path) -> RunFiles:
        """A checkpoint folder carries config.yaml; its metrics and run_info are in the run folder above it,
        and only the metric lines up to its step describe it."""
        files = RunFiles()
        if (folder / "config.yaml").is_file():
            files.config_path = folder / "config.yaml"
            try:
                files.config = load_config(files.config_path)
            except ConfigError as e:
                raise ExportError(f"{files.config_path} is not a readable anyfit config: {e}") from None
        step = None
        run_dir = folder
        if folder.name.startswith(CHECKPOINT_PREFIX) and folder.name[len(CHECKPOINT_PREFIX):].isdigit():
            step, run_dir = int(folder.name[len(CHECKPOINT_PREFIX):]), folder.parent
        if (run_dir / "metrics.jsonl").is_file():
            for line in (run_dir / "metrics.jsonl").read_text().splitlines():
                try:
                    record = json.loads(line)
                except json.JSONDecodeError:
                    continue  # a line cut short by an interrupted write
                if isinstance(record, dict) and (step is None or record.get("step", 0) <= step):
                    files.metrics.append(record)
        if (run_dir / "run_info.json").is_file():
            try:
                files.run_info = json.loads((run_dir / "run_info.json").read_text())
            except json.JSONDecodeError:
                files.run_info = {}
        return files

    def final_metrics(self) -> dict[str, tuple[int, float]]:
        """The last value of each headline metric with its step: loss, val_loss, gen_accuracy."""
        last: dict[str, tuple[int, float]] = {}
        for record in self.metrics:
            for key in ("loss", "val_loss", "gen_accuracy"):
                value = record.get(key)
                if isinstance(value, (int, float)) and not math.isnan(value):
                    last[key] = (record.get("step", 0), value)
        return last

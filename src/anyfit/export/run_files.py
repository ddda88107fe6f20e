"""What a training run left next to its model (config.yaml, metrics.jsonl, run_info.json), read for the
export's default dtype and its model card; a plain model folder has none of them."""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from anyfit.config import ConfigError, load_config
from anyfit.export.errors import ExportError
from anyfit.runfolder import read_metrics, read_run_info, run_config_path, run_of


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
        and only the metric lines up to its step describe it (``anyfit.runfolder`` reads them)."""
        files = RunFiles()
        config_path = run_config_path(folder)
        if config_path is not None:
            files.config_path = config_path
            try:
                files.config = load_config(config_path)
            except ConfigError as e:
                raise ExportError(f"{config_path} is not a readable anyfit config: {e}") from None
        run_dir, step = run_of(folder)
        files.metrics = read_metrics(run_dir, up_to_step=step)
        files.run_info = read_run_info(run_dir)
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

"""Per-step metrics: a JSONL file (one object per logged step) and the meter that fills it."""

from __future__ import annotations

import json
import time
from pathlib import Path
from typing import Any

import torch

from anyfit.hardware.memory import GIB, peak_bytes


class MetricsLog:
    """Appends one JSON object per call to ``metrics.jsonl``; a no-op off the main process."""

    def __init__(self, path: Path, enabled: bool):
        self.path = path
        self.enabled = enabled
        if enabled:
            path.parent.mkdir(parents=True, exist_ok=True)

    def write(self, record: dict[str, Any]) -> None:
        if not self.enabled:
            return
        with self.path.open("a") as f:
            f.write(json.dumps(record) + "\n")


class StepMeter:
    """Loss and token counts since the last metrics line.

    Sums stay on the device, so a step adds to them without a host sync; ``line`` reads them with one
    collective over the processes (only on logged steps) and starts the next interval.
    """

    def __init__(self, device: torch.device):
        self.loss = torch.zeros((), device=device)  # summed token loss of the finite steps
        self.trained = torch.zeros((), device=device, dtype=torch.long)  # their trainable tokens (global window)
        self.real_tokens = 0  # tokens this process fed to the model (host ints: no sync)
        self.t0 = time.perf_counter()

    def add(self, loss_sum: torch.Tensor, finite: torch.Tensor | bool, window_tokens: int, real_tokens: int) -> None:
        finite = torch.as_tensor(finite, device=self.loss.device)
        self.loss += torch.where(finite, loss_sum, 0.0)
        self.trained += finite * window_tokens
        self.real_tokens += real_tokens

    def line(self, accelerator, device: str, **fields: Any) -> dict[str, Any]:
        """The metrics record of the interval (``fields`` first: step, lr, ...), then a fresh interval."""
        totals = torch.stack([self.loss, torch.tensor(float(self.real_tokens), device=self.loss.device)])
        loss_total, real_total = accelerator.reduce(totals, reduction="sum").tolist()
        elapsed = time.perf_counter() - self.t0  # after the collective above: the device work is included
        trained = int(self.trained)
        record = {**fields, "loss": round(loss_total / trained, 6) if trained else float("nan"),
                  "tokens_per_s": round(real_total / elapsed, 1), "real_tokens": int(real_total),
                  "trainable_tokens": trained, "peak_mem_gib": round(peak_bytes(device) / GIB, 3)}
        self.loss.zero_()
        self.trained.zero_()
        self.real_tokens = 0
        self.t0 = time.perf_counter()
        return record

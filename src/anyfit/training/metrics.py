"""Per-step metrics: a JSONL file (one object per logged step) and peak memory of the device."""

from __future__ import annotations

import json
import resource
import sys
from pathlib import Path
from typing import Any

import torch


def peak_memory_gib(device: str) -> float:
    """Peak memory of this process: CUDA max allocated, MPS driver-allocated, CPU max resident set."""
    if device == "cuda":
        return torch.cuda.max_memory_allocated() / 2**30
    if device == "mps":
        return torch.mps.driver_allocated_memory() / 2**30
    rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return rss / 2**30 if sys.platform == "darwin" else rss / 2**20  # bytes on macOS, KiB on Linux


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

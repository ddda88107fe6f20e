"""A set-up run and what it hands back: ``Run`` (``training.loop.set_up`` builds it, ``run_steps`` steps through it,
the loop's hooks read it) and ``TrainResult``."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

import torch

from anyfit.data.batching import StepStream
from anyfit.profiling.flops import DevicePeak, ModelFlops
from anyfit.training.checkpoints.checkpoint import TrainState
from anyfit.training.parts import Parts
from anyfit.training.validation import InTrainingEval


@dataclass
class TrainResult:
    output_dir: Path
    steps: int
    losses: list[float] = field(default_factory=list)
    model: torch.nn.Module | None = None  # the trained model, unwrapped (e.g. to generate right away)
    tokenizer: object = None
    evals: list[dict] = field(default_factory=list)  # validation loss / generation accuracy records
    interrupted: str | None = None  # the signal that stopped the run early (a checkpoint was written)
    skipped_steps: int = 0  # updates skipped for a non-finite loss or gradient


@dataclass
class Run:
    """Everything a set-up run is made of: its parts (``training.parts``) and what the loop steps through."""

    parts: Parts
    state: TrainState  # model, optimizer, scheduler (as the backend wrapped them) and tokenizer: what checkpoints hold
    stream: StepStream
    evaluator: InTrainingEval
    steps: int
    start: int = 0
    skipped_before: int = 0
    best_before: dict | None = None  # train.keep_best's record in the resumed checkpoint
    flops: ModelFlops | None = None  # model FLOPs of a window (for MFU; anyfit.profiling.flops)
    peak: DevicePeak | None = None  # one device's dense peak, what MFU is measured against

    @property
    def out(self) -> Path:
        return self.parts.out

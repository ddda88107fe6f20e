"""The run's parts, built once by ``training.loop.set_up`` and handed by name to everything that needs several of
them (the forgetting watch, the micro-batch probe, each step's backward, evaluation, checkpoints), instead of as
argument lists that every new feature lengthens.

Set-up fills the record in the order the parts come to exist (the data before the model, the model before the
loss that may anchor to it); what reads a part gets it from here, never as a copy of its own.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

from torch import nn

from anyfit.backends import Backend, Loaded
from anyfit.backends.sequence import SequenceSplit
from anyfit.config import Config
from anyfit.data.prepare import TrainingData
from anyfit.hardware.runtime import RuntimePolicy


@dataclass
class Parts:
    """What one run is made of, as set-up builds it (``None``: not built yet)."""

    cfg: Config
    policy: RuntimePolicy
    backend: Backend  # how the run is spread over its processes (chosen once, never branched on)
    accelerator: Any  # HF Accelerate's, as the policy told it
    split: SequenceSplit  # runtime.sequence_parallel: this process's part of each sequence
    say: Callable[..., None]  # prints on the main process only
    out: Path | None = None  # the run folder (where the run starts: ``checkpoints.start``)
    tokenizer: Any = None
    images: Any = None  # the model's processor for image records (``anyfit.data.image_tokens.ImageTokens``)
    data: TrainingData | None = None
    loaded: Loaded | None = None  # the model as the backend loaded it (``.model``: under no wrapper) and its sizes
    model: nn.Module | None = None  # the same model under the backend's wrapper: what steps and evaluations call
    collate: Callable | None = None  # examples -> one micro-batch (packed or padded, as the self-test decided)
    loss_fn: Callable | None = None  # (model, batch) -> summed token loss: what validation measures
    train_loss: Callable | None = None  # what each step minimises: ``loss_fn``, or anchored (train.base_kl_weight)

    @property
    def bare(self) -> nn.Module:
        """The model as loaded, without the backend's wrapper (its config; what a result hands back)."""
        return self.loaded.model

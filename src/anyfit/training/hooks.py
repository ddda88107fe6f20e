"""How a feature joins the training loop: a ``Hook`` the loop calls before the first step, after each optimizer step
and at the end of the run, handed what it needs by name (``Loop``: the run and the loop's own objects; ``StepDone``:
what the step left; ``RunEnd``: how the run ended).

A new per-step or end-of-run feature is one module with one ``Hook`` subclass, and one entry in
``training.loop.FEATURES`` (their order is the order they are called in); the loop itself does not change. The
per-step metrics line (``training.step_metrics``), evaluation with keep-best and base_kl
(``training.evaluation_hook``) and what a run leaves at its end (``training.run_end``) are built this way. What
stops or redoes a step (the non-finite guard, a stop signal, the out-of-memory retry) and the checkpoint cadence
stay in the loop: they decide whether there is a next step.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from anyfit.training.autofit import Window
from anyfit.training.checkpoints.checkpoint import Checkpointer
from anyfit.training.divergence import NonFiniteGuard
from anyfit.training.metrics import MetricsLog
from anyfit.training.run import Run, TrainResult


@dataclass
class Loop:
    """The run and the loop's own objects that features write to: the result it returns, the metrics file, the
    non-finite guard, the checkpoints (``train.keep_best`` is told of every evaluation)."""

    run: Run
    result: TrainResult
    log: MetricsLog
    guard: NonFiniteGuard
    checkpoints: Checkpointer


@dataclass(frozen=True)
class StepDone:
    """What one optimizer step left."""

    done: int  # optimizer steps done, this one included
    window: Window  # its accumulation window, forward and backward done (``training.autofit``)
    grad_norm: Any  # the gradients' norm before clipping (a device tensor: read only when logged)
    finite: Any  # whether the update was taken (a device flag; ``NonFiniteGuard`` counts it)
    log_now: bool  # a metrics line is due (``train.log_every``, and the last step)


@dataclass(frozen=True)
class RunEnd:
    """How the steps ended."""

    done: int  # optimizer steps done
    interrupted: str | None  # the signal that stopped the run early, or None


class Hook:
    """A feature of the loop. Each method does nothing unless the feature needs it; every process calls every
    method (a feature that writes files checks for the main process itself)."""

    def __init__(self, loop: Loop):
        self.loop = loop

    def start(self) -> None:
        """Before the first step this process runs (after a resume: the first step after the checkpoint's)."""

    def after_step(self, step: StepDone) -> None:
        """After each optimizer step, once the guard has looked at it."""

    def at_end(self, end: RunEnd) -> None:
        """After the last step, or after a stop signal."""

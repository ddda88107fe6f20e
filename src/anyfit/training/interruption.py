"""Stopping cleanly on SIGTERM/SIGINT (Colab disconnects, spot preemption, Ctrl-C).

The handler only sets a flag; the loop finishes the current optimizer step, writes a checkpoint and
returns. With several processes the flag is agreed on with one tiny all-reduce, asked by the loop on
logged steps only (it is a host sync), so every process stops after the same step (a process that stopped
alone would hang the others in a collective).
"""

from __future__ import annotations

import signal

import torch


class StopOnSignal:
    """Context manager: records SIGTERM/SIGINT instead of dying; ``requested(accelerator)`` asks all processes."""

    SIGNALS = (signal.SIGTERM, signal.SIGINT)

    def __init__(self) -> None:
        self.signal_name: str | None = None
        self._previous: dict[int, object] = {}

    def _handle(self, signum, frame) -> None:
        if self.signal_name is not None and signum == signal.SIGINT:
            raise KeyboardInterrupt  # a second Ctrl-C means: stop now, without the checkpoint
        self.signal_name = signal.Signals(signum).name

    def __enter__(self) -> "StopOnSignal":
        try:
            for s in self.SIGNALS:
                self._previous[s] = signal.signal(s, self._handle)
        except ValueError:  # not the main thread (e.g. a notebook worker): keep the default behaviour
            self._previous.clear()
        return self

    def __exit__(self, *exc) -> None:
        for s, handler in self._previous.items():
            signal.signal(s, handler)

    def requested(self, accelerator) -> bool:
        if accelerator.num_processes == 1:
            return self.signal_name is not None
        flag = torch.tensor(1.0 if self.signal_name else 0.0, device=accelerator.device)
        return bool(accelerator.reduce(flag, reduction="sum").item() > 0)

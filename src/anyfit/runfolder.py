"""The run folder's layout, named and parsed in one place: every module that writes or reads a training
output folder (``train.output_dir``) asks this one, so a file name changes in one line.

A run folder holds

- ``config.yaml``: the resolved config (also inside every checkpoint);
- ``run_info.json``: runtime policy with its reasons, batch split, data report, versions;
- ``metrics.jsonl``: one JSON object per logged step, appended while the run goes on;
- ``loss.png``: the curves, drawn at the end of the run and by ``anyfit plot``;
- ``generations.jsonl``: a few example answers of each generation evaluation (prompt, gold answer, the
  model's answer, graded correct or not), one line per example;
- ``report.html``: the whole run on one self-contained page, written at the end of the run and by
  ``anyfit report``;
- ``.anyfit-run.lock``: held by the run that is writing the folder (``RunLock``);
- ``checkpoint-<step>/``: written as ``.tmp-checkpoint-<step>/`` and renamed when complete, renamed to
  ``.deleting-checkpoint-<step>/`` before it is deleted (what a checkpoint holds is
  ``anyfit.training.checkpoints.checkpoint``'s); what a killed run left under either hidden name is removed when
  the next run takes the lock (``remove_leftovers``);
- the final model (``config.json`` + weights, or ``adapter_config.json`` + adapter) when the run finished.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import socket
import time
from pathlib import Path
from typing import Any

from anyfit.config import ConfigError
from anyfit.durable import FileLock, LockBusy
from anyfit.faults import FileFault, os_problem

RUN_CONFIG = "config.yaml"
RUN_INFO = "run_info.json"
METRICS = "metrics.jsonl"
PLOT = "loss.png"
GENERATIONS = "generations.jsonl"
REPORT = "report.html"
CHECKPOINT_PREFIX = "checkpoint-"
TMP_CHECKPOINT_PREFIX = ".tmp-checkpoint-"
DELETING_CHECKPOINT_PREFIX = ".deleting-checkpoint-"  # an old checkpoint renamed so, then removed (keep-last-K)
FINAL_MODEL_FILES = ("config.json", "adapter_config.json")  # either marks a finished run's final model
LOCK = ".anyfit-run.lock"
# The loss curves of a run, drawn alike by loss.png (training.plot) and report.html (training.report): the
# metrics.jsonl key, its label, and whether its points are marked (evaluations are sparse). Each data source's losses
# follow them (data.source_names.curve_prefixes).
LOSS_CURVES = (("loss", "training loss", False), ("val_loss", "validation loss", True))


class NotWritten(Exception):
    """A checkpoint or the final model could not be written (a full disk, a quota): one line for the user,
    saying what was lost and what is intact (``anyfit.training.checkpoints.disk``)."""


class RunLock:
    """Held by the process that writes a run folder for as long as its run goes on, so that a second run on the
    same folder is refused at once, naming the holder (process, host, start). A ``durable.FileLock``: a crashed
    or killed run's leftover file blocks nothing; the file is removed when the run ends."""

    def __init__(self, run_dir: Path, enabled: bool = True):
        self.run_dir, self.enabled, self.lock, self.created = Path(run_dir), enabled, None, False

    def __enter__(self) -> RunLock:
        if not self.enabled:
            return self
        self.created = not self.run_dir.exists()
        note = f"process {os.getpid()} on {socket.gethostname()}, started {time.strftime('%Y-%m-%d %H:%M:%S')}"
        lock = FileLock(self.run_dir / LOCK, wait=False, note=note, remove=True)
        try:
            self.run_dir.mkdir(parents=True, exist_ok=True)
            self.lock = lock.__enter__()
        except LockBusy as busy:
            raise ConfigError(f"train.output_dir {self.run_dir} is in use by a run that is still going "
                              f"({busy.holder or 'another process'}); wait for it to end, or choose another "
                              "train.output_dir.") from None
        except OSError as e:  # a read-only disk, permissions, no room: said before any heavy work
            raise FileFault(os_problem(e, {"train.output_dir": self.run_dir})) from None
        remove_leftovers(self.run_dir)
        return self

    def __exit__(self, *exc) -> bool:
        if self.lock is not None:
            self.lock.__exit__(*exc)
            self.lock = None
            if self.created and not any(self.run_dir.iterdir()):
                # a run that stopped before writing anything leaves no folder (unless the next run's lock is in it)
                with contextlib.suppress(OSError):
                    self.run_dir.rmdir()
        return False


def remove_leftovers(run_dir: Path, prefixes: tuple[str, ...] = (TMP_CHECKPOINT_PREFIX, DELETING_CHECKPOINT_PREFIX)
                     ) -> None:
    """Remove what a killed run left half-done in ``run_dir``: a checkpoint being written (``.tmp-checkpoint-N``)
    or being deleted (``.deleting-checkpoint-N``); no reader takes either for a checkpoint. Called by the process
    that holds the run's lock, when no checkpoint is being written."""
    for prefix in prefixes:
        for path in Path(run_dir).glob(f"{prefix}*"):
            shutil.rmtree(path, ignore_errors=True)


def checkpoint_step(path: Path) -> int | None:
    """The step of a ``checkpoint-<step>`` folder name, None for any other name."""
    name = Path(path).name
    tail = name[len(CHECKPOINT_PREFIX):] if name.startswith(CHECKPOINT_PREFIX) else ""
    return int(tail) if tail.isdigit() else None


def checkpoint_dirs(run_dir: Path) -> list[Path]:
    """Every ``checkpoint-<step>`` folder, complete or not, oldest first."""
    run_dir = Path(run_dir)
    if not run_dir.is_dir():
        return []
    found = [p for p in run_dir.glob(f"{CHECKPOINT_PREFIX}*") if p.is_dir() and checkpoint_step(p) is not None]
    return sorted(found, key=checkpoint_step)


def has_final_model(folder: Path) -> bool:
    """Whether ``folder`` holds a model (full, or a LoRA adapter), as a finished run does."""
    return any((Path(folder) / name).is_file() for name in FINAL_MODEL_FILES)


def run_config_path(folder: str | Path) -> Path | None:
    """The ``config.yaml`` a training run left in ``folder`` (its output folder or a checkpoint), if any."""
    path = Path(folder) / RUN_CONFIG
    return path if path.is_file() else None


def run_of(folder: Path) -> tuple[Path, int | None]:
    """``(run folder, step)`` of a checkpoint folder; ``(folder, None)`` for anything else."""
    step = checkpoint_step(folder)
    return (Path(folder).parent, step) if step is not None else (Path(folder), None)


def read_metrics(run_dir: Path, up_to_step: int | None = None) -> list[dict[str, Any]]:
    """The metric records of a run, in order; ``[]`` when it has none yet.

    The file is only ever appended to, so the one damage a crash can do is cut its last line short: that
    line is skipped (it is logged again when the run resumes). A bad line anywhere else means the file was
    edited or mixed up, and is a ``ConfigError`` naming file and line rather than a silent gap.
    """
    path = Path(run_dir) / METRICS
    if not path.is_file():
        return []
    lines = path.read_text(encoding="utf-8", errors="replace").splitlines()
    records = []
    for lineno, line in enumerate(lines, start=1):
        if not line.strip():
            continue
        try:
            record = json.loads(line)
        except json.JSONDecodeError as e:
            if lineno == len(lines):
                break  # the last line, cut short by a crash mid-write
            raise ConfigError(f"{path}:{lineno}: not a JSON line ({e.msg}); was the file edited or cut?") from None
        if not isinstance(record, dict):
            raise ConfigError(f"{path}:{lineno}: not a metrics record (a JSON object with a 'step').")
        if up_to_step is None or record.get("step", 0) <= up_to_step:
            records.append(record)
    return records


def write_metrics(run_dir: Path, records: list[dict[str, Any]]) -> None:
    """Replace the run's metrics file by ``records`` (a resumed run keeps the lines up to its checkpoint)."""
    (Path(run_dir) / METRICS).write_text("".join(json.dumps(r) + "\n" for r in records), encoding="utf-8")


def read_run_info(run_dir: Path) -> dict[str, Any]:
    """The run's ``run_info.json``; ``{}`` when it is missing or unreadable (it describes, it never steers)."""
    path = Path(run_dir) / RUN_INFO
    try:
        info = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return {}
    return info if isinstance(info, dict) else {}


def write_run_info(run_dir: Path, info: dict[str, Any]) -> None:
    (Path(run_dir) / RUN_INFO).write_text(json.dumps(info, indent=2, default=str))


def read_generations(run_dir: Path, up_to_step: int | None = None) -> list[dict[str, Any]]:
    """The saved example answers of a run's generation evaluations, in order (each with its ``step``); ``[]``
    when there are none. They only describe the run, so a line that does not parse (cut by a crash) is skipped."""
    path = Path(run_dir) / GENERATIONS
    if not path.is_file():
        return []
    found = []
    for line in path.read_text(encoding="utf-8", errors="replace").splitlines():
        try:
            record = json.loads(line)
        except json.JSONDecodeError:
            continue
        if isinstance(record, dict) and (up_to_step is None or record.get("step", 0) <= up_to_step):
            found.append(record)
    return found


def write_generations(run_dir: Path, records: list[dict[str, Any]], append: bool = True) -> None:
    """Add ``records`` (example answers, each with its ``step``) to the run's generations file, or replace it
    (a resumed run keeps the lines up to its checkpoint)."""
    with (Path(run_dir) / GENERATIONS).open("a" if append else "w", encoding="utf-8") as f:
        f.write("".join(json.dumps(r, ensure_ascii=False) + "\n" for r in records))

"""Per-step metrics: a JSONL file (one object per logged step), the same records sent to experiment trackers
(``train.report_to``, through Accelerate's trackers), and the meter that fills them."""

from __future__ import annotations

import json
import os
import time
from pathlib import Path
from typing import Any

import numpy as np
import torch

from anyfit.config import ConfigError
from anyfit.data.source_names import source_key
from anyfit.faults import os_problem
from anyfit.hardware.memory import peak_bytes
from anyfit.units import GIB


def requested_trackers(report_to: list[str] | str) -> list[str]:
    """The trackers ``train.report_to`` names, each checked to be installed (before any heavy work)."""
    from accelerate import utils



    names = [report_to] if isinstance(report_to, str) else list(report_to)
    names = [n for n in names if n != "none"]
    missing = [n for n in names if not getattr(utils, f"is_{n}_available")()]
    if missing:
        raise ConfigError(f"train.report_to: {', '.join(missing)} is not installed; pip install "
                          f"{' '.join(repr(f'anyfit[{n}]') for n in missing)} (or set train.report_to=none).")
    if "wandb" in names:
        check_wandb_login()
    return names


def check_wandb_login() -> None:
    """wandb online with no credentials asks for an API key at a terminal and waits there for an answer (without a
    terminal it fails, but only once the model is loaded): say so now, in one line. Offline and disabled modes
    need no login; the credentials are looked up as wandb does (WANDB_API_KEY, its settings files, .netrc, a
    ``wandb.login()`` earlier in this process), without asking."""
    import wandb



    if os.environ.get("WANDB_API_KEY") or wandb.setup().settings.mode in ("offline", "dryrun", "disabled"):
        return
    try:
        logged_in = wandb.login(prompt=False, verify=False)
    except TypeError:  # a wandb without login(prompt=...): it checks (and may ask) itself
        return
    if not logged_in:
        raise ConfigError("train.report_to: wandb is not logged in; run `wandb login` (or set WANDB_API_KEY), or set "
                          "WANDB_MODE=offline to keep the run on this machine.")


def start_trackers(accelerator, trackers: list[str], run_name: str, config: dict[str, Any]) -> None:
    """Open the trackers with the run's resolved config (flattened: trackers want scalar hyperparameters)."""
    if trackers:
        flat = {f"{section}.{k}": v if isinstance(v, (int, float, str, bool)) else str(v)
                for section, values in config.items() for k, v in values.items()}
        accelerator.init_trackers(run_name, config=flat)


def finish_trackers(accelerator) -> None:
    """Close the trackers of a run that completed. (Accelerate's ``end_training`` would also destroy the process
    group, which must outlive the wrapped model: ``anyfit.hardware.runtime.end_process_group``.)"""
    for tracker in accelerator.trackers:
        tracker.finish()


def finish_failed_trackers(accelerator, error: BaseException) -> None:
    """Close the trackers of a run that ended in ``error`` (marked failed where the tracker keeps a status, killed
    for Ctrl-C). Left open, they would swallow the next run in this Python process (a notebook): wandb hands the
    still-open run back to the next ``wandb.init`` (its metrics and config land in the failed run), and MLflow
    refuses to start another run while one is active. Errors here are dropped: ``error`` is what the user needs."""
    status = "KILLED" if isinstance(error, KeyboardInterrupt) else "FAILED"
    for tracker in accelerator.trackers:
        try:
            if tracker.name == "wandb":
                tracker.run.finish(exit_code=1)
            elif tracker.name == "mlflow":
                import mlflow

                mlflow.end_run(status=status)
            else:
                tracker.finish()
        except Exception:  # noqa: BLE001, S110 - a tracker that never started, or one that fails to close
            pass
    accelerator.trackers.clear()


class MetricsLog:
    """Appends one JSON object per call to ``metrics.jsonl`` and sends its numbers to the trackers the
    accelerator was given; a no-op off the main process."""

    def __init__(self, path: Path, enabled: bool, accelerator=None, say=print):
        self.path = path
        self.enabled = enabled
        self.accelerator = accelerator if accelerator is not None and accelerator.trackers else None
        self.say, self.missed = say, 0
        if enabled:
            path.parent.mkdir(parents=True, exist_ok=True)

    def write(self, record: dict[str, Any]) -> None:
        """Append ``record`` as one line. A line that cannot be written (a full disk, a disk gone read-only) is
        taken back whole, so the file keeps only whole lines, and said once in a warning: the run goes on (its
        checkpoints and final model say for themselves whether they were written)."""
        if not self.enabled:
            return
        try:
            _append_whole(self.path, (json.dumps(record) + "\n").encode())
            if self.missed:
                self.say(f"[anyfit] {self.path} is written again from step {record.get('step')} on "
                         f"({self.missed} metrics line(s) before it were lost).")
            self.missed = 0
        except OSError as e:
            if not self.missed:
                self.say(f"[anyfit] warning: the metrics line of step {record.get('step')} was not written: "
                         f"{os_problem(e, {'train.output_dir': self.path.parent}, where=self.path)} Training goes "
                         "on; lines are written again once it can.")
            self.missed += 1
        if self.accelerator is not None:
            numbers = {k: v for k, v in record.items() if k != "step" and isinstance(v, (int, float))}
            self.accelerator.log(numbers, step=record["step"])


def _append_whole(path: Path, data: bytes) -> None:
    """Append ``data`` to ``path``, or on an error cut the file back to where it was and raise it."""
    with path.open("ab", buffering=0) as f:
        start = f.seek(0, os.SEEK_END)
        try:
            view = memoryview(data)
            while view:
                view = view[f.write(view):]
        except OSError:
            f.truncate(start)  # a shorter file needs no room
            raise


class StepMeter:
    """Loss and token counts since the last metrics line.

    Sums stay on the device, so a step adds to them without a host sync; ``line`` reads them with one
    collective over the processes (only on logged steps) and starts the next interval. ``peak_flops``: one
    device's dense FLOP/s (``anyfit.profiling.flops.device_peak``); with it every line carries ``mfu``, the model
    FLOPs of all processes over the interval's time and their summed peak. ``router``: a mixture of experts' load
    balancing (``anyfit.model.moe.RouterBalance``); every line then carries ``aux_loss``, the mean of the
    micro-batches' aux losses over the interval (before the coefficient), apart from ``loss``. ``sources``: the
    names of the sources the loss is split by (``data.mix``, ``data.source_column``); every line then carries ``loss/<name>``, each source's summed token loss over
    its trained tokens (token-weighted as ``loss`` is: the ``trainable_tokens/<name>``-weighted mean of them is
    ``loss``).
    """

    def __init__(self, device: torch.device, peak_flops: float = 0.0, router=None, sources: list[str] = ()):
        self.loss = torch.zeros((), device=device)  # summed token loss of the finite steps
        self.trained = torch.zeros((), device=device, dtype=torch.long)  # their trainable tokens (global window)
        self.real_tokens = 0  # tokens this process fed to the model (host ints: no sync)
        self.flops = 0.0  # model FLOPs of this process's windows (host float)
        self.peak_flops = peak_flops
        self.router = router
        self.sources = list(sources)
        self.by_source = torch.zeros(len(self.sources), device=device)  # summed token loss per source (finite steps)
        # per step: (finite, the window's trained tokens per source); host counts, read with the finite flags
        self.source_steps: list[tuple[torch.Tensor, np.ndarray]] = []
        self.t0 = time.perf_counter()

    def add(self, loss_sum: torch.Tensor, finite: torch.Tensor | bool, window_tokens: int, real_tokens: int,
            flops: float = 0.0, by_source: tuple[torch.Tensor, np.ndarray] | None = None) -> None:
        """One step: this process's summed loss, whether the step was taken, the window's trained tokens (all
        processes); ``by_source``: this process's summed loss per source and the window's trained tokens per
        source (all processes)."""
        finite = torch.as_tensor(finite, device=self.loss.device)
        self.loss += torch.where(finite, loss_sum, 0.0)
        self.trained += finite * window_tokens
        self.real_tokens += real_tokens
        self.flops += flops
        if by_source is not None:
            sums, tokens = by_source
            self.by_source += torch.where(finite, sums, 0.0)
            self.source_steps.append((finite, tokens))

    def line(self, accelerator, device: str, **fields: Any) -> dict[str, Any]:
        """The metrics record of the interval (``fields`` first: step, lr, ...), then a fresh interval."""
        host = torch.tensor([float(self.real_tokens), self.flops / 1e9], device=self.loss.device)  # GFLOPs: fp32-safe
        aux = self._aux()
        totals = torch.cat([self.loss.float().reshape(1), host, self.by_source, aux])
        loss_total, real_total, gflops, *rest = accelerator.reduce(totals, reduction="sum").tolist()
        by_source, aux = rest[:len(self.sources)], rest[len(self.sources):]
        elapsed = time.perf_counter() - self.t0  # after the collective above: the device work is included
        trained = int(self.trained)
        record = {**fields, "loss": round(loss_total / trained, 6) if trained else float("nan"),
                  "tokens_per_s": round(real_total / elapsed, 1), "real_tokens": int(real_total),
                  "trainable_tokens": trained, "peak_mem_gib": round(peak_bytes(device) / GIB, 3), **system_metrics(device)}
        if self.sources:
            record.update(self._source_fields(by_source))
        if aux:
            record["aux_loss"] = round(aux[0] / aux[1], 6) if aux[1] else float("nan")
        if self.peak_flops:
            record["mfu"] = round(gflops * 1e9 / elapsed / (self.peak_flops * accelerator.num_processes), 5)
        self.loss.zero_()
        self.trained.zero_()
        self.by_source.zero_()
        self.source_steps.clear()
        self.real_tokens = 0
        self.flops = 0.0
        self.t0 = time.perf_counter()
        return record


    def _source_fields(self, sums: list[float]) -> dict[str, Any]:
        """``loss/<name>`` and ``trainable_tokens/<name>`` of the interval's finite steps (a source none of whose
        tokens were trained in the interval has no ``loss/<name>`` in that line)."""
        finite = torch.stack([f for f, _ in self.source_steps]).cpu().tolist() if self.source_steps else []
        tokens = sum((t for ok, (_, t) in zip(finite, self.source_steps) if ok), np.zeros(len(self.sources), np.int64))
        out: dict[str, Any] = {}
        for name, total, n in zip(self.sources, sums, tokens.tolist()):
            if n:
                out[source_key("loss", name)] = round(total / n, 6)
            out[source_key("trainable_tokens", name)] = n
        return out

    def _aux(self) -> torch.Tensor:
        """(summed aux losses, how many) of the router's micro-batches since the last line; empty without one."""
        if self.router is None:
            return torch.zeros(0, device=self.loss.device)
        total, count = self.router.drain()
        total = torch.zeros((), device=self.loss.device) if total is None else total.to(self.loss.device)
        return torch.stack([total.float(), torch.tensor(float(count), device=self.loss.device)])


def system_metrics(device: str) -> dict[str, float]:
    """What the machine is doing, where it can be read cheaply: host CPU use since the last call, and the GPU's
    utilisation (through NVML, when the pynvml package is there)."""
    import psutil  # a dependency of accelerate

    out = {"cpu_percent": psutil.cpu_percent(interval=None)}
    if device == "cuda":
        try:
            out["gpu_util_percent"] = float(torch.cuda.utilization())
        except (ModuleNotFoundError, RuntimeError):  # no pynvml / NVML: utilisation is not readable here
            pass
    return out

"""Launches of the tiny run with real processes (torchrun over gloo, or one process), shared by the sharded,
DeepSpeed and gradient-sync equivalence tests."""

from __future__ import annotations

import socket
import subprocess
import sys
from pathlib import Path

import psutil
from tiny_runs import ENV, HANG_S, read_metrics, write_dataset

STEPS = 8


def run_config(tmp_path: Path, model_dir: Path, *extra: str) -> Path:
    data = write_dataset(tmp_path / "d.jsonl", n=24)
    path = tmp_path / "c.yaml"
    path.write_text(f"model: {{name_or_path: {model_dir}}}\ndata: {{path: {data}, template: plain}}\n"
                    f"train: {{effective_batch: 8, micro_batch: 2, max_steps: {STEPS}, learning_rate: 1.0e-2, seed: 0, "
                    "log_every: 1, save_every: 2, keep_last: 3}\n" + "".join(f"{e}\n" for e in extra))
    return path


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def launch(cfg: Path, out: Path, procs: int, *overrides: str, wait: bool = True, restarts: int = 0):
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", str(procs), "--master_port",
           str(free_port()), "--max-restarts", str(restarts), "-m", "anyfit", "train", str(cfg),
           f"train.output_dir={out}", *overrides]
    if procs == 1:
        cmd = [sys.executable, "-m", "anyfit", "train", str(cfg), f"train.output_dir={out}", *overrides]
    proc = subprocess.Popen(cmd, env=ENV, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    if not wait:
        return proc
    try:
        stdout, stderr = proc.communicate(timeout=HANG_S)
    except subprocess.TimeoutExpired:  # a hang: kill the launcher and its workers, show their last lines
        for child in psutil.Process(proc.pid).children(recursive=True):
            child.kill()
        proc.kill()
        stdout, stderr = proc.communicate()
        raise AssertionError(f"timed out after {HANG_S} s: {' '.join(cmd)}\n--- stdout\n{stdout[-3000:]}\n--- stderr\n"
                             f"{stderr[-3000:]}") from None
    assert proc.returncode == 0, stderr[-12000:]  # room for a crashed rank's stacks (tiny_runs.ENV) before the summary
    return stdout


def run_here(cfg: Path, out: Path, *overrides: str) -> str:
    """The one-process run ``launch(cfg, out, 1, ...)`` makes, in this process: the same config and code path as
    ``anyfit train`` (on one torch thread, as a launched process), without a new interpreter's imports (about 12 s
    of CPU per launch on the 2-core VM); its printed lines as the log."""
    import torch

    from anyfit.config import load_config
    from anyfit.training.loop import train

    lines: list[str] = []
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # as a launched process has it (ENV: OMP_NUM_THREADS=1), also under -n 0: bit for bit
    try:
        train(load_config(cfg, [f"train.output_dir={out}", *overrides]), echo=lines.append)
    finally:
        torch.set_num_threads(threads)
    return "\n".join(lines)


def losses(out: Path) -> list[float]:
    return [m["loss"] for m in read_metrics(out) if "loss" in m]


def complete_run(tmp_path_factory, model_dir: Path, name: str, procs: int, sharding: str) -> tuple[Path, str]:
    """A whole run of the module's config in a folder of its own: (its output folder, its log); one process runs
    here (``run_here``)."""
    tmp = tmp_path_factory.mktemp(name)
    out = tmp / "out"
    if procs == 1:
        return out, run_here(run_config(tmp, model_dir), out, f"runtime.sharding={sharding}")
    return out, launch(run_config(tmp, model_dir), out, procs, f"runtime.sharding={sharding}")

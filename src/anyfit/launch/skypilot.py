"""SkyPilot: the launch as a SkyPilot task (its YAML, as ``sky launch`` takes it), launched, followed and torn down
through SkyPilot's own command line, ``sky``.

SkyPilot runs from its own environment (``uv tool install skypilot``), not as an extra of anyfit: it pins
``click<8.2`` and the ``huggingface_hub`` anyfit pins needs ``click>=8.4.2``, so the two cannot share one (``uv lock``
with a ``skypilot`` extra finds no solution). The task file is the interface between them, as ``sky launch`` reads it.

The bundle folder is a ``file_mounts`` upload (SkyPilot rsyncs it: blobs already on the cluster are not sent
again); a bucket store (``s3://``, ``gs://``, ``r2://``, ...) is mounted at ``/anyfit-store`` (``mode: MOUNT``),
so the job syncs its run folder to it as to a folder; several nodes come from ``num_nodes`` and the job's
``torchrun`` reads SkyPilot's node variables (``anyfit.launch.remote.train_command``). Secrets go as
``secrets`` (SkyPilot redacts them) and ``--secret NAME``: their values from this machine's environment, passed to
``sky`` in its environment, never on a command line or in the file.
"""

from __future__ import annotations

import os
import shutil
import subprocess
from pathlib import Path

import yaml

from anyfit.config import ConfigError
from anyfit.launch.bundle import Bundle

MOUNT = "/anyfit"
STORE_MOUNT = "/anyfit-store"
BUCKETS = ("s3://", "gs://", "r2://", "cos://", "oci://", "https://")


def job_store(store: str) -> str:
    """Where the job reaches ``store``: a bucket at its mount point, a Hub repo as it is."""
    return STORE_MOUNT if store.startswith(BUCKETS) else store


def task_dict(bundle: Bundle, accelerator: str, nodes: int, store: str, secrets: list[str]) -> dict:
    mounts: dict = {MOUNT: str(bundle.root)}
    if store.startswith(BUCKETS):
        mounts[STORE_MOUNT] = {"source": store, "mode": "MOUNT"}
    task = {"name": bundle.run, "resources": {"accelerators": accelerator}, "num_nodes": nodes,
            "file_mounts": mounts, "envs": {"ANYFIT_WORK": "~/anyfit-work"},
            # uv installs the wheel and its pinned dependencies (job.sh); SkyPilot's images have pip
            "setup": "python3 -m pip install -q uv", "run": " ".join(bundle.command(MOUNT))}
    if secrets:
        task["secrets"] = {name: None for name in secrets}
    return task


def task_yaml(task: dict) -> str:
    return yaml.safe_dump(task, sort_keys=False)


NOT_INSTALLED = ("SkyPilot is not installed: `uv tool install skypilot` (in its own environment: it pins click<8.2, "
                 "which anyfit's huggingface_hub cannot use), then `sky check` to enable a cloud; or use --on hf-jobs.")


def sky_command() -> str:
    sky = shutil.which("sky")
    if sky is None:
        raise ConfigError(NOT_INSTALLED)
    return sky


def _sky(args: list[str], what: str, env: dict[str, str] | None = None) -> None:
    """``sky ARGS`` on this terminal (its own output streams through); refused in one line when it fails."""
    done = subprocess.run([sky_command(), *args], env=env, check=False)
    if done.returncode:
        raise ConfigError(f"SkyPilot refused {what} (`sky {args[0]}` exited with status {done.returncode}; its "
                          "message is above): run `sky check` for the clouds and their credentials.")


def launch_args(task_file: Path, cluster: str, secrets: list[str], detach: bool) -> list[str]:
    """``sky launch`` of the task: a cluster named after the run, torn down when the job ends."""
    named = [arg for name in secrets for arg in ("--secret", name)]
    return ["launch", "-y", "--down", "-c", cluster, *named, *(["--detach-run"] if detach else []), str(task_file)]


def submit(task_file: Path, cluster: str, secrets: dict[str, str], detach: bool) -> None:
    """``sky launch`` of the task file; the secrets' values reach ``sky`` through its environment only."""
    _sky(launch_args(task_file, cluster, sorted(secrets), detach), "the launch", env={**os.environ, **secrets})


def status(cluster: str) -> None:
    _sky(["status", cluster], f"the status of {cluster}")


def logs(cluster: str, follow: bool) -> None:
    _sky(["logs", cluster, "--follow" if follow else "--no-follow"], f"the log of {cluster}")


def down(cluster: str) -> None:
    """The cluster torn down: the job stops; its synced checkpoints stay in the store."""
    _sky(["down", "-y", cluster], f"tearing down {cluster}")

"""SkyPilot: the launch as a SkyPilot task (its YAML, as ``sky launch`` takes it), and its submission through
SkyPilot's Python API (the optional extra ``anyfit[cloud]``).

The bundle folder is a ``file_mounts`` upload (SkyPilot rsyncs it: blobs already on the cluster are not sent
again); a bucket store (``s3://``, ``gs://``, ``r2://``, ...) is mounted at ``/anyfit-store`` (``mode: MOUNT``),
so the job syncs its run folder to it as to a folder; several nodes come from ``num_nodes`` and the job's
``torchrun`` reads SkyPilot's node variables (``anyfit.launch.remote.train_command``). Secrets go as
``secrets`` (SkyPilot redacts them), their values from this machine's environment at launch, never in the file.
"""

from __future__ import annotations

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


def load_sky():
    try:
        import sky  # the optional extra anyfit[cloud]
    except ImportError:
        raise ConfigError("SkyPilot is not installed: pip install 'anyfit[cloud]' (then `sky check` to enable a "
                          "cloud), or use --on hf-jobs.") from None
    return sky


def _refused(e: Exception, what: str) -> ConfigError:
    """SkyPilot's own message names the cloud and the fix (no cloud enabled, quota, no API server): one line."""
    return ConfigError(f"SkyPilot refused {what}: {' '.join(str(e).split())[:300]} (run `sky check`)")


def submit(task_file: Path, cluster: str, secrets: dict[str, str]):
    """``sky launch`` of the task file (the cluster torn down when the job ends), through SkyPilot's Python API;
    the request to follow."""
    sky = load_sky()
    task = sky.Task.from_yaml(str(task_file))
    if secrets:
        task.update_secrets(secrets)
    try:
        return sky.launch(task, cluster_name=cluster, down=True)
    except Exception as e:
        raise _refused(e, "the launch") from None


def follow(request) -> None:
    """The launch's log until the job ends (``sky launch`` without ``--detach-run``)."""
    sky = load_sky()
    try:
        sky.stream_and_get(request)
    except Exception as e:
        raise _refused(e, "following the launch") from None


def status(cluster: str) -> tuple[str, float | None]:
    """The cluster's status and when it was launched (Unix seconds; None when SkyPilot has no such cluster: the
    job ended and the cluster was torn down, or it never came up)."""
    sky = load_sky()
    try:
        found = sky.get(sky.status(cluster_names=[cluster]))
    except Exception as e:
        raise _refused(e, f"the status of {cluster}") from None
    if not found:
        return "no cluster (ended and torn down, or never up)", None
    record = found[0]
    state = getattr(record, "status", None) or record["status"]
    launched = getattr(record, "launched_at", None) if not isinstance(record, dict) else record.get("launched_at")
    return getattr(state, "value", str(state)), launched


def logs(cluster: str, follow_: bool) -> None:
    """The job's log (``sky logs``) on this terminal."""
    sky = load_sky()
    try:
        sky.tail_logs(cluster, job_id=None, follow=follow_)
    except Exception as e:
        raise _refused(e, f"the log of {cluster}") from None


def down(cluster: str) -> None:
    """The cluster torn down (``sky down``): the job stops; its synced checkpoints stay in the store."""
    sky = load_sky()
    try:
        sky.get(sky.down(cluster))
    except Exception as e:
        raise _refused(e, f"tearing down {cluster}") from None

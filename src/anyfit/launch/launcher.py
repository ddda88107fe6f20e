"""``anyfit launch`` from start to submission: the machine from the plan, the bundle staged, the job spec printed
(image, command, machine, env names, files and sizes), then (unless ``--dry-run``) the upload and the job, and a
record of it (``anyfit jobs`` reads it). Secrets are read from this machine's environment and only their names are
ever printed or written."""

from __future__ import annotations

import json
import os
import time
from dataclasses import dataclass, field
from pathlib import Path

from anyfit.cache import cache_root
from anyfit.config import Config, ConfigError
from anyfit.config.schema import TRACKERS
from anyfit.launch import hf_jobs, skypilot
from anyfit.launch.bundle import Bundle, make_bundle
from anyfit.launch.choose import Choice
from anyfit.units import GIB

# The secrets a run needs, by what it uses: the Hub (models, data, the store) and each tracker of train.report_to.
TRACKER_SECRETS = {"wandb": ["WANDB_API_KEY"], "mlflow": ["MLFLOW_TRACKING_URI", "MLFLOW_TRACKING_TOKEN"],
                   "trackio": [], "tensorboard": []}


@dataclass
class Launch:
    """What the command line asked for."""

    provider: str
    run: str
    store: str
    gpus: int
    nodes: int = 1
    detach: bool = False
    retries: int = 0
    timeout: str | None = None
    namespace: str | None = None
    extra_secrets: list[str] = field(default_factory=list)


def secret_names(cfg: Config, extra: list[str]) -> list[str]:
    report = cfg.train.report_to if isinstance(cfg.train.report_to, list) else [cfg.train.report_to]
    names = ["HF_TOKEN", *(n for t in report if t in TRACKERS for n in TRACKER_SECRETS[t]), *extra]
    return list(dict.fromkeys(names))


def secret_values(names: list[str]) -> dict[str, str]:
    """The secrets' values from this environment (HF_TOKEN from the Hub login too); a missing one is refused."""
    values = {}
    for name in names:
        value = hf_jobs.token_or_refuse() if name == "HF_TOKEN" else os.environ.get(name)
        if not value and name != "MLFLOW_TRACKING_TOKEN":
            raise ConfigError(f"{name} is not set here: the job needs it (set it in this shell; it is sent as a "
                              "secret, never written or printed).")
        if value:
            values[name] = value
    return values


def timeout_for(choice: Choice | None, asked: str | None) -> str:
    """The job's time limit: as asked, else twice the plan's whole run plus 30 minutes for installing and
    downloading (Jobs stop a job at 30 minutes by default), else 24 hours when the run's length is unknown."""
    if asked:
        return asked
    if choice is None or choice.seconds is None:
        return "24h"
    return f"{int(2 * choice.seconds / 60 + 30)}m"


def stage(cfg: Config, base: Path, launch: Launch, choice: Choice | None) -> Bundle:
    store = skypilot.job_store(launch.store) if launch.provider == "skypilot" else launch.store
    gpus = choice.plan.setup.processes if choice is not None else launch.gpus
    return make_bundle(cfg, base, cache_root() / "launch", launch.run, store=store, gpus=gpus,
                       gpu=choice is not None)


def spec_lines(bundle: Bundle, launch: Launch, choice: Choice | None, secrets: list[str], task_file: Path | None
               ) -> list[str]:
    """The job spec as printed before anything is spent."""
    lines = [f"run: {launch.run} on {launch.provider}"]
    if choice is not None:
        lines += choice.lines()
    if launch.provider == "hf-jobs":
        lines += [f"image: {hf_jobs.IMAGE}", f"flavor: {choice.machine.name if choice else '-'}",
                  f"timeout: {timeout_for(choice, launch.timeout)}; attempts: {launch.retries + 1}",
                  f"volume: the launch repo mounted read-only at {hf_jobs.MOUNT}"]
    else:
        lines += [f"task: {task_file}",
                  f"  = sky {' '.join(skypilot.launch_args(task_file, launch.run, secrets, launch.detach))}",
                  f"resources: {choice.machine.name if choice else '-'}, num_nodes {launch.nodes}"]
    lines += [f"command: {' '.join(bundle.command(hf_jobs.MOUNT if launch.provider == 'hf-jobs' else skypilot.MOUNT))}",
              "  = install the anyfit wheel with pyproject's pins (constraints.txt), anyfit download, anyfit train "
              "train.resume=auto, the run folder synced to the store as it is written",
              "secrets (names only): " + ", ".join(f"{n} ({'set' if os.environ.get(n) or (n == 'HF_TOKEN' and hf_jobs.has_token()) else 'not set here'})"
                                                   for n in secrets),
              f"store: {launch.store} (the run folder, checkpoints as written; private when anyfit creates it)",
              "files:"]
    total = 0
    for name, size in bundle.sizes():
        total += size
        lines.append(f"  {name}  {size / 2**20:,.2f} MiB" if size < GIB else f"  {name}  {size / GIB:,.2f} GiB")
    lines.append(f"  config.yaml, constraints.txt, launch.json, job.sh  (launches/{launch.run}/); {total / 2**20:,.2f} "
                 "MiB of files in all, each sent once")
    if bundle.shipped.hub:
        lines.append("from the Hub, named not copied (the job downloads them): " + ", ".join(bundle.shipped.hub))
    return lines


def record_path(run: str) -> Path:
    return cache_root() / "launches" / f"{run}.json"


def save_record(record: dict) -> None:
    """The launch record here (the cache) and in the namespace's launch repo on the Hub, where ``anyfit jobs`` and
    ``--resume`` read it from any machine."""
    path = record_path(record["run"])
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(record, indent=1))
    hf_jobs.HfJobs(record["namespace"]).put_record(record["repo"], record)


def load_record(run: str, namespace: str | None = None) -> dict:
    """The launch record of ``run``: the Hub's copy when logged in (it has the jobs any machine started for the
    run), else the one this machine wrote; refused in one line when neither has it."""
    path = record_path(run)
    local = json.loads(path.read_text()) if path.is_file() else None
    if hf_jobs.has_token():
        jobs = hf_jobs.HfJobs(namespace or (local or {}).get("namespace"))
        repo = f"{jobs.owner()}/{hf_jobs.LAUNCHES}"
        remote = jobs.get_record(repo, run)
        if remote is not None:
            path.parent.mkdir(parents=True, exist_ok=True)
            path.write_text(json.dumps(remote, indent=1))
            return remote
        where = f"on this machine or in {repo} (another namespace: --namespace)"
    else:
        where = "on this machine (log in to the Hub, `hf auth login`, to read launches made elsewhere)"
    if local is not None:
        return local
    known = sorted(p.stem for p in path.parent.glob("*.json")) if path.parent.is_dir() else []
    raise ConfigError(f"No launch named {run} {where}; launched from here: {', '.join(known) or 'none'}.")


def submit_hf(bundle: Bundle, launch: Launch, choice: Choice, secrets: dict[str, str]) -> dict:
    jobs = hf_jobs.HfJobs(launch.namespace)
    repo = f"{jobs.owner()}/{hf_jobs.LAUNCHES}"
    sent = jobs.upload(bundle, repo)
    print(f"[anyfit launch] uploaded the launch to {repo} ({len(sent)} new file(s); the others were there)")
    record = {"run": launch.run, "provider": "hf-jobs", "namespace": jobs.owner(), "repo": repo,
              "command": bundle.command(hf_jobs.MOUNT), "store": launch.store, "flavor": choice.machine.name,
              "price_per_hour": choice.plan.price_per_hour, "timeout": timeout_for(choice, launch.timeout),
              "retries": launch.retries, "secrets": sorted(secrets), "jobs": []}
    return start_hf(record, secrets)


def start_hf(record: dict, secrets: dict[str, str]) -> dict:
    """A job for the launch ``record`` (a first start or a resume: the same command, which resumes from the
    store), recorded."""
    jobs = hf_jobs.HfJobs(record["namespace"])
    job = jobs.submit(record["run"], record["command"], record["repo"], record["flavor"], secrets, record["timeout"],
                      record["retries"])
    record["jobs"].append({"id": job.id, "url": job.url, "submitted": time.time()})
    save_record(record)
    print(f"[anyfit launch] job {job.id} started: {job.url}")
    return record


def submit_sky(task_file: Path, launch: Launch, choice: Choice, secrets: dict[str, str]) -> dict:
    """``sky launch`` of the task, and its record (on the Hub too, as for HF Jobs)."""
    record = {"run": launch.run, "provider": "skypilot", "namespace": launch.namespace,
              "repo": f"{launch.namespace}/{hf_jobs.LAUNCHES}", "task": str(task_file), "store": launch.store,
              "machine": choice.machine.name, "nodes": launch.nodes,
              "price_per_hour": choice.plan.price_per_hour * launch.nodes, "secrets": sorted(secrets), "jobs": []}
    return start_sky(record, secrets, launch.detach)


def start_sky(record: dict, secrets: dict[str, str], detach: bool) -> dict:
    """The task launched again as a SkyPilot cluster named after the run (a first start or a resume: the job
    resumes from the store), recorded. The task's files are the bundle on the machine that launched it."""
    task = Path(record["task"])
    if not task.is_file():
        raise ConfigError(f"{record['run']}: its SkyPilot task and bundle are on the machine that launched it "
                          f"({task}); resume it from there, or launch the config again with the same --store.")
    skypilot.sky_command()  # not installed: refused before anything is recorded
    record["jobs"].append({"id": record["run"], "submitted": time.time()})
    save_record(record)  # first: the launch streams until the job ends, unless detached
    skypilot.submit(task, record["run"], secrets, detach)
    return record

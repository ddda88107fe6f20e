"""``anyfit launch`` (the config that passed here, on a rented GPU: Hugging Face Jobs or SkyPilot) and ``anyfit
jobs status|logs|cancel|fetch RUN``; the work is in ``anyfit.launch``."""

from __future__ import annotations

import sys
import time
from pathlib import Path

from anyfit.cli.common import config_and_overrides, config_args, load
from anyfit.config import ConfigError


def _base(args) -> Path:
    """The folder local files must lie under: the config file's, else the current one."""
    config, _ = config_and_overrides(args)
    return Path(config).resolve().parent if config and Path(config).is_file() else Path.cwd()


def cmd_launch(args) -> int:
    # start-up time: the planner reads the model config through transformers
    from anyfit.launch import launcher, skypilot
    from anyfit.launch.choose import choose_machine
    from anyfit.model.shape import model_shape

    if args.resume:
        return _resume(args)
    cfg = load(args)  # validated before anything is built or sent
    if args.retries < 0 or (args.gpus is not None and args.gpus < 1) or args.nodes < 1:
        raise ConfigError("--retries must be 0 or more, --gpus and --nodes at least 1.")
    if args.nodes > 1 and args.on != "skypilot":
        raise ConfigError("--nodes: several nodes go through SkyPilot (--on skypilot).")
    choice = choose_machine(cfg, model_shape(cfg.model), args.on, args.gpu, args.gpus, examples=args.examples,
                            price_per_hour=args.price_per_hour)
    if choice.applied:  # the plan's savers, as overrides after the user's: validated again, and in the config shipped
        args.overrides = [*args.overrides, *choice.applied]
        cfg = load(args)
    run = args.name or f"{Path(args.config or 'anyfit').stem}-{time.strftime('%Y%m%d-%H%M%S')}"
    secrets = launcher.secret_names(cfg, args.secret)
    namespace = args.namespace
    if not args.dry_run:  # not logged in: refused before anything is uploaded (the record goes to the Hub too)
        values = launcher.secret_values(secrets)
        namespace = launcher.hf_jobs.HfJobs(namespace).owner()
    store = args.store or f"hf://{namespace or '<your user>'}/{run}"
    launch = launcher.Launch(args.on, run, store, choice.machine.gpus, args.nodes, args.detach, args.retries,
                             args.timeout, namespace, args.secret)
    bundle = launcher.stage(cfg, _base(args), launch, choice)
    task_file = None
    if args.on == "skypilot":
        task = skypilot.task_dict(bundle, choice.machine.name, args.nodes, store, secrets)
        bundle.texts["task.yaml"] = skypilot.task_yaml(task)
        task_file = bundle.root / bundle.launch_dir / "task.yaml"
    bundle.write()
    for line in launcher.spec_lines(bundle, launch, choice, secrets, task_file):
        print(line)
    if args.dry_run:
        print("dry run: nothing was uploaded or started")
        return 0
    if args.on == "skypilot":
        launcher.submit_sky(task_file, launch, choice, values)
        return 0
    record = launcher.submit_hf(bundle, launch, choice, values)
    return 0 if args.detach else _follow(record)


def _resume(args) -> int:
    from anyfit.launch import launcher  # start-up time: huggingface_hub

    record = launcher.load_record(args.resume, args.namespace)
    if record["provider"] == "skypilot":
        launcher.start_sky(record, launcher.secret_values(record["secrets"]), args.detach)
        return 0
    record = launcher.start_hf(record, launcher.secret_values(record["secrets"]))
    return 0 if args.detach else _follow(record)


def _follow(record: dict) -> int:
    from anyfit.launch.hf_jobs import HfJobs  # start-up time: huggingface_hub

    jobs, job_id = HfJobs(record["namespace"]), record["jobs"][-1]["id"]
    for line in jobs.logs(job_id, follow=True):
        print(line, flush=True)
    info = jobs.inspect(job_id)
    if info.status.stage != "COMPLETED":
        print(f"anyfit: error: job {job_id} ended {info.status.stage}"
              + (f" ({info.status.message})" if info.status.message else "")
              + f"; continue it from its last synced checkpoint: anyfit launch --resume {record['run']}",
              file=sys.stderr)
        return 1
    print(f"[anyfit launch] done; bring the run folder back: anyfit jobs fetch {record['run']}")
    return 0


def cmd_jobs(args) -> int:
    from anyfit.launch import launcher  # start-up time: huggingface_hub
    from anyfit.launch.hf_jobs import HfJobs  # start-up time: huggingface_hub
    from anyfit.launch.store import open_store  # start-up time: huggingface_hub

    record = launcher.load_record(args.run, args.namespace)
    if args.action == "fetch":
        out = Path(args.out or f"runs/{args.run}")
        store = record["store"]
        if record["provider"] == "skypilot" and store.startswith(launcher.skypilot.BUCKETS):
            raise ConfigError(f"{args.run} syncs to the bucket {store}: copy it with the cloud's own tool (e.g. "
                              f"`aws s3 sync {store} {out}`); anyfit fetches hf:// and folder stores.")
        found = open_store(store).pull(out)
        print(f"[anyfit jobs] {store} -> {out} ({len(found)} checkpoint(s)); anyfit report/eval/export work on it")
        return 0
    if record["provider"] == "skypilot":
        return _sky_jobs(args, record)
    jobs, job_id = HfJobs(record["namespace"]), record["jobs"][-1]["id"]
    if args.action == "logs":
        for line in jobs.logs(job_id, follow=args.follow):
            print(line, flush=True)
    elif args.action == "cancel":
        jobs.cancel(job_id)
        print(f"[anyfit jobs] cancelled {job_id}; continue later with: anyfit launch --resume {args.run}")
    else:
        print(status_line(record, jobs))
    return 0


def _sky_jobs(args, record: dict) -> int:
    """``anyfit jobs`` of a SkyPilot launch: its cluster (named after the run) through its command line, sky."""
    from anyfit.launch import skypilot  # start-up time: SkyPilot

    cluster = record["run"]
    if args.action == "logs":
        skypilot.logs(cluster, args.follow)
    elif args.action == "cancel":
        skypilot.down(cluster)
        print(f"[anyfit jobs] tore down {cluster}; continue later with: anyfit launch --resume {args.run}")
    else:
        since = record["jobs"][-1]["submitted"] if record["jobs"] else time.time()
        spent = (time.time() - since) / 3600 * record["price_per_hour"]
        print(f"{record['run']}: on SkyPilot, {record['machine']} x {record['nodes']} node(s), {len(record['jobs'])} "
              f"launch(es); the last has cost at most ${spent:,.2f} so far (the table's ${record['price_per_hour']:.2f}"
              f"/h since it was launched; SkyPilot's own figure: sky cost-report); store {record['store']}", flush=True)
        skypilot.status(cluster)
    return 0


def status_line(record: dict, jobs) -> str:
    """The stage of the launch's last job and the cost of all its jobs so far (their running time at the
    flavor's price)."""
    spent, stage = 0.0, "-"
    for job in record["jobs"]:
        info = jobs.inspect(job["id"])
        stage = f"{info.status.stage}" + (f" ({info.status.message})" if info.status.message else "")
        if info.started_at is not None:
            end = info.finished_at.timestamp() if info.finished_at else time.time()
            spent += max(0.0, end - info.started_at.timestamp()) / 3600 * record["price_per_hour"]
    return (f"{record['run']}: {stage} on {record['flavor']}, {len(record['jobs'])} job(s); cost so far "
            f"${spent:,.2f} (${record['price_per_hour']:.2f}/h); store {record['store']}")


def register(sub) -> None:
    p = sub.add_parser("launch", help="Run the config on a rented GPU chosen by the plan: anyfit launch CONFIG "
                                      "[key=value ...] --on hf-jobs|skypilot [--gpu auto|NAME] [--dry-run]")
    config_args(p)
    p.add_argument("--on", choices=("hf-jobs", "skypilot"), default="hf-jobs", help="Where to run (default hf-jobs).")
    p.add_argument("--gpu", default="auto", help="auto (the cheapest machine the config fits on at the memory "
                   "savers the plan chooses there, applied as overrides), or a "
                   "machine: an HF Jobs flavor (l40sx1, a100-large, h200x8, ...) or a SkyPilot accelerator (L40S, H100:8).")
    p.add_argument("--gpus", type=int, default=None, help="Only machines with this many GPUs.")
    p.add_argument("--nodes", type=int, default=1, help="Nodes (SkyPilot's num_nodes).")
    p.add_argument("--store", default=None, help="Where the run folder is synced: hf://OWNER/NAME (default: a private "
                   "model repo named after the run), a folder, or a bucket (s3://..., SkyPilot).")
    p.add_argument("--name", default=None, help="The run's name (default: the config's name and the time).")
    p.add_argument("--examples", type=int, default=None, help="Training examples, for the whole run's time and cost.")
    p.add_argument("--price-per-hour", type=float, default=None, help="USD per hour of the machine, instead of the table's.")
    p.add_argument("--timeout", default=None, help="The job's time limit (e.g. 3h; default: twice the plan's run "
                   "+ 30 min).")
    p.add_argument("--retries", type=int, default=0, help="Start the job again this many times after a failure; each "
                   "resumes from the last synced checkpoint.")
    p.add_argument("--secret", action="append", default=[], help="Another environment variable to send as a secret.")
    p.add_argument("--namespace", default=None, help="HF Jobs: the user or organization billed.")
    p.add_argument("--detach", action="store_true", help="Return once the job is started (do not stream its log).")
    p.add_argument("--resume", default=None, metavar="RUN", help="Start a launched run again, from its last synced "
                   "checkpoint.")
    p.add_argument("--dry-run", action="store_true", help="Print the job spec; upload and start nothing.")
    p.set_defaults(func=cmd_launch)

    p = sub.add_parser("jobs", help="A launched run: anyfit jobs status|logs|cancel|fetch RUN")
    p.add_argument("action", choices=("status", "logs", "cancel", "fetch"))
    p.add_argument("run", help="The run's name (anyfit launch printed it).")
    p.add_argument("--follow", action="store_true", help="logs: stream until the job ends.")
    p.add_argument("--namespace", default=None, help="The Hub user or organization the run was launched under "
                   "(default: the one logged in); its launch record is read from there.")
    p.add_argument("--out", default=None, help="fetch: where the run folder goes (default runs/RUN).")
    p.set_defaults(func=cmd_jobs)

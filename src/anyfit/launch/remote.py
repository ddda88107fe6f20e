"""The launched job's side: ``python -m anyfit.launch.remote LAUNCH.json WORK`` (run by the job's ``job.sh`` once
the anyfit wheel is installed).

1. Lays the shipped files out in ``WORK`` (symbolic links to the content-addressed blobs, at the relative paths
   the resolved config names), with the resolved config as ``WORK/config.yaml``.
2. Pulls the run folder from the store (``anyfit.launch.store``): a job started again after a preemption, a
   time-out or a failure continues from the last checkpoint that reached it.
3. ``anyfit download`` (the model and hub data, before the clock-heavy part), then ``anyfit train`` with
   ``train.resume=auto``: one process per GPU under torchrun (``torch.distributed.run``, as anyfit runs several
   GPUs), several nodes through SkyPilot's node variables.
4. While training runs, pushes the run folder to the store (node 0): each checkpoint as soon as it is complete,
   the rest every ``sync_every`` seconds, and once more at the end, whatever the exit status.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import threading
import time
from pathlib import Path

from anyfit.launch.store import open_store


def lay_out(launch: dict, bundle: Path, work: Path) -> None:
    """The shipped files at the paths the resolved config names, and the config, in ``work``."""
    for rel, digest in launch["files"].items():
        path = work / rel
        path.parent.mkdir(parents=True, exist_ok=True)
        if path.is_symlink() or path.exists():
            path.unlink()
        path.symlink_to(bundle / "blobs" / digest)


def train_command(gpus: int, env: dict[str, str]) -> list[str]:
    """``anyfit train`` for this node: alone for one GPU (or the CPU), under torchrun for several; the node
    count, rank and head address from SkyPilot's variables when it runs several nodes."""
    train = ["-m", "anyfit", "train", "config.yaml", "train.resume=auto"]
    nodes = int(env.get("SKYPILOT_NUM_NODES", "1"))
    if gpus <= 1 and nodes <= 1:
        return [sys.executable, *train]
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", str(gpus)]
    if nodes > 1:
        head = env["SKYPILOT_NODE_IPS"].split()[0]
        cmd += ["--nnodes", str(nodes), "--node_rank", env["SKYPILOT_NODE_RANK"], "--master_addr", head,
                "--master_port", "29500"]
    return [*cmd, *train]


def checkpoint_names(run: Path) -> set[str]:
    """The complete checkpoints of the run folder: a ``checkpoint-<step>`` folder appears only once the loop has
    written it whole (under a hidden name) and renamed it."""
    if not run.is_dir():
        return set()
    return {e.name for e in os.scandir(run) if e.is_dir() and e.name.startswith("checkpoint-")}


class Syncer:
    """Pushes the run folder to the store from a thread: as soon as a new checkpoint is complete (the run folder's
    top level looked at every ``poll`` seconds: one directory listing, so a watcher library would buy nothing),
    every ``every`` seconds for the rest (metrics, logs), and on ``finish``. A push that fails (the network, a
    checkpoint pruned while it was read) is said in one line and tried again at the next periodic push."""

    def __init__(self, store, run: Path, every: float, poll: float = 1.0):
        self.store, self.run, self.every, self.poll = store, run, every, min(poll, every)
        self.stop = threading.Event()
        self.thread = threading.Thread(target=self._loop, daemon=True)
        self.seen, self.last = checkpoint_names(run), time.monotonic()

    def _push(self) -> None:
        try:
            if self.run.is_dir() and self.store.push(self.run):
                print(f"[anyfit launch] synced the run folder to {self.store.describe()}", flush=True)
        except Exception as e:  # one line, and the next push tries again: the run itself is not stopped
            print(f"[anyfit launch] sync to {self.store.describe()} failed, will retry: "
                  f"{' '.join(str(e).split())[:300]}", flush=True)

    def tick(self) -> None:
        """One look at the run folder: a push when a new checkpoint is complete or the period has passed."""
        now = checkpoint_names(self.run)
        if now - self.seen or time.monotonic() - self.last >= self.every:
            self._push()
            self.seen, self.last = now, time.monotonic()

    def _loop(self) -> None:
        while not self.stop.wait(self.poll):
            self.tick()

    def start(self) -> None:
        self.thread.start()

    def finish(self) -> None:
        self.stop.set()
        if self.thread.is_alive():
            self.thread.join()
        self._push()


def main(argv: list[str] | None = None) -> int:
    launch_json, work = (argv if argv is not None else sys.argv[1:])[:2]
    launch_json, work = Path(launch_json).resolve(), Path(work).resolve()
    launch = json.loads(launch_json.read_text())
    bundle = launch_json.parent.parent.parent
    work.mkdir(parents=True, exist_ok=True)
    lay_out(launch, bundle, work)
    (work / "config.yaml").write_text((launch_json.parent / "config.yaml").read_text())
    head = os.environ.get("SKYPILOT_NODE_RANK", "0") == "0"
    store = open_store(launch["store"])
    run = work / launch["output_dir"]
    if head:
        found = store.pull(run)
        print(f"[anyfit launch] run {launch['run']}: "
              + (f"{len(found)} checkpoint(s) from {store.describe()}, newest {found[-1]}" if found
                 else f"a fresh start (nothing in {store.describe()} yet)"), flush=True)
    env = {**os.environ}
    code = subprocess.call([sys.executable, "-m", "anyfit", "download", "config.yaml"], cwd=work, env=env)
    if code:
        return code
    syncer = Syncer(store, run, launch.get("sync_every", 30.0)) if head else None
    if syncer:
        syncer.start()
    try:
        code = subprocess.call(train_command(launch["gpus"], env), cwd=work, env=env)
    finally:
        if syncer:
            syncer.finish()
    print(f"[anyfit launch] anyfit train exited with status {code}", flush=True)
    return code


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())

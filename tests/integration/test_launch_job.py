"""The launched job's exact command (``job.sh`` of an ``anyfit launch`` bundle), run here in a fresh folder and a fresh
virtual environment holding only what would be uploaded (the wheel, the resolved config, the data and the model):
it trains to the losses of the local run; killed after a checkpoint reached a local stand-in for the remote store,
then started again on a fresh machine (a new folder), it resumes from what the store holds, bit-identical to a run
never interrupted."""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
from pathlib import Path

import pytest
import torch
from launches import losses, run_here
from tiny_runs import ENV, HANG_S, final_weights, metric_steps, wait_for, write_dataset

from anyfit.config import load_config
from anyfit.launch.bundle import make_bundle

pytestmark = [pytest.mark.slow, pytest.mark.multirun]
STEPS = 8


def project(tmp_path: Path, model_dir: Path) -> Path:
    """A user's folder: the model, the data and the config, side by side."""
    proj = tmp_path / "proj"
    shutil.copytree(model_dir, proj / "model")
    data = write_dataset(proj / "d.jsonl", n=24)
    cfg = proj / "c.yaml"
    cfg.write_text(f"model: {{name_or_path: {proj / 'model'}}}\ndata: {{path: {data}, template: plain}}\n"
                   f"train: {{effective_batch: 4, micro_batch: 2, max_steps: {STEPS}, learning_rate: 1.0e-3, "
                   "save_every: 2, keep_last: 2, seed: 0, log_every: 1}\n")
    return cfg


def staged(cfg: Path, tmp_path: Path, store: Path, *overrides: str) -> Path:
    bundle = make_bundle(load_config(cfg, list(overrides)), cfg.parent, tmp_path / "bundle", "tiny-run", store=str(store), gpus=0,
                         gpu=False, sync_every=0.2)
    return bundle.write() / "job.sh"


def start_job(job_sh: Path, machine: Path) -> subprocess.Popen:
    """The job's command on a fresh 'machine' (an empty folder), as the provider runs it."""
    machine.mkdir(parents=True)
    env = {k: v for k, v in ENV.items() if k not in ("VIRTUAL_ENV", "PYTHONPATH")}
    return subprocess.Popen(["bash", str(job_sh)], cwd=machine, env=env, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True, start_new_session=True)


def finish(proc: subprocess.Popen) -> str:
    out, _ = proc.communicate(timeout=HANG_S)
    assert proc.returncode == 0, out[-4000:]
    return out


def test_the_job_command_trains_as_the_local_run_then_resumes_from_the_store(tiny_llama_dir, tmp_path):
    cfg = project(tmp_path, tiny_llama_dir)
    store = tmp_path / "store"
    job_sh = staged(cfg, tmp_path, store)
    assert not any(p.is_symlink() or p.suffix == ".py" for p in (tmp_path / "bundle").rglob("*"))  # what is uploaded
    run_here(cfg, tmp_path / "local")

    # (b) the whole job on a fresh machine: the store gets the same run the local one wrote
    log = finish(start_job(job_sh, tmp_path / "machine-b"))
    assert "a fresh start" in log
    assert losses(store) == losses(tmp_path / "local")  # the same numbers, not close ones
    for k, v in final_weights(tmp_path / "local").items():
        assert torch.equal(v, final_weights(store)[k]), k

    # (c) killed once a checkpoint reached the store, then the job again on another fresh machine; long enough
    # (a few seconds) that the kill lands well before its end
    longer = ("train.max_steps=200", "train.save_every=4")
    store_c = tmp_path / "store-c"
    job_sh = staged(cfg, tmp_path, store_c, *longer)
    victim = start_job(job_sh, tmp_path / "machine-c1")
    # any checkpoint: on a fast machine checkpoint-4 is pruned (keep_last 2) before a poll of the store sees it
    wait_for(lambda: any(store_c.glob("checkpoint-*/trainer_state.json")), victim)
    os.killpg(victim.pid, signal.SIGKILL)  # the machine goes away: the job and everything it started
    victim.wait()
    assert not (store_c / "model.safetensors").exists()
    log = finish(start_job(job_sh, tmp_path / "machine-c2"))
    assert "checkpoint(s) from" in log and "resumed from" in log
    run_here(cfg, tmp_path / "local-c", *longer)
    a, b = final_weights(tmp_path / "local-c"), final_weights(store_c)
    assert a.keys() == b.keys()
    for k in a:
        assert torch.equal(a[k], b[k]), k  # bit-identical
    assert metric_steps(store_c) == list(range(1, 201))

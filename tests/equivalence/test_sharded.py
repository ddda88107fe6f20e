"""Sharded training (FSDP2 ``fully_shard``) with real processes over gloo: each process holds 1/N, the run
matches the unsharded one, resumes bit-identically after SIGKILL, moves between process counts, and leaves
ordinary Hugging Face outputs. Multi-node launch is exercised as two torchrun "nodes" on loopback. (Sharded LoRA:
test_sequence_parallel.py, whose LoRA run is sharded too.)"""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

import psutil
import pytest
import torch
from launches import STEPS, complete_run, free_port, launch, losses, run_config, run_here
from safetensors.torch import load_file
from tiny_runs import ENV, HANG_S, final_weights, metric_steps, wait_for

from anyfit.training.checkpoints.integrity import checkpoint_problem

pytestmark = [pytest.mark.multiprocess, pytest.mark.multirun]

@pytest.fixture(scope="module")
def four_processes(tiny_llama_dir, tmp_path_factory) -> Path:
    """A complete sharded run on four processes (its checkpoints are resumed on other layouts below)."""
    out, log = complete_run(tmp_path_factory, tiny_llama_dir, "four", 4, "fsdp")
    assert "sharding fsdp: asked for in the config" in log
    return out


@pytest.mark.parametrize("procs", [2, 4])
def test_sharded_run_holds_one_nth_and_matches_the_unsharded_run(procs, unsharded, request):
    out = request.getfixturevalue("two_processes" if procs == 2 else "four_processes")  # [2] alone starts no four
    info = json.loads((out / "run_info.json").read_text())
    held, total = info["held_per_process"], info["parameters"]["total"]
    assert len(held["parameters"]) == procs
    # each process holds about 1/N of the weights and of the AdamW states (two per weight)
    for params, states in zip(held["parameters"], held["optimizer_states"]):
        assert abs(params - total / procs) <= 0.02 * total, (params, total)
        assert abs(states - 2 * total / procs) <= 0.04 * total, (states, total)
    # the model was read once: process 0 read it, the others built it on the meta device and received shards
    assert held["loaded_parameters"] == [total] + [0] * (procs - 1)
    # fp32 sums over a different split of the reductions: the same run to round-off
    assert losses(out) == pytest.approx(losses(unsharded), rel=2e-4)
    a, b = load_file(unsharded / "model.safetensors"), load_file(out / "model.safetensors")
    assert a.keys() == b.keys()
    for k in a:
        torch.testing.assert_close(b[k], a[k], rtol=1e-3, atol=2e-5)
    from transformers import AutoModelForCausalLM

    AutoModelForCausalLM.from_pretrained(out)  # an ordinary Hugging Face folder


def test_a_worker_killed_under_torchrun_restarts_the_job_and_it_ends_bit_identical(two_processes, tiny_llama_dir,
                                                                                     tmp_path):
    """torchrun --max-restarts 1, one worker SIGKILLed mid-run: torchrun restarts both, they resume from the newest
    complete checkpoint with nobody setting train.resume, and the run ends as the uninterrupted one did."""
    killed = tmp_path / "killed"
    job = launch(run_config(tmp_path, tiny_llama_dir), killed, 2, "runtime.sharding=fsdp", wait=False, restarts=1)
    try:
        # at the first checkpoint: six steps still to go, so the kill lands mid-run however fast the machine
        wait_for(lambda: (killed / "checkpoint-2" / "trainer_state.json").exists(), job)
        workers = psutil.Process(job.pid).children()
        assert len(workers) == 2
        workers[-1].kill()  # one worker of two: a lost GPU, an OOM kill
        stdout, stderr = job.communicate(timeout=HANG_S)
    finally:  # a failed test leaves no job behind
        for process in [*psutil.Process(job.pid).children(recursive=True), job] if job.poll() is None else []:
            process.kill()
    assert job.returncode == 0, stderr[-4000:]
    assert "restart 1 of this job" in stdout and "resumed from" in stdout
    a, b = final_weights(two_processes), final_weights(killed)
    assert a.keys() == b.keys()
    for k in a:
        assert torch.equal(a[k], b[k]), k
    assert metric_steps(killed) == list(range(1, STEPS + 1))


def test_a_sharded_checkpoint_resumes_on_one_process(unsharded, four_processes, tiny_llama_dir, tmp_path):
    """A checkpoint written by N processes, sharded or not, continues on M processes in either mode: the same
    effective batch and data order, so the same losses as the uninterrupted run. Here 4 sharded to 1; replicated
    on 1 to sharded on 2: the two-node test below; sharded to replicated on several processes: the LoRA test."""
    out = tmp_path / "out"
    out.mkdir()
    shutil.copytree(four_processes / "checkpoint-4", out / "checkpoint-4")
    log = run_here(run_config(tmp_path, tiny_llama_dir), out, "runtime.sharding=none", "train.resume=auto")
    assert_continues_the_unsharded_run(log, out, unsharded)


def assert_continues_the_unsharded_run(log: str, out: Path, unsharded: Path) -> None:
    assert "resumed from" in log and "at step 4" in log
    assert losses(out) == pytest.approx(losses(unsharded)[4:], rel=2e-4)
    a, b = load_file(unsharded / "model.safetensors"), load_file(out / "model.safetensors")
    for k in a:
        torch.testing.assert_close(b[k], a[k], rtol=1e-3, atol=2e-5)


def test_a_sharded_checkpoint_exports_without_the_processes_that_wrote_it(unsharded, four_processes, tmp_path):
    """anyfit export of a checkpoint four processes wrote: one process gathers the shards into ordinary safetensors
    (the same weights as the replicated run's checkpoint of that step), and the export goes on from there."""
    from anyfit.export.folder import export

    checkpoint = tmp_path / "run" / "checkpoint-4"
    shutil.copytree(four_processes / "checkpoint-4", checkpoint)
    said: list[str] = []
    result = export(checkpoint, tmp_path / "exported", dtype="fp32", echo=said.append)
    assert any("gathered the sharded checkpoint" in line for line in said)
    replicated = load_file(unsharded / "checkpoint-4" / "model.safetensors")
    for gathered in (load_file(checkpoint / "model.safetensors"), load_file(result.out / "model.safetensors")):
        assert gathered.keys() == replicated.keys()
        for k in replicated:
            torch.testing.assert_close(gathered[k], replicated[k], rtol=1e-3, atol=2e-5)
    assert checkpoint_problem(checkpoint) is None  # still a checkpoint that resumes


def test_two_nodes_over_loopback_continue_one_processs_checkpoint_sharded(unsharded, tiny_llama_dir, tmp_path):
    """torchrun --nnodes 2: two 'machines' of one process each, rendezvous on 127.0.0.1, continue the one-process
    replicated run's checkpoint sharded over both (FSDP2) and end as that run did."""
    cfg = run_config(tmp_path, tiny_llama_dir)
    out, port = tmp_path / "out", free_port()
    out.mkdir()
    shutil.copytree(unsharded / "checkpoint-4", out / "checkpoint-4")
    nodes = [subprocess.Popen([sys.executable, "-m", "torch.distributed.run", "--nnodes", "2", "--node_rank", str(rank),
                               "--nproc_per_node", "1", "--rdzv-backend", "static", "--master_addr", "127.0.0.1",
                               "--master_port", str(port), "-m", "anyfit", "train", str(cfg),
                               f"train.output_dir={out}", "runtime.sharding=fsdp", "train.resume=auto"],
                              env=ENV, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True) for rank in (0, 1)]
    logs = []
    for node in nodes:
        log, err = node.communicate(timeout=HANG_S)
        assert node.returncode == 0, err[-3000:]
        logs.append(log)
    info = json.loads((out / "run_info.json").read_text())
    assert info["batch"]["processes"] == 2 and len(info["held_per_process"]["parameters"]) == 2
    assert_continues_the_unsharded_run(logs[0], out, unsharded)

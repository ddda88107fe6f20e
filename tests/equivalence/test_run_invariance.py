"""The same run whatever the process count, packing, batch workers or compilation."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from launches import run_here
from safetensors.torch import load_file
from tiny_runs import (
    assert_same_sources,
    read_metrics,
    same_losses,
    train_variants,
    write_mix,
)
from transformers import AutoModelForCausalLM


@pytest.mark.multiprocess
@pytest.mark.multirun
def test_two_processes_match_one(tiny_llama_dir, tmp_path):
    """torchrun --nproc_per_node 2 (gloo on CPU) gives the same per-step loss, the same loss, validation loss and
    trained tokens of each data source (a data.mix: their sums are reduced with the loss's), the same base_kl (full
    fine-tuning: each process looks up its own texts' rows of the base's top-k) and the same final weights as 1
    process."""
    texts = tmp_path / "base.jsonl"
    lines = ("Seven blue birds sat on a wire.", "Numbers: 3, 14, 15, 92, 65.", "A short line.")
    texts.write_text("".join(json.dumps({"text": t}) + "\n" for t in lines))
    cfg_path = tmp_path / "c.yaml"
    cfg_path.write_text(f"model: {{name_or_path: {tiny_llama_dir}}}\ndata: {{template: plain}}\n"
                        "train: {effective_batch: 8, micro_batch: 2, max_steps: 6, learning_rate: 1.0e-3, seed: 0, "
                        "log_every: 1, watch_base: true}\n"
                        f"eval: {{holdout: 3, every: 3, base_text: {texts}, base_top_k: 8}}\n")
    data = write_mix(tmp_path)
    env = {**os.environ, "OMP_NUM_THREADS": "1", "TOKENIZERS_PARALLELISM": "false"}
    env.pop("DS_ACCELERATOR", None)  # as a user's shell has it (an in-process run of this worker may have set it)
    one, two = tmp_path / "one", tmp_path / "two"
    run_here(cfg_path, one, data)  # the one-process run in this process: the same config and train()
    run = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2", "-m", "anyfit",
                          "train", str(cfg_path), f"train.output_dir={two}", data], env=env, capture_output=True,
                         text=True)
    assert run.returncode == 0, run.stderr[-3000:]
    # Accelerate's unwrap_model imports DeepSpeed wherever it is installed (the main process saves the model through
    # it): DeepSpeed must not speak in a run not using it
    assert "[WARNING]" not in run.stderr, run.stderr[-2000:]
    info = json.loads((two / "run_info.json").read_text())
    assert info["batch"]["processes"] == 2 and info["batch"]["accumulation"] == 2
    l1 = [m["loss"] for m in read_metrics(one) if "loss" in m]
    l2 = [m["loss"] for m in read_metrics(two) if "loss" in m]
    assert len(l1) == len(l2) == 6
    assert l1 == pytest.approx(l2, rel=1e-5)
    assert_same_sources(one, two, steps=6, rel=1e-5)
    kl1, kl2 = ({m["step"]: m["base_kl"] for m in read_metrics(out) if "base_kl" in m} for out in (one, two))
    assert sorted(kl1) == sorted(kl2) == [3, 6] and kl2[6] > 0
    assert [kl2[s] for s in (3, 6)] == pytest.approx([kl1[s] for s in (3, 6)], rel=1e-4)
    w1, w2 = load_file(one / "model.safetensors"), load_file(two / "model.safetensors")
    assert w1.keys() == w2.keys()
    for k in w1:
        torch.testing.assert_close(w1[k], w2[k], rtol=1e-4, atol=1e-6)
    assert not any(w1[k].equal(load_file(Path(tiny_llama_dir) / "model.safetensors")[k]) for k in w1 if "norm" not in k)


@pytest.mark.multirun
def test_packing_on_and_off_train_the_same(tiny_qwen2_dir, tmp_path):
    """Packed rows (no padding, position_ids) and padded rows give the same per-step losses and weights."""
    lr, steps = 1e-2, 3
    runs = train_variants(tiny_qwen2_dir, tmp_path, "train.packing", ("true", "false"), "train.effective_batch=8",
                 "train.micro_batch=4", f"train.max_steps={steps}")
    on, off = runs["true"], runs["false"]
    assert same_losses(on.losses, off.losses, steps), (on.losses, off.losses)
    start = AutoModelForCausalLM.from_pretrained(tiny_qwen2_dir)
    assert_same_updates(on.model, off.model, start, lr, steps)


def assert_same_updates(a, b, start, lr: float, steps: int) -> None:
    """The two runs moved every weight the same way, up to what fp32 round-off can do through Adam.

    The two attention paths differ by fp32 round-off (~1e-7 relative) in the gradients. Adam divides each
    gradient element by its own running magnitude, so where a gradient is itself at round-off level (a weight
    that barely matters for this batch) the round-off can change that element's update by up to its bound, lr
    per step. So: (1) no element differs by more than Adam's bound, 2 x lr x steps; (2) the differences are
    rare: at most 1% of a tensor's elements differ by more than 1e-3 of one update (lr); (3) as a whole they
    are small: the norm of the difference is at most 1% of the norm of the update. A real difference between
    the paths (attention leaking across packed examples, a wrong position id) changes most elements'
    gradients and fails (2) and (3) by orders of magnitude; a fixed atol would instead depend on the CPU.
    """
    start_params = dict(start.named_parameters())
    for (name, p), q in zip(a.named_parameters(), b.parameters()):
        p0 = start_params[name].detach()
        diff = (p.detach() - q.detach()).abs()
        update = (q.detach() - p0).norm()
        assert diff.max() <= 2 * lr * steps, (name, diff.max().item())
        assert (diff > 1e-3 * lr).float().mean() <= 0.01, (name, (diff > 1e-3 * lr).float().mean().item())
        assert diff.norm() <= 0.01 * update + 1e-12, (name, diff.norm().item(), update.item())


@pytest.mark.multirun
def test_background_batch_workers_do_not_change_the_run(tiny_qwen2_dir, tmp_path):
    """runtime.num_workers prepares the windows in other processes; the data order and result stay the same."""
    runs = train_variants(tiny_qwen2_dir, tmp_path, "runtime.num_workers", ("0", "2"), "train.effective_batch=4",
                 "train.micro_batch=2", "train.max_steps=4")
    assert len(runs["0"].losses) == 4 and runs["0"].losses == runs["2"].losses  # exactly: same data, same order



@pytest.mark.slow
@pytest.mark.multirun
def test_torch_compile_trains_the_same(tiny_qwen2_dir, tmp_path):
    """runtime.compile=true (inductor, dynamic shapes, packed rows of changing length) matches eager."""
    runs = train_variants(tiny_qwen2_dir, tmp_path, "runtime.compile", ("false", "true"), "train.effective_batch=4",
                 "train.micro_batch=2", "train.max_steps=3")
    assert same_losses(runs["true"].losses, runs["false"].losses, 3), (runs["true"].losses, runs["false"].losses)


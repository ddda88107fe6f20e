"""runtime.fsdp_reduce_every_micro_batch with real processes over gloo: between the micro-batches of a window
each process holds only its shard of the gradients (not FSDP2's unsharded accumulation), and the run's per-step
losses are the ones of one reduce-scatter per window."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
from launches import free_port, launch, losses, run_config
from tiny_runs import ENV, HANG_S

pytestmark = [pytest.mark.multiprocess, pytest.mark.multirun]

# What each process holds when the window's second micro-batch starts, measured inside anyfit's own
# backward_window (the loss function is the hook: it runs at the start of every micro-batch).
_PROBE = """
import json, sys
import torch
from accelerate import Accelerator
from anyfit.config import load_config
from anyfit.data.batching import collate
from anyfit.hardware.runtime import resolve_runtime
from anyfit.model.loading import load_model
from anyfit.training.loss import token_loss_sum
from anyfit.backends import local_numel
from anyfit.backends.fsdp import FSDP2, shard_model
from anyfit.training.step import backward_window

acc = Accelerator(cpu=True)
cfg = load_config(None, [f"model.name_or_path={sys.argv[1]}"])
model = shard_model(load_model(cfg, resolve_runtime(cfg.runtime), empty=acc.process_index > 0), torch.float32,
                    False, acc.device, from_rank0=True)
seen = []  # (re)bound per window below

def loss_fn(m, batch):
    grads = [p.grad for p in m.parameters() if p.grad is not None]
    seen.append({"params_with_grad": len(grads), "grad_elements": local_numel(grads)})
    return token_loss_sum(m, batch)

ids = [list(range(3 + acc.process_index, 12 + i)) for i in range(2)]  # other tokens on each process
rows = [{"input_ids": x, "labels": x} for x in ids]
out = {"params": sum(1 for _ in model.parameters()), "total": sum(p.numel() for p in model.parameters())}
for knob in ("off", "on"):  # one window each, the gradients dropped between them
    seen = []
    backward_window(FSDP2("probe", reduce_every=knob == "on"), acc, model, [collate([r], pad_id=0) for r in rows], 20,
                    loss_fn)
    model.zero_grad(set_to_none=True)
    out[knob] = seen
if acc.is_main_process:
    print("PROBE " + json.dumps(out))
"""


def _probe(tmp_path: Path, model_dir: Path) -> dict:
    script = tmp_path / "probe.py"
    script.write_text(_PROBE)
    proc = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2", "--master_port",
                           str(free_port()), str(script), str(model_dir)], env=ENV, capture_output=True, text=True,
                          timeout=HANG_S)
    assert proc.returncode == 0, proc.stderr[-12000:]  # with a crashed rank's stacks (tiny_runs.ENV)
    (line,) = [x for x in proc.stdout.splitlines() if x.startswith("PROBE ")]
    return json.loads(line.removeprefix("PROBE "))


def test_only_gradient_shards_persist_between_micro_batches(tiny_llama_dir, tmp_path):
    seen = _probe(tmp_path, tiny_llama_dir)
    on, off = seen["on"], seen["off"]
    # after the first micro-batch every parameter holds its reduced shard: about 1/2 of the model's elements
    assert on[0] == {"params_with_grad": 0, "grad_elements": 0}
    assert on[1]["params_with_grad"] == seen["params"]
    assert abs(on[1]["grad_elements"] - seen["total"] / 2) <= 0.02 * seen["total"]
    # one reduce-scatter per window (the default): nothing reduced yet, FSDP2 holds the unsharded gradients
    assert off[1] == {"params_with_grad": 0, "grad_elements": 0}


def test_losses_equal_with_one_reduce_scatter_per_window_or_per_micro_batch(two_processes, tiny_llama_dir, tmp_path):
    # effective batch 8 = micro-batch 2 x accumulation 2 x 2 processes (each step's gradient is compared through the
    # next step's loss); the reference is the shared two-process FSDP2 run, one reduce-scatter per window
    every = tmp_path / "every"
    log = launch(run_config(tmp_path, tiny_llama_dir), every, 2, "runtime.sharding=fsdp", "train.save_every=0",
                 "train.save_final=false", "runtime.fsdp_reduce_every_micro_batch=true")  # its losses are what counts
    assert "gradients reduce-scattered after every micro-batch" in log
    # The same gradient summed in another order (each micro-batch's mean over processes, then the sum, instead of
    # the sum, then the mean): fp32 round-off, the sharded runs' tolerance (tests/equivalence/test_sharded.py).
    assert losses(every) == pytest.approx(losses(two_processes), rel=2e-4)

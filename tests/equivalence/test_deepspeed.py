"""DeepSpeed ZeRO-3 through anyfit's loop (``runtime.sharding=deepspeed``) with real processes on CPU: DeepSpeed's
CPU accelerator over gloo (``DS_ACCELERATOR=cpu``), the same engine and ZeRO-3 partitioning code a GPU run uses.

The config has accumulation 2 on two processes (4 on one) and clipping that bites (train.max_grad_norm=1 against
gradient norms of 2.4-6.3), so anyfit's loss scaling, its window as DeepSpeed's boundary and the clip are all
in play when the losses are compared with the unsharded run's."""

from __future__ import annotations

import json
import math
import shutil
import subprocess
import sys
from pathlib import Path

import deepspeed_ops
import pytest
import torch
from launches import STEPS, launch, losses, run_config
from safetensors.torch import load_file
from tiny_runs import ENV, HANG_S, final_weights, read_metrics

pytest.importorskip("deepspeed", reason="DeepSpeed is installed by the deepspeed dependency group (CI has it)")
pytestmark = [pytest.mark.multiprocess, pytest.mark.multirun]


@pytest.fixture(scope="module", autouse=True)
def built_op():
    """DeepSpeed's CPU collective compiled before the first launch's time limit starts (a no-op once built)."""
    assert deepspeed_ops.build()


@pytest.fixture(scope="module")
def zero3_two(tiny_llama_dir, tmp_path_factory) -> tuple[Path, str]:
    """A complete ZeRO-3 run on two processes: (its output folder, its log). The model is the tiny Llama written as
    an f32 GGUF file, which holds the HF folder's weights exactly: the same run as from the folder (the comparisons
    with the unsharded run below), and the GGUF path of partitioned loading on the way (its own test below). The
    tokenizer is the HF folder's: transformers rebuilds a GGUF file's own in Python, and it is not what is compared."""
    from anyfit.export.gguf_writer import write_gguf

    tmp = tmp_path_factory.mktemp("zero3")
    gguf = write_gguf(tiny_llama_dir, tmp / "small-F32.gguf", "f32", echo=lambda *a: None)
    out = tmp / "out"
    return out, launch(run_config(tmp, gguf), out, 2, "runtime.sharding=deepspeed", f"model.tokenizer={tiny_llama_dir}")


def test_zero3_on_two_processes_matches_the_unsharded_run(zero3_two, unsharded):
    out, log = zero3_two
    assert "sharding deepspeed: ZeRO-3" in log and "partitioned by DeepSpeed ZeRO-3 over 2" in log
    info = json.loads((out / "run_info.json").read_text())
    assert info["batch"]["accumulation"] == 2
    # each process holds its half of the weights and of the AdamW states (two per weight): ZeRO-3 really engaged
    held, total = info["held_per_process"], info["parameters"]["total"]
    # built partitioned (zero.Init through transformers): process 0 read the weights, process 1 none
    assert held["loaded_parameters"] == [total, 0]
    for params, states in zip(held["parameters"], held["optimizer_states"]):
        assert abs(params - total / 2) <= 0.02 * total, (params, total)
        assert abs(states - total) <= 0.04 * total, (states, total)
    metrics = [m for m in read_metrics(out) if "loss" in m]
    assert max(m["grad_norm"] for m in metrics) > 1.0  # the clip at train.max_grad_norm=1 changed updates
    # fp32 sums over another split of the reductions: the same run to round-off
    assert losses(out) == pytest.approx(losses(unsharded), rel=2e-4)
    assert [m["grad_norm"] for m in metrics] == pytest.approx(
        [m["grad_norm"] for m in read_metrics(unsharded) if "loss" in m], rel=1e-3)
    a, b = load_file(unsharded / "model.safetensors"), load_file(out / "model.safetensors")
    assert a.keys() == b.keys()  # gathered whole, tied head once: the folder save_pretrained writes unsharded
    for k in a:
        torch.testing.assert_close(b[k], a[k], rtol=1e-3, atol=2e-5)
    from transformers import AutoModelForCausalLM

    AutoModelForCausalLM.from_pretrained(out)


def test_a_zero3_checkpoint_resumes_bit_identically(zero3_two, tiny_llama_dir, tmp_path):
    """The engine's partitions and optimizer states under checkpoint-4/deepspeed/, anyfit's scheduler, RNG and
    data position beside them: the continued run is the uninterrupted one, bit for bit."""
    written, _ = zero3_two
    out = tmp_path / "out"
    out.mkdir()
    shutil.copytree(written / "checkpoint-4", out / "checkpoint-4")
    assert (out / "checkpoint-4" / "deepspeed").is_dir()
    log = launch(written.parent / "c.yaml", out, 2, "runtime.sharding=deepspeed", f"model.tokenizer={tiny_llama_dir}",
                 "train.resume=auto")
    assert "resumed from" in log and "at step 4" in log
    assert losses(out) == losses(written)[4:]
    a, b = final_weights(written), final_weights(out)
    for k in a:
        assert torch.equal(a[k], b[k]), k


def test_a_gguf_model_is_converted_once_and_partitioned_from_safetensors(zero3_two, tiny_llama_dir):
    """transformers' partitioned loading reads a GGUF file whole on every process: anyfit converts it once into
    safetensors (process 0 first, the others reuse the folder) and loads that on process 0 alone (the run of
    ``zero3_two``). The model has the 1,000-token vocabulary: transformers rebuilds a GGUF file's tokenizer in
    Python (20 s for Qwen's 151k)."""
    from anyfit.model.gguf_cache import is_materialized

    out, log = zero3_two
    (line,) = [line for line in log.splitlines() if "GGUF model read from its safetensors conversion" in line]
    converted = Path(line.split()[-1])
    assert is_materialized(converted)
    info = json.loads((out / "run_info.json").read_text())
    assert info["held_per_process"]["loaded_parameters"] == [info["parameters"]["total"], 0]
    # an f32 GGUF holds the weights exactly (Llama's q/k rows permuted, and back): the partitioned run reads the
    # HF folder's own weights, bit for bit, through the loading every ZeRO-3 run uses
    original, read = load_file(tiny_llama_dir / "model.safetensors"), load_file(converted / "model.safetensors")
    assert original.keys() == read.keys()
    for k in original:
        assert torch.equal(read[k], original[k]), k
    assert len(losses(out)) == STEPS and all(math.isfinite(x) for x in losses(out))


def test_a_zero3_checkpoint_exports_without_the_processes_that_wrote_it(zero3_two, unsharded, tmp_path):
    """anyfit export of a checkpoint two ZeRO-3 processes wrote: DeepSpeed's zero_to_fp32 joins the partitions in
    one process (the replicated run's weights of that step), and the export goes on from there."""
    from anyfit.export.folder import export
    from anyfit.training.checkpoints.integrity import checkpoint_problem

    checkpoint = tmp_path / "run" / "checkpoint-4"
    shutil.copytree(zero3_two[0] / "checkpoint-4", checkpoint)
    said: list[str] = []
    result = export(checkpoint, tmp_path / "exported", dtype="fp32", echo=said.append)
    assert any("gathered the sharded checkpoint" in line for line in said)
    replicated = load_file(unsharded / "checkpoint-4" / "model.safetensors")
    gathered = load_file(result.out / "model.safetensors")
    assert gathered.keys() == replicated.keys()
    for k in replicated:
        torch.testing.assert_close(gathered[k], replicated[k], rtol=1e-3, atol=2e-5)
    assert checkpoint_problem(checkpoint) is None  # still a checkpoint that resumes


# One process with ZeRO-3 offload and LoRA; the third window's loss is made NaN (the loss function is the hook:
# it is called once per micro-batch, four per window here).
_NAN_WINDOW = """
import json, sys
from anyfit.config import load_config
from anyfit.training.loop import train
from anyfit.training.loss import token_loss_sum

calls = []
def loss_fn(model, batch):
    calls.append(1)
    loss = token_loss_sum(model, batch)
    return loss * float("nan") if 8 <= len(calls) - 1 < 12 else loss

cfg = load_config(sys.argv[1], sys.argv[2:])
result = train(cfg, loss_fn=loss_fn)
print("RESULT " + json.dumps({"skipped": result.skipped_steps, "losses": result.losses}))
"""


def test_zero3_with_offload_skips_a_nan_window_and_leaves_an_adapter(tiny_llama_dir, tmp_path):
    out = tmp_path / "out"
    cfg = run_config(tmp_path, tiny_llama_dir, "lora: {enabled: true, dropout: 0.0}")
    proc = subprocess.run([sys.executable, "-c", _NAN_WINDOW, str(cfg), f"train.output_dir={out}",
                           "runtime.sharding=deepspeed", "runtime.deepspeed_offload=true", "train.max_steps=5"],
                          env=ENV, capture_output=True, text=True, timeout=HANG_S)
    assert proc.returncode == 0, proc.stderr[-4000:]
    assert "offloaded to host RAM" in proc.stdout
    result = json.loads(next(line for line in proc.stdout.splitlines() if line.startswith("RESULT "))[7:])
    assert result["skipped"] == 1
    steps = [m for m in read_metrics(out) if "loss" in m]
    assert [m["skipped_steps"] for m in steps] == [0, 0, 1, 1, 1]
    assert not torch.isfinite(torch.tensor(steps[2]["loss"]))  # the NaN window itself is logged as it was
    trained = load_file(out / "adapter_model.safetensors")
    assert all(torch.isfinite(v).all() for v in trained.values())  # the NaN never reached the weights
    assert any(k.endswith("lora_B.weight") and v.abs().sum() > 0 for k, v in trained.items())
    from peft import AutoPeftModelForCausalLM

    assert AutoPeftModelForCausalLM.from_pretrained(out) is not None

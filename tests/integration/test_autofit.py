"""micro_batch=auto measures and keeps the effective batch; an OOM halves the micro-batch without losing the step."""

import json

import pytest
import torch
from safetensors.torch import load_file
from tiny_runs import write_dataset

from anyfit.config import ConfigError, load_config
from anyfit.data.batching import BatchPlan
from anyfit.training.loop import train
from anyfit.training.loss import token_loss_sum


def _cfg(model_dir, data, out, *extra):
    return load_config(None, [f"model.name_or_path={model_dir}", f"data.path={data}", "data.template=plain",
                              f"train.output_dir={out}", "train.effective_batch=8", "train.max_steps=3",
                              "train.seed=0", "train.log_every=1", *extra])


@pytest.mark.slow
def test_auto_micro_batch_is_measured_and_keeps_the_effective_batch(tiny_llama_dir, tmp_path, capsys):
    data = write_dataset(tmp_path / "d.jsonl")
    train(_cfg(tiny_llama_dir, data, tmp_path / "a", "train.micro_batch=auto"))
    out = capsys.readouterr().out
    assert "micro_batch probe: 1 x" in out and "micro_batch=auto chose 8" in out  # a tiny model fits everything
    metrics = [json.loads(x) for x in (tmp_path / "a" / "metrics.jsonl").read_text().splitlines()]
    assert metrics[0]["micro_batch"] == 8


@pytest.mark.slow
def test_auto_respects_a_small_budget(tiny_llama_dir, tmp_path, capsys):
    data = write_dataset(tmp_path / "d.jsonl")
    train(_cfg(tiny_llama_dir, data, tmp_path / "a", "train.micro_batch=auto", "runtime.memory_fraction=0.00001"))
    assert "micro_batch=auto chose 1" in capsys.readouterr().out


@pytest.mark.slow
def test_oom_halves_micro_batch_and_redoes_the_step(tiny_llama_dir, tmp_path, capsys):
    data = write_dataset(tmp_path / "d.jsonl")

    def fails_above_two(model, batch):  # a stand-in for a device that fits only 2 sequences at a time
        sequences = int((batch["position_ids"] == 0).sum()) if "position_ids" in batch else len(batch["input_ids"])
        if sequences > 2:
            raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 20.00 GiB")
        return token_loss_sum(model, batch)

    train(_cfg(tiny_llama_dir, data, tmp_path / "oom", "train.micro_batch=8"), loss_fn=fails_above_two)
    out = capsys.readouterr().out
    assert "out of memory at step 1: retrying the step with effective batch 8 = micro-batch 4 x accumulation 2" in out
    assert "micro-batch 2 x accumulation 4" in out
    train(_cfg(tiny_llama_dir, data, tmp_path / "ref", "train.micro_batch=2"))
    a, b = load_file(tmp_path / "oom" / "model.safetensors"), load_file(tmp_path / "ref" / "model.safetensors")
    assert all(torch.equal(a[k], b[k]) for k in a)  # same steps, same data, same result as micro-batch 2 throughout
    steps = [json.loads(x)["step"] for x in (tmp_path / "oom" / "metrics.jsonl").read_text().splitlines()]
    assert steps == [1, 2, 3]


def test_oom_at_micro_batch_one_says_what_to_do():
    from anyfit.training.autofit import halve_micro_batch

    with pytest.raises(ConfigError, match="gradient_checkpointing"):
        halve_micro_batch(BatchPlan(8, 1, 8, 1), 1, torch.OutOfMemoryError("x"))
    with pytest.raises(ConfigError, match="2-process run"):
        halve_micro_batch(BatchPlan(8, 4, 1, 2), 2, torch.OutOfMemoryError("x"))
    assert halve_micro_batch(BatchPlan(12, 6, 2, 1), 1, RuntimeError("x")).micro_batch == 3


def test_auto_is_a_valid_config_value():
    assert load_config(None, ["train.micro_batch=auto"]).train.micro_batch == "auto"
    with pytest.raises(ConfigError, match="micro_batch"):
        load_config(None, ["train.micro_batch=big"])

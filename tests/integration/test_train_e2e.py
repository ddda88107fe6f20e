"""End to end on tiny real-architecture models: loss goes down, outputs reload, checkpoints, evaluation."""

from __future__ import annotations

import json
import math

import pytest
import torch
from tiny_runs import (
    config_for,
    read_metrics,
    write_dataset,
)
from transformers import AutoModelForCausalLM

from anyfit.config import load_config
from anyfit.training.loop import train


@pytest.mark.slow
@pytest.mark.parametrize("lora", [False, True, "qlora"], ids=["full", "lora", "qlora"])
def test_loss_goes_down_and_output_reloads(lora, tiny_llama_dir, tmp_path):
    """QLoRA too, on the CPU (bitsandbytes' 4-bit CPU kernels): the path CUDA runs, loading through reloading."""
    if lora == "qlora":
        from anyfit.hardware.runtime import bitsandbytes_cpu_problem

        if bitsandbytes_cpu_problem():
            pytest.skip(bitsandbytes_cpu_problem())
    data = write_dataset(tmp_path / "d.jsonl")
    extra = ["lora.enabled=true", "lora.dropout=0.0", "train.learning_rate=1e-2"] if lora else ["train.learning_rate=1e-2"]
    extra += ["lora.qlora=true"] if lora == "qlora" else []
    cfg = config_for(tiny_llama_dir, data, tmp_path / "out", "train.effective_batch=8", "train.micro_batch=4",
                     "train.max_steps=30", "train.lr_schedule=constant", *extra)
    result = train(cfg)
    metrics = read_metrics(tmp_path / "out")
    assert len(metrics) == 30 and [m["step"] for m in metrics] == list(range(1, 31))
    first, last = metrics[0]["loss"], sum(m["loss"] for m in metrics[-3:]) / 3
    assert last < 0.5 * first, (first, last)
    assert all(k in metrics[0] for k in ("lr", "grad_norm", "tokens_per_s", "peak_mem_gib"))

    out = tmp_path / "out"
    assert (out / "config.yaml").is_file() and (out / "run_info.json").is_file()
    ids = torch.tensor([[1, 2, 3, 4, 5, 6]])
    result.model.eval()
    with torch.no_grad():
        expected = result.model(ids).logits
    if lora:
        from peft import PeftModel

        assert (out / "adapter_model.safetensors").is_file() and not (out / "model.safetensors").exists()
        quantized = {}
        if lora == "qlora":  # the adapter's base as training loaded it: NF4 with double quantization
            from transformers import BitsAndBytesConfig

            quantized = dict(device_map={"": "cpu"}, quantization_config=BitsAndBytesConfig(
                load_in_4bit=True, bnb_4bit_quant_type="nf4", bnb_4bit_use_double_quant=True,
                bnb_4bit_compute_dtype=torch.float32))
        base = AutoModelForCausalLM.from_pretrained(tiny_llama_dir, dtype=torch.float32, **quantized)
        if quantized:  # the 4-bit path training ran, not bitsandbytes' bf16 kernel for AVX-512 BF16 CPUs
            from anyfit.model.loading import keep_one_4bit_path

            keep_one_4bit_path(base)
        reloaded = PeftModel.from_pretrained(base, out)
    else:
        reloaded = AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32)
    reloaded.eval()
    with torch.no_grad():
        torch.testing.assert_close(reloaded(ids).logits, expected, rtol=0, atol=0)



@pytest.mark.slow
def test_checkpoints_are_complete_and_pruned(tiny_qwen2_dir, tmp_path):
    data = write_dataset(tmp_path / "d.jsonl")
    out = tmp_path / "out"
    cfg = config_for(tiny_qwen2_dir, data, out, "train.effective_batch=4", "train.micro_batch=2", "train.max_steps=7",
                     "train.save_every=2", "train.keep_last=2")
    train(cfg)
    ckpts = sorted(p.name for p in out.glob("checkpoint-*"))
    assert ckpts == ["checkpoint-4", "checkpoint-6"]
    ck = out / "checkpoint-6"
    for name in ("model.safetensors", "optimizer.pt", "scheduler.pt", "rng_state_0.pt", "trainer_state.json",
                 "config.yaml", "tokenizer.json"):
        assert (ck / name).is_file(), name
    assert json.loads((ck / "trainer_state.json").read_text())["step"] == 6
    assert not list(out.glob(".tmp-*"))
    assert load_config(ck / "config.yaml") == cfg
    # a second run into the same folder is refused unless overwrite is asked for
    from anyfit.config import ConfigError

    with pytest.raises(ConfigError, match="already holds a run"):
        train(cfg)



@pytest.mark.slow
def test_evaluation_during_training(tiny_qwen2_dir, tmp_path):
    data = write_dataset(tmp_path / "d.jsonl", n=20)
    cfg = config_for(tiny_qwen2_dir, data, tmp_path / "out", "train.effective_batch=4", "train.micro_batch=2",
                     "train.max_steps=4", "eval.holdout=4", "eval.every=2", "eval.generate_before=true",
                     "eval.generate_at_end=true", "eval.num_generate=2", "eval.max_new_tokens=4", "eval.batch_size=2")
    result = train(cfg)
    evals = [m for m in read_metrics(tmp_path / "out") if "val_loss" in m or "gen_accuracy" in m]
    assert [e["step"] for e in evals] == [0, 2, 4]
    assert "gen_accuracy" in evals[0] and "gen_accuracy" in evals[-1] and "gen_accuracy" not in evals[1]
    assert all(math.isfinite(e["val_loss"]) for e in evals[1:]) and evals[-1]["gen_n"] == 2
    assert result.evals == evals
    info = json.loads((tmp_path / "out" / "run_info.json").read_text())
    assert info["data"]["loaded"] == 16  # the 4 held-out records are not trained on


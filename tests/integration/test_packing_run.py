"""Model families inside real runs: the packing self-test's and the inference check's lines printed and recorded,
a packed run of a windowed model (Mistral, window 8 tokens, examples of 10-30) or of a hybrid (Qwen3.5: its linear
attention run one example per row) giving the per-step losses of the same run with train.packing=false, and LoRA runs of
families with sinks, windows, linear attention and latent attention with experts exported as the architecture they
started from, with the same logits."""

from __future__ import annotations

import json

import pytest
import torch
from families import tiny_model
from tiny_runs import config_for, cut_qwen_tokenizer, same_losses, write_dataset
from transformers import AutoModelForCausalLM, AutoTokenizer

from anyfit.export.folder import export
from anyfit.model.loading import load_for_inference
from anyfit.training.loop import train

STEPS = 3


def _saved(family: str, tokenizer_dir, out):
    cut_qwen_tokenizer(tokenizer_dir, out)  # a 1,000-token vocabulary: the runs are about the model, not the head
    tok = AutoTokenizer.from_pretrained(out)
    model = tiny_model(family, vocab_size=len(tok), pad_token_id=tok.pad_token_id, eos_token_id=tok.eos_token_id,
                       bos_token_id=None)
    model.save_pretrained(out)
    return out


@pytest.mark.slow
@pytest.mark.parametrize("family, packed_line", [
    ("mistral", "packing: self-test passed"),
    ("qwen3_5", "'linear_attention' layers run one example per row"),
])
def test_packed_run_equals_padded_run(family, packed_line, qwen_tokenizer_dir, tmp_path):
    model_dir = _saved(family, qwen_tokenizer_dir, tmp_path / "model")
    data = write_dataset(tmp_path / "d.jsonl", n=16)
    runs, said = {}, []
    for packing in ("true", "false"):
        cfg = config_for(model_dir, data, tmp_path / packing, "train.learning_rate=1e-2", f"train.packing={packing}",
                         f"train.max_steps={STEPS}", "train.effective_batch=4", "train.micro_batch=2")
        runs[packing] = train(cfg, echo=said.append if packing == "true" else lambda *a: None)
    assert same_losses(runs["true"].losses, runs["false"].losses, STEPS)
    assert any(packed_line in line for line in said), said
    # and the training forward, packed or padded as decided, computes what generate does with its cache
    assert any("inference check: training forward and generate agree" in line for line in said), said
    info = json.loads((tmp_path / "true" / "run_info.json").read_text())
    assert info["packing"]["packed"] and info["packing"]["state"] == ("per_example" if family == "qwen3_5" else "")
    assert info["inference_check"]["agrees"] and info["inference_check"]["error"] <= info["inference_check"]["tolerance"]
    assert "packing" not in json.loads((tmp_path / "false" / "run_info.json").read_text())


@pytest.mark.slow
@pytest.mark.parametrize("family", ["gpt_oss", "gemma3", "qwen3_5", "deepseek_v3"])
def test_a_lora_run_exports_as_the_architecture_it_started_from(family, qwen_tokenizer_dir, tmp_path):
    model_dir = _saved(family, qwen_tokenizer_dir, tmp_path / "model")
    cfg = config_for(model_dir, write_dataset(tmp_path / "d.jsonl", n=8), tmp_path / "out", "lora.enabled=true",
                     "train.learning_rate=1e-2", "train.max_steps=2", "train.effective_batch=4", "train.micro_batch=2")
    train(cfg, echo=lambda *a: None)
    export(tmp_path / "out", tmp_path / "exported", dtype="fp32", echo=lambda *a: None)
    merged = AutoModelForCausalLM.from_pretrained(tmp_path / "exported", dtype=torch.float32)
    original = json.loads((model_dir / "config.json").read_text())["architectures"]
    assert json.loads((tmp_path / "exported" / "config.json").read_text())["architectures"] == original
    adapted, tok = load_for_inference(tmp_path / "out")
    ids = torch.tensor([tok("Repeat red green blue gold pink")["input_ids"]])
    with torch.no_grad():
        want, got = adapted(input_ids=ids).logits, merged(input_ids=ids).logits
    assert torch.allclose(got, want, rtol=1e-4, atol=1e-4 * want.abs().max())

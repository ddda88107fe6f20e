"""A mixture of experts trained end to end: LoRA on the routed experts with the default dropout, the router's
load-balancing loss logged apart (aux_loss) in metrics.jsonl, the adapter reloaded for generation."""

from __future__ import annotations

import math

import torch
from moe_families import moe_config
from tiny_runs import config_for, cut_qwen_tokenizer, read_metrics, write_dataset
from transformers import AutoModelForCausalLM, AutoTokenizer

from anyfit.export.folder import export
from anyfit.model.loading import load_for_inference
from anyfit.training.loop import train


def test_lora_on_experts_with_the_load_balancing_loss(qwen_tokenizer_dir, tmp_path):
    model_dir = tmp_path / "moe"
    cut_qwen_tokenizer(qwen_tokenizer_dir, model_dir)
    tok = AutoTokenizer.from_pretrained(model_dir)
    torch.manual_seed(0)
    config = moe_config("qwen3_moe", vocab_size=len(tok), pad_token_id=tok.pad_token_id, eos_token_id=tok.eos_token_id,
                        bos_token_id=None, tie_word_embeddings=True)
    AutoModelForCausalLM.from_config(config).save_pretrained(model_dir)
    lines: list[str] = []
    cfg = config_for(model_dir, write_dataset(tmp_path / "d.jsonl", n=8), tmp_path / "out", "lora.enabled=true",
                     "train.router_aux_loss_coef=0.01", "train.effective_batch=4", "train.micro_batch=2",
                     "train.max_steps=2")
    train(cfg, echo=lines.append)
    metrics = read_metrics(tmp_path / "out")
    assert [m["step"] for m in metrics] == [1, 2]
    assert all(math.isfinite(m["loss"]) and 0 < m["aux_loss"] < 10 for m in metrics)
    said = "\n".join(lines)
    assert "in the routed experts" in said and "coefficient 0.01 (train.router_aux_loss_coef=0.01)" in said
    model, _ = load_for_inference(tmp_path / "out")
    assert any(".experts." in n and "lora_A" in n for n, _ in model.named_parameters())
    # exported, the adapter is merged into the fused experts: the same class, the same logits as adapter + base
    export(tmp_path / "out", tmp_path / "exported", dtype="fp32", echo=lambda *a: None)
    merged = AutoModelForCausalLM.from_pretrained(tmp_path / "exported", dtype=torch.float32)
    assert type(merged).__name__ == "Qwen3MoeForCausalLM"
    ids = torch.tensor([tok("Repeat red green blue")["input_ids"]])
    with torch.no_grad():
        want, got = model(input_ids=ids).logits, merged(input_ids=ids).logits
    assert torch.allclose(got, want, rtol=1e-4, atol=1e-4 * want.abs().max())

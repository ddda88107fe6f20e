"""Mixtures of experts in the planner and in MFU: every parameter for memory, the active ones (the linear layers,
the routers, top_k of num_experts routed experts) for compute, each equal to what the built tiny model of every
family holds, counted here from its parameters by name."""

from __future__ import annotations

import dataclasses

import pytest
import torch
from moe_families import CURRENT_MOE, MOE, NUM_EXPERTS, moe_config, moe_model
from transformers import AutoConfig

from anyfit.config import Config
from anyfit.model.shape import shape_from_config
from anyfit.planning.report import plan_dict, plan_report
from anyfit.profiling.flops import ModelFlops
from anyfit.profiling.memory import saved_storages


def _counted(model: torch.nn.Module, top_k: int) -> tuple[int, int, int]:
    """(all parameters, active parameters, matmul weights one token passes through in the body), read off the model:
    a routed expert's parameters sit in a module named ``experts`` (shared experts are ``shared_expert(s)``)."""
    head = model.get_output_embeddings()
    total = sum(p.numel() for p in model.parameters())
    routed = sum(p.numel() for n, p in model.named_parameters() if ".experts." in n)
    active = total - routed + routed * top_k // NUM_EXPERTS
    linear = sum(m.weight.numel() for m in model.modules() if isinstance(m, torch.nn.Linear) and m is not head)
    routers = sum(m.weight.numel() for m in model.modules()
                  if "Router" in type(m).__name__ and not isinstance(m, torch.nn.Linear))
    experts = sum(p.numel() for n, p in model.named_parameters() if ".experts." in n and p.ndim == 3)
    return total, active, linear + routers + experts * top_k // NUM_EXPERTS


@pytest.mark.parametrize("family", list(MOE))
def test_plan_counts_total_and_active_parameters_as_built(family):
    _, top_k, _ = MOE[family]
    shape = shape_from_config(moe_config(family))
    total, active, body = _counted(moe_model(family), top_k)
    assert (shape.params, shape.active_params) == (total, active)
    assert active < total and (shape.num_experts, shape.experts_per_token) == (NUM_EXPERTS, top_k)
    assert shape.active_body_params == body
    flops = ModelFlops.of(shape)  # full fine-tuning: 6 FLOPs per active matmul weight per token
    assert flops.body_per_token == 6 * body


def test_plan_shows_total_and_active():
    cfg = Config()
    cfg.lora.enabled = True
    shape = shape_from_config(moe_config("qwen3_moe"))
    data = plan_dict(cfg, targets=["h100"], shape=shape)
    assert (data["model"]["params"], data["model"]["active_params"]) == (shape.params, shape.active_params)
    assert 0 < data["model"]["lora_params_in_experts"] < data["model"]["lora_params"]
    text = plan_report(cfg, targets=["h100"], shape=shape)
    assert f"{shape.active_params / 1e6:,.1f}M active per token: 2 of 4 routed experts" in text
    assert "in the routed experts" in text


def test_qwen3_30b_a3b_compute_counts_its_active_experts():
    """Qwen3-30B-A3B (its config.json's sizes): 30.5B parameters, 3.3B active; the compute per token is ~2.5x what
    the attention and the output head alone would give."""
    config = AutoConfig.for_model("qwen3_moe", vocab_size=151936, hidden_size=2048, intermediate_size=6144,
                                  moe_intermediate_size=768, num_hidden_layers=48, num_attention_heads=32,
                                  num_key_value_heads=4, head_dim=128, num_experts=128, num_experts_per_tok=8,
                                  tie_word_embeddings=False)
    shape = shape_from_config(config)
    assert round(shape.params / 1e9, 1) == 30.5 and round(shape.active_params / 1e9, 1) == 3.4
    assert shape.active_matmul_params / shape.matmul_params == pytest.approx(2.5, abs=0.05)
    # LoRA r=16: an r-rank pair per expert, 48 x 128 of them per tensor; without them attention only
    assert round(shape.lora_params(16) / 1e6) == 643 and round(shape.lora_params(16, experts=False) / 1e6, 1) == 13.4


def _saved_bytes(model, ids) -> int:
    """Bytes autograd keeps for the backward beyond the parameters themselves (one forward)."""
    with saved_storages(model) as kept:
        model(input_ids=ids)
    return sum(kept.values())


@CURRENT_MOE
@pytest.mark.parametrize("split", [True, False])
def test_lora_on_experts_keeps_what_the_plan_counts(split):
    """What the forward keeps for the backward beyond the frozen-expert run, against the planner. PEFT's path
    (lora.split_experts=false) keeps a folded copy of the experts; the split path only each MoE layer's token rows
    (the routed rows, the down projection's input, the r-wide products and the factors' copies are rebuilt in the
    backward)."""
    from anyfit.config import LoraConfig
    from anyfit.model.loading import apply_lora
    from anyfit.planning.memory import folded_expert_bytes, split_expert_inputs
    from anyfit.planning.setup import Setup

    sizes = dict(hidden_size=64, moe_intermediate_size=128, num_experts=8, head_dim=16)
    ids = torch.randint(3, 512, (1, 16))
    saved = {experts: _saved_bytes(apply_lora(moe_model("qwen3_moe", **sizes),
                                              LoraConfig(enabled=True, r=4, experts=experts, split_experts=split)),
                                   ids)
             for experts in (False, True)}
    setup = Setup(method="lora", device="cpu", precision="fp32", weight_bytes=4, micro_batch=1, seq_len=16, lora_r=4,
                  lora_split_experts=split)
    shape = shape_from_config(moe_config("qwen3_moe", **sizes))
    assert shape.experts_split
    kept, around = folded_expert_bytes(shape, setup)
    per_token = split_expert_inputs(shape, setup, 4) * shape.num_layers
    if split:
        assert kept == 0 and around == 4 * 4 * sum((p.d_in + p.d_out) * p.count for p in shape.experts) // 2
        assert saved[True] - saved[False] == 16 * per_token == 16 * 64 * 4 * 2  # 16 tokens x hidden x fp32 x 2 layers
    else:
        assert kept == 4 * sum(p.d_in * p.d_out * p.count for p in shape.experts) and around == kept and not per_token
        assert saved[True] - saved[False] == pytest.approx(kept, rel=0.05)  # + the adapters reshaped for the fold
    assert folded_expert_bytes(shape, dataclasses.replace(setup, lora_experts=False)) == (0, 0)
    assert folded_expert_bytes(shape, dataclasses.replace(setup, gradient_checkpointing=True))[0] == 0

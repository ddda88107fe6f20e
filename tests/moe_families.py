"""Tiny random-init mixtures of experts of every family anyfit plans and adapts, built from transformers' own config
classes: 2 layers, 32 wide, 4 routed experts (each family's own names for its sizes), token ids under 512.

``MOE[family] = (model_type, experts per token, settings)``; ``moe_config`` builds the config, ``moe_model`` the
model, seeded. Used by tests/unit/model/test_moe.py and tests/unit/planning/test_moe_plan.py.
"""

from __future__ import annotations

import peft
import pytest
import torch
import transformers
from packaging.version import Version

SMALL = dict(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
             head_dim=8, vocab_size=512, max_position_embeddings=512, pad_token_id=0, eos_token_id=1, bos_token_id=2)
_LINEAR_ATTENTION = dict(layer_types=["linear_attention", "full_attention"], linear_num_key_heads=2,
                         linear_num_value_heads=2, linear_key_head_dim=8, linear_value_head_dim=8)
_DEEPSEEK = dict(moe_intermediate_size=32, n_routed_experts=4, num_experts_per_tok=2, n_shared_experts=1,
                 first_k_dense_replace=1, n_group=1, topk_group=1)

MOE: dict[str, tuple[str, int, dict]] = {
    "qwen3_moe": ("qwen3_moe", 2, dict(moe_intermediate_size=32, num_experts=4, num_experts_per_tok=2)),
    "mixtral": ("mixtral", 2, dict(num_local_experts=4, num_experts_per_tok=2)),
    "olmoe": ("olmoe", 2, dict(intermediate_size=32, num_experts=4, num_experts_per_tok=2)),
    "gpt_oss": ("gpt_oss", 2, dict(intermediate_size=32, num_local_experts=4, num_experts_per_tok=2)),
    # the rotary part of DeepSeek's heads is head_dim
    "deepseek_v3": ("deepseek_v3", 2, dict(_DEEPSEEK, num_key_value_heads=4, kv_lora_rank=16, q_lora_rank=16,
                                           qk_rope_head_dim=8, qk_nope_head_dim=8, v_head_dim=8)),
    "glm4_moe": ("glm4_moe", 2, _DEEPSEEK),
    "granitemoe": ("granitemoe", 2, dict(intermediate_size=32, num_local_experts=4, num_experts_per_tok=2)),
    "ernie4_5_moe": ("ernie4_5_moe", 2, dict(moe_intermediate_size=32, moe_num_experts=4, moe_k=2,
                                             moe_num_shared_experts=1, moe_layer_start_index=1)),
    "llama4": ("llama4_text", 1, dict(intermediate_size=32, intermediate_size_mlp=64, num_local_experts=4,
                                      num_experts_per_tok=1)),
    "qwen3_5_moe": ("qwen3_5_moe_text", 2, dict(_LINEAR_ATTENTION, moe_intermediate_size=32,
                                                shared_expert_intermediate_size=32, num_experts=4,
                                                num_experts_per_tok=2)),
    "qwen3_next": ("qwen3_next", 2, dict(_LINEAR_ATTENTION, moe_intermediate_size=32,
                                         shared_expert_intermediate_size=32, num_experts=4, num_experts_per_tok=2)),
}
NUM_EXPERTS = 4
# transformers computes the router's load-balancing aux_loss for these (DeepSeek-V3 and GLM-4-MoE balance with a
# bias, Llama-4 computes none)
WITH_AUX_LOSS = ("qwen3_moe", "mixtral", "olmoe", "gpt_oss", "granitemoe", "ernie4_5_moe", "qwen3_5_moe",
                 "qwen3_next")


def moe_config(family: str, **overrides):
    from transformers import AutoConfig

    model_type, _, extra = MOE[family]
    return AutoConfig.for_model(model_type, **{**SMALL, **extra, **overrides})


def moe_model(family: str, **overrides) -> torch.nn.Module:
    from transformers import AutoModelForCausalLM

    torch.manual_seed(0)
    return AutoModelForCausalLM.from_config(moe_config(family, **overrides))


# Routed experts as transformers 5.23 fuses them and PEFT 0.21 adapts them (target_parameters, its transformers-v5
# conversion): the releases at anyfit's lower bounds (.ci/lower_bounds.sh) lay experts out and adapt them otherwise,
# and anyfit refuses expert LoRA on a PEFT without target_parameters in one line.
CURRENT_MOE = pytest.mark.skipif(Version(transformers.__version__) < Version("5.23")
                                 or Version(peft.__version__) < Version("0.21"),
                                 reason="fused experts as transformers 5.23 / PEFT 0.21 make them")

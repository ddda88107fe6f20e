"""Tiny random-init models of the families users fine-tune in 2026, built from transformers' own config classes.

Each entry is a ``model_type`` and the few settings that make it tiny (2 layers, 32 wide) while keeping what makes
the family itself: sliding windows of 8 tokens (so short test examples cross them), softcapping, attention sinks,
chunked attention, linear-attention / state-space / convolution layers, experts. ``tiny_config`` builds the
config; ``tiny_model`` the model, seeded.
"""

from __future__ import annotations

import numpy as np
import torch

WINDOW = 8  # every windowed family gets this window, so 20-token examples cross it
SMALL = dict(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
             head_dim=8, vocab_size=512, max_position_embeddings=512, pad_token_id=0, eos_token_id=1, bos_token_id=2)
_MOE = dict(moe_intermediate_size=32, num_experts=4, num_experts_per_tok=2)

# family -> (model_type, what it tests beyond a plain decoder, overrides)
FAMILIES: dict[str, tuple[str, dict]] = {
    "llama": ("llama", {}),
    "mistral": ("mistral", dict(sliding_window=WINDOW)),
    "qwen2": ("qwen2", dict(use_sliding_window=True, sliding_window=WINDOW, max_window_layers=1)),
    "qwen3": ("qwen3", {}),
    "qwen3_moe": ("qwen3_moe", _MOE),
    "mixtral": ("mixtral", dict(num_local_experts=4, num_experts_per_tok=2, sliding_window=WINDOW)),
    "gemma2": ("gemma2", dict(sliding_window=WINDOW)),  # softcapping, eager only
    "gemma3": ("gemma3_text", dict(sliding_window=WINDOW, layer_types=["sliding_attention", "full_attention"])),
    "cohere2": ("cohere2", dict(sliding_window=WINDOW, layer_types=["sliding_attention", "full_attention"])),
    "olmo2": ("olmo2", {}),
    "olmo3": ("olmo3", dict(sliding_window=WINDOW, layer_types=["sliding_attention", "full_attention"])),
    "phi3": ("phi3", dict(sliding_window=WINDOW)),
    "gpt_oss": ("gpt_oss", dict(sliding_window=WINDOW, num_local_experts=4, num_experts_per_tok=2)),  # sinks
    "llama4": ("llama4_text", dict(attention_chunk_size=WINDOW, intermediate_size_mlp=64, num_local_experts=2)),
    "deepseek_v3": ("deepseek_v3", dict(n_routed_experts=4, num_experts_per_tok=2, moe_intermediate_size=32,
                                        first_k_dense_replace=1, n_group=1, topk_group=1, q_lora_rank=16,
                                        kv_lora_rank=16, qk_rope_head_dim=8, qk_nope_head_dim=8, v_head_dim=8,
                                        num_key_value_heads=4)),
    "glm4": ("glm4", {}),
    "glm4_moe": ("glm4_moe", dict(n_routed_experts=4, num_experts_per_tok=2, moe_intermediate_size=32,
                                  first_k_dense_replace=1, n_group=1, topk_group=1)),
    "olmoe": ("olmoe", dict(num_experts=4, num_experts_per_tok=2)),
    "granite": ("granite", {}),
    "granitemoe": ("granitemoe", dict(num_local_experts=4, num_experts_per_tok=2)),
    "smollm3": ("smollm3", {}),
    "ernie4_5": ("ernie4_5", {}),
    "hunyuan": ("hunyuan_v1_dense", {}),
    # layers with a state along the sequence
    "qwen3_next": ("qwen3_next", dict(_MOE, layer_types=["linear_attention", "full_attention"],
                                      linear_num_key_heads=2, linear_num_value_heads=4, linear_key_head_dim=8,
                                      linear_value_head_dim=8)),
    "qwen3_5": ("qwen3_5_text", dict(layer_types=["linear_attention", "full_attention"], linear_num_key_heads=2,
                                     linear_num_value_heads=4, linear_key_head_dim=8, linear_value_head_dim=8)),
    "lfm2": ("lfm2", dict(layer_types=["conv", "full_attention"])),
    "falcon_h1": ("falcon_h1", dict(mamba_d_ssm=32, mamba_n_heads=4, mamba_d_head=8, mamba_n_groups=1,
                                    mamba_d_state=8, mamba_chunk_size=8)),
}
# More families whose layers carry a state along the sequence (Gated DeltaNet, Mamba-1/2, short convolutions,
# lightning attention, KDA, RG-LRU): the packing tests run them too; the README's table keeps the four above.
_GDN = dict(layer_types=["linear_attention", "full_attention"], linear_num_key_heads=2, linear_num_value_heads=4,
            linear_key_head_dim=8, linear_value_head_dim=8)
_MAMBA2 = dict(mamba_n_heads=4, mamba_d_head=16, mamba_d_state=8, mamba_n_groups=1, mamba_chunk_size=8)
MORE_STATEFUL: dict[str, tuple[str, dict]] = {
    "qwen3_5_moe": ("qwen3_5_moe_text", dict(_GDN, **_MOE, shared_expert_intermediate_size=32)),
    "olmo_hybrid": ("olmo_hybrid", _GDN),
    "lfm2_moe": ("lfm2_moe", dict(_MOE, layer_types=["conv", "full_attention"], num_dense_layers=1)),
    "granitemoehybrid": ("granitemoehybrid", dict(_MAMBA2, layer_types=["mamba", "attention"], num_local_experts=4,
                                                  num_experts_per_tok=2, shared_intermediate_size=64)),
    "bamba": ("bamba", dict(_MAMBA2, attn_layer_indices=[1])),
    "jamba": ("jamba", dict(attn_layer_period=2, attn_layer_offset=1, expert_layer_period=2, expert_layer_offset=1,
                            num_experts=4, num_experts_per_tok=2, mamba_d_state=8, mamba_dt_rank=4, mamba_expand=2)),
    "nemotron_h": ("nemotron_h", dict(hybrid_override_pattern="M*", mamba_num_heads=4, mamba_head_dim=16,
                                      ssm_state_size=8, n_groups=1, chunk_size=8)),
    "zamba2": ("zamba2", dict(mamba_d_state=8, mamba_headdim=8, mamba_ngroups=1, n_mamba_heads=8,
                              layers_block_type=["mamba", "hybrid"], hybrid_layer_ids=[1], chunk_size=8,
                              use_mem_rope=False)),
    "mamba2": ("mamba2", dict(num_heads=4, head_dim=16, state_size=8, n_groups=1, chunk_size=8, expand=2)),
    "minimax": ("minimax", dict(layer_types=["linear_attention", "full_attention"], num_local_experts=4,
                                num_experts_per_tok=2, block_size=8)),
    "kimi_linear": ("kimi_linear", {}),
    "recurrent_gemma": ("recurrent_gemma", dict(block_types=["recurrent", "attention"], lru_width=32,
                                                attention_window_size=WINDOW)),
}
STATEFUL = ("qwen3_next", "qwen3_5", "lfm2", "falcon_h1", *MORE_STATEFUL)


def tiny_config(family: str, **overrides):
    from transformers import AutoConfig

    model_type, extra = FAMILIES.get(family) or MORE_STATEFUL[family]
    return AutoConfig.for_model(model_type, **{**SMALL, **extra, **overrides})


def tiny_model(family: str, attn_implementation: str | None = None, **overrides) -> torch.nn.Module:
    from transformers import AutoModelForCausalLM

    torch.manual_seed(0)
    kwargs = {"attn_implementation": attn_implementation} if attn_implementation else {}
    return AutoModelForCausalLM.from_config(tiny_config(family, **overrides), **kwargs)


class Examples(list):
    """A list of examples with the ``lengths`` a token store's view has (what the start-up checks read)."""

    @property
    def lengths(self) -> np.ndarray:
        return np.array([len(e["input_ids"]) for e in self])

"""Which checkpoint tensors a model does not load: by transformers' own renaming (a mixture of experts stored one
tensor per expert is loaded whole, not reported), grouped by the prefix no loaded tensor shares."""

from __future__ import annotations

import json

import torch
from families import tiny_model
from safetensors import safe_open
from safetensors.torch import save_file
from transformers import AutoModelForCausalLM

from anyfit.config import ModelConfig
from anyfit.model.unloaded import find_unloaded, group_names


def test_groups_by_the_first_prefix_no_loaded_tensor_has():
    loaded = ["model.layers.0.mlp.up_proj.weight", "model.layers.1.mlp.up_proj.weight", "lm_head.weight"]
    names = ["mtp.fc.weight", "mtp.layers.0.mlp.up_proj.weight", "model.layers.2.mlp.up_proj.weight",
             "model.layers.0.self_attn.rotary_emb.inv_freq"]
    assert group_names(names, loaded) == {"mtp.*": 2, "model.layers.2.*": 1, "model.layers.0.self_attn.*": 1}


def test_an_extra_layer_beside_per_expert_tensors(tmp_path):
    """DeepSeek-V3 / GLM-4.5 ship their MTP layer as layer num_hidden_layers; the experts transformers fuses on load
    are stored one per expert and count as loaded."""
    tiny_model("qwen3_moe", num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32).save_pretrained(tmp_path)
    model = AutoModelForCausalLM.from_pretrained(tmp_path)
    assert find_unloaded(model, ModelConfig(name_or_path=str(tmp_path))) is None
    with safe_open(tmp_path / "model.safetensors", framework="pt") as f:
        weight_map = dict.fromkeys(f.keys(), "model.safetensors")
    assert any(".experts.0." in name for name in weight_map)  # stored per expert, held fused
    extra = {"model.layers.2.mlp.experts.0.up_proj.weight": torch.zeros(32, 32),
             "model.layers.2.eh_proj.weight": torch.zeros(32, 64)}
    save_file(extra, tmp_path / "extra.safetensors", metadata={"format": "pt"})
    weight_map.update(dict.fromkeys(extra, "extra.safetensors"))
    (tmp_path / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))
    found = find_unloaded(model, ModelConfig(name_or_path=str(tmp_path), keep_unloaded_tensors=False))
    assert found.files == {tmp_path / "extra.safetensors": tuple(sorted(extra))}
    assert found.groups == {"model.layers.2.*": 2}
    assert found.line().startswith("[anyfit] dropped 2 tensors the model does not load: model.layers.2.*")

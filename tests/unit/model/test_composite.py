"""``anyfit.model.composite`` on configs and tiny models built in memory: which class a checkpoint loads as, which
parameters are its language model (trained, adapted, planned) and which are frozen, and what is refused."""

from __future__ import annotations

import re

import pytest
import torch
from transformers import AutoConfig, AutoModelForImageTextToText, LlamaConfig

from anyfit.config import ConfigError
from anyfit.model.composite import language_prefixes, lora_scope, model_class
from anyfit.model.layers import decoder_stack
from anyfit.model.loading import find_lora_targets
from anyfit.model.shape import shape_from_config
from anyfit.model.vision import freeze_untrained

TEXT = dict(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=2, head_dim=8)


def mistral3_config(architectures=None):
    """A Mistral-Small-3 shape: a Pixtral vision tower deeper (3 layers) than its language model (2), with
    q_proj/k_proj/v_proj/o_proj of its own."""
    config = AutoConfig.for_model("mistral3", text_config=dict(TEXT, model_type="mistral"),
                                  vision_config=dict(model_type="pixtral", hidden_size=32, intermediate_size=64,
                                                     num_hidden_layers=3, num_attention_heads=2, head_dim=16,
                                                     image_size=32, patch_size=8))
    config.architectures = architectures
    return config


def qwen3_5_config(architectures):
    config = AutoConfig.for_model("qwen3_5", text_config=TEXT, vision_config=dict(depth=1, hidden_size=32,
                                                                                 intermediate_size=64, num_heads=2,
                                                                                 out_hidden_size=32))
    config.architectures = architectures
    return config


@pytest.mark.parametrize("config, expected", [
    (LlamaConfig(**TEXT), "AutoModelForCausalLM"),  # a plain language model, as always
    (qwen3_5_config(["Qwen3_5ForConditionalGeneration"]), "AutoModelForImageTextToText"),  # not the text model
    (qwen3_5_config(["Qwen3_5ForCausalLM"]), "AutoModelForCausalLM"),  # a text-only checkpoint stays text-only
    (mistral3_config(), "AutoModelForImageTextToText"),  # none recorded: the whole model
], ids=["llama", "qwen3_5-composite", "qwen3_5-text-checkpoint", "mistral3-unrecorded"])
def test_a_checkpoint_loads_as_the_class_it_was_saved_as(config, expected):
    assert model_class(config).__name__ == expected


@pytest.mark.parametrize("model_type, architectures, needle", [
    ("mistral3", ["Mistral3Unknown"], "Mistral3Unknown.*neither as a causal LM nor as an image-text-to-text"),
    ("t5gemma2", None, "encoder-decoder"),
    ("blip-2", None, "needs pixel_values"),
])
def test_a_composite_anyfit_cannot_train_on_text_is_one_line(model_type, architectures, needle):
    config = AutoConfig.for_model(model_type)
    config.architectures = architectures
    with pytest.raises(ConfigError, match=needle) as e:
        model_class(config, "m")
    assert "\n" not in str(e.value)


def test_only_the_language_model_trains_is_adapted_and_is_the_decoder_stack():
    torch.manual_seed(0)
    model = AutoModelForImageTextToText.from_config(mistral3_config())
    vision = sum(p.numel() for n, p in model.named_parameters() if "language_model" not in n and "lm_head" not in n)
    assert freeze_untrained(model) == vision > 0
    assert all(p.requires_grad == ("language_model" in n or "lm_head" in n) for n, p in model.named_parameters())
    assert language_prefixes(model) == ["model.language_model", "lm_head"]
    targets = find_lora_targets(model, "auto")
    assert "q_proj" in targets and "fc1" not in targets  # no name only the vision tower has
    pattern = lora_scope(model, targets)
    adapted = [n for n, _ in model.named_modules() if re.fullmatch(pattern, n)]
    assert adapted and all(n.startswith("model.language_model.") for n in adapted)
    assert "model.vision_tower.transformer.layers.0.attention.q_proj" in dict(model.named_modules())
    holder, layers = decoder_stack(model)
    assert holder is model.model.language_model and len(layers) == 2  # not the deeper vision stack


def test_the_plan_is_the_language_model_and_the_rest_is_frozen():
    config = mistral3_config(["Mistral3ForConditionalGeneration"])
    model = AutoModelForImageTextToText.from_config(config)
    shape = shape_from_config(config)
    assert (shape.hidden_size, shape.num_layers, shape.vocab_size) == (32, 2, 64)
    assert shape.outside_params == freeze_untrained(model)
    assert shape.params + shape.outside_params == sum(p.numel() for p in model.parameters())
    assert "frozen" in shape.describe()


@pytest.mark.parametrize("model_type, vision", [
    ("qwen2_vl", dict(depth=1, embed_dim=32, hidden_size=32, num_heads=2, mlp_ratio=2, patch_size=8)),
    ("qwen2_5_vl", dict(depth=1, hidden_size=32, intermediate_size=64, num_heads=2, out_hidden_size=32, patch_size=8)),
])
def test_qwen_vl_language_models_are_planned_by_formula(model_type, vision):
    # transformers maps no AutoModelForCausalLM to their text configs, so the meta-device count cannot build them
    # (training Qwen2.5-VL stopped at "anyfit plan has no formula for model_type 'qwen2_5_vl_text'")
    config = AutoConfig.for_model(model_type, text_config=dict(TEXT), vision_config=vision)
    model = AutoModelForImageTextToText.from_config(config)
    shape = shape_from_config(config)
    assert shape.params + shape.outside_params == sum(p.numel() for p in model.parameters())
    assert shape.outside_params == freeze_untrained(model)

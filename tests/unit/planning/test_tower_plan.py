"""A trained vision tower's activations in the plan, against what autograd saves: each family's tower (transformers'
own code, widened to 256 so the per-patch terms weigh as in real towers) runs one image through the model with
every tower weight trained, and the bytes its forward saves for the backward (weights excluded) are counted with
``saved_tensors_hooks``. The planner's count (``ModelShape.tower_saved_per_patch``) is a sum over the tower's linear
layers; what it leaves out (rotary embeddings, fp32 casts) is the tolerance."""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch
from vlm_fixtures import FAMILIES, built_vlm, make_image, missing_for

from anyfit.data.image_tokens import ImageTokens
from anyfit.model.shape import shape_from_config
from anyfit.model.vision import parts
from anyfit.planning.memory import estimate_memory, tower_activation_bytes
from anyfit.planning.setup import Setup

WIDTH, LAYERS = 256, 2


def _widened(family: str):
    from transformers import AutoConfig, AutoProcessor

    folder = built_vlm(family)
    config = AutoConfig.from_pretrained(folder)
    vision = config.vision_config
    for key, value in (("num_hidden_layers", LAYERS), ("depth", LAYERS), ("hidden_size", WIDTH), ("embed_dim", WIDTH),
                       ("intermediate_size", 4 * WIDTH), ("num_attention_heads", 4), ("num_heads", 4),
                       ("head_dim", WIDTH // 4)):
        if hasattr(vision, key):
            setattr(vision, key, value)
    return config, AutoProcessor.from_pretrained(folder)


def _saved_by_tower(config, processor) -> int:
    from transformers import AutoModelForImageTextToText

    model = AutoModelForImageTextToText.from_config(config)
    tower = model.get_submodule(parts(model).tower)
    weights = {p.data_ptr() for p in model.parameters()}
    inside, saved = [False], {}

    def pack(t):
        if inside[0] and t.data_ptr() not in weights:  # views of one storage counted once
            saved[t.data_ptr()] = max(saved.get(t.data_ptr(), 0), t.untyped_storage().nbytes())
        return t

    tower.register_forward_pre_hook(lambda *a: inside.__setitem__(0, True))
    tower.register_forward_hook(lambda *a: inside.__setitem__(0, False))
    conversation = [{"role": "user", "content": [{"type": "image", "image": make_image(300, 200)},
                                                 {"type": "text", "text": "What is it?"}]}]
    inputs = processor.apply_chat_template(conversation, tokenize=True, return_dict=True, return_tensors="pt")
    inputs = inputs.to(model.dtype)  # as transformers' pipeline hands them (Llama-4's processor gives bf16 pixels)
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        model(**inputs)
    return sum(saved.values())


@pytest.mark.parametrize("family", [f for f in FAMILIES if f != "qwen3_5"])  # qwen3_5's tower is qwen3_vl's
def test_a_trained_towers_planned_activations_are_what_autograd_saves(family):
    if why := missing_for(family):
        pytest.skip(why)
    config, processor = _widened(family)
    shape = shape_from_config(config)
    images = ImageTokens(processor)
    patches = images.kept_pixels(images.processed(images.probes[0], [(300, 200)], "a test")) // shape.tower_patch ** 2
    shape = replace(shape, tower_patches=patches)
    setup = Setup(method="full", device="cpu", precision="fp32", weight_bytes=4, micro_batch=1, seq_len=64,
                  train_vision="full")
    planned, measured = tower_activation_bytes(shape, setup), _saved_by_tower(config, processor)
    assert 0.5 <= planned / measured <= 1.3, (planned, measured)
    assert tower_activation_bytes(shape, replace(setup, train_vision="frozen")) == 0
    # checkpointed, a deep tower keeps each layer's input and one layer's tensors (and their gradients) at a time
    deep = replace(shape, tower_projections=tuple(replace(p, count=p.count * 16) for p in shape.tower_projections))
    checkpointed = tower_activation_bytes(deep, replace(setup, gradient_checkpointing=True))
    assert 0 < checkpointed < tower_activation_bytes(deep, setup) / 4
    said = " ".join(estimate_memory(shape, setup).notes)
    assert "the trained vision tower keeps" in said, said

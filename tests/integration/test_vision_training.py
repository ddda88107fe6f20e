"""model.train_vision and model.train_projector on tiny random-init composites (``composite_parts``' sizes): which
parameters train, that a trained tower gets gradients from images and a frozen one none and keeps its values bit for
bit, that LoRA reaches the tower only when asked, that an adapter holding a whole tower or projector reloads on its
base as the trained model, that checkpointing recomputes the tower exactly when it trains, and that the plan counts
what trains. Text data gives the tower no gradient, so the image checks run a forward and backward of
``get_image_features`` on random pixels shaped for each tiny tower."""

from __future__ import annotations

import re

import pytest
import torch
from peft import PeftModel
from safetensors.torch import load_file
from test_composite_models import composite, composite_parts, logits_of, run  # noqa: F401 (composite: a fixture)
from transformers import AutoConfig, AutoModelForImageTextToText, LlamaConfig, LlamaForCausalLM
from transformers.modeling_layers import GradientCheckpointingLayer

from anyfit.config import ConfigError, LoraConfig
from anyfit.model.loading import apply_lora, count_parameters
from anyfit.model.savers import enable_checkpointing
from anyfit.model.shape import shape_from_config
from anyfit.model.vision import check_parts, freeze_untrained, parts
from anyfit.planning.memory import estimate_memory
from anyfit.planning.setup import Setup

TEXT = dict(vocab_size=1024, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=2, head_dim=8, max_position_embeddings=512)
# (tower, projector modules) as anyfit.model.vision finds them, by family
PARTS = {
    "qwen3_5": ("model.visual", ()),  # the merger is part of the tower
    "gemma3": ("model.vision_tower", ("model.multi_modal_projector",)),
    "mistral3": ("model.vision_tower", ("model.multi_modal_projector",)),
    "llama4": ("vision_model", ("multi_modal_projector",)),
    "gemma4": ("model.vision_tower", ("model.embed_vision",)),
}


def tiny(model_type: str) -> torch.nn.Module:
    parts_ = composite_parts(model_type)
    text = dict(TEXT, **parts_.pop("text"))
    if model_type == "gemma4":
        text["vocab_size_per_layer_input"] = TEXT["vocab_size"]
    torch.manual_seed(0)
    model = AutoModelForImageTextToText.from_config(AutoConfig.for_model(model_type, text_config=text, **parts_))
    with torch.no_grad():  # Gemma-3's projection matrix starts at zero: images would reach nothing, tower gradients 0
        for p in model.parameters():
            if p.ndim > 1 and not p.any():
                p.normal_(0, 0.3)
    return model


def pixels(model_type: str) -> dict:
    """Inputs of ``get_image_features`` for the tiny towers: Qwen's flattened 8x8 patches of a 32x32 image over 2
    frames (3 channels x 2 x 8 x 8 = 384 values per patch, a 1 x 4 x 4 grid), Gemma-3's one 32x32 image."""
    g = torch.Generator().manual_seed(1)
    if model_type == "qwen3_5":
        return dict(pixel_values=torch.randn(16, 384, generator=g), image_grid_thw=torch.tensor([[1, 4, 4]]))
    return dict(pixel_values=torch.randn(1, 3, 32, 32, generator=g))


def image_features(model, model_type: str) -> torch.Tensor:
    base = model.get_base_model() if isinstance(model, PeftModel) else model
    out = base.get_image_features(**pixels(model_type)).pooler_output
    return torch.cat([t.flatten() for t in out]) if isinstance(out, (list, tuple)) else out  # Qwen: one per image


def image_step(model, model_type: str, lr: float = 0.1) -> None:
    """One SGD step on an image loss: every trained parameter reached from the pixels moves."""
    model.zero_grad(set_to_none=True)
    loss = image_features(model, model_type).float().square().mean()
    if loss.requires_grad:  # nothing trained on the image path: no backward to run
        loss.backward()
    with torch.no_grad():
        for p in model.parameters():
            if p.grad is not None:
                p -= lr * p.grad


def names(model, ids) -> set[str]:
    return {n for n, p in model.named_parameters() if id(p) in ids}


@pytest.mark.parametrize("model_type", list(PARTS))
def test_each_family_s_tower_and_projector_are_found(model_type):
    found = parts(tiny(model_type))
    assert (found.tower, found.projector) == PARTS[model_type]
    assert found.tower_ids and not found.loose and not found.audio_ids
    assert not found.language & found.tower_ids and not found.language & found.projector_ids


@pytest.mark.parametrize("model_type", ["qwen3_5", "gemma3"])
@pytest.mark.parametrize("train_vision, train_projector", [("frozen", False), ("frozen", True), ("full", False),
                                                           ("full", True)])
def test_a_full_fine_tune_trains_exactly_the_parts_asked(model_type, train_vision, train_projector):
    model = tiny(model_type)
    found = parts(model)
    freeze_untrained(model, train_vision, train_projector)
    trained = found.language | (found.tower_ids if train_vision == "full" else set()) | (
        found.projector_ids if train_projector else set())
    assert names(model, {id(p) for p in model.parameters() if p.requires_grad}) == names(model, trained)
    frozen = {n: p.detach().clone() for n, p in model.named_parameters() if not p.requires_grad}
    image_step(model, model_type)
    got = {id(p) for p in model.parameters() if p.grad is not None}
    assert found.tower_ids <= got if train_vision == "full" else not got & found.tower_ids
    assert found.projector_ids <= got if train_projector else not got & found.projector_ids
    assert all(torch.equal(p, frozen[n]) for n, p in model.named_parameters() if n in frozen)


@pytest.mark.parametrize("model_type", ["qwen3_5", "gemma3"])
@pytest.mark.parametrize("train_vision, train_projector", [("frozen", False), ("lora", False), ("lora", True),
                                                           ("full", True)])
def test_lora_adapts_the_tower_only_when_asked_and_the_adapter_reloads_as_trained(model_type, train_vision,
                                                                                   train_projector, tmp_path):
    base = tiny(model_type)
    base.save_pretrained(tmp_path / "base")
    found = parts(base)
    freeze_untrained(base, train_vision, train_projector)
    model = apply_lora(base, LoraConfig(enabled=True, r=4, dropout=0.0), train_vision, train_projector)
    trainable = [n for n, p in model.named_parameters() if p.requires_grad]
    in_tower = [n for n in trainable if f".{found.tower}." in n]
    assert any("lora_A" in n for n in in_tower) == (train_vision == "lora")
    assert any("modules_to_save" in n for n in in_tower) == (train_vision == "full")
    saved_projector = [n for n in trainable if "multi_modal_projector.modules_to_save" in n]
    assert bool(saved_projector) == (train_projector and bool(found.projector))
    frozen = {n: p.detach().clone() for n, p in model.named_parameters() if not p.requires_grad}
    image_step(model, model_type)
    moved = {n for n, p in model.named_parameters() if p.grad is not None}
    assert any(f".{found.tower}." in n for n in moved) == (train_vision != "frozen")
    assert all(torch.equal(p, frozen[n]) for n, p in model.named_parameters() if n in frozen)
    if train_vision == "frozen":
        return
    model.save_pretrained(tmp_path / "adapter")
    saved = load_file(tmp_path / "adapter" / "adapter_model.safetensors")
    assert any(re.search(r"\.(visual|vision_tower)\..*lora_[AB]", k) for k in saved) == (train_vision == "lora")
    reloaded = PeftModel.from_pretrained(AutoModelForImageTextToText.from_pretrained(tmp_path / "base"),
                                         tmp_path / "adapter")
    model.eval()
    reloaded.eval()
    with torch.no_grad():
        # the same modules and weights, so the same operations: equal to the last bit
        assert torch.equal(image_features(reloaded, model_type), image_features(model, model_type))
        assert not torch.equal(image_features(reloaded, model_type),
                               image_features(AutoModelForImageTextToText.from_pretrained(tmp_path / "base"),
                                              model_type))
    assert torch.equal(logits_of(reloaded), logits_of(model))


@pytest.mark.parametrize("model_type", ["qwen3_5", "gemma3"])
@pytest.mark.parametrize("tower_trains", [False, True])
def test_checkpointing_recomputes_the_tower_exactly_when_it_trains(model_type, tower_trains):
    model = tiny(model_type)
    found = parts(model)
    freeze_untrained(model, "full" if tower_trains else "frozen")
    enable_checkpointing(model, every=1, tower=tower_trains)
    tower_layers = [m for n, m in model.named_modules() if n.startswith(found.tower + ".")
                    and isinstance(m, GradientCheckpointingLayer)]
    assert tower_layers and all(m.gradient_checkpointing == tower_trains for m in tower_layers)
    # transformers checkpoints a layer's forward, outside its own hooks: count the calls of the linears inside it
    calls = []
    inner = [m for layer in tower_layers for m in layer.modules() if isinstance(m, torch.nn.Linear)]
    for linear in inner:
        linear.register_forward_hook(lambda *_: calls.append(1))
    model.train()
    with torch.utils.checkpoint.set_checkpoint_early_stop(False):  # recompute whole layers, the last linear too
        loss = image_features(model, model_type).float().square().mean()
    assert loss.requires_grad == tower_trains  # a frozen tower builds no graph (transformers' input-grad hook removed)
    if tower_trains:
        loss.backward()
    # a checkpointed layer runs its forward again in the backward; a frozen tower runs no backward at all
    assert len(calls) == len(inner) * (2 if tower_trains else 1)


def test_checkpoint_every_counts_the_language_model_s_layers_not_the_tower_s():
    # transformers' own every_n_layers counts the tower's layers first: with a 1-layer tower it would checkpoint the
    # language model's second layer, not its first (the planner's "every N-th decoder layer")
    model = tiny("qwen3_5")
    enable_checkpointing(model, every=2, tower=True)
    layers = model.model.language_model.layers
    assert [layer.gradient_checkpointing for layer in layers] == [True, False]
    assert model.model.visual.blocks[0].gradient_checkpointing


def test_a_text_only_model_refuses_vision_settings_in_one_line():
    model = LlamaForCausalLM(LlamaConfig(**TEXT))
    assert check_parts(model, "frozen", False, lora=False) == []
    with pytest.raises(ConfigError, match="model.train_vision=lora but LlamaForCausalLM has no vision tower") as e:
        check_parts(model, "lora", False, lora=True)
    assert "\n" not in str(e.value)
    with pytest.raises(ConfigError, match="model.train_projector=true but LlamaForCausalLM has no vision tower"):
        check_parts(model, "frozen", True, lora=False)


def test_a_projector_inside_the_tower_is_named_in_one_line():
    model = tiny("qwen3_5")
    lines = check_parts(model, "frozen", True, lora=False)
    assert "no projector outside its vision tower (model.visual" in lines[0] and "stays frozen" in lines[0]
    assert "trains with the tower" in check_parts(model, "full", True, lora=False)[0]
    assert check_parts(tiny("gemma3"), "lora", True, lora=True) == [
        "[anyfit] composite: language model trains; vision tower model.vision_tower lora; projector "
        "(model.multi_modal_projector) trains"]


@pytest.mark.parametrize("model_type", ["qwen3_5", "gemma3"])
@pytest.mark.parametrize("method, train_vision, train_projector", [
    ("full", "frozen", False), ("full", "full", True), ("full", "frozen", True),
    ("lora", "frozen", False), ("lora", "lora", False), ("lora", "lora", True), ("lora", "full", False),
])
def test_the_plan_counts_what_trains_as_the_built_model_holds_it(model_type, method, train_vision, train_projector):
    # Trainable parameters and weight bytes of the plan equal the built model's after freezing and LoRA (fp32, so
    # every loaded weight, adapter and modules_to_save copy takes 4 bytes); gradients and AdamW states follow.
    model = tiny(model_type)
    shape = shape_from_config(model.config)
    freeze_untrained(model, train_vision, train_projector)
    if method == "lora":
        model = apply_lora(model, LoraConfig(enabled=True, r=4), train_vision, train_projector)
    trainable, total = count_parameters(model)
    setup = Setup(method=method, device="cpu", precision="fp32", weight_bytes=4, micro_batch=1, seq_len=16, lora_r=4,
                  train_vision=train_vision, train_projector=train_projector)
    plan = estimate_memory(shape, setup)
    assert plan.trainable_params == trainable
    assert plan.weights == total * 4
    assert plan.optimizer == 2 * trainable * 4


def test_a_lora_run_with_the_tower_adapted_and_the_projector_saved_exports_whole(composite, tmp_path):  # noqa: F811
    """anyfit's own training on text (the tower gets no gradient from it: the image checks are above): the adapter
    holds the tower's adapters and the whole projector, and the export reloads as the trained model."""
    from anyfit.export.folder import export

    src = composite("gemma3")
    result = run(src, tmp_path, "lora.enabled=true", "lora.r=4", "lora.alpha=8", "model.train_vision=lora",
                 "model.train_projector=true", "model.gradient_checkpointing=true")
    adapter = load_file(tmp_path / "run" / "adapter_model.safetensors")
    assert any("vision_tower" in k and "lora_A" in k for k in adapter)
    assert any("multi_modal_projector" in k and "lora_" not in k for k in adapter)
    exported = export(tmp_path / "run", tmp_path / "export", echo=lambda *a: None).out
    reloaded = AutoModelForImageTextToText.from_pretrained(exported, dtype=torch.float32)
    torch.testing.assert_close(logits_of(reloaded), logits_of(result.model), rtol=0, atol=1e-4)

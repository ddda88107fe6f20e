"""The tiny vision-language checkpoints of tests/vlm_fixtures.py load as hub checkpoints do: AutoProcessor renders a
conversation with images through the family's chat template into input_ids with the image tokens expanded plus the
image tensors, and AutoModelForImageTextToText trains on exactly that (a finite loss, labels = input_ids)."""

from __future__ import annotations

from functools import cache

import pytest
import torch
from transformers import AutoConfig, AutoModelForImageTextToText, AutoProcessor, AutoTokenizer
from vlm_fixtures import FAMILIES, built_vlm, chat_template, make_image, missing_for, write_image

# The processor class each family's folder loads as, and the image tokens one 64x48 image becomes.
PROCESSOR = {"qwen3_5": "Qwen3VLProcessor", "qwen2_5_vl": "Qwen2_5_VLProcessor", "qwen3_vl": "Qwen3VLProcessor",
             "gemma3": "Gemma3Processor",
             "mistral3": "PixtralProcessor", "idefics3": "Idefics3Processor", "llava": "LlavaProcessor",
             "gemma4": "Gemma4Processor", "llama4": "Llama4Processor"}
IMAGE_TOKENS = {"qwen3_5": 12,  # 6x8 patches of 8 pixels, merged 2x2
                "qwen2_5_vl": 12,
                "qwen3_vl": 12,
                "gemma3": 4,  # mm_tokens_per_image, whatever the image's size
                "mistral3": 12,  # 3x4 merged patches, plus an [IMG_BREAK] per row but the last, then [IMG_END]
                "idefics3": 20,  # 2x2 tiles of 32 and the whole image, 4 tokens each
                "llava": 16,  # 4x4 patches of the 32x32 crop, CLS dropped
                "gemma4": 63,  # resized to its 630-patch budget (216x168: 27x21 patches of 8), pooled 3x3
                "llama4": 20}  # 2x2 tiles of 32 and the whole image, 4 <|patch|> tokens each
# What the processor returns: Qwen's M-RoPE needs mm_token_type_ids (which tokens are image tokens), Gemma-3's
# bidirectional attention over each image token_type_ids, Pixtral the images' sizes, Idefics3 the tiles' masks,
# Gemma-4 its patches' positions (its patches padded to the budget) and mm_token_type_ids.
KEYS = {"qwen3_5": {"mm_token_type_ids", "pixel_values", "image_grid_thw"},
        "qwen2_5_vl": {"mm_token_type_ids", "pixel_values", "image_grid_thw"},
        "qwen3_vl": {"mm_token_type_ids", "pixel_values", "image_grid_thw"},
        "gemma3": {"token_type_ids", "pixel_values"}, "mistral3": {"pixel_values", "image_sizes"},
        "idefics3": {"pixel_values", "pixel_attention_mask"}, "llava": {"pixel_values"},
        "gemma4": {"mm_token_type_ids", "pixel_values", "image_position_ids"}, "llama4": {"pixel_values"}}


@pytest.fixture(params=FAMILIES)
def family(request) -> str:
    if reason := missing_for(request.param):
        pytest.skip(reason)
    return request.param


def conversation(*turns: tuple[list, str]) -> list[dict]:
    """User turns of (images, question), each answered."""
    messages = []
    for n, (images, question) in enumerate(turns):
        messages.append({"role": "user", "content": [*({"type": "image", "image": im} for im in images),
                                                     {"type": "text", "text": question}]})
        messages.append({"role": "assistant", "content": [{"type": "text", "text": f"A cat, {n}."}]})
    return messages


def render(processor, messages):
    return processor.apply_chat_template(messages, tokenize=True, return_dict=True, return_tensors="pt")


def image_token_id(folder) -> int:
    # saved as image_token_index by some families (Gemma-3, Mistral-3, LLaVA): read through the config class
    return AutoConfig.from_pretrained(folder).image_token_id


@cache
def model(family: str):
    return AutoModelForImageTextToText.from_pretrained(built_vlm(family), dtype=torch.float32)


def assert_trains(family: str, batch) -> None:
    """The model takes the processor's output (floating-point tensors in its dtype, as transformers' pipeline hands
    them: Llama-4's processor gives bfloat16 pixels), labels = input_ids, and gives a finite loss with gradients
    reaching the vision tower."""
    m = model(family)
    m.zero_grad()
    batch = batch.to(m.dtype)
    loss = m(**batch, labels=batch["input_ids"]).loss
    assert torch.isfinite(loss), loss
    loss.backward()
    vision = [p for n, p in m.named_parameters() if ("vision" in n or "visual" in n) and p.grad is not None]
    assert vision and any(p.grad.abs().sum() > 0 for p in vision)


def test_one_image_expands_and_trains(family):
    folder = built_vlm(family)
    processor = AutoProcessor.from_pretrained(folder)
    assert type(processor).__name__ == PROCESSOR[family]
    batch = render(processor, conversation(([make_image(64, 48)], "What is this?")))
    assert set(batch) == {"input_ids", "attention_mask"} | KEYS[family], sorted(batch)
    assert (batch["input_ids"] == image_token_id(folder)).sum() == IMAGE_TOKENS[family]
    assert processor.tokenizer.decode(batch["input_ids"][0]).count("What is this?") == 1
    assert_trains(family, batch)


@pytest.mark.parametrize("layout", ["one turn", "two turns"])
def test_two_images_in_one_record(family, layout):
    folder = built_vlm(family)
    processor = AutoProcessor.from_pretrained(folder)
    images = [make_image(64, 48, seed=1), make_image(48, 64, seed=2)]
    turns = [(images, "Compare them.")] if layout == "one turn" else [(images[:1], "And this?"), (images[1:], "Now?")]
    batch = render(processor, conversation(*turns))
    one = render(processor, conversation(([images[0]], "x")))
    two = render(processor, conversation(([images[1]], "x")))
    assert (batch["input_ids"] == image_token_id(folder)).sum() == sum(
        int((b["input_ids"] == image_token_id(folder)).sum()) for b in (one, two))
    assert_trains(family, batch)


def test_idefics3_without_image_splitting_is_one_tile():
    processor = AutoProcessor.from_pretrained(built_vlm("idefics3"))
    processor.image_processor.do_image_splitting = False
    batch = render(processor, conversation(([make_image(64, 48)], "What is this?")))
    assert batch["pixel_values"].shape[:2] == (1, 1)
    assert (batch["input_ids"] == image_token_id(built_vlm("idefics3"))).sum() == IMAGE_TOKENS["idefics3"] // 5
    assert_trains("idefics3", batch)


def test_the_folder_is_a_checkpoint_of_the_family(family):
    """Config, tokenizer and template agree: the config's image token is the tokenizer's, the saved template is the
    family's real one, and the tokenizer loads on its own with that template."""
    folder = built_vlm(family)
    config = AutoConfig.from_pretrained(folder)
    assert config.model_type == family
    tokenizer = AutoTokenizer.from_pretrained(folder)
    image_token = {"qwen3_5": "<|image_pad|>", "qwen2_5_vl": "<|image_pad|>", "qwen3_vl": "<|image_pad|>",
                   "gemma3": "<image_soft_token>",
                   "mistral3": "[IMG]", "idefics3": "<image>", "llava": "<image>", "gemma4": "<|image|>",
                   "llama4": "<|patch|>"}[family]
    assert tokenizer.convert_tokens_to_ids(image_token) == config.image_token_id
    assert config.get_text_config().vocab_size == len(tokenizer) < 1100
    assert AutoProcessor.from_pretrained(folder).chat_template == tokenizer.chat_template == chat_template(family)


def test_make_image_is_deterministic(tmp_path):
    a, b, c = make_image(64, 48), make_image(64, 48), make_image(64, 48, seed=1)
    assert a.size == (64, 48) and a.mode == "RGB"
    assert a.tobytes() == b.tobytes() != c.tobytes()
    assert make_image(8, 4, mode="L").mode == "L"
    from PIL import Image

    with Image.open(write_image(tmp_path / "x.png", 20, 10, seed=3)) as saved:
        assert saved.size == (20, 10) and saved.tobytes() == make_image(20, 10, seed=3).tobytes()

"""Image records, exact against each family's own processor and forward: for tiny random-init vision-language models
of nine families with their real processors (``tests/vlm_fixtures``), the token store's ids equal what
``processor.apply_chat_template(..., tokenize=True)`` gives at inference, the batch's image tensors equal the
processor's, and anyfit's summed token loss equals transformers' own forward with labels, one example at a time
(fp32: the same computation, so the same numbers up to the order of a sum)."""

from __future__ import annotations

import pytest
import torch
from vlm_fixtures import FAMILIES, built_vlm, make_image, missing_for

from anyfit.config import DataConfig, ModelConfig
from anyfit.data.batching import collate
from anyfit.data.formats import Example
from anyfit.data.image_batches import ImageBatches
from anyfit.data.image_tokens import ImageTokens
from anyfit.data.images import ImageRef
from anyfit.data.tokenization import IGNORE_INDEX, tokenize_each
from anyfit.model.processor import load_processor
from anyfit.model.tokenizer import load_tokenizer
from anyfit.training.loss import token_loss_sum

QUESTION = [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": "What is in the picture?"}]},
            {"role": "assistant", "content": "Two red squares."}]


def _setup(family: str):
    if why := missing_for(family):
        pytest.skip(why)
    folder = built_vlm(family)
    cfg = ModelConfig(name_or_path=str(folder))
    tokenizer = load_tokenizer(cfg)
    return folder, tokenizer, ImageTokens(*load_processor(cfg, tokenizer))


def _images(tmp_path, sizes):
    refs = []
    for k, (w, h) in enumerate(sizes):
        path = tmp_path / f"image{k}.png"
        make_image(w, h, seed=k).save(path)
        refs.append(ImageRef(path=str(path)))
    return tuple(refs)


def _reference(images: ImageTokens, messages, refs):
    """The processor's own inference output on the conversation with the decoded images. Where the template's
    generation prompt before the answer is not a prefix of the whole conversation's text (Gemma-4's prompt ends in an
    empty thought channel its finished turns drop), the model answers after that prompt at inference: the reference
    is then the prompt's text followed by what the conversation's text writes after the part they share, through
    the processor as ``apply_chat_template(tokenize=True)`` calls it."""
    from PIL import Image

    pictures = [Image.open(ref.path).convert("RGB") for ref in refs]
    shown = iter(pictures)
    conversation = [{**m, "content": [dict(p, image=next(shown)) if p["type"] == "image" else p for p in m["content"]]
                     if isinstance(m["content"], list) else [{"type": "text", "text": m["content"]}]} for m in messages]
    processor = images.processor
    whole = processor.apply_chat_template(conversation, tokenize=False)
    prompt = processor.apply_chat_template(conversation[:-1], tokenize=False, add_generation_prompt=True)
    if whole.startswith(prompt):
        return processor.apply_chat_template(conversation, tokenize=True, return_dict=True, return_tensors="pt")
    at = next(k for k, (a, b) in enumerate(zip(prompt, whole)) if a != b)
    text = prompt + whole[at:]
    bos = processor.tokenizer.bos_token  # transformers' apply_chat_template adds no special tokens after a BOS
    return processor(text=[text], images=[pictures], return_tensors="pt",
                     add_special_tokens=not (bos and text.startswith(bos)))


@pytest.mark.parametrize("family", FAMILIES)
def test_ids_tensors_and_loss_are_the_processors_and_the_models_own(family, tmp_path):
    folder, tokenizer, images = _setup(family)
    refs = _images(tmp_path, [(64, 48)])
    example = Example(kind="messages", messages=QUESTION, images=refs)
    (result,) = tokenize_each([example], tokenizer, DataConfig(path="unused"), images)
    (fate, ids, labels, _), vision = result.parts[0], result.vision[0]
    assert fate.kept
    reference = _reference(images, QUESTION, refs)
    expected = reference["input_ids"][0].tolist()
    # the template's text after the answer (a newline after the end of turn) is not trained, so not kept; where the
    # template ends the turn without a stop token, the text pipeline's EOS follows the answer (as for text records)
    body = ids[:-1] if ids[-1] == tokenizer.eos_token_id and expected[len(ids) - 1:len(ids)] != ids[-1:] else ids
    assert body == expected[:len(body)] and len(expected) - len(body) <= 1
    assert tokenizer.decode([t for t, l in zip(ids, labels) if l != IGNORE_INDEX]).strip().startswith("Two red squares.")
    assert vision["image_tokens"] > 0 and all(labels[k] == IGNORE_INDEX for k in range(vision["last_image_token"] + 1))

    text = {"input_ids": [1, 2, 3, 4, 5], "labels": [IGNORE_INDEX, IGNORE_INDEX, 3, 4, 5]}  # a text row beside it
    batch = collate([{"input_ids": ids, "labels": labels, "vision": vision}, text], tokenizer.pad_token_id,
                    images=ImageBatches(images))
    for key, value in reference.items():
        if key not in ("input_ids", "attention_mask"):
            got = batch["image_inputs"][key]
            assert torch.equal(got[0, :len(ids)] if got.shape[:1] == (2,) and got.dim() == 2 else got,
                               value[0, :len(ids)] if value.dim() == 2 and value.shape[-1] == len(expected) else value), key

    from transformers import AutoModelForImageTextToText

    model = AutoModelForImageTextToText.from_pretrained(folder, dtype=torch.float32)
    summed = token_loss_sum(model, batch)
    with torch.no_grad():  # floating-point inputs in the model's dtype, as transformers' pipeline hands them
        own = {k: v[:, :len(ids)] if v.dim() == 2 and v.shape[-1] == len(expected) else
               v.float() if v.is_floating_point() else v for k, v in reference.items()}
        one = model(**own, labels=torch.tensor([labels])).loss * sum(l != IGNORE_INDEX for l in labels[1:])
        two = model(input_ids=torch.tensor([text["input_ids"]]), labels=torch.tensor([text["labels"]])).loss * 3
    torch.testing.assert_close(summed.detach(), one + two, rtol=1e-5, atol=1e-4)


def test_a_part_before_the_first_image_is_a_text_example(tmp_path):
    """Qwen3.5's template renders an earlier turn's think block otherwise once the conversation goes on, so each
    assistant turn is an example of its own: the first, before the record's image, holds no image; the second
    holds it. Both collate in one batch."""
    _, tokenizer, images = _setup("qwen3_5")
    refs = _images(tmp_path, [(64, 48)])
    messages = [{"role": "user", "content": "Hello"}, {"role": "assistant", "content": "Hi."},
                {"role": "user", "content": [{"type": "image"}, {"type": "text", "text": "And this?"}]},
                {"role": "assistant", "content": "A square."}]
    (result,) = tokenize_each([Example(kind="messages", messages=messages, images=refs)], tokenizer,
                              DataConfig(path="unused"), images)
    assert len(result.parts) == 2 and result.vision[0] is None and len(result.vision[1]["images"]) == 1
    rows = [{"input_ids": ids, "labels": labels, **({"vision": v} if v else {})}
            for (_, ids, labels, _), v in zip(result.parts, result.vision)]
    batch = collate(rows, tokenizer.pad_token_id, images=ImageBatches(images))
    assert batch["image_inputs"]["image_grid_thw"].shape[0] == 1


def test_an_image_after_the_last_answer_is_refused_not_dropped(tmp_path):
    """Messages after the last assistant turn are not trained; an image there would be left out without a word,
    also where the record makes several examples (Qwen3.5): refused in one line."""
    from anyfit.data.sources import DataError

    _, tokenizer, images = _setup("qwen3_5")
    refs = _images(tmp_path, [(64, 48), (40, 56)])
    messages = [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": "What?"}]},
                {"role": "assistant", "content": "A square."},
                {"role": "user", "content": [{"type": "image"}, {"type": "text", "text": "And this?"}]},
                {"role": "assistant", "content": "A circle."},
                {"role": "user", "content": [{"type": "text", "text": "Thanks"}, {"type": "image"}]}]
    refs = refs + (refs[0],)
    with pytest.raises(DataError, match=r"writes 2 image\(s\) of the record's 3: .*after the last assistant turn") as e:
        tokenize_each([Example(kind="messages", messages=messages, images=refs)], tokenizer,
                      DataConfig(path="unused"), images)
    assert "\n" not in str(e.value)


@pytest.mark.parametrize("family", FAMILIES)
def test_images_over_the_processors_size_limit_are_counted_as_shrunk(family, tmp_path):
    """The tiny processors' limits are a few dozen pixels a side (Qwen's max_pixels, Pixtral's and Idefics3's
    longest edge, Gemma-3's and CLIP's fixed size): a 16x16 image is kept whole by every one of them, a 300x200 one
    shrunk, whether alone in its record or beside another."""
    _, tokenizer, images = _setup(family)
    for sizes, shrunk in (([(16, 16)], 0), ([(300, 200)], 1), ([(16, 16), (300, 200)], 1)):
        messages = [{"role": "user", "content": [{"type": "image"}] * len(sizes) + [{"type": "text", "text": "?"}]},
                    {"role": "assistant", "content": "Squares."}]
        example = Example(kind="messages", messages=messages, images=_images(tmp_path, sizes))
        (result,) = tokenize_each([example], tokenizer, DataConfig(path="unused"), images)
        assert result.vision[-1]["shrunk"] == shrunk, (sizes, result.vision[-1]["shrunk"])

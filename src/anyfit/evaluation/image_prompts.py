"""Prompts with images: what a vision-language model is given to answer an image record, as transformers gives it.

The reference is ``processor.apply_chat_template(messages before the answer, add_generation_prompt=True,
tokenize=True)``: the chat template's generation prompt (``anyfit.data.templates.render_prompt``, the text the
training pipeline renders), then the model's processor on that text and the prompt's decoded images, which expands
each image placeholder into the image's tokens (``anyfit.data.image_tokens.ImageTokens``: the same call as the
token store's, so a prompt's ids are the ids the model trained on before its answer).

The images of a prompt are those its text holds: the record's first images, as many as the template wrote
placeholders before the answer (an image in the answer turn is not the model's to see).

Batches are processed as training processes them (``anyfit.data.image_batches``): the processor on the batch's texts
and images, here padded on the left so that every row's last prompt token is in the last column for
``model.generate``; each row's ids are checked against the prompt's.
"""

from __future__ import annotations

from dataclasses import dataclass

from anyfit.config import DataConfig
from anyfit.data.formats import Example
from anyfit.data.image_tokens import ImageTokens
from anyfit.data.images import ImageRef, image_size, load_image
from anyfit.data.records import DataError
from anyfit.data.templates import render_prompt
from anyfit.data.tokenization import prompt_token_ids


@dataclass(frozen=True)
class ImagePrompt:
    """One prompt with images. ``ids``: the processor's (each image's placeholder expanded into its tokens), what
    transformers generates from; ``text_ids``: the tokenizer's ids of ``text`` (one placeholder per image), what
    vLLM takes with the images and expands itself."""

    text: str
    images: tuple[ImageRef, ...]
    ids: list[int]
    text_ids: list[int]
    place: str = "a prompt"

    def pictures(self) -> list:
        """The images, decoded (``anyfit.data.images.load_image``: RGB, EXIF orientation applied)."""
        return [load_image(ref, where) for ref, where in zip(self.images, _wheres(self.place, self.images))]


def example_prompt(example: Example, tokenizer, cfg: DataConfig, images: ImageTokens | None = None
                   ) -> list[int] | ImagePrompt:
    """What the model is given to generate ``example``'s (last) answer: the training pipeline's ids for a text
    record (``prompt_token_ids``, unchanged), an ``ImagePrompt`` for a record with images, refused in one line
    when the model has no processor (a text-only model)."""
    if not example.images:
        return prompt_token_ids(example, tokenizer, cfg)
    images = images or ImageTokens()
    if images.processor is None:
        raise DataError(f"{example.place} holds {len(example.images)} image(s), but {images.missing}: generate from a "
                        "vision-language checkpoint (one with a processor: preprocessor_config.json), or leave the "
                        "image records out of the evaluation data.")
    images.check(example)  # a record without a conversation: one line
    text = render_prompt(example, tokenizer, cfg)
    shown = example.images[:text.count(images.placeholder)] if images.placeholder else ()
    text_ids = prompt_token_ids(example, tokenizer, cfg)
    if not shown:  # the images are in the answer turn only: the prompt is text
        return text_ids
    sizes = [image_size(ref, where) for ref, where in zip(shown, _wheres(example.place, shown))]
    return ImagePrompt(text, tuple(shown), images.ids(text, sizes, example.place), text_ids, example.place)


def processed_batch(prompts: list[ImagePrompt], images: ImageTokens) -> dict:
    """The model inputs of a batch of image prompts: the processor's output on their texts and decoded images,
    padded on the left (``input_ids``, ``attention_mask``, ``pixel_values``, ``image_grid_thw``, ...), each row's
    ids checked against its prompt's."""
    texts = [p.text for p in prompts]
    out = images.processor(text=texts, images=[p.pictures() for p in prompts], padding=True, padding_side="left",
                           return_tensors="pt", **images.text_kwargs(texts[0]))
    mask = out["attention_mask"].bool()
    for k, prompt in enumerate(prompts):
        if out["input_ids"][k][mask[k]].tolist() != prompt.ids or not mask[k, -1]:
            raise DataError(f"{prompt.place}: the model's processor gives its images a different number of tokens "
                            "when it decodes them than their sizes gave (or does not pad on the left), so the prompt "
                            "would not be the one the model trained on; report the model.")
    return dict(out)


def prompt_image_names(prompt: list[int] | ImagePrompt) -> list[str]:
    """The images of a prompt as ``predictions.jsonl`` names them (paths, URLs, or how many bytes); [] for text."""
    return [ref.describe() for ref in prompt.images] if isinstance(prompt, ImagePrompt) else []


def _wheres(place: str, refs) -> list[str]:
    """Each image as error messages name it: ``Record 3 (data.jsonl:5): image 2 (/abs/cat.png)``."""
    return [f"{place}: image {k + 1} ({ref.describe()})" for k, ref in enumerate(refs)]

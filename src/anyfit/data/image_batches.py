"""The images of a micro-batch, decoded and processed in the batch workers by the model's own processor, into the
inputs its forward takes beside the token ids (``pixel_values``, ``image_grid_thw``, ``mm_token_type_ids``, ...).

The token store holds each image example's rendered text and image references (``anyfit.data.image_tokens``), never
pixels. Here the processor is called on the batch's texts and real images exactly as transformers'
``processor.apply_chat_template(..., tokenize=True)`` calls it, so the tensors are the ones the model is given at
inference, batched as the processor batches them (every family's layout is its processor's: Qwen's flattened
patches and grids, Idefics3's padded image grid with its pixel mask, Gemma-3's fixed-size crops). Its ids must be the
store's ids (a prefix of either: the store may hold a cut example, or the EOS the text pipeline appends), else the
batch is refused: an image file that changed since the store was built, or a processor whose token count depends on
more than an image's size, would otherwise train on ids the store's mask does not describe.

The processor's per-token outputs beside the ids (``mm_token_type_ids``, Gemma-3's ``token_type_ids``) are laid onto
anyfit's own padded rows; rows without images get zeros (text), as the processor gives a text token.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass
from typing import Any

import torch

from anyfit.data.image_tokens import ImageTokens
from anyfit.data.images import ImageRef, load_image
from anyfit.data.records import DataError

# The processor's outputs that are the text's own: anyfit's collate makes them from the store.
_TEXT_KEYS = ("input_ids", "attention_mask")


@dataclass
class ImageBatches:
    """Called by ``batching.collate`` on a padded micro-batch with image examples: their model inputs."""

    images: ImageTokens

    def __call__(self, examples: list[dict], width: int) -> dict[str, torch.Tensor]:
        """The image inputs of a padded micro-batch of ``examples`` (``width`` tokens per row)."""
        def padded(own: dict[int, torch.Tensor], dtype) -> torch.Tensor:
            laid = torch.zeros((len(examples), width), dtype=dtype)
            for r, values in own.items():
                laid[r, :len(values)] = values
            return laid

        return self._inputs(examples, padded)

    def packed(self, examples: list[dict]) -> dict[str, torch.Tensor]:
        """The image inputs of ``examples`` packed into one row, in order: the images as the processor batches
        them (every family's forward places an image's features at its tokens in order), each per-token output laid
        along the row (text examples: zeros)."""
        def row(own: dict[int, torch.Tensor], dtype) -> torch.Tensor:
            return torch.cat([own.get(r, torch.zeros(len(ex["input_ids"]), dtype=dtype))
                              for r, ex in enumerate(examples)])[None]

        return self._inputs(examples, row)

    def _inputs(self, examples: list[dict], lay) -> dict[str, torch.Tensor]:
        """The processor's outputs but the ids: image tensors as it batches them; each per-token output as
        ``lay(row -> that example's values at its store length, dtype)`` lays them out."""
        rows, out, valid = self._processed(examples)
        inputs: dict[str, Any] = {}
        for key, value in out.items():
            if key in _TEXT_KEYS:
                continue
            if isinstance(value, torch.Tensor) and value.shape[:2] == out["input_ids"].shape:  # per token
                own = {r: _own(value[k][valid[k]], len(examples[r]["input_ids"])) for k, r in enumerate(rows)}
                inputs[key] = lay(own, value.dtype)
            else:
                inputs[key] = value
        return inputs

    def _processed(self, examples: list[dict]) -> tuple[list[int], dict, torch.Tensor]:
        """(the rows with images, the processor's output on them, its valid positions), its ids checked against
        the store's."""
        rows = [r for r, ex in enumerate(examples) if "vision" in ex]
        texts = [examples[r]["vision"]["text"] for r in rows]
        pictures = [[_decoded(ref, digest) for ref, digest in
                     zip(examples[r]["vision"]["images"], examples[r]["vision"]["sha256"])] for r in rows]
        kwargs = self.images.text_kwargs(texts[0])
        out = self.images.processor(text=texts, images=pictures, padding=True, return_tensors="pt", **kwargs)
        valid = out["attention_mask"].bool() if "attention_mask" in out else torch.ones_like(out["input_ids"]).bool()
        for k, r in enumerate(rows):
            ids = out["input_ids"][k][valid[k]].tolist()
            stored = examples[r]["input_ids"]
            n = min(len(ids), len(stored))
            if ids[:n] != stored[:n] or len(stored) > len(ids) + 1:
                raise DataError(f"the model's processor gives an image example ids that differ from the token store's "
                                f"({examples[r]['vision']['images'][0].describe()}, ...): an image changed since the "
                                "store was built, or this processor's image tokens depend on more than the image's "
                                "size. Run `anyfit prepare` again (a changed image file), or report the model.")
        return rows, out, valid


def _own(values: torch.Tensor, length: int) -> torch.Tensor:
    """A per-token output of the processor for one example, cut or extended to the store's ``length`` (the tokens
    the text pipeline appends after the text take the value of the text's last token: text)."""
    n = min(len(values), length)
    return torch.cat([values[:n], values[n - 1:n].expand(length - n)])


def _decoded(ref: ImageRef, digest: str):
    """The image, decoded, when its bytes are still those the token store was built from (a DataError otherwise)."""
    raw = ref.read_bytes()
    if hashlib.sha256(raw).hexdigest() != digest:
        raise DataError(f"image {ref.describe()} changed since the token store was built from it (its bytes differ), so "
                        "its tokens may not match it; run `anyfit prepare` again (set data.cache_dir elsewhere or "
                        "delete the store to rebuild), or restore the image.")
    return load_image(ImageRef(data=raw), ref.describe())

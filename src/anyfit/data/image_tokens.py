"""Records with images tokenized as the model's own processor tokenizes them at inference, with the loss mask of the
text pipeline carried onto its ids.

The reference is transformers' ``processor.apply_chat_template(..., tokenize=True)``: the chat template's text
(an image part rendered as the template writes it, e.g. Qwen's ``<|vision_start|><|image_pad|><|vision_end|>``),
then the processor called on that text and the images, which expands each placeholder into the image's tokens
(Qwen: one ``<|image_pad|>`` per merged patch; Gemma-3: ``\\n\\n<start_of_image>`` + 256 soft tokens +
``<end_of_image>\\n\\n``; Idefics3: a grid of row/column tokens). No expansion is rewritten here, per family: the
processor does it, so every family it knows is handled, and the ids are its ids.

The loss mask comes from the text pipeline (``anyfit.data.chat`` and ``tokenization``: the same ``data.train_on``,
per-message loss, template options and override as text), whose ids are those of the same text before expansion.
``carry_labels`` aligns the two id sequences: a token the processor left as it was keeps its label; a token it
added or changed (image tokens, and text its expansion merged with, such as Gemma-3's newlines) is never trained. A
record where the expansion would change a trained token is refused in one line, never trained approximately.

The number of image tokens depends on an image's size alone (the processor resizes to its own grid), so the token
store is built from each image's header (``images.image_size``) with a blank stand-in of that size, never decoding
the pixels; the batch workers then process the real images and check that the processor gives the very ids the
store holds (``anyfit.data.image_batches``).
"""

from __future__ import annotations

import difflib
import functools
import hashlib
import json
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import numpy as np

from anyfit.data.audit import IGNORE_INDEX
from anyfit.data.images import ImageRef, image_size
from anyfit.data.records import DataError

if TYPE_CHECKING:
    from anyfit.data.formats import Example


@dataclass
class ImageTokens:
    """The model's processor as the token store uses it; ``processor`` None for a model without one (``missing``
    says why: a text-only model), whose image records are refused."""

    processor: Any = None
    missing: str = "the model has no image processor"

    @property
    def bos(self) -> str | None:
        return getattr(self.processor.tokenizer, "bos_token", None)

    def fingerprint(self) -> str | None:
        """What in the processor decides ids (its image processor's settings), for the token store's key."""
        if self.processor is None:
            return None
        return hashlib.sha256(self.processor.to_json_string().encode()).hexdigest()

    @functools.cached_property
    def probes(self) -> tuple[str, str]:
        """The chat template's text of a user turn with one image part before its text, and without it."""
        text = {"type": "text", "text": "anyfit-probe"}
        return tuple(self.processor.tokenizer.apply_chat_template([{"role": "user", "content": parts}], tokenize=False)
                     for parts in ([{"type": "image"}, text], [text]))

    @functools.cached_property
    def placeholder(self) -> str:
        """The text the chat template writes for one image part (read from the template: a user turn rendered with
        and without an image), by which the images of an example's text are counted."""
        a, b = self.probes
        start = next((k for k, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))
        end = len(a) - next((k for k, (x, y) in enumerate(zip(a[::-1], b[::-1])) if x != y), len(b))
        return a[start:max(start, end)]

    def largest_image(self, side: int = 4096) -> int:
        """The tokens one ``side`` x ``side`` image takes in a user message (its placeholder and everything the
        processor expands it into), measured with the processor itself: its own resize caps it (Qwen's max_pixels,
        Idefics3's and Pixtral's longest edge; Gemma-3's and LLaVA's fixed size), so no per-family rule is needed."""
        with_image, plain = self.probes
        return len(self.ids(with_image, [(side, side)], "a probe")) - len(self.ids(plain, [], "a probe"))

    def patches(self, patch: int, side: int = 4096) -> int:
        """Patches of ``patch`` pixels a side that the tower embeds for one ``side`` x ``side`` image: the pixels the
        processor keeps of it (its own size limit, tiles included)."""
        with_image, _ = self.probes
        return (self.kept_pixels(self.processed(with_image, [(side, side)], "a probe")) or 0) // (patch * patch)

    def check(self, example: Example) -> None:
        """A DataError for an image record this model cannot train."""
        if self.processor is None:
            raise DataError(f"{example.place} holds {len(example.images)} image(s), but {self.missing}. Fine-tune a "
                            "vision-language checkpoint (one with a processor: preprocessor_config.json), or remove "
                            "the image parts from the data.")
        if example.kind != "messages" and not isinstance(example.prompt, list):
            raise DataError(f"{example.place} holds images in a record without a conversation; images are trained "
                            "through the model's chat template: write the record as messages (or a conversational "
                            "prompt) with image parts.")

    def tokens(self, example: Example, texts: list[str], pairs: list[tuple[list[int], list[int]]]
               ) -> list[tuple[list[int], list[int], dict | None]]:
        """(ids, labels, vision) of each part of an image record: the processor's ids for the part's text (``texts``,
        as the chat template rendered it) and images, the labels of the text pipeline's ``pairs`` carried onto them,
        and what the batch workers need (the text, the part's images, where its last image token is; None for a
        part before the record's first image, which is text)."""
        self.check(example)
        sizes, digests = [], []
        for k, ref in enumerate(example.images):  # each file read once: its size, and the digest of the bytes trained
            raw = ref.read_bytes()  # on (checked again when the batch workers decode them)
            sizes.append(image_size(ImageRef(data=raw), f"{example.place}: image {k + 1} ({ref.describe()})"))
            digests.append(hashlib.sha256(raw).hexdigest())
        counts = [text.count(self.placeholder) if self.placeholder else 0 for text in texts]
        if max(counts, default=0) != len(example.images):  # the last part holds the images of every earlier one
            raise DataError(f"{example.place}: the chat template writes {max(counts, default=0)} image(s) of the "
                            f"record's {len(example.images)}: it leaves out the images of messages after the last "
                            "assistant turn (nothing there is trained) and where it renders no image part; remove "
                            "those images, or move them to a user message before an answer.")
        out, kept = [], {}
        for text, (text_ids, text_labels), n in zip(texts, pairs, counts):
            processed = self.processed(text, sizes[:n], example.place)
            ids = [int(t) for t in processed["input_ids"][0]]
            if n == 1:  # a part with one image: the pixels the processor kept of it, from the same call
                kept[sizes[0]] = self.kept_pixels(processed)
            carried = carry_labels(text_ids, text_labels, ids)
            if carried is None:
                raise DataError(f"{example.place}: the processor's expansion of an image changes trained tokens next "
                                "to it (they tokenize differently once the image tokens are in), so the answer "
                                "cannot be trained exactly; put the image in a user message, or text between it and "
                                "the answer.")
            vision = {"text": text, "images": list(example.images[:n]), "sha256": digests[:n],
                      "image_tokens": carried.image_tokens, "last_image_token": carried.last_image_token} if n else None
            out.append((_padded_ids(text_ids, ids, carried), carried.labels, vision))
        shrunk = [self.shrunk(size, kept) for size in sizes]
        for _, _, vision in out:
            if vision is not None:
                vision["shrunk"] = sum(shrunk[:len(vision["images"])])
        return out

    def shrunk(self, size: tuple[int, int], kept: dict) -> bool:
        """Whether the processor keeps fewer pixels of an image of ``size`` than it has (its size limit: Qwen's
        max_pixels, Idefics3's and Pixtral's longest edge, a fixed-size tower's resolution); ``kept`` holds what the
        record's own calls measured, an image of a record of several is measured alone (a processor's batch pads
        its images, so their pixels are not told apart)."""
        if size not in kept:
            with_image, _ = self.probes
            kept[size] = self.kept_pixels(self.processed(with_image, [size], "a probe"))
        return kept[size] is not None and kept[size] < size[0] * size[1]

    def kept_pixels(self, processed) -> int | None:
        """The pixels of the processor's ``pixel_values`` (tiles and patches alike, RGB; an image it repeats in
        time, Qwen's ``temporal_patch_size``, counted once); None for a processor that returns none."""
        values = next((v for k, v in processed.items() if k.startswith("pixel_values")), None)
        if values is None:
            return None
        repeats = getattr(self.processor.image_processor, "temporal_patch_size", None) or 1
        return _numel(values) // (3 * repeats)

    def ids(self, text: str, sizes: list[tuple[int, int]], place: str) -> list[int]:
        """The processor's ids for ``text`` and images of these sizes (blank stand-ins: the ids depend on the sizes
        alone), with special tokens as ``apply_chat_template(tokenize=True)`` adds them."""
        return [int(t) for t in self.processed(text, sizes, place)["input_ids"][0]]

    def processed(self, text: str, sizes: list[tuple[int, int]], place: str):
        """What the processor returns for ``text`` and blank stand-ins of these sizes (see ``ids``)."""
        from PIL import Image

        stand_ins = [Image.new("RGB", size) for size in sizes]
        try:
            return self.processor(text=[text], images=[stand_ins] if stand_ins else None, **self.text_kwargs(text))
        except Exception as e:  # the processor's own check (placeholders vs images), in its words
            raise DataError(f"{place}: the model's processor refused the record ({' '.join(str(e).split())}); check "
                            "that each image has its image part (or <image> placeholder) and the reverse.") from e

    def text_kwargs(self, text: str) -> dict:
        """The processor's text options as transformers' ``apply_chat_template(tokenize=True)`` passes them: no
        special tokens added to a text that starts with the BOS (the template wrote it), the processor's own default
        otherwise."""
        return {"add_special_tokens": False} if self.bos and text.startswith(self.bos) else {}


def _numel(values) -> int:
    """Elements of a tensor or array, or of the (nested) list of them some processors return."""
    if hasattr(values, "shape"):
        return int(np.prod(values.shape))
    return sum(_numel(v) for v in values)


@dataclass
class Carried:
    """``carry_labels``' answer: the labels of the processor's ids (tokens appended after the text included), how
    many of its ids it added or changed (the image tokens), and where the last of them is (-1: none)."""

    labels: list[int]
    image_tokens: int
    last_image_token: int


def carry_labels(text_ids: list[int], text_labels: list[int], ids: list[int]) -> Carried | None:
    """Labels for ``ids`` (the processor's) from the text pipeline's ``text_ids``/``text_labels`` of the same text
    before expansion: equal runs keep their labels, everything the processor added or changed is IGNORE_INDEX; None
    where a trained text token is not found unchanged. Tokens the text pipeline appended after the text (an EOS it
    adds to teach stopping) are carried over at the end, trained as they were.

    The equal runs are found by ``difflib`` on the part between the common prefix and suffix (the images' region:
    a few places per record), so a long record costs a linear scan plus a diff of its image regions."""
    n, m = len(text_ids), len(ids)
    head = 0
    while head < min(n, m) and text_ids[head] == ids[head]:
        head += 1
    tail = 0
    while tail < min(n, m) - head and text_ids[n - 1 - tail] == ids[m - 1 - tail]:
        tail += 1
    labels = list(text_labels[:head]) + [IGNORE_INDEX] * (m - head - tail) + list(text_labels[n - tail:])
    added = [True] * (m - head - tail)  # per position of the middle: added or changed by the processor
    a, b = text_ids[head:n - tail], ids[head:m - tail]
    appended: list[int] = []
    for op, i1, i2, j1, j2 in difflib.SequenceMatcher(None, a, b, autojunk=False).get_opcodes():
        if op == "equal":
            labels[head + j1:head + j2] = text_labels[head + i1:head + i2]
            added[j1:j2] = [False] * (j2 - j1)
        elif op == "delete" and i2 == len(a) and tail == 0 and all(t != IGNORE_INDEX for t in text_labels[head + i1:]):
            appended = list(text_labels[head + i1:])  # after the text (the EOS): kept, as trained
        elif any(t != IGNORE_INDEX for t in text_labels[head + i1:head + i2]):
            return None
    last = max((head + j for j, changed in enumerate(added) if changed), default=-1)
    return Carried(labels + appended, sum(added), last)


def _padded_ids(text_ids: list[int], ids: list[int], carried: Carried) -> list[int]:
    """The processor's ids with the tokens appended after the text (see ``carry_labels``)."""
    extra = len(carried.labels) - len(ids)
    return ids + text_ids[len(text_ids) - extra:] if extra else ids


def vision_json(vision: dict, blob) -> bytes:
    """One example's image record as the token store keeps it (``blob(bytes) -> [offset, length]`` stores embedded
    image bytes once); ``vision_of`` reads it back."""
    refs = []
    for ref in vision["images"]:
        if ref.data is not None:
            refs.append({"at": blob(ref.data)})
        else:
            refs.append({"path": ref.path} if ref.path is not None else {"url": ref.url})
    return json.dumps({"text": vision["text"], "images": refs, "sha256": vision["sha256"],
                       "image_tokens": vision["image_tokens"]}, ensure_ascii=False).encode()


def vision_of(raw: bytes, blobs) -> dict:
    """The example's text and images (``ImageRef``) from ``vision_json``'s bytes (``blobs``: the store's image
    bytes)."""
    record = json.loads(raw)
    refs = [ImageRef(data=bytes(blobs[r["at"][0]:r["at"][0] + r["at"][1]])) if "at" in r else ImageRef(**r)
            for r in record["images"]]
    return {"text": record["text"], "images": refs, "sha256": record["sha256"], "image_tokens": record["image_tokens"]}


def rendered_text(rendering) -> str:
    """The text a chat template rendered for one part of a record (``anyfit.data.templates.Rendering``); images go
    through the chat template, so another rendering (a text template, data.template=trl) is refused."""
    segments = getattr(rendering, "segments", None)
    if segments is None or getattr(rendering, "add_special_tokens", True):
        raise DataError("records with images are trained through the model's chat template (data.template: chat); "
                        "data.template=trl and text templates take text records only.")
    return "".join(s.text for s in segments)


def expand_image_records(examples: list, texts: dict[int, list[str]], pairs: list[list], images: ImageTokens | None
                         ) -> dict[int, list[dict]]:
    """For each image record (``texts``: record index -> its parts' rendered texts): its ``pairs`` replaced by the
    processor's ids and the carried labels (in place), and the parts' vision records returned (record index -> one
    per part)."""
    visions = {}
    for i, part_texts in texts.items():
        out = (images or ImageTokens()).tokens(examples[i], part_texts, pairs[i])
        pairs[i] = [(ids, labels) for ids, labels, _ in out]
        visions[i] = [vision for *_, vision in out]
    return visions

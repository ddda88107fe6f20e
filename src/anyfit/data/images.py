"""The images of a record: where each one is (``ImageRef``), how the public data shapes place them in a
conversation (``place_images``), and loading one, checked (``load_image``, ``image_size``, ``thumbnail_uri``).

A record's images end up in one canonical form: a message with images has as content a list of parts,
``[{"type": "text", "text": ...}, {"type": "image"}, ...]`` in order, the image parts without payload; the
``ImageRef`` of the k-th image part of the record (over its messages, in order) is ``Example.images[k]``. A
message without images keeps its string content. The shapes read:

- TRL: ``{"type": "image"}`` parts filled in order from an ``images`` (or ``image``) column; string contents plus
  an ``images`` column: the images go at the start of the first user message (``trl.data_utils.
  prepare_multimodal_messages``, TRL 1.16);
- transformers' parts: ``{"type": "image", "image" | "url" | "path" | "base64": ...}`` (the keys
  ``ProcessorMixin.apply_chat_template`` reads); OpenAI's ``{"type": "image_url", "image_url": {"url": ...}}``;
- LLaVA / LLaMA-Factory: ``<image>`` in the text, the images in ``image`` / ``images``, one per placeholder.

An image is a local path (relative: to the data file's folder; hub data: the current directory), an http(s)
URL (fetched once into anyfit's cache), a base64 data URL, bytes, the hub's ``Image`` feature ``{"bytes",
"path"}`` or a PIL image. Whatever cannot be read is refused in one line naming the record, the image and the fix.
"""

from __future__ import annotations

import base64
import binascii
import hashlib
import inspect
import io
import os
import re
import urllib.parse
import urllib.request
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from anyfit.cache import cache_root
from anyfit.data.messages import Message, short
from anyfit.data.records import DataError

if TYPE_CHECKING:
    import PIL.Image

IMAGE_TOKEN = "<image>"  # LLaVA's and LLaMA-Factory's placeholder
# The payload keys of an image part: transformers' (ProcessorMixin.apply_chat_template reads these four).
PAYLOAD_KEYS = ("image", "url", "path", "base64")
_BASE64 = re.compile(r"[A-Za-z0-9+/\s]+={0,2}")
_FIX_PATH = "fix the path in the record, or put the image there"


@dataclass(frozen=True)
class ImageRef:
    """Where one image of a record is: exactly one of an absolute local ``path``, an http(s) ``url``, or the
    ``data`` embedded in the record (a decoded base64 data URL, the hub ``Image`` feature's bytes, raw bytes)."""

    path: str | None = None
    url: str | None = None
    data: bytes | None = None

    def __post_init__(self):
        if sum(v is not None for v in (self.path, self.url, self.data)) != 1:
            raise ValueError("an ImageRef has exactly one of path, url and data")

    def __repr__(self) -> str:  # not the bytes
        return f"ImageRef({self.describe()!r})"

    def describe(self) -> str:
        """The image in a few words, for error messages."""
        if self.data is None:
            return self.path or self.url or ""
        return f"embedded {_format_of(self.data) or 'image'} bytes ({len(self.data) / 1024:.1f} KiB)"

    def read_bytes(self, cache_dir: Path | None = None) -> bytes:
        """The image file's bytes. A URL is fetched once into ``cache_dir`` (default: anyfit's cache, ``images/``)
        under the sha256 of the URL, and read from there after."""
        if self.data is not None:
            return self.data
        if self.path is not None:
            try:
                return Path(self.path).read_bytes()
            except OSError as e:
                raise DataError(f"{self.path}: cannot read the image ({e.strerror or e}).") from None
        if cache_dir is None:
            cache_dir = cache_root() / "images"
        cached = Path(cache_dir) / hashlib.sha256(self.url.encode()).hexdigest()
        if not cached.is_file():
            try:
                data = _fetch(self.url)
            except Exception as e:  # offline, refused, not found, timed out: all the same to the user
                raise DataError(f"{self.url}: could not fetch the image ({' '.join(str(e).split()) or type(e).__name__})"
                                "; download the images and point the records at the files (paths relative to the "
                                "data file's folder).") from None
            cached.parent.mkdir(parents=True, exist_ok=True)
            partial = cached.with_name(f"{cached.name}.{os.getpid()}.partial")
            partial.write_bytes(data)
            os.replace(partial, cached)  # never a half-written file under the final name
        return cached.read_bytes()

    def digest(self) -> str:
        """The sha256 of the image's bytes (for the data fingerprint)."""
        return hashlib.sha256(self.read_bytes()).hexdigest()


def _fetch(url: str) -> bytes:
    """The bytes at an http(s) URL (tests replace this function). Hub offline mode fetches nothing."""
    from huggingface_hub import constants

    if constants.HF_HUB_OFFLINE:
        raise ConnectionError("HF_HUB_OFFLINE is set")
    import httpx  # what transformers' load_image fetches with

    response = httpx.get(url, timeout=30, follow_redirects=True)
    response.raise_for_status()
    return response.content


def _format_of(data: bytes) -> str | None:
    """PIL's name for the format of image bytes (PNG, JPEG, ...), from their header; None if not an image."""
    from PIL import Image, UnidentifiedImageError

    try:
        with Image.open(io.BytesIO(data)) as image:
            return image.format
    except (UnidentifiedImageError, OSError, ValueError):
        return None


# ---------------------------------------------------------------------------------------------- reading records


def image_ref(value: Any, where: str, folder: str | None, base64_only: bool = False) -> ImageRef:
    """The image a record gives as ``value`` (see the module doc); ``folder``: where relative paths are taken
    from (None: the current directory); ``base64_only``: a string is base64 (transformers' ``base64`` key)."""
    if isinstance(value, str):
        return _from_string(value.strip(), where, folder, base64_only)
    if isinstance(value, (bytes, bytearray, memoryview)):
        return ImageRef(data=bytes(value))
    if isinstance(value, Mapping) and ("bytes" in value or "path" in value):  # the hub's Image feature
        if value.get("bytes") is not None:
            return ImageRef(data=bytes(value["bytes"]))
        if isinstance(value.get("path"), str) and value["path"]:
            return _from_string(value["path"], where, folder, False)
        raise DataError(f"{where} is the hub's Image feature with neither 'bytes' nor 'path': {short(value)}; give "
                        "the image's file or bytes.")
    if type(value).__module__.startswith("PIL.") and hasattr(value, "save"):  # decoded by `datasets`, or in code
        return _from_pil(value, where)
    raise DataError(f"{where} must be an image: a file path, an http(s) URL, a base64 data URL, bytes or the hub's "
                    f"Image {{'bytes', 'path'}}; got {short(value)}. Fix the record.")


def _from_string(text: str, where: str, folder: str | None, base64_only: bool) -> ImageRef:
    if text.startswith("data:") or base64_only:
        return ImageRef(data=_decode_base64(text, where))
    if text.startswith(("http://", "https://")):
        return ImageRef(url=text)
    written = text
    if text.startswith("file://"):
        parsed = urllib.parse.urlparse(text)
        text = urllib.request.url2pathname(parsed.netloc + parsed.path)
    path = Path(text).expanduser()
    full = os.path.normpath(path if path.is_absolute() else Path(folder or os.getcwd()) / path)
    if os.path.isfile(full):
        return ImageRef(path=full)
    if len(text) >= 64 and _BASE64.fullmatch(text):  # transformers' load_image takes a bare base64 string too
        return ImageRef(data=_decode_base64(text, where))
    looked = "" if path.is_absolute() else (
        f" (looked for {full}: relative to {'the data file' if folder else 'the current directory'})")
    raise DataError(f"{where}: image file {written!r} does not exist{looked}; {_FIX_PATH}.")


def _decode_base64(text: str, where: str) -> bytes:
    """The bytes of a base64 data URL (``data:image/png;base64,...``) or of bare base64."""
    if text.startswith("data:"):
        header, _, text = text.partition(",")
        if not header.endswith(";base64") or not header[5:].startswith("image/"):
            raise DataError(f"{where} is a data URL {short(header + ',')} that is not a base64 image "
                            "('data:image/png;base64,...'); encode the image so, or give its file.")
    try:
        data = base64.b64decode("".join(text.split()), validate=True)  # line breaks, as base64.encodebytes writes
    except (binascii.Error, ValueError) as e:
        raise DataError(f"{where} is not valid base64 ({e}): {short(text)}; encode the image again, or give its "
                        "file.") from None
    if not data:
        raise DataError(f"{where} is empty base64; give the image.")
    return data


def _from_pil(image: PIL.Image.Image, where: str) -> ImageRef:
    """A PIL image (as `datasets` decodes the Image feature): its file where it was opened from one, else its
    pixels as PNG (lossless) bytes."""
    filename = getattr(image, "filename", None)
    if filename and os.path.isfile(filename):
        return ImageRef(path=os.path.abspath(filename))
    if getattr(image, "n_frames", 1) > 1:
        raise DataError(f"{where} is an animated image ({image.n_frames} frames); extract the frame to train on, "
                        "or give the data as video (not trained yet).")
    buffer = io.BytesIO()
    image.save(buffer, format="PNG")
    return ImageRef(data=buffer.getvalue())


def column_images(value: Any) -> list | None:
    """An ``images`` / ``image`` column as a list of images (one image alone, as LLaVA's ``image`` path, is a
    list of one); None when the record holds none (absent, or null as Arrow fills it)."""
    if value is None:
        return None
    return list(value) if isinstance(value, (list, tuple)) else [value]


def place_images(messages: list[Message], given: list | None, column: str, conversation: str, place: str,
                 folder: str | None) -> tuple[list[Message], tuple[ImageRef, ...]]:
    """The conversation with its images in canonical form, and their ``ImageRef`` in order.

    ``messages``: normalised (``anyfit.data.messages``), whose list contents keep their image parts as written;
    ``given``: the images of the record's ``column`` (``column_images``); ``conversation``: the conversation's
    column, to name a message in errors. Image parts take their payload, else the column's next image (TRL's
    placeholders); without image parts each ``<image>`` in the text takes the column's next image (LLaVA,
    LLaMA-Factory); without either the column's images go at the start of the first user message (TRL)."""
    given = given or []
    parts = [(j, m) for j, m in enumerate(messages) if isinstance(m.get("content"), list)]
    at = f"{place}: '{column}'"
    if parts:
        out, refs, filled = list(messages), [], 0
        for j, m in parts:
            where = f"{place}: message {j} of '{conversation}'"
            content = []
            for part in m["content"]:
                if part.get("type") == "text":
                    if IMAGE_TOKEN in part["text"]:
                        raise DataError(f"{where} has both image parts and {IMAGE_TOKEN} in its text; give each "
                                        f"image one place: an image part, or {IMAGE_TOKEN} with the '{column}' column.")
                    content.append(part)
                    continue
                payload = _payload(part, f"{where}: image part {len(refs)}")
                if payload is None:
                    if filled == len(given):
                        raise DataError(_count_error(place, "image parts without an image of their own",
                                                     _empty_parts(messages), given, column))
                    payload, filled = (given[filled], f"{at}[{filled}]", None), filled + 1
                value, named, key = payload
                refs.append(image_ref(value, named, folder, base64_only=key == "base64"))
                content.append({"type": "image"})
            out[j] = {**m, "content": content}
        if filled < len(given):
            raise DataError(_count_error(place, "image parts without an image of their own",
                                         _empty_parts(messages), given, column))
        _refuse_system_images(out, place, conversation)
        return out, tuple(refs)
    count = sum(m["content"].count(IMAGE_TOKEN) for m in messages if isinstance(m.get("content"), str))
    if not given and not count:
        return messages, ()
    if count and count != len(given):
        raise DataError(_count_error(place, f"{IMAGE_TOKEN} placeholders", count, given, column))
    refs = tuple(image_ref(v, f"{at}[{k}]", folder) for k, v in enumerate(given))
    if count:
        out = [{**m, "content": _split(m["content"])} if IMAGE_TOKEN in (m.get("content") or "") else m
               for m in messages]
    else:  # TRL's rule: every image before the text of the first user message
        first = next((j for j, m in enumerate(messages) if m["role"] == "user"), None)
        if first is None:
            raise DataError(f"{place} has {len(given)} image(s) in '{column}' but no user message to put them in and "
                            f"no {IMAGE_TOKEN} in its text; mark each image's place with {IMAGE_TOKEN}.")
        out = list(messages)
        text = out[first]["content"]
        out[first] = {**out[first], "content": [{"type": "image"}] * len(given) + (
            [{"type": "text", "text": text}] if text else [])}
    _refuse_system_images(out, place, conversation)
    return out, refs


def _payload(part: Mapping, where: str) -> tuple[Any, str, str] | None:
    """(the payload, where it is, its key) of an image part as written; None for a placeholder without one."""
    if part.get("type") == "image_url":  # OpenAI: {"image_url": {"url": ...}} or the URL alone
        value = part.get("image_url")
        value = value.get("url") if isinstance(value, Mapping) else value
        if not isinstance(value, str) or not value:
            raise DataError(f"{where} is OpenAI's image_url with no URL: {short(part)}; give {{\"image_url\": "
                            "{\"url\": ...}}.")
        return value, f"{where}: 'image_url'", "image_url"
    found = [k for k in PAYLOAD_KEYS if part.get(k) is not None]  # Arrow fills absent keys with None
    if len(found) > 1:
        raise DataError(f"{where} has several images ({', '.join(found)}); give one per part.")
    return (part[found[0]], f"{where}: {found[0]!r}", found[0]) if found else None


def _empty_parts(messages: list[Message]) -> int:
    return sum(1 for m in messages if isinstance(m.get("content"), list) for p in m["content"]
               if p.get("type") == "image" and not any(p.get(k) is not None for k in PAYLOAD_KEYS))


def _count_error(place: str, what: str, count: int, given: list, column: str) -> str:
    fix = ("remove the extra images" if len(given) > count else
           f"give one image per placeholder in '{column}'")
    return f"{place}: {count} {what} but {len(given)} image(s) in '{column}'; {fix}."


def _split(text: str) -> list[dict[str, str]]:
    """Text with ``<image>`` placeholders as parts. The one newline after a placeholder that opens the text goes:
    it is LLaVA's layout, not the author's text (llava/train/train.py ``preprocess_multimodal`` rewrites every
    turn with an image to ``'<image>\\n' + text``; chat templates write their own separator after an image part,
    llava-hf's ``'<image>\\n'``). LLaMA-Factory's plugins replace ``<image>`` in place and keep the newline; the
    chat template's own layout is what inference sees, so it is the one trained."""
    pieces = text.split(IMAGE_TOKEN)
    parts: list[dict[str, str]] = []
    leading = True
    for k, piece in enumerate(pieces):
        if k:
            if leading and piece.startswith("\n"):
                piece = piece[1:]
            parts.append({"type": "image"})
        leading = leading and not piece
        if piece:
            parts.append({"type": "text", "text": piece})
    return parts


def _refuse_system_images(messages: list[Message], place: str, conversation: str) -> None:
    for j, m in enumerate(messages):
        if m["role"] == "system" and isinstance(m["content"], list) and any(
                p.get("type") == "image" for p in m["content"]):
            raise DataError(f"{place}: message {j} of '{conversation}' is a system message with an image; chat "
                            "templates differ on those (Gemma-3's keeps only the system's first text part, "
                            "Llama-3.2-Vision's reads text only), so it is not trained: move the image to the first "
                            "user message.")


# ---------------------------------------------------------------------------------------------- loading


def load_image(ref: ImageRef, where: str) -> PIL.Image.Image:
    """The image decoded whole, EXIF orientation applied, in RGB (``where`` names it in errors: ``Record 3
    (data.jsonl:5): image 2 (/abs/cat.png)``).

    Not ``transformers.image_utils.load_image``: it decodes lazily (a truncated file would fail later, in the
    collator), takes the first frame of an animation in silence, clips 16-bit and float pixels to 8 bits, drops
    an alpha channel onto black where the image processors composite it onto white, and fetches a URL on every
    call. Its steps are kept: ``PIL.ImageOps.exif_transpose``, then RGB as the processors make it
    (``rgb_as_processors_make_it``: transparency onto white at transformers 5.21+; CMYK, L, 1, P by PIL's convert)."""
    from PIL import ImageOps

    image = opened = _open(ref, where)
    try:
        frames = getattr(image, "n_frames", 1)
        if frames > 1:
            raise DataError(f"{where} is animated ({frames} frames); extract the frame to train on (e.g. "
                            "PIL's Image.seek(0) and save), or give it as a video (anyfit does not train video yet).")
        if image.mode.startswith(("I", "F")):
            raise DataError(f"{where} has {_MODES.get(image.mode[:1], image.mode)} pixels (PIL mode {image.mode}), "
                            "which image processors clip to 8 bits; convert it to 8-bit RGB or grayscale (e.g. "
                            "scaled to 0..255) and save it again.")
        try:
            image.load()
            image = ImageOps.exif_transpose(image)
        except (OSError, SyntaxError, ValueError) as e:  # PIL's truncated or corrupt data
            raise _corrupt(where, e) from None
        if image.mode == "RGB" and "transparency" not in image.info:
            opened = None if image is opened else opened  # the image returned stays open
            return image
        try:
            return rgb_as_processors_make_it(image)
        except (ValueError, OSError) as e:
            raise DataError(f"{where} has PIL mode {image.mode}, which cannot be made RGB ({e}); save it as RGB "
                            "(PNG or JPEG).") from None
    finally:
        if opened is not None:
            opened.close()  # the file handle; the pixels are loaded


_MODES = {"I": "32-bit or 16-bit integer", "F": "32-bit float"}


def rgb_as_processors_make_it(image: PIL.Image.Image) -> PIL.Image.Image:
    """``image`` in RGB exactly as the installed transformers' image processors make it (``convert_to_rgb``: since
    5.21 transparency is composited onto white; before, PIL's own ``convert`` drops it)."""
    from PIL import Image
    from transformers.image_transforms import convert_to_rgb

    if "return_numpy" in inspect.signature(convert_to_rgb).parameters:
        return Image.fromarray(convert_to_rgb(image, return_numpy=True))
    return convert_to_rgb(image)


def image_size(ref: ImageRef, where: str) -> tuple[int, int]:
    """(width, height) as ``load_image`` gives the image, read from the file's header only: EXIF orientations
    that rotate by 90 or 270 degrees swap them."""
    with _open(ref, where) as image:
        width, height = image.size
        try:
            orientation = image.getexif().get(0x0112, 1)  # ExifTags.Base.Orientation
        except (OSError, SyntaxError, ValueError):
            orientation = 1
    return (height, width) if orientation in (5, 6, 7, 8) else (width, height)


THUMBNAIL_PIXELS = 160  # the longer side of a thumbnail in the run's report


def thumbnail_uri(ref: ImageRef, where: str, longest: int = THUMBNAIL_PIXELS) -> str:
    """The image as ``load_image`` gives it, shrunk to at most ``longest`` pixels on its longer side, as a PNG data
    URI (what the run's report shows beside an example answer: tens of kilobytes, no file to keep)."""
    image = load_image(ref, where)
    image.thumbnail((longest, longest))
    buffer = io.BytesIO()
    image.save(buffer, format="PNG", optimize=True)
    return "data:image/png;base64," + base64.b64encode(buffer.getvalue()).decode("ascii")


def _open(ref: ImageRef, where: str) -> PIL.Image.Image:
    """The image opened (header read, pixels not decoded); missing or unreadable: one line."""
    from PIL import Image, UnidentifiedImageError

    try:
        source = ref.path if ref.path is not None else io.BytesIO(ref.read_bytes())
        return Image.open(source)
    except FileNotFoundError:
        raise DataError(f"{where}: the image file does not exist (any more); {_FIX_PATH}.") from None
    except UnidentifiedImageError:
        raise DataError(f"{where} is not an image PIL can read (not PNG, JPEG, WebP, GIF, BMP, TIFF, ...); "
                        "convert it, or fix the record.") from None
    except Image.DecompressionBombError as e:
        raise DataError(f"{where} is too large to decode ({e}); resize it.") from None
    except DataError as e:
        raise DataError(f"{where}: {e}") from None
    except OSError as e:
        if e.errno is not None:  # the file system's: permissions, a folder, ...
            raise DataError(f"{where}: cannot read the image ({e.strerror or e}).") from None
        raise _corrupt(where, e) from None


def _corrupt(where: str, error: Exception) -> DataError:
    return DataError(f"{where} cannot be decoded ({' '.join(str(error).split())}): the file is truncated or corrupt; "
                     "download or export it again.")

"""Records with images: every public shape read into the one canonical form (parts + Example.images), images
loaded and checked, and every bad input refused in one line naming the record, the image and the fix."""

from __future__ import annotations

import base64
import io
import json
import pickle
from pathlib import Path

import pytest
from PIL import Image

from anyfit.config import DataConfig
from anyfit.data import images as images_module
from anyfit.data.fingerprint import record_digests
from anyfit.data.formats import to_examples
from anyfit.data.images import ImageRef, image_size, load_image
from anyfit.data.records import DataError, Place
from anyfit.data.sources import load_records

PARTS = [{"type": "image"}, {"type": "text", "text": "What is it?"}]
CANONICAL = [{"role": "user", "content": PARTS}, {"role": "assistant", "content": "A red square."}]


def png(color=(255, 0, 0), size=(8, 6), mode="RGB", fmt="PNG", **save) -> bytes:
    buffer = io.BytesIO()
    Image.new(mode, size, color).save(buffer, format=fmt, **save)
    return buffer.getvalue()


@pytest.fixture
def folder(tmp_path):
    (tmp_path / "img").mkdir()
    (tmp_path / "img" / "cat.png").write_bytes(png())
    (tmp_path / "img" / "dog.png").write_bytes(png((0, 0, 255)))
    return tmp_path


def read(records, tmp_path, name="data.jsonl", cfg=None):
    path = tmp_path / name
    path.write_text("".join(json.dumps(r) + "\n" for r in records))
    return to_examples(load_records(DataConfig(path=str(path))), cfg or DataConfig())


def one(record, tmp_path, **kw):
    (ex,) = read([record], tmp_path, **kw)
    return ex


def pixels(ex):
    return [load_image(ref, "test").tobytes() for ref in ex.images]


def test_every_shape_gives_the_same_canonical_example(folder):
    cat = str(folder / "img" / "cat.png")
    data_url = "data:image/png;base64," + base64.b64encode(png()).decode()
    question, answer = "What is it?", "A red square."
    shapes = [
        # TRL: image parts + images column (a relative path, an absolute one)
        {"messages": [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": question}]},
                      {"role": "assistant", "content": answer}], "images": ["img/cat.png"]},
        {"messages": [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": question}]},
                      {"role": "assistant", "content": [{"type": "text", "text": answer}]}], "images": [cat]},
        # TRL: string contents + images column: the images open the first user message
        {"messages": [{"role": "user", "content": question}, {"role": "assistant", "content": answer}],
         "images": ["img/cat.png"]},
        # transformers' parts
        {"messages": [{"role": "user", "content": [{"type": "image", "image": "img/cat.png"},
                                                   {"type": "text", "text": question}]},
                      {"role": "assistant", "content": answer}]},
        {"messages": [{"role": "user", "content": [{"type": "image", "path": cat}, {"type": "text", "text": question}]},
                      {"role": "assistant", "content": answer}]},
        {"messages": [{"role": "user", "content": [{"type": "image", "url": data_url},
                                                   {"type": "text", "text": question}]},
                      {"role": "assistant", "content": answer}]},
        {"messages": [{"role": "user", "content": [{"type": "image", "base64": base64.b64encode(png()).decode()},
                                                   {"type": "text", "text": question}]},
                      {"role": "assistant", "content": answer}]},
        # OpenAI
        {"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": data_url}},
                                                   {"type": "text", "text": question}]},
                      {"role": "assistant", "content": answer}]},
        {"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": "file://" + cat},
                                                   {"type": "text", "text": question}]},
                      {"role": "assistant", "content": answer}]},
        # LLaVA (ShareGPT + image) and LLaMA-Factory (messages + images)
        {"id": "1", "image": "img/cat.png",
         "conversations": [{"from": "human", "value": f"<image>\n{question}"}, {"from": "gpt", "value": answer}]},
        {"conversations": [{"from": "human", "value": f"<image>{question}"}, {"from": "gpt", "value": answer}],
         "images": ["img/cat.png"]},
        {"messages": [{"role": "user", "content": f"<image>\n{question}"}, {"role": "assistant", "content": answer}],
         "images": ["img/cat.png"]},
    ]
    for k, record in enumerate(shapes):
        ex = one(record, folder)
        assert (ex.kind, ex.messages) == ("messages", CANONICAL), k
        assert len(ex.images) == 1 and pixels(ex) == [Image.new("RGB", (8, 6), (255, 0, 0)).tobytes()], k
    # a path is kept as a path: absolute, from the data file's folder
    assert one(shapes[0], folder).images == (ImageRef(path=cat),)


def test_prompt_completion_with_images(folder):
    conversational = {"prompt": [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": "What?"}]}],
                      "completion": [{"role": "assistant", "content": "Red."}], "images": ["img/cat.png"]}
    plain = {"prompt": "What?", "completion": "Red.", "images": ["img/cat.png"]}
    placeholder = {"prompt": "<image>\nWhat?", "completion": "Red.", "image": "img/cat.png"}
    for record in (conversational, plain, placeholder):
        ex = one(record, folder)
        assert ex.kind == "prompt_completion" and ex.completion == "Red."
        assert ex.prompt == [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": "What?"}]}]
        assert ex.images == (ImageRef(path=str(folder / "img" / "cat.png")),)
    # Alpaca (LLaMA-Factory): the input joins the instruction in the user's message
    ex = one({"instruction": "<image>Describe.", "input": "Briefly.", "output": "Red.", "images": ["img/cat.png"]},
             folder)
    assert ex.prompt == [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": "Describe.\nBriefly."}]}]
    assert ex.input is None


def test_several_images_in_any_turn_keep_their_order(folder):
    ex = one({"messages": [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "<image>\n<image>\nCompare them."},
        {"role": "assistant", "content": "Here: <image> is red."},
        {"role": "user", "content": "And this? <image>"},
        {"role": "assistant", "content": "Blue."}],
        "images": ["img/cat.png", "img/dog.png", "img/cat.png", "img/dog.png"]}, folder)
    assert ex.messages == [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": [{"type": "image"}, {"type": "image"}, {"type": "text", "text": "Compare them."}]},
        {"role": "assistant", "content": [{"type": "text", "text": "Here: "}, {"type": "image"},
                                          {"type": "text", "text": " is red."}]},
        {"role": "user", "content": [{"type": "text", "text": "And this? "}, {"type": "image"}]},
        {"role": "assistant", "content": "Blue."}]
    assert [Path(r.path).name for r in ex.images] == ["cat.png", "dog.png", "cat.png", "dog.png"]
    # parts with and without their own payload: the column fills the empty ones, in order
    ex = one({"messages": [{"role": "user", "content": [{"type": "image", "image": "img/dog.png"},
                                                       {"type": "image"}, {"type": "text", "text": "a"},
                                                       {"type": "text", "text": "b"}]},
                           {"role": "assistant", "content": "c"}], "images": ["img/cat.png"]}, folder)
    assert ex.messages[0]["content"] == [{"type": "image"}, {"type": "image"}, {"type": "text", "text": "ab"}]
    assert [Path(r.path).name for r in ex.images] == ["dog.png", "cat.png"]


def test_parquet_with_the_hub_image_feature(folder):
    from datasets import Dataset, Features, Sequence, Value
    from datasets import Image as ImageFeature

    message = {"role": Value("string"), "content": Value("string")}
    features = Features({"images": Sequence(ImageFeature()), "messages": [message]})
    rows = {"images": [[{"bytes": png(), "path": "cat.png"}], [str(folder / "img" / "dog.png")]],
            "messages": [[{"role": "user", "content": "<image>What is it?"},
                          {"role": "assistant", "content": "A red square."}]] * 2}
    path = folder / "vision.parquet"
    Dataset.from_dict(rows, features=features).to_parquet(str(path))
    records = load_records(DataConfig(path=str(path)))
    first, second = to_examples(records, DataConfig())
    assert first.messages == CANONICAL and first.images[0].data == png()
    assert first.images[0].describe() == f"embedded PNG bytes ({len(png()) / 1024:.1f} KiB)"
    assert second.messages == CANONICAL and pixels(second) == [Image.new("RGB", (8, 6), (0, 0, 255)).tobytes()]
    # embedded bytes are part of the record digest
    other = [dict(records[0], images=[{"bytes": png((0, 255, 0)), "path": "cat.png"}])]
    assert record_digests(records[:1], 1)[0] != record_digests(other, 1)[0]


def test_pil_images_as_datasets_decodes_them(folder):
    decoded = Image.open(io.BytesIO(png()))
    from_file = Image.open(folder / "img" / "cat.png")
    ex, = to_examples([{"messages": CANONICAL[:1] + CANONICAL[1:], "images": [decoded]}], DataConfig())
    assert ex.images[0].data is not None and pixels(ex) == [Image.new("RGB", (8, 6), (255, 0, 0)).tobytes()]
    ex, = to_examples([{"messages": [{"role": "user", "content": "What is it?"}, CANONICAL[1]],
                        "images": [from_file]}], DataConfig())
    assert ex.messages == CANONICAL and ex.images == (ImageRef(path=str(folder / "img" / "cat.png")),)


def test_text_only_records_are_read_as_before(folder):
    records = [{"messages": [{"role": "user", "content": "<image> is an HTML tag?"},
                             {"role": "assistant", "content": "No."}]},
               {"messages": [{"role": "user", "content": [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}]},
                             {"role": "assistant", "content": "c"}]},
               {"prompt": "q", "completion": "a", "images": None}]
    first, second, third = (one(record, folder) for record in records)
    assert first.messages[0]["content"] == "<image> is an HTML tag?" and first.images == ()
    assert second.messages[0]["content"] == "ab" and third.prompt == "q" and third.images == ()


def test_a_place_keeps_its_folder_through_pickling(folder):
    place = Place("data.jsonl:3", str(folder))
    again = pickle.loads(pickle.dumps(place))
    assert again == "data.jsonl:3" and again.folder == str(folder) and f"{again}" == "data.jsonl:3"


def test_urls_are_fetched_once_into_the_cache(folder, monkeypatch):
    calls = []
    monkeypatch.setattr(images_module, "_fetch", lambda url: calls.append(url) or png())
    ref = one({"messages": [{"role": "user", "content": [{"type": "image", "url": "https://example.com/cat.png"},
                                                         {"type": "text", "text": "What is it?"}]},
                            CANONICAL[1]]}, folder).images[0]
    assert ref == ImageRef(url="https://example.com/cat.png") and ref.describe() == "https://example.com/cat.png"
    assert ref.read_bytes(folder / "cache") == png() == ref.read_bytes(folder / "cache") and len(calls) == 1
    assert load_image(ref, "x").size == (8, 6)  # from anyfit's cache (ANYFIT_CACHE in tests)


def test_an_unreachable_url_says_to_download_the_images(monkeypatch, tmp_path):
    def offline(url):
        raise ConnectionError("network is unreachable")

    monkeypatch.setattr(images_module, "_fetch", offline)
    with pytest.raises(DataError) as e:
        load_image(ImageRef(url="https://example.com/x.png"), "Record 3 (data.jsonl:5): image 0")
    message = str(e.value)
    assert message.startswith("Record 3 (data.jsonl:5): image 0: https://example.com/x.png: could not fetch the image")
    assert "download the images and point the records at the files" in message and "\n" not in message


def _error(record, tmp_path, **kw) -> str:
    with pytest.raises(DataError) as e:
        read([record, record], tmp_path, **kw)
    message = str(e.value)
    assert "\n" not in message, message
    assert message.startswith(f"Record 0 ({tmp_path}/data.jsonl:1)"), message
    return message


USER = {"role": "user", "content": "What is it?"}
BOT = {"role": "assistant", "content": "Red."}


@pytest.mark.parametrize("record, expected", [
    ({"conversations": [{"from": "human", "value": "<image><image>What?"}, {"from": "gpt", "value": "Red."}],
      "images": ["img/cat.png"]}, "2 <image> placeholders but 1 image(s) in 'images'; give one image per placeholder"),
    ({"messages": [{"role": "user", "content": "<image>What?"}, BOT], "images": ["img/cat.png", "img/dog.png"]},
     "1 <image> placeholders but 2 image(s) in 'images'; remove the extra images"),
    ({"messages": [{"role": "user", "content": "<image>What?"}, BOT], "images": []},
     "1 <image> placeholders but 0 image(s) in 'images'"),
    ({"messages": [{"role": "assistant", "content": "Hello."}], "images": ["img/cat.png"]},
     "1 image(s) in 'images' but no user message to put them in"),
    ({"messages": [{"role": "user", "content": [{"type": "image", "image": "img/cat.png"}]}, BOT],
      "images": ["img/dog.png"]}, "0 image parts without an image of their own but 1 image(s) in 'images'"),
    ({"messages": [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": "What?"}]}, BOT]},
     "1 image parts without an image of their own but 0 image(s) in 'images'"),
    ({"messages": [{"role": "user", "content": [{"type": "image", "image": 42}]}, BOT]},
     "message 0 of 'messages': image part 0: 'image' must be an image: a file path, an http(s) URL, a base64"),
    ({"messages": [USER, BOT], "images": [{"width": 3}]}, "'images'[0] must be an image"),
    ({"messages": [{"role": "user", "content": [{"type": "image", "url": "data:image/png;base64,@@@"}]}, BOT]},
     "is not valid base64"),
    ({"messages": [{"role": "user", "content": [{"type": "image", "image": "a.png", "url": "b.png"}]}, BOT]},
     "has several images (image, url); give one per part"),
    ({"messages": [USER, BOT], "images": ["img/missing.png"]},
     "'images'[0]: image file 'img/missing.png' does not exist (looked for {folder}/img/missing.png: relative to the "
     "data file)"),
    ({"messages": [{"role": "user", "content": [{"type": "video", "video": "clip.mp4"}]}, BOT]},
     "holds a 'video' part: video records are not trained yet"),
    ({"messages": [USER, BOT], "videos": ["clip.mp4"]}, "has 'videos': video records are not trained yet"),
    ({"messages": [{"role": "user", "content": [{"type": "input_audio", "input_audio": {"data": "AA"}}]}, BOT]},
     "holds non-text parts"),
    ({"messages": [{"role": "system", "content": [{"type": "image"}]}, USER, BOT], "images": ["img/cat.png"]},
     "message 0 of 'messages' is a system message with an image"),
    ({"messages": [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": "<image>"}]}, BOT],
      "images": ["img/cat.png"]}, "has both image parts and <image> in its text"),
    ({"prompt": [USER], "completion": [{"role": "assistant", "content": [{"type": "image", "image": "img/cat.png"}]}]},
     "'completion' holds an image; a completion is text"),
    ({"messages": [USER, BOT], "images": ["img/cat.png"], "image": "img/dog.png"},
     "has images in both 'images' and 'image'"),
    ({"text": "<image> hi", "images": ["img/cat.png"]}, "has 'images', which holds content that format 'text'"),
])
def test_bad_image_records_are_refused_in_one_line(folder, record, expected):
    if "text" in record:
        with pytest.raises(DataError, match="format 'text'"):
            one(record, folder)
        return
    assert expected.format(folder=folder) in _error(record, folder)


def check_refused(ref: ImageRef, expected: str):
    with pytest.raises(DataError) as e:
        load_image(ref, "Record 3 (data.jsonl:5): image 2 (x)")
    message = str(e.value)
    assert message.startswith("Record 3 (data.jsonl:5): image 2 (x)") and expected in message and "\n" not in message


def test_images_that_cannot_be_trained_are_refused(tmp_path):
    whole = png(size=(64, 64), fmt="JPEG")
    (tmp_path / "truncated.jpg").write_bytes(whole[: len(whole) // 2])
    check_refused(ImageRef(path=str(tmp_path / "truncated.jpg")), "the file is truncated or corrupt")
    (tmp_path / "notes.png").write_text("not an image")
    check_refused(ImageRef(path=str(tmp_path / "notes.png")), "is not an image PIL can read")
    check_refused(ImageRef(path=str(tmp_path / "gone.png")), "the image file does not exist")
    frames = [Image.new("RGB", (8, 6), c) for c in ((255, 0, 0), (0, 255, 0))]
    buffer = io.BytesIO()
    frames[0].save(buffer, format="GIF", save_all=True, append_images=frames[1:])
    check_refused(ImageRef(data=buffer.getvalue()), "is animated (2 frames); extract the frame")
    check_refused(ImageRef(data=png(1000, mode="I;16")), "PIL mode I")  # I;16, or I where PIL reads it so
    check_refused(ImageRef(data=png(1000, mode="I", fmt="TIFF")), "convert it to 8-bit")
    whole = png(size=(64, 64))
    check_refused(ImageRef(data=whole[: len(whole) - 30]), "the file is truncated or corrupt")
    check_refused(ImageRef(data=png(0.5, mode="F", fmt="TIFF")), "32-bit float")
    assert image_size(ImageRef(data=png()), "x") == (8, 6)
    with pytest.raises(DataError, match="x: the image file does not exist"):
        image_size(ImageRef(path=str(tmp_path / "gone.png")), "x")


@pytest.mark.parametrize("mode, color, rgb", [
    ("RGBA", (255, 0, 0, 0), None),  # transparency as the installed transformers makes it (white since 5.21)
    ("RGBA", (255, 0, 0, 255), (255, 0, 0)),
    ("LA", (0, 0), None),
    ("L", 128, (128, 128, 128)),
    ("1", 1, (255, 255, 255)),
    ("P", 0, (0, 0, 0)),
    ("CMYK", (0, 255, 255, 0), (255, 0, 0)),  # converted as transformers converts it (PIL)
])
def test_modes_become_rgb_as_the_image_processors_make_them(mode, color, rgb):
    fmt = "JPEG" if mode == "CMYK" else "PNG"
    image = load_image(ImageRef(data=png(color, mode=mode, fmt=fmt)), "x")
    assert image.mode == "RGB" and image.size == (8, 6)
    if rgb is None:  # the installed transformers' own conversion of the same pixels
        import inspect

        import numpy as np
        from transformers.image_transforms import convert_to_rgb

        original = Image.open(io.BytesIO(png(color, mode=mode, fmt=fmt)))
        numpy = {"return_numpy": True} if "return_numpy" in inspect.signature(convert_to_rgb).parameters else {}
        rgb = tuple(int(v) for v in np.asarray(convert_to_rgb(original, **numpy))[0, 0])
    assert all(abs(a - b) <= 2 for a, b in zip(image.getpixel((0, 0)), rgb))


def test_exif_orientation_is_applied():
    exif = Image.Exif()
    exif[0x0112] = 6  # rotated 90 degrees
    data = png(fmt="JPEG", exif=exif.tobytes())
    assert load_image(ImageRef(data=data), "x").size == (6, 8)
    assert image_size(ImageRef(data=data), "x") == (6, 8)


def test_image_ref_holds_exactly_one_and_digests_its_bytes(folder):
    with pytest.raises(ValueError):
        ImageRef()
    with pytest.raises(ValueError):
        ImageRef(path="/a.png", url="https://x")
    path = ImageRef(path=str(folder / "img" / "cat.png"))
    assert path.digest() == ImageRef(data=png()).digest() != ImageRef(data=png((0, 0, 255))).digest()
    assert repr(ImageRef(data=png())) == f"ImageRef('embedded PNG bytes ({len(png()) / 1024:.1f} KiB)')"


def test_relative_paths_of_records_not_read_from_a_file_are_taken_from_the_current_directory(folder, monkeypatch):
    monkeypatch.chdir(folder / "img")
    ex, = to_examples([{"messages": [USER, BOT], "images": ["cat.png"]}], DataConfig())
    assert ex.images == (ImageRef(path=str(folder / "img" / "cat.png")),)
    with pytest.raises(DataError, match=r"image file 'img/cat.png' does not exist \(looked for .*/img/img/cat.png: "
                                        r"relative to the current directory\)"):
        to_examples([{"messages": [USER, BOT], "images": ["img/cat.png"]}], DataConfig())


def test_relative_paths_in_a_json_file_are_taken_from_its_folder(folder, monkeypatch):
    monkeypatch.chdir(folder / "img")
    (folder / "data.json").write_text(json.dumps([{"messages": [USER, BOT], "images": ["img/cat.png"]}]))
    ex, = to_examples(load_records(DataConfig(path=str(folder / "data.json"))), DataConfig())
    assert ex.images == (ImageRef(path=str(folder / "img" / "cat.png")),)

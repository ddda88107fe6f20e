"""Training on image records end to end: a JSON Lines file in TRL's shape (image parts in ``messages``, relative paths
in ``images``), tiny vision-language models with their real processors (``tests/vlm_fixtures``). The run reads the
images, trains the language model, keeps the vision tower bit for bit, saves the processor with the model, resumes
exactly, and the export reloads in transformers (``AutoModelForImageTextToText`` + ``AutoProcessor``) with the same
logits on an image prompt."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file
from tiny_runs import config_for
from vlm_fixtures import built_vlm, make_image, missing_for

from anyfit.export.folder import export
from anyfit.training.loop import train

ANSWERS = ("red", "green", "blue", "white")


def write_image_data(folder: Path, n: int = 8) -> Path:
    """``n`` records, each a question about one generated image (its file in ``images/``, named relative to the data
    file) and a one-word answer; every other record has a second image in a later turn."""
    (folder / "images").mkdir(parents=True, exist_ok=True)
    lines = []
    for i in range(n):
        make_image(48 + 8 * (i % 3), 40, seed=i).save(folder / "images" / f"{i}.png")
        messages = [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": "Which colour?"}]},
                    {"role": "assistant", "content": [{"type": "text", "text": ANSWERS[i % 4]}]}]
        images = [f"images/{i}.png"]
        if i % 2:
            make_image(40, 56, seed=100 + i).save(folder / "images" / f"{i}b.png")
            messages += [{"role": "user", "content": [{"type": "text", "text": "And this one?"}, {"type": "image"}]},
                         {"role": "assistant", "content": [{"type": "text", "text": ANSWERS[(i + 1) % 4]}]}]
            images.append(f"images/{i}b.png")
        lines.append(json.dumps({"messages": messages, "images": images}))
    path = folder / "data.jsonl"
    path.write_text("\n".join(lines) + "\n")
    return path


def _model(family: str) -> Path:
    if why := missing_for(family):
        pytest.skip(why)
    return built_vlm(family)


def _tensors(folder: Path) -> dict[str, torch.Tensor]:
    return {k: v for f in sorted(folder.glob("model*.safetensors")) for k, v in load_file(f).items()}


def _run(model: Path, data: Path, out: Path, *extra: str, echo=lambda *a: None):
    cfg = config_for(model, data, out, "data.template=chat", "train.max_steps=3", "train.effective_batch=4",
                     "train.micro_batch=2", "train.learning_rate=1e-2", *extra)
    return train(cfg, echo=echo)


@pytest.mark.slow
@pytest.mark.parametrize("family", ("qwen3_5", "gemma3"))
def test_a_run_on_image_records_trains_the_language_model_and_keeps_the_tower(family, tmp_path):
    model = _model(family)
    data = write_image_data(tmp_path / "data")
    lines: list[str] = []
    result = _run(model, data, tmp_path / "run", echo=lambda *a: lines.append(" ".join(map(str, a))))
    said = "\n".join(lines)
    assert "images" in said and "image tokens (never trained on)" in said, said
    if family == "gemma3":  # the tiny Gemma-3 sees 32x32: every image of the data is larger
        assert "12 images (12 shrunk by the processor to its size limit)" in said, said
    # Qwen3.5 packs with its linear attention run one example per row; Gemma-3 through transformers' own attention (its
    # image tokens attend to each other both ways, which anyfit_varlen's causal slices do not give); self-tested with
    # images
    assert "with images" in said and ("run one example per row" in said) is (family == "qwen3_5"), said
    out = tmp_path / "run"
    assert (out / "processor_config.json").is_file()  # the model's processor, saved with it
    before, after = _tensors(model), _tensors(out)
    assert sorted(before) == sorted(after)
    changed = {k for k in before if not torch.equal(before[k], after[k])}
    tower = [k for k in before if "vision" in k or "visual" in k]
    assert tower and not changed & set(tower), sorted(changed & set(tower))[:3]
    assert changed, "nothing trained"

    from PIL import Image
    from transformers import AutoModelForImageTextToText, AutoProcessor

    exported = export(out, tmp_path / "export", echo=lambda *a: None).out
    processor = AutoProcessor.from_pretrained(exported)
    reloaded = AutoModelForImageTextToText.from_pretrained(exported, dtype=torch.float32).eval()
    prompt = [{"role": "user", "content": [{"type": "image", "image": Image.open(data.parent / "images" / "0.png")},
                                           {"type": "text", "text": "Which colour?"}]}]
    inputs = processor.apply_chat_template(prompt, add_generation_prompt=True, tokenize=True, return_dict=True,
                                           return_tensors="pt")
    trained = result.model.eval()
    with torch.no_grad():
        torch.testing.assert_close(reloaded(**inputs).logits, trained(**inputs).logits, rtol=0, atol=1e-5)


@pytest.mark.slow
@pytest.mark.multirun
def test_a_resumed_image_run_ends_where_the_straight_run_ends(tmp_path):
    model = _model("qwen3_5")
    data = write_image_data(tmp_path / "data")
    _run(model, data, tmp_path / "straight", "train.max_steps=4", "train.save_every=2")
    _run(model, data, tmp_path / "resumed", "train.max_steps=4",
         f"train.resume={tmp_path / 'straight' / 'checkpoint-2'}")
    straight, resumed = _tensors(tmp_path / "straight"), _tensors(tmp_path / "resumed")
    assert all(torch.equal(straight[k], resumed[k]) for k in straight)


def test_image_records_for_a_text_only_model_are_refused_in_one_line(tiny_llama_dir, tmp_path):
    from anyfit.data.sources import DataError

    data = write_image_data(tmp_path / "data", n=4)
    with pytest.raises(DataError, match=r"Record 0 \(.*data.jsonl:1\) holds 1 image\(s\), but .* is a text-only "
                                        r"model .*vision-language checkpoint") as e:
        _run(tiny_llama_dir, data, tmp_path / "run")
    assert "\n" not in str(e.value)


def test_an_image_changed_since_the_store_was_built_is_refused(tmp_path):
    from anyfit.data.sources import DataError

    model = _model("gemma3")
    data = write_image_data(tmp_path / "data", n=4)
    _run(model, data, tmp_path / "first", "train.max_steps=1")
    make_image(48, 40, seed=99).save(tmp_path / "data" / "images" / "0.png")  # same size, other pixels
    with pytest.raises(DataError, match=r"images/0.png changed since the token store was built") as e:
        _run(model, data, tmp_path / "second", "train.max_steps=1")
    assert "\n" not in str(e.value)


def test_a_cut_through_an_image_drops_the_example_and_says_so(tmp_path):
    model = _model("gemma3")
    data = write_image_data(tmp_path / "data", n=8)
    lines: list[str] = []
    # Gemma-3's tiny processor gives 4 soft tokens an image: 12 tokens keep no whole image and its answer
    with pytest.raises(Exception, match="longer than data.max_length=12"):
        _run(model, data, tmp_path / "run", "data.max_length=12", echo=lambda *a: lines.append(" ".join(map(str, a))))


@pytest.mark.slow
@pytest.mark.multirun
@pytest.mark.parametrize("family", ("qwen2_5_vl", "qwen3_vl", "gemma3", "llava", "idefics3", "mistral3", "gemma4", "llama4"))
def test_packed_image_rows_train_as_padded_ones(family, tmp_path):
    """Packed rows (as the self-test chose: anyfit_varlen, transformers' own attention, the model's own M-RoPE
    positions) give the per-step losses of padded rows: the same examples, the same function. fp32: the tolerance is
    round-off of a few hundred products, grown over three updates at learning rate 1e-2."""
    model = _model(family)
    data = write_image_data(tmp_path / "data")
    losses = {}
    for packing in ("true", "false"):
        lines: list[str] = []
        _run(model, data, tmp_path / packing, f"train.packing={packing}", echo=lambda *a: lines.append(" ".join(map(str, a))))
        if packing == "true":
            assert "self-test passed" in "\n".join(lines), "\n".join(lines)
        losses[packing] = [json.loads(line)["loss"] for line in (tmp_path / packing / "metrics.jsonl").read_text().splitlines()
                           if "loss" in json.loads(line)]
    assert len(losses["true"]) == 3
    torch.testing.assert_close(torch.tensor(losses["true"]), torch.tensor(losses["false"]), rtol=1e-4, atol=1e-5)


@pytest.mark.multiprocess
def test_a_parallel_build_of_image_records_gives_the_same_store(tmp_path):
    """Image records tokenized over data.num_proc worker processes (each with the model's processor) give the store
    one process gives: ids, masks and the image records byte for byte."""
    from anyfit.config import load_config
    from anyfit.data.image_tokens import ImageTokens
    from anyfit.data.store import BATCH_RECORDS, open_or_build
    from anyfit.model.processor import load_processor
    from anyfit.model.tokenizer import load_tokenizer

    model = _model("gemma3")
    folder = tmp_path / "data"
    write_image_data(folder, n=4)
    lines = (folder / "data.jsonl").read_text().splitlines()
    (folder / "data.jsonl").write_text("\n".join(lines[i % 4] for i in range(BATCH_RECORDS + 40)) + "\n")
    stores = []
    for workers in (1, 2):
        cfg = load_config(None, [f"model.name_or_path={model}", f"data.path={folder / 'data.jsonl'}",
                                 f"data.cache_dir={tmp_path / str(workers)}", f"data.num_proc={workers}"])
        tokenizer = load_tokenizer(cfg.model)
        stores.append(open_or_build(cfg.data, tokenizer, echo=lambda *a: None,
                                    images=ImageTokens(*load_processor(cfg.model, tokenizer))))
    one, two = stores
    assert one.report.images == two.report.images > BATCH_RECORDS
    for name in ("input_ids", "loss_mask", "offsets", "vision", "vision_offsets", "example_images", "record_digest"):
        assert (one.folder / f"{name}.bin").read_bytes() == (two.folder / f"{name}.bin").read_bytes(), name

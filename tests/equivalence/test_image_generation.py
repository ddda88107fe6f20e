"""Generation on image records, exact against transformers: for tiny random-init vision-language models of real
families with their real processors (``tests/vlm_fixtures``), an image record's prompt ids are what
``processor.apply_chat_template(messages before the answer, add_generation_prompt=True, tokenize=True)`` gives;
batched, left-padded greedy generation (fp32) gives the tokens of one prompt at a time and of ``model.generate`` on
the processor's own output; ``anyfit eval`` grades held-out image questions end to end; a text-only model refuses
an image record in one line."""

from __future__ import annotations

import json

import pytest
import torch
from vlm_fixtures import FAMILIES, built_vlm, missing_for, write_image

from anyfit.cli import main
from anyfit.config import DataConfig, ModelConfig
from anyfit.data.formats import Example
from anyfit.data.image_tokens import ImageTokens
from anyfit.data.images import ImageRef
from anyfit.data.records import DataError
from anyfit.evaluation.evaluate import run_eval
from anyfit.evaluation.image_prompts import ImagePrompt, example_prompt
from anyfit.evaluation.inference import GenerationParams, TransformersBackend
from anyfit.model.processor import load_processor
from anyfit.model.tokenizer import load_tokenizer

DATA = DataConfig(path="unused")


def _setup(family: str):
    if why := missing_for(family):
        pytest.skip(why)
    cfg = ModelConfig(name_or_path=str(built_vlm(family)))
    tokenizer = load_tokenizer(cfg)
    return tokenizer, ImageTokens(*load_processor(cfg, tokenizer))


def _question(text: str, answer: str = "Two red squares.", images: int = 1) -> list[dict]:
    return [{"role": "user", "content": [*({"type": "image"} for _ in range(images)), {"type": "text", "text": text}]},
            {"role": "assistant", "content": answer}]


def _example(tmp_path, messages, sizes, index=0) -> Example:
    refs = tuple(ImageRef(path=str(write_image(tmp_path / f"image{index}_{k}.png", w, h, seed=index * 10 + k)))
                 for k, (w, h) in enumerate(sizes))
    return Example(kind="messages", index=index, messages=messages, images=refs)


def _reference(processor, messages, refs):
    """transformers' own inference input: the conversation before the answer with its decoded images."""
    from PIL import Image

    pictures = iter(Image.open(ref.path).convert("RGB") for ref in refs)
    conversation = [{**m, "content": [dict(p, image=next(pictures)) if p["type"] == "image" else p for p in m["content"]]
                     if isinstance(m["content"], list) else [{"type": "text", "text": m["content"]}]}
                    for m in messages]
    return processor.apply_chat_template(conversation, add_generation_prompt=True, tokenize=True, return_dict=True,
                                         return_tensors="pt")


@pytest.mark.parametrize("family", FAMILIES)
def test_prompt_ids_are_the_processors_inference_ids(family, tmp_path):
    tokenizer, images = _setup(family)
    # two turns, an image in each user turn: the prompt of the last answer holds both
    messages = [*_question("What is this?", "A square."), *_question("And this one?", "A circle.")]
    example = _example(tmp_path, messages, [(64, 48), (40, 70)])
    prompt = example_prompt(example, tokenizer, DATA, images)
    reference = _reference(images.processor, messages[:-1], example.images)
    assert isinstance(prompt, ImagePrompt) and prompt.images == example.images
    assert prompt.ids == reference["input_ids"][0].tolist()
    # vLLM's ids: the same text with one placeholder per image, which it expands itself
    assert tokenizer.decode(prompt.text_ids) == prompt.text and prompt.text.count(images.placeholder) == 2


@pytest.mark.parametrize("family", ["qwen3_5", "gemma3", "llava", "idefics3", "gemma4", "llama4"])
def test_batched_generation_equals_one_prompt_at_a_time_and_transformers_own(family, tmp_path):
    from transformers import AutoModelForImageTextToText

    tokenizer, images = _setup(family)
    model = AutoModelForImageTextToText.from_pretrained(built_vlm(family), dtype=torch.float32)
    questions = [("What is in the picture?", [(64, 48)]), ("Describe it in detail, please, at length.", [(40, 70)]),
                 ("Which one is larger?", [(32, 32), (64, 48)])]
    examples = [_example(tmp_path, _question(q, images=len(sizes)), sizes, index=k)
                for k, (q, sizes) in enumerate(questions)]
    prompts = [example_prompt(ex, tokenizer, DATA, images) for ex in examples]
    prompts.append(tokenizer("A text prompt beside them", add_special_tokens=False)["input_ids"])  # batched apart
    params = GenerationParams(max_new_tokens=6)
    together = TransformersBackend(model, tokenizer, batch_size=4, images=images).generate(prompts, params)
    alone = TransformersBackend(model, tokenizer, batch_size=1, images=images)
    assert together == [alone.generate([p], params)[0] for p in prompts]
    text_only = TransformersBackend(model, tokenizer, batch_size=4).generate(prompts[-1:], params)
    assert together[-1] == text_only[0]  # text prompts: the text path, unchanged

    # floating-point inputs in the model's dtype, as transformers' pipeline hands them (Llama-4's pixels are bf16)
    reference = _reference(images.processor, _question(*questions[0][:1])[:-1], examples[0].images).to(model.dtype)
    own = model.generate(**reference, max_new_tokens=6, do_sample=False, pad_token_id=tokenizer.pad_token_id,
                         eos_token_id=None)[0, reference["input_ids"].shape[1]:]
    first = alone.generate(prompts[:1], GenerationParams(max_new_tokens=6))[0]
    assert tokenizer.decode(own[:first.num_tokens], skip_special_tokens=True) == first.text


def test_a_text_only_model_refuses_an_image_record_in_one_line(tiny_llama_dir, tmp_path):
    cfg = ModelConfig(name_or_path=str(tiny_llama_dir))
    tokenizer = load_tokenizer(cfg)
    images = ImageTokens(*load_processor(cfg, tokenizer))
    example = _example(tmp_path, _question("What is this?"), [(64, 48)])
    with pytest.raises(DataError) as e:
        example_prompt(example, tokenizer, DATA, images)
    assert "\n" not in str(e.value) and "text-only" in str(e.value) and str(e.value).startswith("Record 0 holds 1 image(s)")
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(tiny_llama_dir)
    backend = TransformersBackend(model, tokenizer, batch_size=1, images=images)
    example = Example(kind="messages", index=0, messages=_question("What is this?", "#### 2"), images=example.images)
    with pytest.raises(DataError, match="text-only"):
        run_eval(backend, [example], DATA, GenerationParams(max_new_tokens=2))
    prompt = ImagePrompt("<image>", example.images, [1, 2, 3], [1], "Record 1")
    with pytest.raises(DataError, match="text-only"):
        backend.generate([prompt], GenerationParams(max_new_tokens=2))


def test_anyfit_eval_grades_held_out_image_questions(tmp_path):
    if why := missing_for("qwen3_5"):
        pytest.skip(why)
    data = tmp_path / "data"
    records = []
    for k in range(3):
        write_image(data / "images" / f"{k}.png", 64 - 8 * k, 48, seed=k)
        records.append({"prompt": [{"role": "user", "content": [{"type": "image", "path": f"images/{k}.png"},
                                                                 {"type": "text", "text": "How many squares?"}]}],
                        "answer": str(k + 1)})
    (data / "test.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))
    out = tmp_path / "eval"
    assert main(["eval", f"data.path={data / 'test.jsonl'}", "runtime.device=cpu", "--model",
                 str(built_vlm("qwen3_5")), "--max-new-tokens", "4", "--batch-size", "2", "--out", str(out)]) == 0
    summary = json.loads((out / "summary.json").read_text())
    rows = [json.loads(line) for line in (out / "predictions.jsonl").read_text().splitlines()]
    assert summary["n"] == 3 and summary["accuracy"] == sum(r["correct"] and r["how"] != "last_number" for r in rows) / 3
    assert [r["gold"] for r in rows] == ["1", "2", "3"]
    assert [r["images"] for r in rows] == [[str(data / "images" / f"{k}.png")] for k in range(3)]
    assert all(r["prompt"].count("<|image_pad|>") == 1 for r in rows)  # shown with its placeholder, not expanded


def test_anyfit_generate_takes_images_on_the_command_line(tmp_path, capsys):
    """``anyfit generate --image PATH --prompt TEXT``: the image before the prompt's text in one user message, as
    training lays it out; the same tokens as the backend given that record's prompt (greedy)."""
    from vlm_fixtures import make_image

    if why := missing_for("qwen3_5"):
        pytest.skip(why)
    folder = built_vlm("qwen3_5")
    make_image(64, 48).save(tmp_path / "cat.png")
    assert main(["generate", "--model", str(folder), "--prompt", "What is this?", "--image", str(tmp_path / "cat.png"),
                 "--max-new-tokens", "4", "--device", "cpu", "--jsonl"]) == 0
    out = [json.loads(line) for line in capsys.readouterr().out.splitlines() if line.startswith("{")]
    assert len(out) == 1 and out[0]["num_tokens"] == 4
    assert main(["generate", "--model", str(folder), "--prompt", "What?", "--image", str(tmp_path / "gone.png"),
                 "--device", "cpu"]) != 0
    assert "gone.png" in capsys.readouterr().err


def test_anyfit_plan_says_what_one_large_image_costs_of_the_sequence(tmp_path, capsys):
    """``anyfit plan`` on a vision-language model: the tokens a 4096x4096 image takes, measured with its processor
    (the count transformers' own apply_chat_template gives, with and without the image)."""
    from PIL import Image

    if why := missing_for("gemma3"):
        pytest.skip(why)
    folder = built_vlm("gemma3")
    config = tmp_path / "plan.yaml"
    config.write_text(f"model: {{name_or_path: {folder}}}\ndata: {{path: x.jsonl, max_length: 512}}\n")
    assert main(["plan", str(config), "--device", "t4"]) == 0
    line = next(line for line in capsys.readouterr().out.splitlines() if line.startswith("images:"))
    from transformers import AutoProcessor

    processor = AutoProcessor.from_pretrained(folder)
    text = {"type": "text", "text": "anyfit-probe"}
    with_image = processor.apply_chat_template([{"role": "user", "content": [
        {"type": "image", "image": Image.new("RGB", (4096, 4096))}, text]}], tokenize=True, return_dict=True)
    plain = processor.apply_chat_template([{"role": "user", "content": [text]}], tokenize=True, return_dict=True)
    assert f"takes {len(with_image['input_ids'][0]) - len(plain['input_ids'][0])} tokens through Gemma3Processor" in line

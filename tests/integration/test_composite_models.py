"""Composite (vision-language) checkpoints fine-tuned on text: the language model trains, everything else stays
bit-for-bit as it came, and the final model, its checkpoints and its export are the same architecture with every
tensor of the original, which transformers loads as it loaded the original. Tiny random-init models built from
transformers' own config classes (small vision and text parts) with Qwen2.5's tokenizer cut to its first 1,000
tokens (the full 151k vocabulary makes every save and load 5x slower)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file
from tiny_runs import config_for, cut_qwen_tokenizer, write_dataset
from transformers import AutoConfig, AutoModelForImageTextToText, AutoTokenizer
from vlm_fixtures import composite_parts

from anyfit.cli import main
from anyfit.config import ConfigError
from anyfit.export import ExportError
from anyfit.export.folder import export
from anyfit.training.loop import train

IDS = torch.tensor([[3, 17, 42, 256, 511, 7, 99, 300]])


def save_composite(out: Path, tokenizer_dir: Path, model_type: str) -> Path:
    """A 2-layer, 32-wide random-init ``*ForConditionalGeneration`` of ``model_type`` saved with ``save_pretrained``
    and the tokenizer, as a hub checkpoint of it is."""
    tok = AutoTokenizer.from_pretrained(tokenizer_dir)
    parts = composite_parts(model_type)
    text = dict(vocab_size=len(tok), hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
                num_key_value_heads=2, head_dim=8, max_position_embeddings=512, eos_token_id=tok.eos_token_id,
                pad_token_id=tok.pad_token_id, initializer_range=0.3, **parts.pop("text"))
    if model_type == "gemma4":
        text["vocab_size_per_layer_input"] = len(tok)
    config = AutoConfig.for_model(model_type, text_config=text, **parts)
    torch.manual_seed(0)
    model = AutoModelForImageTextToText.from_config(config)
    model.save_pretrained(out)
    tok.save_pretrained(out)
    return out


FAMILIES = ("qwen3_5", "qwen3_5_moe", "gemma3", "mistral3", "llama4", "gemma4")


@pytest.fixture(scope="module")
def composite(tmp_path_factory, qwen_tokenizer_dir):
    tokenizer = tmp_path_factory.mktemp("cut_tokenizer")
    cut_qwen_tokenizer(qwen_tokenizer_dir, tokenizer)
    made: dict[str, Path] = {}

    def get(model_type: str) -> Path:
        if model_type not in made:
            made[model_type] = save_composite(tmp_path_factory.mktemp(model_type), tokenizer, model_type)
        return made[model_type]

    return get


def tensors(folder: Path) -> dict[str, torch.Tensor]:
    found: dict[str, torch.Tensor] = {}
    for f in sorted(folder.glob("*.safetensors")):
        found.update(load_file(f))
    return found


def is_language(name: str) -> bool:
    """A tensor of the language model, by its name in the checkpoint (every family here names it so)."""
    return "language_model" in name or name == "lm_head.weight"


def architectures(folder: Path) -> list[str]:
    return json.loads((folder / "config.json").read_text())["architectures"]


def assert_whole(original: Path, saved: Path) -> set[str]:
    """``saved`` is ``original``'s architecture with the same tensor names, every one outside the language model
    bit-identical; returns the names of the tensors that changed (all of the language model)."""
    before, after = tensors(original), tensors(saved)
    assert architectures(saved) == architectures(original)
    assert sorted(after) == sorted(before)
    changed = {k for k in before if not torch.equal(before[k], after[k])}
    assert changed and all(is_language(k) for k in changed), sorted(changed)[:5]
    assert any(not is_language(k) for k in before)  # the vision part is there, and unchanged
    return changed


def logits_of(model) -> torch.Tensor:
    model.eval()
    with torch.no_grad():
        return model(input_ids=IDS).logits


def run(model_dir: Path, tmp_path: Path, *extra: str):
    data = write_dataset(tmp_path / "d.jsonl", n=8)
    cfg = config_for(model_dir, data, tmp_path / "run", "train.max_steps=2", "train.learning_rate=1e-2",
                     "train.effective_batch=4", "train.micro_batch=4", "train.save_every=1", *extra)
    return train(cfg, echo=lambda *a: None)


@pytest.mark.slow
@pytest.mark.parametrize("model_type", FAMILIES)
def test_a_full_fine_tune_keeps_the_composite_whole(model_type, composite, tmp_path):
    src = composite(model_type)
    result = run(src, tmp_path)
    out = tmp_path / "run"
    changed = assert_whole(src, out)
    language = [k for k in tensors(src) if is_language(k)]
    assert len(changed) >= len(language) // 2, f"only {len(changed)} of {len(language)} language tensors trained"
    assert_whole(src, out / "checkpoint-1")  # checkpoints are written the same way
    exported = export(out, tmp_path / "export", echo=lambda *a: None).out
    assert_whole(src, exported)
    reloaded = AutoModelForImageTextToText.from_pretrained(exported, dtype=torch.float32)
    assert type(reloaded).__name__ == architectures(src)[0]
    torch.testing.assert_close(logits_of(reloaded), logits_of(result.model), rtol=0, atol=1e-5)
    assert "AutoModelForImageTextToText.from_pretrained" in (exported / "README.md").read_text()  # the card's usage


@pytest.mark.parametrize("model_type", ("qwen3_5", "gemma3", "mistral3", "llama4", "gemma4"))
def test_lora_adapts_only_the_language_model_and_exports_whole(model_type, composite, tmp_path):
    src = composite(model_type)
    result = run(src, tmp_path, "lora.enabled=true", "lora.r=4", "lora.alpha=8")
    out = tmp_path / "run"
    adapter = load_file(out / "adapter_model.safetensors")
    assert adapter and all("language_model" in k for k in adapter), sorted(adapter)[:5]
    exported = export(out, tmp_path / "export", echo=lambda *a: None).out
    assert_whole(src, exported)
    reloaded = AutoModelForImageTextToText.from_pretrained(exported, dtype=torch.float32)
    assert type(reloaded).__name__ == architectures(src)[0]
    torch.testing.assert_close(logits_of(reloaded), logits_of(result.model), rtol=0, atol=1e-4)


def test_gguf_export_of_a_composite_is_refused_in_one_line(composite, tmp_path):
    src = composite("mistral3")
    with pytest.raises(ExportError, match=r"Mistral3ForConditionalGeneration.*convert_hf_to_gguf.*composite") as e:
        export(src, tmp_path / "export", gguf="q8_0", echo=lambda *a: None)
    assert "\n" not in str(e.value)


@pytest.mark.parametrize("model_type", ("mistral3", "gemma3", "gemma4"))
def test_plan_reads_the_text_config_and_counts_the_rest_as_frozen(model_type, composite, tmp_path, capsys):
    src = composite(model_type)
    assert main(["plan", f"model.name_or_path={src}", "data.path=d.jsonl", "lora.enabled=true", "--device", "l40s"]) == 0
    out = capsys.readouterr().out
    assert "hidden 32" in out and "frozen" in out, out[:600]
    assert "fc1" not in out  # LoRA targets are the language model's (the vision tower's fc1/fc2 are not)


def test_a_composite_that_cannot_be_trained_whole_is_refused(composite, tmp_path):
    src = composite("mistral3")
    config = json.loads((src / "config.json").read_text())
    config["architectures"] = ["Mistral3ForSomethingElse"]
    odd = tmp_path / "odd"
    odd.mkdir()
    for f in src.iterdir():
        (odd / f.name).write_bytes(f.read_bytes())
    (odd / "config.json").write_text(json.dumps(config))
    with pytest.raises(ConfigError, match="Mistral3ForSomethingElse.*neither as a causal LM"):
        run(odd, tmp_path)


@pytest.mark.parametrize("model_type", ("mistral3", "qwen3_5_moe"))
def test_a_checkpoint_of_a_composite_resumes_exactly(model_type, composite, tmp_path):
    """The checkpoint holds the weights under the checkpoint's names (legacy ``language_model.model.*``, one tensor per
    expert), not the loaded model's: resuming reads them back through transformers and continues bit-identically."""
    src = composite(model_type)
    run(src, tmp_path, "train.max_steps=3", "train.save_every=2")
    whole = tmp_path / "run"
    resumed = tmp_path / "resumed"
    run(src, tmp_path, "train.max_steps=3", f"train.output_dir={resumed}", f"train.resume={whole / 'checkpoint-2'}")
    before, after = tensors(whole), tensors(resumed)
    assert sorted(after) == sorted(before) and all(torch.equal(before[k], after[k]) for k in before)


@pytest.mark.parametrize("model_type", FAMILIES)
def test_the_plan_counts_every_part_the_model_holds(model_type, composite):
    # Weights in memory are the whole composite's: the language model planned, the rest (vision tower, projector)
    # counted as frozen, together the parameters of the class the checkpoint loads as.
    from transformers import AutoConfig

    from anyfit.model.composite import model_class
    from anyfit.model.shape import shape_from_config
    from anyfit.planning.memory import estimate_memory
    from anyfit.planning.setup import Setup

    config = AutoConfig.from_pretrained(composite(model_type))
    shape = shape_from_config(config)
    with torch.device("meta"):
        built = model_class(config).from_config(config)
    assert shape.outside_params > 0
    assert shape.params + shape.outside_params == sum(p.numel() for p in built.parameters())
    setup = Setup(method="full", device="cpu", precision="fp32", weight_bytes=4, micro_batch=1, seq_len=16)
    assert estimate_memory(shape, setup).weights == (shape.params + shape.outside_params) * 4

"""Tensors of the source checkpoint the model class does not load (Qwen3.5's multi-token prediction ``mtp.*``) are
carried bit for bit into every checkpoint, the resumed run's checkpoints, the final model and the export, or dropped
when asked; the run says which in one line. A tiny random-init Qwen3.5 (text) whose checkpoint ships two MTP tensors
in a shard of their own, as the real ones do."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from families import tiny_model
from safetensors import safe_open
from safetensors.torch import save_file
from tiny_runs import config_for, write_dataset
from transformers import AutoModelForCausalLM, AutoTokenizer

from anyfit.config import ModelConfig
from anyfit.export.folder import export
from anyfit.model.source import ModelSource
from anyfit.training.loop import train

MTP = {"mtp.fc.weight": torch.randn(32, 64, generator=torch.Generator().manual_seed(1)).to(torch.bfloat16),
       "mtp.layers.0.mlp.up_proj.weight": torch.randn(64, 32, generator=torch.Generator().manual_seed(2))}
LINE = "tensors the model does not load"


@pytest.fixture(scope="module")
def qwen35_with_mtp(tmp_path_factory, qwen_small_tokenizer_dir) -> Path:
    """The model's weights in shard 1, the MTP tensors in shard 2, both listed in the index."""
    out = tmp_path_factory.mktemp("qwen35_mtp")
    tok = AutoTokenizer.from_pretrained(qwen_small_tokenizer_dir)
    tiny_model("qwen3_5", vocab_size=len(tok), pad_token_id=tok.pad_token_id, eos_token_id=tok.eos_token_id,
               bos_token_id=None).save_pretrained(out)
    tok.save_pretrained(out)
    (out / "model.safetensors").rename(out / "model-00001-of-00002.safetensors")
    save_file(MTP, out / "model-00002-of-00002.safetensors", metadata={"format": "pt"})
    with safe_open(out / "model-00001-of-00002.safetensors", framework="pt") as f:
        weight_map = dict.fromkeys(f.keys(), "model-00001-of-00002.safetensors")
    weight_map.update(dict.fromkeys(MTP, "model-00002-of-00002.safetensors"))
    (out / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))
    return out


def held(folder: Path) -> dict[str, torch.Tensor]:
    """The tensors of ``folder``'s safetensors that its index lists (the one file, without an index)."""
    index = folder / "model.safetensors.index.json"
    files = (set(json.loads(index.read_text())["weight_map"].values()) if index.is_file() else {"model.safetensors"})
    tensors = {}
    for name in files:
        with safe_open(folder / name, framework="pt") as f:
            tensors.update({key: f.get_tensor(key) for key in f.keys()})  # noqa: SIM118 (safe_open is not iterable)
    return tensors


def assert_kept(folder: Path) -> None:
    tensors = held(folder)
    for name, original in MTP.items():
        assert tensors[name].dtype == original.dtype, (folder, name)
        assert torch.equal(tensors[name].view(torch.uint8), original.view(torch.uint8)), (folder, name)


def test_kept_in_checkpoints_resume_final_model_and_export(qwen35_with_mtp, tmp_path):
    data = write_dataset(tmp_path / "d.jsonl", n=8)
    out = tmp_path / "run"
    common = ("train.effective_batch=2", "train.micro_batch=2", "train.save_every=2", "train.keep_last=5")
    lines: list[str] = []
    train(config_for(qwen35_with_mtp, data, out, *common, "train.max_steps=3"), echo=lines.append)
    said = [line for line in lines if LINE in line]
    assert len(said) == 1 and said[0].startswith("[anyfit] kept 2 tensors") and "mtp.*" in said[0], said
    assert_kept(out / "checkpoint-2")
    assert_kept(out)
    AutoModelForCausalLM.from_pretrained(out)  # the saved folder still loads

    lines.clear()  # resumed from checkpoint-2 to step 5: checkpoint-4 and the final model are written again
    train(config_for(qwen35_with_mtp, data, out, *common, "train.max_steps=5", "train.resume=auto"),
          echo=lines.append)
    assert sum(LINE in line for line in lines) == 1
    assert_kept(out / "checkpoint-4")
    assert_kept(out)

    exported = export(out, tmp_path / "export", echo=lines.append)
    assert_kept(exported.out)
    assert any(line.startswith("[anyfit] export: kept 2 tensors") for line in lines)
    AutoModelForCausalLM.from_pretrained(exported.out)

    lines.clear()  # resumed again, dropping them: the final model written over the last one holds none, nor an index
    train(config_for(qwen35_with_mtp, data, out, *common, "train.max_steps=6", "train.resume=auto",
                     "model.keep_unloaded_tensors=false"), echo=lines.append)
    assert sum(line.startswith("[anyfit] dropped 2 tensors") for line in lines) == 1
    assert not set(MTP) & set(held(out)) and not (out / "model.safetensors.index.json").exists()
    ModelSource.from_config(ModelConfig(name_or_path=str(out))).check_weights()


def test_dropped_when_asked(qwen35_with_mtp, tmp_path):
    out = tmp_path / "run"
    lines: list[str] = []
    train(config_for(qwen35_with_mtp, write_dataset(tmp_path / "d.jsonl", n=4), out, "train.effective_batch=2",
                     "train.micro_batch=2", "train.max_steps=1", "model.keep_unloaded_tensors=false"),
          echo=lines.append)
    said = [line for line in lines if LINE in line]
    assert len(said) == 1 and said[0].startswith("[anyfit] dropped 2 tensors") and "mtp.*" in said[0], said
    assert not set(MTP) & set(held(out))
    assert not set(MTP) & set(held(export(out, tmp_path / "export", echo=lines.append).out))


def test_lora_export_keeps_the_base_tensors(qwen35_with_mtp, tmp_path):
    """The adapter is saved alone (no line, no copy); the merged export carries the base's MTP tensors."""
    out = tmp_path / "run"
    lines: list[str] = []
    train(config_for(qwen35_with_mtp, write_dataset(tmp_path / "d.jsonl", n=4), out, "lora.enabled=true",
                     "train.effective_batch=2", "train.micro_batch=2", "train.max_steps=1"), echo=lines.append)
    assert not any(LINE in line for line in lines)
    assert not set(MTP) & set(held_adapter(out))
    assert_kept(export(out, tmp_path / "export", echo=lines.append).out)


def held_adapter(folder: Path) -> set[str]:
    with safe_open(folder / "adapter_model.safetensors", framework="pt") as f:
        return set(f.keys())

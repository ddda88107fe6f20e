"""Checkpoints: the manifest, what counts as intact, resuming past damaged ones, loading damaged files,
and the base model an adapter records."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file

from anyfit.backends.replicated import Replicated
from anyfit.config import ConfigError, ModelConfig, load_config
from anyfit.model.source import BASE_RECORD, portable_base, record_base
from anyfit.training.checkpoints.checkpoint import (
    TrainState,
    load_checkpoint,
    prune,
    rng_state,
    save_checkpoint,
    save_model,
)
from anyfit.training.checkpoints.integrity import MANIFEST, checkpoint_problem, complete_checkpoints, resolve_resume, write_manifest


REPLICATED = Replicated("one process")


class OneProcess:
    """The parts of an accelerate.Accelerator that checkpointing uses, for a single process."""

    is_main_process = True
    process_index = 0
    num_processes = 1
    scaler = None

    def get_state_dict(self, model):
        return model.state_dict()

    def unwrap_model(self, model):
        return model

    def wait_for_everyone(self):
        pass


def fake_checkpoint(out: Path, step: int, manifest: bool = True, weights: dict | None = None) -> Path:
    """A checkpoint folder with the files anyfit writes (small ones), and its manifest unless told not to."""
    d = out / f"checkpoint-{step}"
    d.mkdir(parents=True)
    save_file(weights or {"w": torch.arange(4096, dtype=torch.float32)}, d / "model.safetensors")
    torch.save({"state": {0: {"exp_avg": torch.ones(2048)}}, "param_groups": []}, d / "optimizer.pt")
    torch.save({"last_epoch": step}, d / "scheduler.pt")
    torch.save({"python": step}, d / "rng_state_0.pt")
    (d / "config.yaml").write_text("model: {name_or_path: x}\n")
    (d / "trainer_state.json").write_text(json.dumps({"step": step, "epoch": 0}))
    if manifest:
        write_manifest(d)
    return d


def truncate(path: Path) -> None:
    data = path.read_bytes()
    path.write_bytes(data[: len(data) // 2])


def zero(path: Path) -> None:
    path.write_bytes(bytes(path.stat().st_size))


def test_the_manifest_lists_every_file_with_size_and_hash(tmp_path):
    ck = fake_checkpoint(tmp_path, 2)
    manifest = json.loads((ck / MANIFEST).read_text())
    assert manifest["hash"] == "sha256"
    assert set(manifest["files"]) == {p.name for p in ck.iterdir()} - {MANIFEST}
    assert manifest["files"]["model.safetensors"]["size"] == (ck / "model.safetensors").stat().st_size
    assert checkpoint_problem(ck, full=True) is None and checkpoint_problem(ck, full=False) is None


@pytest.mark.parametrize("damage, full_says, sizes_say", [
    (lambda ck: truncate(ck / "model.safetensors"), "model.safetensors has", "model.safetensors has"),
    (lambda ck: zero(ck / "optimizer.pt"), "optimizer.pt does not match its sha256", None),  # same size
    (lambda ck: (ck / "scheduler.pt").unlink(), "scheduler.pt is missing", "scheduler.pt is missing"),
    (lambda ck: (ck / MANIFEST).write_text((ck / MANIFEST).read_text()[:40] + "\x00garbage"),
     "manifest.json is damaged", "manifest.json is damaged"),
    (lambda ck: (ck / MANIFEST).write_text('{"format": 1, "hash": "sha256", "files": {}}'),
     "does not list trainer_state.json", "does not list"),
    (lambda ck: (ck / MANIFEST).write_text('{"format": 1, "hash": "sha256", "files": {"../x": {}}}'),
     "manifest.json is damaged", "manifest.json is damaged"),
], ids=["truncated", "zeroed", "deleted", "garbage-manifest", "empty-manifest", "escaping-manifest"])
def test_damage_is_found_and_named(tmp_path, damage, full_says, sizes_say):
    ck = fake_checkpoint(tmp_path, 4)
    damage(ck)
    assert full_says in checkpoint_problem(ck, full=True)
    problem = checkpoint_problem(ck, full=False)
    assert problem is None if sizes_say is None else sizes_say in problem


def test_a_sharded_checkpoint_keeps_weights_and_optimizer_under_sharded(tmp_path):
    """torch.distributed.checkpoint files (every process's shards) replace *.safetensors and optimizer.pt."""
    ck = fake_checkpoint(tmp_path, 2, manifest=False)
    (ck / "model.safetensors").unlink()
    (ck / "optimizer.pt").unlink()
    (ck / "sharded").mkdir()
    (ck / "sharded" / ".metadata").write_bytes(b"metadata")
    (ck / "sharded" / "__0_0.distcp").write_bytes(b"shard" * 100)
    write_manifest(ck)
    assert {"sharded/.metadata", "sharded/__0_0.distcp"} <= set(json.loads((ck / MANIFEST).read_text())["files"])
    assert checkpoint_problem(ck) is None
    truncate(ck / "sharded" / "__0_0.distcp")
    assert "sharded/__0_0.distcp has 250 bytes" in checkpoint_problem(ck)


def test_resume_auto_skips_a_damaged_newest_checkpoint_with_one_warning(tmp_path):
    good = fake_checkpoint(tmp_path, 2)
    truncate(fake_checkpoint(tmp_path, 4) / "model.safetensors")
    zero(fake_checkpoint(tmp_path, 6) / "optimizer.pt")
    (tmp_path / "checkpoint-8").mkdir()  # a folder the save never finished (e.g. copied in by hand)
    warnings = []
    assert resolve_resume("auto", tmp_path, warn=warnings.append) == good
    assert len(warnings) == 3 and all("\n" not in w for w in warnings)
    assert "checkpoint-8" in warnings[0] and "incomplete" in warnings[0]
    assert "checkpoint-6" in warnings[1] and "optimizer.pt" in warnings[1]
    assert "checkpoint-4" in warnings[2] and "model.safetensors" in warnings[2] and "truncated" in warnings[2]
    # listing checks sizes only: the zeroed optimizer state keeps its size
    assert complete_checkpoints(tmp_path) == [good, tmp_path / "checkpoint-6"]
    assert complete_checkpoints(tmp_path, full=True) == [good]


def test_resume_auto_without_checkpoints_is_a_fresh_start_but_all_damaged_is_an_error(tmp_path):
    assert resolve_resume("auto", tmp_path / "nothing") is None
    assert resolve_resume("auto", tmp_path) is None
    truncate(fake_checkpoint(tmp_path, 2) / "optimizer.pt")
    with pytest.raises(ConfigError, match="no intact checkpoint") as e:
        resolve_resume("auto", tmp_path, warn=lambda line: None)
    assert "checkpoint-2: optimizer.pt has" in str(e.value) and "\n" not in str(e.value)


def test_resume_from_a_damaged_path_is_one_line_naming_the_file(tmp_path):
    ck = fake_checkpoint(tmp_path, 2)
    zero(ck / "model.safetensors")
    with pytest.raises(ConfigError) as e:
        resolve_resume(str(ck), tmp_path)
    msg = str(e.value)
    assert "\n" not in msg and str(ck) in msg and "model.safetensors" in msg and "train.resume=auto" in msg
    with pytest.raises(ConfigError, match="not a complete checkpoint"):
        resolve_resume(str(tmp_path / "checkpoint-9"), tmp_path)
    assert resolve_resume(str(fake_checkpoint(tmp_path, 4)), tmp_path) == tmp_path / "checkpoint-4"


def test_checkpoints_from_before_manifests_are_checked_by_their_structure(tmp_path):
    """No manifest but trainer_state.json: accepted when each file's own format accounts for its length."""
    old = fake_checkpoint(tmp_path, 2, manifest=False)
    assert checkpoint_problem(old) is None and resolve_resume("auto", tmp_path) == old
    damages = {"model.safetensors": (truncate, "truncated"), "optimizer.pt": (truncate, "not a readable archive"),
               "scheduler.pt": (zero, "not a readable archive"), "rng_state_0.pt": (zero, "not a readable")}
    for name, (damage, says) in damages.items():
        ck = fake_checkpoint(tmp_path / name, 2, manifest=False)
        damage(ck / name)
        assert name in checkpoint_problem(ck) and says in checkpoint_problem(ck), name
    ck = fake_checkpoint(tmp_path / "zeroed", 2, manifest=False)
    zero(ck / "model.safetensors")
    assert "no valid header" in checkpoint_problem(ck)


def test_prune_keeps_the_newest_intact_checkpoints(tmp_path):
    for step in (2, 4, 6, 8):
        fake_checkpoint(tmp_path, step)
    truncate(tmp_path / "checkpoint-8" / "model.safetensors")
    prune(tmp_path, keep_last=2)
    # 4 and 6 are the newest intact ones; the damaged 8 is left for resume=auto to report
    assert sorted(p.name for p in tmp_path.iterdir()) == ["checkpoint-4", "checkpoint-6", "checkpoint-8"]


def _linear_checkpoint(tmp_path):
    model = torch.nn.Linear(4, 3)
    opt = torch.optim.AdamW(model.parameters())
    model(torch.ones(2, 4)).sum().backward()
    opt.step()
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1.0)
    ck = fake_checkpoint(tmp_path, 2, weights={k: v.detach().clone() for k, v in model.state_dict().items()})
    torch.save(opt.state_dict(), ck / "optimizer.pt")
    torch.save(sched.state_dict(), ck / "scheduler.pt")
    torch.save(rng_state(), ck / "rng_state_0.pt")
    return ck, model, opt, sched


@pytest.mark.parametrize("name, damage", [("model.safetensors", truncate), ("model.safetensors", zero),
                                          ("optimizer.pt", truncate), ("optimizer.pt", zero),
                                          ("scheduler.pt", lambda p: p.write_bytes(b"garbage")),
                                          ("rng_state_0.pt", truncate), ("trainer_state.json", truncate)])
def test_loading_a_damaged_file_is_a_config_error_naming_it(tmp_path, name, damage):
    ck, model, opt, sched = _linear_checkpoint(tmp_path)
    state = TrainState(model=model, optimizer=opt, scheduler=sched)
    assert load_checkpoint(REPLICATED, OneProcess(), ck, state)["step"] == 2  # intact: loads
    damage(ck / name)
    with pytest.raises(ConfigError) as e:
        load_checkpoint(REPLICATED, OneProcess(), ck, state)
    assert str(ck / name) in str(e.value) and "\n" not in str(e.value)


def _tiny_lora(model_dir):
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    torch.manual_seed(0)
    model = get_peft_model(AutoModelForCausalLM.from_pretrained(model_dir),
                           LoraConfig(r=4, target_modules=["q_proj", "v_proj"], init_lora_weights=False))
    return model.eval()


def test_save_checkpoint_writes_the_manifest_last(tiny_llama_dir, tmp_path):
    model = _tiny_lora(tiny_llama_dir)
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad])
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1.0)
    cfg = load_config(None, [f"model.name_or_path={tiny_llama_dir}", "train.keep_last=2"])
    ck = save_checkpoint(REPLICATED, OneProcess(), tmp_path, 3, TrainState(model=model, optimizer=opt, scheduler=sched),
                         cfg=cfg, trainer_state={"epoch": 0})
    assert ck == tmp_path / "checkpoint-3" and not list(tmp_path.glob(".tmp-*"))
    files = json.loads((ck / MANIFEST).read_text())["files"]
    assert set(files) == {p.name for p in ck.iterdir()} - {MANIFEST}
    assert {"adapter_model.safetensors", "adapter_config.json", "trainer_state.json", "optimizer.pt"} <= set(files)
    assert checkpoint_problem(ck) is None and resolve_resume("auto", tmp_path) == ck


def test_an_adapter_from_a_relative_local_folder_loads_with_auto_peft(tiny_llama_dir, tmp_path, monkeypatch):
    """PEFT records the path as given; a relative one breaks as soon as the working directory changes."""
    from peft import AutoPeftModelForCausalLM

    monkeypatch.chdir(tiny_llama_dir.parent)
    model = _tiny_lora(tiny_llama_dir.name)  # as training reads it: the path as given
    assert model.peft_config["default"].base_model_name_or_path == tiny_llama_dir.name
    cfg = ModelConfig(name_or_path=tiny_llama_dir.name)
    out = tmp_path / "out"
    save_model(REPLICATED, OneProcess(), model, None, out, cfg)
    recorded = json.loads((out / "adapter_config.json").read_text())["base_model_name_or_path"]
    assert recorded == str(tiny_llama_dir.resolve()) and not (out / BASE_RECORD).exists()

    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    loaded = AutoPeftModelForCausalLM.from_pretrained(out).eval()
    ids = torch.tensor([[1, 2, 3, 4]])
    with torch.no_grad():
        torch.testing.assert_close(loaded(ids).logits, model(ids).logits)


def test_a_hub_base_is_recorded_as_the_hub_id_with_its_revision(tmp_path):
    base = portable_base(ModelConfig(name_or_path="Qwen/Qwen2.5-0.5B", revision="v1"))
    assert base == {"base_model_name_or_path": "Qwen/Qwen2.5-0.5B", "revision": "v1", "source": "hub"}


def test_a_whole_models_generation_config_stops_at_the_end_of_turn(tiny_qwen2_dir, qwen_base_tokenizer_dir,
                                                                   tmp_path):
    """A base model stopping at <|endoftext|> only, fine-tuned on a template whose turns end with <|im_end|>: the
    folder the run writes stops at both (a checkpoint's and the final model's)."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(qwen_base_tokenizer_dir)
    endoftext, im_end = tok.convert_tokens_to_ids(["<|endoftext|>", "<|im_end|>"])
    model = AutoModelForCausalLM.from_pretrained(tiny_qwen2_dir)
    model.config.eos_token_id = model.generation_config.eos_token_id = endoftext  # as Qwen2.5's base ships
    out = tmp_path / "out"
    assert save_model(REPLICATED, OneProcess(), model, tok, out) == ["<|endoftext|>", "<|im_end|>"]
    assert json.loads((out / "generation_config.json").read_text())["eos_token_id"] == [endoftext, im_end]


@pytest.fixture
def fake_gguf(tmp_path, tiny_llama_dir, monkeypatch):
    """A stand-in .gguf file whose 'dequantized' weights are the tiny Llama's (as in test_gguf_cache)."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    path = tmp_path / "models" / "Tiny-Q4.gguf"
    path.parent.mkdir()
    path.write_bytes(b"GGUF fake weights")
    real_model, real_tok = AutoModelForCausalLM.from_pretrained, AutoTokenizer.from_pretrained
    monkeypatch.setattr(AutoModelForCausalLM, "from_pretrained",
                        lambda folder, gguf_file=None, **kw: real_model(tiny_llama_dir, **kw))
    monkeypatch.setattr(AutoTokenizer, "from_pretrained",
                        lambda folder, gguf_file=None, **kw: real_tok(tiny_llama_dir, **kw))
    monkeypatch.setenv("ANYFIT_CACHE", str(tmp_path / "cache"))
    return path


@pytest.mark.slow
def test_a_gguf_base_is_recorded_as_a_loadable_folder_and_where_it_came_from(fake_gguf, tiny_llama_dir, tmp_path,
                                                                           monkeypatch):
    # (the real SmolLM2 GGUF is converted and recorded by the quickstart in CI's notebook run, .ci/wheel_notebook.sh:
    # 20 s of the suite's time for the same path)
    model = _tiny_lora(tiny_llama_dir)
    out = tmp_path / "out"
    save_model(REPLICATED, OneProcess(), model, None, out, ModelConfig(name_or_path=str(fake_gguf)))
    folder = tmp_path / "cache" / "Tiny-Q4"
    assert json.loads((out / "adapter_config.json").read_text())["base_model_name_or_path"] == str(folder)
    record = json.loads((out / BASE_RECORD).read_text())
    assert record["source"] == "gguf" and record["base_model_name_or_path"] == str(folder)
    assert record["gguf"] == {"file": str(fake_gguf), "name": "Tiny-Q4.gguf", "size": fake_gguf.stat().st_size}
    assert "materialize_gguf" in record["note"]
    # The same record for the file named as folder + gguf_file, and for training on the converted folder
    # itself (the quickstart does that): the base is that folder, the origin is the GGUF file.
    assert portable_base(ModelConfig(name_or_path=str(fake_gguf.parent), gguf_file=fake_gguf.name)) == record
    assert portable_base(ModelConfig(name_or_path=str(folder))) == record

    monkeypatch.undo()  # real loaders: the recorded folder is a plain HF model that AutoPeft loads
    from peft import AutoPeftModelForCausalLM

    loaded = AutoPeftModelForCausalLM.from_pretrained(out).eval()
    ids = torch.tensor([[5, 6, 7]])
    with torch.no_grad():
        torch.testing.assert_close(loaded(ids).logits, model(ids).logits)


def test_a_gguf_base_that_cannot_be_converted_records_the_file(fake_gguf, tmp_path, capsys):
    (tmp_path / "cache" / "Tiny-Q4").mkdir(parents=True)  # taken by something that is not anyfit's
    out = tmp_path / "out"
    out.mkdir()
    (out / "adapter_config.json").write_text(json.dumps({"base_model_name_or_path": str(fake_gguf.parent)}))
    base = record_base(out, ModelConfig(name_or_path=str(fake_gguf)))
    assert base["base_model_name_or_path"] == str(fake_gguf) and base["gguf"]["name"] == "Tiny-Q4.gguf"
    assert json.loads((out / "adapter_config.json").read_text())["base_model_name_or_path"] == str(fake_gguf)
    assert "could not convert" in capsys.readouterr().err

"""Resuming on another layout: what a run's config cannot continue is refused in one line before any weights
load, and a position-keyed optimizer state becomes the name-keyed one PyTorch moves between layouts. (The
layout transitions themselves run with real processes in tests/equivalence/test_sharded.py.)"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from anyfit.config import ConfigError, load_config
from anyfit.backends.fsdp import FSDP2
from anyfit.backends.replicated import Replicated, optimizer_by_name
from anyfit.backends.zero3 import ZeRO3
from anyfit.training.checkpoints import start


def _checkpoint(tmp_path: Path, *overrides: str) -> Path:
    folder = tmp_path / "checkpoint-4"
    folder.mkdir()
    (folder / "config.yaml").write_text(load_config(None, ["model.name_or_path=m", "data.path=d.jsonl",
                                                           *overrides]).to_yaml())
    return folder



def check_resumable(folder: Path, cfg, processes: int) -> list:
    """The run's check with the backend its runtime.sharding names (built directly: no DeepSpeed needed)."""
    backend = {"deepspeed": lambda: ZeRO3("test", False, {}), "fsdp": lambda: FSDP2("test")}.get(
        cfg.runtime.sharding, lambda: Replicated("test"))()
    return start.check_resumable(folder, cfg, backend, processes)


def _cfg(*overrides: str):
    return load_config(None, ["model.name_or_path=m", "data.path=d.jsonl", *overrides])


@pytest.mark.parametrize("saved, now, key", [
    (("lora.enabled=true",), (), "lora.enabled=true"),
    ((), ("lora.enabled=true",), "lora.enabled=false"),
    (("lora.enabled=true", "lora.r=8"), ("lora.enabled=true",), "lora.r=8"),
    (("lora.enabled=true", "lora.target_modules=[q_proj]"), ("lora.enabled=true",), "lora.target_modules="),
    (("train.optimizer=adafactor",), (), "train.optimizer=adafactor"),
], ids=["lora-into-full", "full-into-lora", "rank", "targets", "optimizer"])
def test_what_cannot_be_continued_is_one_line_naming_the_setting(saved, now, key, tmp_path):
    with pytest.raises(ConfigError) as e:
        check_resumable(_checkpoint(tmp_path, *saved), _cfg(*now), 1)
    message = str(e.value)
    assert "\n" not in message and "checkpoint-4" in message and key in message


def test_layout_settings_may_change(tmp_path):
    folder = _checkpoint(tmp_path, "lora.enabled=true", "runtime.sharding=fsdp", "runtime.device=cpu")
    check_resumable(folder, _cfg("lora.enabled=true", "runtime.sharding=none", "train.micro_batch=1"), 1)
    (folder / "config.yaml").unlink()  # an older checkpoint: its files are checked when they load
    check_resumable(folder, _cfg(), 1)


def _deepspeed_checkpoint(tmp_path: Path, processes: int) -> Path:
    folder = _checkpoint(tmp_path, "runtime.sharding=deepspeed", "train.micro_batch=1")
    state = folder / "deepspeed" / "state"
    state.mkdir(parents=True)
    for rank in range(processes):  # the file names DeepSpeed ZeRO-3 writes, one per process
        (state / f"zero_pp_rank_{rank}_mp_rank_00_model_states.pt").write_bytes(b"")
    return folder


@pytest.mark.parametrize("sharding, processes, key", [
    ("none", 2, "runtime.sharding=deepspeed"), ("fsdp", 2, "runtime.sharding=deepspeed"),
    ("deepspeed", 4, "Launch 2"),
], ids=["zero3-into-ddp", "zero3-into-fsdp", "zero3-on-4-of-2"])
def test_a_deepspeed_checkpoint_continues_under_zero3_on_as_many_processes(sharding, processes, key, tmp_path):
    folder = _deepspeed_checkpoint(tmp_path, 2)
    with pytest.raises(ConfigError) as e:
        check_resumable(folder, _cfg(f"runtime.sharding={sharding}", "train.micro_batch=1"), processes)
    assert "\n" not in str(e.value) and key in str(e.value)
    check_resumable(folder, _cfg("runtime.sharding=deepspeed", "train.micro_batch=1"), 2)


@pytest.mark.parametrize("sharded", [False, True], ids=["replicated", "fsdp"])
def test_zero3_continues_only_its_own_checkpoints(sharded, tmp_path):
    folder = _checkpoint(tmp_path)
    if sharded:
        (folder / "sharded").mkdir()
    with pytest.raises(ConfigError, match="runtime.sharding=fsdp or none"):
        check_resumable(folder, _cfg("runtime.sharding=deepspeed", "train.micro_batch=1"), 2)


def test_a_position_keyed_optimizer_state_is_keyed_by_name(tmp_path):
    model = torch.nn.Sequential(torch.nn.Linear(3, 2), torch.nn.LayerNorm(2))
    decay = [model[0].weight]
    rest = [model[0].bias, model[1].weight, model[1].bias]
    optimizer = torch.optim.AdamW([{"params": decay}, {"params": rest, "weight_decay": 0.0}])
    model(torch.ones(1, 3)).sum().backward()
    optimizer.step()
    named = optimizer_by_name(model, optimizer, optimizer.state_dict(), tmp_path)
    assert [g["params"] for g in named["param_groups"]] == [["0.weight"], ["0.bias", "1.weight", "1.bias"]]
    assert torch.equal(named["state"]["1.bias"]["exp_avg"], optimizer.state[model[1].bias]["exp_avg"])
    assert named["param_groups"][1]["weight_decay"] == 0.0
    other = torch.optim.AdamW(model.parameters())  # one group where the checkpoint had two
    with pytest.raises(ConfigError, match="parameter groups"):
        optimizer_by_name(model, other, optimizer.state_dict(), tmp_path)


def test_every_setting_has_one_resume_rule():
    """A setting added to the config without saying what a resume does when it changes would be refused by default;
    this names it instead."""
    from anyfit.training.checkpoints.changes import RULES, unruled

    assert unruled() == []
    assert not set(RULES) - {f"{s}.{k}" for s, keys in _cfg().to_dict().items() for k in keys}  # no stale rule


def test_applied_changes_are_returned_with_what_is_done(tmp_path):
    folder = _checkpoint(tmp_path)
    changes = check_resumable(folder, _cfg("train.learning_rate=1e-3", "train.save_every=5", "data.num_proc=2"), 1)
    assert {c.key for c in changes} == {"train.learning_rate", "train.save_every", "data.num_proc"}
    assert all(c.rule.verdict == "applied" for c in changes)


def test_a_moved_model_continues_a_full_fine_tune_but_not_an_adapter(tmp_path):
    """A full fine-tune's weights all come from the checkpoint; an adapter's base is read from the place."""
    (tmp_path / "full").mkdir()
    (tmp_path / "lora").mkdir()
    full = _checkpoint(tmp_path / "full")
    (change,) = check_resumable(full, _cfg("model.name_or_path=/elsewhere/m"), 1)
    assert change.key == "model.name_or_path" and change.rule.verdict == "applied"
    lora = _checkpoint(tmp_path / "lora", "lora.enabled=true")
    with pytest.raises(ConfigError, match="the adapter was trained on the base weights at that place"):
        check_resumable(lora, _cfg("lora.enabled=true", "model.name_or_path=/elsewhere/m"), 1)

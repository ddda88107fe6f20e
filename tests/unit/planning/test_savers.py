"""The table of memory savers (anyfit.planning.savers) agrees with what it points at: every key is a config key that
setup_for reads into the Setup field the row names, every text lists every row, every model hook is a row's, the
estimate terms are the memory and time model's functions, and README.md's ladder section is the table's."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest

from anyfit.config import all_keys, load_config
from anyfit.model.savers import MODEL_HOOKS
from anyfit.planning import memory, time
from anyfit.planning.savers import (
    BY_NAME,
    METHODS,
    SAVERS,
    SHOWN,
    Option,
    config_overrides,
    ladder_markdown,
)
from anyfit.planning.setup import Setup, setup_for

REPO = Path(__file__).resolve().parents[3]
# A value each key may take other than its default (with what it needs to take effect).
CHANGED = {
    "runtime.sequence_parallel": {"runtime.sequence_parallel": 2},
    "train.optimizer": {"train.optimizer": "adafactor"},
    "runtime.sharding": {"runtime.sharding": "fsdp"},
    "runtime.fsdp_offload": {"runtime.sharding": "fsdp", "runtime.fsdp_offload": True},
    "runtime.fsdp_reduce_every_micro_batch": {"runtime.sharding": "fsdp",
                                              "runtime.fsdp_reduce_every_micro_batch": True},
    "model.checkpoint_every": {"model.gradient_checkpointing": True, "model.checkpoint_every": 2},
}


def test_every_key_is_a_config_key_and_every_field_a_setup_field():
    keys, fields = set(all_keys()), {f.name for f in dataclasses.fields(Setup)}
    for saver in SAVERS:
        assert set(saver.keys) <= keys, saver.name
        assert set(saver.fields) <= fields, saver.name
        for rung in saver.rungs:
            assert rung.setting.split(":")[0] in keys, rung
    assert all(setting.split(":")[0] in keys for _, setting, _ in METHODS.values())


@pytest.mark.parametrize("saver", SAVERS, ids=lambda s: s.name)
def test_setup_for_reads_each_key_into_the_rows_fields(saver):
    cfg = load_config(None, ["model.name_or_path=x", "train.effective_batch=8"])
    plain = setup_for(cfg, method="full", device="cuda", precision="bf16", micro_batch=1, processes=2)
    for key in saver.keys:
        changed = setup_for(cfg, method="full", device="cuda", precision="bf16", micro_batch=1, processes=2,
                            overrides=CHANGED.get(key, {key: True}))
        moved = {f for f in saver.fields if getattr(changed, f) != getattr(plain, f)}
        assert moved, f"{key}: none of {saver.fields} changed"


def test_every_text_names_every_row_once():
    assert sorted(SHOWN) == sorted(BY_NAME)


def test_the_model_hooks_are_the_rows_hooks():
    assert {saver.hook for saver in SAVERS if saver.hook} == set(MODEL_HOOKS)
    assert all(saver.hook in saver.keys for saver in SAVERS if saver.hook)


def test_the_estimate_terms_are_the_models_functions():
    for saver in SAVERS:
        assert saver.memory and all(callable(getattr(memory, name, None)) for name in saver.memory), saver.name
        assert saver.time and all(callable(getattr(time, name, None)) for name in saver.time), saver.name


def test_the_config_keys_a_plan_prints_select_its_setup():
    """config_overrides is the table's settings: loading them back gives the same Setup."""
    cfg = load_config(None, ["model.name_or_path=x", "train.effective_batch=8"])
    chosen = {"model.gradient_checkpointing": True, "model.checkpoint_every": 2, "model.tiled_mlp": True,
              "train.fused_loss": True, "train.optimizer": "adamw_8bit", "runtime.sharding": "fsdp",
              "runtime.fsdp_reduce_every_micro_batch": True, "model.activation_offload": True}
    s = setup_for(cfg, method="full", device="cuda", precision="bf16", micro_batch=1, processes=4, overrides=chosen)
    printed = config_overrides(s)
    again = load_config(None, ["model.name_or_path=x", "train.effective_batch=8", *printed])
    assert setup_for(again, method="full", device="cuda", precision="bf16", micro_batch=1, processes=4) == s


def test_an_option_is_its_overrides():
    a = Option.of("full", 2, {"train.optimizer": "adamw", "train.fused_loss": False})
    b = Option.of("full", 2, {"train.fused_loss": False, "train.optimizer": "adamw"})
    assert a == b and hash(a) == hash(b) and a["train.optimizer"] == "adamw"
    assert a.with_({"train.fused_loss": True}) != a and a.with_({"train.fused_loss": True})["train.fused_loss"]


def test_readme_ladder_is_the_table():
    readme = (REPO / "README.md").read_text()
    section = readme.split("<!-- saver-ladder:start -->\n", 1)[1].split("<!-- saver-ladder:end -->", 1)[0]
    assert section == ladder_markdown(), "run: uv run python scripts/update_readme.py"

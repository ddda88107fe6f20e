"""The DeepSpeed config anyfit's settings amount to: anyfit's window is the boundary, its clip is the engine's,
ZeRO-3 with offload when asked. (The engine itself runs with real processes in tests/equivalence/test_deepspeed.py.)"""

from __future__ import annotations

import pytest

from anyfit.config import load_config
from anyfit.backends.zero3 import deepspeed_missing, deepspeed_refusal, engine_config


def _cfg(*items: str):
    return load_config(None, ["model.name_or_path=unused", "runtime.sharding=deepspeed", *items])


def test_the_window_and_the_clip_are_anyfits():
    config = engine_config(_cfg("train.max_grad_norm=0.5"), micro_batch=2, accumulation=4, processes=8,
                           precision="bf16", offload=False, pin_memory=True)
    assert config["managed_gradient_accumulation"] is False  # step() ends the window, however many micro-batches
    assert config["gradient_clipping"] == 0.5
    assert config["train_batch_size"] == 2 * 4 * 8
    assert config["zero_optimization"]["stage"] == 3 and "offload_param" not in config["zero_optimization"]
    assert config["bf16"]["enabled"] is True
    assert engine_config(_cfg("train.max_grad_norm=0"), 1, 1, 1, "fp32", False, False)["gradient_clipping"] == 0.0


def test_offload_moves_parameters_and_optimizer_states_to_host_ram():
    zero = engine_config(_cfg(), 1, 1, 1, "bf16", offload=True, pin_memory=True)["zero_optimization"]
    assert zero["offload_param"] == {"device": "cpu", "pin_memory": True}
    assert zero["offload_optimizer"] == {"device": "cpu", "pin_memory": True}


def test_without_deepspeed_installed_the_refusal_names_the_extra(monkeypatch):
    import importlib.util

    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "deepspeed" else real(name, *a))
    refusal = deepspeed_missing()
    assert "anyfit[deepspeed]" in refusal and "\n" not in refusal


def test_a_runnable_config_is_not_refused():
    assert deepspeed_refusal(_cfg("train.micro_batch=1"), "cpu", micro_batch_auto=False) == ""
    pytest.importorskip("deepspeed")
    assert deepspeed_missing() == ""

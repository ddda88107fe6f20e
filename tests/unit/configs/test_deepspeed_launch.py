"""A launch through a DeepSpeed ``accelerate config`` file (``ACCELERATE_USE_DEEPSPEED`` in the environment that
``accelerate launch`` prepares): refused in one line before any work, naming the setting that runs DeepSpeed
through anyfit's own loop (``runtime.sharding=deepspeed``); and ``runtime.sharding=auto`` never adds FSDP2 beside
it. (ZeRO-3 itself runs in tests/equivalence/test_deepspeed.py.)"""

from __future__ import annotations

import pytest

from anyfit.config import ConfigError, RuntimeConfig
from anyfit.hardware.runtime import deepspeed_launch_refusal, make_accelerator, resolve_runtime

# what accelerate launch --config_file (a DeepSpeed one) puts in the environment
LAUNCH = {"ACCELERATE_USE_DEEPSPEED": "true", "ACCELERATE_DEEPSPEED_ZERO_STAGE": "3",
          "ACCELERATE_DEEPSPEED_OFFLOAD_PARAM_DEVICE": "cpu"}


def test_the_refusal_is_one_line_naming_runtime_sharding_deepspeed():
    refusal = deepspeed_launch_refusal(LAUNCH)
    assert refusal and "\n" not in refusal
    assert "runtime.sharding=deepspeed" in refusal and "runtime.deepspeed_offload=true" in refusal
    assert deepspeed_launch_refusal({}) == "" and deepspeed_launch_refusal({"ACCELERATE_USE_DEEPSPEED": "false"}) == ""


def test_training_stops_before_any_work(monkeypatch):
    for key, value in LAUNCH.items():
        monkeypatch.setenv(key, value)
    with pytest.raises(ConfigError, match="runtime.sharding=deepspeed"):
        make_accelerator(resolve_runtime(RuntimeConfig(device="cpu")))


def test_auto_does_not_shard_beside_a_deepspeed_launch(monkeypatch, tiny_llama_dir):
    from transformers import AutoConfig

    from anyfit.config import load_config
    from anyfit.model.shape import shape_from_config
    from anyfit.planning.recommend import recommend_sharding
    from anyfit.planning.presets import custom_target

    cfg = load_config(None, [f"model.name_or_path={tiny_llama_dir}", "data.path=d.jsonl", "train.effective_batch=8"])
    shape = shape_from_config(AutoConfig.from_pretrained(tiny_llama_dir))
    tiny_gpu = custom_target("cuda", 0.05, gpus=2)  # far too small: auto would shard with FSDP2
    monkeypatch.delenv("ACCELERATE_USE_DEEPSPEED", raising=False)
    assert recommend_sharding(cfg, shape, tiny_gpu, 2)[0] is True
    monkeypatch.setenv("ACCELERATE_USE_DEEPSPEED", "true")
    use, why = recommend_sharding(cfg, shape, tiny_gpu, 2)
    assert use is False and "DeepSpeed" in why

"""The shipped accelerate/deepspeed_zero3 config (src/anyfit/configs/accelerate/deepspeed_zero3.yaml): the `accelerate config` file that keeps DeepSpeed ZeRO-3 reachable.

Checked with accelerate's own code, without DeepSpeed installed (nothing here imports it): the file loads with
accelerate's config loader, names DeepSpeed with ZeRO stage 3, bf16 and no offload, every deepspeed_config key is
one `accelerate launch` reads (it silently ignores unknown ones), and the launch environment it produces asks
for ZeRO-3 - which also turns anyfit's own sharding off under runtime.sharding=auto. Not checked: that
DeepSpeed is installed, or that anyfit's training loop runs under it.
"""

from __future__ import annotations

import pytest
from accelerate.commands.config.config_args import ClusterConfig, load_config_from_file
from accelerate.utils import DistributedType

from anyfit.configs import find

CONFIG = find("accelerate/deepspeed_zero3")


def test_loads_with_accelerates_loader_and_names_zero_stage_3():
    cfg = load_config_from_file(str(CONFIG))
    assert isinstance(cfg, ClusterConfig)
    assert cfg.distributed_type == DistributedType.DEEPSPEED
    assert cfg.deepspeed_config["zero_stage"] == 3
    assert cfg.mixed_precision == "bf16"
    assert cfg.deepspeed_config["offload_optimizer_device"] == "none"
    assert cfg.deepspeed_config["offload_param_device"] == "none"
    assert ClusterConfig.from_yaml_file(str(CONFIG)).deepspeed_config == cfg.deepspeed_config


def test_every_deepspeed_key_is_an_accelerate_launch_option():
    from accelerate.commands.launch import launch_command_parser

    options = {action.dest for action in launch_command_parser()._actions}
    assert set(load_config_from_file(str(CONFIG)).deepspeed_config) <= options


def test_the_launch_environment_asks_for_zero_3_and_training_refuses_it(monkeypatch, tiny_llama_dir):
    from accelerate.commands.launch import _validate_launch_command, launch_command_parser
    from accelerate.utils.launch import prepare_deepspeed_cmd_env
    from transformers import AutoConfig

    from anyfit.config import load_config
    from anyfit.model.shape import shape_from_config
    from anyfit.planning.ladder import recommend_sharding
    from anyfit.planning.presets import custom_target

    args = launch_command_parser().parse_args(
        ["--config_file", str(CONFIG), "--num_processes", "2", "--main_process_port", "0", "-m", "anyfit", "train",
         "run.yaml"])
    args, defaults, _ = _validate_launch_command(args)
    assert args.use_deepspeed and args.zero_stage == 3
    args.deepspeed_fields_from_accelerate_config = ",".join(defaults.deepspeed_config)
    _, env = prepare_deepspeed_cmd_env(args)
    assert env["ACCELERATE_USE_DEEPSPEED"] == "true" and env["ACCELERATE_DEEPSPEED_ZERO_STAGE"] == "3"
    assert env["ACCELERATE_DEEPSPEED_OFFLOAD_PARAM_DEVICE"] == "none"
    assert env["ACCELERATE_MIXED_PRECISION"] == "bf16"

    cfg = load_config(None, [f"model.name_or_path={tiny_llama_dir}", "data.path=d.jsonl", "train.effective_batch=8"])
    shape = shape_from_config(AutoConfig.from_pretrained(tiny_llama_dir))
    tiny_gpu = custom_target("cuda", 0.05, gpus=2)  # far too small: auto would shard with FSDP2
    monkeypatch.delenv("ACCELERATE_USE_DEEPSPEED", raising=False)
    assert recommend_sharding(cfg, shape, tiny_gpu, 2)[0] is True
    monkeypatch.setenv("ACCELERATE_USE_DEEPSPEED", env["ACCELERATE_USE_DEEPSPEED"])
    use, why = recommend_sharding(cfg, shape, tiny_gpu, 2)
    assert use is False and "DeepSpeed" in why
    # and training refuses the launch in one line before any work: the loop does not drive DeepSpeed's engine
    from anyfit.hardware.runtime import deepspeed_launch_refusal

    refusal = deepspeed_launch_refusal(env)
    assert refusal and "\n" not in refusal and "runtime.sharding=fsdp" in refusal
    assert deepspeed_launch_refusal({}) == ""


@pytest.mark.parametrize("key", ["zero3_init_flag", "zero3_save_16bit_model"])
def test_zero3_loads_partitioned_and_saves_a_whole_model(key):
    assert load_config_from_file(str(CONFIG)).deepspeed_config[key] is True

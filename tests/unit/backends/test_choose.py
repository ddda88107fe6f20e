"""When a run shards, and the combinations it refuses before loading anything (each with what to do)."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from anyfit.backends import choose_backend
from anyfit.config import ConfigError, load_config



def decide_sharding(cfg, device: str, precision: str, processes: int) -> tuple[bool, bool, str]:
    """(shard, offload, the reason printed) of the backend the run chooses."""
    backend = choose_backend(cfg, SimpleNamespace(device=device, precision=precision, pin_memory=False), processes)
    return backend.sharded, backend.offload, backend.reason


def _cfg(*items: str):
    return load_config(None, ["model.name_or_path=unused", *items])


def test_asked_for_or_not():
    assert decide_sharding(_cfg("runtime.sharding=fsdp"), "cuda", "bf16", 8)[:2] == (True, False)
    assert decide_sharding(_cfg("runtime.sharding=fsdp", "runtime.fsdp_offload=true"), "cuda", "bf16", 8)[:2] == \
        (True, True)
    shard, offload, why = decide_sharding(_cfg("runtime.sharding=fsdp", "runtime.fsdp_offload=true"), "cpu", "fp32", 2)
    assert (shard, offload) == (True, False) and "nothing to move on cpu" in why
    assert decide_sharding(_cfg("runtime.sharding=none"), "cuda", "bf16", 8)[0] is False
    assert decide_sharding(_cfg(), "cpu", "fp32", 1) == (False, False, "sharding none: one process, nothing to shard "
                                                                       "over (auto)")


@pytest.mark.parametrize("items,device,precision,needle", [
    (["runtime.sharding=fsdp"], "cuda", "fp16", "fp16"),
    (["runtime.sharding=fsdp", "train.optimizer=adafactor"], "cpu", "fp32", "adafactor"),
    (["runtime.sharding=fsdp", "train.optimizer=paged_adamw_8bit"], "cuda", "bf16", "train.optimizer=adamw_8bit"),
    (["runtime.sharding=fsdp", "eval.generate_at_end=true", "eval.holdout=4"], "cpu", "fp32", "anyfit eval"),
    (["runtime.sharding=none", "runtime.fsdp_offload=true"], "cuda", "bf16", "runtime.sharding=fsdp"),
    (["runtime.sharding=fsdp", "runtime.deepspeed_offload=true"], "cuda", "bf16", "runtime.sharding=deepspeed"),
    # auto: DeepSpeed fixes the micro-batch when the engine is built
    (["runtime.sharding=deepspeed", "train.micro_batch=auto"], "cpu", "fp32", "train.micro_batch to a number"),
    (["runtime.sharding=deepspeed", "train.micro_batch=1", "runtime.compile=true"], "cuda", "bf16", "compile"),
    (["runtime.sharding=deepspeed", "train.micro_batch=1", "runtime.fsdp_offload=true"], "cuda", "bf16",
     "runtime.deepspeed_offload"),
    (["runtime.sharding=deepspeed", "train.micro_batch=1"], "mps", "fp32", "cuda or cpu"),
    (["runtime.sharding=deepspeed", "train.micro_batch=1"], "cuda", "fp16", "fp16"),
    (["runtime.sharding=deepspeed", "train.micro_batch=1", "train.optimizer=adafactor"], "cpu", "fp32", "adafactor"),
])
def test_refused_combinations_say_what_to_do(items, device, precision, needle):
    with pytest.raises(ConfigError, match=needle):
        decide_sharding(_cfg(*items), device, precision, 2)


def test_8bit_adamw_shards_with_fsdp_and_its_checkpoints_continue_on_as_many_processes(tmp_path):
    """torchao's 8-bit states are quantized per process shard: FSDP2 with 8-bit AdamW is a run (any device), and
    its checkpoint continues under FSDP2 on the process count that wrote it, refused otherwise in one line."""
    from anyfit.backends import continue_problem
    from anyfit.backends.replicated import Replicated

    backend = choose_backend(_cfg("runtime.sharding=fsdp", "train.optimizer=adamw_8bit"),
                             SimpleNamespace(device="cpu", precision="fp32", pin_memory=False), 2)
    assert backend.sharded
    folder = tmp_path / "checkpoint-4"
    (folder / "sharded").mkdir(parents=True)
    for rank in range(2):
        (folder / "sharded" / f"__{rank}_0.distcp").write_bytes(b"")
    (folder / "config.yaml").write_text("train: {optimizer: adamw_8bit}\n")
    assert continue_problem(backend, folder, 2) == ""
    assert "Launch 2 processes" in continue_problem(backend, folder, 4)
    assert "runtime.sharding=fsdp and launch 2" in continue_problem(Replicated("none"), folder, 2)
    (folder / "config.yaml").write_text("train: {optimizer: adamw}\n")  # fp32 states: DCP re-cuts them for any count
    assert continue_problem(backend, folder, 4) == continue_problem(Replicated("none"), folder, 1) == ""


def test_deepspeed_is_zero3_with_its_offload_when_asked():
    pytest.importorskip("deepspeed")
    shard, offload, why = decide_sharding(_cfg("runtime.sharding=deepspeed", "train.micro_batch=1",
                                               "runtime.deepspeed_offload=true"), "cuda", "bf16", 8)
    assert (shard, offload) == (True, True) and "ZeRO-3" in why and "host RAM" in why

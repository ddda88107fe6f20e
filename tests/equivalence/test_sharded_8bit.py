"""FSDP2 with 8-bit AdamW (torchao's, ``train.optimizer=adamw_8bit`` under ``runtime.sharding=fsdp``): real processes
over gloo. The states are sharded and 8-bit (about a quarter of AdamW's bytes per process), the run follows
AdamW's, and a checkpoint continues bit for bit."""

from __future__ import annotations

import json
import shutil

import pytest
from launches import STEPS, complete_run, launch, losses, run_config

pytestmark = [pytest.mark.multiprocess, pytest.mark.multirun]
pytest.importorskip("torchao")

EIGHT_BIT = ("runtime.sharding=fsdp", "train.optimizer=adamw_8bit")


@pytest.fixture(scope="module")
def two_processes(tiny_llama_dir, tmp_path_factory):
    """AdamW's FSDP2 run on two processes of this module's model: the tiny Llama with Qwen's whole 151k vocabulary,
    whose embedding is nearly all of its weights (what the share of state bytes below is read on). The other
    multi-process modules share a reference of a 1,000-token vocabulary."""
    return complete_run(tmp_path_factory, tiny_llama_dir, "adamw", 2, "fsdp")[0]


@pytest.fixture(scope="module")
def eight_bit(tiny_llama_dir, tmp_path_factory):
    tmp = tmp_path_factory.mktemp("eight_bit")
    out = tmp / "out"
    log = launch(run_config(tmp, tiny_llama_dir), out, 2, *EIGHT_BIT)
    return tmp, out, log


def test_sharded_8bit_states_are_a_quarter_of_adamws_and_the_run_follows_adamw(eight_bit, two_processes):
    _, out, log = eight_bit
    held = json.loads((out / "run_info.json").read_text())["held_per_process"]
    adamw = json.loads((two_processes / "run_info.json").read_text())["held_per_process"]
    # per process: two 8-bit moments and one fp32 scale per 256 values where AdamW keeps two fp32 moments, for
    # every shard of 4096+ values that divides into 256-value blocks (torchao's rule, shard by shard); the tiny
    # model's odd vocabulary leaves process 0's half of the embedding (nearly all of its weights) one row off,
    # so that process keeps AdamW's fp32 states, in full
    quarter = [0.24 * theirs < mine < 0.28 * theirs
               for mine, theirs in zip(held["optimizer_state_bytes"], adamw["optimizer_state_bytes"])]
    assert quarter == [False, True], (held, adamw)
    assert held["optimizer_state_bytes"][0] <= adamw["optimizer_state_bytes"][0]
    # the first loss comes before any update: the same as AdamW's to fp32 round-off; after that the moments'
    # rounding (8-bit codes, under 1% of a block's largest value) changes each update by at most that fraction,
    # so the loss's progress (about 4 of its 13 nats over the 8 steps) by at most 1% of it: within 1% of AdamW's
    ours, theirs = losses(out), losses(two_processes)
    assert ours[0] == pytest.approx(theirs[0], rel=1e-5)
    assert ours == pytest.approx(theirs, rel=1e-2)
    assert ours[-1] < 0.9 * ours[0]


def test_a_sharded_8bit_checkpoint_continues_bit_for_bit(eight_bit, tiny_llama_dir):
    tmp, out, _ = eight_bit
    again = tmp / "again"
    again.mkdir()
    shutil.copytree(out / "checkpoint-4", again / "checkpoint-4")
    log = launch(run_config(tmp, tiny_llama_dir), again, 2, *EIGHT_BIT, "train.resume=auto")
    assert "resumed from" in log and "at step 4" in log
    assert losses(again) == losses(out)[4:STEPS]

"""FSDP2 with 8-bit AdamW (torchao's, ``train.optimizer=adamw_8bit`` under ``runtime.sharding=fsdp``): real processes
over gloo. The states are sharded and 8-bit (about a quarter of AdamW's bytes per process), the run follows
AdamW's, and a checkpoint continues bit for bit."""

from __future__ import annotations

import json
import shutil

import pytest
from launches import STEPS, complete_run, launch, losses, run_config
from tiny_runs import save_tiny

pytestmark = [pytest.mark.multiprocess, pytest.mark.multirun]
pytest.importorskip("torchao")

EIGHT_BIT = ("runtime.sharding=fsdp", "train.optimizer=adamw_8bit")


@pytest.fixture(scope="module")
def wide_llama_dir(tmp_path_factory, qwen_small_tokenizer_dir):
    """The tiny Llama 128 wide, with the 1,000-token vocabulary and an embedding of 1,023 rows: every weight's shard
    is 4096+ values in whole 256-value blocks, torchao's rule for 8-bit states, except process 1's half of the
    embedding (511 rows of 128: one half block over), which keeps AdamW's fp32 states."""
    return save_tiny(tmp_path_factory.mktemp("wide_llama"), qwen_small_tokenizer_dir, "llama", hidden_size=128,
                     intermediate_size=256, num_key_value_heads=4, vocab_size=1023, initializer_range=0.1)


@pytest.fixture(scope="module")
def adamw(wide_llama_dir, tmp_path_factory):
    """AdamW's run of this module's model and data on one process, in this one (FSDP2 on two processes follows the
    one-process run to fp32 round-off: test_sharded)."""
    return complete_run(tmp_path_factory, wide_llama_dir, "adamw", 1, "none")[0]


@pytest.fixture(scope="module")
def eight_bit(wide_llama_dir, tmp_path_factory):
    tmp = tmp_path_factory.mktemp("eight_bit")
    out = tmp / "out"
    log = launch(run_config(tmp, wide_llama_dir), out, 2, *EIGHT_BIT)
    return tmp, out, log


def test_sharded_8bit_states_are_a_quarter_of_adamws_and_the_run_follows_adamw(eight_bit, adamw):
    _, out, log = eight_bit
    held = json.loads((out / "run_info.json").read_text())["held_per_process"]
    adamw_bytes = [8 * n for n in held["parameters"]]  # AdamW's two fp32 moments of each parameter a process holds
    # per process: two 8-bit moments, one fp32 scale per 256 values and a 256-entry fp32 code table per moment and
    # tensor, where AdamW keeps two fp32 moments (0.27 of AdamW's bytes on process 0 here), for every shard of
    # 4096+ values that divides into 256-value blocks (torchao's rule, shard by shard); process 1's half of the
    # embedding does not divide, so that process keeps AdamW's fp32 states for it
    quarter = [0.24 * theirs < mine < 0.28 * theirs
               for mine, theirs in zip(held["optimizer_state_bytes"], adamw_bytes)]
    assert quarter == [True, False], (held, adamw_bytes)
    assert held["optimizer_state_bytes"][1] < adamw_bytes[1]
    # the first loss comes before any update: the same as AdamW's to fp32 round-off; after that the moments'
    # rounding (8-bit codes, under 1% of a block's largest value) changes each update by at most that fraction,
    # so the loss's progress (about 6 of its 7.7 nats over the 8 steps) by at most 1% of it: within 1% of AdamW's
    ours, theirs = losses(out), losses(adamw)
    assert ours[0] == pytest.approx(theirs[0], rel=1e-5)
    assert ours == pytest.approx(theirs, rel=1e-2)
    assert ours[-1] < 0.9 * ours[0]


def test_a_sharded_8bit_checkpoint_continues_bit_for_bit(eight_bit, wide_llama_dir):
    tmp, out, _ = eight_bit
    again = tmp / "again"
    again.mkdir()
    shutil.copytree(out / "checkpoint-4", again / "checkpoint-4")
    log = launch(run_config(tmp, wide_llama_dir), again, 2, *EIGHT_BIT, "train.resume=auto")
    assert "resumed from" in log and "at step 4" in log
    assert losses(again) == losses(out)[4:STEPS]

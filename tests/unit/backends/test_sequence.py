"""Sequence parallelism's own parts, without processes: the cut of a batch into parts (every trained target in
exactly one part, at its global position) and the refusals before any weights load."""

from __future__ import annotations

import importlib.util

import pytest
import torch

from anyfit.backends.sequence import SequenceSplit, shard_batch
from anyfit.config import load_config
from anyfit.data.batching import collate
from anyfit.hardware.runtime import sequence_parallel_problem

EXAMPLES = [{"input_ids": [11, 12, 13, 14, 15], "labels": [-100, 12, 13, 14, 15]},
            {"input_ids": [31, 32, 33, 34], "labels": [-100, 32, 33, 34]},
            {"input_ids": [41, 42, 43], "labels": [-100, -100, 43]}]


@pytest.mark.parametrize("packed", [False, True], ids=["padded", "packed"])
@pytest.mark.parametrize("degree", [2, 3, 4])
def test_the_parts_of_a_batch_hold_each_trained_target_once_at_its_global_position(packed, degree):
    batch = collate(EXAMPLES, pad_id=0, packed=packed)
    parts = [shard_batch(batch, degree, r) for r in range(degree)]
    rows, length = batch["input_ids"].shape
    width = -(-length // degree)  # the sequence padded to a multiple of the degree, cut in equal parts
    assert all(p["input_ids"].shape == (rows, width) == p["position_ids"].shape for p in parts)
    ids = torch.cat([p["input_ids"] for p in parts], dim=1)
    assert torch.equal(ids[:, :length], batch["input_ids"]) and not ids[:, length:].any()
    positions = torch.cat([p["position_ids"] for p in parts], dim=1)[:, :length]
    expected = batch["position_ids"] if packed else torch.arange(length).expand(rows, -1)
    assert torch.equal(positions, expected)  # global positions: rotary sees the unsplit sequence
    # every trained target in exactly one part, at the position it had
    if packed:
        assert torch.equal(torch.cat([p["keep_targets"] for p in parts]), batch["keep_targets"])
        kept = torch.cat([p["keep"] + r * width for r, p in enumerate(parts)])
        assert torch.equal(kept, batch["keep"])
        for p in parts:  # the boundaries stay whole, the padding one more untrained example
            assert sum(p["packed_lengths"]) == width * degree and p["packed_lengths"][:3] == (5, 4, 3)
            assert p["cu_seq_lens"].tolist()[-1] == width * degree
    else:
        kept = torch.cat([p["keep"] for p in parts], dim=1)[:, :length]
        assert torch.equal(kept, batch["keep"])
        targets = [torch.full(p["keep"].shape, -100).index_put_((p["keep"],), p["keep_targets"]) for p in parts]
        assert torch.equal(torch.cat(targets, dim=1)[:, :length][kept], batch["keep_targets"])
        assert all("attention_mask" not in p for p in parts)  # causal by position after the all-to-all


@pytest.mark.parametrize("packed", [False, True], ids=["padded", "packed"])
def test_each_trained_target_keeps_its_source_in_its_part(packed):
    """data.mix: the parts' sources, part after part, are the whole batch's, each with its own target."""
    mixed = [{**ex, "source": s, "sources": 3} for ex, s in zip(EXAMPLES, (2, 0, 1))]
    batch = collate(mixed, pad_id=0, packed=packed)
    assert batch["keep_source"].tolist() == [2, 2, 2, 2, 0, 0, 0, 1]
    parts = [shard_batch(batch, 3, r) for r in range(3)]
    assert all(p["sources"] == 3 and p["keep_source"].shape == p["keep_targets"].shape for p in parts)
    if packed:
        assert torch.equal(torch.cat([p["keep_source"] for p in parts]), batch["keep_source"])
    else:  # part by part the rows' targets interleave; per row, in order, they are the batch's
        width = parts[0]["keep"].shape[1]
        grid = torch.full((3, 3 * width), -1)
        for r, p in enumerate(parts):
            grid[:, r * width:(r + 1) * width][p["keep"]] = p["keep_source"]
        assert grid[grid >= 0].tolist() == batch["keep_source"].tolist()


def test_a_split_process_knows_its_part_and_its_data_group():
    assert [SequenceSplit.of(2, i, 4) for i in range(4)] == [
        SequenceSplit(2, 0, 0, 2), SequenceSplit(2, 1, 0, 2), SequenceSplit(2, 0, 1, 2), SequenceSplit(2, 1, 1, 2)]
    assert [s.counts() for s in (SequenceSplit.of(2, i, 4) for i in range(4))] == [True, False, True, False]
    loss = object()
    assert SequenceSplit().loss(loss) is loss  # not split: the loss function as it was


def _cfg(*items: str):
    return load_config(None, ["model.name_or_path=unused", *items])


@pytest.mark.parametrize("items, processes, heads, needle", [
    (["runtime.sequence_parallel=2"], 1, (4, 2), "single process"),
    (["runtime.sequence_parallel=4"], 6, (8, 8), "does not divide the 6 processes"),
    (["runtime.sequence_parallel=4"], 4, (6, 2), "Degrees that fit 4 processes: 2"),
    (["runtime.sequence_parallel=3"], 3, (4, 4), "No degree fits 3 processes"),
    (["runtime.sequence_parallel=2", "runtime.sharding=deepspeed"], 2, (4, 2), "sharding=fsdp or none"),
    (["runtime.sequence_parallel=2", "model.attn_implementation=eager"], 2, (4, 2), "(T x T) mask"),
    (["runtime.sequence_parallel=2", "eval.generate_at_end=true"], 2, (4, 2), "anyfit eval"),
    (["runtime.sequence_parallel=2", "lora.enabled=true", "train.watch_base=true", "eval.every=5"], 2, (4, 2),
     "watch_base=false"),
    (["runtime.sequence_parallel=2", "lora.enabled=true", "train.base_kl_weight=0.1"], 2, (4, 2),
     "base_kl_weight=0"),
], ids=["one-process", "processes", "heads", "no-degree", "zero3", "eager", "generation", "base-kl", "anchor"])
def test_what_cannot_be_split_is_one_line_with_what_would_work(items, processes, heads, needle):
    problem = sequence_parallel_problem(_cfg(*items), processes, *heads)
    assert needle in problem and "\n" not in problem, problem


def test_splits_that_run_are_not_refused():
    assert sequence_parallel_problem(_cfg(), 1, 4, 2) == ""
    assert sequence_parallel_problem(_cfg("runtime.sequence_parallel=4"), 8, 32, 2) == ""  # kv heads replicated
    assert sequence_parallel_problem(_cfg("runtime.sequence_parallel=2", "runtime.sharding=fsdp"), 2, 4, 2) == ""
    # base_kl's 'auto' is turned off under a split with a printed line, not refused
    assert sequence_parallel_problem(_cfg("runtime.sequence_parallel=2", "lora.enabled=true"), 2, 4, 2) == ""


def test_the_run_takes_its_degree_from_the_config_or_the_plan_and_says_why(tiny_llama_dir):
    from anyfit.backends import choose_sequence_parallel
    from anyfit.config import ConfigError

    model = f"model.name_or_path={tiny_llama_dir}"
    assert choose_sequence_parallel(load_config(None, [model]), 2) == (1, "")
    degree, why = choose_sequence_parallel(load_config(None, [model, "runtime.sequence_parallel=auto"]), 2)
    assert degree == 1 and why.startswith("sequence parallel 1 (auto): the unsplit run fits")
    two = load_config(None, [model, "runtime.sequence_parallel=2"])
    if importlib.util.find_spec("deepspeed"):
        assert choose_sequence_parallel(two, 2)[0] == 2
    else:  # an install without the deepspeed extra (the lower-bounds job): what to install, in one line
        with pytest.raises(ConfigError, match=r"pip install 'anyfit\[deepspeed\]'"):
            choose_sequence_parallel(two, 2)
    with pytest.raises(ConfigError, match="cannot be split 3 ways"):  # 4 heads
        choose_sequence_parallel(load_config(None, [model, "runtime.sequence_parallel=3"]), 3)


def test_a_model_with_a_state_along_the_sequence_is_not_split(tmp_path):
    """Qwen3.5's linear attention (and any layer kind that is not attention) reads the whole sequence in order:
    Ulysses splits only attention, so the split is refused in one line, before any weights load."""
    from families import tiny_config

    from anyfit.backends import choose_sequence_parallel
    from anyfit.config import ConfigError

    tiny_config("qwen3_5").save_pretrained(tmp_path)
    cfg = load_config(None, [f"model.name_or_path={tmp_path}", "runtime.sequence_parallel=2"])
    with pytest.raises(ConfigError, match="'linear_attention' layers carry a state along the sequence") as refused:
        choose_sequence_parallel(cfg, 2)
    assert "\n" not in str(refused.value)

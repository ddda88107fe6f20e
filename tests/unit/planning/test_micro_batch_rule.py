"""``anyfit plan`` and ``train.micro_batch=auto`` choose the micro-batch by one rule: given the same peak
memory per micro-batch and the same budget, they pick the same value."""

from __future__ import annotations

import dataclasses

import pytest
from transformers import AutoConfig

from anyfit.config import load_config
from anyfit.data.batching import BatchPlan, choose_micro_batch, micro_batch_candidates
from anyfit.model.shape import shape_from_config
from anyfit.planning.ladder import plan_target
from anyfit.planning.memory import estimate_memory
from anyfit.planning.presets import custom_target
from anyfit.planning.setup import SAFETY
from anyfit.training.autofit import probe_micro_batch
from anyfit.units import GIB


def test_candidates_are_every_divisor():
    assert micro_batch_candidates(12) == [1, 2, 3, 4, 6, 12]
    assert micro_batch_candidates(7) == [1, 7]


def test_the_first_micro_batch_that_does_not_fit_ends_the_search():
    peaks = {1: 10, 2: 20, 3: 30, 4: 99, 6: 40, 12: 50}  # 4 does not fit: 6 is never tried
    assert choose_micro_batch(12, peaks.get, budget=45) == 3
    assert choose_micro_batch(12, lambda m: None if m > 2 else m, budget=100) == 2  # None: out of memory
    assert choose_micro_batch(12, peaks.get, budget=5) is None


@pytest.mark.parametrize("packing", [True, False])
def test_plan_and_auto_pick_the_same_micro_batch(tiny_llama_dir, packing):
    effective, seq = 12, 64
    cfg = load_config(None, [f"model.name_or_path={tiny_llama_dir}", f"train.effective_batch={effective}",
                             f"data.max_length={seq}", f"train.packing={packing}", "runtime.device=cpu"])
    shape = shape_from_config(AutoConfig.from_pretrained(tiny_llama_dir))
    setup = plan_target(cfg, shape, custom_target("cpu", 64), overhead_gib=0).setup

    def peak(micro: int) -> int:  # the planner's estimate for this micro-batch: the "measurement" of the probe
        return estimate_memory(shape, dataclasses.replace(setup, micro_batch=micro, accumulation=effective // micro),
                               overhead_gib=0).peak

    examples = [{"input_ids": [1] * seq, "labels": [1] * seq}] * effective
    candidates = micro_batch_candidates(effective)
    picked = set()
    for low, high in zip(candidates, candidates[1:] + [None]):
        budget = (peak(low) + peak(high)) // 2 if high else 2 * peak(low)  # room for `low`, not for the next one
        target = custom_target("cpu", budget / SAFETY / 1e9)
        planned = plan_target(cfg, shape, target, overhead_gib=0).setup.micro_batch
        budget = int(target.memory_gib * GIB * SAFETY)  # the planner's budget, to the byte
        probed = probe_micro_batch(examples, BatchPlan(effective, 1, effective, 1), budget, peak,
                                   echo=lambda *a: None)
        assert planned == probed == low, (budget, planned, probed)
        picked.add(planned)
    assert picked == set(candidates)  # including 3 and 6, which are not powers of two


@pytest.mark.parametrize("effective, processes, micro", [(8, 4, 4), (8, 4, 2), (12, 2, 3), (8, 1, 8), (16, 4, "auto")])
def test_recommend_sharding_plans_the_micro_batch_the_run_uses(tiny_llama_dir, effective, processes, micro):
    """runtime.sharding=auto decides on the micro-batch BatchPlan.from_config gives the run (effective 8 over 4
    processes with micro_batch 4: each process has 2 sequences, so the run uses 2, and so does the estimate)."""
    from anyfit.planning.recommend import recommend_sharding

    cfg = load_config(None, [f"model.name_or_path={tiny_llama_dir}", f"train.effective_batch={effective}",
                             f"train.micro_batch={micro}", "runtime.device=cpu"])
    shape = shape_from_config(AutoConfig.from_pretrained(tiny_llama_dir))
    _, why = recommend_sharding(cfg, shape, custom_target("cpu", 64), processes)
    if processes == 1:
        assert why == "one process: nothing to shard over"
        return
    run = BatchPlan.from_config(cfg.train, processes).micro_batch
    if micro == "auto":  # the planner's estimate of micro_batch=auto: the largest divisor that fits (all, here)
        run = effective // processes
    assert why.endswith(f"at micro-batch {run}"), why


def test_a_batch_split_the_run_refuses_is_not_planned(tiny_llama_dir):
    from anyfit.planning.recommend import recommend_sharding

    cfg = load_config(None, [f"model.name_or_path={tiny_llama_dir}", "train.effective_batch=12",
                             "train.micro_batch=4", "runtime.device=cpu"])
    shape = shape_from_config(AutoConfig.from_pretrained(tiny_llama_dir))
    use, why = recommend_sharding(cfg, shape, custom_target("cpu", 64), 2)  # 6 per process: 4 does not divide
    assert not use and "train.micro_batch=4 does not divide" in why

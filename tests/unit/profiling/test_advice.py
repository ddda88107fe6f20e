"""Each advice rule on hand-made profiles: it fires on the bad case with its measured reason and expected effect,
and stays silent on the good one. The rules that need CUDA (compile, precision, offload) and several processes
(communication) are proven only here, on synthetic profiles; the CPU rules also run on real profiles in
tests/integration/test_profile.py."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest

from anyfit.profiling.advice import (
    Facts,
    Layout,
    Profile,
    advise,
    checkpointing_rule,
    combined_factor,
    communication_rule,
    compile_rule,
    data_wait_rule,
    logits_rule,
    micro_batch_rule,
    micro_cost,
    micro_fit,
    nonnegative_lstsq,
    offload_rule,
    padding_rule,
    precision_rule,
)


def _profile(**kw) -> Profile:
    base = dict(step=1.0, phases={"data_wait": 0.01, "h2d": 0.0, "forward": 0.3, "backward": 0.6, "optimizer": 0.05,
                                  "other": 0.04},
                micro_seconds=[0.10, 0.12, 0.14, 0.16, 0.10, 0.12, 0.14, 0.09],  # 80 ms + 2 ms a position
                micro_positions=[10, 20, 30, 40, 10, 20, 30, 5])
    base.update(kw)
    return Profile(**base)


def _facts(**kw) -> Facts:
    base = dict(device="cpu", precision="fp32", processes=1, packing=True, num_workers=0, micro_batch=8,
                per_process=8, accumulation=1,
                layouts={(True, 8): Layout(1, 165, 165), (False, 8): Layout(1, 320, 165)})
    base.update(kw)
    return Facts(**base)


def test_padding_fires_only_without_packing_and_with_padding():
    bad = _facts(packing=False)
    advice = padding_rule(_profile(micro_seconds=[0.9], micro_positions=[320]), bad)
    assert advice.setting == "train.packing=true" and "48% of the token positions are padding" in advice.reason
    assert advice.factor == pytest.approx(1.0 / (0.1 + 0.9 * 165 / 320))
    assert padding_rule(_profile(), _facts()) is None
    little = _facts(packing=False, layouts={(False, 8): Layout(1, 170, 165), (True, 8): Layout(1, 165, 165)})
    assert padding_rule(_profile(), little) is None


def test_micro_batch_fires_when_a_larger_one_fits_and_pays():
    layouts = {(True, 1): Layout(8, 165, 165), (False, 1): Layout(8, 165, 165), (True, 8): Layout(1, 165, 165),
               (False, 8): Layout(1, 320, 165)}
    bad = _facts(micro_batch=1, accumulation=8, packing=False, layouts=layouts, proposed_micro=8)
    advice = micro_batch_rule(_profile(), bad)
    assert advice.setting == "train.micro_batch=8" and "fixed cost" in advice.reason and advice.factor > 1.5
    # With packing off, the larger micro-batch would pad: the padding rule fires too, and together they predict
    # one step model's factor (not the product of the two).
    both = advise(_profile(), bad)
    assert [a.key for a in both] == ["train.packing", "train.micro_batch"]
    assert combined_factor(_profile(), bad, both) == pytest.approx(advice.factor)
    assert micro_batch_rule(_profile(), dataclasses.replace(bad, proposed_micro=None)) is None  # no memory to spare
    flat = _profile(micro_seconds=[0.1] * 8, micro_positions=[20] * 8)  # no size variety: no fixed cost claimed
    assert micro_batch_rule(flat, bad) is None


def test_data_wait_fires_without_workers():
    slow = _profile(phases={**_profile().phases, "data_wait": 0.2, "other": 0.0})
    advice = data_wait_rule(slow, _facts())
    assert advice.setting == "runtime.num_workers=2" and "20%" in advice.reason
    assert advice.factor == pytest.approx(1 / 0.8, rel=1e-3)
    assert data_wait_rule(slow, _facts(num_workers=2)) is None
    assert data_wait_rule(_profile(), _facts()) is None


def test_checkpointing_fires_only_with_memory_to_spare():
    bad = _facts(gradient_checkpointing=True, checkpoint_share=1.0, fits_without_checkpointing=True)
    advice = checkpointing_rule(_profile(), bad)
    assert advice.setting == "model.gradient_checkpointing=false" and advice.factor == pytest.approx(1 / 0.7)
    assert checkpointing_rule(_profile(), dataclasses.replace(bad, fits_without_checkpointing=False)) is None
    assert checkpointing_rule(_profile(), _facts()) is None


def test_offload_optimizer_share():
    slow = _profile(phases={**_profile().phases, "optimizer": 0.5, "backward": 0.15})
    fits = offload_rule(slow, _facts(offload=True, fits_without_offload=True))
    assert fits.setting == "runtime.fsdp_offload=false" and "50%" in fits.reason
    tight = offload_rule(slow, _facts(offload=True))
    assert tight.setting == "train.optimizer=adafactor"
    assert offload_rule(_profile(), _facts(offload=True)) is None
    assert offload_rule(slow, _facts()) is None


def test_communication_bound_with_accumulation_one():
    comm = _profile(communication=0.4)
    advice = communication_rule(comm, _facts(processes=4, per_process=8))
    assert advice.setting == "train.effective_batch=64" and advice.factor == pytest.approx(2 / 1.6)
    assert communication_rule(comm, _facts(processes=4, accumulation=2)) is None
    assert communication_rule(_profile(communication=0.05), _facts(processes=4)) is None


def test_compile_on_cuda_with_many_small_kernels():
    gpu = _profile(device_busy=0.9, device_matmul=0.3, device_communication=0.1)
    advice = compile_rule(gpu, _facts(device="cuda"))
    assert advice.setting == "runtime.compile=true" and "50%" in advice.reason
    assert compile_rule(gpu, _facts(device="cuda", compile=True)) is None
    assert compile_rule(gpu, _facts(device="cpu")) is None
    assert compile_rule(_profile(device_busy=0.9, device_matmul=0.8), _facts(device="cuda")) is None


def test_bf16_where_the_gpu_has_it():
    gpu = _profile(device_busy=0.9, device_matmul=0.6)
    facts = _facts(device="cuda", native_bf16=True, bf16_speedup=2.0)
    advice = precision_rule(gpu, facts)
    assert advice.setting == "runtime.precision=bf16" and advice.factor == pytest.approx(1 / 0.7)
    assert precision_rule(gpu, dataclasses.replace(facts, precision="bf16")) is None
    assert precision_rule(gpu, dataclasses.replace(facts, native_bf16=False)) is None  # a T4: bf16 is emulated


def test_logits_share_unchunked():
    big = _profile(activations=100, logits=300)
    advice = logits_rule(big, _facts(loss_chunk_tokens=0, logits_chunked_bytes=50))
    assert advice.setting == "train.loss_chunk_tokens=1024" and "75%" in advice.reason and advice.factor is None
    assert logits_rule(big, _facts()) is None
    assert logits_rule(_profile(activations=300, logits=10), _facts(loss_chunk_tokens=0)) is None


def test_a_good_run_gets_no_advice():
    assert advise(_profile(), _facts()) == []


def test_nonnegative_lstsq_matches_plain_least_squares_when_that_is_nonnegative_and_clamps_otherwise():
    rng = np.random.default_rng(0)
    a = np.stack([np.ones(12), rng.uniform(5, 40, 12), rng.uniform(1, 20, 12)], axis=1)
    b = a @ np.array([0.05, 0.002, 0.001]) + rng.normal(0, 1e-4, 12)
    np.testing.assert_allclose(nonnegative_lstsq(a, b), np.linalg.lstsq(a, b, rcond=None)[0])
    flat = 0.1 - 0.0001 * a[:, 1]  # time falls with the positions: noise, not physics
    coef = nonnegative_lstsq(a[:, :2], flat)
    assert coef[1] == 0 and coef[0] == pytest.approx(flat.mean())  # the clamped slope leaves the mean as fixed cost


def test_micro_cost_keeps_the_fixed_cost_when_noise_tilts_the_slope_negative():
    # micro-batch 1 of tiny examples: every call costs about the same, and noise makes longer ones look cheaper
    p = _profile(micro_seconds=[0.052, 0.051, 0.050, 0.049, 0.052, 0.050, 0.049, 0.048],
                 micro_positions=[5, 7, 9, 11, 6, 8, 10, 12])
    a, b, _ = micro_cost(p)
    assert b == 0 and a == pytest.approx(np.mean(sorted(p.micro_seconds)[:4]))  # the faster half's mean


def test_trained_tokens_that_follow_the_positions_get_no_cost_of_their_own():
    positions = [12, 11, 11, 9, 8, 7, 6, 6]
    seconds = [0.02 + 0.001 * x for x in positions]
    following = _profile(micro_seconds=seconds, micro_positions=positions, micro_trained=[x - 5 for x in positions])
    coef, fitted = micro_fit(following)
    assert len(coef) == 2 and coef == pytest.approx([0.02, 0.001]) and fitted == pytest.approx(seconds)
    apart = _profile(micro_seconds=seconds, micro_positions=positions, micro_trained=[3, 6, 2, 5, 1, 4, 2, 3])
    assert len(micro_fit(apart)[0]) == 3  # prompts of their own lengths: the head's cost can be told apart


def _bursty(a: float, b: float, seed: int) -> tuple[list[float], list[float]]:
    """Two steps of eight micro-batches each costing ``a + b x positions`` with a little noise, and a burst of
    contention (another process on the core) adding 20-40 ms to five micro-batches in a row."""
    rng = np.random.default_rng(seed)
    positions = [12, 11, 11, 9, 8, 7, 6, 6, 15, 14, 13, 11, 9, 8, 7, 6]
    seconds = [a + b * x + abs(rng.normal(0, 5e-4)) for x in positions]
    start = int(rng.integers(0, len(positions) - 5))
    for i in range(start, start + 5):
        seconds[i] += rng.uniform(0.020, 0.040)
    return seconds, positions


@pytest.mark.parametrize("seed", range(5))
def test_a_burst_of_contention_does_not_move_the_fitted_costs(seed):
    seconds, positions = _bursty(0.020, 0.001, seed)
    p = _profile(micro_seconds=seconds, micro_positions=positions)
    a, b, _ = micro_cost(p)
    # what is left is the quiet micro-batches' noise (half-normal, 0.5 ms), seen through the fit
    assert a == pytest.approx(0.020, abs=4e-3) and b == pytest.approx(0.001, abs=4e-4)
    everything = np.linalg.lstsq(np.stack([np.ones(16), positions], axis=1), seconds, rcond=None)[0]
    assert abs(everything[0] - 0.020) > 4e-3 or abs(everything[1] - 0.001) > 4e-4  # the plain fit is moved


def test_the_fixed_cost_advice_survives_contention_in_the_traced_steps():
    # micro-batch 1 (8 calls) at 20 ms a call + 1 ms a position, a 20 ms optimizer step; the traced steps were hit
    # by a burst (the plain fit put the fixed cost near zero and the rule fell silent on a shared CI runner)
    seconds, positions = _bursty(0.020, 0.001, 3)
    compute = sum(seconds) / 2
    traced = {"data_wait": 0.0, "h2d": 0.0, "forward": compute / 3, "backward": 2 * compute / 3, "optimizer": 0.02,
              "other": 0.0}
    quiet = 8 * 0.020 + 0.001 * sum(positions) / 2 + 0.02  # the same step, untraced and uncontended
    p = _profile(step=sum(traced.values()), phases=traced, micro_seconds=seconds, micro_positions=positions,
                 untraced_step=quiet)
    per_step = sum(positions) / 2
    layouts = {(True, 1): Layout(8, per_step, per_step), (True, 8): Layout(1, per_step, per_step)}
    bad = _facts(micro_batch=1, accumulation=8, layouts=layouts, proposed_micro=8)
    advice = micro_batch_rule(p, bad)
    truth = quiet / (quiet - 7 * 0.020)  # seven calls' fixed cost fewer
    assert advice is not None and advice.factor == pytest.approx(truth, rel=0.15)


def test_the_fixed_cost_advice_survives_a_busy_machine_during_the_traced_steps_only():
    # the untraced steps ran quiet, then every traced micro-batch took 3x as long (another job took the cores): the
    # difference is not the profiler's per-call cost (read that way, it wiped the fixed cost and the rule fell silent)
    positions = [12, 11, 11, 9, 8, 7, 6, 6, 15, 14, 13, 11, 9, 8, 7, 6]
    seconds = [3 * (0.020 + 0.001 * x) for x in positions]
    compute = sum(seconds) / 2
    traced = {"data_wait": 0.0, "h2d": 0.0, "forward": compute / 3, "backward": 2 * compute / 3, "optimizer": 0.06,
              "other": 0.0}
    quiet = 8 * 0.020 + 0.001 * sum(positions) / 2 + 0.02
    p = _profile(step=sum(traced.values()), phases=traced, micro_seconds=seconds, micro_positions=positions,
                 untraced_step=quiet)
    per_step = sum(positions) / 2
    layouts = {(True, 1): Layout(8, per_step, per_step), (True, 8): Layout(1, per_step, per_step)}
    advice = micro_batch_rule(p, _facts(micro_batch=1, accumulation=8, layouts=layouts, proposed_micro=8))
    assert advice is not None and advice.factor == pytest.approx(quiet / (quiet - 7 * 0.020), rel=0.05)

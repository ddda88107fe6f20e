"""The step-time model on CUDA (matmuls at a calibrated share of the peak + the bytes the operations between them
stream) and the activation offload saver's memory and time. The calibration itself is
benchmarks/published_speed.py; this holds its constants to what it computes and the model to its physics."""

from __future__ import annotations

import dataclasses
import importlib.util
import sys
from pathlib import Path

import pytest
from transformers import LlamaConfig, Qwen2Config

from anyfit.config import load_config
from anyfit.model.shape import shape_from_config
from anyfit.planning.ladder import plan_target
from anyfit.planning.memory import estimate_memory, offloaded_activation_bytes
from anyfit.planning.presets import MATMUL_SHARE, PRESETS
from anyfit.planning.setup import Setup, Workload
from anyfit.planning.time import flops_per_token, step_time, streamed_bytes_per_token

BENCHMARKS = Path(__file__).resolve().parents[3] / "benchmarks"  # the source tree beside this test


def llama(hidden: int, inter: int, layers: int, heads: int, vocab: int = 32000):
    return shape_from_config(LlamaConfig(vocab_size=vocab, hidden_size=hidden, intermediate_size=inter,
                                         num_hidden_layers=layers, num_attention_heads=heads,
                                         num_key_value_heads=heads, tie_word_embeddings=False))


def setup(**kw) -> Setup:
    return Setup(**{**dict(method="full", device="cuda", precision="bf16", weight_bytes=4, micro_batch=4,
                           seq_len=2048), **kw})


def mfu(shape, s: Setup, key: str) -> float:
    target = PRESETS[key]
    t = step_time(shape, s, target, Workload(s.seq_len))
    tokens = s.micro_batch * s.accumulation * s.seq_len
    return tokens * flops_per_token(shape, s) / (t.compute * target.tflops("bf16") * 1e12)


def test_narrow_models_and_hopper_reach_less_of_the_peak():
    """Streamed bytes grow with the width, matmul FLOPs with its square: a 0.5B model gets a smaller share of the
    peak than a 7B one; the same bytes weigh more on a Hopper (3x the FLOPs, 1.6x the bandwidth of an A100)."""
    small = shape_from_config(Qwen2Config(vocab_size=151936, hidden_size=896, intermediate_size=4864,
                                          num_hidden_layers=24, num_attention_heads=14, num_key_value_heads=2,
                                          tie_word_embeddings=True))
    big = llama(4096, 11008, 32, 32)
    for key in ("a100-80", "h100"):
        assert mfu(small, setup(), key) < mfu(big, setup(), key) < MATMUL_SHARE[
            "hopper" if key == "h100" else "ampere"]
    assert mfu(big, setup(), "h100") < mfu(big, setup(), "a100-80")


def test_streamed_bytes_count_what_runs():
    shape = llama(4096, 11008, 32, 32)
    base = streamed_bytes_per_token(shape, setup())
    assert streamed_bytes_per_token(shape, setup(gradient_checkpointing=True)) > base  # the forward runs again
    assert streamed_bytes_per_token(shape, setup(method="lora", weight_bytes=2)) > \
        streamed_bytes_per_token(shape, setup(weight_bytes=2))  # adapters read their inputs again
    # autocast's weight copies are per micro-batch: they weigh less per token in a larger one
    assert streamed_bytes_per_token(shape, setup(micro_batch=8)) < base


def test_macs_and_cpus_keep_the_one_term_model():
    shape = llama(2048, 5632, 22, 32)
    s = setup(device="mps", precision="fp32")
    target = PRESETS["m-128"]
    t = step_time(shape, s, target, Workload(s.seq_len))
    flops = s.micro_batch * s.seq_len * flops_per_token(shape, s)
    assert target.matmul_share is None
    assert t.compute == pytest.approx(flops / (target.tflops("fp32") * 1e12 * target.efficiency))


def test_the_shares_are_what_the_published_runs_give():
    """MATMUL_SHARE is the per-architecture median of benchmarks/published_speed.py's implied shares: change the
    time model, and this fails until the constants are recalibrated (run the benchmark, copy its 'Calibration')."""
    sys.path.insert(0, str(BENCHMARKS))  # it imports its sibling published_memory
    try:
        bench = importlib.import_module("published_speed")
    finally:
        sys.path.remove(str(BENCHMARKS))
    _, summary, kept = bench.build()
    assert bench.calibration(kept) == MATMUL_SHARE
    ratios = sorted(r for r, *_ in kept)
    assert 0.8 <= ratios[len(ratios) // 2] <= 1.25


def test_activation_offload_keeps_one_layer_on_the_gpu_and_pays_its_copies():
    shape = llama(4096, 11008, 32, 32)
    cfg = load_config(None, ["model.name_or_path=x", "data.max_length=16384", "train.effective_batch=8",
                             "lora.enabled=true", "model.gradient_checkpointing=true"])
    target = PRESETS["a100-80"]
    plans = {on: plan_target(dataclasses.replace(cfg, model=dataclasses.replace(cfg.model, activation_offload=on)),
                             shape, target, micro_batch=1) for on in (False, True)}
    kept, off = plans[False], plans[True]
    assert off.setup.activation_offload and "act-offload" not in kept.verdict
    moved = offloaded_activation_bytes(shape, off.setup, 16384)
    assert moved > 0
    assert off.memory.activations < kept.memory.activations
    assert off.memory.host == kept.memory.host + moved
    # the copies out and back run on the compute stream: every micro-batch of the window pays them
    copies = off.setup.accumulation * 2 * moved / (target.host_link_gbs * 1e9)
    assert off.time.communication == pytest.approx(kept.time.communication + copies)
    assert off.time.compute == kept.time.compute
    # on a CPU the activations already are in host RAM: nothing is planned to move
    cpu = estimate_memory(shape, dataclasses.replace(off.setup, device="cpu", precision="fp32", weight_bytes=4))
    assert cpu.host == 0


def test_the_ladder_adds_activation_offload_where_checkpointing_alone_does_not_fit():
    """13B LoRA on 16k-token sequences on one L40S: every layer checkpointed still keeps 40 layer inputs; moving
    them to host RAM is the cheapest rung that fits (before CPU offload of the weights, LoRA-to-QLoRA or more
    GPUs), and the plan says which key turns it on."""
    from anyfit.planning.savers import config_overrides
    from anyfit.planning.setup import setup_for

    shape = llama(5120, 13824, 40, 40)
    cfg = load_config(None, ["model.name_or_path=x", "data.max_length=16384", "train.effective_batch=8",
                             "lora.enabled=true"])
    target = PRESETS["l40s"]
    p = plan_target(cfg, shape, target)
    assert p.verdict == "fits with gradient checkpointing + activation offload", p.verdict
    assert "model.activation_offload=true" in config_overrides(p.setup)
    alone = estimate_memory(shape, setup_for(cfg, method="lora", device="cuda", precision="bf16", micro_batch=1,
                                             overrides={"model.gradient_checkpointing": True}))
    assert alone.peak > p.budget_bytes >= p.memory.peak


def _measured_cpu(rates):
    return dataclasses.replace(PRESETS["m-128"], key="local", name="this CPU", device="cpu", rates=rates,
                               bandwidth_gbs=rates.dram_gbs)


def test_a_machine_with_measured_rates_is_timed_from_them_term_by_term():
    """Matmul FLOPs at the rate measured at the model's width, streamed bytes at the bandwidth measured at one
    micro-batch activation's size, and the measured cost of each eager operation: doubling one rate halves its
    term only."""
    from anyfit.hardware.calibration import MachineRates
    from anyfit.planning.time import eager_operations

    shape = llama(576, 1536, 30, 9, vocab=49152)
    s = setup(device="cpu", precision="fp32", micro_batch=8, seq_len=128)
    tokens = s.micro_batch * s.seq_len
    rates = MachineRates("k", {512: 0.2, 1024: 0.2}, {1 << 20: 100.0, 1 << 26: 20.0}, 5e-6, {16: 0.01})
    t = step_time(shape, s, _measured_cpu(rates), Workload(s.seq_len))
    activation = tokens * 576 * 4  # 2.25 MiB: between the two measured sizes
    matmul = flops_per_token(shape, s) * tokens / 0.2e12  # full fine-tuning: no adapter
    streamed = streamed_bytes_per_token(shape, s) * tokens / (rates.bandwidth_at(activation) * 1e9)
    ops = eager_operations(shape, s) * 5e-6
    assert 20 < rates.bandwidth_at(activation) < 100
    assert t.compute == pytest.approx(matmul + streamed + ops)
    faster = MachineRates("k", {512: 0.4, 1024: 0.4}, rates.stream_gbs, 5e-6, {16: 0.01})
    assert step_time(shape, s, _measured_cpu(faster), Workload(s.seq_len)).compute == pytest.approx(matmul / 2 + streamed + ops)
    # the optimizer streams from main memory: the bandwidth of the largest measured operand (the target's)
    doubled = dataclasses.replace(_measured_cpu(rates), bandwidth_gbs=2 * rates.dram_gbs)
    assert step_time(shape, s, doubled, Workload(s.seq_len)).optimizer == pytest.approx(t.optimizer / 2)


def test_eager_operations_count_lora_targets_and_recomputed_forwards():
    from anyfit.planning.time import LAYER_OPS, LORA_OPS, OUTPUT_OPS, eager_operations

    shape = llama(256, 1024, 4, 4)
    assert eager_operations(shape, setup()) == 4 * LAYER_OPS + OUTPUT_OPS
    lora = setup(method="lora", lora_targets="all-linear")
    assert eager_operations(shape, lora) == 4 * (LAYER_OPS + 7 * LORA_OPS) + OUTPUT_OPS
    assert eager_operations(shape, setup(gradient_checkpointing=True)) == 4 * LAYER_OPS * 1.5 + OUTPUT_OPS


def test_a_lora_adapters_flops_run_at_the_measured_rate_of_thin_matmuls():
    from anyfit.hardware.calibration import MachineRates

    shape = llama(576, 1536, 30, 9, vocab=49152)
    s = setup(device="cpu", precision="fp32", method="lora", lora_r=16, lora_targets="all-linear")
    slow, fast = (MachineRates("k", {1024: 0.2}, {1: 50.0}, 0.0, {16: rate}) for rate in (0.01, 0.02))
    adapter = 6.0 * shape.lora_params(16, "all-linear", experts=False) * s.micro_batch * s.seq_len
    gap = step_time(shape, s, _measured_cpu(slow), Workload(s.seq_len)).compute - \
        step_time(shape, s, _measured_cpu(fast), Workload(s.seq_len)).compute
    assert gap == pytest.approx(adapter / 0.01e12 - adapter / 0.02e12)


@pytest.mark.parametrize("method, per_head", [("full", 6), ("lora", 4)])
def test_the_head_and_loss_are_timed_at_trained_positions_only(method, per_head):
    """anyfit computes logits only where the next token trains (logits_to_keep), and its MFU counts the head there
    (anyfit.profiling.flops): the plan's FLOPs and the output's streamed bytes follow the trained share; memory
    still plans every position (one micro-batch can be all answer)."""
    from anyfit.profiling.flops import ModelFlops

    shape = llama(576, 1536, 30, 9, vocab=49152)
    head = 49152 * 576
    every, quarter = setup(method=method), setup(method=method, trained_share=0.25)
    assert flops_per_token(shape, every) - flops_per_token(shape, quarter) == pytest.approx(0.75 * per_head * head)
    fused = dataclasses.replace(quarter, fused_loss=True)
    assert flops_per_token(shape, fused) - flops_per_token(shape, quarter) == pytest.approx(2 * 0.25 * head)
    output = shape.vocab_size * (4 * 2 + 28)
    assert streamed_bytes_per_token(shape, every) - streamed_bytes_per_token(shape, quarter) == \
        pytest.approx(0.75 * output)
    # the run's MFU counts the same head FLOPs per trained token
    assert ModelFlops.of(shape, 1 if method == "lora" else 0).head_per_trained_token == per_head * head
    h100 = PRESETS["h100"]
    assert step_time(shape, every, h100, Workload(2048, 0.25)).compute < step_time(shape, every, h100,
                                                                                  Workload(2048)).compute
    assert estimate_memory(shape, quarter).peak == estimate_memory(shape, every).peak

"""This machine's measured rates: measured in a bounded time, kept per machine, the best one seen kept."""

import json

import pytest


def test_measuring_is_bounded_leaves_the_seeded_rng_alone_and_gives_every_rate():
    import torch

    from anyfit.hardware.calibration import (
        LORA_RANKS,
        MATMUL_WIDTHS,
        STREAM_BYTES,
        machine_key,
        measure_rates,
    )

    torch.manual_seed(0)
    expected = torch.rand(4)
    torch.manual_seed(0)
    rates = measure_rates("cpu", "fp32", seconds=0.05, passes=1)
    assert torch.equal(torch.rand(4), expected)
    assert rates.key == machine_key("cpu", "fp32")
    assert set(rates.matmul_tflops) == set(MATMUL_WIDTHS) and set(rates.stream_gbs) == set(STREAM_BYTES)
    assert set(rates.adapter_tflops) == set(LORA_RANKS)
    measured = [*rates.matmul_tflops.values(), *rates.stream_gbs.values(), *rates.adapter_tflops.values()]
    assert all(v > 0 for v in [*measured, rates.op_seconds])


def test_the_key_names_processor_cores_threads_torch_and_dtype(monkeypatch):
    import torch

    from anyfit.hardware import calibration

    key = calibration.machine_key("cpu", "fp32")
    assert key.startswith("cpu|fp32|") and f"torch {torch.__version__}" in key
    assert f"{torch.get_num_threads()} threads" in key and calibration.processor_name() in key
    monkeypatch.setattr(calibration, "processor_name", lambda: "Another CPU")
    assert calibration.machine_key("cpu", "fp32") != key != calibration.machine_key("cpu", "bf16")


def test_the_cache_keeps_the_best_rates_per_key_and_a_refresh_forgets_them(tmp_path, monkeypatch):
    from anyfit.hardware import calibration
    from anyfit.hardware.calibration import (
        MachineRates,
        known_rates,
        machine_key,
        machine_rates,
        record_rates,
    )

    monkeypatch.setenv("ANYFIT_CACHE", str(tmp_path))
    assert known_rates() is None
    key = machine_key("cpu", "fp32")
    slow = MachineRates(key, {128: 0.01, 1024: 0.1}, {1 << 20: 50.0}, 9e-6, {16: 0.02})
    fast = MachineRates(key, {128: 0.02, 1024: 0.05}, {1 << 20: 80.0}, 4e-6, {16: 0.01})
    record_rates(slow)
    kept = record_rates(fast)
    assert kept.matmul_tflops == {128: 0.02, 1024: 0.1} and kept.stream_gbs == {1 << 20: 80.0}
    assert kept.op_seconds == 4e-6 and kept.adapter_tflops == {16: 0.02}
    assert known_rates() == kept
    assert key in json.loads((tmp_path / calibration.RATES_FILE).read_text())
    monkeypatch.setattr(calibration, "measure_rates", lambda device, dtype: slow)
    assert machine_rates() == kept  # cached: not measured again
    assert machine_rates(refresh=True) == slow  # measured again, the old entry forgotten


@pytest.mark.parametrize(("x", "expected"), [(64, 0.1), (128, 0.1), (362, 0.15), (1024, 0.2), (4096, 0.2)])
def test_rates_between_measured_sizes_are_log_interpolated(x, expected):
    from anyfit.hardware.calibration import MachineRates

    rates = MachineRates("k", {128: 0.1, 1024: 0.2}, {1: 1.0}, 1e-6, {16: 0.01})
    assert rates.matmul_at(x) == pytest.approx(expected, rel=0.01)


def test_an_older_or_damaged_entry_is_measured_again(tmp_path, monkeypatch):
    from anyfit.hardware import calibration
    from anyfit.hardware.calibration import (
        MachineRates,
        known_rates,
        machine_key,
        machine_rates,
    )

    monkeypatch.setenv("ANYFIT_CACHE", str(tmp_path))
    (tmp_path / calibration.RATES_FILE).write_text(json.dumps({machine_key("cpu", "fp32"): {"matmul_tflops": 1}}))
    assert known_rates() is None
    fresh = MachineRates(machine_key("cpu", "fp32"), {1024: 0.1}, {1: 1.0}, 1e-6, {16: 0.01})
    monkeypatch.setattr(calibration, "measure_rates", lambda device, dtype: fresh)
    assert machine_rates() == fresh == known_rates()

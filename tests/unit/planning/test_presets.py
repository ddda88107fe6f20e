"""The device presets' helpers."""

def test_measuring_the_matmul_rate_leaves_the_seeded_rng_alone():
    """A run measures its MFU peak after seeding: drawing from the global RNG would move LoRA dropout and losses."""
    import torch

    from anyfit.planning.presets import measure_matmul_tflops

    torch.manual_seed(0)
    expected = torch.rand(4)
    torch.manual_seed(0)
    assert measure_matmul_tflops("cpu", seconds=0.01, n=64) > 0
    assert torch.equal(torch.rand(4), expected)


def test_the_matmul_peak_is_the_best_seen_on_this_machine(tmp_path, monkeypatch):
    # A timing taken while the cores are shared reads low: the peak MFU is measured against is the best one kept.
    import json

    from anyfit.planning.presets import best_matmul_tflops

    monkeypatch.setenv("ANYFIT_CACHE", str(tmp_path))
    first = best_matmul_tflops("cpu")
    stored = json.loads((tmp_path / "machine_peaks.json").read_text())
    assert list(stored.values()) == [first]
    key = next(iter(stored))
    (tmp_path / "machine_peaks.json").write_text(json.dumps({key: first * 1000}))
    assert best_matmul_tflops("cpu") == first * 1000  # an earlier, better measurement stands


def test_this_machine_plans_with_its_measured_rates_once_they_are_known(tmp_path, monkeypatch):
    from anyfit.hardware.calibration import MachineRates, machine_key, record_rates
    from anyfit.planning.presets import CPU_TFLOPS_PER_CORE, this_machine

    monkeypatch.setenv("ANYFIT_CACHE", str(tmp_path))
    assumed = this_machine()
    assert assumed.rates is None and assumed.measured == {} and "assumed" in assumed.note  # nothing measured yet
    rates = record_rates(MachineRates(machine_key("cpu", "fp32"), {128: 0.05, 1024: 0.3}, {1 << 26: 30.0}, 5e-6,
                                      {16: 0.01}))
    target = this_machine()
    assert target.rates == rates and target.bandwidth_gbs == 30.0 and "measured rates" in target.note
    assert target.tflops("fp32") == 0.3 != CPU_TFLOPS_PER_CORE

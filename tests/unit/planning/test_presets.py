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


def test_this_machine_plans_with_the_measured_rate_once_one_is_known(tmp_path, monkeypatch):
    from anyfit.planning.presets import CPU_TFLOPS_PER_CORE, best_matmul_tflops, known_matmul_tflops, this_machine

    monkeypatch.setenv("ANYFIT_CACHE", str(tmp_path))
    assert known_matmul_tflops("cpu") is None and this_machine().measured == {}  # the per-core assumption
    best = best_matmul_tflops("cpu")
    target = this_machine()
    assert target.measured == {"fp32": best} and "measured" in target.note
    assert target.tflops("fp32") == best != CPU_TFLOPS_PER_CORE

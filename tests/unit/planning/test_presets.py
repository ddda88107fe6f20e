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

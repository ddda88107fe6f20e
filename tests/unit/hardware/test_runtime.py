import pytest
import torch

from anyfit.config import ConfigError, RuntimeConfig
from anyfit.hardware.runtime import Hardware, resolve_runtime

CPU = Hardware(cuda=False)
MAC = Hardware(cuda=False, mps=True)
T4 = Hardware(cuda=True, cuda_name="Tesla T4", cuda_capability=(7, 5), cuda_count=1)
H100 = Hardware(cuda=True, cuda_name="NVIDIA H100 80GB HBM3", cuda_capability=(9, 0), cuda_count=8)


@pytest.mark.parametrize("hw,device,precision,tf32", [
    (CPU, "cpu", "fp32", False), (MAC, "mps", "fp32", False), (T4, "cuda", "fp16", False), (H100, "cuda", "bf16", True)])
def test_auto_policy(hw, device, precision, tf32):
    p = resolve_runtime(RuntimeConfig(), hw)
    assert (p.device, p.precision, p.tf32) == (device, precision, tf32)
    assert p.reasons and "precision" in p.describe()


def test_t4_fp16_gets_loss_scaling_via_accelerate():
    assert resolve_runtime(RuntimeConfig(), T4).mixed_precision == "fp16"


def test_bf16_on_mps_only_when_asked():
    assert resolve_runtime(RuntimeConfig(precision="bf16"), MAC).precision == "bf16"


@pytest.mark.parametrize("cfg,hw,needle", [
    (RuntimeConfig(precision="fp16"), CPU, "Use runtime.precision=fp32"),
    (RuntimeConfig(precision="fp16"), MAC, "NaN"),
    (RuntimeConfig(precision="bf16"), T4, "Use runtime.precision=fp16"),
    (RuntimeConfig(device="cuda"), CPU, "no CUDA GPU"),
    (RuntimeConfig(device="mps"), CPU, "MPS backend is not available"),
])
def test_impossible_requests_fail_fast(cfg, hw, needle):
    with pytest.raises(ConfigError, match=needle):
        resolve_runtime(cfg, hw)


def test_qlora_needs_cuda_or_a_cpu_bitsandbytes(monkeypatch):
    with pytest.raises(ConfigError, match="needs CUDA or the CPU"):
        resolve_runtime(RuntimeConfig(), MAC, qlora=True)
    assert resolve_runtime(RuntimeConfig(), T4, qlora=True).device == "cuda"
    from anyfit.hardware import runtime

    monkeypatch.setattr(runtime, "bitsandbytes_cpu_problem", lambda: "bitsandbytes 0.45.0 is installed")
    with pytest.raises(ConfigError, match=r"on the CPU needs bitsandbytes>=0\.50.*0\.45\.0 is installed"):
        resolve_runtime(RuntimeConfig(), CPU, qlora=True)
    monkeypatch.setattr(runtime, "bitsandbytes_cpu_problem", lambda: "")
    assert resolve_runtime(RuntimeConfig(), CPU, qlora=True).device == "cpu"


def test_cpu_forced_on_a_gpu_machine():
    p = resolve_runtime(RuntimeConfig(device="cpu"), H100)
    assert (p.device, p.precision) == ("cpu", "fp32")


def test_inference_follows_the_training_policy():
    """One policy: eval/generate get the dtype training would compute in; never fp16 on MPS by default."""
    from anyfit.hardware.runtime import inference_policy

    assert inference_policy("auto", "auto", MAC).precision == "fp32"
    assert inference_policy("auto", "auto", T4).precision == "fp16"
    assert inference_policy("auto", "auto", H100).compute_dtype == torch.bfloat16
    assert inference_policy("auto", torch.float16, MAC).precision == "fp16"  # asked for: fine without gradients
    with pytest.raises(ConfigError):
        resolve_runtime(RuntimeConfig(precision="fp16"), MAC)  # training refuses it (no loss scaling)
    with pytest.raises(ConfigError, match="emulated"):
        inference_policy("auto", "bfloat16", T4)
    with pytest.raises(ConfigError, match="dtype"):
        inference_policy("auto", "int8", H100)


def test_batch_workers_are_part_of_the_policy_with_a_reason():
    gpu = resolve_runtime(RuntimeConfig(), H100)
    cpu = resolve_runtime(RuntimeConfig(device="cpu"), H100)
    assert (gpu.num_workers, gpu.pin_memory, cpu.num_workers, cpu.pin_memory) == (2, True, 0, False)
    assert any(r.startswith("batch workers 0") for r in cpu.reasons) and "batch workers=2" in gpu.describe()
    assert resolve_runtime(RuntimeConfig(device="cpu", num_workers=3), H100).num_workers == 3


def test_weight_dtype_is_one_rule():
    from anyfit.hardware.runtime import weight_dtype

    assert weight_dtype("auto", False, "cuda", "bf16") == torch.float32  # fp32 master weights
    assert weight_dtype("auto", True, "cuda", "bf16") == torch.bfloat16  # a frozen LoRA base in the compute dtype
    assert weight_dtype("auto", True, "cpu", "fp32") == torch.float32
    assert weight_dtype("float16", False, "cpu", "fp32") == torch.float16

"""Reading a trace: phases, communication, host syncs and device idle time from hand-made spans."""

from __future__ import annotations

import pytest

from anyfit.profiling.trace import Span, mean_step, step_times, union_seconds


def test_union_counts_overlaps_once():
    assert union_seconds([Span("a", 0, 2), Span("b", 1, 3), Span("c", 5, 6)]) == pytest.approx(4)
    assert union_seconds([Span("a", 0, 10), Span("b", 2, 3)]) == pytest.approx(10)


def _step(offset: float, device: bool) -> list[Span]:
    o = offset
    spans = [Span("ProfilerStep#3", o, o + 10), Span("anyfit.data_wait", o, o + 1), Span("anyfit.h2d", o + 1, o + 1.5),
             Span("anyfit.forward", o + 1.5, o + 3), Span("anyfit.loss", o + 2.5, o + 3),
             Span("anyfit.backward", o + 3, o + 6), Span("ChunkedCrossEntropyBackward", o + 3, o + 3.5),
             Span("c10d::allreduce_", o + 5, o + 6.5), Span("gloo:all_reduce", o + 5.5, o + 6.5),
             Span("anyfit.forward", o + 6, o + 6.5), Span("anyfit.backward", o + 6.5, o + 7),
             Span("anyfit.optimizer", o + 7, o + 9), Span("aten::_local_scalar_dense", o + 8, o + 8.2)]
    if device:
        spans += [Span("ampere_sgemm_128x64", o + 2, o + 4, True), Span("vectorized_elementwise", o + 4, o + 5, True),
                  Span("ncclDevKernel_AllReduce_Sum", o + 5, o + 6, True)]
    return spans


def test_phases_communication_syncs_and_idle():
    (cpu,) = step_times(_step(0, device=False))
    assert cpu.wall == pytest.approx(10)
    assert cpu.phases == pytest.approx({"data_wait": 1, "h2d": 0.5, "forward": 2, "backward": 3.5, "optimizer": 2,
                                        "other": 1})
    assert cpu.micro == pytest.approx([4.5, 1.0])  # two micro-batches: forward + backward each
    assert cpu.communication == pytest.approx(1.5) and cpu.host_syncs == 1 and cpu.host_sync == pytest.approx(0.2)
    assert cpu.loss == pytest.approx(1.0) and cpu.device_idle is None
    (gpu,) = step_times(_step(0, device=True))
    assert gpu.device_busy == pytest.approx(4) and gpu.device_idle == pytest.approx(6)
    assert gpu.device_matmul == pytest.approx(2) and gpu.communication == pytest.approx(1)


def test_mean_over_steps():
    mean = mean_step(step_times(_step(0, False) + _step(20, False)))
    assert mean.wall == pytest.approx(10) and len(mean.micro) == 4


def test_sequence_parallelisms_all_to_alls_are_named_within_communication():
    """Ulysses' all-to-alls: gloo's host ops on a CPU, NCCL's grouped send/recv kernels on CUDA; the gradient
    all-reduce stays communication only."""
    o = 0.0
    host = [Span("ProfilerStep#1", o, o + 10), Span("anyfit.forward", o, o + 4), Span("anyfit.backward", o + 4, o + 9),
            Span("c10d::alltoall_base_", o + 1, o + 1.5), Span("gloo:all_to_all", o + 1.1, o + 1.4),
            Span("c10d::alltoall_base_", o + 5, o + 5.5), Span("c10d::allreduce_", o + 8, o + 9)]
    (cpu,) = step_times(host)
    assert cpu.exchange == pytest.approx(1.0) and cpu.communication == pytest.approx(2.0)
    kernels = [Span("ncclDevKernel_SendRecv", o + 1, o + 1.2, True), Span("ncclDevKernel_SendRecv", o + 5, o + 5.3, True),
               Span("ncclDevKernel_AllReduce_Sum", o + 8, o + 8.5, True)]
    (gpu,) = step_times(host + kernels)
    assert gpu.exchange == pytest.approx(0.5) and gpu.communication == pytest.approx(1.0)
    assert mean_step([cpu, gpu]).exchange == pytest.approx(0.75)

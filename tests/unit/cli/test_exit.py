"""The ``anyfit`` command's exit under a launcher: the run's model goes before its process group.

DDP's reducer holds the process group from C++. When it is the group's last holder it destroys the group with the
GIL held, and gloo's destructor waits for a worker thread that may need the GIL to free the last collective's
tensors: a two-process run once hung there at exit. So ``train()`` leaves the group alive, and ``anyfit.cli.run``
destroys it from Python (``end_process_group``) after ``main`` has returned and the model is gone."""

from __future__ import annotations

import gc
import sys
import weakref

import pytest
import torch
import torch.distributed as dist

import anyfit.cli


def test_the_process_group_ends_after_the_run_and_its_model(monkeypatch):
    seen: list[bool] = []

    def a_run_under_a_launcher(argv=None) -> int:
        dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
        model = torch.nn.parallel.DistributedDataParallel(torch.nn.Linear(2, 2))
        model(torch.ones(1, 2)).sum().backward()  # the reducer's all-reduce over gloo
        weakref.finalize(model, lambda: seen.append(dist.is_initialized()))
        return 0

    monkeypatch.setattr(anyfit.cli, "main", a_run_under_a_launcher)
    monkeypatch.setattr(sys, "argv", ["anyfit", "train"])
    try:
        with pytest.raises(SystemExit) as exit_:
            anyfit.cli.run()
        ended = not dist.is_initialized()
    finally:
        gc.unfreeze()  # run() leaves the objects of a finished command to the exit; this process goes on
        if dist.is_initialized():
            dist.destroy_process_group()
    assert exit_.value.code == 0
    assert seen == [True]  # the model was freed while its group was alive
    assert ended  # and the group was destroyed before the exit


def test_ending_without_a_process_group_is_nothing():
    from anyfit.hardware.runtime import end_process_group

    assert not dist.is_initialized()
    end_process_group()

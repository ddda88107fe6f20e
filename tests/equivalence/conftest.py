"""Fixtures of the equivalence tests that several modules compare against.

The suite runs under pytest-xdist (``--dist loadfile``: a module's tests stay on one worker, so a module-scoped
run is made once), but these references are shared by several modules, which may land on different workers. Each
is made once for the whole session all the same, the way xdist's documentation describes: the first worker to
ask makes it under a file lock in the session's shared temporary folder and records where, the others wait and
reuse it. Without xdist they are plain session fixtures."""

from __future__ import annotations

import json
import os
from collections.abc import Callable
from pathlib import Path

import pytest
from filelock import FileLock
from launches import complete_run


def _made_once(tmp_path_factory, name: str, make: Callable[[], Path]) -> Path:
    if "PYTEST_XDIST_WORKER" not in os.environ:  # one process (-n 0, or no xdist): the session fixture is once
        return make()
    shared = tmp_path_factory.getbasetemp().parent  # pytest-N/, the parent of every worker's gwK/
    record = shared / f"{name}.json"
    with FileLock(str(record) + ".lock"):
        if record.is_file():
            return Path(json.loads(record.read_text())["out"])
        out = make()
        record.write_text(json.dumps({"out": str(out)}))
        return out


@pytest.fixture(scope="session")
def unsharded(tiny_llama_dir, tmp_path_factory) -> Path:
    """The reference of the multi-process tests: the tiny run on one process, no sharding (the tiny Llama with the
    1,000-token vocabulary: these tests are about the processes, not the head; every process of every launch then
    loads its tokenizer in 0.01 s instead of Qwen's whole 151k in 1.5 s)."""
    return _made_once(tmp_path_factory, "unsharded",
                      lambda: complete_run(tmp_path_factory, tiny_llama_dir, "unsharded", 1, "none")[0])


@pytest.fixture(scope="session")
def two_processes(tiny_llama_dir, tmp_path_factory) -> Path:
    """A complete FSDP2 run on two processes, one reduce-scatter per window (the reference of the restart test and
    of the reduce-every-micro-batch one)."""
    return _made_once(tmp_path_factory, "two_processes",
                      lambda: complete_run(tmp_path_factory, tiny_llama_dir, "two", 2, "fsdp")[0])

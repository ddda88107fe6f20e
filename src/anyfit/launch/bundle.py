"""What a launch ships: the resolved config, the anyfit wheel of this checkout, the pinned versions as constraints,
and the local files the config names, content-addressed.

The bundle is a folder (``$ANYFIT_CACHE/launch`` here, a private Hub dataset repo or SkyPilot's upload there):

- ``blobs/<sha256>``: every shipped file once, whatever its name and whichever launch ships it again;
- ``launches/<run>/``: ``config.yaml`` (the config as resolved, every override in, its local paths made relative to
  the job's work folder), ``constraints.txt``, ``launch.json`` (files, store, GPUs) and ``job.sh``, the job's
  whole command.

Hub models and data sets are named, not copied: the job downloads them (``anyfit download``).
"""

from __future__ import annotations

import glob
import hashlib
import json
import shlex
import shutil
import subprocess
from dataclasses import dataclass, field
from pathlib import Path

import anyfit
from anyfit.config import Config, ConfigError

try:
    import tomllib
except ModuleNotFoundError:  # Python 3.10: tomli, the package tomllib came from (a dependency there)
    import tomli as tomllib
from anyfit.config.schema import TRACKERS

# The config keys that may name a local file or folder (data.mix entries and their templates too).
PATH_KEYS = ("model.name_or_path", "model.tokenizer", "data.path", "eval.path", "data.chat_template")


def sha256(path: Path) -> str:
    h = hashlib.sha256()
    with path.open("rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


@dataclass
class Shipped:
    """The local files of a launch: ``files`` maps each path in the job's work folder to the local file;
    ``hub`` lists the hub names the job downloads itself."""

    files: dict[str, Path] = field(default_factory=dict)
    digests: dict[str, str] = field(default_factory=dict)
    hub: list[str] = field(default_factory=list)

    def add(self, key: str, value: str, base: Path) -> str:
        """The job's name for the local path ``value`` of ``key`` (its files added), or ``value`` itself (a hub
        name, or a template text). A local path outside ``base`` is refused."""
        path = Path(value).expanduser()
        matches = [Path(m) for m in sorted(glob.glob(str(path)))] if glob.has_magic(str(path)) else []
        if not path.exists() and not matches:
            if key == "data.chat_template" and not value.endswith(".jinja"):
                return value  # the template text itself
            if key == "data.chat_template":
                raise ConfigError(f"{key}={value}: the file does not exist.")
            self.hub.append(value)
            return value
        parts = path.parts
        first_magic = next((i for i, part in enumerate(parts) if glob.has_magic(part)), len(parts))
        root = path if path.exists() else Path(*parts[:first_magic])
        if not root.resolve().is_relative_to(base.resolve()):
            raise ConfigError(f"{key}={value} is outside the config's folder {base}: the job gets the files under it; "
                              "move the file there (or launch from a folder that holds both).")
        anchor = root if root.is_dir() else root.parent
        files = matches or ([path] if path.is_file() else sorted(path.rglob("*")))
        listing = sorted((f.relative_to(anchor).as_posix(), f) for f in files if f.is_file())
        digests = [(rel, sha256(f)) for rel, f in listing]
        folder = f"files/{hashlib.sha256(json.dumps(digests).encode()).hexdigest()[:12]}"
        for (rel, f), (_, digest) in zip(listing, digests):
            self.files[f"{folder}/{rel}"] = f
            self.digests[f"{folder}/{rel}"] = digest
        if root.is_dir():
            return f"{folder}/{path.relative_to(root).as_posix()}".rstrip("/.") if path != root else folder
        return f"{folder}/{path.name}"


def ship_config(cfg: Config, base: Path) -> tuple[Config, Shipped]:
    """The config as the job runs it (local paths replaced by their place in the work folder, the output in
    ``run``) and what it ships. ``cfg`` is resolved already (validated, every override in)."""
    shipped = Shipped()
    for key in PATH_KEYS:
        value = cfg.value(key)
        if value:
            section, name = key.split(".")
            setattr(getattr(cfg, section), name, shipped.add(key, value, base))
    for entry in cfg.data.mix:
        entry["path"] = shipped.add("data.mix path", entry["path"], base)
        if entry.get("chat_template"):
            entry["chat_template"] = shipped.add("data.chat_template", entry["chat_template"], base)
    cfg.train.output_dir = "run"
    cfg.train.resume = None  # the job resumes from what the store holds (train.resume=auto, on its command)
    cfg.data.cache_dir = None
    return cfg, shipped


def checkout_root() -> Path:
    """The source checkout anyfit runs from (the wheel is built from it); refused when anyfit is installed from
    a wheel, since the job must install the very code that passed here."""
    root = Path(anyfit.__file__).resolve().parents[2]
    if not (root / "pyproject.toml").is_file():
        raise ConfigError("anyfit launch builds the anyfit wheel from its source checkout, and this anyfit is "
                          f"installed without one ({root}): run it from a clone (uv sync, or pip install -e .).")
    return root


def build_wheel(out: Path) -> Path:
    """``uv build --wheel`` of this checkout into ``out`` (anyfit is not on PyPI: the job installs this wheel)."""
    root = checkout_root()
    out.mkdir(parents=True, exist_ok=True)
    for old in out.glob("anyfit-*.whl"):
        old.unlink()
    uv = shutil.which("uv")
    if uv is None:
        raise ConfigError("anyfit launch needs uv to build the anyfit wheel: pip install uv.")
    done = subprocess.run([uv, "build", "--wheel", "-q", "-o", str(out), str(root)], capture_output=True, text=True)
    wheels = sorted(out.glob("anyfit-*.whl"))
    if done.returncode or not wheels:
        raise ConfigError(f"uv build --wheel of {root} failed: {' '.join(done.stderr.split())[-300:]}")
    return wheels[0]


def constraints() -> str:
    """pyproject.toml's exact pins (``[tool.uv] constraint-dependencies``), one a line, as the job installs them."""
    data = tomllib.loads((checkout_root() / "pyproject.toml").read_text())
    return "\n".join(data["tool"]["uv"]["constraint-dependencies"]) + "\n"


def extras(cfg: Config, gpu: bool) -> list[str]:
    """The anyfit extras the job installs: the trackers of train.report_to, the CUDA extra where the config uses
    bitsandbytes or torchao on a GPU, DeepSpeed when it shards with it."""
    report = cfg.train.report_to if isinstance(cfg.train.report_to, list) else [cfg.train.report_to]
    out = [t for t in report if t in TRACKERS]
    if gpu and (cfg.lora.qlora or "8bit" in cfg.train.optimizer):
        out.append("cuda")
    if cfg.runtime.sharding == "deepspeed":
        out.append("deepspeed")
    return out


def job_script(run: str, wheel: str, wheel_digest: str, extra: list[str], python: str) -> str:
    """The job's whole command: install this wheel with the pinned constraints in a fresh environment, then
    ``anyfit.launch.remote``. Run as is by the tests, in a fresh folder and virtual environment."""
    spec = f"anyfit[{','.join(extra)}]" if extra else "anyfit"
    return f"""#!/usr/bin/env bash
# anyfit launch {run}: the job's command, written by `anyfit launch` (bundle: ../../blobs, this launch: here).
set -euo pipefail
HERE="$(cd "$(dirname "${{BASH_SOURCE[0]}}")" && pwd)"
BUNDLE="$(cd "$HERE/../.." && pwd)"
WORK="${{ANYFIT_WORK:-$PWD/anyfit-work}}"
mkdir -p "$WORK/wheel"
ln -sf "$BUNDLE/blobs/{wheel_digest}" "$WORK/wheel/{wheel}"
uv venv -q --allow-existing --python {python} "$WORK/venv"
uv pip install -q -p "$WORK/venv" "{spec} @ file://$WORK/wheel/{wheel}" -c "$HERE/constraints.txt"
exec "$WORK/venv/bin/python" -m anyfit.launch.remote "$HERE/launch.json" "$WORK"
"""


@dataclass
class Bundle:
    """A launch's files, staged: ``root`` (the bundle folder), ``run``; ``blobs`` (digest -> local file) and the
    launch folder's own files (name -> text)."""

    root: Path
    run: str
    blobs: dict[str, Path]
    texts: dict[str, str]
    shipped: Shipped

    @property
    def launch_dir(self) -> str:
        return f"launches/{self.run}"

    def command(self, mount: str) -> list[str]:
        return ["bash", f"{mount}/{self.launch_dir}/job.sh"]

    def sizes(self) -> list[tuple[str, int]]:
        """(name in the job's work folder, bytes) of every shipped file, the wheel first."""
        return [(name, self.blobs[digest].stat().st_size) for name, digest in self.names().items()]

    def names(self) -> dict[str, str]:
        launch = json.loads(self.texts["launch.json"])
        return {f"wheel/{launch['wheel'][0]}": launch["wheel"][1], **launch["files"]}

    def write(self) -> Path:
        """Copy what is new into the staging folder (blobs once), and the launch folder; its path."""
        (self.root / "blobs").mkdir(parents=True, exist_ok=True)
        for digest, path in self.blobs.items():
            target = self.root / "blobs" / digest
            if not target.exists():
                tmp = target.with_name(f".{digest}.partial")
                shutil.copyfile(path, tmp)
                tmp.replace(target)
        folder = self.root / self.launch_dir
        folder.mkdir(parents=True, exist_ok=True)
        for name, text in self.texts.items():
            (folder / name).write_text(text)
        (folder / "job.sh").chmod(0o755)
        return folder


def make_bundle(cfg: Config, base: Path, root: Path, run: str, *, store: str, gpus: int, gpu: bool,
                sync_every: float = 30.0, python: str = "3.11") -> Bundle:
    """Stage a launch of the resolved ``cfg`` (its local paths under ``base``) into the bundle folder ``root``."""
    job_cfg, shipped = ship_config(cfg, base)
    wheel = build_wheel(root / ".wheel")
    wheel_digest = sha256(wheel)
    blobs = {wheel_digest: wheel, **{shipped.digests[n]: p for n, p in shipped.files.items()}}
    launch = {"run": run, "files": shipped.digests, "store": store, "gpus": gpus, "output_dir": "run",
              "sync_every": sync_every, "wheel": [wheel.name, wheel_digest]}
    texts = {"config.yaml": job_cfg.to_yaml(), "constraints.txt": constraints(),
             "launch.json": json.dumps(launch, indent=1),
             "job.sh": job_script(run, wheel.name, wheel_digest, extras(cfg, gpu), shlex.quote(python))}
    return Bundle(root, run, blobs, texts, shipped)

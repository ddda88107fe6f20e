"""Whether a checkpoint folder can be trusted, and which one to resume from.

Every checkpoint ends with ``manifest.json``: the size and sha256 of every other file, written last. Sizes
are compared whenever checkpoints are listed; hashes when one is chosen to resume from. The manifest catches
what the temporary-name-then-rename of a save cannot: a file truncated or zeroed later (a full disk, a copy
cut short, a crash before the data reached the disk). Its file table is ``anyfit.durable``'s, as the token store's.

Checkpoints written before manifests existed (``trainer_state.json`` but no ``manifest.json``) are still
accepted, checked by their structure instead: every safetensors header must account for the file's size
and every ``.pt`` file must be a readable zip archive (with ``full`` checks, its members' CRCs too).
"""

from __future__ import annotations

import json
import sys
import zipfile
from pathlib import Path
from typing import Callable

from anyfit import durable
from anyfit.backends import unlisted_states
from anyfit.config import ConfigError
from anyfit.durable import HASH, MANIFEST
from anyfit.runfolder import checkpoint_dirs

STATE = "trainer_state.json"
SCHEDULER = "scheduler.pt"
# Files a checkpoint from before manifests has besides its *.safetensors (replicated: sharded ones always had one).
REQUIRED = (STATE, "optimizer.pt", SCHEDULER)


def complete_checkpoints(output_dir: Path, full: bool = False) -> list[Path]:
    """Checkpoints that pass :func:`checkpoint_problem`, oldest first. Sizes only unless ``full``
    (which reads every byte: for choosing one to resume from, not for listing)."""
    return [p for p in checkpoint_dirs(output_dir) if checkpoint_problem(p, full) is None]


def write_manifest(directory: Path) -> None:
    """Record the size and hash of every file in ``directory``; call it after every other file is written."""
    names = [p.relative_to(directory).as_posix() for p in sorted(directory.rglob("*"))
             if p.is_file() and p.name != MANIFEST]
    durable.write_manifest(directory, names, {"format": 1, "hash": HASH})


def _unlisted(names: set[str]) -> list[str]:
    """The parts every checkpoint has that a manifest does not list: anyfit's own files, then the model and
    optimizer states as the backend that wrote them lays them out (``anyfit.backends.unlisted_states``)."""
    return [name for name in (STATE, SCHEDULER) if name not in names] + unlisted_states(names)


def checkpoint_problem(directory: Path, full: bool = True) -> str | None:
    """What is wrong with a checkpoint folder, in a few words naming the file; None when it is usable.

    Sizes are always compared with the manifest; ``full`` also compares every file's hash (reads it all:
    about 0.7 s per GB here). A folder without a manifest is an older anyfit checkpoint when it has
    ``trainer_state.json``: its structure is checked instead (see the module docstring).
    """
    if not (directory / MANIFEST).is_file():
        if not (directory / STATE).is_file():
            return f"incomplete: no {MANIFEST} or {STATE} (the save did not finish)"
        return _structure_problem(directory, full)
    manifest = durable.read_manifest(directory)
    if manifest is None or manifest.get("hash") != HASH:
        return f"{MANIFEST} is damaged (not the manifest anyfit writes)"
    unlisted = _unlisted(set(manifest["files"]))
    if unlisted:
        return f"{MANIFEST} does not list {', '.join(unlisted)}"
    return durable.manifest_problem(directory, manifest["files"], verify=full)


def _structure_problem(directory: Path, full: bool) -> str | None:
    """Checks for a checkpoint without a manifest: what each file's own format says about its length."""
    for name in REQUIRED:
        if not (directory / name).is_file():
            return f"{name} is missing"
    try:
        json.loads((directory / STATE).read_text())["step"]
    except (OSError, UnicodeDecodeError, ValueError, KeyError, TypeError):
        return f"{STATE} is damaged"
    weights = sorted(directory.glob("*.safetensors"))
    if not weights:
        return "no weights (*.safetensors)"
    for path in weights:
        problem = _safetensors_problem(path)
        if problem:
            return f"{path.name} {problem}"
    for path in sorted(directory.glob("*.pt")):
        try:
            with zipfile.ZipFile(path) as z:  # reads the central directory at the end: gone when truncated
                bad = z.testzip() if full else None  # CRC of every member
        except (OSError, zipfile.BadZipFile, EOFError, ValueError):
            return f"{path.name} is not a readable archive (truncated or damaged)"
        if bad:
            return f"{path.name} is damaged ({bad} fails its CRC)"
    return None


def _safetensors_problem(path: Path) -> str | None:
    """A safetensors file is an 8-byte header length, a JSON header and the tensor bytes it describes."""
    size = path.stat().st_size
    try:
        with path.open("rb") as f:
            n = int.from_bytes(f.read(8), "little")
            if not 2 <= n <= size - 8:
                return "has no valid header (truncated or zeroed)"
            header = json.loads(f.read(n))
        end = max([t["data_offsets"][1] for k, t in header.items() if k != "__metadata__"], default=0)
    except (OSError, UnicodeDecodeError, ValueError, KeyError, TypeError, IndexError):
        return "has a damaged header"
    if 8 + n + end != size:
        return f"has {size} bytes, its header describes {8 + n + end} (truncated)"
    return None


def _warn(line: str) -> None:
    print(line, file=sys.stderr)


def resolve_resume(spec: str | None, output_dir: Path, warn: Callable[[str], None] | None = None) -> Path | None:
    """The checkpoint to resume from: None for a fresh run; 'auto' picks the newest intact one (hashes
    checked), saying in one line through ``warn`` (default: stderr) which newer ones it skipped and why."""
    warn = warn or _warn
    if not spec:
        return None
    if spec == "auto":
        dirs = checkpoint_dirs(output_dir)
        problems = []
        for path in reversed(dirs):
            problem = checkpoint_problem(path, full=True)
            if problem is None:
                return path
            problems.append(f"{path.name}: {problem}")
            warn(f"[anyfit] warning: skipping checkpoint {path}: {problem}")
        if problems:
            raise ConfigError(f"train.resume=auto: no intact checkpoint in {output_dir} ({'; '.join(problems)}). "
                              "Start again with train.overwrite=true, or resume from a copy of the run.")
        return None
    path = Path(spec)
    if not path.is_dir() or not ((path / STATE).is_file() or (path / MANIFEST).is_file()):
        found = [p.name for p in complete_checkpoints(path.parent)]
        raise ConfigError(f"train.resume: {path} is not a complete checkpoint (no {STATE}). "
                          + (f"Complete ones there: {', '.join(found)}. " if found else "")
                          + "Use train.resume=auto to pick the newest complete checkpoint of train.output_dir.")
    problem = checkpoint_problem(path, full=True)
    if problem:
        raise ConfigError(f"train.resume: checkpoint {path} is damaged: {problem}. Use train.resume=auto to pick "
                          "the newest intact checkpoint of train.output_dir.")
    return path

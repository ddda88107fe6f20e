"""Checkpoints and the final model.

A checkpoint is ``checkpoint-<step>/`` holding the model (safetensors; only the adapter for LoRA) and the
optimizer state (for a sharded run instead: every process's shards of both, written with
``torch.distributed.checkpoint`` under ``sharded/``), the scheduler state, each process's RNG state, ``trainer_state.json``, the resolved
``config.yaml`` and, written last, ``manifest.json``: the size and sha256 of every other file. The folder
is written under a temporary name and renamed when complete, so a crash mid-write never leaves a folder
that looks like a finished checkpoint; the manifest catches what the rename cannot: a file truncated or
zeroed later (a full disk, a copy cut short, a crash before the data reached the disk).

Checkpoints written before manifests existed (``trainer_state.json`` but no ``manifest.json``) are still
accepted, checked by their structure instead: every safetensors header must account for the file's size
and every ``.pt`` file must be a readable zip archive (with ``full`` checks, its members' CRCs too).
"""

from __future__ import annotations

import hashlib
import json
import random
import shutil
import sys
import zipfile
from pathlib import Path
from typing import Any, Callable

import numpy as np
import torch

from anyfit.training.sharding import full_state_dict, is_sharded, load_sharded, save_sharded

PREFIX = "checkpoint-"
TMP_PREFIX = ".tmp-checkpoint-"
MANIFEST = "manifest.json"
STATE = "trainer_state.json"
# Files every unsharded checkpoint has, besides at least one .safetensors file (see _unlisted for sharded ones).
REQUIRED = (STATE, "optimizer.pt", "scheduler.pt")
# A hash the user can check by hand (sha256sum) and that is hardware-accelerated on current x86 (SHA-NI)
# and ARM CPUs: measured 1.5 GB/s here, against 3.4 GB/s for zlib's crc32 (see the manifest tests).
HASH = "sha256"
BASE_RECORD = "base_model.json"  # where a LoRA output's base came from, when that takes more than a path


def checkpoint_step(path: Path) -> int | None:
    """The step of a ``checkpoint-<step>`` folder name, None for any other name."""
    tail = path.name[len(PREFIX):] if path.name.startswith(PREFIX) else ""
    return int(tail) if tail.isdigit() else None


def checkpoint_dirs(output_dir: Path) -> list[Path]:
    """Every ``checkpoint-<step>`` folder, complete or not, oldest first."""
    if not output_dir.is_dir():
        return []
    found = [p for p in output_dir.glob(f"{PREFIX}*") if p.is_dir() and checkpoint_step(p) is not None]
    return sorted(found, key=checkpoint_step)


def complete_checkpoints(output_dir: Path, full: bool = False) -> list[Path]:
    """Checkpoints that pass :func:`checkpoint_problem`, oldest first. Sizes only unless ``full``
    (which reads every byte: for choosing one to resume from, not for listing)."""
    return [p for p in checkpoint_dirs(output_dir) if checkpoint_problem(p, full) is None]


def file_hash(path: Path) -> str:
    digest = hashlib.new(HASH)  # hashlib.file_digest needs Python 3.11
    with path.open("rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


def write_manifest(directory: Path) -> None:
    """Record the size and hash of every file in ``directory``; call it after every other file is written."""
    files = {p.relative_to(directory).as_posix(): {"size": p.stat().st_size, HASH: file_hash(p)}
             for p in sorted(directory.rglob("*")) if p.is_file() and p.name != MANIFEST}
    (directory / MANIFEST).write_text(json.dumps({"format": 1, "hash": HASH, "files": files}, indent=1) + "\n")


def _read_manifest(directory: Path) -> dict[str, dict[str, Any]] | None:
    """The manifest's file table, or None when it is not what write_manifest writes."""
    try:
        manifest = json.loads((directory / MANIFEST).read_text())
        files = manifest["files"]
        if manifest.get("hash") != HASH or not isinstance(files, dict):
            return None
        for name, entry in files.items():
            # a listed name must stay inside the folder, and every entry needs both facts
            if Path(name).is_absolute() or ".." in Path(name).parts:
                return None
            if not isinstance(entry.get("size"), int) or not isinstance(entry.get(HASH), str):
                return None
        return files
    except (OSError, UnicodeDecodeError, ValueError, KeyError, TypeError, AttributeError):
        return None


def _unlisted(names: set[str]) -> list[str]:
    """The parts every checkpoint has that a manifest does not list. A sharded run keeps its weights and
    optimizer state under sharded/ (torch.distributed.checkpoint) instead of *.safetensors and optimizer.pt."""
    from anyfit.training.sharding import SHARDED_DIR

    if any(name.startswith(f"{SHARDED_DIR}/") for name in names):
        return [name for name in (STATE, "scheduler.pt") if name not in names]
    unlisted = [name for name in REQUIRED if name not in names]
    if not any(name.endswith(".safetensors") for name in names):
        unlisted.append("the weights (*.safetensors)")
    return unlisted


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
    files = _read_manifest(directory)
    if files is None:
        return f"{MANIFEST} is damaged (not the manifest anyfit writes)"
    unlisted = _unlisted(set(files))
    if unlisted:
        return f"{MANIFEST} does not list {', '.join(unlisted)}"
    for name, entry in files.items():
        path = directory / name
        if not path.is_file():
            return f"{name} is missing"
        size = path.stat().st_size
        if size != entry["size"]:
            return f"{name} has {size} bytes, the manifest says {entry['size']} (truncated or changed)"
    if full:
        for name, entry in files.items():
            if file_hash(directory / name) != entry[HASH]:
                return f"{name} does not match its {HASH} in the manifest (corrupted)"
    return None


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


def rng_state() -> dict[str, Any]:
    state = {"python": random.getstate(), "numpy": np.random.get_state(), "torch": torch.get_rng_state()}
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def save_model(accelerator, model, tokenizer, directory: Path, model_cfg=None) -> None:
    """The trainable weights as safetensors (LoRA: the adapter only), plus the tokenizer. Main process writes;
    every process must call this because gathering a sharded (FSDP/DeepSpeed) state dict is collective.

    With ``model_cfg`` (the run's ModelConfig), an adapter records a base others can load (see
    :func:`portable_base`) instead of the path the weights happened to be read from."""
    state_dict = full_state_dict(model) if is_sharded(model) else accelerator.get_state_dict(model)
    if accelerator.is_main_process:
        unwrapped = accelerator.unwrap_model(model)
        unwrapped.save_pretrained(directory, state_dict=state_dict, safe_serialization=True)
        if tokenizer is not None:
            tokenizer.save_pretrained(directory)
        if model_cfg is not None and (directory / "adapter_config.json").is_file():
            record_base(directory, model_cfg)


def portable_base(model_cfg) -> dict[str, Any]:
    """Where an adapter's base model is to be loaded from, as recorded in its adapter_config.json.

    PEFT records the folder the weights were read from: for a GGUF file that is its parent folder (no
    config.json: nothing loads it), for a relative path it depends on the working directory. Instead:
    a hub id stays a hub id (with its revision); a local folder becomes its absolute path; a GGUF file is
    converted once into a safetensors folder (``anyfit.model.gguf_cache``, reused afterwards) because that is
    the only form PEFT's AutoPeftModelForCausalLM can load, and the GGUF file it came from is recorded
    next to it (``gguf``) so it can be rebuilt elsewhere. Returns ``base_model_name_or_path``,
    ``revision``, ``source`` (hub, folder or gguf) and, for GGUF, ``gguf`` and ``note``.
    """
    from anyfit.model import gguf_cache

    name, revision = model_cfg.name_or_path, model_cfg.revision
    path = Path(name).expanduser()
    gguf_file = None
    if name.endswith(".gguf"):
        gguf_file = path
    elif model_cfg.gguf_file:
        gguf_file = path / model_cfg.gguf_file if path.is_dir() else _cached_hub_file(name, model_cfg.gguf_file,
                                                                                        revision)
    if gguf_file is not None:
        origin = {"file": str(gguf_file.resolve()), "name": gguf_file.name, "size": gguf_file.stat().st_size}
        if not (name.endswith(".gguf") or path.is_dir()):
            origin.update(hub_repo=name, revision=revision)
        try:
            folder = gguf_cache.materialize_gguf(gguf_file)
        except OSError as e:  # no room for the converted copy, or its cache folder is taken
            print(f"[anyfit] warning: could not convert {gguf_file} into a safetensors folder ({e}); the adapter "
                  "records the GGUF file, which anyfit loads but AutoPeftModelForCausalLM does not.", file=sys.stderr)
            return {"base_model_name_or_path": origin["file"], "revision": None, "source": "gguf", "gguf": origin,
                    "note": _gguf_note(origin)}
        return {"base_model_name_or_path": str(folder.resolve()), "revision": None, "source": "gguf",
                "gguf": origin, "note": _gguf_note(origin)}
    if path.is_dir():
        folder = path.resolve()
        if gguf_cache.is_materialized(folder):  # the quickstart trains on such a folder: say where it came from
            # the marker's name is private to gguf_cache; is_materialized has just said it is there
            made_from = json.loads((folder / gguf_cache._COMPLETE_MARKER).read_text())
            origin = {"file": made_from.get("source"), "name": Path(made_from.get("source", "")).name,
                      "size": made_from.get("size")}
            return {"base_model_name_or_path": str(folder), "revision": None, "source": "gguf", "gguf": origin,
                    "note": _gguf_note(origin)}
        return {"base_model_name_or_path": str(folder), "revision": None, "source": "folder"}
    return {"base_model_name_or_path": name, "revision": revision, "source": "hub"}


def _cached_hub_file(repo: str, filename: str, revision: str | None) -> Path:
    """The local copy of a hub file that loading the model has already downloaded."""
    from huggingface_hub import hf_hub_download

    return Path(hf_hub_download(repo, filename, revision=revision))


def _gguf_note(origin: dict[str, Any]) -> str:
    return (f"The base is the GGUF model {origin['name']} ({origin['size']} bytes), dequantized to float32 "
            "safetensors in base_model_name_or_path. On another machine, rebuild that folder from the same GGUF "
            "file: python -c \"from anyfit.model.gguf_cache import materialize_gguf as m; "
            f"print(m('{origin['name']}'))\" prints it; then set base_model_name_or_path in adapter_config.json to it (for "
            "AutoPeftModelForCausalLM), or load it with AutoModelForCausalLM and apply the adapter with "
            "PeftModel.from_pretrained(base, adapter_dir).")


def record_base(directory: Path, model_cfg) -> dict[str, Any]:
    """Rewrite ``adapter_config.json``'s base (see :func:`portable_base`); for a GGUF base also write
    ``base_model.json`` with the GGUF file's name, size and path and how to rebuild the base. PEFT warns
    about keys it does not know in adapter_config.json, hence the separate file."""
    base = portable_base(model_cfg)
    config_path = directory / "adapter_config.json"
    adapter_cfg = json.loads(config_path.read_text())
    adapter_cfg["base_model_name_or_path"] = base["base_model_name_or_path"]
    adapter_cfg["revision"] = base["revision"]
    config_path.write_text(json.dumps(adapter_cfg, indent=2, sort_keys=True) + "\n")
    if base["source"] == "gguf":
        (directory / BASE_RECORD).write_text(json.dumps(base, indent=2) + "\n")
    else:
        (directory / BASE_RECORD).unlink(missing_ok=True)
    return base


def save_checkpoint(accelerator, output_dir: Path, step: int, model, optimizer, scheduler, tokenizer,
                    config_yaml: str, trainer_state: dict[str, Any], keep_last: int, model_cfg=None) -> Path:
    final = output_dir / f"{PREFIX}{step}"
    tmp = output_dir / f"{TMP_PREFIX}{step}"
    if accelerator.is_main_process:
        shutil.rmtree(tmp, ignore_errors=True)
        tmp.mkdir(parents=True)
    accelerator.wait_for_everyone()
    sharded = is_sharded(model)
    if sharded:  # every process writes its own shards of the weights and the optimizer states
        save_sharded(model, optimizer, tmp)
    else:
        save_model(accelerator, model, tokenizer, tmp, model_cfg)
    torch.save(rng_state(), tmp / f"rng_state_{accelerator.process_index}.pt")
    if accelerator.is_main_process:
        if not sharded:
            torch.save(optimizer.state_dict(), tmp / "optimizer.pt")
        torch.save(scheduler.state_dict(), tmp / "scheduler.pt")
        scaler = getattr(accelerator, "scaler", None)
        if scaler is not None:
            torch.save(scaler.state_dict(), tmp / "scaler.pt")
        (tmp / "config.yaml").write_text(config_yaml)
    accelerator.wait_for_everyone()
    if accelerator.is_main_process:
        (tmp / STATE).write_text(json.dumps({**trainer_state, "step": step}, indent=2))
        # The manifest is written last (every process's files are in by now), then the folder is renamed.
        write_manifest(tmp)
        if final.exists():
            shutil.rmtree(final)
        tmp.rename(final)
        prune(output_dir, keep_last)
    accelerator.wait_for_everyone()
    return final


def prune(output_dir: Path, keep_last: int) -> None:
    """Keep the newest ``keep_last`` intact checkpoints (sizes checked) and delete every older folder.
    Damaged ones newer than those are left for ``resume=auto`` to name and skip."""
    dirs = checkpoint_dirs(output_dir)
    intact = [p for p in dirs if checkpoint_problem(p, full=False) is None]
    if not intact:
        return
    oldest_kept = checkpoint_step(intact[-max(1, keep_last):][0])
    for old in dirs:
        if checkpoint_step(old) < oldest_kept:
            shutil.rmtree(old, ignore_errors=True)


def _warn(line: str) -> None:
    print(line, file=sys.stderr)


def resolve_resume(spec: str | None, output_dir: Path, warn: Callable[[str], None] | None = None) -> Path | None:
    """The checkpoint to resume from: None for a fresh run; 'auto' picks the newest intact one (hashes
    checked), saying in one line through ``warn`` (default: stderr) which newer ones it skipped and why."""
    from anyfit.config import ConfigError

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


def _damaged(path: Path, error: Exception):
    """The error for a checkpoint file that cannot be read: one line naming it, not the reader's traceback."""
    from anyfit.config import ConfigError

    reason = str(error).strip().splitlines()[0] if str(error).strip() else ""
    reason = reason if len(reason) <= 120 else reason[:117] + "..."
    return ConfigError(f"checkpoint file {path} cannot be read ({type(error).__name__}{': ' + reason if reason else ''}"
                       "); it is damaged. Resume from an earlier checkpoint: train.resume=auto skips damaged ones.")


def _torch_load(path: Path, **kwargs) -> Any:
    try:
        return torch.load(path, weights_only=False, **kwargs)
    except Exception as e:  # a damaged pickle/zip raises almost anything (EOFError, UnpicklingError, ...)
        raise _damaged(path, e) from e


def _load_weights(model, directory: Path) -> None:
    """Load saved weights into the (unwrapped) model: the adapter for PEFT models, else every tensor."""
    from safetensors.torch import load_file

    files = sorted(directory.glob("*.safetensors"))
    if not files:
        raise FileNotFoundError(f"{directory} holds no .safetensors weights")
    state: dict[str, torch.Tensor] = {}
    for f in files:
        try:
            state.update(load_file(f))
        except Exception as e:  # SafetensorError, or an OSError from a file cut short
            raise _damaged(f, e) from e
    if hasattr(model, "peft_config"):
        from peft import set_peft_model_state_dict

        result = set_peft_model_state_dict(model, state)
        if result.unexpected_keys:
            raise RuntimeError(f"adapter checkpoint {directory} does not fit this model: {result.unexpected_keys[:5]}")
        return
    missing, unexpected = model.load_state_dict(state, strict=False)
    # save_pretrained leaves out tied copies (lm_head tied to the embeddings); anything else missing is an error.
    tied = {k for k in missing if k.endswith("lm_head.weight") and getattr(model.config, "tie_word_embeddings", False)}
    if set(missing) - tied or unexpected:
        raise RuntimeError(f"checkpoint {directory} does not fit this model: missing {sorted(set(missing) - tied)[:5]}, "
                           f"unexpected {sorted(unexpected)[:5]}")


def load_checkpoint(accelerator, directory: Path, model, optimizer, scheduler) -> dict[str, Any]:
    """Restore everything a checkpoint holds into the prepared objects; returns its trainer state.
    A file that cannot be read is a ConfigError naming it (resolve_resume has normally caught it already)."""
    if is_sharded(model):  # shards written by any number of processes, re-cut for this run
        load_sharded(model, optimizer, directory)
    else:
        _load_weights(accelerator.unwrap_model(model), directory)
        optimizer.load_state_dict(_torch_load(directory / "optimizer.pt", map_location="cpu"))
    scheduler.load_state_dict(_torch_load(directory / "scheduler.pt"))
    scaler = getattr(accelerator, "scaler", None)
    if scaler is not None and (directory / "scaler.pt").is_file():
        scaler.load_state_dict(_torch_load(directory / "scaler.pt"))
    rng_file = directory / f"rng_state_{accelerator.process_index}.pt"
    if rng_file.is_file():  # absent when resuming with more processes than saved: those start from the seed
        set_rng_state(_torch_load(rng_file))
    try:
        return json.loads((directory / STATE).read_text())
    except (OSError, UnicodeDecodeError, ValueError) as e:
        raise _damaged(directory / STATE, e) from e


def set_rng_state(state: dict[str, Any]) -> None:
    random.setstate(state["python"])
    np.random.set_state(state["numpy"])
    torch.set_rng_state(state["torch"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])

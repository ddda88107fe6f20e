"""Where the raw training records come from: a local .jsonl/.json/.csv (also compressed: .jsonl.gz, ...), .parquet
or .arrow file, a folder of them split by file name, a glob of shards (``data/train-*.jsonl``), a folder written by
``Dataset.save_to_disk`` or ``DatasetDict.save_to_disk``, or a hub dataset through ``datasets``.

``iter_records`` yields the records of ``data.split`` (slicing included: ``train[:500]``, ``train[10%:20%]``,
``train[:10]+test[:5]``) cut to ``data.num_samples``, in batches, as a stream: memory holds about one batch,
whatever the size of the data. ``load_records`` is the same records in one list. Each batch is a ``Records``
list, which also knows where each record came from (``file:line`` for JSON Lines and CSV), so a later error
about a record can name the place to fix. What the fields mean is decided later, in ``anyfit.data.formats``;
how each file format is read, in ``anyfit.data.readers``.

``source_fingerprint`` names the records a config reads by their content (the files' bytes, or the hub
dataset's fingerprint), for a cache of what is made from them.
"""

from __future__ import annotations

import glob
import hashlib
import json
import os
import re
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from anyfit.cache import file_sha256
from anyfit.config import DataConfig
from anyfit.data.readers import (READABLE, DataError, Records, check_readable, concat, count_rows, is_readable,
                                 read_file)
from anyfit.hub import DATA_LIKE_SUFFIXES, check_dataset_id, data_looks_local, innermost_message

__all__ = ["DataError", "Records", "iter_records", "load_records", "source_fingerprint", "FINGERPRINT_VERSION"]

# Part of every source_fingerprint: raise it when reading the same bytes can give other records (a reader's rules).
# 2: a .json object whose one list is a conversation ({"messages": [...]}) is one record, not a list of them.
FINGERPRINT_VERSION = 2
_GLOB_MAGIC = re.compile(r"[*?\[]")
# A slice's end when the split's length is not counted: "to the end".
_UNCOUNTED = 2**62


@dataclass
class _Local:
    """Local files: each split's files in reading order."""

    splits: dict[str, list[Path]]
    where: str  # the data, as the 'holds no records' message names it
    what: str  # the data, as the 'not a valid split' message names it
    base: Path  # file names in the fingerprint are relative to this
    counts: dict[Path, int] = field(default_factory=dict)

    def count(self, path: Path) -> int:
        if path not in self.counts:
            self.counts[path] = count_rows(path)
        return self.counts[path]


@dataclass
class _Hub:
    ds: Any  # the loaded split, a datasets.Dataset
    where: str


def iter_records(cfg: DataConfig, batch_size: int = 1024) -> Iterator[Records]:
    """The records of ``cfg.path`` for ``cfg.split`` (slicing included), cut to ``cfg.num_samples``, in batches of
    ``batch_size`` (the last may be smaller), read as a stream.

    Where the data is, the split and its slice are checked now (and rows counted when the slice needs the
    length: percentages, negative indices); the records are read as the batches are asked for, so a bad record
    is a DataError raised by the iteration. Rows outside the slice are not parsed. Each batch's ``locate(i)``
    names record i's place in its file.
    """
    if batch_size < 1:
        raise ValueError(f"batch_size must be at least 1, got {batch_size}.")
    source = _resolve(cfg)
    if isinstance(source, _Hub):
        chunks = _hub_chunks(source.ds, f"{cfg.path} ({cfg.split})", batch_size)
    else:
        chunks = _local_chunks(source, _slices(source, cfg.split), batch_size)
    return _batches(chunks, cfg, source.where, batch_size)


def load_records(cfg: DataConfig) -> Records:
    """All records of ``cfg.path`` for ``cfg.split`` (slicing included), cut to ``cfg.num_samples``."""
    return concat(list(iter_records(cfg, batch_size=8192)))


def source_fingerprint(cfg: DataConfig) -> str:
    """A hex sha256 that changes whenever the records ``iter_records(cfg)`` yields can change.

    It covers ``data.path``, ``data.subset``, ``data.split``, ``data.num_samples``, ``FINGERPRINT_VERSION`` and
    the content: for local data the full sha256 of every file of the splits named (all of them, also those a
    slice does not reach), each named relative to the folder (or the pattern's folder, or the file's own
    name); for a hub dataset the ``datasets`` fingerprint of the loaded split. No absolute path or time is in
    it, so the same files give the same value on any machine. ``data.path`` is taken as written: the same
    relative path run from another folder with the same layout gives the same value; another absolute path
    to a copy gives another.
    """
    source = _resolve(cfg)
    key: dict[str, Any] = {"version": FINGERPRINT_VERSION, "path": cfg.path, "subset": cfg.subset,
                           "split": cfg.split, "num_samples": cfg.num_samples}
    if isinstance(source, _Hub):
        key["hub"] = source.ds._fingerprint
    else:
        files = {p for paths in source.splits.values() for p in paths}
        key["files"] = sorted([Path(os.path.relpath(p, source.base)).as_posix(), _file_sha256(p)] for p in files)
    return hashlib.sha256(json.dumps(key, sort_keys=True).encode()).hexdigest()


def _file_sha256(path: Path) -> str:
    try:
        return file_sha256(path)
    except OSError as e:
        raise DataError(f"{path}: cannot read the file ({e.strerror or e}).") from None


# ---------------------------------------------------------------------------------------------- resolution


def _resolve(cfg: DataConfig) -> _Local | _Hub:
    """Where ``cfg.path`` points, with the files of the splits ``cfg.split`` names (a hub dataset: loaded)."""
    if not cfg.path:
        raise DataError("data.path is empty: set it to a .jsonl/.json/.csv/.parquet/.arrow file (.jsonl.gz and the "
                        "like too), a folder or a glob of them, or a hub dataset name (e.g. data.path=openai/gsm8k "
                        "data.subset=main).")
    if cfg.num_samples is not None and cfg.num_samples < 1:
        raise DataError(f"data.num_samples must be at least 1 (or unset for all), got {cfg.num_samples}.")

    path = Path(cfg.path).expanduser()
    if path.is_file():
        _one_split(cfg.split, f"{path} is a single file")
        check_readable(path)
        # A single file holds one split, so only the slice matters and the split name is not checked
        # (data.split=test[:100] on test.jsonl reads its first 100 records).
        return _Local({_split_name(cfg.split): [path]}, str(path), str(path), path.parent)
    if path.is_dir():
        if _saved_dataset(path):
            # Read as a single file is: one split, only the slice matters.
            _one_split(cfg.split, f"{path} is one saved split (Dataset.save_to_disk)")
            return _Local({_split_name(cfg.split): _saved_files(path)}, str(path), f"saved dataset {path}", path)
        if (path / "dataset_dict.json").is_file():
            return _Local(_saved_splits(path, cfg.split), f"{path} ({cfg.split})", f"saved dataset dict {path}", path)
        return _Local(_folder_files(path, cfg.split), f"{path} ({cfg.split})", f"folder {path}", path)
    if _GLOB_MAGIC.search(cfg.path):
        return _glob(cfg)
    if not data_looks_local(cfg.path):
        return _Hub(_load_with_datasets(cfg), f"{cfg.path} ({cfg.split})")
    raise DataError(
        f"Data file {cfg.path} does not exist (looked for {path.resolve()}). Check data.path: relative paths "
        f"are taken from the current directory ({Path.cwd()}). For a hub dataset use its name, e.g. "
        "data.path=openai/gsm8k.")


def _split_name(split: str) -> str:
    return split.split("[", 1)[0].strip() or "train"


def _one_split(split: str, what: str) -> None:
    if "+" in split:
        raise DataError(f"data.split={split!r} combines splits, but {what}; use one slice such as 'train[:500]'.")


def _glob(cfg: DataConfig) -> _Local:
    """Shards named by a pattern (``data/train-*.jsonl``, ``shards/*.parquet``; ``**`` for any depth), read in
    the order of their paths as one split."""
    pattern = os.path.expanduser(cfg.path)
    files = sorted(p for p in glob.glob(pattern, recursive=True) if os.path.isfile(p))
    if not files:
        raise DataError(f"data.path={cfg.path!r} matches no files (relative patterns are taken from {Path.cwd()}); "
                        "check the pattern, e.g. data.path='data/train-*.jsonl'.")
    unread = [p for p in files if not is_readable(Path(p))]
    if unread:
        raise DataError(f"data.path={cfg.path!r} matches {', '.join(unread[:3])}{', ...' if len(unread) > 3 else ''}, "
                        f"which anyfit does not read (it reads {READABLE}); narrow the pattern, e.g. to *.jsonl.")
    _one_split(cfg.split, f"data.path={cfg.path!r} is one set of files")
    base = os.path.dirname(pattern[: _GLOB_MAGIC.search(pattern).start()]) or "."
    return _Local({_split_name(cfg.split): [Path(p) for p in files]}, f"{cfg.path} ({len(files)} files)",
                  f"the files of {cfg.path}", Path(base))


def _folder_files(path: Path, split: str) -> dict[str, list[Path]]:
    """The files of the splits ``split`` names, from a folder split by file name as `datasets` does
    (train.jsonl, test-*.parquet, train/...; every file is 'train' when no name says otherwise). Each file is
    read here, so errors name the file and line; files of the other splits are not read."""
    from datasets.data_files import DataFilesDict, EmptyDatasetError, get_data_patterns

    try:
        files = DataFilesDict.from_patterns(get_data_patterns(str(path)), base_path=str(path))
    except EmptyDatasetError:
        raise DataError(f"Data folder {path} holds no data files: put .jsonl/.json/.csv/.parquet/.arrow files in it "
                        "(e.g. train.jsonl, test.jsonl) or set data.path to a file.") from None
    names = list(dict.fromkeys(part.split("[", 1)[0].strip() for part in split.split("+")))
    unknown = sorted(set(names) - set(map(str, files)))
    if unknown:
        raise DataError(f"data.split={split!r}: data folder {path} has no split {unknown[0]!r}; its splits (from the "
                        f"file names) are {', '.join(map(str, files))}.")
    splits = {}
    for name in names:
        # In the order `datasets` lists them: by path within each of its patterns (train/**: train/algebra/1.json,
        # train/algebra/10.json, train/algebra/2.json, train/geometry/...), the same on every machine.
        paths = _with_saved_datasets([Path(f) for f in files[name]])
        foreign = [p.name for p in paths if p.name.lower().endswith(DATA_LIKE_SUFFIXES) and not is_readable(p)]
        if foreign:
            raise DataError(f"Data folder {path} holds {', '.join(sorted(foreign)[:3])}, which anyfit does not read "
                            f"(it reads {READABLE}); convert or move them, or set data.path to one file.")
        readable = [p for p in paths if is_readable(p)]
        if not readable:
            raise DataError(f"Data folder {path} holds no .jsonl/.json/.csv/.parquet/.arrow files for split {name!r}; "
                            "set data.path to the data file.")
        splits[name] = readable
    return splits


# ---------------------------------------------------------------------------------------------- save_to_disk
# A save_to_disk folder's Arrow files are read as any .arrow file is, not through datasets.load_from_disk: slices,
# row counts, places (data-00000-of-00002.arrow row 7) and the fingerprint (the files' bytes; the saved
# `_fingerprint` is no hash of the content) work as for every local file, and no saved format (torch, a column
# subset) changes the raw records.


def _saved_dataset(path: Path) -> bool:
    """Whether ``path`` is a folder written by ``Dataset.save_to_disk``."""
    return (path / "state.json").is_file() and (path / "dataset_info.json").is_file()


def _saved_files(path: Path) -> list[Path]:
    """The Arrow files of a ``Dataset.save_to_disk`` folder, in the order its state.json lists them (the order of
    the rows; `datasets` names them so that it is also the order of their names, which the fingerprint sorts by)."""
    state = path / "state.json"
    try:
        names = [entry["filename"] for entry in json.loads(state.read_text(encoding="utf-8"))["_data_files"]]
    except OSError as e:
        raise DataError(f"{state}: cannot read the file ({e.strerror or e}).") from None
    except (ValueError, KeyError, TypeError):
        raise DataError(f"{state} is not a state.json as Dataset.save_to_disk writes it (its files under "
                        "'_data_files'); save the dataset again.") from None
    files = [path / name for name in names]
    missing = [f.name for f in files if not f.is_file()]
    if missing:
        raise DataError(f"Saved dataset {path} lacks {', '.join(missing[:3])}, which its state.json lists; copy the "
                        "whole folder, or save the dataset again.")
    return files


def _saved_splits(path: Path, split: str) -> dict[str, list[Path]]:
    """The Arrow files of the splits ``split`` names, from a ``DatasetDict.save_to_disk`` folder: its
    dataset_dict.json lists the splits, each saved in the subfolder of its name."""
    listing = path / "dataset_dict.json"
    try:
        splits = json.loads(listing.read_text(encoding="utf-8"))["splits"]
    except OSError as e:
        raise DataError(f"{listing}: cannot read the file ({e.strerror or e}).") from None
    except (ValueError, KeyError, TypeError):
        raise DataError(f"{listing} is not a dataset_dict.json as DatasetDict.save_to_disk writes it (the split "
                        "names under 'splits'); save the dataset again.") from None
    names = list(dict.fromkeys(_split_name(part) for part in split.split("+")))
    unknown = [name for name in names if name not in splits]
    if unknown:
        raise DataError(f"data.split={split!r}: saved dataset dict {path} has no split {unknown[0]!r}; its splits are "
                        f"{', '.join(map(str, splits))}.")
    for name in names:
        if not _saved_dataset(path / name):
            raise DataError(f"{path / name} is not a folder written by Dataset.save_to_disk (with state.json and "
                            f"dataset_info.json), though {listing} lists split {name!r}; copy the whole folder, or "
                            "save the dataset again.")
    return {name: _saved_files(path / name) for name in names}


def _with_saved_datasets(paths: list[Path]) -> list[Path]:
    """A split's files, each ``Dataset.save_to_disk`` folder among them (a split's subfolder written so) replaced by
    its Arrow files: its state.json and dataset_info.json are not records."""
    saved = {p.parent for p in paths if p.name == "state.json" and _saved_dataset(p.parent)}
    out: list[Path] = []
    for p in paths:
        if p.parent not in saved:
            out.append(p)
        elif not any(q.parent == p.parent for q in out):
            out.extend(_saved_files(p.parent))
    return out


# ---------------------------------------------------------------------------------------------- slicing


def _slices(source: _Local, split: str) -> list[tuple[list[Path], int, int | None]]:
    """(files, first row, end row or None for all) of each part of ``split`` (``+`` joins parts), with the syntax
    and the rounding of percentages of ``datasets.ReadInstruction``, so local and hub data agree. Rows are
    counted only when the slice needs the length (percentages, negative indices)."""
    if split in source.splits:  # a whole split: what ReadInstruction gives, without importing datasets (~0.6 s)
        return [(source.splits[split], 0, None)]
    from datasets import ReadInstruction

    if re.search(r"\[[^\]]*[-%]", split):
        lengths = {name: sum(source.count(p) for p in files) for name, files in source.splits.items()}
    else:
        lengths = dict.fromkeys(source.splits, _UNCOUNTED)
    try:
        instructions = ReadInstruction.from_spec(split).to_absolute(lengths)
    except (ValueError, AssertionError) as e:
        raise DataError(f"data.split={split!r} is not a valid split of {source.what}: {e}. Use e.g. 'train', "
                        "'train[:500]', 'train[10:20]' or 'train[10%:]'.") from None
    return [(source.splits[i.splitname], i.from_, None if i.to >= _UNCOUNTED else i.to) for i in instructions]


def _local_chunks(source: _Local, parts: list[tuple[list[Path], int, int | None]],
                  batch_size: int) -> Iterator[Records]:
    """The rows of each part, file after file; a file that ends before a part's first row is counted, not read."""
    for files, start, stop in parts:
        for path in files:
            if stop is not None and stop <= start:
                break
            if start > 0 and path is not files[-1]:
                n = source.count(path)
                if start >= n:
                    start, stop = start - n, None if stop is None else stop - n
                    continue
            got = 0
            for chunk in read_file(path, start, stop, batch_size):
                got += len(chunk)
                yield chunk
            start, stop = 0, None if stop is None else stop - start - got


def _hub_chunks(ds, where: str, batch_size: int) -> Iterator[Records]:
    # Arrow batches of the memory-mapped split, as Dataset.to_list() gives them (no feature decoding).
    table = ds.with_format("arrow")
    for start in range(0, len(ds), batch_size):
        yield Records(table[start:start + batch_size].to_pylist(), lambda i, s=start: f"{where} row {s + i}")


def _batches(chunks: Iterator[Records], cfg: DataConfig, where: str, batch_size: int) -> Iterator[Records]:
    """``chunks`` cut to ``cfg.num_samples`` (reading stops there) in batches of exactly ``batch_size`` (the
    last may be smaller); a DataError at the end when there was no record at all."""
    parts, held, total = [], 0, 0
    for chunk in chunks:
        if cfg.num_samples is not None:
            chunk = chunk[: cfg.num_samples - total]
        total += len(chunk)
        while chunk:
            take = chunk[: batch_size - held]
            chunk = chunk[len(take):]
            parts.append(take)
            held += len(take)
            if held == batch_size:
                yield concat(parts)
                parts, held = [], 0
        if cfg.num_samples is not None and total >= cfg.num_samples:
            break
    if parts:
        yield concat(parts)
    if not total:
        raise DataError(f"{where} holds no records (split {cfg.split!r}); check data.path and data.split.")


def _load_with_datasets(cfg: DataConfig):
    import datasets

    check_dataset_id(cfg.path)  # typos and an unreachable hub: one line at once, not 30 s of retries
    try:
        return datasets.load_dataset(cfg.path, cfg.subset, split=cfg.split)
    except (datasets.exceptions.DatasetsError, OSError, ConnectionError, ValueError) as e:
        # OSError covers missing files and the hub client's HTTP and offline errors.
        raise DataError(
            f"Could not load dataset {cfg.path!r} (subset {cfg.subset!r}, split {cfg.split!r}): "
            f"{innermost_message(e)} If this is meant as a local file, give its path with the suffix (.jsonl, .json, "
            ".parquet, .csv); for a hub dataset check the name, data.subset and data.split, and that the hub is "
            "reachable (or the dataset cached).") from e

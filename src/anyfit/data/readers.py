"""Reading one local data file as a stream of records, in chunks: JSON Lines line by line, CSV row by row,
Parquet by row groups, and a .json document (loaded whole: it is one JSON value, so it cannot be streamed).

A chunk is a ``Records`` list that names each record's place (``data.jsonl:12``, ``data.parquet row 7``) for
error messages. Rows before the first one asked for are skipped without being parsed, and reading stops at
the last one asked for, so memory holds about one chunk and a bad line outside the slice is not an error.
``count_rows`` counts a file's records cheaply (lines, CSV rows, Parquet metadata) for percentage slices.

Text files are read as UTF-8 (a leading byte-order mark is skipped), one line at a time; anything else is
an error that names the file, line and byte offset rather than text decoded wrongly.
"""

from __future__ import annotations

import bisect
import codecs
import csv
import json
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass
from itertools import islice
from pathlib import Path
from typing import Any, BinaryIO

from anyfit.hub import DATA_SUFFIXES

# Suffixes read here; anything else that looks like a file is an error rather than a hub lookup.
LOCAL_SUFFIXES = DATA_SUFFIXES
# Leading bytes of files that are often given a .jsonl/.json/.csv name by mistake.
_MAGIC = {b"\x1f\x8b": "gzip-compressed: decompress it first (gunzip)",
          b"\x28\xb5\x2f\xfd": "zstd-compressed: decompress it first (zstd -d)",
          b"PAR1": "a Parquet file: give it the suffix .parquet",
          b"PK\x03\x04": "a zip archive: extract it first"}
_DECODER = json.JSONDecoder()  # json.loads without its per-call checks: a million lines are a million calls
# A completion of a few hundred kB in one CSV cell is fine; the csv module's default limit is 128 kB.
_CSV_FIELD_LIMIT = 2**31 - 1


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


def concat(parts: list[Records]) -> Records:
    """One Records of several, each record keeping its place."""
    if len(parts) == 1:
        return parts[0]
    starts = [0]
    for part in parts:
        starts.append(starts[-1] + len(part))
    locates = [part.locate for part in parts]  # not the parts themselves: the places outlive their lists

    def locate(i: int) -> str:
        k = bisect.bisect_right(starts, i) - 1
        return locates[k](i - starts[k])

    return Records([r for part in parts for r in part], locate)


def check_readable(path: Path) -> None:
    """A DataError unless ``path``'s suffix is one read here."""
    if path.suffix.lower() not in LOCAL_SUFFIXES:
        raise DataError(f"{path}: unsupported file type {path.suffix.lower()!r}; anyfit reads "
                        f"{', '.join(LOCAL_SUFFIXES)} files (or a folder or a glob of them, or a hub dataset through "
                        "`datasets`).")


def read_file(path: Path, start: int = 0, stop: int | None = None, batch_size: int = 1024) -> Iterator[Records]:
    """Records ``start`` to ``stop`` (None: the end) of one file, in chunks of at most ``batch_size``."""
    check_readable(path)
    if path.suffix.lower() == ".parquet":
        return _parquet_chunks(path, start, stop, batch_size)
    return _chunks(path, start, stop, batch_size)


def count_rows(path: Path) -> int:
    """How many records ``read_file`` yields for the whole file, without parsing them where the format allows:
    non-blank lines of JSON Lines, rows of CSV, the metadata of Parquet (a .json document is parsed)."""
    check_readable(path)
    if path.suffix.lower() == ".parquet":
        pf = _open_parquet(path)
        try:
            return pf.metadata.num_rows
        finally:
            pf.close()
    entries = _open_entries(path)
    try:
        return sum(1 for _ in entries.items)
    finally:
        entries.close()


@dataclass
class _Entries:
    """A file's records before parsing: (place, raw) pairs that are cheap to skip and count, ``parse`` to make
    the record (or a DataError naming the place), ``name`` to name a place in messages."""

    items: Iterator[tuple[int, Any]]
    parse: Callable[[int, Any], dict]
    name: Callable[[int], str]

    def close(self) -> None:
        close = getattr(self.items, "close", None)
        if close:
            close()  # a generator left half-way still holds its open file


def _chunks(path: Path, start: int, stop: int | None, batch_size: int) -> Iterator[Records]:
    entries = _open_entries(path)
    try:
        wanted = islice(entries.items, start, stop)
        while block := list(islice(wanted, batch_size)):
            places = [place for place, _ in block]
            yield Records([entries.parse(place, raw) for place, raw in block],
                          lambda i, places=places, name=entries.name: name(places[i]))
    finally:
        entries.close()


def _open_entries(path: Path) -> _Entries:
    suffix = path.suffix.lower()
    if suffix == ".json":
        return _open_json(path)
    if suffix == ".csv":
        return _open_csv(path)
    return _open_jsonl(path)


# ---------------------------------------------------------------------------------------------- text lines


def _open_binary(path: Path) -> tuple[BinaryIO, int]:
    """The file opened for reading bytes and the length of its UTF-8 byte-order mark (0 or 3), after checking
    that it is not UTF-16 or a compressed/binary file under a text name."""
    f = None
    try:
        f = path.open("rb")
        head = f.read(4)
        f.seek(0)
    except OSError as e:  # no permission, a file that vanished, a network share that went away
        if f is not None:
            f.close()
        raise DataError(f"{path}: cannot read the file ({e.strerror or e}).") from None
    if head.startswith((codecs.BOM_UTF16_LE, codecs.BOM_UTF16_BE)):
        f.close()
        raise DataError(f"{path} is UTF-16 text, but anyfit reads UTF-8: re-encode it, e.g. "
                        f"iconv -f UTF-16 -t UTF-8 {path} > {_utf8_name(path)}")
    for magic, what in _MAGIC.items():
        if head.startswith(magic):
            f.close()
            raise DataError(f"{path} is {what}.")
    # Editors on Windows often start UTF-8 files with a byte-order mark; it is not part of the data.
    return f, len(codecs.BOM_UTF8) if head.startswith(codecs.BOM_UTF8) else 0


def _lines(path: Path, blank: bool = True) -> Iterator[tuple[int, tuple[int, bytes, int]]]:
    """(line number, (offset of the line in the file, its bytes without the '\\n', length of a byte-order mark
    at its start)) for every line (``blank=False``: every line that holds more than whitespace). Lines end at
    b"\\n" only: a "\\r" before it is JSON whitespace, and U+2028, U+0085 and the like, which JSON writers leave
    unescaped inside strings, do not end a line."""
    f, bom = _open_binary(path)
    offset = 0
    with f:
        try:
            for lineno, line in enumerate(f, start=1):
                start, offset = offset, offset + len(line)
                line = line[:-1] if line.endswith(b"\n") else line
                skip = bom if lineno == 1 else 0
                if blank or line[skip:skip + 1] == b"{" or not _blank(line[skip:]):
                    yield lineno, (start, line, skip)
        except OSError as e:
            raise DataError(f"{path}: cannot read the file ({e.strerror or e}).") from None


def _decode(path: Path, lineno: int, raw: tuple[int, bytes, int]) -> str:
    """One line as text, without a byte-order mark; a DataError at its first byte that is not UTF-8."""
    offset, line, bom = raw
    try:
        return line[bom:].decode("utf-8")
    except UnicodeDecodeError as e:
        column = bom + e.start  # from the start of the line, as `cmp`/`xxd` count
        raise _not_utf8(path, lineno, offset + column, column, line[:column], line[column]) from None


def _not_utf8(path: Path, lineno: int, offset: int, column: int, before: bytes, byte: int) -> DataError:
    before_text = before.decode("utf-8", errors="replace")[-30:]
    return DataError(
        f"{path}:{lineno}: not UTF-8 text: byte 0x{byte:02x} at byte offset {offset} (column {column + 1} of line "
        f"{lineno}, after {before_text!r}). anyfit reads UTF-8 only and does not guess: re-encode the file, e.g. "
        f"iconv -f LATIN1 -t UTF-8 {path} > {_utf8_name(path)} (LATIN1 or CP1252 for most Western-European "
        f"exports; `file -i {path}` guesses the encoding).")


def _read_text(path: Path) -> str:
    """The whole file as UTF-8 text, without a leading byte-order mark (for a .json document)."""
    f, bom = _open_binary(path)
    with f:
        try:
            data = f.read()
        except OSError as e:
            raise DataError(f"{path}: cannot read the file ({e.strerror or e}).") from None
    try:
        return data[bom:].decode("utf-8")
    except UnicodeDecodeError as e:
        offset = bom + e.start
        line_start = data.rfind(b"\n", 0, offset) + 1
        lineno = data.count(b"\n", 0, offset) + 1
        raise _not_utf8(path, lineno, offset, offset - line_start, data[line_start:offset], data[offset]) from None


def _utf8_name(path: Path) -> Path:
    return path.with_name(f"{path.stem}.utf8{path.suffix}")


def _blank(line: bytes) -> bool:
    """Whether a line holds only whitespace (by str.strip, as the record parser sees it), decoding only the
    lines that do not plainly hold something."""
    text = line.strip()
    return not text or (text[:1] not in b'{["' and not text.decode("utf-8", errors="replace").strip())


# ---------------------------------------------------------------------------------------------- JSON Lines


def _open_jsonl(path: Path) -> _Entries:
    lines = _lines(path, blank=False)
    first = next(lines, None)
    if first is not None and _decode(path, *first).lstrip().startswith("["):
        whole = _parse_json_array(_read_text(path))  # a JSON array saved as .jsonl: `datasets` reads it too
        if whole is not None:
            lines.close()
            return _array_entries(path, whole)
    return _Entries(_prepend(first, lines), lambda lineno, raw: _parse_line(path, lineno, raw),
                    lambda lineno: f"{path}:{lineno}")


def _prepend(first: Any, rest: Iterator) -> Iterator:
    """``first`` (unless None), then ``rest``; closing it closes ``rest`` (and so the file)."""
    if first is not None:
        yield first
    yield from rest


def _parse_line(path: Path, lineno: int, raw: tuple[int, bytes, int]) -> dict:
    # Parsed line by line by hand (not via `datasets`) so a bad line is reported as file:line with its text.
    line = _decode(path, lineno, raw)
    record = _parse(line, f"{path}:{lineno}")
    if not isinstance(record, dict):
        raise DataError(f"{path}:{lineno}: each line must be a JSON object {{...}}, got "
                        f"{type(record).__name__}: {_snippet(line)}")
    return record


def _parse(text: str, where: str) -> Any:
    """One JSON value; every way it can fail is a DataError naming ``where``."""
    try:
        return _DECODER.decode(text)
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


# ---------------------------------------------------------------------------------------------- .json


def _open_json(path: Path) -> _Entries:
    # One JSON document: it is parsed whole (there is no record boundary to stream by). JSON Lines saved as
    # .json are streamed as JSON Lines.
    text = _read_text(path)
    if not text.strip():
        raise DataError(f"{path} is empty: it should hold a JSON list of records.")
    try:
        data = json.loads(text)
    except json.JSONDecodeError as e:
        if e.msg == "Extra data":
            # One object per line saved as .json is common; `datasets` reads those too, so do the same.
            return _open_jsonl(path)
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
    return _array_entries(path, data, key)


def _array_entries(path: Path, data: list, key: str | None = None) -> _Entries:
    where = f"{path} '{key}' record" if key else f"{path} record"

    def parse(i: int, record: Any) -> dict:
        if not isinstance(record, dict):
            raise DataError(f"{where} {i} must be a JSON object {{...}}, got {type(record).__name__}: "
                            f"{_snippet(json.dumps(record))}")
        return record

    return _Entries(iter(enumerate(data)), parse, lambda i: f"{where} {i}")


# ---------------------------------------------------------------------------------------------- CSV


def _open_csv(path: Path) -> _Entries:
    """The header row names the fields; every later row is a record of strings (an empty cell is None, as
    `datasets` reads it). A row of another length than the header is an error naming its line."""
    csv.field_size_limit(max(csv.field_size_limit(), _CSV_FIELD_LIMIT))
    rows = _csv_rows(path)
    first = next(rows, None)
    if first is None:
        return _Entries(iter(()), lambda line, row: {}, lambda line: f"{path}:{line}")
    header_line, header = first
    duplicated = sorted({name for name in header if header.count(name) > 1})
    if duplicated:
        rows.close()
        raise DataError(f"{path}:{header_line}: the header row names {', '.join(map(repr, duplicated))} more than "
                        "once; each column needs its own name.")

    def parse(line: int, row: list[str]) -> dict:
        if len(row) != len(header):
            raise DataError(f"{path}:{line}: {len(row)} fields, but the header row ({path}:{header_line}) has "
                            f"{len(header)}: {_snippet(','.join(row))}. Quote cells that hold a comma (\"a, b\").")
        return {name: value if value != "" else None for name, value in zip(header, row)}

    return _Entries(rows, parse, lambda line: f"{path}:{line}")


def _csv_rows(path: Path) -> Iterator[tuple[int, list[str]]]:
    """(first line, cells) of every row that is not empty, the header included."""
    lines = _lines(path)
    reader = csv.reader(_decode(path, lineno, raw) + "\n" for lineno, raw in lines)
    try:
        while True:
            line = reader.line_num + 1
            try:
                row = next(reader)
            except StopIteration:
                return
            except csv.Error as e:
                raise DataError(f"{path}:{reader.line_num}: not valid CSV ({e}).") from None
            if row:
                yield line, row
    finally:
        lines.close()


# ---------------------------------------------------------------------------------------------- Parquet


def _open_parquet(path: Path):
    import pyarrow as pa
    import pyarrow.parquet as pq  # a dependency of `datasets`; read directly to skip its cache

    try:
        return pq.ParquetFile(path)
    except (pa.ArrowException, OSError) as e:
        raise _not_parquet(path, e) from None


def _not_parquet(path: Path, error: Exception) -> DataError:
    return DataError(f"{path} is not a readable Parquet file ({error}). Check that it was written completely, "
                     "or give the data as .jsonl.")


def _parquet_chunks(path: Path, start: int, stop: int | None, batch_size: int) -> Iterator[Records]:
    """Row groups before ``start`` are not read; the others are read in batches of ``batch_size`` rows."""
    import pyarrow as pa

    pf = _open_parquet(path)
    try:
        meta = pf.metadata
        stop = meta.num_rows if stop is None else min(stop, meta.num_rows)
        groups, row, first = [], 0, None
        for g in range(meta.num_row_groups):
            n = meta.row_group(g).num_rows
            if row + n > start and row < stop:
                groups.append(g)
                first = row if first is None else first
            row += n
        if not groups:
            return
        row = first
        try:
            for batch in pf.iter_batches(batch_size=batch_size, row_groups=groups):
                lo, hi = max(start - row, 0), min(batch.num_rows, stop - row)
                if lo < hi:
                    yield Records(batch.slice(lo, hi - lo).to_pylist(), lambda i, at=row + lo: f"{path} row {at + i}")
                row += batch.num_rows
                if row >= stop:
                    return
        except (pa.ArrowException, OSError) as e:
            raise _not_parquet(path, e) from None
    finally:
        pf.close()


def _snippet(line: str, width: int = 80) -> str:
    line = line.strip()
    return repr(line if len(line) <= width else line[:width] + "...")

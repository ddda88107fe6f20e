"""Reading one local data file as a stream of records, in chunks: JSON Lines line by line, CSV row by row, a
.json document (loaded whole: it is one JSON value, so it cannot be streamed), and Parquet and Arrow files by
row groups and record batches (``anyfit.data.columnar``). Text files may be compressed (``data.jsonl.gz``):
they are decompressed as they are read (``anyfit.data.files``).

A chunk is a ``Records`` list that names each record's place (``data.jsonl:12``, ``data.parquet row 7``) for
error messages. Rows before the first one asked for are skipped without being parsed, and reading stops at
the last one asked for, so memory holds about one chunk and a bad line outside the slice is not an error.
``count_rows`` counts a file's records cheaply (lines, CSV rows, Parquet and Arrow metadata) for percentage
slices.

Text files are read as UTF-8 (a leading byte-order mark is skipped), one line at a time; anything else is
an error that names the file, line and byte offset rather than text decoded wrongly.
"""

from __future__ import annotations

import csv
import json
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from itertools import islice
from pathlib import Path
from typing import Any

from anyfit.data.columnar import arrow_chunks, arrow_rows, parquet_chunks, parquet_rows
from anyfit.data.files import READABLE, compression_of, file_format, is_readable, open_bytes, reencode
from anyfit.data.records import DataError, Place, Records, concat, folder_of

__all__ = ["DataError", "Records", "concat", "READABLE", "is_readable", "check_readable", "read_file", "count_rows"]

_DECODER = json.JSONDecoder()  # json.loads without its per-call checks: a million lines are a million calls
# A completion of a few hundred kB in one CSV cell is fine; the csv module's default limit is 128 kB.
_CSV_FIELD_LIMIT = 2**31 - 1


def check_readable(path: Path) -> None:
    """A DataError, with the way forward, unless ``path`` is a file read here (by its name)."""
    file_format(path)


def read_file(path: Path, start: int = 0, stop: int | None = None, batch_size: int = 1024) -> Iterator[Records]:
    """Records ``start`` to ``stop`` (None: the end) of one file, in chunks of at most ``batch_size``."""
    fmt, _ = file_format(path)
    if fmt == ".parquet":
        return parquet_chunks(path, start, stop, batch_size)
    if fmt == ".arrow":
        return arrow_chunks(path, start, stop, batch_size)
    return _chunks(path, start, stop, batch_size)


def count_rows(path: Path) -> int:
    """How many records ``read_file`` yields for the whole file, without parsing them where the format allows:
    non-blank lines of JSON Lines, rows of CSV, the metadata of Parquet and Arrow (a .json document is parsed;
    a compressed file is decompressed)."""
    fmt, _ = file_format(path)
    if fmt == ".parquet":
        return parquet_rows(path)
    if fmt == ".arrow":
        return arrow_rows(path)
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
    fmt, _ = file_format(path)
    if fmt == ".json":
        return _open_json(path)
    if fmt == ".csv":
        return _open_csv(path)
    return _open_jsonl(path)


# ---------------------------------------------------------------------------------------------- text lines


def _lines(path: Path, blank: bool = True) -> Iterator[tuple[int, tuple[int, bytes, int]]]:
    """(line number, (offset of the line in the file, its bytes without the '\\n', length of a byte-order mark
    at its start)) for every line (``blank=False``: every line that holds more than whitespace). Lines end at
    b"\\n" only: a "\\r" before it is JSON whitespace, and U+2028, U+0085 and the like, which JSON writers leave
    unescaped inside strings, do not end a line."""
    f, bom, _ = open_bytes(path)
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
    compression = compression_of(path)  # offsets count the decompressed bytes then
    return DataError(
        f"{path}:{lineno}: not UTF-8 text: byte 0x{byte:02x} at byte offset {offset}"
        f"{' of the decompressed text' if compression else ''} (column {column + 1} of line {lineno}, after "
        f"{before_text!r}). anyfit reads UTF-8 only and does not guess: re-encode the file, e.g. "
        f"{reencode(path, 'LATIN1', compression)} (LATIN1 or CP1252 for most Western-European exports; "
        f"`file -i {'-z ' if compression else ''}{path}` guesses the encoding).")


def _read_text(path: Path) -> str:
    """The whole file as UTF-8 text, without a leading byte-order mark (for a .json document)."""
    f, bom, _ = open_bytes(path)
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


def _blank(line: bytes) -> bool:
    """Whether a line holds only whitespace (by str.strip, as the record parser sees it), decoding only the
    lines that do not plainly hold something."""
    text = line.strip()
    return not text or (text[:1] not in b'{["' and not text.decode("utf-8", errors="replace").strip())


# ---------------------------------------------------------------------------------------------- JSON Lines


def _open_jsonl(path: Path) -> _Entries:
    lines, folder = _lines(path, blank=False), folder_of(path)  # relative image paths are taken from the folder
    first = next(lines, None)
    if first is not None and _decode(path, *first).lstrip().startswith("["):
        whole = _parse_json_array(_read_text(path))  # a JSON array saved as .jsonl: `datasets` reads it too
        if whole is not None:
            lines.close()
            return _array_entries(path, whole)
    return _Entries(_prepend(first, lines), lambda lineno, raw: _parse_line(path, lineno, raw),
                    lambda lineno: Place(f"{path}:{lineno}", folder))


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
    """One JSON document, parsed whole (there is no record boundary to stream by): a list of records; an object
    that wraps one, such as ``{"data": [...]}``; or one record (``{"problem": ..., "solution": ...}``, as a data
    set of one file per record has it), placed as the file itself. JSON Lines saved as .json are streamed as
    JSON Lines.

    An object is a wrapper when exactly one of its values is a list of records: a list that is the object's only
    value, or a list of objects; and not a conversation (a list of chat messages, objects with a "role" or
    "from"), which is a field of one record, as in ``{"messages": [...]}``. Any other object is one record: a
    list of plain values (tags, choices as strings) is a field. Two lists of records (``{"train": [...],
    "test": [...]}``) are an error: which one is meant is not said. So a record whose only list holds objects
    that are not messages (``{"question": ..., "choices": [{...}]}``) reads as a wrapper: save such records as a
    list ``[{...}]`` or as JSON Lines.
    """
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
        lists = [k for k, v in data.items() if isinstance(v, list) and _records_list(v, alone=len(data) == 1)]
        if len(lists) > 1:
            raise DataError(f"{path}: expected a list of records, one record, or an object with one list of records "
                            f'such as {{"data": [...]}}; found several, under keys {sorted(lists)}: keep one, or '
                            "give each its own file.")
        if not lists:
            return _Entries(iter([(0, data)]), lambda i, record: record,
                            lambda i: Place(str(path), folder_of(path)))
        key, data = lists[0], data[lists[0]]
    if not isinstance(data, list):
        raise DataError(f"{path}: expected a list of records or an object, got {type(data).__name__}.")
    return _array_entries(path, data, key)


def _records_list(items: list, alone: bool) -> bool:
    """Whether a list in a .json object is the data set's records (see ``_open_json``)."""
    objects = bool(items) and all(isinstance(x, dict) for x in items)
    if objects and all("role" in x or "from" in x for x in items):
        return False  # a conversation: one record's messages
    return alone or objects


def _array_entries(path: Path, data: list, key: str | None = None) -> _Entries:
    where = f"{path} '{key}' record" if key else f"{path} record"
    folder = folder_of(path)

    def parse(i: int, record: Any) -> dict:
        if not isinstance(record, dict):
            raise DataError(f"{where} {i} must be a JSON object {{...}}, got {type(record).__name__}: "
                            f"{_snippet(json.dumps(record))}")
        return record

    return _Entries(iter(enumerate(data)), parse, lambda i: Place(f"{where} {i}", folder))


# ---------------------------------------------------------------------------------------------- CSV


def _open_csv(path: Path) -> _Entries:
    """The header row names the fields; every later row is a record of strings (an empty cell is None, as
    `datasets` reads it). A row of another length than the header is an error naming its line."""
    csv.field_size_limit(max(csv.field_size_limit(), _CSV_FIELD_LIMIT))
    rows, folder = _csv_rows(path), folder_of(path)
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

    return _Entries(rows, parse, lambda line: Place(f"{path}:{line}", folder))


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


def _snippet(line: str, width: int = 80) -> str:
    line = line.strip()
    return repr(line if len(line) <= width else line[:width] + "...")

"""Reading Parquet and Arrow files as a stream of records, in chunks, with pyarrow (a dependency of `datasets`;
read directly to skip its cache).

Parquet is read by row groups: groups before the first row asked for are not read. Arrow files, in the IPC
stream format that `datasets` writes (``Dataset.save_to_disk``, its cache) or the IPC file format, are memory-mapped
and read by record batches: a batch outside the rows asked for is never converted, so memory holds about one
chunk. Both count their rows from metadata without converting any. A record's place is ``data.parquet row 7``.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

from anyfit.data.records import DataError, Place, Records, folder_of

_ARROW_FILE_MAGIC = b"ARROW1"  # the IPC file format; the stream format has no magic of its own


# ---------------------------------------------------------------------------------------------- Parquet


def _open_parquet(path: Path):
    import pyarrow as pa
    import pyarrow.parquet as pq

    try:
        return pq.ParquetFile(path)
    except (pa.ArrowException, OSError) as e:
        raise _not_parquet(path, e) from None


def _not_parquet(path: Path, error: Exception) -> DataError:
    text = " ".join(str(error).split())
    if "magic bytes not found" in text:
        what = "Parquet magic bytes not found: the file is cut short or is not Parquet"
    elif "size is 0" in text:
        what = "the file is empty"
    else:
        what = "its data is damaged"
    return DataError(f"{path} is not a readable Parquet file ({text}): {what}. Write it again completely, or give "
                     "the data as .jsonl.")


def parquet_rows(path: Path) -> int:
    pf = _open_parquet(path)
    try:
        return pf.metadata.num_rows
    finally:
        pf.close()


def parquet_chunks(path: Path, start: int, stop: int | None, batch_size: int) -> Iterator[Records]:
    """Row groups before ``start`` are not read; the others are read in batches of ``batch_size`` rows."""
    import pyarrow as pa

    pf = _open_parquet(path)
    folder = folder_of(path)  # relative image paths in the records are taken from here
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
                    yield Records(batch.slice(lo, hi - lo).to_pylist(),
                                  lambda i, at=row + lo: Place(f"{path} row {at + i}", folder))
                row += batch.num_rows
                if row >= stop:
                    return
        except (pa.ArrowException, OSError) as e:
            raise _not_parquet(path, e) from None
    finally:
        pf.close()


# ---------------------------------------------------------------------------------------------- Arrow


@contextmanager
def _arrow_batches(path: Path, validate: bool = True):
    """The file's record batches, memory-mapped (a batch's data is only read where it is converted), each checked
    whole unless only counted (``validate=False``)."""
    import pyarrow as pa

    try:
        source = pa.memory_map(str(path))
    except (pa.ArrowException, OSError) as e:
        raise _not_arrow(path, e) from None
    try:
        try:
            if source.read(len(_ARROW_FILE_MAGIC)) == _ARROW_FILE_MAGIC:
                source.seek(0)
                reader = pa.ipc.open_file(source)
                batches = (reader.get_batch(i) for i in range(reader.num_record_batches))
            else:
                source.seek(0)
                batches = iter(pa.ipc.open_stream(source))
        except (pa.ArrowException, OSError) as e:
            raise _not_arrow(path, e) from None
        yield _checked(path, batches, validate)
    finally:
        source.close()


def _checked(path: Path, batches: Iterator, validate: bool) -> Iterator:
    """The batches, each with ``validate`` checked whole before it is converted: the IPC reader trusts the offsets
    and bytes of a batch's buffers, and a damaged file's batch would otherwise convert into other text, fail as
    text that is not UTF-8, or crash the process (out-of-bounds offsets into the memory map)."""
    import pyarrow as pa

    try:
        for batch in batches:
            if validate:
                batch.validate(full=True)
            yield batch
    except (pa.ArrowException, OSError) as e:
        raise _not_arrow(path, e) from None


def _not_arrow(path: Path, error: Exception) -> DataError:
    text = " ".join(str(error).split())
    with contextlib.suppress(OSError), path.open("rb") as f:
        file_format = f.read(len(_ARROW_FILE_MAGIC)) == _ARROW_FILE_MAGIC
    if "Expected to be able to read" in text or (file_format and text.startswith("Not an Arrow file")):
        what = "it is cut short (it ends inside a record batch, or before the IPC file's footer)"
    elif any(s in text for s in ("IPC message", "schema message", "metadata bytes", "Not an Arrow file")):
        what = "not an Arrow IPC stream or file (its first bytes are no Arrow message)"
    else:
        what = "a record batch is damaged"
    return DataError(f"{path} is not a readable Arrow file ({text}): {what}. Write it again (Dataset.save_to_disk, "
                     "or pyarrow's IPC writers), or give the data as .jsonl or .parquet.")


def arrow_rows(path: Path) -> int:
    with _arrow_batches(path, validate=False) as batches:
        return sum(batch.num_rows for batch in batches)


def arrow_chunks(path: Path, start: int, stop: int | None, batch_size: int) -> Iterator[Records]:
    """Rows ``start`` to ``stop`` in chunks of at most ``batch_size``; batches before ``start`` are skipped by
    their row counts, and reading stops at ``stop``."""
    row, folder = 0, folder_of(path)
    with _arrow_batches(path) as batches:
        for batch in batches:
            end = row + batch.num_rows
            lo, hi = max(start, row), end if stop is None else min(stop, end)
            for at in range(lo, hi, batch_size):
                piece = batch.slice(at - row, min(batch_size, hi - at))
                yield Records(piece.to_pylist(), lambda i, at=at: Place(f"{path} row {at + i}", folder))
            row = end
            if stop is not None and row >= stop:
                return

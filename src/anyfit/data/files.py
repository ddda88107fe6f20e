"""What a local data file is, and its bytes as one stream.

The name says the format: ``data.jsonl`` and ``data.jsonl.gz`` are JSON Lines, the second gzip-compressed (the
suffix before the compression's names the format, as in `datasets`). The first bytes say the compression: a
gzip file named ``data.jsonl`` is read too. A compressed file is decompressed as it is read, so the text readers
stream it line by line as they stream a plain file, in memory of about one chunk.

gzip, bz2, xz and .lzma are read with the standard library; zstd with Python's ``compression.zstd`` (3.14 and
later) or the ``zstandard`` package, lz4 with the ``lz4`` package: the compressions `datasets` reads. Any other
file is a DataError that says what to do with it (extract the archive, export the sheet as CSV, ...).
"""

from __future__ import annotations

import bz2
import codecs
import gzip
import io
import lzma
import zlib
from pathlib import Path
from typing import BinaryIO

from anyfit.data.records import DataError
from anyfit.hub import COMPRESSIBLE_FORMATS, COMPRESSIONS, DATA_FORMATS

# What anyfit reads, as the messages about other files say it.
READABLE = (".jsonl/.ndjson, .json, .csv (also compressed: .gz, .bz2, .xz, .zst, .lz4), .parquet and .arrow files "
            "(or a folder or a glob of them, a folder written by save_to_disk, or a hub dataset through `datasets`)")
_NAMES = {".gz": "gzip", ".gzip": "gzip", ".bz2": "bz2", ".xz": "xz", ".lzma": "lzma", ".zst": "zstd",
          ".zstd": "zstd", ".lz4": "lz4"}
# Compressions known by their first bytes. bz2 by 10 of them ("BZh", a block size, and the magic of its first block
# or of its end): a text file cannot start so by chance; the others start with bytes that are not UTF-8 text.
_COMPRESSED_MAGIC = ((b"\x1f\x8b", "gzip"), (b"\xfd7zXZ\x00", "xz"), (b"\x28\xb5\x2f\xfd", "zstd"),
                     (b"\x04\x22\x4d\x18", "lz4"))
_BZ2_BLOCKS = (b"1AY&SY", b"\x17rE8P\x90")
# Leading bytes (after decompression) of files that are often given a text name by mistake.
_MAGIC = {b"PAR1": "a Parquet file: give it the suffix .parquet",
          b"ARROW1": "an Arrow file: give it the suffix .arrow",
          b"\xff\xff\xff\xff": "an Arrow stream (as `datasets` writes it): give it the suffix .arrow",
          b"PK\x03\x04": "a zip archive: extract it first (unzip) and set data.path to what it holds",
          b"Rar!": "a rar archive: extract it first and set data.path to what it holds"}
_ARCHIVES = (".zip", ".tar", ".tgz", ".7z", ".rar")
_ADVICE = {".txt": "to read one record per line, make it JSON Lines, e.g. jq -Rc '{{text: .}}' {path} > {stem}.jsonl",
           ".tsv": "save it as .csv, e.g. with pandas: pd.read_csv('{path}', sep='\\t').to_csv('{stem}.csv', "
                   "index=False)",
           ".xlsx": "export it from the spreadsheet as CSV UTF-8 (.csv)"}
_ADVICE[".xls"] = _ADVICE[".ods"] = _ADVICE[".xlsx"]
_HEAD = 512  # enough to tell a tar archive (its magic is at byte 257)


def file_format(path: Path) -> tuple[str, str | None]:
    """(format suffix, compression name or None) of a file read here, by its name: ``data.jsonl.gz`` is
    ``('.jsonl', 'gzip')``. A DataError, in one line with the way forward, for any other file."""
    suffixes = [s.lower() for s in path.suffixes]
    last = suffixes[-1] if suffixes else ""
    if last in DATA_FORMATS:
        return last, None
    inner = suffixes[-2] if len(suffixes) > 1 else ""
    if last in COMPRESSIONS and inner in COMPRESSIBLE_FORMATS:
        return inner, _NAMES[last]
    raise DataError(_unsupported(path, inner, last))


def is_readable(path: Path) -> bool:
    try:
        file_format(path)
    except DataError:
        return False
    return True


def _unsupported(path: Path, inner: str, last: str) -> str:
    kind = inner + last if last in COMPRESSIONS and (inner in DATA_FORMATS or inner == ".tar") else last
    stem = path.name[: len(path.name) - len(kind)] if kind else path.name
    stem = stem[: -len(inner)] if last in COMPRESSIONS and kind == last and inner else stem  # my.data.gz: my
    if last in _ARCHIVES or inner == ".tar":
        advice = "it is an archive: extract it first (unzip, tar -xf) and set data.path to the folder or file it holds"
    elif last in COMPRESSIONS and inner in DATA_FORMATS:
        advice = f"{inner} files are read uncompressed: decompress it first"
    elif last in COMPRESSIONS:
        advice = f"name the format of what it holds, e.g. {stem}.jsonl{last} for JSON Lines"
    elif last in _ADVICE:
        advice = _ADVICE[last].format(path=path, stem=stem)
    else:
        advice = "convert it to JSON Lines (.jsonl, one JSON object per line)"
    what = f"unsupported file type {kind!r}" if kind else "a file without a suffix that names its type"
    return f"{path}: {what}; {advice}. anyfit reads {READABLE}."


def open_bytes(path: Path) -> tuple[BinaryIO, int, str | None]:
    """The file's bytes (decompressed), the length of its UTF-8 byte-order mark (0 or 3), and its compression
    (None when plain), after checking that it is not UTF-16 or a binary file under a text name."""
    f = None
    try:
        f = path.open("rb")
        head = f.peek(_HEAD)[:_HEAD]
    except OSError as e:  # no permission, a file that vanished, a network share that went away
        if f is not None:
            f.close()
        raise DataError(f"{path}: cannot read the file ({e.strerror or e}).") from None
    compression = _compression(path, head)
    if compression:
        f = io.BufferedReader(_Decompressed(path, f, compression), 1 << 16)
        try:
            head = f.peek(_HEAD)[:_HEAD]
        except DataError:
            f.close()
            raise
    if head.startswith((codecs.BOM_UTF16_LE, codecs.BOM_UTF16_BE)):
        f.close()
        raise DataError(f"{path} is UTF-16 text, but anyfit reads UTF-8: re-encode it, e.g. "
                        f"{reencode(path, 'UTF-16', compression)}")
    what = next((what for magic, what in _MAGIC.items() if head.startswith(magic)), None)
    if what is None and head[257:262] == b"ustar":
        what = "a tar archive: extract it first (tar -xf) and set data.path to what it holds"
    if what:
        f.close()
        raise DataError(f"{path} is {what}.")
    # Editors on Windows often start UTF-8 files with a byte-order mark; it is not part of the data.
    return f, len(codecs.BOM_UTF8) if head.startswith(codecs.BOM_UTF8) else 0, compression


def compression_of(path: Path) -> str | None:
    """The file's compression, by its first bytes (for messages; None where it cannot be read)."""
    try:
        with path.open("rb") as f:
            return _compression(path, f.read(_HEAD))
    except (OSError, DataError):
        return None


def reencode(path: Path, encoding: str, compression: str | None) -> str:
    """How to re-encode the file as UTF-8, as a command line (or the steps, for a compressed file)."""
    if compression:
        return f"decompress it, re-encode it (iconv -f {encoding} -t UTF-8) and compress it again"
    return f"iconv -f {encoding} -t UTF-8 {path} > {path.with_name(f'{path.stem}.utf8{path.suffix}')}"


def _compression(path: Path, head: bytes) -> str | None:
    """What the first bytes say; the name only where they cannot (.lzma has no magic). A name that says
    compressed on bytes that are not is an error: such a file is most often a download cut short or an error
    page."""
    for magic, name in _COMPRESSED_MAGIC:
        if head.startswith(magic):
            return name
    if head[:3] == b"BZh" and head[3:4].isdigit() and head[3:4] != b"0" and head[4:10] in _BZ2_BLOCKS:
        return "bz2"
    named = file_format(path)[1]
    if named == "lzma" or not named or not head:
        return named if head else None
    raise DataError(f"{path}: the name says {named}-compressed, but the file does not start as {named} data does "
                    f"(it starts with {head[:8]!r}); check that it was downloaded completely, or rename it.")


class _Decompressed(io.RawIOBase):
    """The decompressed bytes of an open file; damaged or cut-short data is a DataError naming the file."""

    def __init__(self, path: Path, raw: BinaryIO, compression: str):
        self.path, self.raw, self.compression = path, raw, compression
        try:
            self.inner, self.errors = _decompressor(path, raw, compression)
        except BaseException:
            raw.close()
            raise

    def readable(self) -> bool:
        return True

    def readinto(self, buffer) -> int:
        try:
            data = self.inner.read(len(buffer))
        except self.errors as e:
            raise DataError(f"{self.path} is {self.compression}-compressed, but its data is damaged or cut short "
                            f"({e}); download it or compress it again.") from None
        buffer[: len(data)] = data
        return len(data)

    def close(self) -> None:
        if not self.closed:
            try:
                self.inner.close()  # given an open file, the decompressors leave it open
            finally:
                self.raw.close()
        super().close()


def _decompressor(path: Path, raw: BinaryIO, compression: str):
    """A reader of the decompressed bytes, and the errors its read raises on bad data."""
    errors = (OSError, EOFError, zlib.error, lzma.LZMAError)
    if compression == "gzip":
        return gzip.GzipFile(fileobj=raw, mode="rb"), errors
    if compression == "bz2":
        return bz2.BZ2File(raw), errors
    if compression in ("xz", "lzma"):
        return lzma.LZMAFile(raw), errors  # the format is told by the data: .xz or the older .lzma
    if compression == "zstd":
        try:
            from compression import zstd  # the standard library from Python 3.14 on

            return zstd.ZstdFile(raw), errors + (zstd.ZstdError,)
        except ImportError:
            pass
        try:
            import zstandard
        except ImportError:
            raise DataError(f"{path} is zstd-compressed: reading it needs Python 3.14 or later, or the zstandard "
                            f"package (pip install zstandard); or decompress it first (zstd -d {path}).") from None
        return _ZstandardReader(raw, zstandard.ZstdDecompressor()), errors + (zstandard.ZstdError,)
    try:
        import lz4.frame
    except ImportError:
        raise DataError(f"{path} is lz4-compressed: reading it needs the lz4 package (pip install lz4); or "
                        f"decompress it first (lz4 -d {path}).") from None
    return lz4.frame.LZ4FrameFile(raw), errors + (RuntimeError,)  # lz4 reports bad data as RuntimeError


class _ZstandardReader:
    """The frames of a zstd file one after another (several when written by pzstd or appended to), through the
    zstandard package. Not its stream_reader: that ends silently where a file is cut short; this raises EOFError."""

    def __init__(self, raw: BinaryIO, dctx):
        self.raw, self.dctx, self.frame = raw, dctx, None
        self.out, self.at = b"", 0

    def read(self, size: int) -> bytes:
        while self.at == len(self.out):
            rest = b""
            if self.frame is not None and self.frame.eof:
                rest, self.frame = self.frame.unused_data, None  # what follows a frame starts the next
            data = rest or self.raw.read(1 << 16)
            if not data:
                if self.frame is not None:
                    raise EOFError("Compressed file ended before the end-of-stream marker was reached")
                return b""
            self.frame = self.frame or self.dctx.decompressobj()
            self.out, self.at = self.frame.decompress(data), 0
        data = self.out[self.at:self.at + size]
        self.at += len(data)
        return data

    def close(self) -> None:
        pass  # the file it reads is closed by its owner

"""What anyfit keeps on disk, written whole or not at all and checked before it is trusted: the one owner of
how a file is hashed, listed in a manifest, locked, and put in place.

- ``sha256``: a file's digest, read in 1 MiB blocks; with a memo folder, remembered while the file is unchanged;
- ``write_manifest`` / ``read_manifest`` / ``manifest_problem``: a folder's ``manifest.json``, written last, with
  the size and sha256 of each file; sizes are checked with a stat, digests when asked (a checkpoint and a token
  store each put their own facts beside the file table, which is the same for both);
- ``FileLock``: an exclusive ``flock`` on a file, waited for or refused at once;
- ``replacing`` / ``replace_file`` and ``building``: a file or a folder written under a temporary name next to
  its place and renamed into it when complete, so that an interruption (Ctrl-C, SIGKILL, a full disk) never
  leaves something that looks complete;
- ``follow_umask``: the modes a plain ``open``/``mkdir`` would have given.

The rename catches what happens while writing; the manifest what happens afterwards (a file truncated or zeroed
by a full disk, a copy cut short, a crash before the data reached the disk). Standard library only, on the
ground floor, so that the run folder, the cache, the data and the training code all ask this one module.
"""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import json
import os
import shutil
import tempfile
import time
from collections.abc import Iterable, Iterator
from pathlib import Path
from typing import Any

MANIFEST = "manifest.json"
# A hash the user can check by hand (sha256sum) and that is hardware-accelerated on current x86 (SHA-NI) and ARM
# CPUs: measured 1.5 GB/s here, against 3.4 GB/s for zlib's crc32.
HASH = "sha256"
_BLOCK = 1 << 20

# A digest is remembered (``sha256(path, memo)``) while the file is unchanged. Hashing the data set (1.6 GiB for a
# million conversations) and the token store (1.3 GiB) cost ~2 s of every start-up before; a remembered digest
# costs a stat. The key is the file's identity and state: device, inode, size, mtime and ctime in ns. No
# user-space call sets ctime (utime sets mtime; ctime becomes "now"), so a file rewritten, truncated, replaced or
# copied (a new inode and ctime) is hashed again. As git's index does for the same problem ("racy git"), a digest
# is remembered only when the file's last change is at least RACY_S older than the hash began: file system
# timestamps are coarse (a kernel tick), so a write in the same tick as the hash would otherwise leave the same
# key. Not seen: bytes changed on the disk below the file system after the hash (bit rot).
RACY_S = 2.0


def sha256(path: Path, memo: Path | None = None) -> str:
    """The hex sha256 of the file at ``path``; with ``memo`` (a folder), remembered there while the file is
    unchanged (see ``RACY_S``). Raises ``OSError`` when the file cannot be read."""
    started = time.time_ns()
    st = os.stat(path)
    note = memo / _memo_name(st) if memo is not None else None
    if note is not None:
        try:
            remembered = note.read_text().strip()
            if len(remembered) == 64:
                return remembered
        except OSError:
            pass
    digest = hashlib.sha256()
    buffer = bytearray(_BLOCK)
    view = memoryview(buffer)
    with open(path, "rb", buffering=0) as f:
        while n := f.readinto(buffer):
            digest.update(view[:n])
    hexdigest = digest.hexdigest()
    if note is not None and started - max(st.st_mtime_ns, st.st_ctime_ns) >= RACY_S * 1e9 \
            and _state(os.stat(path)) == _state(st):
        try:  # a memo folder that cannot be written only costs the next hash
            note.parent.mkdir(parents=True, exist_ok=True)
            replace_file(note, hexdigest)
        except OSError:
            pass
    return hexdigest


def _state(st: os.stat_result) -> tuple[int, ...]:
    return st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns, st.st_ctime_ns


def _memo_name(st: os.stat_result) -> str:
    return hashlib.sha256(":".join(map(str, _state(st))).encode()).hexdigest()[:40]


def write_manifest(folder: Path, names: Iterable[str], header: dict[str, Any], memo: Path | None = None) -> None:
    """Write ``folder``'s manifest: the keys of ``header``, then ``files``, the size and sha256 of each of ``names``
    (paths relative to ``folder``, with ``/``). Call it after every other file is written."""
    files = {name: {"size": (folder / name).stat().st_size, HASH: sha256(folder / name, memo)} for name in names}
    replace_file(folder / MANIFEST, json.dumps({**header, "files": files}, indent=1) + "\n")


def read_manifest(folder: Path) -> dict[str, Any] | None:
    """``folder``'s manifest; None when it is missing or unreadable, or its ``files`` are not what
    ``write_manifest`` writes (every name inside the folder, every entry with an integer size and a digest)."""
    try:
        manifest = json.loads((folder / MANIFEST).read_text())
        files = manifest["files"]
        if not isinstance(files, dict):
            return None
        for name, entry in files.items():
            if Path(name).is_absolute() or ".." in Path(name).parts:
                return None
            if not isinstance(entry.get("size"), int) or not isinstance(entry.get(HASH), str):
                return None
        return manifest
    except (OSError, UnicodeDecodeError, ValueError, KeyError, TypeError, AttributeError):
        return None


def manifest_problem(folder: Path, files: dict[str, dict[str, Any]], verify: bool,
                     memo: Path | None = None) -> str | None:
    """What is wrong with the files a manifest lists, in a few words naming one; None when they match. Every size
    first (a stat each), then with ``verify`` every digest (reads it all: about 0.7 s per GB here)."""
    for name, entry in files.items():
        path = folder / name
        if not path.is_file():
            return f"{name} is missing"
        size = path.stat().st_size
        if size != entry["size"]:
            return f"{name} has {size} bytes, the manifest says {entry['size']} (truncated or changed)"
    if verify:
        for name, entry in files.items():
            if sha256(folder / name, memo) != entry[HASH]:
                return f"{name} does not match its {HASH} in the manifest (corrupted)"
    return None


class LockBusy(Exception):
    """A ``FileLock(wait=False)`` held by another process; ``holder`` is what its file says ('' when nothing)."""

    def __init__(self, holder: str):
        super().__init__(holder)
        self.holder = holder


class FileLock:
    """An exclusive ``flock`` on ``path`` for the duration of a ``with`` block, waited for, or with ``wait=False``
    refused at once (``LockBusy``). The kernel releases it when the holding process ends, however it ends, so
    the file a crashed or killed process leaves behind blocks nothing. ``note`` (who holds it) is written into
    the file for a refused process to read; with ``remove`` the file is removed on release, while still held, so
    that a process that opened it meanwhile sees its inode change and locks a new file. (On a network file
    system that does not pass ``flock`` on, two machines do not see each other's lock.)"""

    def __init__(self, path: Path, wait: bool = True, note: str | None = None, remove: bool = False):
        self.path, self.wait, self.note, self.remove, self.file = Path(path), wait, note, remove, None

    def __enter__(self) -> FileLock:
        while True:
            file = self.path.open("a+", encoding="utf-8")
            try:
                fcntl.flock(file, fcntl.LOCK_EX | (0 if self.wait else fcntl.LOCK_NB))
            except BlockingIOError:
                file.seek(0)
                holder = file.read().strip()
                file.close()
                raise LockBusy(holder) from None
            except BaseException:  # Ctrl-C while waiting
                file.close()
                raise
            try:
                same = os.stat(self.path).st_ino == os.fstat(file.fileno()).st_ino
            except FileNotFoundError:
                same = False
            if same:  # else the holder removed the file as we opened it: lock the new one
                break
            file.close()
        if self.note is not None:
            file.truncate(0)
            file.write(self.note)
            file.flush()
        self.file = file
        return self

    def __exit__(self, *exc) -> bool:
        if self.file is not None:
            if self.remove:
                self.path.unlink(missing_ok=True)
            fcntl.flock(self.file, fcntl.LOCK_UN)
            self.file.close()
            self.file = None
        return False


@contextlib.contextmanager
def replacing(path: Path) -> Iterator[Path]:
    """A temporary file name beside ``path`` to write (by any writer); renamed over ``path`` when the ``with`` block
    ends, so a reader sees the old file or the new one, never a part; removed when the block raises."""
    path = Path(path)
    tmp = path.with_name(f"{path.name}.{os.getpid()}.tmp")
    try:
        yield tmp
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise


def replace_file(path: Path, data: str | bytes) -> None:
    """Put ``data`` (text as UTF-8) at ``path`` whole (``replacing``)."""
    with replacing(path) as tmp:
        tmp.write_bytes(data.encode() if isinstance(data, str) else data)


@contextlib.contextmanager
def building(folder: Path, replace: bool = False) -> Iterator[Path]:
    """A temporary folder beside ``folder`` (``.<name>.tmp-*``: a glob finds what a killed build left) to write
    into; when the ``with`` block ends, it takes the umask's modes (``follow_umask``) and is renamed to ``folder``
    (an existing ``folder`` removed first with ``replace``). When the block raises, Ctrl-C included, or the rename
    fails (``folder`` exists: another process finished first), the temporary folder is removed and the error
    raised."""
    folder = Path(folder)
    folder.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{folder.name}.tmp-", dir=folder.parent))
    try:
        yield tmp
        follow_umask(tmp)
        if replace and folder.exists():
            shutil.rmtree(folder)
        tmp.rename(folder)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise


def follow_umask(folder: Path) -> None:
    """Give ``folder`` and the files directly in it the modes a plain ``open``/``mkdir`` would under the process's
    umask: transformers writes weights through a private temporary file (mode 600) and ``tempfile.mkdtemp`` makes
    private folders (700), so on a shared disk a group could read a model's config but not its weights. Only the
    top level: that is where ``save_pretrained`` writes, and a run folder's checkpoints and logs below it were
    written with the umask already (walking them would cost a stat per file of a large sharded checkpoint)."""
    mask = os.umask(0)
    os.umask(mask)
    folder = Path(folder)
    folder.chmod(0o777 & ~mask)
    for path in folder.iterdir():
        if path.is_file() and not path.is_symlink():
            path.chmod(0o666 & ~mask)

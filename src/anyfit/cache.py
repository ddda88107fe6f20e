"""Where anyfit keeps what it derives once and reuses: GGUF models converted to safetensors
(``anyfit.model.gguf_cache``), tokenized data sets (``anyfit.data.store``) and the digests of large files."""

from __future__ import annotations

import hashlib
import os
import time
from pathlib import Path


def cache_root() -> Path:
    """``$ANYFIT_CACHE`` if set, else ``$XDG_CACHE_HOME/anyfit``, else ``~/.cache/anyfit``."""
    if os.environ.get("ANYFIT_CACHE"):
        return Path(os.environ["ANYFIT_CACHE"]).expanduser()
    xdg = os.environ.get("XDG_CACHE_HOME")
    return (Path(xdg).expanduser() if xdg else Path.home() / ".cache") / "anyfit"


# A file's digest is remembered while the file is unchanged. Hashing the data set (1.6 GiB for a million
# conversations) and the token store (1.3 GiB) cost ~2 s of every start-up before; a remembered digest costs a stat.
# The key is the file's identity and state: device, inode, size, mtime and ctime in ns. No user-space call sets
# ctime (utime sets mtime; ctime becomes "now"), so a file rewritten, truncated, replaced or copied (a new inode
# and ctime) is hashed again. As git's index does for the same problem ("racy git"), a digest is remembered only
# when the file's last change is at least RACY_S older than the hash began: file system timestamps are coarse (a
# kernel tick), so a write in the same tick as the hash would otherwise leave the same key. Not seen: bytes
# changed on the disk below the file system after the hash (bit rot).
RACY_S = 2.0
_BLOCK = 1 << 20


def file_sha256(path: Path) -> str:
    """The hex sha256 of the file at ``path`` (remembered under ``cache_root()/digests`` while it is unchanged).
    Raises ``OSError`` when the file cannot be read."""
    started = time.time_ns()
    st = os.stat(path)
    memo = _memo_path(st)
    try:
        remembered = memo.read_text().strip()
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
    if started - max(st.st_mtime_ns, st.st_ctime_ns) >= RACY_S * 1e9 and _state(os.stat(path)) == _state(st):
        _remember(memo, hexdigest)
    return hexdigest


def _state(st: os.stat_result) -> tuple[int, ...]:
    return st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns, st.st_ctime_ns


def _memo_path(st: os.stat_result) -> Path:
    key = ":".join(map(str, _state(st)))
    return cache_root() / "digests" / hashlib.sha256(key.encode()).hexdigest()[:40]


def _remember(memo: Path, hexdigest: str) -> None:
    """Write the memo atomically; a cache folder that cannot be written only costs the next hash."""
    try:
        memo.parent.mkdir(parents=True, exist_ok=True)
        tmp = memo.with_name(f"{memo.name}.{os.getpid()}.tmp")
        tmp.write_text(hexdigest)
        os.replace(tmp, memo)
    except OSError:
        pass

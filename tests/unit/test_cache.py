"""The remembered file digests (``anyfit.cache.file_sha256``): a remembered digest is never returned for a file
that changed, and a file changed within the file system's timestamp tick is never remembered."""

from __future__ import annotations

import hashlib
import os
import shutil

import pytest

from anyfit import cache, durable


def _sha(path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def _memos() -> list:
    folder = cache.cache_root() / "digests"
    return sorted(folder.iterdir()) if folder.is_dir() else []


@pytest.fixture()
def own_cache(tmp_path, monkeypatch):
    monkeypatch.setenv("ANYFIT_CACHE", str(tmp_path / "cache"))
    return tmp_path


def test_a_fresh_file_is_hashed_but_not_remembered(own_cache):
    path = own_cache / "data.bin"
    path.write_bytes(os.urandom(3 << 20))
    assert cache.file_sha256(path) == _sha(path)
    assert _memos() == []  # changed less than RACY_S ago: its timestamps could miss a change in the same tick


def test_a_remembered_digest_is_dropped_when_the_file_changes(own_cache, monkeypatch):
    monkeypatch.setattr(durable, "RACY_S", 0.0)
    path = own_cache / "data.bin"
    path.write_bytes(b"a" * 5000)
    first = cache.file_sha256(path)
    assert len(_memos()) == 1 and cache.file_sha256(path) == first
    before = os.stat(path)
    with open(path, "r+b") as f:  # same size, same mtime afterwards: only the ctime says it changed
        f.write(b"b")
    os.utime(path, ns=(before.st_atime_ns, before.st_mtime_ns))
    assert cache.file_sha256(path) == _sha(path) != first
    copy = own_cache / "copy.bin"
    shutil.copy2(path, copy)  # a copy keeps the mtime but is another inode
    assert cache.file_sha256(copy) == _sha(copy)
    assert len(_memos()) == 3


def test_an_unwritable_cache_only_costs_the_hash(own_cache, monkeypatch):
    monkeypatch.setattr(durable, "RACY_S", 0.0)
    (own_cache / "cache").write_text("a file where the cache folder should be")
    path = own_cache / "data.bin"
    path.write_bytes(b"x" * 100)
    assert cache.file_sha256(path) == _sha(path)

"""Files written whole or not at all, hashed, listed in a manifest and locked (``anyfit.durable``): the
manifests of checkpoints and token stores keep the bytes they had, damage is named, a folder is never seen
half-written, and a lock is held once."""

from __future__ import annotations

import hashlib
import json
import os
import threading
import time

import pytest

from anyfit import durable
from anyfit.durable import MANIFEST, FileLock, LockBusy, building, manifest_problem, read_manifest, replace_file


def _sha(path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


@pytest.fixture()
def folder(tmp_path):
    d = tmp_path / "store"
    d.mkdir()
    (d / "a.bin").write_bytes(os.urandom(3 << 20))  # more than one block
    (d / "sub").mkdir()
    (d / "sub" / "b.txt").write_text("b")
    return d


def test_sha256_reads_the_whole_file_and_remembers_only_with_a_memo(folder, tmp_path, monkeypatch):
    assert durable.sha256(folder / "a.bin") == _sha(folder / "a.bin")
    memo = tmp_path / "memo"
    monkeypatch.setattr(durable, "RACY_S", 0.0)
    assert durable.sha256(folder / "a.bin", memo) == _sha(folder / "a.bin")
    assert len(list(memo.iterdir())) == 1


def test_the_manifest_keeps_the_bytes_both_formats_had(folder):
    """A checkpoint's manifest (format, hash, files) and a token store's (its facts, then files): the header's keys
    in order, the file table last, indent 1, a final newline: what anyfit wrote before durable.py."""
    names = ["a.bin", "sub/b.txt"]
    table = {n: {"size": (folder / n).stat().st_size, "sha256": _sha(folder / n)} for n in names}
    for header in ({"format": 1, "hash": "sha256"}, {"format": 3, "key": "k", "counts": {"a": 1}, "report": {}}):
        durable.write_manifest(folder, names, header)
        assert (folder / MANIFEST).read_text() == json.dumps({**header, "files": table}, indent=1) + "\n"
        assert read_manifest(folder) == {**header, "files": table}
    assert sorted(p.name for p in folder.iterdir()) == ["a.bin", MANIFEST, "sub"]  # no temporary file left


@pytest.mark.parametrize("text", [
    "{", "[]", '{"files": []}', '{"files": {"x": 1}}', '{"files": {"x": {"size": 1}}}',
    '{"files": {"x": {"size": "1", "sha256": "0"}}}', '{"files": {"../x": {"size": 1, "sha256": "0"}}}',
    '{"files": {"/x": {"size": 1, "sha256": "0"}}}',
])
def test_a_manifest_that_is_not_what_anyfit_writes_is_none(folder, text):
    (folder / MANIFEST).write_text(text)
    assert read_manifest(folder) is None
    assert read_manifest(folder / "missing") is None


def test_damage_is_named_sizes_always_digests_when_asked(folder):
    durable.write_manifest(folder, ["a.bin", "sub/b.txt"], {"format": 1})
    files = read_manifest(folder)["files"]
    assert manifest_problem(folder, files, verify=True) is None
    (folder / "sub" / "b.txt").write_text("c")  # same size
    assert manifest_problem(folder, files, verify=False) is None
    assert manifest_problem(folder, files, verify=True) == \
        "sub/b.txt does not match its sha256 in the manifest (corrupted)"
    with open(folder / "a.bin", "r+b") as f:
        f.truncate(10)
    assert manifest_problem(folder, files, verify=False).startswith("a.bin has 10 bytes, the manifest says")
    (folder / "a.bin").unlink()
    assert manifest_problem(folder, files, verify=False) == "a.bin is missing"


def test_a_lock_is_refused_at_once_naming_its_holder_or_waited_for(tmp_path):
    path = tmp_path / "x.lock"
    with FileLock(path, wait=False, note="process 1 on here", remove=True):
        with pytest.raises(LockBusy) as busy:
            with FileLock(path, wait=False):
                pass
        assert busy.value.holder == "process 1 on here"
    assert not path.exists()  # removed on release

    order = []
    held = threading.Event()

    def hold():
        with FileLock(path):
            held.set()
            time.sleep(0.3)
            order.append("first released")

    thread = threading.Thread(target=hold)
    thread.start()
    held.wait()
    with FileLock(path):  # another open file description of the same file: waits, as another process does
        order.append("second held")
    thread.join()
    assert order == ["first released", "second held"]
    assert path.exists()  # kept without remove


def test_replace_file_leaves_the_old_file_or_the_new_one(tmp_path):
    path = tmp_path / "memo"
    replace_file(path, "one")
    replace_file(path, b"two")
    assert path.read_text() == "two"
    with pytest.raises(TypeError):
        replace_file(path, 3)  # not data: nothing written, nothing left behind
    assert path.read_text() == "two" and [p.name for p in tmp_path.iterdir()] == ["memo"]
    with pytest.raises(OSError):
        with durable.replacing(path) as tmp:  # a writer that fails half-way
            tmp.write_text("thr")
            raise OSError("no space left on device")
    assert path.read_text() == "two" and [p.name for p in tmp_path.iterdir()] == ["memo"]


def test_a_folder_is_renamed_into_place_only_when_complete(tmp_path):
    final = tmp_path / "cache" / "model"
    with pytest.raises(KeyboardInterrupt):
        with building(final) as tmp:
            assert tmp.name.startswith(".model.tmp-") and tmp.parent == final.parent
            (tmp / "w.bin").write_bytes(b"x")
            raise KeyboardInterrupt
    assert list(final.parent.iterdir()) == []  # nothing that looks complete, no temporary folder
    mask = os.umask(0o027)
    try:
        with building(final) as tmp:
            (tmp / "w.bin").write_bytes(b"x")
            (tmp / "w.bin").chmod(0o600)  # what a private temporary file of transformers' leaves
    finally:
        os.umask(mask)
    assert [p.name for p in final.parent.iterdir()] == ["model"] and (final / "w.bin").read_bytes() == b"x"
    assert final.stat().st_mode & 0o777 == 0o750 and (final / "w.bin").stat().st_mode & 0o777 == 0o640
    with pytest.raises(OSError):  # another process finished first: its folder stays, ours goes
        with building(final) as tmp:
            (tmp / "w.bin").write_bytes(b"y")
    assert [p.name for p in final.parent.iterdir()] == ["model"] and (final / "w.bin").read_bytes() == b"x"
    with building(final, replace=True) as tmp:  # overwrite: the old folder goes only once the new one is whole
        (tmp / "v.bin").write_bytes(b"z")
    assert [p.name for p in final.parent.iterdir()] == ["model"] and [p.name for p in final.iterdir()] == ["v.bin"]

"""What a resume is told about changed data: the examples compared by content (the token files and the rows
drawn), the records as multisets of digests (kept, gone, new), and the same records tokenized differently."""

from __future__ import annotations

import numpy as np

from anyfit.data.fingerprint import difference, load, record_digests, save, trained_fingerprint


def _fp(records: list[dict], tokens: str = "t", rows: bytes = b"r", path: str = "d.jsonl"):
    digests = record_digests(records, len(records))
    source = {"path": path, "key": "k", "records": len(records), "examples": len(records), "tokens": tokens}
    return {"trained": trained_fingerprint([source], [rows]), "sources": [source]}, [digests]


RECORDS = [{"prompt": f"q{i}", "completion": f"a{i}"} for i in range(10)]


def test_a_record_digest_is_its_content_not_its_key_order_or_place():
    a = record_digests([{"x": 1, "y": [1, 2]}, {"y": [1, 2], "x": 1}], 2)
    assert a.dtype == np.uint64 and a[0] == a[1]
    assert record_digests([{"x": 2, "y": [1, 2]}], 1)[0] != a[0]


def test_the_same_examples_are_no_difference_whatever_the_path():
    saved, digests = _fp(RECORDS)
    now, now_digests = _fp(RECORDS)
    assert difference(saved, digests, now, now_digests) is None


def test_edited_appended_and_removed_records_are_counted_as_multisets():
    saved, digests = _fp(RECORDS)
    edited = [*RECORDS[:3], {**RECORDS[3], "completion": "other"}, *RECORDS[4:]]
    said = difference(saved, digests, *_fp(edited, tokens="t2"))
    assert "of its 10 records 9 are unchanged and 1 gone, and 1 records are new" in said
    said = difference(saved, digests, *_fp(RECORDS + RECORDS[:2], tokens="t2"))
    assert "10 are unchanged and 0 gone, and 2 records are new" in said
    said = difference(saved, digests, *_fp(RECORDS[:7], tokens="t2", path="moved.jsonl"))
    assert said.startswith("d.jsonl then, moved.jsonl now: ") and "7 are unchanged and 3 gone, and 0" in said
    assert "in another order" in difference(saved, digests, *_fp(RECORDS[::-1], tokens="t2"))


def test_the_same_records_tokenized_otherwise_or_drawn_otherwise_are_named():
    saved, digests = _fp(RECORDS)
    assert "tokenize differently now" in difference(saved, digests, *_fp(RECORDS, tokens="t2"))
    assert "held out for validation or drawn by data.mix" in difference(saved, digests, *_fp(RECORDS, rows=b"s"))


def test_a_checkpoint_keeps_the_fingerprint_and_the_digests(tmp_path):
    fp, digests = _fp(RECORDS)
    save(tmp_path, fp, digests)
    loaded, loaded_digests = load(tmp_path)
    assert loaded == fp and np.array_equal(loaded_digests[0], digests[0])
    (tmp_path / "data_records-0.npy").unlink()  # the fingerprint still tells that something changed
    loaded, loaded_digests = load(tmp_path)
    assert loaded_digests == [None]
    assert "keeps no record digests" in difference(loaded, loaded_digests, *_fp(RECORDS[:5], tokens="t2"))
    assert load(tmp_path / "none") == (None, [])  # a checkpoint from before fingerprints: nothing to compare

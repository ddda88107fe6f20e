"""Reading local files and folders into records: formats, errors with file:line, slicing, num_samples."""

from __future__ import annotations

import json

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from anyfit.config import DataConfig
from anyfit.data.sources import DataError, load_records

ROWS = [{"prompt": f"q{i}", "completion": f"a{i}"} for i in range(10)]


def _jsonl(path, rows):
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def test_jsonl_skips_blank_lines(tmp_path):
    path = tmp_path / "d.jsonl"
    path.write_text('{"text": "a"}\n\n   \n{"text": "b"}\n')
    assert load_records(DataConfig(path=str(path))) == [{"text": "a"}, {"text": "b"}]


def test_malformed_jsonl_names_file_line_and_snippet(tmp_path):
    path = tmp_path / "d.jsonl"
    path.write_text('{"text": "a"}\n\n{"text": "b",, oops}\n')
    with pytest.raises(DataError) as e:
        load_records(DataConfig(path=str(path)))
    assert f"{path}:3:" in str(e.value)
    assert '"text": "b",, oops' in str(e.value)


def test_jsonl_line_that_is_not_an_object(tmp_path):
    path = tmp_path / "d.jsonl"
    path.write_text('{"text": "a"}\n[1, 2]\n')
    with pytest.raises(DataError, match=r"d\.jsonl:2: each line must be a JSON object"):
        load_records(DataConfig(path=str(path)))


def test_json_list_and_data_key(tmp_path):
    (tmp_path / "list.json").write_text(json.dumps(ROWS[:2]))
    (tmp_path / "wrapped.json").write_text(json.dumps({"version": 1, "data": ROWS[:2]}))
    for name in ("list.json", "wrapped.json"):
        assert load_records(DataConfig(path=str(tmp_path / name))) == ROWS[:2]


def test_json_of_the_wrong_shape(tmp_path):
    path = tmp_path / "d.json"
    path.write_text(json.dumps({"train": ROWS, "test": ROWS}))
    with pytest.raises(DataError, match=r"one list of records.*\['test', 'train'\]"):
        load_records(DataConfig(path=str(path)))
    path.write_text(json.dumps(["just", "strings"]))
    with pytest.raises(DataError, match="record 0 must be a JSON object"):
        load_records(DataConfig(path=str(path)))


def test_json_file_holding_json_lines(tmp_path):
    path = _jsonl(tmp_path / "d.json", ROWS[:3])
    assert load_records(DataConfig(path=str(path))) == ROWS[:3]


def test_parquet_round_trip(tmp_path):
    path = tmp_path / "d.parquet"
    rows = [{"messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "yo"}], "n": 1}]
    pq.write_table(pa.Table.from_pylist(rows), path)
    assert load_records(DataConfig(path=str(path))) == rows


@pytest.mark.parametrize("split, expected", [
    ("train", ROWS),
    ("train[:3]", ROWS[:3]),
    ("train[2:5]", ROWS[2:5]),
    ("train[-2:]", ROWS[-2:]),
    ("train[80%:]", ROWS[8:]),
    ("test[:1]", ROWS[:1]),  # one file is one split, whatever its name
])
def test_split_slicing_on_a_local_file(tmp_path, split, expected):
    path = _jsonl(tmp_path / "d.jsonl", ROWS)
    assert load_records(DataConfig(path=str(path), split=split)) == expected


def test_bad_split_spec(tmp_path):
    path = _jsonl(tmp_path / "d.jsonl", ROWS)
    with pytest.raises(DataError, match="not a valid split"):
        load_records(DataConfig(path=str(path), split="train[:abc]"))
    with pytest.raises(DataError, match="single file"):
        load_records(DataConfig(path=str(path), split="train+test"))


def test_num_samples_after_slicing(tmp_path):
    path = _jsonl(tmp_path / "d.jsonl", ROWS)
    assert load_records(DataConfig(path=str(path), split="train[5:]", num_samples=2)) == ROWS[5:7]


@pytest.mark.parametrize("spec", ["missing.jsonl", "data/missing", "./missing", "a/b/c"])
def test_missing_local_path(tmp_path, monkeypatch, spec):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "data").mkdir()
    with pytest.raises(DataError) as e:
        load_records(DataConfig(path=spec))
    assert f"Data file {spec} does not exist" in str(e.value)
    assert "Check data.path" in str(e.value)


def test_empty_file(tmp_path):
    path = tmp_path / "d.jsonl"
    path.write_text("\n")
    with pytest.raises(DataError, match="holds no records"):
        load_records(DataConfig(path=str(path)))


def test_unsupported_suffix(tmp_path):
    path = tmp_path / "d.tsv"
    path.write_text("a\tb\n1\t2\n")
    with pytest.raises(DataError, match="unsupported file type '.tsv'"):
        load_records(DataConfig(path=str(path)))


def test_folder_is_split_by_file_names(tmp_path, monkeypatch):
    import datasets

    monkeypatch.setattr(datasets.config, "HF_DATASETS_CACHE", str(tmp_path / "cache"))
    folder = tmp_path / "folder"
    folder.mkdir()
    _jsonl(folder / "train.jsonl", ROWS[:4])
    assert load_records(DataConfig(path=str(folder), split="train[1:3]")) == ROWS[1:3]


def test_folder_errors_name_the_file_and_line(tmp_path):
    folder = tmp_path / "folder"
    folder.mkdir()
    _jsonl(folder / "train.jsonl", ROWS[:2])
    (folder / "test.jsonl").write_text('{"prompt": "q"}\n{"prompt": \n')
    assert load_records(DataConfig(path=str(folder), split="train")) == ROWS[:2]
    with pytest.raises(DataError, match=r"test\.jsonl:2: not valid JSON"):
        load_records(DataConfig(path=str(folder), split="test"))
    with pytest.raises(DataError, match=r"no split 'validation'; its splits \(from the file names\) are train, test"):
        load_records(DataConfig(path=str(folder), split="validation"))
    (folder / "train-2.tsv").write_text("a\tb\n")
    with pytest.raises(DataError, match=r"holds train-2\.tsv, which anyfit does not read"):
        load_records(DataConfig(path=str(folder)))
    (tmp_path / "empty").mkdir()
    with pytest.raises(DataError, match="holds no data files"):
        load_records(DataConfig(path=str(tmp_path / "empty")))


def test_records_remember_their_file_and_line(tmp_path):
    from anyfit.data.formats import to_examples

    path = tmp_path / "d.jsonl"
    path.write_text('{"prompt": "a", "completion": "b"}\n\n{"prompt": "c", "completion": "d"}\n'
                    '{"prompt": "e", "completion": null}\n')
    records = load_records(DataConfig(path=str(path), split="train[1:]"))  # the slice keeps the places
    with pytest.raises(DataError, match=rf"Record 1 \({path}:4\): 'completion' is null"):
        to_examples(records, DataConfig())


@pytest.mark.parametrize("suffix", [".jsonl", ".json"])
def test_non_utf8_names_file_line_and_byte_offset(tmp_path, suffix):
    path = tmp_path / f"d{suffix}"
    first = json.dumps(ROWS[0]).encode() + b"\n"
    path.write_bytes((b"[" if suffix == ".json" else b"") + first + '{"prompt": "caf\xe9", "completion": "x"}'
                     .encode("latin-1"))
    offset = len(first) + len('{"prompt": "caf') + (suffix == ".json")
    with pytest.raises(DataError) as e:
        load_records(DataConfig(path=str(path)))
    msg = str(e.value)
    assert f"{path}:2: not UTF-8 text: byte 0xe9 at byte offset {offset}" in msg
    assert "iconv -f LATIN1 -t UTF-8" in msg and "\n" not in msg


def test_utf16_and_compressed_files_say_what_they_are(tmp_path):
    path = tmp_path / "d.jsonl"
    path.write_bytes(json.dumps(ROWS[0]).encode("utf-16"))
    with pytest.raises(DataError, match="is UTF-16 text.*iconv -f UTF-16"):
        load_records(DataConfig(path=str(path)))
    path.write_bytes(b"\x1f\x8b\x08\x00rest")
    with pytest.raises(DataError, match="gzip-compressed"):
        load_records(DataConfig(path=str(path)))


def test_bom_crlf_and_unescaped_line_separators_are_read(tmp_path):
    path = tmp_path / "d.jsonl"
    odd = {"prompt": "one\u2028two\x85three", "completion": "a\u2029b"}  # str.splitlines would split these
    path.write_bytes(b"\xef\xbb\xbf" + "".join(json.dumps(r, ensure_ascii=False) + "\r\n"
                                                for r in [ROWS[0], odd]).encode())
    assert load_records(DataConfig(path=str(path))) == [ROWS[0], odd]


def test_json_array_saved_as_jsonl_is_read(tmp_path):
    path = tmp_path / "d.jsonl"
    path.write_text(json.dumps(ROWS[:3], indent=2))
    assert load_records(DataConfig(path=str(path))) == ROWS[:3]


@pytest.mark.parametrize("line, message", [
    ('{"prompt": "a", "completion": ' + "9" * 5000 + "}", "a number in this line is too long"),
    ('{"prompt": ' + "[" * 100000 + "]" * 100000 + "}", "the JSON is nested too deeply"),
    ('{"prompt": "a\x01"}', r"not valid JSON \(Invalid control character, column 14\)"),
])
def test_unreadable_json_lines(tmp_path, line, message):
    path = tmp_path / "d.jsonl"
    path.write_text(json.dumps(ROWS[0]) + "\n" + line + "\n")
    with pytest.raises(DataError, match=rf"d\.jsonl:2: {message}"):
        load_records(DataConfig(path=str(path)))


def test_parquet_that_is_not_parquet(tmp_path):
    path = tmp_path / "d.parquet"
    path.write_bytes(b"this is not parquet")
    with pytest.raises(DataError, match=r"d\.parquet is not a readable Parquet file"):
        load_records(DataConfig(path=str(path)))

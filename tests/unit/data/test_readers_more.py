"""The local files `datasets` reads, read here as a stream too: compressed text (.jsonl.gz, .csv.bz2, ...; a gzip
file under a plain name), Arrow files, folders written by save_to_disk, a folder of one-record .json files (as the
MATH archive unpacks), and one line with the way forward for the files that are still not read."""

from __future__ import annotations

import bz2
import functools
import gzip
import json
import lzma
import sys

import pyarrow as pa
import pytest

from anyfit.config import DataConfig
from anyfit.data.readers import count_rows
from anyfit.data.sources import DataError, iter_records, load_records, source_fingerprint
from anyfit.hub import data_looks_local

N = 20
ROWS = [{"prompt": f"q{i}", "completion": f"a{i}"} for i in range(N)]
# mtime=0: the same bytes on every call, so parametrized ids are the same in every pytest-xdist worker.
COMPRESS = {"gz": functools.partial(gzip.compress, mtime=0), "bz2": bz2.compress, "xz": lzma.compress}


def _text(fmt, rows):
    if fmt in ("jsonl", "ndjson"):
        return "".join(json.dumps(r) + "\n" for r in rows).encode()
    if fmt == "json":
        return json.dumps({"data": rows}).encode()
    return ("prompt,completion\n" + "".join(f"{r['prompt']},{r['completion']}\n" for r in rows)).encode()


def _write(path, data):
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(data)
    return path


def _read(path, split="train", batch_size=8):
    """The records and their places, streamed."""
    batches = list(iter_records(DataConfig(path=str(path), split=split), batch_size=batch_size))
    return [r for b in batches for r in b], [b.locate(i) for b in batches for i in range(len(b))]


@pytest.mark.parametrize("fmt", ["jsonl", "ndjson", "json", "csv"])
@pytest.mark.parametrize("compression", ["gz", "bz2", "xz"])
def test_compressed_text_is_read_as_the_format_inside(tmp_path, fmt, compression):
    path = _write(tmp_path / f"d.{fmt}.{compression}", COMPRESS[compression](_text(fmt, ROWS)))
    records, places = _read(path)
    assert records == ROWS
    first = {"json": f"{path} 'data' record 0", "csv": f"{path}:2"}.get(fmt, f"{path}:1")
    assert places[0] == first
    assert _read(path, "train[:2]")[0] == ROWS[:2]
    assert _read(path, "train[50%:]")[0] == ROWS[N // 2:]
    assert count_rows(path) == N


def test_a_compressed_file_under_a_plain_name_is_decompressed(tmp_path):
    jsonl = _write(tmp_path / "d.jsonl", COMPRESS["gz"](_text("jsonl", ROWS)))
    csv = _write(tmp_path / "d.csv", bz2.compress(_text("csv", ROWS)))
    assert _read(jsonl, "train[3:5]") == (ROWS[3:5], [f"{jsonl}:4", f"{jsonl}:5"])
    assert _read(csv)[0] == ROWS and count_rows(csv) == N


def test_compressed_text_streams_and_errors_name_the_line(tmp_path):
    rows = [{"prompt": f"q{i}", "completion": f"a{i}"} for i in range(3000)]
    lines = [json.dumps(r) for r in rows]
    lines[2500] = '{"prompt": "q2500", "completion": '
    path = _write(tmp_path / "d.jsonl.gz", COMPRESS["gz"](("\n".join(lines) + "\n").encode()))
    stream = iter_records(DataConfig(path=str(path)), batch_size=1024)
    assert len(next(stream)) == 1024 and len(next(stream)) == 1024  # read before the bad line is reached
    with pytest.raises(DataError, match=rf"^{path}:2501: not valid JSON"):
        next(stream)
    assert load_records(DataConfig(path=str(path), split="train[:2500]")) == rows[:2500]  # outside: not parsed


@pytest.mark.parametrize("data, message", [
    (COMPRESS["gz"](_text("jsonl", ROWS))[:-30], r"d\.jsonl\.gz is gzip-compressed, but its data is damaged or cut"),
    (_text("jsonl", ROWS), r"d\.jsonl\.gz: the name says gzip-compressed, but the file does not start as gzip data"),
    (COMPRESS["gz"](b'{"prompt": "caf\xe9"}\n'),
     r"d\.jsonl\.gz:1: not UTF-8 text: byte 0xe9 at byte offset 15 of the decompressed text .*decompress it, re-enc"),
    (COMPRESS["gz"](b"\xff\xfe{\x00}\x00"), r"d\.jsonl\.gz is UTF-16 text, .*decompress it, re-encode it"),
])
def test_damaged_mislabeled_or_misencoded_compressed_files(tmp_path, data, message):
    path = _write(tmp_path / "d.jsonl.gz", data)
    with pytest.raises(DataError, match=message) as e:
        load_records(DataConfig(path=str(path)))
    assert "\n" not in str(e.value)


@pytest.mark.parametrize("suffix, blocked, package", [(".zst", ("compression", "zstandard"), "zstandard"),
                                                       (".lz4", ("lz4",), "lz4")])
def test_zstd_and_lz4_without_a_reader_say_what_to_install(tmp_path, monkeypatch, suffix, blocked, package):
    for name in blocked:
        monkeypatch.setitem(sys.modules, name, None)  # import fails as if it were not installed
    magic = {".zst": b"\x28\xb5\x2f\xfd", ".lz4": b"\x04\x22\x4d\x18"}[suffix]
    path = _write(tmp_path / f"d.jsonl{suffix}", magic + b"\x00" * 16)
    with pytest.raises(DataError, match=rf"reading it needs .*pip install {package}\); or decompress it first"):
        load_records(DataConfig(path=str(path)))


def _zstd_compress():
    try:
        from compression import zstd  # Python 3.14 and later

        return zstd.compress
    except ImportError:
        return pytest.importorskip("zstandard").ZstdCompressor().compress


@pytest.mark.parametrize("suffix", [".zst", ".lz4"])
def test_zstd_and_lz4_where_a_reader_is_installed(tmp_path, suffix):
    compress = _zstd_compress() if suffix == ".zst" else pytest.importorskip("lz4.frame").compress
    text = _text("jsonl", ROWS)
    path = _write(tmp_path / f"d.jsonl{suffix}", compress(text[:100]) + compress(text[100:]))  # two frames
    assert _read(path, "train[-2:]") == (ROWS[-2:], [f"{path}:19", f"{path}:20"])
    path.write_bytes(compress(text)[:-5])
    with pytest.raises(DataError, match=r"-compressed, but its data is damaged or cut short"):  # not silently less
        load_records(DataConfig(path=str(path)))


def test_globs_and_folders_pick_up_compressed_shards(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    _write(tmp_path / "data" / "train-1.csv.bz2", bz2.compress(_text("csv", ROWS[10:])))
    _write(tmp_path / "data" / "train-0.jsonl.gz", COMPRESS["gz"](_text("jsonl", ROWS[:10])))
    _write(tmp_path / "data" / "test.jsonl.xz", lzma.compress(_text("jsonl", ROWS[:3])))
    records, places = _read("data/train-*", "train[8:12]")
    assert records == ROWS[8:12] and places == ["data/train-0.jsonl.gz:9", "data/train-0.jsonl.gz:10",
                                                "data/train-1.csv.bz2:2", "data/train-1.csv.bz2:3"]
    assert _read("data", "train")[0] == ROWS and _read("data", "test")[0] == ROWS[:3]
    first = source_fingerprint(DataConfig(path="data/train-*.jsonl.gz"))
    shard = tmp_path / "data" / "train-0.jsonl.gz"
    shard.write_bytes(COMPRESS["gz"](_text("jsonl", ROWS[:9] + [ROWS[0]])))
    assert source_fingerprint(DataConfig(path="data/train-*.jsonl.gz")) != first


def _arrow_file(path, rows, stream, batch_rows=3):
    table = pa.Table.from_pylist(rows)
    with pa.OSFile(str(path), "wb") as sink:
        writer = (pa.ipc.new_stream if stream else pa.ipc.new_file)(sink, table.schema)
        for batch in table.to_batches(max_chunksize=batch_rows):
            writer.write_batch(batch)
        writer.close()
    return path


@pytest.mark.parametrize("stream", [True, False], ids=["ipc-stream", "ipc-file"])
def test_arrow_files_are_read_by_record_batches(tmp_path, stream):
    path = _arrow_file(tmp_path / "d.arrow", ROWS, stream)
    records, places = _read(path, batch_size=2)
    assert records == ROWS and places[7] == f"{path} row 7"
    assert _read(path, "train[4:9]") == (ROWS[4:9], [f"{path} row {i}" for i in range(4, 9)])
    assert _read(path, "train[50%:]")[0] == ROWS[N // 2:]
    assert count_rows(path) == N
    first = source_fingerprint(DataConfig(path=str(path)))
    _arrow_file(path, ROWS[:-1] + [{"prompt": "q19", "completion": "changed"}], stream)
    assert source_fingerprint(DataConfig(path=str(path))) != first


def test_an_arrow_file_that_is_not_arrow(tmp_path):
    path = _write(tmp_path / "d.arrow", b"not arrow at all")
    with pytest.raises(DataError, match=r"d\.arrow is not a readable Arrow file .*give the data as \.jsonl"):
        load_records(DataConfig(path=str(path)))


def test_a_dataset_saved_to_disk(tmp_path, monkeypatch):
    import datasets

    monkeypatch.chdir(tmp_path)
    datasets.Dataset.from_list(ROWS).save_to_disk("saved", num_shards=2)
    records, places = _read("saved", batch_size=3)
    assert records == ROWS
    assert places[0] == "saved/data-00000-of-00002.arrow row 0"
    assert places[10] == "saved/data-00001-of-00002.arrow row 0"
    assert _read("saved", "train[:2]")[0] == ROWS[:2] and _read("saved", "train[50%:]")[0] == ROWS[N // 2:]
    assert _read("saved", "test[8:12]")[0] == ROWS[8:12]  # one saved split: only the slice matters
    with pytest.raises(DataError, match="one saved split"):
        load_records(DataConfig(path="saved", split="train+test"))
    first = source_fingerprint(DataConfig(path="saved"))
    datasets.Dataset.from_list(ROWS[:-1] + [{"prompt": "q19", "completion": "other"}]).save_to_disk("other",
                                                                                                  num_shards=2)
    shard = tmp_path / "saved" / "data-00001-of-00002.arrow"
    shard.write_bytes((tmp_path / "other" / shard.name).read_bytes())
    assert source_fingerprint(DataConfig(path="saved")) != first
    (tmp_path / "saved" / "data-00000-of-00002.arrow").unlink()
    with pytest.raises(DataError, match=r"Saved dataset saved lacks data-00000-of-00002\.arrow, which its state\.json"):
        load_records(DataConfig(path="saved"))


def test_a_dataset_dict_saved_to_disk(tmp_path, monkeypatch):
    import datasets

    monkeypatch.chdir(tmp_path)
    splits = {"train": ROWS, "holdout": ROWS[:5]}
    datasets.DatasetDict({k: datasets.Dataset.from_list(v) for k, v in splits.items()}).save_to_disk("dd")
    assert _read("dd", "train[50%:]")[0] == ROWS[N // 2:]
    records, places = _read("dd", "train[:2]+holdout[-1:]")
    assert records == ROWS[:2] + ROWS[4:5] and places[-1] == "dd/holdout/data-00000-of-00001.arrow row 4"
    with pytest.raises(DataError, match=r"saved dataset dict dd has no split 'test'; its splits are train, holdout"):
        load_records(DataConfig(path="dd", split="test"))
    train = source_fingerprint(DataConfig(path="dd"))
    datasets.Dataset.from_list(ROWS[:4]).save_to_disk("dd2")
    (tmp_path / "dd" / "holdout" / "data-00000-of-00001.arrow").write_bytes(
        (tmp_path / "dd2" / "data-00000-of-00001.arrow").read_bytes())
    assert source_fingerprint(DataConfig(path="dd")) == train  # the holdout split changed, not train
    # Split subfolders each saved on their own (no dataset_dict.json) are split by their names, as any folder is.
    (tmp_path / "dd" / "dataset_dict.json").unlink()
    (tmp_path / "dd" / "holdout").rename(tmp_path / "dd" / "test")
    records, places = _read("dd", "test")
    assert records == ROWS[:4] and places[0] == str(tmp_path / "dd/test/data-00000-of-00001.arrow row 0")
    assert _read("dd", "train[-1:]")[0] == ROWS[-1:]


def _math(root):
    """A MATH-like tree: one .json object per problem, under split and subject folders."""
    problems = {"train/algebra/1.json": 0, "train/algebra/10.json": 1, "train/algebra/2.json": 2,
                "train/geometry/1.json": 3, "test/algebra/5.json": 4}
    for name, i in problems.items():
        record = {"problem": f"p{i}", "level": "Level 2", "type": name.split("/")[1].title(), "solution": f"s{i}"}
        _write(root / name, json.dumps(record, indent=4).encode())
    return [f"p{i}" for i in range(4)]


def test_a_folder_of_one_record_json_files(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    order = _math(tmp_path / "MATH")
    records, places = _read("MATH", "train")
    assert [r["problem"] for r in records] == order  # by path: 1, 10, 2, then geometry
    assert places[:2] == [str(tmp_path / "MATH/train/algebra/1.json"), str(tmp_path / "MATH/train/algebra/10.json")]
    assert records[3] == {"problem": "p3", "level": "Level 2", "type": "Geometry", "solution": "s3"}
    assert [r["problem"] for r in _read("MATH", "train[:2]")[0]] == order[:2]
    assert [r["problem"] for r in _read("MATH", "train[50%:]")[0]] == order[2:]
    assert _read("MATH", "test")[0][0]["problem"] == "p4"
    assert count_rows(tmp_path / "MATH/train/algebra/1.json") == 1
    first = source_fingerprint(DataConfig(path="MATH"))
    assert first == source_fingerprint(DataConfig(path="MATH"))
    (tmp_path / "MATH/train/algebra/2.json").write_text(json.dumps({"problem": "changed"}))
    assert source_fingerprint(DataConfig(path="MATH")) != first


CHAT = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "yo"}]


@pytest.mark.parametrize("document, wrapper", [
    ({"problem": "p", "solution": "s"}, None),  # no list: one record
    ({"messages": CHAT}, None),  # its one list is a conversation: one record
    ({"conversations": [{"from": "human", "value": "hi"}]}, None),
    ({"prompt": "p", "tags": ["a", "b"], "choices": ["x"]}, None),  # lists of plain values are fields
    ({"data": ROWS[:2]}, "data"),  # a wrapper of records
    ({"version": 1, "rows": ROWS[:2]}, "rows"),
])
def test_a_json_object_is_a_record_or_a_wrapper(tmp_path, document, wrapper):
    path = _write(tmp_path / "d.json", json.dumps(document).encode())
    records, places = _read(path)
    if wrapper is None:
        assert records == [document] and places == [str(path)]  # placed as the file itself
    else:
        assert records == document[wrapper] and places[1] == f"{path} '{wrapper}' record 1"


def test_a_json_object_of_the_wrong_shape(tmp_path):
    path = _write(tmp_path / "d.json", json.dumps({"data": []}).encode())
    with pytest.raises(DataError, match="holds no records"):  # a wrapper, empty
        load_records(DataConfig(path=str(path)))
    path.write_text(json.dumps({"train": ROWS, "test": ROWS}))
    with pytest.raises(DataError, match=r"found several, under keys \['test', 'train'\]: keep one"):
        load_records(DataConfig(path=str(path)))


@pytest.mark.parametrize("name, advice", [
    ("notes.txt", r"jq -Rc '\{text: \.\}' .*notes\.txt > notes\.jsonl"),
    ("sheet.xlsx", r"export it from the spreadsheet as CSV UTF-8"),
    ("data.tar.gz", r"unsupported file type '\.tar\.gz'; it is an archive: extract it first"),
    ("data.zip", r"it is an archive: extract it first"),
    ("data.gz", r"name the format of what it holds, e.g. data\.jsonl\.gz"),
    ("data.parquet.gz", r"\.parquet files are read uncompressed: decompress it first"),
])
def test_files_still_not_read_are_one_line_with_the_way_forward(tmp_path, name, advice):
    path = _write(tmp_path / name, b"hello")
    with pytest.raises(DataError, match=advice) as e:
        load_records(DataConfig(path=str(path)))
    assert str(e.value).startswith(f"{path}: unsupported file type") and "\n" not in str(e.value)
    assert data_looks_local(name)  # a local file to refuse, not a hub name to look up


def test_unread_files_in_folders_and_globs(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    _write(tmp_path / "data" / "train.jsonl.gz", COMPRESS["gz"](_text("jsonl", ROWS)))
    _write(tmp_path / "data" / "train-extra.tar.gz", b"archive")
    with pytest.raises(DataError, match=r"holds train-extra\.tar\.gz, which anyfit does not read"):
        load_records(DataConfig(path="data"))
    with pytest.raises(DataError, match=r"matches data/train-extra\.tar\.gz, which anyfit does not read"):
        load_records(DataConfig(path="data/train*"))
    assert load_records(DataConfig(path="data/*.jsonl.gz")) == ROWS


@pytest.mark.parametrize("data, what", [
    (None, r"is an Arrow stream \(as `datasets` writes it\): give it the suffix \.arrow"),
    (b"a" * 257 + b"ustar\x0000" + b"\x00" * 250, r"is a tar archive: extract it first"),
    (b"PK\x03\x04rest", r"is a zip archive"),
])
def test_binary_files_under_a_text_name_say_what_they_are(tmp_path, data, what):
    path = tmp_path / "d.jsonl"
    if data is None:
        _arrow_file(path, ROWS, stream=True)
    else:
        _write(path, COMPRESS["gz"](data))  # what the decompressed bytes are is what counts
    with pytest.raises(DataError, match=rf"d\.jsonl {what}"):
        load_records(DataConfig(path=str(path)))

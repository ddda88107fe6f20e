"""anyfit.faults: an error of the machine or its files as one line (which file, what is wrong, what to do, which
setting names the place), and anything else left to its traceback."""

from __future__ import annotations

import errno
import json
import os

import pytest

from anyfit.faults import FileFault, one_line, os_problem, setting_of


def test_the_innermost_place_names_the_setting(tmp_path):
    places = {"ANYFIT_CACHE": tmp_path / "cache", "data.cache_dir": tmp_path / "cache" / "tok",
              "train.output_dir": tmp_path / "run", "--out": None}
    assert setting_of(tmp_path / "cache" / "tok" / "x.bin", places) == "data.cache_dir"
    assert setting_of(tmp_path / "cache" / "digests" / "x", places) == "ANYFIT_CACHE"
    assert setting_of(tmp_path / "run", places) == "train.output_dir"
    assert setting_of(tmp_path / "runs", places) is None and setting_of(None, places) is None


@pytest.mark.parametrize("code, says, status", [
    (errno.EROFS, "the file system is read-only; make it writable, or set train.output_dir to a writable folder", 1),
    (errno.EACCES, "this user may not use it; fix its permissions (or run as its owner), or set train.output_dir to "
                   "a place this user may read and write", 1),
    (errno.ENOSPC, "no space left there (or a quota or file-size limit reached) (", 1),
    (errno.EDQUOT, "free space, or set train.output_dir to another folder on a disk with room", 1),
    (errno.ENOENT, "it is not there (moved or deleted while anyfit ran?); put it back, or set train.output_dir to "
                   "where it is now", 1),
    (errno.EISDIR, "that is a folder where a file is needed", 2),
    (errno.EIO, "the disk (or the network file system) failed", 1),
])
def test_an_os_error_is_one_line_by_its_errno(tmp_path, code, says, status):
    error = OSError(code, os.strerror(code), str(tmp_path / "run" / "metrics.jsonl"))
    line, got = one_line(error, {"train.output_dir": tmp_path / "run"})
    assert line.startswith(f"{tmp_path / 'run' / 'metrics.jsonl'}: {os.strerror(code)} (under train.output_dir): ")
    assert says in line and got == status and "\n" not in line


def test_a_write_that_names_no_file_is_told_where_it_went(tmp_path):
    line = os_problem(OSError(errno.ENOSPC, "No space left on device"), {"ANYFIT_CACHE": tmp_path},
                      doing="the token store of d.jsonl was not written", where=tmp_path)
    assert line.startswith(f"the token store of d.jsonl was not written: {tmp_path}: No space left on device (under "
                           "ANYFIT_CACHE): ")
    assert f"free on {tmp_path})" in line and "set ANYFIT_CACHE to another folder on a disk with room." in line


def test_a_parsers_error_names_the_file_it_was_reading(tmp_path):
    path = tmp_path / "tokenizer.json"
    path.write_text('{"model": ')

    def read(path):
        return json.loads(path.read_text())

    with pytest.raises(json.JSONDecodeError) as caught:
        read(path)
    line, status = one_line(caught.value, {"model.name_or_path": tmp_path})
    assert line.startswith(f"{path}: not readable as a JSON file (Expecting value") and status == 2
    assert "(under model.name_or_path): the file is damaged, cut short or of another kind" in line


def test_a_librarys_oserror_about_a_file_it_could_not_parse_is_bad_input(tmp_path):
    config_file = tmp_path / "config.json"
    config_file.write_text("{")
    try:
        try:
            json.loads(config_file.read_text())
        except json.JSONDecodeError:  # as transformers does
            raise OSError(f"It looks like the config file at '{config_file}' is not a valid JSON file.")
    except OSError as e:
        line, status = one_line(e)
    assert line.startswith(f"{config_file}: not readable as a JSON file (It looks like") and status == 2


def test_a_rust_librarys_io_error_is_read_by_its_errno():
    class SafetensorError(Exception):
        pass

    SafetensorError.__module__ = "safetensors._safetensors_rust"
    line, status = one_line(SafetensorError("I/O error: No space left on device (os error 28)"))
    assert line.startswith("No space left on device: no space left there") and status == 1


def test_programming_errors_keep_their_traceback():
    assert one_line(TypeError("unsupported operand")) is None
    assert one_line(ValueError("bad value")) is None
    assert one_line(json.JSONDecodeError("Expecting value", "{", 1)) is None  # no file behind it: not told as one
    assert one_line(FileFault("said already")) == ("said already", 1)

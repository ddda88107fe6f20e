"""One line instead of a traceback for what goes wrong with the machine or its files: a folder that cannot be
written or read (a read-only disk, permissions), a full disk or quota, a file or folder that disappeared while
anyfit ran, and a file a library could not parse (a damaged Arrow, Parquet, safetensors, JSON, YAML or torch
file, text that is not UTF-8).

- ``one_line(error, places)``: ``(line, exit status)`` for such an error, None for anything else (a programming
  error keeps its traceback). The line names the file (the error's own; for a parser's error, the file the
  failing code was reading), what is wrong, what to do (by errno) and the setting that names the place
  (``places``: a setting such as ``train.output_dir`` -> its folder; the innermost place holding the file wins).
  Exit status 1 for the machine or its files, 2 for a damaged or wrong input file (bad input, as ``DataError``).
- ``os_problem(error, places, doing)``: that line for an ``OSError``, for code that adds what it was doing;
- ``FileFault``: such a line raised by the code that knows more than the error does (the run lock, the token
  store's build), exit status 1.

``anyfit.cli.main`` prints the line as ``anyfit: error: ...``. Standard library only (the libraries whose errors
it recognises are known by their class names, not imported), on the ground floor, so that the run folder, the
data and the training code can all use it.
"""

from __future__ import annotations

import errno
import io
import os
import re
import shutil
from collections.abc import Mapping
from pathlib import Path
from types import TracebackType

NO_ROOM = frozenset({errno.ENOSPC, errno.EDQUOT, errno.EFBIG})
NOT_ALLOWED = frozenset({errno.EROFS, errno.EACCES, errno.EPERM})
GONE = frozenset({errno.ENOENT, errno.ESTALE})
WRONG_KIND = frozenset({errno.EISDIR, errno.ENOTDIR, errno.EEXIST})  # a file where a folder is needed, or the
# other way round: bad input

# Errors of the libraries that read files, about a file's content: (module prefix, class name) anywhere in the
# error's class hierarchy, with what the file should have been.
FORMAT_ERRORS = (
    ("pyarrow", "ArrowException", "an Arrow or Parquet file"),
    ("safetensors", "SafetensorError", "a safetensors file"),
    ("json", "JSONDecodeError", "a JSON file"),
    ("yaml", "YAMLError", "a YAML file"),
    ("builtins", "UnicodeDecodeError", "a UTF-8 text file"),
    ("zipfile", "BadZipFile", "a zip archive (a torch .pt file is one)"),
    ("_pickle", "UnpicklingError", "a pickle (torch .pt) file"),
)
# torch's C++ reader and writer raise RuntimeError; what they say tells a damaged file or a failed write.
TORCH_READ = ("PytorchStreamReader failed",)
TORCH_WRITE = ("PytorchStreamWriter failed", "file write failed")
_OS_ERROR = re.compile(r"\(os error (\d+)\)")  # how Rust's std::io::Error ends its message
# Local names that hold the file the failing code was reading (a Path of any name counts too).
_PATH_NAMES = ("path", "file", "filename", "filepath", "source")  # and names ending in _file or _path


Places = Mapping[str, "str | Path | None"]  # a setting (or option, or environment variable) -> the place it names


class FileFault(Exception):
    """A file or folder anyfit needs cannot be written or read; the message says which, why and what to do
    (printed as ``anyfit: error: ...``, exit status 1)."""


def one_line(error: BaseException, places: Places | None = None) -> tuple[str, int] | None:
    """``(line, exit status)`` when ``error`` is about the machine or a file; None otherwise."""
    places = places or {}
    if isinstance(error, FileFault):
        return str(error), 1
    text = " ".join(str(error).split())
    cause = error.__cause__ or error.__context__
    if isinstance(error, OSError) and error.errno is None and cause is not None and _format_kind(cause):
        # a library's own OSError for a file it could not parse (transformers: "... is not a valid JSON file")
        detail = " ".join(str(cause).split())[:200]
        return _damaged(file_of(cause), _format_kind(cause), f"{text[:300]} {detail}", places), 2
    if isinstance(error, OSError):
        where = None if error.filename else file_of(error)  # a write to an open file names none
        return os_problem(error, places, where=where), 2 if error.errno in WRONG_KIND else 1
    found = _OS_ERROR.search(text)
    if found:  # a Rust library's I/O error (safetensors, tokenizers): the OS's errno is in its message
        code = int(found.group(1))
        return os_problem(OSError(code, os.strerror(code)), places, where=file_of(error)), 1
    if isinstance(error, RuntimeError) and any(t in text for t in TORCH_WRITE):
        file = file_of(error)
        return (f"{file + ': ' if file else ''}writing failed ({text[:200]}){_setting_note(file, places)}: the disk "
                f"is probably full or failing{_free_note(file)}; free space, or {_elsewhere(file, places)}."), 1
    kind = _format_kind(error)
    if kind is None and isinstance(error, RuntimeError) and any(t in text for t in TORCH_READ):
        kind = "a torch .pt file"
    file = file_of(error) if kind else None
    if file is None:  # not about a file, or not known to come from one: could be anyfit's own mistake
        return None
    return _damaged(file, kind, text[:200] or type(error).__name__, places), 2


def _damaged(file: str | None, kind: str, detail: str, places: Places) -> str:
    where = f"{file}: not readable as {kind}" if file else f"not readable as {kind}"
    return (f"{where} ({detail}){_setting_note(file, places)}: the file is damaged, cut short or of another kind; "
            "write it again or replace it.")


def os_problem(error: OSError, places: Places | None = None, doing: str | None = None,
               where: str | Path | None = None) -> str:
    """One line for ``error``: the file or files (``where`` when the error names none: a write to an open file),
    what is wrong in words, and what to do, naming the setting whose place holds the file where ``places`` tells
    it; ``doing``, what anyfit was doing, comes first."""
    places = places or {}
    files = [str(f) for f in (error.filename, error.filename2) if f not in (None, "")]
    files = files or ([str(where)] if where else [])
    file = files[0] if files else None
    reason = error.strerror or " ".join(str(error).split()) or type(error).__name__
    head = f"{doing}: " if doing else ""
    head += f"{' -> '.join(files)}: {reason}" if files else reason
    head += _setting_note(file, places)
    code = error.errno
    if code in NO_ROOM:
        return (f"{head}: no space left there (or a quota or file-size limit reached){_free_note(file)}; free space, "
                f"or {_elsewhere(file, places)} on a disk with room.")
    if code in NOT_ALLOWED:
        if code == errno.EROFS:
            return (f"{head}: the file system is read-only; make it writable, or "
                    f"{_elsewhere(file, places, 'a writable folder')}.")
        return (f"{head}: this user may not use it; fix its permissions (or run as its owner), or "
                f"{_elsewhere(file, places, 'a place this user may read and write')}.")
    if code in GONE:
        return (f"{head}: it is not there (moved or deleted while anyfit ran?); put it back, or "
                f"{_elsewhere(file, places, 'where it is now')}.")
    if code in WRONG_KIND:
        kind = {errno.EISDIR: "that is a folder where a file is needed",
                errno.ENOTDIR: "that is a file where a folder is needed"}.get(code, "something else is there")
        return f"{head}: {kind}; {_elsewhere(file, places, 'another path')}, or move what is in the way."
    if code == errno.EIO:
        return f"{head}: the disk (or the network file system) failed; check the disk (dmesg), then run again."
    if code in (errno.EMFILE, errno.ENFILE):
        return f"{head}: too many open files; raise the limit (ulimit -n 65536) and run again."
    if code == errno.ENAMETOOLONG:
        return f"{head}: the path is too long for the file system; {_elsewhere(file, places, 'a shorter path')}."
    if code == errno.ENOMEM:
        return f"{head}: the machine is out of memory; close what else runs, or use less (anyfit plan)."
    if not files:  # a library's own words (transformers, the hub client), or the network
        return f"{head}; check the path or name it mentions (and the network, for a hub id), then run again."
    return f"{head}; check that path and the disk it is on, then run again."


def setting_of(path: str | Path | None, places: Places) -> str | None:
    """The setting whose place holds ``path`` (the innermost place, when several do), or whose temporary name beside
    it (``.NAME.*``: ``durable.building``, export's) it is; None when none does."""
    if path is None:
        return None
    target = _absolute(path)
    best: tuple[int, str] | None = None
    for setting, place in places.items():
        if not place:
            continue
        where = _absolute(place)
        beside = target.parent == where.parent and target.name.startswith(f".{where.name}.")  # its temporary name
        if (target == where or where in target.parents or beside) and (best is None or len(where.parts) > best[0]):
            best = (len(where.parts), setting)
    return best[1] if best else None


def file_of(error: BaseException) -> str | None:
    """The file ``error`` is about: its own ``filename`` (a YAML error's marked stream), else the file the failing
    code was reading or writing: in the innermost frame of the traceback that has one, a local variable that names
    an existing file (a ``Path``, an open file, or a string called ``path``, ``file``, ...)."""
    own = getattr(error, "filename", None)
    if isinstance(own, (str, os.PathLike)) and str(own):
        return str(own)
    mark = getattr(error, "problem_mark", None) or getattr(error, "context_mark", None)
    name = getattr(mark, "name", None)
    if isinstance(name, str) and name and not name.startswith("<"):
        return name
    return _file_in_traceback(error.__traceback__)


def _file_in_traceback(tb: TracebackType | None) -> str | None:
    frames = []
    while tb is not None:
        frames.append(tb.tb_frame)
        tb = tb.tb_next
    for frame in reversed(frames):
        for name, value in frame.f_locals.items():
            if isinstance(value, io.IOBase):  # an open file: its name
                name, value = "file", getattr(value, "name", None)
            is_path = isinstance(value, Path) or (isinstance(value, str) and len(value) < 4096 and (
                name in _PATH_NAMES or name.endswith(("_file", "_path"))))
            if is_path and os.path.isfile(value):
                return str(value)
    return None


def _format_kind(error: BaseException) -> str | None:
    for cls in type(error).__mro__:
        for module, name, kind in FORMAT_ERRORS:
            if cls.__name__ == name and (cls.__module__ or "").startswith(module):
                return kind
    return None


def _absolute(path: str | Path) -> Path:
    return Path(os.path.abspath(os.path.expanduser(str(path))))


def _setting_note(file: str | None, places: Places) -> str:
    setting = setting_of(file, places)
    return f" (under {setting})" if setting else ""


def _elsewhere(file: str | None, places: Places, target: str = "another folder") -> str:
    setting = setting_of(file, places)
    return f"set {setting} to {target}" if setting else f"use {target}"


def _free_note(file: str | None) -> str:
    """How much is free on the file system of ``file`` now (its nearest existing folder), when that can be told."""
    if file is None:
        return ""
    folder = _absolute(file)
    while not folder.exists() and folder != folder.parent:
        folder = folder.parent
    try:
        free = shutil.disk_usage(folder).free
    except OSError:
        return ""
    return f" ({_size(free)} free on {folder})"


def _size(n: int) -> str:
    for unit, scale in (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if n >= scale:
            return f"{n / scale:.1f} {unit}"
    return f"{n} bytes"

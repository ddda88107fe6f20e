"""Where anyfit keeps what it derives once and reuses: GGUF models converted to safetensors
(``anyfit.model.gguf_cache``), tokenized data sets (``anyfit.data.store``) and the digests of large files
(remembered by ``anyfit.durable.sha256`` under ``digests/``)."""

from __future__ import annotations

import os
from pathlib import Path

from anyfit import durable


def cache_root() -> Path:
    """``$ANYFIT_CACHE`` if set, else ``$XDG_CACHE_HOME/anyfit``, else ``~/.cache/anyfit``."""
    if os.environ.get("ANYFIT_CACHE"):
        return Path(os.environ["ANYFIT_CACHE"]).expanduser()
    xdg = os.environ.get("XDG_CACHE_HOME")
    return (Path(xdg).expanduser() if xdg else Path.home() / ".cache") / "anyfit"


def digest_memo() -> Path:
    """The folder where ``anyfit.durable.sha256`` remembers the digests of unchanged files."""
    return cache_root() / "digests"


def file_sha256(path: Path) -> str:
    """The hex sha256 of the file at ``path``, remembered under ``digest_memo()`` while the file is unchanged
    (``anyfit.durable.RACY_S`` says when that is safe). Raises ``OSError`` when the file cannot be read."""
    return durable.sha256(path, memo=digest_memo())

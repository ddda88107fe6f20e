"""Where anyfit keeps what it derives once and reuses: GGUF models converted to safetensors
(``anyfit.model.gguf_cache``) and tokenized data sets (``anyfit.data.store``)."""

from __future__ import annotations

import os
from pathlib import Path


def cache_root() -> Path:
    """``$ANYFIT_CACHE`` if set, else ``$XDG_CACHE_HOME/anyfit``, else ``~/.cache/anyfit``."""
    if os.environ.get("ANYFIT_CACHE"):
        return Path(os.environ["ANYFIT_CACHE"]).expanduser()
    xdg = os.environ.get("XDG_CACHE_HOME")
    return (Path(xdg).expanduser() if xdg else Path.home() / ".cache") / "anyfit"

"""Checking a model or data set name that is not a local path before anything loads it.

Without this, a typo (``Qwen/Qwen2.5-0.5b-instrukt``) or a model that is not cached while offline reaches
``from_pretrained``, which retries for about 30 s and ends in a long traceback (``datasets.load_dataset``
retries for about 30 s too, printing every retry). Here the same mistakes
are one-line ``ConfigError``s: offline, the local hub cache is looked at (no network, well under a
second); online, a model that is not cached costs one metadata request (a HEAD on its config.json) with a
short timeout and no retries. ``hub_error`` is the one ladder from a hub's answer to that line (``anyfit download``
asks it too).
"""

from __future__ import annotations

import os
from pathlib import Path

from anyfit.config import ConfigError

# One HEAD on the hub answers in well under a second; a link that needs longer than this for it would not
# download the weights either. Only models missing from the local cache ever wait on it.
TIMEOUT_S = 5.0


# The data files anyfit reads: these formats, the text ones also compressed (data.jsonl.gz, with the compressions
# `datasets` reads). A data.path with one of these suffixes (or another data-like one) is a local file.
DATA_FORMATS = (".jsonl", ".ndjson", ".json", ".csv", ".parquet", ".arrow")
COMPRESSIBLE_FORMATS = (".jsonl", ".ndjson", ".json", ".csv")
COMPRESSIONS = (".gz", ".gzip", ".bz2", ".xz", ".lzma", ".zst", ".zstd", ".lz4")
DATA_SUFFIXES = DATA_FORMATS + tuple(f + c for f in COMPRESSIBLE_FORMATS for c in COMPRESSIONS)
DATA_LIKE_SUFFIXES = DATA_SUFFIXES + COMPRESSIONS + (".tsv", ".txt", ".xlsx", ".xls", ".ods", ".zip", ".tar", ".tgz",
                                                     ".7z", ".rar")


def looks_local(name: str) -> bool:
    """Whether ``model.name_or_path`` names a local path, by the rule ``ModelSource`` applies: an explicit
    path prefix, a .gguf file, or anything that exists here."""
    return name.startswith((".", "/", "~")) or name.endswith(".gguf") or Path(name).expanduser().exists()


def data_looks_local(spec: str) -> bool:
    """Whether ``data.path`` is meant as a local path rather than a hub name like ``openai/gsm8k``.

    A hub name has at most one slash and no file suffix; anything that exists here, has a data-file suffix,
    an explicit relative/absolute prefix or more than one slash, a glob's ``*?[``, or whose first folder exists
    here is local.
    """
    if Path(spec).expanduser().exists() or spec.lower().endswith(DATA_LIKE_SUFFIXES) or any(c in spec for c in "\\*?["):
        return True
    if spec.startswith(("/", "./", "../", "~")) or spec.count("/") > 1:
        return True
    first = spec.split("/", 1)[0]
    return "/" in spec and Path(first).is_dir()


def is_hub_id(name: str) -> bool:
    """Whether a model name is a hub repository id (``owner/name``) that a reader elsewhere can look up."""
    return name.count("/") == 1 and not looks_local(name)


def is_hub_dataset_id(spec: str) -> bool:
    """Whether a ``data.path`` is a hub data set id (``owner/name``), not a local file or folder."""
    return spec.count("/") == 1 and not data_looks_local(spec)


def innermost_message(error: BaseException) -> str:
    """The message of the exception at the bottom of a chain, as one sentence (``datasets`` and the hub
    client wrap the cause in generic errors)."""
    while error.__cause__ is not None:
        error = error.__cause__
    text = " ".join(str(error).split())
    return (text if text.endswith(".") else text + ".") if text else type(error).__name__ + "."


def offline(datasets: bool = False) -> bool:
    """HF_HUB_OFFLINE (or TRANSFORMERS_OFFLINE; with ``datasets``, HF_DATASETS_OFFLINE) set now, or when
    huggingface_hub was imported."""
    from huggingface_hub import constants

    names = ("HF_HUB_OFFLINE", "TRANSFORMERS_OFFLINE") + (("HF_DATASETS_OFFLINE",) if datasets else ())
    flags = (os.environ.get(name, "").strip().upper() for name in names)
    return constants.HF_HUB_OFFLINE or any(flag in ("1", "ON", "YES", "TRUE") for flag in flags)


def endpoint() -> str:
    from huggingface_hub import constants

    return (os.environ.get("HF_ENDPOINT") or constants.ENDPOINT).rstrip("/")


def is_cached(repo_id: str, filename: str, revision: str | None = None) -> bool:
    """Whether the local hub cache holds ``filename`` of the model at ``revision`` (default: main)."""
    from huggingface_hub import try_to_load_from_cache

    return isinstance(try_to_load_from_cache(repo_id, filename, revision=revision), str)


def check_model_id(name: str, revision: str | None = None, gguf_file: str | None = None,
                   key: str = "model.name_or_path", timeout: float = TIMEOUT_S) -> None:
    """Raise a one-line ConfigError unless ``name`` is a local path or a model that can be loaded from the
    hub: cached locally, or (online) found there. ``gguf_file`` is the file to look for instead of
    config.json (a GGUF repository has none); ``key`` names the setting in the messages."""
    from huggingface_hub import get_hf_file_metadata, hf_hub_url
    from huggingface_hub.errors import EntryNotFoundError, HFValidationError
    from huggingface_hub.utils import validate_repo_id

    if looks_local(name):
        return
    at = f" at revision {revision!r}" if revision else ""
    try:
        validate_repo_id(name)
    except HFValidationError:
        raise ConfigError(f"{key}: {name!r} is not an existing path (relative paths are taken from {Path.cwd()}) "
                          "and not a valid hub id such as Qwen/Qwen2.5-0.5B-Instruct.") from None
    filename = gguf_file or "config.json"
    not_local = f"it is not a local path either (relative paths are taken from {Path.cwd()})"
    if is_cached(name, filename, revision):
        return  # from_pretrained finds it without the network (and refreshes it when it can)
    if offline():
        raise ConfigError(f"{key}: offline (HF_HUB_OFFLINE is set) and {name}{at} is not in the local cache, and "
                          f"{not_local}: download it first (hf download {name}) or give a local folder.")
    try:
        get_hf_file_metadata(hf_hub_url(name, filename, revision=revision, endpoint=endpoint()), timeout=timeout,
                             retry_on_errors=False)
    except EntryNotFoundError:
        hint = "" if gguf_file else " Is it a GGUF-only repository? Then set model.gguf_file to one of its .gguf files."
        raise ConfigError(f"{key}: {name}{at} is on the hub but has no {filename}.{hint}") from None
    except Exception as e:
        raise hub_error(e, key, "model", name, revision,
                        missing=f", and {not_local}. Check the spelling and the case, e.g. Qwen/Qwen2.5-0.5B-Instruct.",
                        asking=f"cannot reach the hub at {endpoint()} to look up {name}",
                        then=f"; it is not in the local cache, and {not_local}: check the network (or HF_ENDPOINT), "
                             "or download the model / give a local folder.") from None


def dataset_is_cached(name: str) -> bool:
    """Whether a download of data set ``name`` is on this machine: its files in the hub cache, or what
    ``datasets`` prepared from them (either lets ``load_dataset`` work without the hub)."""
    from datasets import config
    from huggingface_hub import constants

    return ((Path(constants.HF_HUB_CACHE) / f"datasets--{name.replace('/', '--')}").is_dir()
            or (Path(config.HF_DATASETS_CACHE) / name.replace("/", "___")).is_dir())


def check_dataset_id(name: str, key: str = "data.path", timeout: float = TIMEOUT_S) -> None:
    """Raise a one-line ConfigError unless hub data set ``name`` is cached here or (online) exists on the hub.

    Online and not cached, this costs one HEAD on the data set's card (README.md) with a short timeout and no
    retries; a repository without a card still passes."""
    from huggingface_hub import get_hf_file_metadata, hf_hub_url
    from huggingface_hub.errors import EntryNotFoundError, HFValidationError
    from huggingface_hub.utils import validate_repo_id

    try:
        validate_repo_id(name)
    except HFValidationError:
        raise ConfigError(f"{key}: {name!r} is not a local file (relative paths are taken from {Path.cwd()}) and "
                          "not a valid hub data set name such as openai/gsm8k.") from None
    if dataset_is_cached(name):
        return
    local = "for a local file give its path with the suffix (.jsonl, .json, .parquet)"
    if offline(datasets=True):
        raise ConfigError(f"{key}: offline (HF_HUB_OFFLINE or HF_DATASETS_OFFLINE is set) and data set {name} is "
                          f"not in the local cache: download it first (anyfit download CONFIG), or {local}.")
    try:
        get_hf_file_metadata(hf_hub_url(name, "README.md", repo_type="dataset", endpoint=endpoint()),
                             timeout=timeout, retry_on_errors=False)
    except EntryNotFoundError:
        return  # the repository exists, without a card
    except Exception as e:
        uncached = f" and it is not in the local cache: check the network (or HF_ENDPOINT), or {local}."
        raise hub_error(e, key, "data set", name,
                        missing=f"; check the spelling and the case (e.g. openai/gsm8k), or {local}.",
                        asking=f"cannot reach the hub at {endpoint()} to look up data set {name}",
                        then=uncached) from None


def hub_error(error: Exception, key: str, what: str, name: str, revision: str | None = None, *,
              missing: str = "; check the spelling and the case.", asking: str, then: str = ".") -> ConfigError:
    """THE ladder from a hub's answer about ``what`` (model, tokenizer, data set) ``name`` to one line naming the
    setting ``key``: gated, no such repository (the line ends with ``missing``), no such revision, offline, or the
    hub could not be asked (``asking`` the first line of the error ``then``). Anything else is a bug: raised again."""
    from huggingface_hub.errors import (
        GatedRepoError,
        OfflineModeIsEnabled,
        RepositoryNotFoundError,
        RevisionNotFoundError,
    )

    dataset = what == "data set"
    if isinstance(error, GatedRepoError):  # before RepositoryNotFoundError: it is a subclass
        page = f"{endpoint()}/datasets/{name}" if dataset else f"{endpoint()}/{name}"
        return ConfigError(f"{key}: {'data set ' if dataset else ''}{name} is gated: accept its conditions on {page} "
                           "and log in (hf auth login, or set HF_TOKEN).")
    if isinstance(error, RepositoryNotFoundError):
        return ConfigError(f"{key}: the hub has no {what} {name!r} (or it is private and you are not logged in)"
                           f"{missing}")
    if isinstance(error, RevisionNotFoundError):
        return ConfigError(f"model.revision: {revision!r} is not a branch, tag or commit of {name}.")
    if isinstance(error, OfflineModeIsEnabled):
        return ConfigError(f"{key}: offline (HF_HUB_OFFLINE is set): cannot download {what} {name}.")
    if not hub_failure(error):
        raise error
    text = str(error).strip()
    return ConfigError(f"{key}: {asking} ({text.splitlines()[0] if text else type(error).__name__}){then}")


def hub_failure(error: BaseException) -> bool:
    """Errors of asking the hub (an HTTP status, the network, a timeout, offline mode), as opposed to bugs."""
    from huggingface_hub.errors import HfHubHTTPError

    return isinstance(error, (OSError, HfHubHTTPError, TimeoutError)) or from_http_library(error)


def from_http_library(error: Exception) -> bool:
    """Transport errors of whichever HTTP client huggingface_hub uses (httpx, its fork httpx2, requests)."""
    return type(error).__module__.split(".")[0] in ("httpx", "httpx2", "httpcore", "requests", "urllib3")

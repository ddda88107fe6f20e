"""``anyfit download``: fetch the model and data sets a config needs before the expensive machine's clock runs.

A rented GPU bills from the moment it starts; downloading 15 GB of weights there (or finding a typo in a
data set name after an hour of setup) is paid for. This module reads the config, plans what to fetch
(``plan_downloads``, a pure function: no network), and fetches it into the Hugging Face cache, or into a
folder of your choice (``--to DIR``, e.g. a persistent disk), printing the config overrides that point at
the local copies.

Only the files ``transformers`` loads are fetched from a model repository (``select_model_files``): the
config, tokenizer and generation files and the safetensors weights; other weight formats (.bin, .pth,
.gguf, ONNX, ...) are skipped unless the repository has nothing else, or ``model.gguf_file`` asks for one.
"""

from __future__ import annotations

import fnmatch
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from anyfit.config import Config, ConfigError
from anyfit.hub import (
    DATA_SUFFIXES,
    check_model_id,
    data_looks_local,
    endpoint,
    hub_error,
    hub_failure,
    innermost_message,
    looks_local,
    offline,
)

# Small files that transformers reads next to the weights (configs, tokenizers, chat templates). A pattern
# without "/" matches top-level files only: subfolders such as onnx/ or original/ hold other formats.
MODEL_SIDE_FILES = ("*.json", "tokenizer.model", "*.tiktoken", "*.txt", "*.jinja", "spiece.model",
                    "sentencepiece.bpe.model")
# Weight formats by preference: transformers loads safetensors first, .bin only when there is none.
WEIGHT_FORMATS = (("*.safetensors",), ("*.bin",))
# Files only a few repositories need; fetched when model.trust_remote_code asks to run the repository's code.
REMOTE_CODE_FILES = ("*.py",)


@dataclass(frozen=True)
class Download:
    """One thing a config needs: a model/tokenizer repository or a data set, and where the config names it."""

    kind: str  # "model" | "tokenizer" | "dataset"
    key: str  # the config key that names it, e.g. "model.name_or_path", "eval.path"
    name: str  # hub id or local path
    local: bool  # a local path: checked to exist, not fetched
    revision: str | None = None
    gguf_file: str | None = None
    subset: str | None = None
    split: str | None = None

    def describe(self) -> str:
        extra = [f"revision {self.revision}"] if self.revision else []
        extra += [f"file {self.gguf_file}"] if self.gguf_file else []
        extra += [f"subset {self.subset}"] if self.subset else []
        extra += [f"split {self.split}"] if self.split else []
        return f"{self.kind} {self.name}" + (f" ({', '.join(extra)})" if extra else "")


def plan_downloads(cfg: Config) -> list[Download]:
    """What ``cfg`` needs, in order: the model, a separate tokenizer, the training data, the eval data.

    No network and no file access beyond telling local paths from hub names (by the rules training uses).
    The same data set named twice (eval data from another split of data.path) is listed once per split,
    since ``datasets`` prepares splits separately.
    """

    m = cfg.model
    plan: list[Download] = []
    if m.name_or_path:
        local = looks_local(m.name_or_path)
        plan.append(Download("model", "model.name_or_path", m.name_or_path, local,
                             revision=None if local else m.revision, gguf_file=m.gguf_file))
    if m.tokenizer and m.tokenizer != m.name_or_path:
        # A separate tokenizer is loaded at its main revision: model.revision belongs to the model.
        plan.append(Download("tokenizer", "model.tokenizer", m.tokenizer, looks_local(m.tokenizer)))
    d = cfg.data
    if d.path:
        plan.append(Download("dataset", "data.path", d.path, data_looks_local(d.path), subset=d.subset, split=d.split))
    for i, entry in enumerate(d.mix):  # several sources: each entry's keys over data.*
        path, subset, split = entry["path"], entry.get("subset", d.subset), entry.get("split", d.split)
        plan.append(Download("dataset", f"data.mix[{i}].path", path, data_looks_local(path), subset=subset,
                             split=split))
    e = cfg.eval
    if e.path or e.split:
        # eval.path defaults to data.path; the eval data are read with the data.* settings (subset included).
        path, split = e.path or d.path, e.split or d.split
        if path and (path, split) != (d.path, d.split):
            plan.append(Download("dataset", "eval.path" if e.path else "eval.split", path, data_looks_local(path),
                                 subset=d.subset, split=split))
    return plan


def select_model_files(files: list[str], gguf_file: str | None = None, remote_code: bool = False) -> list[str]:
    """The files of a model repository that transformers needs, from the repository's file list.

    With ``gguf_file``: that file plus the small side files (a GGUF holds weights and tokenizer; the rest
    is harmless). Otherwise the side files plus the first weight format the repository has (safetensors,
    else .bin); sharded weights come with their index (a .json, already a side file).
    """
    def top_level(patterns) -> list[str]:
        return [f for f in files if "/" not in f and any(fnmatch.fnmatch(f, p) for p in patterns)]

    side = top_level(MODEL_SIDE_FILES + (REMOTE_CODE_FILES if remote_code else ()))
    if gguf_file:
        if gguf_file not in files:
            ggufs = sorted(f for f in files if f.endswith(".gguf"))
            raise ConfigError(f"model.gguf_file: the repository has no {gguf_file!r}; its .gguf files: "
                              f"{', '.join(ggufs[:5]) or 'none'}.")
        return sorted(set(side) | {gguf_file})
    for patterns in WEIGHT_FORMATS:
        weights = top_level(patterns)
        if weights:
            return sorted(set(side) | set(weights))
    ggufs = sorted(f for f in files if f.endswith(".gguf"))
    hint = f" It holds GGUF files ({', '.join(ggufs[:3])}): set model.gguf_file to one." if ggufs else ""
    raise ConfigError(f"the repository has no safetensors or .bin weights at its top level.{hint}")


def human_size(n: int | None) -> str:
    if n is None:
        return "size unknown"
    for unit in ("B", "KB", "MB", "GB"):
        if n < 1000 or unit == "GB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1000
    return ""  # pragma: no cover


def _safe_name(name: str) -> str:
    return name.replace("/", "__")


def _hub_error(item: Download, e: Exception) -> ConfigError:
    """A one-line ConfigError for a hub failure while listing or fetching ``item`` (``e`` again for a bug)."""
    what = "data set" if item.kind == "dataset" else item.kind
    return hub_error(e, item.key, what, item.name, item.revision,
                     asking=f"downloading {what} {item.name} from {endpoint()} failed")


def _list_files(repo_id: str, repo_type: str, revision: str | None) -> dict[str, int | None]:
    """Every file of a hub repository with its size (one paginated listing request)."""
    from huggingface_hub import HfApi
    from huggingface_hub.hf_api import RepoFile


    tree = HfApi(endpoint=endpoint()).list_repo_tree(repo_id, recursive=True, revision=revision, repo_type=repo_type)
    return {f.path: f.size for f in tree if isinstance(f, RepoFile)}


def _fetch_model(item: Download, cfg: Config, to: Path | None, say: Callable[[str], None]) -> tuple[int, list[str]]:
    """Download a model or tokenizer repository; the bytes listed and the overrides for ``to``."""
    from huggingface_hub import snapshot_download


    check_model_id(item.name, item.revision, item.gguf_file, key=item.key)  # one-line errors for typos and offline
    if offline():  # check_model_id passed: it is in the cache; nothing can be fetched or refreshed
        if to is not None:
            raise ConfigError(f"{item.key}: offline (HF_HUB_OFFLINE is set): cannot copy {item.name} to {to}.")
        say(f"  {item.describe()}: in the local cache (offline: not checked for updates)")
        return 0, []
    try:
        files = _list_files(item.name, "model", item.revision)
        wanted = select_model_files(list(files), item.gguf_file, cfg.model.trust_remote_code)
    except ConfigError as e:
        raise ConfigError(f"{item.key}: {item.name}: {e}") from None
    except Exception as e:
        raise _hub_error(item, e) from None
    total = sum(files[f] or 0 for f in wanted)
    skipped = len(files) - len(wanted)
    say(f"  {item.describe()}: {len(wanted)} files, {human_size(total)}"
        + (f" (skipping {skipped} other files: formats transformers does not load here)" if skipped else ""))
    for f in wanted:
        say(f"    {f}  {human_size(files[f])}")
    target = None if to is None else to / item.kind
    try:
        path = snapshot_download(item.name, revision=item.revision, allow_patterns=wanted, endpoint=endpoint(),
                                 local_dir=str(target) if target else None)
    except Exception as e:
        raise _hub_error(item, e) from None
    say(f"    -> {path}")
    if target is None:
        return total, []
    overrides = [f"{item.key}={target}"]
    if item.kind == "model" and item.revision:
        overrides.append("model.revision=null")  # the local folder is that revision already
    return total, overrides


def _fetch_dataset(item: Download, to: Path | None, say: Callable[[str], None]) -> tuple[int, list[str]]:
    """Download a hub data set: prepared into the datasets cache (where training finds it by name), or the
    repository's files into ``to`` (read as a local folder, split by file name)."""

    if offline():
        raise ConfigError(f"{item.key}: offline (HF_HUB_OFFLINE is set): cannot download data set {item.name}; "
                          "unset HF_HUB_OFFLINE, or give a local .jsonl/.json/.parquet file.")
    if to is None:
        import datasets

        try:
            ds = datasets.load_dataset(item.name, item.subset, split=item.split)
        except Exception as e:
            if not (hub_failure(e) or isinstance(e, (datasets.exceptions.DatasetsError, ValueError))):
                raise
            from huggingface_hub.errors import HfHubHTTPError

            if isinstance(e, HfHubHTTPError):
                raise _hub_error(item, e) from None

            raise ConfigError(f"{item.key}: could not download data set {item.name!r} (subset {item.subset!r}, "
                              f"split {item.split!r}): {innermost_message(e)}") from None
        size = ds.info.download_size
        say(f"  {item.describe()}: {len(ds)} rows, {human_size(size)} downloaded -> datasets cache")
        return size or 0, []
    try:
        files = _list_files(item.name, "dataset", None)
    except Exception as e:
        raise _hub_error(item, e) from None
    # A subset usually lives in a folder of its name (openai/gsm8k: main/, socratic/); fetch only that one,
    # so that the local folder holds one subset's splits, as anyfit reads folders.
    prefix = f"{item.subset}/" if item.subset and any(f.startswith(f"{item.subset}/") for f in files) else ""
    wanted = [f for f in files if f.startswith(prefix) and f.lower().endswith(DATA_SUFFIXES)
              and not f.startswith(".")]
    if not wanted:
        raise ConfigError(f"{item.key}: data set {item.name} has no .jsonl/.json/.parquet files"
                          + (f" under {prefix}" if prefix else "") + ", which is what anyfit reads from a folder; "
                          "download it without --to (into the datasets cache) instead.")
    total = sum(files[f] or 0 for f in wanted)
    say(f"  {item.describe()}: {len(wanted)} files, {human_size(total)}")
    target = to / "data" / _safe_name(item.name)
    from huggingface_hub import snapshot_download

    try:
        snapshot_download(item.name, repo_type="dataset", allow_patterns=wanted, local_dir=str(target),
                          endpoint=endpoint())
    except Exception as e:
        raise _hub_error(item, e) from None
    folder = target / prefix.rstrip("/") if prefix else target
    say(f"    -> {folder}")
    overrides = [f"{item.key}={folder}"] if item.key != "eval.split" else [f"eval.path={folder}"]
    if item.key == "data.path" and item.subset:
        overrides.append("data.subset=null")  # a local folder has no subsets
    return total, overrides


def _check_local(item: Download) -> None:
    if not Path(item.name).expanduser().exists():
        raise ConfigError(f"{item.key}: {item.name} is a local path that does not exist (relative paths are "
                          f"taken from {Path.cwd()}).")


def download(cfg: Config, to: str | Path | None = None, say: Callable[[str], None] = print) -> list[str]:
    """Fetch everything ``cfg`` needs into the HF cache, or under ``to``; returns the config overrides that
    point at the copies under ``to`` (none for the cache: training finds cached files by name).

    Local paths are checked to exist and skipped. Errors are one-line ConfigErrors naming the config key.
    """
    target = Path(to).expanduser().resolve() if to else None
    plan = plan_downloads(cfg)
    if not plan:
        raise ConfigError("nothing to download: the config names no model.name_or_path, data.path or eval.path.")
    for item in plan:  # every local path first: a typo there should not wait for a 15 GB download
        if item.local:
            _check_local(item)
    fetched, total, overrides = 0, 0, []
    for item in plan:
        if item.local:
            say(f"  {item.describe()}: local path, skipped")
            continue
        if item.kind == "dataset":
            size, more = _fetch_dataset(item, target, say)
        else:
            size, more = _fetch_model(item, cfg, target, say)
        fetched, total = fetched + 1, total + size
        overrides += [o for o in more if o not in overrides]
    local = len(plan) - fetched
    where = f"into {target}" if target else "into the Hugging Face cache"
    say(f"downloaded {fetched} of {len(plan)} items ({human_size(total)}) {where}; {local} local, skipped.")
    if overrides:
        say("use the local copies with these overrides:\n  " + " ".join(overrides))
    return overrides


"""Where a launched run's folder lives while the machine may go away: a Hub repo (``hf://OWNER/NAME``, private
when anyfit creates it) or a folder (a local stand-in, or a cloud bucket SkyPilot mounts at a path).

``push`` mirrors the run folder as it is written: a ``checkpoint-<step>`` folder appears in the run only once it
is complete (the training loop writes it under a hidden name and renames it), so only complete checkpoints are
sent, each once; checkpoints the run pruned (``train.keep_last``) are removed from the store too; the other files
(metrics, report, config, final model) are sent when they changed. ``pull`` brings the store's copy back, so
``train.resume=auto`` continues from the last checkpoint that reached the store.
"""

from __future__ import annotations

import os
import shutil
from pathlib import Path

from anyfit.config import ConfigError
from anyfit.durable import MANIFEST


def _listing(run: Path) -> dict[str, tuple[int, int]]:
    """Every visible file of the run folder (relative path -> (size, mtime_ns)); hidden names (a checkpoint being
    written, one being deleted) are left out."""
    out = {}
    for path in sorted(run.rglob("*")):
        rel = path.relative_to(run)
        if path.is_file() and not any(part.startswith(".") for part in rel.parts):
            stat = path.stat()
            out[rel.as_posix()] = (stat.st_size, stat.st_mtime_ns)
    return out


def _checkpoints(names) -> set[str]:
    return {n.split("/", 1)[0] for n in names if n.startswith("checkpoint-")}


def _changes(sent: dict, run: Path) -> tuple[dict, set[str], set[str]]:
    """(the run folder's listing now, the files changed since ``sent``, the checkpoints the run pruned since)."""
    now = _listing(run)
    return now, {n for n, sig in now.items() if sent.get(n) != sig}, _checkpoints(sent) - _checkpoints(now)


class FolderStore:
    """A folder as the store: each complete checkpoint copied under a hidden name, then renamed (one atomic step);
    other files copied beside and renamed over the old copy."""

    def __init__(self, root: Path):
        self.root = Path(root)
        self.sent: dict[str, tuple[int, int]] = {}

    def describe(self) -> str:
        return str(self.root)

    def pull(self, run: Path) -> list[str]:
        """Copy the store's run folder into ``run``; the checkpoints it held."""
        if not self.root.is_dir():
            return []
        shutil.copytree(self.root, run, dirs_exist_ok=True, ignore=shutil.ignore_patterns(".*"))
        self.sent = _listing(run)
        return sorted(_checkpoints(self.sent))

    def push(self, run: Path) -> bool:
        """Send what changed since the last push; whether anything was sent."""
        now, changed, gone = _changes(self.sent, run)
        if not changed and not gone:
            return False
        self.root.mkdir(parents=True, exist_ok=True)
        # The metrics and logs first: a checkpoint in the store then always has the metrics of its steps beside it
        # (the run writes them before the checkpoint), whenever the machine goes away.
        for name in sorted(n for n in changed if not n.startswith("checkpoint-")):
            target = self.root / name
            target.parent.mkdir(parents=True, exist_ok=True)
            tmp = target.with_name(f".partial-{target.name}")
            shutil.copy2(run / name, tmp)
            os.replace(tmp, target)
        for folder in sorted(_checkpoints(changed)):
            if not (self.root / folder).exists():
                tmp = self.root / f".partial-{folder}"
                shutil.rmtree(tmp, ignore_errors=True)
                shutil.copytree(run / folder, tmp)
                os.replace(tmp, self.root / folder)
        for folder in sorted(gone):
            shutil.rmtree(self.root / folder, ignore_errors=True)
        self.sent = now
        return True


class HubStore:
    """A Hub model repo as the store, through huggingface_hub's ``upload_folder`` and ``snapshot_download``.

    A new checkpoint goes up in two commits: its files, then its ``manifest.json`` (anyfit writes it last) with the
    run's other files, so a push cut short (or split into several commits by the client, as its Xet pipeline does
    for large folders) leaves at most a checkpoint without its manifest, which ``pull`` leaves out: only complete
    checkpoints come back. A push sent again re-sends nothing the Hub already holds (the client skips files whose
    content the repo has, and content it already stored)."""

    def __init__(self, repo_id: str, private: bool = True):
        self.repo_id = repo_id
        self.private = private
        self.sent: dict[str, tuple[int, int]] = {}

    def describe(self) -> str:
        return f"hf://{self.repo_id}"

    def pull(self, run: Path) -> list[str]:
        from huggingface_hub import snapshot_download  # start-up time: only in a launched job
        from huggingface_hub.errors import RepositoryNotFoundError

        try:
            snapshot_download(self.repo_id, local_dir=run, ignore_patterns=[".gitattributes"])  # the Hub's, not the run's
        except RepositoryNotFoundError:
            return []
        shutil.rmtree(run / ".cache", ignore_errors=True)  # huggingface_hub's bookkeeping of local_dir
        for folder in _checkpoints(_listing(run)):
            if not (run / folder / MANIFEST).is_file():  # its push was cut short: not a checkpoint to resume from
                shutil.rmtree(run / folder)
        self.sent = _listing(run)
        return sorted(_checkpoints(self.sent))

    def push(self, run: Path) -> bool:
        from huggingface_hub import HfApi  # start-up time: only in a launched job

        now, changed, gone = _changes(self.sent, run)
        if not changed and not gone:
            return False
        api = HfApi()
        api.create_repo(self.repo_id, private=self.private, exist_ok=True)
        first = sorted(n for n in changed if n.startswith("checkpoint-") and not n.endswith(f"/{MANIFEST}"))
        # a new checkpoint's files before its manifest, which comes in one commit with the metrics and logs: a
        # complete checkpoint on the Hub always has the metrics of its steps beside it
        if first:
            api.upload_folder(repo_id=self.repo_id, folder_path=run, allow_patterns=first,
                              commit_message=f"anyfit: {len(first)} checkpoint files")
        rest = sorted(set(changed) - set(first))
        if rest or gone:
            api.upload_folder(repo_id=self.repo_id, folder_path=run, allow_patterns=rest or [],
                              delete_patterns=[f"{c}/**" for c in sorted(gone)] or None,
                              commit_message=f"anyfit: {len(rest)} files of the run" +
                              (f", {len(gone)} pruned checkpoint(s) removed" if gone else ""))
        self.sent = now
        return True


def open_store(url: str):
    """The store a launch names: ``hf://OWNER/NAME`` (a Hub model repo) or a folder path (``file://`` optional)."""
    if url.startswith("hf://"):
        repo = url.removeprefix("hf://").strip("/")
        if repo.count("/") != 1:
            raise ConfigError(f"--store {url}: a Hub store is hf://OWNER/NAME (a model repo).")
        return HubStore(repo)
    if "://" in url and not url.startswith("file://"):
        raise ConfigError(f"--store {url}: use hf://OWNER/NAME or a folder; a cloud bucket goes through SkyPilot "
                          "(--on skypilot mounts it at a folder).")
    return FolderStore(Path(url.removeprefix("file://")))

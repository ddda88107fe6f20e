"""What a checkpoint remembers of the data its run trained on, and what a resumed run is told changed since.

A run draws its windows from the token store's examples in a seeded order (``anyfit.data.batching``); a resume
continues that order at the checkpoint's step. Both are the same only if the examples are: same tokens, same
loss masks, same rows kept out for validation, same mixture draws. So the fingerprint is a digest of exactly
what the window sampler and the collator read (``trained``: the token files' digests from each store's manifest,
and the rows taken of each store), not of the input files: an edited record that tokenizes the same changes
nothing, a new tokenizer or ``data.max_length`` that tokenizes the same records differently does.

To say *what* differs, every store also keeps one 8-byte digest per source record (``record_digests``, the
record's canonical JSON), and a checkpoint keeps a copy of them (a few MB at a million records, next to
weights of GBs): a resume compares the two as multisets (records kept, removed, added; an edited record is one
of each) and says whether the same records now tokenize differently instead.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Iterable
from pathlib import Path
from typing import Any

import numpy as np

DATA_FILE = "data.json"  # in a checkpoint: the fingerprint of the examples the run was drawing from
DIGESTS_FILE = "data_records-{}.npy"  # in a checkpoint: one source's record digests


def record_digests(records: Iterable[Any], count: int) -> np.ndarray:
    """One 8-byte digest per record: blake2b of its canonical JSON (sorted keys; values JSON cannot hold, such
    as dates from Parquet, by their text)."""
    return np.fromiter(
        (int.from_bytes(hashlib.blake2b(json.dumps(r, sort_keys=True, default=str, ensure_ascii=False).encode(),
                                        digest_size=8).digest(), "little") for r in records),
        dtype=np.uint64, count=count)


def trained_fingerprint(sources: list[dict[str, Any]], draws: list[bytes]) -> str:
    """The digest of what the windows read: each source's token files and the rows taken of it (``draws``: the
    bytes of the row and mixture arrays)."""
    h = hashlib.sha256(json.dumps([s["tokens"] for s in sources]).encode())
    for part in draws:
        h.update(hashlib.sha256(part).digest())
    return h.hexdigest()


def store_tokens(manifest: dict[str, Any], files: Iterable[str]) -> str:
    """A store's token content from its manifest's file digests (what the examples are, whatever key made them)."""
    return hashlib.sha256(json.dumps([manifest["files"][f]["sha256"] for f in files]).encode()).hexdigest()


def save(folder: Path, fingerprint: dict[str, Any], digests: list[np.ndarray]) -> None:
    """The fingerprint and the sources' record digests into a checkpoint folder (main process)."""
    (folder / DATA_FILE).write_text(json.dumps(fingerprint, indent=1))
    for i, values in enumerate(digests):
        np.save(folder / DIGESTS_FILE.format(i), values)


def load(folder: Path) -> tuple[dict[str, Any] | None, list[np.ndarray | None]]:
    """A checkpoint's fingerprint (None: written before anyfit kept one, or unreadable) and record digests."""
    try:
        saved = json.loads((folder / DATA_FILE).read_text())
    except (OSError, UnicodeDecodeError, ValueError):
        return None, []
    digests = []
    for i in range(len(saved.get("sources", []))):
        try:
            digests.append(np.load(folder / DIGESTS_FILE.format(i)))
        except (OSError, ValueError):
            digests.append(None)
    return saved, digests


def difference(saved: dict[str, Any], saved_digests: list[np.ndarray | None], now: dict[str, Any],
               now_digests: list[np.ndarray]) -> str | None:
    """What differs between the examples a checkpoint was drawing from and this run's, in words; None when the
    windows would read the same examples."""
    if saved.get("trained") == now.get("trained"):
        return None
    before, after = saved.get("sources", []), now.get("sources", [])
    if len(before) != len(after):
        return f"its data sources were {_paths(before)}, this run's are {_paths(after)}"
    said = []
    for i, (old, new) in enumerate(zip(before, after)):
        where = f"{new['path']}: " if len(after) > 1 else ""
        if old.get("path") != new["path"]:
            where = f"{old.get('path')} then, {new['path']} now: "
        old_d = saved_digests[i] if i < len(saved_digests) else None
        said.extend(where + line for line in _source_difference(old, old_d, new, now_digests[i]))
    if not said:  # every source's examples are the same: the rows taken of them differ
        said.append("the examples held out for validation or drawn by data.mix differ (eval.holdout, data.mix "
                    "weights or train.seed)")
    return "; ".join(said)


def _source_difference(old: dict[str, Any], old_digests: np.ndarray | None, new: dict[str, Any],
                       new_digests: np.ndarray) -> list[str]:
    if old.get("tokens") == new.get("tokens"):
        return []
    counts = f"{old.get('records', '?'):,} records then, {new['records']:,} now" \
        if isinstance(old.get("records"), int) else f"{new['records']:,} records now"
    if old_digests is None:
        return [f"its tokens differ ({counts}; the checkpoint keeps no record digests to say which)"]
    kept = _common(old_digests, new_digests)
    removed, added = len(old_digests) - kept, len(new_digests) - kept
    if removed or added:
        return [f"of its {len(old_digests):,} records {kept:,} are unchanged and {removed:,} gone, and {added:,} "
                "records are new (an edited record counts as gone and new)"]
    if not np.array_equal(old_digests, new_digests):
        return [f"the same {len(new_digests):,} records, in another order"]
    return [f"the same {len(new_digests):,} records tokenize differently now (the tokenizer, its chat template, "
            "a data.* setting such as data.max_length, or anyfit's tokenization changed)"]


def _common(a: np.ndarray, b: np.ndarray) -> int:
    """How many records two digest arrays share, as multisets."""
    ua, ca = np.unique(a, return_counts=True)
    ub, cb = np.unique(b, return_counts=True)
    _, ia, ib = np.intersect1d(ua, ub, assume_unique=True, return_indices=True)
    return int(np.minimum(ca[ia], cb[ib]).sum())


def _paths(sources: list[dict[str, Any]]) -> str:
    return ", ".join(str(s.get("path")) for s in sources) or "(none)"

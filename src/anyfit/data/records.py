"""What every reader of training data gives back: ``Records`` (a list of dicts that knows where each came from) and
``DataError`` (a problem with the data, said in one line that names the place to fix)."""

from __future__ import annotations

import bisect
import os
from collections.abc import Callable, Iterable
from typing import Any


class DataError(ValueError):
    """A problem with the training data; the message says where and what to change."""


class Place(str):
    """A record's place as error messages name it (``data.jsonl:12``) that also knows the folder of the record's
    file (``folder``; None for hub data): a record's relative image paths are taken from there
    (``anyfit.data.images``). A plain str to everything else; pickled with its folder, so places handed to the
    token store's worker processes keep it."""

    folder: str | None

    def __new__(cls, text: str, folder: str | None) -> Place:
        place = super().__new__(cls, text)
        place.folder = folder
        return place

    def __reduce__(self):
        return Place, (str(self), self.folder)


def folder_of(path) -> str:
    """The absolute folder of a data file, for its records' ``Place``."""
    return os.path.dirname(os.path.abspath(path))


class Records(list):
    """Loaded records (a plain list of dicts) that remember where each came from, for error messages.

    ``locate(i)`` names record i's place, e.g. ``data.jsonl:12``. Slicing with step 1 (the split slice,
    ``num_samples``) keeps the places; any other list operation gives a plain list, whose records are
    then named by their position alone.
    """

    def __init__(self, records: Iterable[dict[str, Any]] = (), locate: Callable[[int], str] | None = None):
        super().__init__(records)
        self.locate = locate or (lambda i: f"record {i}")

    def __getitem__(self, key):
        items = super().__getitem__(key)
        if isinstance(key, slice):
            start, _, step = key.indices(len(self))
            if step == 1:
                return Records(items, lambda i, parent=self.locate, start=start: parent(start + i))
        return items

    def __reduce__(self):
        # The places serve error messages only; a pickled copy (sent to another process) is a plain list.
        return list, (list(self),)


def concat(parts: list[Records]) -> Records:
    """One Records of several, each record keeping its place."""
    if len(parts) == 1:
        return parts[0]
    starts = [0]
    for part in parts:
        starts.append(starts[-1] + len(part))
    locates = [part.locate for part in parts]  # not the parts themselves: the places outlive their lists

    def locate(i: int) -> str:
        k = bisect.bisect_right(starts, i) - 1
        return locates[k](i - starts[k])

    return Records([r for part in parts for r in part], locate)

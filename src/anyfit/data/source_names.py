"""The sources a run's loss is split by: the entries of ``data.mix``, or the values of one record field
(``data.source_column``, e.g. ``source`` in a mixture published as one data set), and the names their losses are
logged under (``loss/<name>``, ``val_loss/<name>``)."""

from __future__ import annotations

import re

from anyfit.data.readers import DataError, Records

# What a run logs per source in metrics.jsonl, each as ``<metric>/<source name>`` (``source_key``): the step's loss and
# its trained tokens, the validation loss. The report and loss.png draw the losses as curves.
SOURCE_METRICS = ("loss", "trainable_tokens", "val_loss")
SOURCE_CURVES = ("loss", "val_loss")


def source_key(metric: str, name: str) -> str:
    """The metrics.jsonl key of ``metric`` (one of ``SOURCE_METRICS``) for the source ``name``."""
    return f"{metric}/{name}"


def curve_prefixes() -> tuple[str, ...]:
    """The prefixes of the per-source keys drawn as curves (``loss/``, ``val_loss/``)."""
    return tuple(source_key(m, "") for m in SOURCE_CURVES)


# More distinct values than this is not a source column (an id, a free-text field): a metric per value would bury
# the run's metrics, so the build stops and says so.
MAX_SOURCES = 64


def metric_names(names: list[str], given: list[bool] | None = None) -> list[str]:
    """Names fit for a metric key: letters, digits and ``_.-`` kept, anything else ``_``; a name two sources would
    share gets its index (``math-2``), unless the user gave it (``given``; distinct by the config's check)."""
    clean = [re.sub(r"[^\w.-]", "_", n) or "source" for n in names]
    given = given or [False] * len(clean)

    def kept(i: int) -> bool:  # the one given name among those that read the same
        return given[i] and sum(g for g, c in zip(given, clean) if c == clean[i]) == 1

    return [f"{n}-{i}" if clean.count(n) > 1 and not kept(i) else n for i, n in enumerate(clean)]


def loss_sources(examples) -> list[str]:
    """The sources whose losses are reported one by one: a mixture's names (``mixture.MixedExamples``), or those of
    a store's source column (``store.Examples``), when there is more than one."""
    names = getattr(examples, "names", [])
    return names if len(names) > 1 else []


class SourceTable:
    """``data.source_column``'s values, numbered in order of first appearance while a token store is built."""

    def __init__(self, column: str | None):
        self.column = column
        self.ids: dict[str, int] = {}

    def number(self, values: list[str]) -> list[int]:
        """The ids of one batch's records' values (new values numbered as they come)."""
        for value in values:
            if value not in self.ids:
                if len(self.ids) == MAX_SOURCES:
                    raise DataError(f"data.source_column={self.column}: more than {MAX_SOURCES} distinct values (first: "
                                    f"{', '.join(list(self.ids)[:5])}, ...); name the field that says which data set "
                                    "a record came from, or set data.source_column=null.")
                self.ids[value] = len(self.ids)
        return [self.ids[v] for v in values]

    @property
    def names(self) -> list[str]:
        return list(self.ids)


def record_sources(records: Records, column: str | None) -> list[str]:
    """Each record's ``column`` value as text ([] without a column); a record without one stops the build at its
    place."""
    if column is None:
        return []
    values = []
    for i, record in enumerate(records):
        value = record.get(column) if isinstance(record, dict) else None
        if value is None or isinstance(value, (dict, list)) or value == "":
            raise DataError(f"{records.locate(i) if isinstance(records, Records) else f'record {i}'}: "
                            f"data.source_column={column} needs a non-empty text or number in every record; this one "
                            f"has {'none' if value in (None, '') else 'a ' + type(value).__name__}. Fill it in, or set "
                            "data.source_column=null.")
        values.append(str(value))
    return values

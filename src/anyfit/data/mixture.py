"""Several sources in one run (``data.mix``): each source is tokenized into its own token store, and every epoch
draws from each in proportion to its weight, with a seeded sample, so every process and every process count sees
the same mixture.

A source's share of an epoch is ``weight / sum(weights)`` of all the kept examples of all sources: a source with
more weight than examples repeats them (whole passes, then a seeded sample of the rest), one with less is
subsampled. With equal weights and equal sizes every example is used once.

Every example knows its source (``source`` in the example, an index into ``names``, of ``sources``): the loss is
summed per source as well (``training.loss``) and logged as ``loss/<name>`` and ``val_loss/<name>``. A source's
name is its entry's ``name``, else its file or data set name.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterator
from dataclasses import dataclass

import numpy as np

from anyfit.config import DataConfig
from anyfit.data.source_names import metric_names
from anyfit.data.store import Examples
from anyfit.data.tokenization import DataReport, TokenizedExample


def sources_of(cfg: DataConfig) -> list[tuple[DataConfig, float]]:
    """``(the data.* settings of each source, its weight)``: one source for ``data.path``, else one per
    ``data.mix`` entry, each entry's keys over the run-wide ``data.*``."""
    if not cfg.mix:
        return [(cfg, 1.0)]
    return [(dataclasses.replace(cfg, mix=[], **{k: v for k, v in entry.items() if k not in ("weight", "name")}),
             float(entry.get("weight", 1.0))) for entry in cfg.mix]


def source_names(cfg: DataConfig) -> list[str]:
    """The name each ``data.mix`` source's loss is logged under (``loss/<name>``): its entry's ``name``, else its
    file, folder or data set name up to the first dot; letters, digits, ``_.-`` kept, anything else ``_``. A name
    that two entries would share gets the entry's index (``math-2``)."""
    return metric_names([str(entry.get("name") or _stem(str(entry["path"]))) for entry in cfg.mix],
                        [bool(entry.get("name")) for entry in cfg.mix])


def _stem(path: str) -> str:
    last = path.rstrip("/").rsplit("/", 1)[-1]
    return last.split(".", 1)[0] or last


@dataclass
class MixedExamples:
    """The examples of one epoch's mixture: row i is example ``rows[i]`` of source ``source[i]``."""

    parts: list[Examples]
    source: np.ndarray
    rows: np.ndarray
    report: DataReport
    lines: list[str]  # per source: kept, drawn per epoch, share, tokens
    names: list[str] = dataclasses.field(default_factory=list)  # per source: what its loss is logged under

    @classmethod
    def whole(cls, parts: list[Examples], names: list[str]) -> MixedExamples:
        """Every example of every part once, part by part (held-out examples: no weights, no draw)."""
        source = np.concatenate([np.full(len(p), s, dtype=np.int16) for s, p in enumerate(parts)])
        rows = np.concatenate([np.arange(len(p), dtype=np.int64) for p in parts])
        return cls(parts, source, rows, combined_report(parts), [], names)

    def __len__(self) -> int:
        return len(self.rows)

    def __getitem__(self, i):
        if isinstance(i, slice):
            return [self[j] for j in range(*i.indices(len(self)))]
        s = int(self.source[i])
        return {**self.parts[s][int(self.rows[i])], "source": s, "sources": len(self.parts)}

    def trained_by_source(self, indices: np.ndarray) -> np.ndarray:
        """Trained tokens per source of the examples ``indices`` (int64, one per source)."""
        source, rows = self.source[indices], self.rows[indices]
        trained = [part.store.arrays["trainable"][part.rows[rows[source == s]]] for s, part in enumerate(self.parts)]
        return np.array([int(t.sum()) for t in trained], dtype=np.int64)

    def __iter__(self) -> Iterator[TokenizedExample]:
        return (self[i] for i in range(len(self)))

    @property
    def lengths(self) -> np.ndarray:
        return self._gather(lambda part: part.lengths)

    @property
    def trainable(self) -> np.ndarray:
        return self._gather(lambda part: part.trainable)

    def _gather(self, values) -> np.ndarray:
        out = np.zeros(len(self.rows), dtype=np.int64)
        for s, part in enumerate(self.parts):
            mine = self.source == s
            out[mine] = values(part)[self.rows[mine]]
        return out


def draw(parts: list[Examples], weights: list[float], names: list[str], seed: int) -> MixedExamples:
    """The mixture of ``parts`` in proportion to ``weights`` (see the module docstring); ``names`` as
    ``source_names`` gives them."""
    counts = _shares(sum(len(p) for p in parts), weights)
    sources, rows, lines = [], [], []
    for s, (part, count, weight, name) in enumerate(zip(parts, counts, weights, names)):
        n = len(part)
        passes, extra = divmod(count, n)
        sample = np.sort(np.random.default_rng([seed, s]).permutation(n)[:extra])
        chosen = np.concatenate([np.tile(np.arange(n), passes), sample]).astype(np.int64)
        sources.append(np.full(len(chosen), s, dtype=np.int16))
        rows.append(chosen)
        tokens, trained = int(part.lengths[chosen].sum()), int(part.trainable[chosen].sum())
        lines.append(f"[anyfit] data.mix[{s}] {name}: {n:,} examples kept, {count:,} drawn per epoch "
                     f"(weight {weight:g}, {count / max(1, sum(counts)):.0%}): {tokens:,} tokens, {trained:,} trained")
    return MixedExamples(parts, np.concatenate(sources), np.concatenate(rows), combined_report(parts), lines, names)


def combined_report(parts: list[Examples]) -> DataReport:
    """What tokenization did to all sources together (each source's own report is printed too)."""
    reports = [p.report for p in parts]
    total = DataReport(length_limit=max(r.length_limit for r in reports), overlong=reports[0].overlong)
    for field in ("loaded", "truncated", "truncated_tokens", "dropped_overlong", "dropped_nothing_to_train",
                  "dropped_no_target", "dropped_no_answer", "kept", "total_tokens", "trainable_tokens", "split_records"):
        setattr(total, field, sum(getattr(r, field) for r in reports))
    total.max_length = max(r.max_length for r in reports)
    total.mean_length = total.total_tokens / total.kept if total.kept else 0.0
    return total


def _shares(total: int, weights: list[float]) -> list[int]:
    """``total`` split in proportion to ``weights`` (largest remainders, so the parts add up to ``total``)."""
    exact = [total * w / sum(weights) for w in weights]
    counts = [int(x) for x in exact]
    for i in sorted(range(len(exact)), key=lambda i: counts[i] - exact[i])[: total - sum(counts)]:
        counts[i] += 1
    return counts

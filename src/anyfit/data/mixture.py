"""Several sources in one run (``data.mix``): each source is tokenized into its own token store, and every epoch
draws from each in proportion to its weight, with a seeded sample, so every process and every process count sees
the same mixture.

A source's share of an epoch is ``weight / sum(weights)`` of all the kept examples of all sources: a source with
more weight than examples repeats them (whole passes, then a seeded sample of the rest), one with less is
subsampled. With equal weights and equal sizes every example is used once.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterator
from dataclasses import dataclass

import numpy as np

from anyfit.config import DataConfig
from anyfit.data.store import Examples
from anyfit.data.tokenization import DataReport, TokenizedExample


def sources_of(cfg: DataConfig) -> list[tuple[DataConfig, float]]:
    """``(the data.* settings of each source, its weight)``: one source for ``data.path``, else one per
    ``data.mix`` entry, each entry's keys over the run-wide ``data.*``."""
    if not cfg.mix:
        return [(cfg, 1.0)]
    return [(dataclasses.replace(cfg, mix=[], **{k: v for k, v in entry.items() if k != "weight"}),
             float(entry.get("weight", 1.0))) for entry in cfg.mix]


@dataclass
class MixedExamples:
    """The examples of one epoch's mixture: row i is example ``rows[i]`` of source ``source[i]``."""

    parts: list[Examples]
    source: np.ndarray
    rows: np.ndarray
    report: DataReport
    lines: list[str]  # per source: kept, drawn per epoch, share, tokens

    def __len__(self) -> int:
        return len(self.rows)

    def __getitem__(self, i):
        if isinstance(i, slice):
            return [self[j] for j in range(*i.indices(len(self)))]
        return self.parts[int(self.source[i])][int(self.rows[i])]

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
    """The mixture of ``parts`` in proportion to ``weights`` (see the module docstring)."""
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
    return MixedExamples(parts, np.concatenate(sources), np.concatenate(rows), combined_report(parts), lines)


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

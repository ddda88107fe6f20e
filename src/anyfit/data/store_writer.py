"""The token store's files as they are written: ``Packed`` (one batch's tokenization results as flat arrays, what a
worker sends back) and ``Writer`` (appends them to the store's files as they come). The layout of the files is
``anyfit.data.store``'s docstring."""

from __future__ import annotations

import dataclasses
import hashlib
import itertools
from array import array
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from anyfit import durable
from anyfit.cache import digest_memo
from anyfit.config import DataConfig
from anyfit.data import image_tokens, source_names, tokenization
from anyfit.data.audit import Findings
from anyfit.data.fingerprint import record_digests
from anyfit.data.tokenization import IGNORE_INDEX, DataReport, Fate, report_of

FORMAT = 7  # 2: record_cut.bin; 3: parts (a record can make several examples); 4: record_digest.bin;
# 5: example_source.bin; 6: images (vision, vision_offsets, image_bytes, example_images, example_image_tokens);
# 7: example_images_shrunk
# name -> dtype; the per-example and per-record arrays are small next to the token arrays.
ARRAYS = {"input_ids": np.int32, "loss_mask": np.uint8, "offsets": np.int64, "trainable": np.int32,
          "part_record": np.int64, "part_fate": np.uint8, "part_example": np.int64, "part_cut": np.int32,
          "record_digest": np.uint64, "example_source": np.int16, "vision": np.uint8, "vision_offsets": np.int64,
          "image_bytes": np.uint8, "example_images": np.int32, "example_image_tokens": np.int32,
          "example_images_shrunk": np.int32}
_KEPT = np.array([f.value for f in Fate if f.kept], dtype=np.uint8)


@dataclass
class Packed:
    """One batch's tokenization results as flat arrays: what a worker sends back and the writer appends.

    Arrays, not the lists ``tokenize_each`` returns: a pickled list costs both processes time per token, an array
    only a copy of its bytes, so the builder's parent is left with little more than writing (the lists were the
    serial part that kept two workers from two cores: BENCHMARKS.md, 'Measurements that were quoted in code
    comments (moved 2026-11-26)').
    """

    records: np.ndarray  # int64, one per part: its record's position in the batch
    fates: np.ndarray  # uint8, one per part
    lengths: np.ndarray  # int64, one per kept example
    ids: np.ndarray  # int32, the kept examples' tokens end to end
    mask: np.ndarray  # uint8, 1 where the token is trained on
    cuts: np.ndarray  # int32, one per part: tokens truncation removed
    findings: Findings  # the batch's unread fields and mask audit
    digests: np.ndarray  # uint64, one per record
    sources: list[str]  # data.source_column's value per record ([] without one)
    visions: list[dict | None]  # one per kept example: its text and images (image_tokens), None for a text one

    @staticmethod
    def of(batch: list[tokenization.RecordResult], records, column: str | None = None) -> Packed:
        findings = Findings()
        for result in batch:
            findings.add(result)
        results = [part for result in batch for part in result.parts]
        visions = [vision for result in batch for part, vision in
                   zip(result.parts, result.vision or [None] * len(result.parts)) if part[0].kept]
        owners = np.fromiter((i for i, result in enumerate(batch) for _ in result.parts), dtype=np.int64,
                             count=len(results))
        kept = [(ids, labels) for fate, ids, labels, _ in results if fate.kept]
        lengths = np.fromiter((len(ids) for ids, _ in kept), dtype=np.int64, count=len(kept))
        total = int(lengths.sum())
        ids = np.fromiter(itertools.chain.from_iterable(i for i, _ in kept), dtype=np.int32, count=total)
        labels = np.fromiter(itertools.chain.from_iterable(lab for _, lab in kept), dtype=np.int64, count=total)
        mask = labels != IGNORE_INDEX
        if not np.array_equal(labels[mask], ids[mask]):  # the 1-byte mask could not hold them
            raise AssertionError("a label differs from its token id; the token store cannot hold it")
        digests = record_digests(records, len(records))
        for k, result in enumerate(batch):  # an image record's digest covers its images' bytes
            images = max((v["sha256"] for v in result.vision if v), key=len, default=None)
            if images:
                digests[k] = np.uint64(int(hashlib.sha256(digests[k].tobytes() + "".join(images).encode()).hexdigest()
                                           [:16], 16))
        return Packed(owners, np.fromiter((r[0] for r in results), dtype=np.uint8, count=len(results)), lengths, ids,
                       mask.astype(np.uint8), np.fromiter((r[3] for r in results), dtype=np.int32, count=len(results)),
                       findings, digests, source_names.record_sources(records, column),
                       visions)


class Writer:
    """Appends tokenized records to the store's files as they come; only per-record bookkeeping stays in RAM."""

    def __init__(self, folder: Path, column: str | None = None):
        self.folder = folder
        self.sources = source_names.SourceTable(column)
        self.record_source = array("h")  # per record: its source's number (data.source_column)
        self.ids = (folder / "input_ids.bin").open("wb")
        self.mask = (folder / "loss_mask.bin").open("wb")
        self.offsets, self.trainable = array("q", [0]), array("i")
        self.part_record, self.fates, self.part_example, self.cuts = array("q"), array("B"), array("q"), array("i")
        self.digests = (folder / "record_digest.bin").open("wb")
        self.vision = (folder / "vision.bin").open("wb")
        self.image_bytes = (folder / "image_bytes.bin").open("wb")
        self.vision_offsets, self.image_counts, self.image_tokens = array("q", [0]), array("i"), array("i")
        self.images_shrunk = array("i")
        self.blob_at = 0
        self.lengths: list[int] = []
        self.records = 0
        self.findings = Findings()

    @property
    def kept(self) -> int:
        return len(self.trainable)

    def add(self, batch: Packed) -> None:
        kept = np.isin(batch.fates, _KEPT)
        first = len(self.trainable)
        self.part_record.extend((self.records + batch.records).tolist())
        self.records += int(batch.records[-1]) + 1 if len(batch.records) else 0  # every record has a part
        self.findings.merge(batch.findings)
        self.digests.write(batch.digests.tobytes())
        self.record_source.extend(self.sources.number(batch.sources))
        self.fates.extend(batch.fates.tolist())
        self.cuts.extend(batch.cuts.tolist())
        self.part_example.extend(np.where(kept, first + np.cumsum(kept) - 1, -1).tolist())
        if any(batch.visions):
            for vision in batch.visions:
                raw = image_tokens.vision_json(vision, self._blob) if vision is not None else b""
                self.vision.write(raw)
                self.vision_offsets.append(self.vision_offsets[-1] + len(raw))
                self.image_counts.append(len(vision["images"]) if vision is not None else 0)
                self.image_tokens.append(vision["image_tokens"] if vision is not None else 0)
                self.images_shrunk.append(vision["shrunk"] if vision is not None else 0)
        else:  # a text batch: its examples' empty entries at once (the parent adds every batch, one at a time)
            n = len(batch.visions)
            self.vision_offsets.extend(array("q", [self.vision_offsets[-1]]) * n)
            for counts in (self.image_counts, self.image_tokens, self.images_shrunk):
                counts.extend(array("i", [0]) * n)
        if not len(batch.lengths):
            return
        self.ids.write(batch.ids.tobytes())
        self.mask.write(batch.mask.tobytes())
        ends = np.cumsum(batch.lengths)
        self.trainable.extend(np.add.reduceat(batch.mask.astype(np.int64), ends - batch.lengths).tolist())
        self.offsets.extend((self.offsets[-1] + ends).tolist())
        self.lengths.extend(batch.lengths.tolist())

    def _blob(self, data: bytes) -> list[int]:
        """Embedded image bytes written once into image_bytes.bin: [offset, length]."""
        self.image_bytes.write(data)
        self.blob_at += len(data)
        return [self.blob_at - len(data), len(data)]

    def report(self, cfg: DataConfig) -> DataReport:
        report = report_of([Fate(f) for f in self.fates], self.lengths, list(self.trainable), cfg.max_length,
                           cfg.overlong, cut=self.cuts, records=self.records, findings=self.findings)
        report.images, report.image_tokens = sum(self.image_counts), sum(self.image_tokens)
        report.images_shrunk = sum(self.images_shrunk)
        return report

    def finish(self, cfg: DataConfig, key: str) -> None:
        self.ids.close()
        self.mask.close()
        self.digests.close()
        self.vision.close()
        self.image_bytes.close()
        with_images = any(self.image_counts)  # a text store keeps no per-example image arrays
        # each kept example's record (parts are in record order, kept ones numbered in turn), then its source
        example_source = np.asarray(self.record_source, dtype=np.int16)[
            np.asarray(self.part_record, dtype=np.int64)[np.asarray(self.part_example) >= 0]] \
            if self.sources.column else np.zeros(0, np.int16)
        for name, values in (("offsets", self.offsets), ("trainable", self.trainable),
                             ("part_record", self.part_record), ("part_fate", self.fates), ("part_example", self.part_example), ("part_cut", self.cuts),
                             ("example_source", example_source),
                             ("vision_offsets", self.vision_offsets if with_images else []),
                             ("example_images", self.image_counts if with_images else []),
                             ("example_image_tokens", self.image_tokens if with_images else []),
                             ("example_images_shrunk", self.images_shrunk if with_images else [])):
            (self.folder / f"{name}.bin").write_bytes(np.asarray(values, dtype=ARRAYS[name]).tobytes())
        counts = {"input_ids": self.offsets[-1], "loss_mask": self.offsets[-1], "offsets": len(self.offsets),
                  "trainable": len(self.trainable), "part_record": len(self.part_record), "part_fate": len(self.fates),
                  "part_example": len(self.part_example), "part_cut": len(self.cuts), "record_digest": self.records,
                  "example_source": len(example_source), "vision": self.vision_offsets[-1],
                  "vision_offsets": len(self.vision_offsets) if with_images else 0, "image_bytes": self.blob_at,
                  "example_images": len(self.image_counts) if with_images else 0,
                  "example_image_tokens": len(self.image_tokens) if with_images else 0,
                  "example_images_shrunk": len(self.images_shrunk) if with_images else 0}
        header = {"format": FORMAT, "key": key, "source": cfg.path, "split": cfg.split, "counts": counts,
                  "dtypes": {k: np.dtype(v).name for k, v in ARRAYS.items()}, "max_length": cfg.max_length,
                  "overlong": cfg.overlong, "report": dataclasses.asdict(self.report(cfg)),
                  "sources": self.sources.names}
        durable.write_manifest(self.folder, [f"{name}.bin" for name in ARRAYS], header, memo=digest_memo())

"""The data of a training run: training examples, held-out examples for the validation loss, and held-out
examples with gold answers for generation accuracy, read from the token store (tokenized once, reused) and
reported.

Every process maps the same store and takes the same seeded hold-out, so the windows drawn from them agree
across processes without communication.
"""

from __future__ import annotations

import dataclasses
import random
from dataclasses import dataclass, field

import numpy as np

from anyfit.config import Config, ConfigError, DataConfig
from anyfit.data import fingerprint
from anyfit.data.answers import example_gold
from anyfit.data.chat import serve_as_trained
from anyfit.data.formats import Example, to_examples
from anyfit.data.image_tokens import ImageTokens
from anyfit.data.mixture import MixedExamples, draw, source_names, sources_of
from anyfit.data.sources import DataError, Records, iter_records
from anyfit.data.store import Examples, TokenStore, open_or_build
from anyfit.data.tokenization import DataReport, nothing_left, only_stops


@dataclass
class TrainingData:
    examples: Examples | MixedExamples
    report: DataReport
    eval_examples: Examples | MixedExamples | list = field(default_factory=list)  # for the validation loss
    eval_report: DataReport | None = None
    gen_examples: list[Example] = field(default_factory=list)  # with gold answers, for generation accuracy


def held_out_records(cfg: Config, records: int) -> list[int]:
    """The record indices ``eval.holdout`` takes out of training: a seeded sample, in record order."""
    order = list(range(records))
    random.Random(cfg.train.seed).shuffle(order)
    return sorted(order[:cfg.eval.holdout])


def eval_data_config(cfg: Config) -> DataConfig:
    """The data.* settings of separate held-out data (``eval.path``/``eval.split``)."""
    return dataclasses.replace(cfg.data, path=cfg.eval.path or cfg.data.path, split=cfg.eval.split or cfg.data.split,
                               num_samples=None, mix=[])


def prepare_training_data(cfg: Config, tokenizer, echo=print, images: ImageTokens | None = None) -> TrainingData:
    """Map (or build) the token store, split off the held-out part, and check now (not after hours of training)
    that generation accuracy, when asked for, has gold answers to compare with. ``images``: the model's processor,
    for records with images."""
    # The template the run trains with and its options as defaults, on the tokenizer every save writes.
    serve_as_trained(tokenizer, cfg.data.chat_template, cfg.data.chat_template_kwargs)
    held: list[int] | None = None
    gold_from: list[tuple[DataConfig, list[int] | None]] = []  # where generation's gold answers are read from
    if cfg.data.mix:  # several sources: a store each, drawn by weight; eval.holdout is taken from each
        examples, eval_examples, gold_from = _mixture(cfg, tokenizer, echo, images)
        if cfg.eval.path:
            eval_examples = open_or_build(eval_data_config(cfg), tokenizer, echo, images).view()
            gold_from = [(eval_data_config(cfg), None)]
    elif cfg.eval.holdout:
        store = open_or_build(cfg.data, tokenizer, echo, images)
        held = held_out_records(cfg, store.records)
        examples, eval_examples = _without(store, held), store.view(held)
    else:
        examples = open_or_build(cfg.data, tokenizer, echo, images).view()
        eval_examples = open_or_build(eval_data_config(cfg), tokenizer, echo, images).view() \
            if cfg.eval.path or cfg.eval.split else None
    if not len(examples):
        raise DataError(nothing_left(examples.report))
    if not cfg.data.mix and (why := only_stops(examples.report, cfg.data)):  # a mixture: each source's, below
        raise DataError(why)
    if cfg.data.source_column:
        echo(_column_line(cfg.data.source_column, examples))
    data = TrainingData(examples, examples.report)
    if eval_examples is None:
        return data
    if not len(eval_examples):
        raise DataError(nothing_left(eval_examples.report))
    data.eval_examples, data.eval_report = eval_examples, eval_examples.report
    if cfg.eval.generate_before or cfg.eval.generate_every or cfg.eval.generate_at_end:
        gold_from = gold_from or [(cfg.data, held) if held is not None else (eval_data_config(cfg), None)]
        for source, records in gold_from:  # data.mix: source after source, until there are enough
            if len(data.gen_examples) < cfg.eval.num_generate:
                data.gen_examples += _with_gold(source, records, cfg.eval.num_generate - len(data.gen_examples))
        if not data.gen_examples:
            raise ConfigError("eval.generate_* is on but no held-out record has a gold answer: map an answer "
                              "column with data.fields: {answer: ...}, or use solutions ending in \\boxed{...} "
                              "or '#### N'.")
    return data


def data_fingerprint(examples: Examples | MixedExamples) -> tuple[dict, list]:
    """What the run's windows read, as ``anyfit.data.fingerprint`` compares it at a resume, and each source's
    record digests."""
    if isinstance(examples, MixedExamples):
        parts, draws = examples.parts, [examples.source.tobytes(), examples.rows.tobytes()]
    else:
        parts, draws = [examples], []
    sources = [_source(part.store) for part in parts]
    draws = [part.rows.tobytes() for part in parts] + draws
    return ({"trained": fingerprint.trained_fingerprint(sources, draws), "sources": sources},
            [part.store.arrays["record_digest"] for part in parts])


def _source(store: TokenStore) -> dict:
    m = store.manifest
    return {"path": m["source"], "split": m["split"], "key": m["key"], "records": store.records,
            "examples": len(store), "tokens": fingerprint.store_tokens(m, ("input_ids.bin", "loss_mask.bin",
                                                                            "offsets.bin"))}


def _mixture(cfg: Config, tokenizer, echo,
             images: ImageTokens | None = None) -> tuple[MixedExamples, MixedExamples | None, list]:
    """The training mixture; with ``eval.holdout``, that many records of each source held out (their examples one
    held-out set, each example knowing its source), and where their gold answers are."""
    sources, names = sources_of(cfg.data), source_names(cfg.data)
    stores = [open_or_build(source, tokenizer, echo, images) for source, _ in sources]
    held = [held_out_records(cfg, store.records) if cfg.eval.holdout else [] for store in stores]
    for store, (source, _) in zip(stores, sources):
        if cfg.eval.holdout >= store.records:
            raise ConfigError(f"eval.holdout={cfg.eval.holdout} records of each data.mix source would leave none of "
                              f"{source.path} ({store.records} records) to train on; lower eval.holdout.")
    parts = [_without(store, h) for store, h in zip(stores, held)]
    for part, (source, _) in zip(parts, sources):
        if not len(part):
            raise DataError(f"data.mix source {source.path}: " + nothing_left(part.report))
        if why := only_stops(part.report, source):
            raise DataError(f"data.mix source {source.path}: {why}")
    mixed = draw(parts, [w for _, w in sources], names, cfg.train.seed)
    for line in mixed.lines:
        echo(line)
    if not cfg.eval.holdout:
        return mixed, None, []
    gold_from = [(source, h) for (source, _), h in zip(sources, held)]
    return mixed, MixedExamples.whole([store.view(h) for store, h in zip(stores, held)], names), gold_from


def _column_line(column: str, examples: Examples) -> str:
    """What ``data.source_column`` found: per source, its training examples and trained tokens."""
    counts = np.bincount(examples.store.arrays["example_source"][examples.rows], minlength=len(examples.names))
    trained = examples.trained_by_source(np.arange(len(examples)))
    parts = [f"{name} {n:,} examples, {t:,} trained tokens" for name, n, t in zip(examples.names, counts, trained)]
    return f"[anyfit] data.source_column {column}: {len(parts)} source(s): " + "; ".join(parts) + \
        ("" if len(parts) > 1 else " (one source: the loss is not split)")


def _without(store: TokenStore, held: list[int]) -> Examples:
    """The store's examples but those of the ``held`` records."""
    if not held:
        return store.view()
    kept = set(held)
    return store.view([i for i in range(store.records) if i not in kept])


def _with_gold(cfg: DataConfig, records: list[int] | None, limit: int) -> list[Example]:
    """The first ``limit`` held-out examples with a gold answer: of the given record indices of ``cfg``'s data,
    or of all of it. Read as a stream, so a large source is never held in memory for a few examples."""
    wanted = set(records) if records is not None else None
    found: list[Example] = []
    start = 0
    detected = cfg
    for batch in iter_records(cfg):
        picked = [i for i in range(len(batch)) if wanted is None or start + i in wanted]
        if picked:
            chosen = Records([batch[i] for i in picked], lambda k, b=batch, p=picked: b.locate(p[k]))
            examples = to_examples(chosen, detected)
            found += [e for e in examples if example_gold(e) is not None]
        if start == 0 and detected.format == "auto":
            detected = dataclasses.replace(cfg, format=to_examples(batch[:1], cfg)[0].kind)
        start += len(batch)
        if len(found) >= limit:
            break
    return found[:limit]

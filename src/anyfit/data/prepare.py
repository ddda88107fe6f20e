"""The data of a training run: training examples, held-out examples for the validation loss, and held-out
examples with gold answers for generation accuracy, tokenized once and reported.

Every process prepares the same lists (the same records, the same seeded hold-out), so the windows drawn
from them agree across processes without communication.
"""

from __future__ import annotations

import dataclasses
import random
from dataclasses import dataclass, field

from anyfit.config import Config, ConfigError
from anyfit.data.answers import example_gold
from anyfit.data.formats import Example, to_examples
from anyfit.data.sources import load_records
from anyfit.data.tokenization import DataReport, TokenizedExample, tokenize_dataset


@dataclass
class TrainingData:
    examples: list[TokenizedExample]
    report: DataReport
    eval_examples: list[TokenizedExample] = field(default_factory=list)  # for the validation loss
    eval_report: DataReport | None = None
    gen_examples: list[Example] = field(default_factory=list)  # with gold answers, for generation accuracy


def split_eval_records(cfg: Config, records: list[dict]) -> tuple[list[dict], list[dict] | None]:
    """(training records, held-out records or None). ``eval.holdout`` takes a seeded sample of the
    training records out of training; ``eval.path``/``eval.split`` read separate data with the data.* settings."""
    if cfg.eval.holdout:
        order = list(range(len(records)))
        random.Random(cfg.train.seed).shuffle(order)
        held = set(order[:cfg.eval.holdout])
        return [r for i, r in enumerate(records) if i not in held], [records[i] for i in sorted(held)]
    if cfg.eval.path or cfg.eval.split:
        eval_data = dataclasses.replace(cfg.data, path=cfg.eval.path or cfg.data.path,
                                        split=cfg.eval.split or cfg.data.split, num_samples=None)
        return records, load_records(eval_data)
    return records, None


def prepare_training_data(cfg: Config, tokenizer) -> TrainingData:
    """Load, split, normalise and tokenize; checks now (not after hours of training) that generation
    accuracy, when asked for, has gold answers to compare with."""
    train_records, eval_records = split_eval_records(cfg, load_records(cfg.data))
    examples, report = tokenize_dataset(train_records, tokenizer, cfg.data)
    data = TrainingData(examples, report)
    if not eval_records:
        return data
    held_out = to_examples(eval_records, cfg.data)  # normalised once, for both uses
    data.eval_examples, data.eval_report = tokenize_dataset(held_out, tokenizer, cfg.data)
    if cfg.eval.generate_before or cfg.eval.generate_every or cfg.eval.generate_at_end:
        data.gen_examples = [e for e in held_out if example_gold(e) is not None][:cfg.eval.num_generate]
        if not data.gen_examples:
            raise ConfigError("eval.generate_* is on but no held-out record has a gold answer: map an answer "
                              "column with data.fields: {answer: ...}, or use solutions ending in \\boxed{...} "
                              "or '#### N'.")
    return data

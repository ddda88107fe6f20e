"""Loss per data source (data.mix): each source's training and validation loss, token-weighted as the main loss,
the same whatever the split into micro-batches, and the validation loss of each source equal to transformers' own
loss on that source's held-out examples. (The same whatever the split into processes: test_run_invariance's
two-process run trains this mixture.)"""

from __future__ import annotations

import json

import pytest
import torch
from tiny_runs import SOURCES, assert_same_sources, metrics_by_step, read_metrics, write_dataset, write_mix
from transformers import AutoModelForCausalLM, AutoTokenizer

from anyfit.config import load_config
from anyfit.data.prepare import prepare_training_data
from anyfit.training.loop import train

pytestmark = pytest.mark.multirun

COLUMN = ("blue", "red_team")  # data.source_column's values in order of first appearance, fit for metric keys
RUN = ("train.effective_batch=8", "train.max_steps=4", "train.learning_rate=1e-2", "train.seed=0", "train.log_every=1",
       "eval.holdout=3", "eval.every=2")


def with_column(tmp) -> tuple[str, ...]:
    """One data set whose records name their source in a field (data.source_column)."""
    rows = [json.loads(line) for line in write_dataset(tmp / "w.jsonl", n=24).read_text().splitlines()]
    path = tmp / "column.jsonl"
    path.write_text("".join(json.dumps({**r, "origin": "red team" if i % 3 else "blue"}) + "\n"
                            for i, r in enumerate(rows)))
    return f"data.path={path}", "data.source_column=origin"


@pytest.fixture(scope="module")
def runs(tiny_llama_dir, tmp_path_factory):
    """The same mixture: one process with micro-batch 8, one with packed micro-batches of 2 (accumulation 4); and
    one data set split by its source column."""
    tmp = tmp_path_factory.mktemp("sources")
    data = write_mix(tmp)
    configs = {name: load_config(None, [f"model.name_or_path={tiny_llama_dir}", "data.template=plain",
                                        f"train.output_dir={tmp / name}", *RUN, *extra])
               for name, extra in {"whole": (data, "train.micro_batch=8"),
                                   "packed": (data, "train.micro_batch=2", "train.packing=true"),
                                   "column": (*with_column(tmp), "train.micro_batch=4")}.items()}
    for cfg in configs.values():
        train(cfg, echo=lambda *a: None)
    return tmp, configs


@pytest.mark.parametrize("run, names", [("whole", SOURCES), ("column", COLUMN)])
def test_the_sources_losses_are_the_loss_token_weighted(runs, run, names):
    tmp, _ = runs
    steps = metrics_by_step(tmp / run)
    assert sum(f"loss/{n}" in m for m in steps.values() for n in names) >= 6  # both sources, most steps
    for m in steps.values():
        tokens = {n: m[f"trainable_tokens/{n}"] for n in names}
        assert sum(tokens.values()) == m["trainable_tokens"]
        weighted = sum(m[f"loss/{n}"] * tokens[n] for n in names if tokens[n]) / m["trainable_tokens"]
        assert weighted == pytest.approx(m["loss"], rel=1e-5)  # each logged value rounded to 6 digits
    evals = [m for m in read_metrics(tmp / run) if "val_loss" in m]
    assert [m["step"] for m in evals] == [2, 4] and all(f"val_loss/{n}" in m for m in evals for n in names)


def test_the_split_into_micro_batches_changes_no_sources_loss(runs):
    tmp, _ = runs
    assert_same_sources(tmp / "whole", tmp / "packed", steps=4, rel=1e-4)


@pytest.mark.parametrize("run, names", [("whole", SOURCES), ("column", COLUMN)])
def test_each_sources_validation_loss_is_transformers_own(runs, tiny_llama_dir, run, names):
    """The final model's loss on each source's held-out examples, one example at a time with transformers'
    ``labels`` (its own shift and mean), weighted by each example's trained tokens."""
    tmp, configs = runs
    data = prepare_training_data(configs[run], AutoTokenizer.from_pretrained(tiny_llama_dir), echo=lambda *a: None)
    model = AutoModelForCausalLM.from_pretrained(tmp / run, dtype=torch.float32).eval()
    sums, counts = [0.0, 0.0], [0, 0]
    with torch.no_grad():
        for ex in data.eval_examples:
            n = sum(t != -100 for t in ex["labels"][1:])
            loss = model(input_ids=torch.tensor([ex["input_ids"]]), labels=torch.tensor([ex["labels"]])).loss
            sums[ex["source"]] += loss.item() * n
            counts[ex["source"]] += n
    logged = [m for m in read_metrics(tmp / run) if "val_loss" in m][-1]
    assert logged["step"] == 4 and all(counts)
    for s, name in enumerate(names):
        assert logged[f"val_loss/{name}"] == pytest.approx(sums[s] / counts[s], rel=1e-5)
    report = (tmp / run / "report.html").read_text()
    assert "Loss per data source" in report and f"val_loss/{names[1]}" in report


def test_a_holdout_that_would_empty_a_source_is_one_line(tiny_llama_dir, tmp_path):
    from anyfit.config import ConfigError

    cfg = load_config(None, [f"model.name_or_path={tiny_llama_dir}", write_mix(tmp_path), "data.template=plain",
                             f"data.cache_dir={tmp_path / 'stores'}", "eval.holdout=14"])
    with pytest.raises(ConfigError, match=r"eval.holdout=14 records of each data.mix source would leave none of "
                                          r".*numbers.jsonl \(14 records\)"):
        prepare_training_data(cfg, AutoTokenizer.from_pretrained(tiny_llama_dir), echo=lambda *a: None)

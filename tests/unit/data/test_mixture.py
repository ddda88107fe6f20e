"""data.mix: several sources, each with its own settings and a weight, drawn into every epoch the same way on
every process."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
from transformers import AutoTokenizer

from anyfit.config import ConfigError, load_config
from anyfit.data.mixture import _shares, sources_of
from anyfit.data.prepare import prepare_training_data
from anyfit.data.sources import load_records
from anyfit.data.tokenization import tokenize_dataset


@pytest.fixture(scope="module")
def tokenizer(qwen_tokenizer_dir):
    return AutoTokenizer.from_pretrained(qwen_tokenizer_dir)


def write(path: Path, rows: list[dict]) -> Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


@pytest.fixture
def two_sources(tmp_path):
    math = write(tmp_path / "math.jsonl", [{"problem": f"{i} + {i}?", "solution": f"{2 * i}"} for i in range(40)])
    chat = write(tmp_path / "chat.jsonl", [{"messages": [{"role": "user", "content": f"hello {i}"},
                                                         {"role": "assistant", "content": "hi " * (i % 5 + 1)}]}
                                           for i in range(20)])
    return math, chat


def mix_config(tmp_path, math, chat, *extra):
    return load_config(None, [
        f"data.mix=[{{path: {math}, weight: 3, template: plain, fields: {{prompt: problem, completion: solution}}}},"
        f" {{path: {chat}, weight: 1}}]", "data.template=chat", f"data.cache_dir={tmp_path / 'stores'}", *extra])


def test_each_source_has_its_own_settings_over_data(tmp_path, two_sources):
    math, chat = two_sources
    cfg = mix_config(tmp_path, math, chat, "data.max_length=99")
    (m, w_m), (c, w_c) = sources_of(cfg.data)
    assert (m.path, m.template, m.fields, w_m) == (str(math), "plain", {"prompt": "problem", "completion": "solution"}, 3)
    assert (c.path, c.template, c.fields, w_c) == (str(chat), "chat", {}, 1.0)
    assert m.max_length == c.max_length == 99 and not m.mix and not c.mix


@pytest.mark.slow
def test_the_epoch_is_drawn_by_weight_the_same_way_every_time(tmp_path, two_sources, tokenizer):
    math, chat = two_sources
    cfg = mix_config(tmp_path, math, chat, "train.seed=3")
    said: list[str] = []
    data = prepare_training_data(cfg, tokenizer, echo=said.append)
    assert len(data.examples) == 60  # all kept examples of both, shared 3:1
    assert np.bincount(data.examples.source).tolist() == [45, 15]
    assert any("data.mix[0]" in line and "45 drawn per epoch" in line and "75%" in line for line in said)
    # the math source (40 examples, 45 drawn) is used once whole plus 5 seeded repeats; chat: 15 of its 20
    math_rows = data.examples.rows[data.examples.source == 0]
    assert sorted(set(math_rows.tolist())) == list(range(40)) and len(math_rows) == 45
    chat_rows = data.examples.rows[data.examples.source == 1]
    assert len(set(chat_rows.tolist())) == 15
    # every example is the source's own tokenization
    (m, _), (c, _) = sources_of(cfg.data)
    math_expected, _ = tokenize_dataset(load_records(m), tokenizer, m)
    chat_expected, _ = tokenize_dataset(load_records(c), tokenizer, c)
    for i in (0, 44, 45, 59):
        source, row = int(data.examples.source[i]), int(data.examples.rows[i])
        assert data.examples[i] == {**(math_expected, chat_expected)[source][row], "source": source, "sources": 2}
    assert data.examples.lengths.tolist() == [len(e["input_ids"]) for e in data.examples]
    # the same mixture on every process and every call (a pure function of the config and the seed)
    again = prepare_training_data(cfg, tokenizer, echo=lambda *a: None)
    assert np.array_equal(again.examples.rows, data.examples.rows)
    other_seed = prepare_training_data(mix_config(tmp_path, math, chat, "train.seed=4"), tokenizer, echo=lambda *a: None)
    assert not np.array_equal(other_seed.examples.rows, data.examples.rows)
    assert data.report.loaded == 60 and data.report.kept == 60


def test_shares_add_up():
    assert _shares(60, [3, 1]) == [45, 15]
    assert _shares(10, [1, 1, 1]) in ([4, 3, 3], [3, 4, 3], [3, 3, 4]) and sum(_shares(10, [1, 1, 1])) == 10
    assert sum(_shares(1001, [0.2, 0.3, 0.5])) == 1001


@pytest.mark.parametrize("extra, message", [
    (["data.path=x.jsonl"], "either data.path"),
    (["eval.split=test"], "eval.split alone"),
    (["data.mix=[{path: a.jsonl, name: x}, {path: b.jsonl, name: x}]"], "distinct"),
    (["data.mix=[{path: a.jsonl, wieght: 2}]"], "Did you mean 'weight'"),
    (["data.mix=[{path: a.jsonl, weight: 0}]"], "positive number"),
    (["data.mix=[{path: a.jsonl, template: nope}]"], "data.mix[0].template"),
    (["data.mix=[{path: a.jsonl, max_length: many}]"], "data.mix[0].max_length"),
])
def test_bad_mixtures_are_one_line(tmp_path, two_sources, extra, message):
    math, chat = two_sources
    with pytest.raises(ConfigError, match=message.replace("[", r"\[").replace("]", r"\]")):
        mix_config(tmp_path, math, chat, *extra) if not extra[0].startswith("data.mix") else \
            load_config(None, extra)


@pytest.mark.slow
def test_a_run_trains_on_a_mixture(tmp_path, two_sources, tiny_llama_dir):
    from anyfit.training.loop import train

    math, chat = two_sources
    cfg = mix_config(tmp_path, math, chat, f"model.name_or_path={tiny_llama_dir}", "train.effective_batch=4",
                     "train.micro_batch=2", "train.max_steps=3", f"train.output_dir={tmp_path / 'out'}",
                     "train.log_every=1")
    result = train(cfg, echo=lambda *a: None)
    assert len(result.losses) == 3 and all(np.isfinite(result.losses))

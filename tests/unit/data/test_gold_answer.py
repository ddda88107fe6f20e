"""One gold answer: what r1_zero trains between its <answer> tags is exactly what ``anyfit eval`` grades
against, for GSM8K-, MATH- and free-form-style records (on the real Qwen2.5 tokenizer)."""

from __future__ import annotations

import json
import re

import pytest

from anyfit.config import Config, DataConfig, EvalConfig
from anyfit.data.answers import example_gold
from anyfit.data.formats import to_examples
from anyfit.data.tokenization import IGNORE_INDEX, tokenize_dataset
from anyfit.evaluation.evaluate import evaluate
from anyfit.evaluation.inference import Completion

GSM8K_SOLUTION = "Natalia sold 48/2 = <<48/2=24>>24 clips in May.\nShe sold 48+24 = <<48+24=72>>72 clips.\n#### 72"
MATH_SOLUTION = "Half of one is $\\frac{1}{2}$, so the answer is $\\boxed{\\frac{1}{2}}$."

# (record, data.fields, the gold answer)
CASES = {
    # GSM8K as published: a question and an 'answer' column holding the whole solution, trained as the completion.
    "gsm8k": ({"question": "How many clips?", "answer": GSM8K_SOLUTION}, {"prompt": "question", "completion": "answer"},
              "72"),
    # The solution in 'completion' and no answer field: r1_zero used to drop it while eval found '#### 72'.
    "gsm8k_completion": ({"prompt": "How many clips?", "completion": GSM8K_SOLUTION}, {}, "72"),
    # A whole solution in the 'answer' field: r1_zero used to train on all of it between the tags.
    "gsm8k_answer_field": ({"prompt": "How many clips?", "completion": "48 + 24 = 72.", "answer": GSM8K_SOLUTION}, {},
                           "72"),
    "math": ({"problem": "What is 1 divided by 2?", "solution": MATH_SOLUTION},
             {"prompt": "problem", "completion": "solution"}, "\\frac{1}{2}"),
    "math_answer_field": ({"problem": "What is 1 divided by 2?", "solution": MATH_SOLUTION, "answer": "1/2"},
                          {"prompt": "problem", "completion": "solution"}, "1/2"),
    "free_form": ({"prompt": "How many 5-element subsets has a 10-element set?", "completion": "Choose 5 of 10.",
                   "answer": "C(10, 5), or equivalently 252"}, {}, "C(10, 5), or equivalently 252"),
}


def trained_text(tokenizer, row) -> str:
    return tokenizer.decode([t for t, label in zip(row["input_ids"], row["labels"]) if label != IGNORE_INDEX])


class Parrot:
    """A back end whose model writes, for each prompt, the completion r1_zero trained on: a perfectly trained model."""

    name = "parrot"

    def __init__(self, tokenizer, texts: list[str]):
        self.tokenizer, self.texts = tokenizer, texts

    def generate(self, prompts, params):
        assert len(prompts) == len(self.texts)
        return [Completion(text, 1, "stop") for text in self.texts]


@pytest.mark.parametrize("case", list(CASES))
def test_r1_zero_trains_on_the_answer_eval_grades_against(case, qwen_tokenizer, tmp_path):
    record, fields, gold = CASES[case]
    data = tmp_path / "d.jsonl"
    data.write_text(json.dumps(record) + "\n")
    cfg = DataConfig(path=str(data), template="r1_zero", fields=fields)

    rows, report = tokenize_dataset([record], qwen_tokenizer, cfg)
    assert report.dropped_no_answer == 0
    trained = trained_text(qwen_tokenizer, rows[0])
    assert trained.endswith(f" </think> <answer> {gold} </answer><|im_end|>")
    (between_tags,) = re.findall(r"<answer> (.*?) </answer>", trained, re.DOTALL)

    completion = trained.removesuffix("<|im_end|>")
    summary = evaluate(Parrot(qwen_tokenizer, [completion]), Config(data=cfg, eval=EvalConfig(max_new_tokens=8)),
                       out_dir=tmp_path / "eval", echo=lambda *a: None)
    (prediction,) = [json.loads(x) for x in (tmp_path / "eval" / "predictions.jsonl").read_text().splitlines()]
    assert prediction["gold"] == between_tags == gold
    assert (prediction["extracted"], prediction["how"], prediction["correct"]) == (gold, "answer_tag", True)
    assert summary["accuracy"] == 1.0 and summary["format_rate"] == 1.0


def test_no_gold_anywhere_is_dropped_from_r1_zero_and_skipped_by_eval(qwen_tokenizer):
    records = [{"prompt": "x?", "completion": "#### 3"}, {"prompt": "y?", "completion": "no final answer"}]
    cfg = DataConfig(template="r1_zero")
    rows, report = tokenize_dataset(records, qwen_tokenizer, cfg)
    assert (report.kept, report.dropped_no_answer) == (1, 1)
    assert "'#### N' or \\boxed{}" in report.summary()
    assert [example_gold(e) for e in to_examples(records, cfg)] == ["3", None]


@pytest.mark.parametrize("record, gold", [
    ({"prompt": "q", "completion": "so \\boxed{2} and then\n#### 5"}, "5"),  # '#### N' before the last \boxed{}
    ({"prompt": "q", "completion": "s", "answer": "  \\boxed{\\pi}  "}, "\\pi"),  # a boxed answer field: its content
    ({"prompt": "q", "completion": "s", "answer": "   "}, None),  # a blank answer field and no form in the solution
    ({"messages": [{"role": "user", "content": "2+2?"}, {"role": "assistant", "content": "It is \\boxed{4}."}]}, "4"),
])
def test_example_gold(record, gold):
    (example,) = to_examples([record], DataConfig())
    assert example_gold(example) == gold

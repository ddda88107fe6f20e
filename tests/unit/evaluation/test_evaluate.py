import json

import pytest
import torch

from anyfit.cli import main
from anyfit.config import Config, DataConfig, EvalConfig
from anyfit.data.answers import example_gold
from anyfit.data.sources import DataError
from anyfit.data.tokenization import prompt_token_ids
from anyfit.evaluation.evaluate import (
    default_params,
    evaluate,
    generation_eval,
    load_eval_examples,
    score_completions,
    summarize,
)
from anyfit.evaluation.inference import Completion


def test_summary_of_fixed_completions_matches_a_hand_count():
    completions = [
        Completion("so \\boxed{\\frac12}", 10, "eos"),  # boxed, right (0.5)
        Completion("#### 72", 5, "eos"),  # GSM8K form: right, but not the form asked for
        Completion("I think 41", 20, "length"),  # last-number guess, wrong
        Completion("it is 7", 8, "eos"),  # last-number guess, right
        Completion("\\boxed{3}", 4, "eos"),  # boxed, wrong
        Completion("no idea", 3, "length"),  # nothing
    ]
    golds = ["0.5", "72", "42", "7", "4", "1"]
    rows = score_completions(completions, golds, "boxed", prompts=[f"q{i}" for i in range(6)])
    assert [r["how"] for r in rows] == ["boxed", "gsm8k", "last_number", "last_number", "boxed", "none"]
    assert [r["correct"] for r in rows] == [True, True, False, True, False, False]
    assert [r["format_ok"] for r in rows] == [True, False, False, False, True, False]
    assert rows[0] == {"index": 0, "prompt": "q0", "completion": "so \\boxed{\\frac12}", "extracted": "\\frac12",
                       "how": "boxed", "gold": "0.5", "correct": True, "format_ok": True, "num_tokens": 10,
                       "finish_reason": "eos"}
    assert summarize(rows, generation_seconds=5.0) == {
        "n": 6,
        "accuracy": pytest.approx(2 / 6),  # the two structured answers that are right; guesses do not count
        "correct": 2,
        "format_rate": pytest.approx(2 / 6),
        "fallback_rate": pytest.approx(2 / 6),
        "fallback_accuracy": pytest.approx(1 / 2),
        "accuracy_with_fallback": pytest.approx(3 / 6),
        "no_answer_rate": pytest.approx(1 / 6),
        "answer_forms": {"boxed": 2, "gsm8k": 1, "last_number": 2, "none": 1},
        "finish_reasons": {"eos": 4, "length": 2},
        "mean_completion_tokens": pytest.approx(50 / 6),
        "completion_tokens": 50,
        "generation_seconds": 5.0,
        "tokens_per_second": pytest.approx(10.0),
    }


def test_r1_zero_asks_for_answer_tags():
    rows = score_completions(["<think> 2+3 </think> <answer> 5 </answer>", "\\boxed{5}", "5"], ["5"] * 3, "answer_tag")
    assert [(r["how"], r["correct"], r["format_ok"]) for r in rows] == [
        ("answer_tag", True, True), ("boxed", True, False), ("last_number", True, False)]
    s = summarize(rows)
    assert s["accuracy"] == pytest.approx(2 / 3) and s["format_rate"] == pytest.approx(1 / 3)
    assert s["fallback_accuracy"] == 1.0 and "tokens_per_second" not in s
    params = default_params(Config(data=DataConfig(template="r1_zero"), eval=EvalConfig(max_new_tokens=64)))
    assert params.stop == ("</answer>",) and params.include_stop and params.greedy and params.max_new_tokens == 64


def _jsonl(path, records):
    path.write_text("".join(json.dumps(r) + "\n" for r in records))
    return path


def test_gold_answers_from_every_layout(tmp_path):
    math = _jsonl(tmp_path / "math.jsonl", [{"problem": "p", "solution": "so \\boxed{\\frac{1}{2}}", "answer": "1/2"},
                                            {"problem": "q", "solution": "thus \\boxed{3}", "answer": ""}])
    examples = load_eval_examples(DataConfig(path=str(math), fields={"prompt": "problem", "completion": "solution"}))
    assert [example_gold(e) for e in examples] == ["1/2", "3"]  # the answer field first, else the last \boxed{}

    gsm8k = _jsonl(tmp_path / "gsm8k.jsonl", [{"question": "How many?", "answer": "1000+234 = 1234\n#### 1,234"}])
    (ex,) = load_eval_examples(DataConfig(path=str(gsm8k), fields={"prompt": "question", "completion": "answer"}))
    assert example_gold(ex) == "1234"
    (ex,) = load_eval_examples(DataConfig(path=str(gsm8k), fields={"prompt": "question", "answer": "answer"}))
    assert ex.completion == "" and example_gold(ex) == "1234"  # prompt-only records are read too

    chat = _jsonl(tmp_path / "chat.jsonl", [{"messages": [{"role": "user", "content": "2+2?"},
                                                          {"role": "assistant", "content": "\\boxed{4}"}]}])
    (ex,) = load_eval_examples(DataConfig(path=str(chat)))
    assert example_gold(ex) == "4"


class FixedBackend:
    """A back end that answers from a script: scoring and file writing without a model."""

    name = "fixed"

    def __init__(self, tokenizer, answers):
        self.tokenizer = tokenizer
        self.answers = answers
        self.calls = []

    def generate(self, prompts, params):
        self.calls.append((prompts, params))
        return [Completion(a, len(a), "eos", len(p)) for a, p in zip(self.answers, prompts)]


def test_evaluate_writes_predictions_and_summary(qwen_tokenizer, tmp_path):
    data = _jsonl(tmp_path / "test.jsonl", [
        {"problem": "What is 2+2?", "answer": "4"},
        {"problem": "What is 4+5?", "answer": "9"},
        {"problem": "Half of 1?", "answer": "\\frac{1}{2}"},
        {"problem": "No gold here", "answer": None},
    ])
    cfg = DataConfig(path=str(data), fields={"prompt": "problem", "answer": "answer"})
    backend = FixedBackend(qwen_tokenizer, ["It is \\boxed{4}.", "maybe 10", "\\boxed{0.5}"])
    summary = evaluate(backend, Config(data=cfg, eval=EvalConfig(max_new_tokens=32)), out_dir=tmp_path / "out",
                       echo=lambda *a: None)

    (prompts, params), = backend.calls
    examples = load_eval_examples(cfg)
    assert prompts == [prompt_token_ids(e, qwen_tokenizer, cfg) for e in examples[:3]]  # exactly as in training
    assert params.max_new_tokens == 32 and params.greedy
    assert summary["n"] == 3 and summary["skipped_no_gold"] == 1
    assert summary["accuracy"] == pytest.approx(2 / 3) and summary["fallback_rate"] == pytest.approx(1 / 3)
    assert summary["data"]["template"] == "chat" and summary["backend"] == "fixed"

    lines = [json.loads(x) for x in (tmp_path / "out" / "predictions.jsonl").read_text().splitlines()]
    assert len(lines) == 3
    assert {"prompt", "completion", "extracted", "how", "gold", "correct"} <= set(lines[0])
    assert "<|im_start|>user\nWhat is 2+2?" in lines[0]["prompt"]
    assert [(x["extracted"], x["how"], x["gold"], x["correct"]) for x in lines] == [
        ("4", "boxed", "4", True), ("10", "last_number", "9", False), ("0.5", "boxed", "\\frac{1}{2}", True)]
    assert json.loads((tmp_path / "out" / "summary.json").read_text())["accuracy"] == pytest.approx(2 / 3)


def test_no_gold_at_all_is_a_clear_error(qwen_tokenizer, tmp_path):
    data = _jsonl(tmp_path / "d.jsonl", [{"prompt": "hi", "completion": "hello"}])
    with pytest.raises(DataError, match="gold answer"):
        evaluate(FixedBackend(qwen_tokenizer, ["x"]), Config(data=DataConfig(path=str(data))), echo=lambda *a: None)


def test_generation_eval_on_a_loaded_model(tiny_llama_dir, qwen_tokenizer, tmp_path):
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(tiny_llama_dir, dtype=torch.float32)
    model.train()
    data = _jsonl(tmp_path / "d.jsonl", [{"prompt": "1+1?", "completion": "\\boxed{2}"},
                                         {"prompt": "2+2?", "completion": "\\boxed{4}"}])
    cfg = Config(data=DataConfig(path=str(data), template="plain"), eval=EvalConfig(max_new_tokens=3, batch_size=2))
    rows, metrics = generation_eval(model, qwen_tokenizer, load_eval_examples(cfg.data), cfg)
    assert len(rows) == 2 and {"prompt", "gold", "extracted", "correct"} <= set(rows[0])
    assert metrics["n"] == 2 and 0 <= metrics["accuracy"] <= 1 and metrics["completion_tokens"] <= 6
    assert metrics["tokens_per_second"] > 0
    assert model.training


@pytest.mark.slow
def test_cli_eval_and_generate(tiny_llama_dir, tmp_path, capsys):
    data = _jsonl(tmp_path / "test.jsonl", [{"problem": "What is 2+2?", "answer": "4"},
                                            {"problem": "What is 3+3?", "answer": "6"}])
    # A training output folder: the model plus the run's config.yaml, whose template eval adopts.
    run = tmp_path / "run"
    run.mkdir()
    for f in tiny_llama_dir.iterdir():
        (run / f.name).symlink_to(f)
    (run / "config.yaml").write_text("data:\n  template: plain\n")
    rc = main(["eval", f"data.path={data}", "data.fields={prompt: problem, answer: answer}", "runtime.device=cpu",
               "--model", str(run), "--max-new-tokens", "3", "--batch-size", "2", "--out", str(tmp_path / "ev")])
    assert rc == 0
    out = capsys.readouterr().out
    assert "settings of the training run" in out and "accuracy" in out
    summary = json.loads((tmp_path / "ev" / "summary.json").read_text())
    assert summary["n"] == 2 and summary["data"]["template"] == "plain" and summary["backend"] == "transformers"
    assert len((tmp_path / "ev" / "predictions.jsonl").read_text().splitlines()) == 2

    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text(json.dumps({"prompt": "Hello"}) + "\n")
    rc = main(["generate", "--model", str(tiny_llama_dir), "--prompt", "What is 2+2?", "--file", str(prompts),
               "--max-new-tokens", "3", "--device", "cpu", "--backend", "transformers", "--jsonl"])
    assert rc == 0
    lines = [json.loads(x) for x in capsys.readouterr().out.splitlines() if x.startswith("{")]
    assert [x["prompt"] for x in lines] == ["What is 2+2?", "Hello"] and all(x["num_tokens"] == 3 for x in lines)


def test_cli_errors(tiny_llama_dir, capsys):
    assert main(["generate", "--model", str(tiny_llama_dir)]) == 2
    assert "No prompts" in capsys.readouterr().err
    assert main(["generate", "--model", str(tiny_llama_dir), "--prompt", "x", "--backend", "vllm",
                 "--device", "cpu"]) == 2
    assert "CUDA" in capsys.readouterr().err
    assert main(["eval", "data.path=x.jsonl"]) == 2
    assert "--model" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        main(["eval", "--batch-size", "0"])

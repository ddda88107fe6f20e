"""``anyfit eval`` takes eval.max_new_tokens and eval.batch_size from the config (the YAML, a training run's
config.yaml, key=value overrides), and a --max-new-tokens / --batch-size flag given on the command line wins."""

from __future__ import annotations

import json

import pytest

from anyfit.cli import main
from anyfit.evaluation.inference import Completion, TransformersBackend


@pytest.fixture
def eval_data(tmp_path):
    data = tmp_path / "test.jsonl"
    records = [{"problem": f"What is {i}+{i}?", "answer": str(2 * i)} for i in range(3)]
    data.write_text("".join(json.dumps(r) + "\n" for r in records))
    return data


def run_eval(tmp_path, *argv) -> dict:
    out = tmp_path / f"eval{len(list(tmp_path.glob('eval*')))}"
    assert main(["eval", *map(str, argv), "runtime.device=cpu", "--out", str(out)]) == 0
    summary = json.loads((out / "summary.json").read_text())
    assert summary["n"] == 3 and summary["backend"] == "transformers"
    assert summary["completion_tokens"] <= 3 * summary["params"]["max_new_tokens"]  # applied, not only recorded
    return summary


def knobs(summary: dict) -> tuple:
    return summary["params"]["max_new_tokens"], summary["batch_size"]


@pytest.mark.slow
def test_yaml_values_and_flags(tiny_llama_dir, eval_data, tmp_path):
    yaml = tmp_path / "eval.yaml"
    yaml.write_text(f"data:\n  path: {eval_data}\n  template: plain\n  fields: {{prompt: problem, answer: answer}}\n"
                    "eval:\n  max_new_tokens: 3\n  batch_size: 2\n")
    assert knobs(run_eval(tmp_path, yaml, "--model", tiny_llama_dir)) == (3, 2)
    overrides = ["eval.max_new_tokens=2", "eval.batch_size=1"]
    assert knobs(run_eval(tmp_path, yaml, *overrides, "--model", tiny_llama_dir)) == (2, 1)
    # A flag given on the command line wins over the YAML and the overrides.
    assert knobs(run_eval(tmp_path, yaml, "eval.batch_size=1", "--model", tiny_llama_dir, "--max-new-tokens", "1",
                          "--batch-size", "3")) == (1, 3)
    assert knobs(run_eval(tmp_path, yaml, "--model", tiny_llama_dir, "--batch-size", "auto")) == (3, "auto")


@pytest.mark.slow
def test_a_training_runs_config_and_the_defaults(tiny_llama_dir, eval_data, tmp_path, capsys, monkeypatch):
    # A training output folder: the model plus the run's config.yaml, whose eval.* settings eval adopts.
    run = tmp_path / "run"
    run.mkdir()
    for f in tiny_llama_dir.iterdir():
        (run / f.name).symlink_to(f)
    (run / "config.yaml").write_text("data:\n  template: plain\neval:\n  max_new_tokens: 4\n  batch_size: 1\n")
    data = [f"data.path={eval_data}", "data.fields={prompt: problem, answer: answer}"]
    assert knobs(run_eval(tmp_path, *data, "--model", run)) == (4, 1)
    assert "max_new_tokens 4" in capsys.readouterr().out
    assert knobs(run_eval(tmp_path, *data, "eval.max_new_tokens=2", "--model", run)) == (2, 1)
    assert knobs(run_eval(tmp_path, *data, "--model", run, "--max-new-tokens", "3")) == (3, 1)
    # Nothing set anywhere: the config's defaults (the tiny model is not a training run: no config.yaml). The
    # model's 256 tokens are spared: the back end answers at once, with the settings it was given on record.
    seen = []

    def answer_at_once(self, prompts, params):
        seen.append((self.batch_size, params.max_new_tokens))
        return [Completion("\\boxed{0}", 1, "eos") for _ in prompts]

    monkeypatch.setattr(TransformersBackend, "generate", answer_at_once)
    summary = run_eval(tmp_path, *data, "data.template=plain", "--model", tiny_llama_dir)
    assert knobs(summary) == (256, "auto") and seen == [("auto", 256)]


def test_eval_max_new_tokens_must_be_positive(capsys):
    assert main(["eval", "data.path=x.jsonl", "eval.max_new_tokens=0", "--model", "m"]) == 2
    assert "'eval.max_new_tokens' must be at least 1" in capsys.readouterr().err

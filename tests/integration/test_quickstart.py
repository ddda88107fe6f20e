"""`anyfit quickstart` end to end at the smallest size, on a tiny model given with --model (the packaged
SmolLM2 takes minutes here; the notebook run in CI covers it)."""

import json

import pytest

from anyfit.cli import main


@pytest.mark.slow
def test_quickstart_small_with_a_given_model_scores_trains_and_leaves_an_adapter(tiny_llama_dir, tmp_path, capsys):
    out = tmp_path / "qs"
    rc = main(["quickstart", "--model", str(tiny_llama_dir), "--output-dir", str(out), "--eval-problems", "2",
               "--train-examples", "16", "train.max_steps=2", "train.log_every=1"])
    assert rc == 0
    printed = capsys.readouterr().out
    assert f"model: {tiny_llama_dir}" in printed
    assert "accuracy on 2 held-out problems" in printed and "16 synthetic training problems" in printed
    assert (out / "adapter_config.json").is_file()
    assert len((out / "data" / "heldout.jsonl").read_text().splitlines()) == 2
    info = json.loads((out / "run_info.json").read_text())
    assert info["steps"] == 2, info

"""Shipped configs by name: `anyfit train NAME` without a file, `anyfit configs` to list, print and locate them."""

import pytest
import yaml

from anyfit import configs
from anyfit.cli import main
from anyfit.config import ConfigError, config_file, load_config


def test_every_shipped_config_is_listed_with_what_it_is_for(capsys):
    assert main(["configs"]) == 0
    out = capsys.readouterr().out
    names = configs.shipped()
    assert {"smollm2-lora-chat", "qwen2.5-math-1.5b-math-r1zero", "qwen2.5-0.5b-gsm8k-qlora"} <= set(names)
    for name, path in names.items():
        line = next(line for line in out.splitlines() if line.startswith(name + " "))
        assert configs.summary(path) in line and configs.summary(path)


def test_a_bare_name_loads_the_shipped_file_with_or_without_the_suffix():
    for name in ("smollm2-lora-chat", "smollm2-lora-chat.yaml"):
        assert config_file(name) == configs.FOLDER / "smollm2-lora-chat.yaml"
    cfg = load_config("smollm2-lora-chat", ["train.max_steps=3"])
    assert cfg.model.name_or_path == "HuggingFaceTB/SmolLM2-135M-Instruct" and cfg.train.max_steps == 3


def test_a_local_file_of_that_name_wins(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "smollm2-lora-chat.yaml").write_text("train:\n  max_steps: 7\n")
    assert load_config("smollm2-lora-chat.yaml").train.max_steps == 7


def test_a_missing_path_is_never_taken_for_a_name(tmp_path):
    with pytest.raises(ConfigError, match="does not exist.*smollm2-lora-chat.*anyfit configs NAME"):
        config_file(tmp_path / "smollm2-lora-chat.yaml")


def test_configs_name_prints_a_copy_that_loads_and_path_locates_it(tmp_path, capsys):
    assert main(["configs", "qwen2.5-math-1.5b-math-r1zero"]) == 0
    copy = tmp_path / "mine.yaml"
    copy.write_text(capsys.readouterr().out)
    assert yaml.safe_load(copy.read_text()) == yaml.safe_load(configs.find("qwen2.5-math-1.5b-math-r1zero").read_text())
    assert load_config(copy) == load_config("qwen2.5-math-1.5b-math-r1zero")
    assert main(["configs", "--path", "smollm2-lora-chat"]) == 0
    assert capsys.readouterr().out.strip() == str(configs.FOLDER / "smollm2-lora-chat.yaml")


def test_an_unknown_name_is_a_one_line_error(capsys):
    assert main(["configs", "nope"]) == 2
    assert "No shipped config is called 'nope'" in capsys.readouterr().err

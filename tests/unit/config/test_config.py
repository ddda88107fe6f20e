from pathlib import Path

import pytest

from anyfit.cli import main
from anyfit.config import Config, ConfigError, help_text, load_config
from anyfit.configs import shipped

ROOT = Path(__file__).resolve().parents[3]


def test_every_shipped_config_loads():
    names = [name for name in shipped() if not name.startswith("accelerate/")]
    assert len(names) >= 3, names
    for name in names:
        cfg = load_config(name)
        assert cfg.model.name_or_path and cfg.data.path, name


def test_overrides_are_typed():
    cfg = load_config(None, ["train.learning_rate=1e-4", "lora.enabled=true", "train.micro_batch=2",
                             "lora.target_modules=[q_proj, v_proj]", "data.fields={prompt: problem}"])
    assert cfg.train.learning_rate == 1e-4 and cfg.lora.enabled and cfg.train.micro_batch == 2
    assert cfg.lora.target_modules == ["q_proj", "v_proj"] and cfg.data.fields == {"prompt": "problem"}


def test_unknown_key_in_file_names_file_line_and_suggestion(tmp_path):
    p = tmp_path / "c.yaml"
    p.write_text("model:\n  name_or_path: x\ntrain:\n  learnign_rate: 0.1\n")
    with pytest.raises(ConfigError) as e:
        load_config(p)
    msg = str(e.value)
    assert f"{p}:4" in msg and "train.learnign_rate" in msg and "Did you mean 'train.learning_rate'" in msg


def test_key_under_wrong_section_is_suggested():
    with pytest.raises(ConfigError, match="Did you mean 'train.lr_schedule'"):
        load_config(None, ["lr_schedule=cosine"])


@pytest.mark.parametrize("override,needle", [
    ("train.micro_batch=abc", "expected an integer"),
    ("runtime.precision=fp8", "use one of auto, fp32, bf16, fp16"),
    ("lora.enabled=maybe", "expected true or false"),
    ("train.learning_rate=-1", "must be positive"),
    ("train.effective_batch=0", "at least 1"),
    ("nonsense", "key=value"),
    ("model.train_vision=lora", "model.train_vision=lora .* needs lora.enabled=true"),
    ("model.train_vision=half", "use one of frozen, lora, full"),
])
def test_bad_values_name_the_key(override, needle):
    with pytest.raises(ConfigError, match=needle):
        load_config(None, [override])


@pytest.mark.parametrize("overrides", [["model.train_vision=full"], ["model.train_projector=true"]])
def test_qlora_refuses_to_train_4bit_vision_weights_whole(overrides):
    with pytest.raises(ConfigError, match="lora.qlora loads the vision tower and projector in 4-bit") as e:
        load_config(None, ["lora.qlora=true", *overrides])
    assert "\n" not in str(e.value)


def test_resolved_config_round_trips(tmp_path):
    cfg = load_config(None, ["model.name_or_path=m", "data.path=d.jsonl", "train.learning_rate=3e-4"])
    p = tmp_path / "resolved.yaml"
    p.write_text(cfg.to_yaml())
    assert load_config(p) == cfg


def test_help_lists_every_field_with_its_doc():
    text = help_text()
    assert "train.effective_batch" in text and "Sequences per optimizer step" in text
    assert text.count(", default ") == sum(len(vars(s)) for s in vars(Config()).values())


def test_cli_reports_bad_key_without_traceback(capsys):
    assert main(["train", "train.learing_rate=1"]) == 2
    err = capsys.readouterr().err
    assert "Did you mean 'train.learning_rate'" in err and "Traceback" not in err


def test_readme_config_reference_is_current():
    """README's tables are generated from the dataclasses: run scripts/update_readme.py after changing a field."""
    from anyfit.config import reference_markdown

    readme = (ROOT / "README.md").read_text()
    section = readme.split("<!-- config-reference:start -->\n", 1)[1].split("<!-- config-reference:end -->", 1)[0]
    assert section == reference_markdown(), "run: uv run python scripts/update_readme.py"


def test_layers_run_config_then_file_then_overrides(tmp_path):
    """eval/generate of a training output: the run's config.yaml is the base, the file and overrides win."""
    run = tmp_path / "run"
    run.mkdir()
    trained = load_config(None, ["data.template=plain", "data.system_prompt=Be brief.", "data.path=train.jsonl",
                                 "train.learning_rate=3e-4"])
    (run / "config.yaml").write_text(trained.to_yaml())
    user = tmp_path / "eval.yaml"
    user.write_text("data:\n  path: test.jsonl\n")
    lines = []
    cfg = load_config(user, ["data.system_prompt=Think."], base=run / "config.yaml", echo=lines.append)
    assert (cfg.data.template, cfg.data.path, cfg.data.system_prompt) == ("plain", "test.jsonl", "Think.")
    assert cfg.train.learning_rate == 3e-4  # inherited
    assert len(lines) == 1 and "data.path, data.system_prompt" in lines[0] and "data.template" not in lines[0]
    from anyfit.config import set_by_user
    from anyfit.runfolder import run_config_path

    assert run_config_path(run) == run / "config.yaml" and run_config_path(tmp_path) is None
    assert set_by_user(user, [], "data.path") and set_by_user(None, ["data.split=test"], "data.split")
    assert not set_by_user(user, [], "data.template")


def test_eval_of_a_run_without_data_refuses_the_training_data(tiny_llama_dir, tmp_path, capsys):
    run = tmp_path / "run"
    run.mkdir()
    (run / "config.yaml").write_text(load_config(None, ["data.path=train.jsonl"]).to_yaml())
    assert main(["eval", "--model", str(run)]) == 2
    err = capsys.readouterr().err
    assert "was trained on train.jsonl" in err and "data.path=" in err


@pytest.mark.parametrize("item,ours", [
    ("per_device_train_batch_size=4", "train.micro_batch"), ("train.gradient_accumulation_steps=8", "train.effective_batch"),
    ("num_train_epochs=3", "train.epochs"), ("micro_batch_size=2", "train.micro_batch"),
    ("sequence_len=2048", "data.max_length"), ("lr_scheduler_type=cosine", "train.lr_schedule"),
    ("train_on_inputs=false", "data.train_on"), ("bf16=true", "runtime.precision")])
def test_trl_and_axolotl_keys_are_answered_with_anyfits_key(item, ours):
    with pytest.raises(ConfigError) as e:
        load_config(None, [item])
    message = str(e.value)
    assert f"anyfit's key is {ours}" in message and "Did you mean" not in message
    if "accumulation" in item:
        assert "derives accumulation" in message


def test_every_foreign_key_points_at_a_real_key():
    from anyfit.config import all_keys
    from anyfit.config.keys import FOREIGN_KEYS

    assert {ours for ours, _ in FOREIGN_KEYS.values()} <= set(all_keys())

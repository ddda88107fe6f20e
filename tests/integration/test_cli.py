import json

from anyfit.cli import main


def test_env_prints_versions_memory_and_policy(capsys):
    assert main(["env"]) == 0
    out = capsys.readouterr().out
    assert "torch:" in out and "host memory" in out and "device=cpu precision=fp32" in out
    assert "planner rates (cpu|fp32|" in out and "best kept; --recalibrate measures again" in out  # the cached ones


def test_env_recalibrate_measures_the_rates_again(capsys, monkeypatch):
    from anyfit.hardware import calibration
    from anyfit.hardware.calibration import MachineRates, known_rates, machine_key

    before = known_rates()
    measured = MachineRates(machine_key("cpu", "fp32"), {1024: 0.123}, {1 << 26: 9.0}, 7e-6, {16: 0.01})
    monkeypatch.setattr(calibration, "measure_rates", lambda device, dtype: measured)
    try:
        assert main(["env", "--recalibrate"]) == 0
        assert "measured now" in capsys.readouterr().out
        assert known_rates() == measured  # the new measurement alone, not the best of it and the old
    finally:
        calibration.record_rates(before, keep_best=False)


def test_render_shows_what_is_trained(tiny_llama_dir, tmp_path, capsys):
    data = tmp_path / "d.jsonl"
    data.write_text(json.dumps({"problem": "What is 2+2?", "solution": "It is \\boxed{4}."}) + "\n")
    rc = main(["render", f"model.name_or_path={tiny_llama_dir}", f"data.path={data}",
               "data.fields={prompt: problem, completion: solution}", "--no-color"])
    assert rc == 0
    out = capsys.readouterr().out
    assert "⟦" in out and "\\boxed{4}" in out.split("⟦", 1)[1]  # the solution is inside the trained span
    assert "What is 2+2?" in out.split("⟦", 1)[0]  # the prompt is not
    assert "whole dataset: Loaded 1 records" in out


def test_missing_field_is_a_clear_error(tiny_llama_dir, tmp_path, capsys):
    data = tmp_path / "d.jsonl"
    data.write_text(json.dumps({"question": "q", "reply": "r"}) + "\n")
    rc = main(["train", f"model.name_or_path={tiny_llama_dir}", f"data.path={data}", f"train.output_dir={tmp_path / 'o'}"])
    err = capsys.readouterr().err
    assert rc == 2 and "question" in err and "reply" in err and "data.fields" in err
    assert not (tmp_path / "o").exists()  # nothing half-written


def test_overrides_may_follow_options(tiny_llama_dir, tmp_path, capsys):
    data = tmp_path / "d.jsonl"
    data.write_text(json.dumps({"prompt": "What is 2+2?", "completion": "4"}) + "\n")
    cfg = tmp_path / "c.yaml"
    cfg.write_text(f"model:\n  name_or_path: {tiny_llama_dir}\n")
    assert main(["render", str(cfg), "--no-color", f"data.path={data}", "--index", "0", "data.max_length=64"]) == 0
    assert "⟦" in capsys.readouterr().out


def test_an_unknown_option_is_still_refused(capsys):
    import pytest

    with pytest.raises(SystemExit) as exit_:
        main(["render", "--no-such-option", "data.path=x.jsonl"])
    assert exit_.value.code == 2 and "unrecognized arguments: --no-such-option" in capsys.readouterr().err

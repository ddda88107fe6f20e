"""Every kind of broken input to ``anyfit train`` is one line on stderr, exit code 2, naming the place to fix,
with no traceback and nothing written to the output folder.

Each case is the config file, the data file or the model a user could get wrong; ``main`` runs in this
process, so any exception other than anyfit's own errors fails the test with its traceback.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

from anyfit.cli import main

GOOD = [{"prompt": f"Say {w}", "completion": w} for w in ("red", "green", "blue", "gold", "pink", "gray", "navy", "cyan")]


def _jsonl(path: Path, records) -> Path:
    path.write_text("".join((r if isinstance(r, str) else json.dumps(r)) + "\n" for r in records))
    return path


def _case(name: str, tmp: Path, model: Path) -> tuple[list[str], str]:
    """(command-line arguments after 'train', a text the error must contain)."""
    data = _jsonl(tmp / "good.jsonl", GOOD)
    base = [f"model.name_or_path={model}", f"data.path={data}", "train.effective_batch=4", "train.micro_batch=2",
            "train.max_steps=1", "data.template=plain"]

    def with_config(text: str) -> list[str]:
        path = tmp / f"c{len(list(tmp.glob('c*.yaml')))}.yaml"
        path.write_text(text)
        return [str(path)]

    def with_data(path: Path, *extra: str) -> list[str]:
        return [*[a for a in base if not a.startswith("data.path=")], f"data.path={path}", *extra]

    def raw(name: str, content: bytes) -> Path:
        (tmp / name).write_bytes(content)
        return tmp / name

    def broken_model(name: str, weights: bytes | None = None, index: dict | None = None) -> list[str]:
        """The tiny model's folder with its weights left out, cut short, or named by an index that lies."""
        folder = tmp / name
        shutil.copytree(model, folder, ignore=shutil.ignore_patterns("*.safetensors"))
        if weights is not None:
            (folder / "model.safetensors").write_bytes(weights)
        if index is not None:
            (folder / "model.safetensors.index.json").write_text(json.dumps(index))
        return [*base[1:], f"model.name_or_path={folder}"]

    whole = (model / "model.safetensors").read_bytes()

    cases = {
        # the config file and the overrides
        "config_missing": ([str(tmp / "nope.yaml")], "nope.yaml"),
        "config_not_yaml": (with_config("model: {name_or_path: x\n"), "c0.yaml"),
        "config_a_list": (with_config("- model\n- data\n"), "c1.yaml"),
        "config_typo_key": (with_config(f"model: {{name_or_path: {model}}}\ntrain:\n  learnign_rate: 0.1\n"),
                            "learning_rate"),
        "config_section_not_mapping": (with_config("train: 5\n"), "train"),
        "config_wrong_type": (base + ["train.learning_rate=fast"], "train.learning_rate"),
        "config_bad_choice": (base + ["runtime.precision=fp8"], "runtime.precision"),
        "config_zero_batch": (base + ["train.effective_batch=0"], "train.effective_batch"),
        "config_micro_not_dividing": (base + ["train.effective_batch=6", "train.micro_batch=4"], "train.micro_batch"),
        "override_without_equals": (base + ["train.learning_rate"], "key=value"),
        "fp16_on_cpu": (base + ["runtime.device=cpu", "runtime.precision=fp16"], "runtime.precision"),
        "qlora_sharded": (base + ["lora.qlora=true", "runtime.sharding=fsdp"], "lora.qlora"),
        # the data
        "data_missing": (with_data(tmp / "absent.jsonl"), "absent.jsonl"),
        "data_empty": (with_data(raw("empty.jsonl", b"")), "empty.jsonl"),
        "data_not_utf8": (with_data(raw("latin1.jsonl", json.dumps(GOOD[0]).encode() + b"\n"
                                        + '{"prompt": "caf\xe9", "completion": "x"}\n'.encode("latin-1"))),
                          "latin1.jsonl:2"),
        "data_bad_json_line": (with_data(_jsonl(tmp / "bad.jsonl", [*GOOD[:3], '{"prompt": "x", ', *GOOD[3:]])),
                               "bad.jsonl:4"),
        "data_line_not_object": (with_data(_jsonl(tmp / "num.jsonl", [*GOOD[:2], "42", *GOOD[2:]])), "num.jsonl:3"),
        "data_missing_completion": (with_data(_jsonl(tmp / "nocomp.jsonl", [{"prompt": "a"}] * 8)), "completion"),
        "data_completion_not_text": (with_data(_jsonl(tmp / "dict.jsonl", [{"prompt": "a", "completion": {"x": 1}}] * 8)),
                                     "completion"),
        "data_unknown_role": (with_data(_jsonl(tmp / "robot.jsonl", [{"messages": [
            {"role": "user", "content": "hi"}, {"role": "robot", "content": "beep"}]}] * 8), "data.template=chat"),
            "robot"),
        "data_messages_not_list": (with_data(_jsonl(tmp / "msgs.jsonl", [{"messages": "hello"}] * 8),
                                             "data.template=chat"), "messages"),
        "data_is_a_directory": (with_data(tmp), str(tmp)),
        "data_fake_parquet": (with_data(raw("fake.parquet", b"this is not parquet")), "fake.parquet"),
        "data_all_too_long": (with_data(data, "data.max_length=3", "data.overlong=drop"), "data.max_length"),
        "data_unknown_template": (with_data(data, "data.template=chatml"), "data.template"),
        "data_field_map_to_missing_column": (with_data(data, "data.fields={prompt: question}"), "question"),
        "data_fewer_than_a_batch": (with_data(data, "train.effective_batch=16", "train.micro_batch=4"),
                                    "train.effective_batch"),
        # every completion empty: only the EOS would be trained
        "data_only_stops": (with_data(_jsonl(tmp / "stops.jsonl", [{**r, "completion": ""} for r in GOOD])),
                            "data.allow_stop_only=true"),
        # the model
        "model_folder_missing": ([*base[1:], f"model.name_or_path={tmp / 'no_model'}"], "no_model"),
        "model_folder_without_config": ([*base[1:], f"model.name_or_path={tmp}"], str(tmp)),
        "model_gguf_missing": ([*base[1:], f"model.name_or_path={tmp / 'm.gguf'}"], "m.gguf"),
        "model_lora_target_typo": (base + ["lora.enabled=true", "lora.target_modules=[q_porj]"], "q_porj"),
        "model_without_weights": (broken_model("noweights"), "noweights has config.json but no weights"),
        "model_weights_cut_short": (broken_model("cut", weights=whole[: len(whole) // 2]),
                                    "cut/model.safetensors is damaged (incomplete metadata"),
        "model_weights_not_safetensors": (broken_model("html", weights=b"<html>Bad gateway</html>"),
                                          "html/model.safetensors is damaged"),
        "model_index_names_a_missing_shard": (
            broken_model("sharded", index={"weight_map": {"lm_head.weight": "model-00002-of-00002.safetensors"}}),
            "model-00002-of-00002.safetensors"),
        "model_unknown_hub_id": ([*base[1:], "model.name_or_path=nobody-here/no-such-model"], "nobody-here/no-such-model"),
        # the run folder and resuming
        "resume_not_a_checkpoint": (base + [f"train.resume={tmp / 'checkpoint-9'}"], "checkpoint-9"),
    }
    return cases[name]


CASES = ["config_missing", "config_not_yaml", "config_a_list", "config_typo_key", "config_section_not_mapping",
         "config_wrong_type", "config_bad_choice", "config_zero_batch", "config_micro_not_dividing",
         "override_without_equals", "fp16_on_cpu", "qlora_sharded", "data_missing", "data_empty", "data_not_utf8",
         "data_bad_json_line", "data_line_not_object", "data_missing_completion", "data_completion_not_text",
         "data_unknown_role", "data_messages_not_list", "data_is_a_directory", "data_fake_parquet",
         "data_all_too_long", "data_unknown_template", "data_field_map_to_missing_column", "data_fewer_than_a_batch",
         "data_only_stops",
         "model_folder_missing", "model_folder_without_config", "model_gguf_missing", "model_lora_target_typo",
         "model_without_weights", "model_weights_cut_short", "model_weights_not_safetensors",
         "model_index_names_a_missing_shard", "model_unknown_hub_id",
         "resume_not_a_checkpoint"]


@pytest.mark.slow
@pytest.mark.parametrize("name", CASES)
def test_broken_input_is_one_clear_line(name, tiny_llama_dir, tmp_path, capsys, monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")  # as on this machine: no hub, and no 30 s of retries either
    inputs = tmp_path / "in"
    inputs.mkdir()
    args, place = _case(name, inputs, tiny_llama_dir)
    out = tmp_path / "out"
    rc = main(["train", *args, f"train.output_dir={out}"])
    captured = capsys.readouterr()
    err = captured.err.strip()
    assert rc == 2, err
    assert "Traceback" not in err, err
    # the error is the last line, and one line (progress bars of loading may come before it)
    line = err.splitlines()[-1]
    assert line.startswith("anyfit: error: ") and err.count("anyfit: error") == 1, err
    assert place in line, (place, line)
    assert not out.exists()  # nothing written, nothing half-written
    if name.startswith(("model_without", "model_weights", "model_index")):  # found before any data work
        assert "[anyfit] data:" not in captured.out


def test_a_folder_holding_a_run_is_left_alone(tiny_llama_dir, tmp_path, capsys):
    out = tmp_path / "out"
    out.mkdir()
    (out / "metrics.jsonl").write_text('{"step": 1, "loss": 1.0}\n')
    (out / "config.yaml").write_text("train: {}\n")
    before = {p.name: p.read_bytes() for p in out.iterdir()}
    data = _jsonl(tmp_path / "d.jsonl", GOOD)
    rc = main(["train", f"model.name_or_path={tiny_llama_dir}", f"data.path={data}", f"train.output_dir={out}"])
    err = capsys.readouterr().err.strip()
    assert rc == 2 and "already holds a run" in err and str(out) in err and "\n" not in err
    assert {p.name: p.read_bytes() for p in out.iterdir()} == before
    shutil.rmtree(out)

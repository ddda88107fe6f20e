"""The trackers ``train.report_to`` offers besides tensorboard (test_watching.py) get the run's metrics lines and
config for real, offline: wandb in offline mode, mlflow with a local store, trackio with its local database.
Each is read back with the tracker's own reader and compared with the run's metrics.jsonl."""

from __future__ import annotations

import json
import os
import pty
import select
import subprocess
import sys
import time

import pytest
from tiny_runs import ENV, HANG_S, config_for, read_metrics, write_dataset

from anyfit.training.loop import train


def _tiny_run(model_dir, tmp_path, tracker: str) -> tuple[list[dict], dict]:
    """Four logged steps and two validation losses (steps 2 and 4), sent to ``tracker``; the metrics lines and the
    hyperparameters every tracker should hold (as flattened ``section.key`` names)."""
    data = write_dataset(tmp_path / "d.jsonl", n=20)
    train(config_for(model_dir, data, tmp_path / "run", "train.effective_batch=4", "train.micro_batch=2",
                     "train.max_steps=4", "train.learning_rate=3e-4", f"train.report_to={tracker}",
                     "eval.holdout=4", "eval.every=2"), echo=lambda *a: None)
    lines = read_metrics(tmp_path / "run")
    assert [r["step"] for r in lines if "loss" in r] == [1, 2, 3, 4]
    assert [r["step"] for r in lines if "val_loss" in r] == [2, 4]
    config = {"train.learning_rate": 3e-4, "train.max_steps": 4, "train.effective_batch": 4, "eval.every": 2,
              "model.name_or_path": str(model_dir), "train.report_to": tracker}
    return lines, config


def _series(lines: list[dict], key: str) -> list[tuple[int, float]]:
    return [(r["step"], r[key]) for r in lines if key in r]


def _numeric_keys(lines: list[dict]) -> set[str]:
    return {k for r in lines for k, v in r.items() if k != "step" and isinstance(v, (int, float))}


def _wandb_records(path):
    """The protobuf records of an offline run's ``.wandb`` file (a LevelDB-style log of 32 KiB blocks after a
    7-byte ``:W&B`` header; wandb no longer ships a Python reader, so the framing is read here and each record
    is parsed with wandb's own protobuf classes)."""
    from wandb.proto import wandb_internal_pb2

    data, block = path.read_bytes(), 32 * 1024
    assert data[:4] == b":W&B", data[:8]
    pos, pending = 7, b""
    while pos + 7 <= len(data):
        if block - pos % block < 7:  # too little room left in the block for a header: zero padding
            pos += block - pos % block
            continue
        length, kind = int.from_bytes(data[pos + 4:pos + 6], "little"), data[pos + 6]
        pending += data[pos + 7:pos + 7 + length]
        pos += 7 + length
        if kind in (1, 4):  # a FULL record, or the LAST chunk of one
            record = wandb_internal_pb2.Record()
            record.ParseFromString(pending)
            pending = b""
            yield record


@pytest.fixture
def wandb_offline(tmp_path, monkeypatch):
    """wandb in offline mode, everything it writes under tmp_path; the folder its runs go to. wandb reads its
    environment once per process (into a singleton), so the fixture tears that down again at the end."""
    wandb = pytest.importorskip("wandb", reason="the wandb tracker is not installed (dependency group 'trackers')")
    for var in [v for v in os.environ if v.startswith("WANDB_")]:
        monkeypatch.delenv(var)
    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.setenv("WANDB_SILENT", "true")
    for var, sub in (("WANDB_DIR", "wandb"), ("WANDB_CONFIG_DIR", "wandb_config"), ("WANDB_CACHE_DIR", "wandb_cache"),
                     ("WANDB_DATA_DIR", "wandb_data")):
        (tmp_path / sub).mkdir()
        monkeypatch.setenv(var, str(tmp_path / sub))
    wandb.teardown()
    yield tmp_path / "wandb"
    wandb.teardown()


@pytest.fixture
def mlflow_store(tmp_path, monkeypatch) -> str:
    """MLflow tracking into a file store under tmp_path; its URI."""
    pytest.importorskip("mlflow", reason="the mlflow tracker is not installed (dependency group 'trackers')")
    uri = (tmp_path / "mlruns").as_uri()
    for var in [v for v in os.environ if v.startswith("MLFLOW_")]:
        monkeypatch.delenv(var)
    monkeypatch.setenv("MLFLOW_TRACKING_URI", uri)
    # MLflow 3 keeps the file store only behind this switch (its default is a SQLite database, which needs
    # SQLAlchemy: not part of mlflow-skinny); the file store is what a run needs with no server and no database.
    monkeypatch.setenv("MLFLOW_ALLOW_FILE_STORE", "true")
    return uri


def _wandb_run(path) -> tuple[str, dict, dict, int | None]:
    """An offline run's project, history (key -> [(step, value)]), config and exit code, from its .wandb file."""
    history: dict[str, list[tuple[int, float]]] = {}
    logged_config, run_project, exit_code = {}, None, None
    for record in _wandb_records(path):
        kind = record.WhichOneof("record_type")
        if kind == "history":
            for item in record.history.item:
                key = item.key or "/".join(item.nested_key)
                history.setdefault(key, []).append((record.history.step.num, json.loads(item.value_json)))
        elif kind in ("run", "config"):
            updates = record.run.config.update if kind == "run" else record.config.update
            logged_config.update({u.key: json.loads(u.value_json) for u in updates})
            run_project = record.run.project if kind == "run" else run_project
        elif kind == "exit":
            exit_code = record.exit.exit_code
    return run_project, history, logged_config, exit_code


@pytest.mark.slow
def test_wandb_offline_run_holds_the_metrics_lines_and_config(tiny_qwen2_dir, tmp_path, wandb_offline):
    lines, config = _tiny_run(tiny_qwen2_dir, tmp_path, "wandb")
    files = list(wandb_offline.rglob("offline-run-*/run-*.wandb"))
    assert len(files) == 1, list(wandb_offline.rglob("*"))
    run_project, history, logged_config, exit_code = _wandb_run(files[0])
    assert history["loss"] == _series(lines, "loss")  # exact: wandb keeps the JSON numbers as sent
    assert history["val_loss"] == _series(lines, "val_loss")
    assert _numeric_keys(lines) <= set(history), _numeric_keys(lines) - set(history)
    assert {k: logged_config[k] for k in config} == config
    assert run_project == "run" and exit_code == 0  # the run is named after the output folder and was finished


@pytest.mark.slow
def test_mlflow_local_store_holds_the_metrics_lines_and_config(tiny_qwen2_dir, tmp_path, mlflow_store):
    from mlflow.tracking import MlflowClient

    lines, config = _tiny_run(tiny_qwen2_dir, tmp_path, "mlflow")
    client = MlflowClient(tracking_uri=mlflow_store)
    experiment = client.get_experiment_by_name("run")  # named after the output folder
    assert experiment is not None, [e.name for e in client.search_experiments()]
    (run,) = client.search_runs([experiment.experiment_id])
    assert run.info.status == "FINISHED"

    def history(key):
        return sorted((m.step, m.value) for m in client.get_metric_history(run.info.run_id, key))

    assert history("loss") == _series(lines, "loss")
    assert history("val_loss") == _series(lines, "val_loss")
    assert _numeric_keys(lines) <= set(run.data.metrics), _numeric_keys(lines) - set(run.data.metrics)
    assert {k: run.data.params[k] for k in config} == {k: str(v) for k, v in config.items()}  # MLflow keeps strings


def test_trackio_local_database_holds_the_metrics_lines_and_config(tiny_qwen2_dir, tmp_path, monkeypatch):
    if "trackio" in sys.modules:  # it reads TRACKIO_DIR once, on import
        pytest.fail("trackio was imported before this test could point TRACKIO_DIR at tmp_path")
    monkeypatch.setenv("TRACKIO_DIR", str(tmp_path / "trackio"))
    pytest.importorskip("trackio", reason="the trackio tracker is not installed (dependency group 'trackers')")
    from trackio.sqlite_storage import SQLiteStorage

    lines, config = _tiny_run(tiny_qwen2_dir, tmp_path, "trackio")
    assert SQLiteStorage.get_project_db_path("run").parent == tmp_path / "trackio"  # project = the output folder
    (run,) = SQLiteStorage.get_runs("run")
    logs = SQLiteStorage.get_logs("run", run)
    assert [(r["step"], r["loss"]) for r in logs if "loss" in r] == _series(lines, "loss")
    assert [(r["step"], r["val_loss"]) for r in logs if "val_loss" in r] == _series(lines, "val_loss")
    assert _numeric_keys(lines) <= {k for r in logs for k in r}
    logged_config = SQLiteStorage.get_run_config("run", run)
    assert {k: logged_config[k] for k in config} == config


@pytest.mark.slow
def test_wandb_without_login_or_offline_mode_fails_at_once_instead_of_asking(tiny_qwen2_dir, tmp_path):
    """At a terminal, wandb with no credentials and no WANDB_MODE asks for an API key and waits for an answer (once
    the model is loaded); anyfit says what to do in one line instead, before loading anything."""
    pytest.importorskip("wandb", reason="the wandb tracker is not installed (dependency group 'trackers')")
    env = {k: v for k, v in ENV.items() if not k.startswith("WANDB_")}
    env.update(HOME=str(tmp_path), NETRC=str(tmp_path / "no.netrc"), WANDB_DIR=str(tmp_path),
               WANDB_CONFIG_DIR=str(tmp_path / "wandb_config"))
    data = write_dataset(tmp_path / "d.jsonl", n=8)
    primary, secondary = pty.openpty()  # a terminal: where wandb would prompt
    proc = subprocess.Popen([sys.executable, "-m", "anyfit", "train", f"model.name_or_path={tiny_qwen2_dir}",
                             f"data.path={data}", "data.template=plain", f"train.output_dir={tmp_path / 'run'}",
                             "train.max_steps=2", "train.report_to=wandb"],
                            stdin=secondary, stdout=secondary, stderr=secondary, env=env, close_fds=True)
    os.close(secondary)
    shown, t0 = b"", time.time()
    try:
        while proc.poll() is None and time.time() - t0 < HANG_S:
            if select.select([primary], [], [], 0.2)[0]:
                try:
                    shown += os.read(primary, 65536)
                except OSError:  # the terminal closed with the process
                    break
        assert proc.wait(timeout=HANG_S) == 2, shown.decode(errors="replace")[-2000:]
    finally:
        if proc.poll() is None:
            proc.kill()
        os.close(primary)
    text = shown.decode(errors="replace")
    assert "wandb is not logged in" in text and "WANDB_MODE=offline" in text, text[-2000:]
    assert "Enter your choice" not in text and "[anyfit] model:" not in text  # no prompt; nothing was loaded


@pytest.mark.slow
def test_a_failed_run_closes_its_trackers_so_the_next_run_in_the_process_gets_its_own(tiny_qwen2_dir, tmp_path,
                                                                                    wandb_offline, mlflow_store):
    """Left open by a failure, wandb hands its run to the next ``wandb.init`` (the next run's metrics and config
    land in the failed one) and MLflow refuses to start a run: a notebook's second ``train`` would be wrong."""
    from mlflow.tracking import MlflowClient

    from anyfit.training.loss import token_loss_sum

    calls = []

    def fails_in_step_two(model, batch, **kw):
        calls.append(1)
        if len(calls) == 3:  # the first micro-batch of step 2, after step 1 was logged
            raise RuntimeError("boom")
        return token_loss_sum(model, batch, **kw)

    data = write_dataset(tmp_path / "d.jsonl", n=16)
    args = ("train.effective_batch=4", "train.micro_batch=2", "train.max_steps=3", "train.report_to=[wandb,mlflow]")
    with pytest.raises(RuntimeError, match="boom"):
        train(config_for(tiny_qwen2_dir, data, tmp_path / "first", *args), echo=lambda *a: None,
              loss_fn=fails_in_step_two)
    train(config_for(tiny_qwen2_dir, data, tmp_path / "second", *args), echo=lambda *a: None)

    client = MlflowClient(tracking_uri=mlflow_store)
    runs = {name: client.search_runs([client.get_experiment_by_name(name).experiment_id])
            for name in ("first", "second")}
    assert [r.info.status for r in runs["first"]] == ["FAILED"]
    assert [r.info.status for r in runs["second"]] == ["FINISHED"]
    assert [m.step for m in client.get_metric_history(runs["second"][0].info.run_id, "loss")] == [1, 2, 3]

    wandb_runs = {}
    for path in wandb_offline.rglob("offline-run-*/run-*.wandb"):
        project, history, config, exit_code = _wandb_run(path)
        wandb_runs[project] = ([s for s, _ in history["loss"]], config["train.output_dir"], exit_code)
    assert wandb_runs == {"first": ([1], str(tmp_path / "first"), 1),
                          "second": ([1, 2, 3], str(tmp_path / "second"), 0)}

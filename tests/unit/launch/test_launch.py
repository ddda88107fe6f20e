"""anyfit launch: the machine from the plan, the job spec (dry run) through huggingface_hub's own spec builder and
job types, faults in one line, and the Hub client driven against a local stand-in for the Jobs protocol."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
from pathlib import Path

import pytest
import yaml
from huggingface_hub import JobHardware
from huggingface_hub._jobs_api import _create_job_spec
from transformers import Qwen2Config

from anyfit.cli import main
from anyfit.config import ConfigError, load_config
from anyfit.launch.bundle import checkout_root
from anyfit.launch.choose import choose_machine
from anyfit.launch.machines import HF_JOBS, offer
from anyfit.planning.ladder import plan_target
from anyfit.planning.savers import config_overrides
from anyfit.model.shape import shape_from_config

SHAPE_1_5B = shape_from_config(Qwen2Config(hidden_size=1536, intermediate_size=8960, num_hidden_layers=28,
                                           num_attention_heads=12, num_key_value_heads=2, vocab_size=151936))


def cfg(*extra):
    return load_config(None, ["model.name_or_path=x", "data.path=d.jsonl", "train.effective_batch=8", *extra])


def test_every_flavor_is_one_of_huggingface_hubs():
    assert set(HF_JOBS) <= {h.value for h in JobHardware}
    assert all(m.target.price_per_hour > 0 and m.target.device == "cuda" for m in offer("hf-jobs") + offer("skypilot"))


def test_auto_takes_the_cheapest_machine_that_fits_at_the_plans_savers():
    full = cfg("data.num_samples=800")  # a 1.5B full fine-tune: 8-bit AdamW fits it on an L40S
    choice = choose_machine(full, SHAPE_1_5B, "hf-jobs")
    assert choice.steps == 100 and choice.cost is not None
    assert choice.machine.name == "l40sx1" and choice.applied == ("train.optimizer=adamw_8bit",)
    assert "applied: train.optimizer=adamw_8bit" in "\n".join(choice.lines())
    for m in offer("hf-jobs"):  # every other flavor is refused by the plan, or costs more over the whole run
        try:
            alone = choose_machine(full, SHAPE_1_5B, "hf-jobs", m.name)
        except ConfigError:
            continue
        assert alone.cost >= choice.cost and alone.plan.setup.method == "full"
    # the savers are what anyfit plan chooses on that machine, less what the run decides there itself
    plan = plan_target(full, SHAPE_1_5B, HF_JOBS["l40sx1"].target, micro_batch=4)
    assert plan.verdict == "fits with 8-bit AdamW" and set(choice.applied) <= set(config_overrides(plan.setup))
    lora = choose_machine(cfg("lora.enabled=true", "data.num_samples=800"), SHAPE_1_5B, "hf-jobs")
    assert "whole run (100 steps)" in "\n".join(lora.lines()) and lora.plan.setup.method == "lora"


def test_a_plan_that_changes_the_method_or_needs_more_gpus_is_not_taken():
    # a machine where a full fine-tune fits only as LoRA, or only with Adafactor: refused, naming the settings
    with pytest.raises(ConfigError, match=r"^--gpu t4-small: the config needs LoRA.* there \(add lora.enabled=true"):
        choose_machine(cfg(), SHAPE_1_5B, "hf-jobs", "t4-small")
    with pytest.raises(ConfigError, match=r"^--gpu l4x1: the config needs Adafactor.*train.optimizer=adafactor"):
        choose_machine(cfg(), SHAPE_1_5B, "hf-jobs", "l4x1")
    with pytest.raises(ConfigError, match="Did you mean 'a10g-small'"):
        choose_machine(cfg(), SHAPE_1_5B, "hf-jobs", "a10g-smal")
    # a named machine that fits with savers is taken with them: sharding over its own two GPUs
    two = choose_machine(cfg(), SHAPE_1_5B, "hf-jobs", "a10g-largex2")
    assert "runtime.sharding=fsdp" in two.applied and two.plan.setup.processes == 2
    assert choose_machine(cfg(), SHAPE_1_5B, "skypilot", "H100", 2).machine.name == "H100:2"


def test_the_runs_own_auto_settings_and_a_deepspeed_config_are_kept():
    sharded = choose_machine(cfg("runtime.sharding=deepspeed"), SHAPE_1_5B, "hf-jobs", "a10g-largex2")
    assert not any(a.startswith(("runtime.sharding", "runtime.fsdp_offload")) for a in sharded.applied)
    single = choose_machine(cfg(), SHAPE_1_5B, "hf-jobs", "a100-large")  # fits as it is: sharding stays auto
    assert single.applied == () and single.plan.verdict == "fits"


@pytest.fixture
def proj(tmp_path, tiny_llama_dir, monkeypatch):
    try:
        checkout_root()
    except ConfigError:  # the lower-bounds job installs anyfit as a wheel: launching builds one from a checkout
        pytest.skip("anyfit is installed from a wheel here, and anyfit launch builds its wheel from a checkout")
    p = tmp_path / "proj"
    shutil.copytree(tiny_llama_dir, p / "model")
    (p / "d.jsonl").write_text("".join(json.dumps({"prompt": f"q{i}", "completion": f"a{i}"}) + "\n" for i in range(8)))
    (p / "c.yaml").write_text("model: {name_or_path: model}\ndata: {path: d.jsonl, template: plain}\n"
                              "train: {max_steps: 10, report_to: wandb}\n")
    monkeypatch.chdir(p)
    monkeypatch.setenv("HF_TOKEN", "hf_secret_value_never_printed")
    monkeypatch.setenv("WANDB_API_KEY", "wandb_secret_value")
    return p


def test_dry_run_prints_the_spec_and_ships_only_names_of_secrets(proj, capsys):
    assert main(["launch", "c.yaml", "--on", "hf-jobs", "--name", "r1", "--store", "hf://me/r1", "--dry-run"]) == 0
    out = capsys.readouterr().out
    assert "flavor: t4-small" in out and "HF_TOKEN (set)" in out and "WANDB_API_KEY (set)" in out
    assert "command: bash /anyfit/launches/r1/job.sh" in out and "model.safetensors" in out and "d.jsonl" in out
    from anyfit.cache import cache_root  # the bundle is staged in the test's ANYFIT_CACHE

    launch = cache_root() / "launch" / "launches" / "r1"
    texts = "".join(p.read_text() for p in launch.iterdir())
    assert "secret_value" not in out + texts
    job_cfg = yaml.safe_load((launch / "config.yaml").read_text())
    assert job_cfg["train"]["output_dir"] == "run" and job_cfg["data"]["path"].startswith("files/")
    assert "anyfit[wandb] @ file://" in (launch / "job.sh").read_text()
    # the spec as huggingface_hub builds it for the Jobs API
    spec = _create_job_spec(image="ghcr.io/astral-sh/uv:python3.11-bookworm", command=["bash", "/anyfit/launches/r1/job.sh"],
                            env=None, secrets={"HF_TOKEN": "x"}, flavor="t4-small", timeout="40m")
    assert spec["flavor"] in {h.value for h in JobHardware} and spec["timeoutSeconds"] == 2400


def test_the_plans_savers_are_shipped_in_the_resolved_config(proj, capsys):
    # a 1.5B model's config alone (the planner reads nothing else): a full fine-tune fits an L40S with 8-bit AdamW
    Qwen2Config(hidden_size=1536, intermediate_size=8960, num_hidden_layers=28, num_attention_heads=12,
                num_key_value_heads=2, vocab_size=151936).save_pretrained(proj / "big")
    assert main(["launch", "c.yaml", "model.name_or_path=big", "train.effective_batch=8", "data.num_samples=800", "train.max_steps=0",
                 "--name", "r3", "--store", "hf://me/r3", "--dry-run"]) == 0
    out = capsys.readouterr().out
    assert "flavor: l40sx1" in out and "applied: train.optimizer=adamw_8bit (the plan's memory savers" in out
    from anyfit.cache import cache_root

    launch = cache_root() / "launch" / "launches" / "r3"
    assert yaml.safe_load((launch / "config.yaml").read_text())["train"]["optimizer"] == "adamw_8bit"
    assert "anyfit[wandb,cuda] @ file://" in (launch / "job.sh").read_text()  # bitsandbytes comes with the cuda extra


def test_skypilot_task(proj, capsys):
    assert main(["launch", "c.yaml", "--on", "skypilot", "--gpu", "L4", "--name", "r2", "--store", "s3://b/r2",
                 "--dry-run"]) == 0
    from anyfit.cache import cache_root

    task = yaml.safe_load((cache_root() / "launch" / "launches" / "r2" / "task.yaml").read_text())
    assert task["resources"]["accelerators"] == "L4:1" and task["run"] == "bash /anyfit/launches/r2/job.sh"
    assert task["file_mounts"]["/anyfit-store"] == {"source": "s3://b/r2", "mode": "MOUNT"}
    assert task["secrets"] == {"HF_TOKEN": None, "WANDB_API_KEY": None}
    launch = json.loads((cache_root() / "launch" / "launches" / "r2" / "launch.json").read_text())
    assert launch["store"] == "/anyfit-store"


@pytest.mark.parametrize("argv, said", [
    (["c.yaml", "train.lr=1"], "'train.lr' is not a known key"),
    (["c.yaml", "data.path=/etc/hostname"], "is outside the config's folder"),
    (["c.yaml", "--gpu", "h100"], "not a machine of hf-jobs"),
])
def test_faults_are_one_line_before_anything_is_built(proj, capsys, argv, said):
    assert main(["launch", *argv, "--dry-run"]) == 2
    err = capsys.readouterr().err
    assert said in err and err.count("\n") == 1 and "Traceback" not in err


def test_jobs_through_the_real_client_against_a_stand_in(hub, tmp_path, capsys):
    import inspect

    from huggingface_hub import HfApi

    from anyfit.launch import launcher

    restarts = "attempts" in inspect.signature(HfApi.run_job).parameters  # not in huggingface_hub's floor
    record = {"run": "r", "provider": "hf-jobs", "namespace": None, "repo": "me/anyfit-launches",
              "command": ["bash", "/anyfit/launches/r/job.sh"], "store": str(tmp_path / "store"),
              "flavor": "l40sx1", "price_per_hour": 1.8, "timeout": "1h", "retries": 2 if restarts else 0,
              "secrets": ["HF_TOKEN"], "jobs": []}
    launcher.start_hf(record, {"HF_TOKEN": "hf_test"})
    sent = hub.jobs["job0"]
    assert sent["flavor"] == "l40sx1" and sent["secrets"] == {"HF_TOKEN": "hf_test"}
    assert sent.get("attempts") == (3 if restarts else None)
    assert sent["volumes"][0]["mountPath"] == "/anyfit" and sent["labels"]["anyfit-run"] == "r"
    assert main(["jobs", "status", "r"]) == 0
    assert "COMPLETED on l40sx1, 1 job(s); cost so far $1.80" in capsys.readouterr().out
    # from another machine: the record is read back from the namespace's launch repo (names of secrets only)
    on_hub = hub.files("me/anyfit-launches", "dataset")["launches/r/record.json"]
    assert json.loads(on_hub)["jobs"][0]["id"] == "job0" and b"hf_test" not in on_hub
    launcher.record_path("r").unlink()
    assert main(["launch", "--resume", "r", "--detach"]) == 0 and hub.jobs["job1"]["flavor"] == "l40sx1"
    launcher.record_path("r").unlink()
    assert main(["jobs", "status", "r"]) == 0
    assert "COMPLETED on l40sx1, 2 job(s); cost so far $3.60" in capsys.readouterr().out
    assert main(["jobs", "status", "nope"]) == 2
    err = capsys.readouterr().err
    assert "No launch named nope on this machine or in me/anyfit-launches" in err and err.count("\n") == 1
    assert main(["jobs", "logs", "r"]) == 0 and "train: done" in capsys.readouterr().out
    assert main(["jobs", "cancel", "r"]) == 0 and hub.jobs["job1"]["stage"] == "CANCELED"  # the last job
    record["flavor"] = "h200x8"
    with pytest.raises(ConfigError, match="this account cannot use flavor h200x8"):
        launcher.start_hf(record, {"HF_TOKEN": "hf_test"})


def fake_sky(tmp_path, monkeypatch) -> Path:
    """A ``sky`` on PATH that writes down its arguments and the secret it was given (SkyPilot is not installed in
    the test environment: it runs from its own, see anyfit.launch.skypilot)."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    calls = tmp_path / "sky-calls.txt"
    (bin_dir / "sky").write_text(f'#!/bin/sh\necho "$* | HF_TOKEN=$HF_TOKEN" >> {calls}\n')
    (bin_dir / "sky").chmod(0o755)
    monkeypatch.setenv("PATH", f"{bin_dir}:{os.environ['PATH']}")
    return calls


def test_a_skypilot_launch_is_found_and_resumed_from_its_record(hub, tmp_path, capsys, monkeypatch):
    from anyfit.launch import launcher

    task = tmp_path / "task.yaml"
    task.write_text("name: s\n")
    record = {"run": "s", "provider": "skypilot", "namespace": "me", "repo": "me/anyfit-launches", "task": str(task),
              "store": "hf://me/s", "machine": "L4:1", "nodes": 1, "price_per_hour": 0.7, "secrets": ["HF_TOKEN"],
              "jobs": []}
    monkeypatch.setenv("PATH", str(tmp_path / "nowhere"))
    with pytest.raises(ConfigError, match=r"^SkyPilot is not installed: `uv tool install skypilot`"):
        launcher.start_sky(record, {"HF_TOKEN": "hf_test"}, detach=True)
    calls = fake_sky(tmp_path, monkeypatch)
    launcher.start_sky(record, {"HF_TOKEN": "hf_test"}, detach=True)
    launcher.record_path("s").unlink()  # another machine: the record comes from the Hub
    assert main(["launch", "--resume", "s", "--detach"]) == 0
    assert len(launcher.load_record("s")["jobs"]) == 2
    said = calls.read_text().splitlines()
    assert said == [f"launch -y --down -c s --secret HF_TOKEN --detach-run {task} | HF_TOKEN=hf_test"] * 2
    assert main(["jobs", "status", "s"]) == 0 and main(["jobs", "logs", "s"]) == 0 and main(["jobs", "cancel", "s"]) == 0
    assert calls.read_text().splitlines()[2:] == ["status s | HF_TOKEN=hf_test", "logs s --no-follow | HF_TOKEN=hf_test",
                                                  "down -y s | HF_TOKEN=hf_test"]
    assert "s: on SkyPilot, L4:1 x 1 node(s), 2 launch(es)" in capsys.readouterr().out
    task.unlink()  # where the bundle is not: refused in one line
    assert main(["launch", "--resume", "s"]) == 2
    assert "its SkyPilot task and bundle are on the machine that launched it" in capsys.readouterr().err


@pytest.mark.skipif(shutil.which("sky") is None, reason="SkyPilot is not installed (uv tool install skypilot)")
def test_the_task_passes_skypilots_own_parser(proj, capsys):
    assert main(["launch", "c.yaml", "--on", "skypilot", "--gpu", "A100-80GB", "--gpus", "2", "--nodes", "2",
                 "--name", "r4", "--store", "s3://b/r4", "--dry-run"]) == 0
    from anyfit.cache import cache_root

    task = cache_root() / "launch" / "launches" / "r4" / "task.yaml"
    python = Path(shutil.which("sky")).read_text().splitlines()[0].removeprefix("#!")  # sky's own environment
    # as `sky launch --secret HF_TOKEN --secret WANDB_API_KEY task.yaml` reads it: the secrets' values from the
    # command's environment (stand-ins here), the names from the file
    check = ("import sys, sky, yaml; sky.Task.from_yaml(sys.argv[1]); "
             "t = sky.Task.from_yaml_config(yaml.safe_load(open(sys.argv[1])), "
             "secrets_overrides=[('HF_TOKEN', 'x'), ('WANDB_API_KEY', 'y')]); r = list(t.resources)[0]; "
             "print(t.num_nodes, r.accelerators, sorted(t.secrets), sorted(t.file_mounts or {}), "
             "sorted(t.storage_mounts or {}))")
    out = subprocess.run([python, "-c", check, str(task)], capture_output=True, text=True, check=True).stdout
    assert out.split("\n")[-2] == ("2 {'A100-80GB': 2} ['HF_TOKEN', 'WANDB_API_KEY'] ['/anyfit'] "
                                    "['/anyfit-store']"), out

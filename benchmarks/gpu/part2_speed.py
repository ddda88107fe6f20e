"""Part 2: speed against TRL on the H100 workload of benchmarks/speed_vs_trl.py, plus the PyTorch profiler's top
kernels of anyfit's default run.

    python benchmarks/gpu/part2_speed.py --out DIR [--dry-run] [--budget SECONDS] [--tuned "key=value ..."]

The workload, the runs and the measurement are speed_vs_trl.py's own (imported, not copied): a random-init
Qwen2.5-0.5B-shaped model, 4000 log-normal token sequences (the same token ids for both frameworks), batch 8,
30 steps, bf16; real tokens/s over the steps after the warm-up, MFU by 6N + attention against a measured bf16
matmul, CUDA peak memory, the last loss. Runs, most important first, each in its own process (a run that would
start past the budget is recorded as skipped):

1. ``anyfit`` (defaults), ``trl-default``, ``trl-tuned`` (packing + padding-free + Liger, what the H100 anchor's
   32.1k tokens/s measured);
2. ``profile``: anyfit's default run again, 12 steps, under ``torch.profiler`` (steps 8-11 recorded, through a
   global optimizer-step hook, the run started as ``python -m anyfit train`` in the same process);
3. ``anyfit-tuned`` (defaults + ``--tuned``, by default ``runtime.compile=true``: the one speed switch that is
   off by default; after the profile, so a slow compilation cannot cost it);
4. if time is left: ``anyfit-20-per-step`` (anyfit's defaults at about TRL tuned's tokens per step: the same work per
   step), ``anyfit-plain-ce``, ``anyfit-no-packing``, ``anyfit-sdpa-mask`` (what each default buys).

``--only A,B`` runs those alone (a later occasion's rest of the part).

Writes results.json (speed_vs_trl's rows plus the anchors), speed.md (its table), profile_top_kernels.txt (the
profiler's table) and runs.log (every child's output).
"""

from __future__ import annotations

import argparse
import json
import runpy
import shutil
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import kit

sys.path.insert(0, str(kit.REPO / "benchmarks"))
import speed_vs_trl as svt  # noqa: E402  (the workload and runs are speed_vs_trl.py's)

TUNED = "runtime.compile=true"
FIRST = ["anyfit", "trl-default", "trl-tuned", "profile", "anyfit-tuned"]
IF_TIME = ["anyfit-20-per-step", "anyfit-plain-ce", "anyfit-no-packing", "anyfit-sdpa-mask"]
ANCHORS = "the H100 anchor (shared/anchors/h100-results.json, transformers 5.17, trl 1.16): TRL defaults 6,080 " \
          "tokens/s, TRL tuned (packing + Liger) 32,102, a bare PyTorch loop 58,682; goal for anyfit's defaults: " \
          ">= 80,000 tokens/s (30% MFU by 6N), <= 40 GiB, >= 2.5x TRL tuned"
PROFILE_STEPS = dict(wait=5, warmup=2, active=4)
DRY_PROFILE_STEPS = dict(wait=0, warmup=1, active=1)


class TimedSubprocess:
    """``subprocess`` for speed_vs_trl.run_child, whose children have no time limit of their own: the part's budget
    applies (a child past it is killed and reads as exit code 124, with its log's tail as the error)."""

    def __init__(self, seconds: float):
        self.seconds = max(1.0, seconds)

    def __getattr__(self, name: str):
        return getattr(subprocess, name)

    def run(self, *args, **kwargs):
        try:
            return subprocess.run(*args, timeout=self.seconds, **kwargs)
        except subprocess.TimeoutExpired as e:
            return subprocess.CompletedProcess(e.cmd, 124)


def workload_args(args) -> argparse.Namespace:
    """The namespace speed_vs_trl's functions read (its own command line's fields)."""
    return argparse.Namespace(workload="gpu", tiny=args.dry_run, steps=2 if args.dry_run else None,
                              warmup=1 if args.dry_run else 3, examples=40 if args.dry_run else None, seed=0,
                              only="", keep_work=False, child=None)


def spec_for(name: str, wl, wargs, work: Path, tuned: list[str]) -> dict[str, Any]:
    """speed_vs_trl's spec for ``name``; ``anyfit-tuned`` is its ``anyfit`` spec plus ``tuned``."""
    if name.startswith("trl"):
        spec = svt.trl_spec(name, wl, wargs, work)
    else:
        base = "anyfit" if name == "anyfit-tuned" else name
        spec = svt.anyfit_spec(base, wl, wargs, work)
        if name == "anyfit-tuned":
            out = str(work / name)
            spec["overrides"] = [o for o in spec["overrides"] if not o.startswith("train.output_dir=")] + \
                [f"train.output_dir={out}", *tuned]
            spec.update(output_dir=out, settings="tuned: " + " ".join(tuned))
    spec.update(name=name, device=wl.device, model_dir=wl.model_dir, data_path=wl.data_path)
    return spec


def validate(spec: dict[str, Any]) -> None:
    """The spec's settings are accepted: anyfit's overrides by its config loader, TRL's by SFTConfig."""
    if spec["task"] == "anyfit":
        import anyfit_api as api

        api.validate(spec["overrides"])
    else:
        import trl

        trl.SFTConfig(**{**spec["sft_args"], "output_dir": str(Path(spec["output_dir"]))})


# ------------------------------------------------------------------------------------------------------------
# The profiled run (child process)
# ------------------------------------------------------------------------------------------------------------

def profile_child(spec_path: Path) -> None:
    """``python -m anyfit train OVERRIDES`` in this process under torch.profiler; one profiler step per optimizer step."""
    import torch
    from torch.optim.optimizer import register_optimizer_step_post_hook
    from torch.profiler import ProfilerActivity, profile, schedule

    spec = json.loads(spec_path.read_text())
    cuda = torch.cuda.is_available()
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])
    steps = spec["profile_steps"]
    prof = profile(activities=activities, schedule=schedule(**steps, repeat=1), record_shapes=False)
    prof.start()
    register_optimizer_step_post_hook(lambda *a, **k: prof.step())  # every optimizer's step
    sys.argv = ["anyfit", "train", *spec["overrides"]]
    try:
        runpy.run_module("anyfit", run_name="__main__", alter_sys=True)
    except SystemExit as e:
        if e.code not in (0, None):
            raise
    finally:
        prof.stop()
    events = prof.key_averages()
    key = "self_device_time_total" if cuda else "self_cpu_time_total"
    # On CUDA the shares are over the kernels alone (an operator's self device time is its kernels' again). The
    # device-side spans of record_function ranges (ProfilerStep*, anyfit.forward) are CUDA events too but no
    # kernels: on 2026-11-28 they made 60% of the first H100 table's total.
    kernels = [e for e in events if not cuda or (getattr(e, "device_type", None) == torch.autograd.DeviceType.CUDA
                                                 and not getattr(e, "is_user_annotation", False)
                                                 and not e.key.startswith("ProfilerStep"))]
    total = sum(getattr(e, key, 0) for e in kernels) or 1
    top = sorted(kernels, key=lambda e: -getattr(e, key, 0))[:30]
    rows = [{"name": e.key[:160], "self_us": round(getattr(e, key, 0), 1), "share": round(getattr(e, key, 0) / total, 4),
             "calls": e.count} for e in top]
    try:
        table = events.table(sort_by=key, row_limit=30, max_name_column_width=90)
    except (KeyError, AttributeError, ValueError):  # a torch that names it self_cuda_time_total
        table = events.table(sort_by="self_cuda_time_total" if cuda else key, row_limit=30, max_name_column_width=90)
    Path(spec["table_path"]).write_text(f"anyfit defaults, {steps['active']} optimizer steps recorded "
                                        f"({'CUDA kernels' if cuda else 'CPU ops (dry run)'}), sorted by self time\n\n"
                                        + table)
    Path(spec["result_path"]).write_text(json.dumps({"top": rows, "total_self_us": total, "time_key": key}))


def run_profile(args, wl, wargs, work: Path, log: Path) -> dict[str, Any]:
    spec = spec_for("anyfit", wl, wargs, work, [])
    out = work / "profile"
    steps = DRY_PROFILE_STEPS if args.dry_run else PROFILE_STEPS
    spec["overrides"] = [o for o in spec["overrides"] if not o.startswith(("train.output_dir=", "train.max_steps="))] \
        + [f"train.output_dir={out}", f"train.max_steps={sum(steps.values()) + 1}"]
    spec.update(table_path=str(args.out / "profile_top_kernels.txt"), result_path=str(work / "profile.json"),
                profile_steps=steps)
    spec_path = work / "profile-spec.json"
    spec_path.write_text(json.dumps(spec))
    cmd = [sys.executable, str(Path(__file__).resolve()), "--out", str(args.out), "--profile-child", str(spec_path)]
    res = kit.run_logged(cmd, log, timeout=min(240, args.deadline.left()))
    if res["rc"] != 0 or not Path(spec["result_path"]).is_file():
        return {"status": "fail", "error": kit.error_line(res), "wall_s": res["wall_s"]}
    return {"status": "pass", "wall_s": res["wall_s"], **json.loads(Path(spec["result_path"]).read_text())}


# ------------------------------------------------------------------------------------------------------------
# The comparison (parent)
# ------------------------------------------------------------------------------------------------------------

def main() -> int:
    args = kit.part_args(__doc__.split("\n\n")[0], lambda p: (
        p.add_argument("--tuned", default=TUNED, help=f"anyfit-tuned's overrides on top of the defaults ({TUNED})"),
        p.add_argument("--only", default="", help="comma-separated runs (default: all, in order): "
                       + ", ".join(FIRST + IF_TIME)),
        p.add_argument("--profile-child", help=argparse.SUPPRESS)))
    if args.profile_child:
        profile_child(Path(args.profile_child))
        return 0
    args.deadline = kit.Deadline(args.budget)
    results = kit.Results(args.out / "results.json", "part2", args.dry_run)
    results.data["anchors"] = ANCHORS
    log = args.out / "runs.log"
    work = args.work
    wargs = workload_args(args)
    t0 = time.perf_counter()
    wl = svt.prepare_workload(wargs, work)
    try:
        env = svt.environment(wl.device)  # imports trl: a broken TRL must not cost anyfit's runs
    except Exception as e:  # noqa: BLE001
        env = {**kit.environment(), "device": wl.device, "trl_import_error": f"{type(e).__name__}: {e}"[:300]}
    results.data.update(workload={k: v for k, v in vars(wl).items()}, speed_env=env,
                        prepare_s=round(time.perf_counter() - t0, 1))
    matmul = svt.run_child({"name": "matmul", "task": "matmul", "device": wl.device}, work, work / "matmul.log")
    results.data["matmul"] = matmul
    print(f"[part2] workload {wl.name} on {wl.device}: {wl.n_examples} examples, mean {wl.mean_length:.0f} tokens; "
          f"peak {matmul}", flush=True)
    peak = matmul.get("matmul_tflops")
    tuned = args.tuned.split()
    # In the dry run only anyfit's default run runs (2 steps, tiny model, CPU: speed_vs_trl.py's own CPU
    # benchmarks run its TRL path); the others' settings are validated (TRL's by SFTConfig).
    dry_runs = {"anyfit"}
    rows: list[dict[str, Any]] = []
    wanted = [n for n in FIRST + IF_TIME if not args.only or n in args.only.split(",")]
    for name in wanted:
        if name == "profile":
            if args.deadline.left() < 60:
                results.cell(name, status="skip", note="out of time (the part's budget)")
            else:
                results.cell(name, **run_profile(args, wl, wargs, work, log))
                shutil.rmtree(work / "profile", ignore_errors=True)
            continue
        spec = spec_for(name, wl, wargs, work, tuned)
        try:
            validate(spec)
        except Exception as e:  # noqa: BLE001 - a rejected setting is this run's result
            results.cell(name, status="fail", error=f"settings rejected: {type(e).__name__}: {e}"[:600])
            continue
        if args.dry_run and name not in dry_runs:
            results.cell(name, status="checked", note="settings validated (dry run)", settings=spec["settings"])
            continue
        if args.deadline.left() < (60 if name in FIRST else 90):
            results.cell(name, status="skip", note="out of time (the part's budget)")
            continue
        with log.open("a") as f:
            f.write(f"\n===== {name}: {spec['settings']}\n")
        svt.subprocess = TimedSubprocess(min(300, args.deadline.left()))
        raw = svt.run_child(spec, work, work / f"{name}.log")
        with log.open("a") as f:
            f.write((work / f"{name}.log").read_text(errors="replace")[-20000:])
        framework = "trl" if name.startswith("trl") else "anyfit"
        row = svt.summarise(name, framework, spec["settings"], raw, wl, wargs.warmup, peak)
        shutil.rmtree(spec["output_dir"], ignore_errors=True)  # ~2 GB per run
        rows.append(row)
        status = "fail" if "error" in row else "pass"
        results.cell(name, status=status, **{k: v for k, v in row.items() if k != "steps"},
                     losses=[s["loss"] for s in row.get("steps", [])])
    table = svt.markdown_table(rows) if rows else "(no run finished)"
    notes = svt.report_notes(wl, wargs, env, matmul, rows) if rows else []
    (args.out / "speed.md").write_text(table + "\n\n" + "\n".join(f"- {n}" for n in notes + [ANCHORS]) + "\n")
    print("\n" + table, flush=True)
    failed = results.failed()
    print(f"[part2] failed: {failed}", flush=True)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())

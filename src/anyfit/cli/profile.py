"""``anyfit profile``: a few training steps of a config under torch.profiler, turned into a breakdown of the
step's time, memory by kind beside the plan, MFU, and config advice (the same as ``runtime.profile`` during a
real run; works under torchrun: one trace per process, the slowest process's breakdown printed).

Then, on one process, a probe: the profiled config and the config with the speed advice applied each train
``--probe-steps`` steps untraced in a fresh process, and their measured tokens/s give the advice's expected effect.
The probe, not the step model of ``anyfit.profiling.advice``, is printed: that model extrapolates from the run's own
micro-batches and cannot see that a packed row or a larger micro-batch costs more per token on a CPU's caches
(BENCHMARKS.md, 'Profile advice: predicted against measured (issue 21, CPU)')."""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
from pathlib import Path

from anyfit.cli.common import config_and_overrides, config_args
from anyfit.config import ConfigError, load_config
from anyfit.runfolder import read_metrics


def profile_overrides(output_dir: str, steps: int, warmup: int, traced: bool = True) -> list[str]:
    """What a profiling run changes in the user's config: its length, its own folder, nothing on the side: no
    checkpoint and no final model, its steps are the product (``traced=False``: a probe, ``steps`` steps without the
    profiler)."""
    length = ([f"runtime.profile={steps}", f"runtime.profile_warmup={warmup}", f"train.max_steps={warmup + steps}"]
              if traced else ["runtime.profile=0", f"train.max_steps={steps}"])
    return [*length, f"train.output_dir={output_dir}", "train.overwrite=true", "train.resume=null",
            "train.save_every=0", "train.save_final=false", "train.log_every=1", "train.report_to=none", "eval.every=0",
            "eval.generate_every=0", "eval.generate_before=false", "eval.generate_at_end=false"]


def speed_settings(summary: dict) -> list[str]:
    """The advice that claims a speed-up, as ``key=value`` overrides."""
    return [a["setting"] for a in summary["advice"] if a.get("factor")]


def untraced_tokens_per_s(run_dir: Path) -> float:
    """Median tokens/s of a run's steps after the first two (the first allocates the optimizer state; both build
    kernels for new shapes)."""
    lines = [m for m in read_metrics(run_dir) if "tokens_per_s" in m]
    return statistics.median(m["tokens_per_s"] for m in (lines[2:] or lines))


def probe(config: str | None, overrides: list[str], out: str, args, settings: list[str]) -> dict:
    """Train the profiled config and the advised one untraced, one after the other, each in a fresh process as a
    real run would (in the profiling process, the kernels already built for the profiled steps' shapes made the
    profiled config look faster than it runs); their tokens/s."""
    measured = {}
    for name, extra in (("profiled", []), ("advised", settings)):
        folder = Path(out) / "profile" / f"probe-{name}"
        command = [sys.executable, "-m", "anyfit", "train", *([config] if config else []), *overrides, *extra,
                   *profile_overrides(str(folder), args.probe_steps, 0, traced=False)]
        done = subprocess.run(command, capture_output=True, text=True)
        if done.returncode:  # e.g. the advised micro-batch runs out of memory after all: the profile stands
            last = (done.stderr.strip().splitlines() or ["(no output)"])[-1]
            return {"settings": settings, "failed": f"{' '.join(extra) or 'the profiled config'}: exit "
                                                    f"{done.returncode}: {last}"}
        measured[name] = untraced_tokens_per_s(folder)
    return {"settings": settings, "steps": args.probe_steps,
            "profiled_tokens_per_s": measured["profiled"], "advised_tokens_per_s": measured["advised"],
            "factor": measured["advised"] / measured["profiled"] if measured["profiled"] else None}


def cmd_profile(args) -> int:
    if args.steps < 1 or args.warmup < 1 or args.probe_steps < 3:
        raise ConfigError(f"--steps and --warmup must be at least 1 and --probe-steps at least 3, got --steps "
                          f"{args.steps} --warmup {args.warmup} --probe-steps {args.probe_steps}.")
    config, overrides = config_and_overrides(args)
    cfg = load_config(config, overrides)  # validate before importing torch & co.
    out = args.out or f"{cfg.train.output_dir.rstrip('/')}-profile"
    cfg = load_config(config, [*overrides, *profile_overrides(out, args.steps, args.warmup)])
    # start-up time: the training stack (torch, transformers) loads only when a run starts
    from anyfit.profiling.session import PROFILE_DIR, SUMMARY
    from anyfit.training.loop import train

    train(cfg)
    summary_file = Path(out) / PROFILE_DIR / SUMMARY
    if not args.probe or int(os.environ.get("WORLD_SIZE", "1")) > 1 or not summary_file.is_file():
        return 0  # several processes: each would probe; the printed prediction stands (see Honest limits)
    summary = json.loads(summary_file.read_text())
    settings = speed_settings(summary)
    if not settings:
        return 0
    print(f"[anyfit] profile: probing the advice ({' '.join(settings)}): {args.probe_steps} untraced steps "
          "of the profiled config and of the advised one (skip with --no-probe)")
    summary["probe"] = result = probe(config, overrides, out, args, settings)
    summary_file.write_text(json.dumps(summary, indent=2, default=str))
    if "failed" in result:
        print(f"[anyfit] profile: the probe did not run to the end ({result['failed']}); the step model's "
              "prediction above stands unmeasured.")
        return 0
    predicted = summary.get("combined_factor")
    print(f"[anyfit] profile: measured with the advice: {result['advised_tokens_per_s']:.0f} tokens/s against "
          f"{result['profiled_tokens_per_s']:.0f}: x{result['factor']:.2f}"
          + (f" (the step model predicted x{predicted:.2f})" if predicted else ""))
    return 0


def register(sub) -> None:
    p = sub.add_parser("profile", help="Profile a few training steps of a config and print where the time goes, "
                                        "memory by kind, MFU and what to change: anyfit profile CONFIG [--steps N]",
                       formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    config_args(p)
    p.add_argument("--steps", type=int, default=3, help="Training steps traced by torch.profiler.")
    p.add_argument("--warmup", type=int, default=3, help="Steps run before the traced ones (not traced).")
    p.add_argument("--out", help="Folder of the profiling run (default: train.output_dir + '-profile'; replaced if "
                                 "it exists); the traces and profile.json go to OUT/profile/.")
    p.add_argument("--probe", action=argparse.BooleanOptionalAction, default=True,
                   help="After the profile, train the profiled and the advised config a few steps each, untraced, "
                        "and print the measured speed-up of the advice (one process only).")
    p.add_argument("--probe-steps", type=int, default=8, help="Steps of each probe run (the median tokens/s of "
                                                                   "those after the first two is compared).")
    p.set_defaults(func=cmd_profile)

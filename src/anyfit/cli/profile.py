"""``anyfit profile``: a few training steps of a config under torch.profiler, turned into a breakdown of the
step's time, memory by kind beside the plan, MFU, and config advice (the same as ``runtime.profile`` during a
real run; works under torchrun: one trace per process, the slowest process's breakdown printed)."""

from __future__ import annotations

import argparse

from anyfit.cli.common import config_and_overrides, config_args
from anyfit.config import ConfigError, load_config


def profile_overrides(output_dir: str, steps: int, warmup: int) -> list[str]:
    """What a profiling run changes in the user's config: its length, its own folder, nothing on the side."""
    return [f"runtime.profile={steps}", f"runtime.profile_warmup={warmup}", f"train.max_steps={warmup + steps}",
            f"train.output_dir={output_dir}", "train.overwrite=true", "train.resume=null", "train.save_every=0",
            "train.log_every=1", "train.report_to=none", "eval.every=0", "eval.generate_every=0",
            "eval.generate_before=false", "eval.generate_at_end=false"]


def cmd_profile(args) -> int:
    if args.steps < 1 or args.warmup < 1:
        raise ConfigError(f"--steps and --warmup must be at least 1, got --steps {args.steps} --warmup {args.warmup}.")
    config, overrides = config_and_overrides(args)
    cfg = load_config(config, overrides)  # validate before importing torch & co.
    out = args.out or f"{cfg.train.output_dir.rstrip('/')}-profile"
    cfg = load_config(config, [*overrides, *profile_overrides(out, args.steps, args.warmup)])
    # start-up time: the training stack (torch, transformers) loads only when a run starts
    from anyfit.training.loop import train

    train(cfg, save_final=False)
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
    p.set_defaults(func=cmd_profile)

"""``anyfit env`` (this machine and the runtime policy it gets) and ``anyfit plan`` (memory, time and cost of a
config on this machine and common GPUs/Macs, before any download)."""

from __future__ import annotations

import json

from anyfit.cli.common import config_args, load
from anyfit.config import ConfigError, RuntimeConfig


def cmd_env(args) -> int:
    from anyfit.hardware.runtime import memory_summary, resolve_runtime, versions  # start-up time: torch

    for k, v in versions().items():
        print(f"{k}: {v}")
    for line in memory_summary():
        print(line)
    cfg = load(args).runtime if (args.config or args.overrides) else RuntimeConfig()
    policy = resolve_runtime(cfg)
    print("runtime policy: " + policy.describe())
    if policy.device in ("cpu", "mps"):
        print(rates_line(policy.device, policy.precision, args.recalibrate))
    return 0


def rates_line(device: str, dtype: str, refresh: bool) -> str:
    """The measured rates `anyfit plan` and a run's plan use on this CPU or Mac (measured now when asked or when
    none are cached)."""
    from anyfit.cache import cache_root  # start-up time: kept with the import below
    from anyfit.hardware.calibration import RATES_FILE, known_rates, machine_rates  # start-up time: torch

    fresh = refresh or known_rates(device, dtype) is None
    rates = machine_rates(device, dtype, refresh=refresh)
    when = "measured now" if fresh else f"measured {rates.measured_at}, best kept; --recalibrate measures again"
    return f"planner rates ({rates.key}; {when}; {cache_root() / RATES_FILE}): {rates.summary()}"


def cmd_plan(args) -> int:
    cfg = load(args)
    # start-up time: the planner reads model configs through transformers
    from anyfit.planning.presets import targets_from_args
    from anyfit.planning.report import plan_dict, plan_report
    from anyfit.planning.setup import Workload

    if args.micro_batch is not None and not 1 <= args.micro_batch <= cfg.train.effective_batch:
        raise ConfigError(f"--micro-batch must be from 1 to train.effective_batch ({cfg.train.effective_batch}), got "
                          f"{args.micro_batch}.")
    if not 0 < args.trained_share <= 1:
        raise ConfigError(f"--trained-share is a share of the tokens, above 0 and at most 1; got {args.trained_share}.")
    if args.examples is not None and args.examples < 1:
        raise ConfigError(f"--examples must be at least 1, got {args.examples}.")
    workload = Workload.of(cfg, args.mean_tokens, args.trained_share, args.examples)
    targets = targets_from_args(args.device, args.memory_gb, args.gpus, price_per_hour=args.price_per_hour)
    line, shape = image_budget(cfg)
    if args.json:
        print(json.dumps(plan_dict(cfg, targets, workload, shape=shape, micro_batch=args.micro_batch), indent=2,
                         default=str))
    else:
        print(plan_report(cfg, targets, workload, shape=shape, micro_batch=args.micro_batch))
        if line:
            print(line)
    return 0


def image_budget(cfg):
    """For a vision-language model: what one large image costs of data.max_length, and the model's shape with the
    patches its tower embeds for it (a trained tower's activations), both measured with the model's own processor
    where it is on this machine; (None, None) for a text model."""
    from dataclasses import replace

    # start-up time: the tokenizer and the processor load only for this line
    from anyfit.data.image_tokens import ImageTokens
    from anyfit.model.composite import is_composite
    from anyfit.model.processor import load_processor
    from anyfit.model.shape import load_model_config, shape_from_config
    from anyfit.model.tokenizer import load_tokenizer

    config = load_model_config(cfg.model)
    if not is_composite(config) or getattr(config, "vision_config", None) is None:
        return None, None
    shape = shape_from_config(config)
    try:
        processor, why = load_processor(cfg.model, load_tokenizer(cfg.model))
    except (OSError, ValueError) as e:  # not downloaded (no hub here), or not loadable
        processor, why = None, " ".join(str(e).split())[:200]
    if processor is None:
        return (f"images: the model's processor is not available here to count image tokens ({why}); "
                "`anyfit download CONFIG` first"), shape
    images = ImageTokens(processor)
    n = images.largest_image()
    shape = replace(shape, tower_patches=images.patches(shape.tower_patch)) if shape.tower_patch else shape
    trained = (f"; model.train_vision={cfg.model.train_vision}: its tower's activations for {shape.tower_patches:,} "
               "patches an example are planned" if cfg.model.train_vision != "frozen" and shape.tower_patches else "")
    return (f"images: a 4096x4096 image takes {n:,} tokens through {type(processor).__name__} (its own resize), "
            f"counted in data.max_length={cfg.data.max_length:,} with the text; the planned sequence holds them"
            + trained), shape


def register(sub) -> None:
    p = sub.add_parser("env", help="Print versions, memory, the runtime policy this machine gets and, on a CPU or Mac, "
                                    "the measured rates the planner uses.")
    config_args(p)
    p.add_argument("--recalibrate", action="store_true",
                   help="Forget this machine's cached matmul/bandwidth/per-operation rates and measure them again "
                        "(a few seconds; best on an otherwise idle machine).")
    p.set_defaults(func=cmd_env)

    p = sub.add_parser("plan", help="Estimate memory and time of a config on this machine and common GPUs/Macs, "
                                     "from the model config alone (no weights downloaded).")
    config_args(p)
    p.add_argument("--device", default=None,
                   help="A preset (t4, rtx4090, l40s, 8xl40s, a100-40, a100-80, h100, 8xh100, m-16, m-36, m-128, "
                        "m-ultra-192), 'local', or cuda/mps/cpu with --memory-gb. Default: all of them.")
    p.add_argument("--memory-gb", type=float, default=None, help="Memory per device in GB.")
    p.add_argument("--gpus", type=int, default=None,
                   help="Number of GPUs (data parallel / FSDP); a preset's price and host RAM scale with it.")
    p.add_argument("--mean-tokens", type=float, default=None,
                   help="Mean tokens per sequence for the time estimate (default: data.max_length).")
    p.add_argument("--trained-share", type=float, default=1.0,
                   help="Share of the tokens that are trained (the answers; `anyfit prepare` prints it): the "
                        "output head and the loss run at those positions only, which the time estimate counts.")
    p.add_argument("--price-per-hour", type=float, default=None,
                   help="USD per hour for the whole machine picked by --device (alone: for this machine), "
                        "instead of the preset's approximate price; gives the cost columns.")
    p.add_argument("--examples", type=int, default=None,
                   help="Training examples per epoch, for time and cost per epoch (default: data.num_samples; "
                        "without either, only per 100 steps).")
    p.add_argument("--micro-batch", type=int, default=None,
                   help="Plan this micro-batch as given (a run with train.micro_batch fixed) instead of the largest "
                        "that fits, as train.micro_batch=auto picks.")
    p.add_argument("--json", action="store_true", help="Print the plan as JSON.")
    p.set_defaults(func=cmd_plan)

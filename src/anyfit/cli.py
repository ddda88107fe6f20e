"""The ``anyfit`` command line: train, env, render, quickstart.

Multi-process runs use the same command under a launcher:
``torchrun --nproc_per_node 2 -m anyfit train CONFIG.yaml`` (or ``accelerate launch -m anyfit ...``).
"""

from __future__ import annotations

import argparse
import sys

from .config import ConfigError, help_text, load_config
from .data_sources import DataError


def _config_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("config", nargs="?", help="YAML config file (see configs/).")
    p.add_argument("overrides", nargs="*", help="Dotted key=value overrides, e.g. train.learning_rate=1e-4.")
    p.add_argument("--help-config", action="store_true", help="List every config key with its type, default and help.")


def _load(args) -> "Config":  # noqa: F821
    config = args.config
    overrides = list(args.overrides)
    if config and "=" in config and not config.endswith((".yaml", ".yml")):
        overrides.insert(0, config)  # only overrides were given
        config = None
    return load_config(config, overrides)


def cmd_train(args) -> int:
    cfg = _load(args)  # validate before importing torch & co.
    from .divergence import TrainingDiverged
    from .train import train

    try:
        train(cfg)
    except TrainingDiverged as e:
        print(f"anyfit: training stopped: {e}", file=sys.stderr)
        return 3
    return 0


def cmd_env(args) -> int:
    from .config import RuntimeConfig
    from .runtime import memory_summary, resolve_runtime, versions

    for k, v in versions().items():
        print(f"{k}: {v}")
    for line in memory_summary():
        print(line)
    cfg = _load(args).runtime if (args.config or args.overrides) else RuntimeConfig()
    print("runtime policy: " + resolve_runtime(cfg).describe())
    return 0


def cmd_render(args) -> int:
    cfg = _load(args)
    from .data_sources import load_records
    from .formats import to_examples
    from .modeling import load_tokenizer
    from .tokenization import show_example, tokenize_dataset, tokenize_example

    tokenizer = load_tokenizer(cfg.model)
    records = load_records(cfg.data)
    if not 0 <= args.index < len(records):
        raise ConfigError(f"--index {args.index} is out of range: the data has {len(records)} records.")
    # Show record N itself (even one the length policy would cut or drop), then what the policy does overall.
    ids, labels = tokenize_example(to_examples(records[args.index:args.index + 1], cfg.data)[0], tokenizer, cfg.data)
    color = sys.stdout.isatty() and not args.no_color
    print(f"record {args.index} of {cfg.data.path}:\n")
    print(show_example(ids, labels, tokenizer, color=color))
    if len(ids) > cfg.data.max_length:
        print(f"\n(this record has {len(ids)} tokens, over data.max_length={cfg.data.max_length}: "
              f"it is {'cut' if cfg.data.overlong == 'truncate' else 'dropped'} in training)")
    _, report = tokenize_dataset(records, tokenizer, cfg.data)
    print(f"\nwhole dataset: {report.summary()}")
    return 0


def cmd_quickstart(args) -> int:
    from .quickstart import run_quickstart

    run_quickstart(output_dir=args.output_dir, overwrite=True)
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="anyfit", description="Supervised fine-tuning that adapts to the hardware.")
    sub = parser.add_subparsers(dest="command", required=True)

    p = sub.add_parser("train", help="Fine-tune a model: anyfit train CONFIG.yaml [key=value ...]")
    _config_args(p)
    p.set_defaults(func=cmd_train)

    p = sub.add_parser("env", help="Print versions, memory and the runtime policy this machine gets.")
    _config_args(p)
    p.set_defaults(func=cmd_env)

    p = sub.add_parser("render", help="Show one training example with the tokens that carry loss highlighted.")
    _config_args(p)
    p.add_argument("--index", type=int, default=0, help="Which example (after filtering).")
    p.add_argument("--no-color", action="store_true", help="Mark trained tokens with brackets instead of colour.")
    p.set_defaults(func=cmd_render)

    p = sub.add_parser("quickstart", help="Offline demo: fine-tune SmolLM2-135M on synthetic arithmetic on this machine.")
    p.add_argument("--output-dir", default="runs/quickstart", help="Where the fine-tuned model goes.")
    p.set_defaults(func=cmd_quickstart)
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    if getattr(args, "help_config", False):
        print(help_text())
        return 0
    try:
        return args.func(args)
    except (ConfigError, DataError) as e:
        print(f"anyfit: error: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())

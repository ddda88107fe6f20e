"""What every sub-command shares: the config positional arguments and their loading, the places a config names
(for a file fault's one line), the version."""

from __future__ import annotations

import argparse
from importlib.metadata import PackageNotFoundError
from importlib.metadata import version as dist_version
from pathlib import Path

from anyfit import __version__
from anyfit.cache import cache_root
from anyfit.config import Config, load_config


def config_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("config", nargs="?", help="YAML config file, or the name of a shipped one (anyfit configs).")
    p.add_argument("overrides", nargs="*", help="Dotted key=value overrides, e.g. train.learning_rate=1e-4.")
    p.add_argument("--help-config", action="store_true", help="List every config key with its type, default and help.")


def config_and_overrides(args) -> tuple[str | None, list[str]]:
    config = args.config
    overrides = list(args.overrides)
    if config and "=" in config and not config.endswith((".yaml", ".yml")):
        overrides.insert(0, config)  # only overrides were given
        config = None
    return config, overrides


def load(args, base=None) -> Config:
    """The config of the command line; ``base``: a training run's config.yaml under it (eval/generate of a run).
    The places its settings name are kept on ``args`` (``places``) for a file fault's one line (``fault_places``)."""
    config, overrides = config_and_overrides(args)
    cfg = load_config(config, overrides, base=base, echo=print if base else None)
    args.places = {"train.output_dir": cfg.train.output_dir, "data.cache_dir": cfg.data.cache_dir,
                   "data.path": cfg.data.path, "eval.path": cfg.eval.path, "model.name_or_path": cfg.model.name_or_path,
                   "model.tokenizer": cfg.model.tokenizer}
    return cfg


def fault_places(args) -> dict[str, str | Path | None]:
    """Which setting (or option, or environment variable) names each place a command writes or reads, for
    ``anyfit.faults.one_line`` to say which one to change: the cache roots, the command's ``--out``, and the
    config's paths once it is loaded (``load``)."""
    from huggingface_hub import constants  # start-up time: only when a command has failed

    return {"ANYFIT_CACHE": cache_root(), "HF_HOME": constants.HF_HOME, "--out": getattr(args, "out", None),
            **getattr(args, "places", {})}


def version() -> str:
    """The installed distribution's version; ``anyfit.__version__`` when running from a source tree that is not
    installed (both come from pyproject.toml's version)."""
    try:
        return dist_version("anyfit")
    except PackageNotFoundError:
        return __version__

"""``anyfit train``: fine-tune as the config says (the same command under torchrun / accelerate launch)."""

from __future__ import annotations

import sys

from anyfit.cli.common import config_args, load


def cmd_train(args) -> int:
    cfg = load(args)  # validate before importing torch & co.
    # start-up time: the training stack (torch, transformers) loads only when a run starts
    from anyfit.training.divergence import TrainingDiverged
    from anyfit.training.loop import train

    try:
        train(cfg)
    except TrainingDiverged as e:
        print(f"anyfit: training stopped: {e}", file=sys.stderr)
        return 3
    return 0


def register(sub) -> None:
    p = sub.add_parser("train", help="Fine-tune a model: anyfit train CONFIG.yaml [key=value ...]")
    config_args(p)
    p.set_defaults(func=cmd_train)

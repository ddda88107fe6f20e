"""The ``anyfit`` command line: train, profile, env, render, plan, generate, eval, download, export, plot, configs,
quickstart. Each sub-command's parser lives beside its handler (``register`` in each module); this module
assembles them and turns a ``ConfigError``/``DataError`` into one ``anyfit: error:`` line (exit 2), and an error of
the machine or its files (a read-only or full disk, a file gone or damaged: ``anyfit.faults``) into one too (exit 1,
or 2 for a damaged input file).

Multi-process runs use the same command under a launcher:
``torchrun --nproc_per_node 2 -m anyfit train CONFIG.yaml`` (or ``accelerate launch -m anyfit ...``).

Modules here import the heavy layers (torch, transformers) inside the handlers, so ``anyfit --help`` and a
config error answer at once; those imports say so in a comment.
"""

from __future__ import annotations

import argparse
import gc
import sys

from anyfit.cli import finished, generation, launch, machine, profile, render, setup, train
from anyfit.cli.common import fault_places, version
from anyfit.config import ConfigError, help_text
from anyfit.data.sources import DataError
from anyfit.faults import one_line
from anyfit.runfolder import NotWritten

# In the order `anyfit --help` lists them.
COMMANDS = (train, profile, machine, launch, render, setup, generation, finished)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="anyfit", description="Supervised fine-tuning that adapts to the hardware.")
    parser.add_argument("--version", action="version", version=f"anyfit {version()}")
    sub = parser.add_subparsers(dest="command", required=True)
    for module in COMMANDS:
        module.register(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    # key=value overrides may come anywhere (`anyfit eval CFG --model M key=value`): argparse ends a positional
    # list at the first option, and its parse_intermixed_args does not support subcommands.
    args, extra = parser.parse_known_args(argv)
    stray = [a for a in extra if a.startswith("-") or "=" not in a]
    if stray or (extra and not hasattr(args, "overrides")):
        parser.error(f"unrecognized arguments: {' '.join(stray or extra)}")
    if extra:
        args.overrides = [*args.overrides, *extra]
    if getattr(args, "help_config", False):
        print(help_text())
        return 0
    try:
        return args.func(args)
    except (ConfigError, DataError) as e:
        print(f"anyfit: error: {e}", file=sys.stderr)
        return 2
    except NotWritten as e:  # a full disk: what was lost and what is intact, in one line
        print(f"anyfit: error: {e}", file=sys.stderr)
        return 1
    except KeyboardInterrupt as e:  # Ctrl-C outside the training steps (which stop cleanly on their own)
        print(f"anyfit: interrupted{': ' + str(e) if str(e) else ''}", file=sys.stderr)
        return 130
    except Exception as e:  # the machine or a file (anyfit.faults): one line; anything else keeps its traceback
        fault = one_line(e, fault_places(args))
        if fault is None:
            raise
        print(f"anyfit: error: {fault[0]}", file=sys.stderr)
        return fault[1]


def run() -> None:
    """The ``anyfit`` command (and ``python -m anyfit``): ``main``, then the exit. The interpreter's last garbage
    collection would walk every object torch and transformers made (1.3 s of every command's exit on a 2-core VM,
    paid by each process of a launch); frozen, they are left to the exit. Everything anyfit writes is closed
    before ``main`` returns."""
    code = main()
    if "torch.distributed" in sys.modules:  # a run under a launcher: its process group ends after its model
        from anyfit.hardware.runtime import end_process_group  # start-up time: torch is already loaded here

        end_process_group()
    gc.freeze()
    sys.exit(code)


if __name__ == "__main__":  # pragma: no cover
    run()

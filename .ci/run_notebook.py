#!/usr/bin/env python3
"""Execute notebooks/colab_quickstart.ipynb headless, with small settings, so that it cannot rot.

    python .ci/run_notebook.py [NOTEBOOK] [--spec ANYFIT_SPEC] [--workdir DIR] [--output FILE]
                               [--full] [-p NAME=VALUE ...] [--timeout SECONDS]

The notebook runs in a kernel of the Python that runs this script (a kernelspec made for the run, so an
installed "python3" kernelspec that points at another interpreter cannot be picked up), with its parameters
cell overridden: SMALL=True (unless --full), ANYFIT_SPEC=--spec (default "": install nothing, use the anyfit
of this Python), WORKDIR and DRIVE_DIR under --workdir (default: a new folder under /tmp). The executed
notebook is written under /tmp (or --output) and its path printed. Exit status 1 on any cell error, after
printing the failing cell's source and output; 2 on bad arguments.

Executed with papermill (pin: papermill==2.7.0): it is the standard tool for parameterised notebook runs
(the notebook's cell tagged "parameters" is the papermill convention, and the executed notebook records the
injected values), it installs cleanly from wheels next to nbclient 0.11.0 / ipykernel 7.4.0 / nbformat
5.11.1, and it executes through nbclient. It streams every cell's output to this process's log as it comes
(log_output), so a CI log shows progress while a slow cell runs.

HF_HUB_OFFLINE=1 is set for the kernel unless already set: the notebook's SMALL path needs no model hub, and
an accidental download should fail at once rather than hang. PATH starts with this Python's bin folder, as in
an activated venv, so `anyfit` and `pip` typed in a cell are this environment's.
"""

from __future__ import annotations

import argparse
import ast
import json
import os
import re
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
DEFAULT_NOTEBOOK = ROOT / "notebooks" / "colab_quickstart.ipynb"
KERNEL_NAME = "anyfit-notebook-ci"


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("notebook", nargs="?", default=str(DEFAULT_NOTEBOOK), help="Notebook to run.")
    p.add_argument("--spec", default="", help="ANYFIT_SPEC: what the notebook's install cell pip-installs "
                   "(a wheel path, '-e /path/to/anyfit', ...); '' (default) installs nothing.")
    p.add_argument("--workdir", help="Folder for WORKDIR and DRIVE_DIR (default: a new folder under /tmp).")
    p.add_argument("--output", help="Where to write the executed notebook (default: WORKDIR's parent folder).")
    p.add_argument("--full", action="store_true", help="SMALL=False: the notebook's real settings (slow on a CPU).")
    p.add_argument("-p", "--parameter", action="append", default=[], metavar="NAME=VALUE",
                   help="Another parameter (VALUE is a Python literal, else a string); repeatable.")
    p.add_argument("--timeout", type=int, default=1200, help="Seconds one cell may run (default 1200).")
    return p.parse_args(argv)


def literal(value: str):
    try:
        return ast.literal_eval(value)
    except (ValueError, SyntaxError):
        return value


def make_kernelspec(folder: Path) -> None:
    """A kernelspec named KERNEL_NAME that starts ipykernel with this very interpreter; JUPYTER_PATH finds it."""
    spec_dir = folder / "kernels" / KERNEL_NAME
    spec_dir.mkdir(parents=True, exist_ok=True)
    (spec_dir / "kernel.json").write_text(json.dumps({
        "argv": [sys.executable, "-m", "ipykernel_launcher", "-f", "{connection_file}"],
        "display_name": f"Python ({sys.executable})", "language": "python"}))
    os.environ["JUPYTER_PATH"] = os.pathsep.join(filter(None, [str(folder), os.environ.get("JUPYTER_PATH")]))


ANSI = re.compile(r"\x1b\[[0-9;]*m")  # IPython colours its tracebacks


def report_failure(executed: Path, error: Exception) -> None:
    """Print the failing cell's source and outputs from the executed notebook (papermill writes it on failure)."""
    import nbformat

    print(f"\n[run_notebook] FAILED: {type(error).__name__}", file=sys.stderr)
    try:
        nb = nbformat.read(executed, as_version=4)
    except Exception as exc:  # the notebook may not have been written at all
        print(f"[run_notebook] (could not read {executed}: {exc})\n{error}", file=sys.stderr)
        return
    failing = [(i, c) for i, c in enumerate(nb.cells) if c.cell_type == "code"
               and any(o.get("output_type") == "error" for o in c.get("outputs", []))]
    if not failing:
        print(str(error), file=sys.stderr)
        return
    index, cell = failing[0]
    print(f"[run_notebook] cell {index} failed:\n----- source -----\n{cell.source}\n----- output -----", file=sys.stderr)
    for out in cell.outputs:
        if out.output_type == "stream":
            print(out.text, end="", file=sys.stderr)
        elif out.output_type == "error":
            print(ANSI.sub("", "\n".join(out.traceback)), file=sys.stderr)
        elif "text/plain" in out.get("data", {}):
            print(out["data"]["text/plain"], file=sys.stderr)
    print("----- end -----", file=sys.stderr)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    notebook = Path(args.notebook).resolve()
    if not notebook.is_file():
        print(f"run_notebook: no notebook at {notebook}", file=sys.stderr)
        return 2
    base = Path(args.workdir).resolve() if args.workdir else Path(tempfile.mkdtemp(prefix="anyfit-notebook-", dir="/tmp"))
    base.mkdir(parents=True, exist_ok=True)
    executed = Path(args.output).resolve() if args.output else base / f"{notebook.stem}.executed.ipynb"
    parameters = {"ANYFIT_SPEC": args.spec, "SMALL": not args.full,
                  "WORKDIR": str(base / "work"), "DRIVE_DIR": str(base / "drive")}
    for item in args.parameter:
        name, sep, value = item.partition("=")
        if not sep:
            print(f"run_notebook: -p wants NAME=VALUE, got {item!r}", file=sys.stderr)
            return 2
        parameters[name] = literal(value)

    make_kernelspec(base / "jupyter")
    os.environ["PATH"] = os.pathsep.join([str(Path(sys.executable).parent), os.environ.get("PATH", "")])
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ.setdefault("MPLBACKEND", "Agg")

    import logging

    import papermill as pm

    logging.basicConfig(level=logging.INFO, format="%(message)s", stream=sys.stdout)
    print(f"[run_notebook] {notebook} with {parameters}\n[run_notebook] python: {sys.executable}; "
          f"papermill {pm.__version__}; executed notebook: {executed}", flush=True)
    start = time.perf_counter()
    try:
        pm.execute_notebook(str(notebook), str(executed), parameters=parameters, kernel_name=KERNEL_NAME,
                            cwd=str(base), log_output=True, progress_bar=False,
                            execution_timeout=args.timeout, request_save_on_cell_execute=True)
    except Exception as error:  # PapermillExecutionError for a cell error; anything else (kernel died, ...) too
        report_failure(executed, error)
        print(f"[run_notebook] executed notebook (up to the failure): {executed}", file=sys.stderr)
        return 1
    elapsed = time.perf_counter() - start

    import nbformat

    nb = nbformat.read(executed, as_version=4)
    timed = sorted(((c.metadata.get("papermill", {}).get("duration") or 0.0, i) for i, c in enumerate(nb.cells)
                    if c.cell_type == "code"), reverse=True)
    print("[run_notebook] slowest cells: " + ", ".join(f"cell {i} {d:.1f}s" for d, i in timed[:6]))
    print(f"[run_notebook] OK in {elapsed:.0f} s; executed notebook: {executed}")
    return 0


if __name__ == "__main__":
    sys.exit(main())

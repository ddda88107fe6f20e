"""The package's floors: every import (module level or inside a function) points down the declared layer
order, no two packages import each other, and no room grows too large. Read from the source with ``ast``, so
a new upward import fails here instead of growing into a cycle."""

from __future__ import annotations

import ast
from dataclasses import dataclass
from pathlib import Path

import pytest

import anyfit

PACKAGE = Path(anyfit.__file__).resolve().parent

# Lowest first. A module may import its own package (sub-package) and anything on a lower floor; packages on the
# same floor are peers and may not import each other (model and data meet only above them).
LAYERS: list[tuple[str, ...]] = [
    ("anyfit", "anyfit.configs"),  # the version; the shipped config files
    # files written whole, hashed, locked; GIB; an error of the machine or its files in one line (standard library only)
    ("anyfit.durable", "anyfit.units", "anyfit.faults"),
    ("anyfit.config",),  # the typed schema and its loader
    ("anyfit.runfolder", "anyfit.hub", "anyfit.cache"),  # the run folder; hub ids; the derived-data cache
    ("anyfit.hardware",),  # runtime policy: device, precision, memory, what may be sharded
    ("anyfit.model", "anyfit.data"),  # where weights come from and how they load; records to token ids
    ("anyfit.planning",),  # memory and time estimates, the saver ladder, machine presets
    ("anyfit.backends",),  # how a run is spread over processes: replicated, FSDP2, ZeRO-3 (one interface)
    ("anyfit.evaluation",),  # generation, answer extraction, grading
    ("anyfit.profiling",),  # torch.profiler traces of training steps, MFU, and config advice from them
    ("anyfit.training",),  # the loop and what it calls
    ("anyfit.export",),  # a run as a standalone model, GGUF, the Hub (asks training which checkpoints are complete)
    ("anyfit.download", "anyfit.quickstart", "anyfit.launch"),  # whole tasks built on everything below
    ("anyfit.cli",),  # the command line
    ("anyfit.__main__",),  # python -m anyfit
]
# Only the command line may import inside functions (start-up time: `anyfit --help` must not load torch), and
# each such import says why in a comment on its line or just above it.
LAZY_IMPORTS_ALLOWED = ("anyfit.cli",)
MAX_MODULE_LINES = 600
MAX_FUNCTION_LINES = 80
LONG_FUNCTION_MARK = "Kept whole:"  # a docstring sentence saying why a long function is not split


@dataclass(frozen=True)
class Import:
    source: str  # the importing module
    target: str  # the imported anyfit module
    line: int
    in_function: bool
    commented: bool


def module_name(path: Path) -> str:
    parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def modules() -> dict[str, Path]:
    return {module_name(p): p for p in sorted(PACKAGE.rglob("*.py"))}


def _resolve(name: str, known: dict[str, Path]) -> str:
    return name if name in known else name.rsplit(".", 1)[0]


def imports_of(name: str, path: Path, known: dict[str, Path]) -> list[Import]:
    text = path.read_text(encoding="utf-8")
    lines = text.splitlines()
    tree = ast.parse(text)
    in_function = {id(n) for f in ast.walk(tree) if isinstance(f, (ast.FunctionDef, ast.AsyncFunctionDef))
                   for n in ast.walk(f) if isinstance(n, (ast.Import, ast.ImportFrom))}
    package = name if path.name == "__init__.py" else name.rsplit(".", 1)[0]
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                base = ".".join(package.split(".")[: len(package.split(".")) - node.level + 1] + ([base] if base else []))
            targets = [_resolve(f"{base}.{a.name}", known) for a in node.names]
        elif isinstance(node, ast.Import):
            targets = [_resolve(a.name, known) for a in node.names]
        else:
            continue
        above = node.lineno - 2
        while above >= 0 and lines[above].lstrip().startswith(("from ", "import ")):
            above -= 1
        commented = "#" in lines[node.lineno - 1] or (above >= 0 and lines[above].lstrip().startswith("#"))
        for target in dict.fromkeys(targets):  # `from x import a, b` of one module is one import
            if target.split(".")[0] == "anyfit":
                found.append(Import(name, target, node.lineno, id(node) in in_function, commented))
    return found


def floor_of(module: str) -> tuple[int, str]:
    """(floor, the package that places it there): the longest declared prefix wins."""
    best = None
    for floor, names in enumerate(LAYERS):
        for prefix in names:
            if (module == prefix or module.startswith(prefix + ".")) and (best is None or len(prefix) > len(best[1])):
                best = (floor, prefix)
    assert best is not None, f"{module} is on no floor: add its package to LAYERS"
    return best


def all_imports() -> list[Import]:
    known = modules()
    return [i for name, path in known.items() for i in imports_of(name, path, known)]


def test_every_module_is_on_a_floor():
    for name in modules():
        floor_of(name)


@pytest.mark.slow
def test_imports_point_down():
    upward = []
    for imp in all_imports():
        (src_floor, src_pkg), (dst_floor, dst_pkg) = floor_of(imp.source), floor_of(imp.target)
        same_package = src_pkg == dst_pkg
        if dst_floor > src_floor or (dst_floor == src_floor and not same_package):
            upward.append(f"{imp.source}:{imp.line} imports {imp.target} ({src_pkg} floor {src_floor} -> "
                          f"{dst_pkg} floor {dst_floor})")
    assert not upward, "imports that point up or sideways:\n" + "\n".join(upward)


def test_no_import_cycles():
    graph: dict[str, set[str]] = {}
    for imp in all_imports():
        if imp.target != imp.source:
            graph.setdefault(imp.source, set()).add(imp.target)
    state: dict[str, int] = {}
    cycles = []

    def visit(node: str, path: list[str]) -> None:
        state[node] = 1
        for nxt in sorted(graph.get(node, ())):
            if state.get(nxt) == 1:
                cycles.append(" -> ".join(path[path.index(nxt):] + [nxt]) if nxt in path else f"{node} -> {nxt}")
            elif nxt not in state:
                visit(nxt, [*path, nxt])
        state[node] = 2

    for node in sorted(graph):
        if node not in state:
            visit(node, [node])
    # A package's __init__ that re-exports its modules is not a cycle with them unless they import it back.
    assert not cycles, "import cycles:\n" + "\n".join(cycles)


def test_imports_inside_functions_only_in_the_cli_and_with_a_reason():
    bad = [f"{i.source}:{i.line} imports {i.target} inside a function"
           + ("" if i.source.startswith(LAZY_IMPORTS_ALLOWED) else " (only the CLI may, for start-up time)")
           for i in all_imports() if i.in_function
           and (not i.source.startswith(LAZY_IMPORTS_ALLOWED) or not i.commented)]
    assert not bad, "\n".join(bad)


def test_no_room_is_too_large():
    too_long = []
    for name, path in modules().items():
        text = path.read_text(encoding="utf-8")
        if len(text.splitlines()) > MAX_MODULE_LINES:
            too_long.append(f"{name}: {len(text.splitlines())} lines (split it by concern)")
        for node in ast.walk(ast.parse(text)):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                length = node.end_lineno - node.lineno + 1
                if length > MAX_FUNCTION_LINES and LONG_FUNCTION_MARK not in (ast.get_docstring(node) or ""):
                    too_long.append(f"{name}.{node.name}: {length} lines, and its docstring does not say why "
                                    f"('{LONG_FUNCTION_MARK} ...')")
    assert not too_long, "\n".join(too_long)


@pytest.mark.parametrize("source, expected", [
    ("def f():\n    from anyfit.training import loop\n", "inside a function"),
    ("from anyfit.cli import main\n", "floor"),
])
def test_the_checks_catch_what_they_are_for(tmp_path, source, expected):
    """A model layer module importing upwards, or inside a function, is reported (the test can fail)."""
    fake = tmp_path / "anyfit" / "model" / "fake.py"
    fake.parent.mkdir(parents=True)
    fake.write_text(source)
    known = {**modules(), "anyfit.model.fake": fake}
    found = imports_of("anyfit.model.fake", fake, known)
    assert found, "the import was not read"
    imp = found[0]
    if expected == "floor":
        assert floor_of(imp.target)[0] > floor_of(imp.source)[0]
    else:
        assert imp.in_function and not imp.source.startswith(LAZY_IMPORTS_ALLOWED)

"""README.md's Layout is the tree of ``src/anyfit``: every module in it, each with a line saying what it holds, and
nothing that is not there. Read from the Layout section's code block (an indented tree, two spaces a level, a
description after each name, longer descriptions continued on lines indented past the names), so a module added,
renamed or removed without its line in the README fails here, saying what to add or remove."""

from __future__ import annotations

from pathlib import Path

# The source tree beside this test, not the installed package (a wheel install has no README beside it)
REPO = Path(__file__).resolve().parents[2]
PACKAGE = REPO / "src" / "anyfit"
README = REPO / "README.md"
ROOT = "src/anyfit/"  # the tree's first line; the block's later lines at column 0 (notebooks/, tests/) are not it
NOT_LISTED = ("__init__.py", "__main__.py")  # a package is listed by its folder


def layout_tree(readme: str) -> list[str]:
    """The lines of the Layout code block below ``src/anyfit/``, up to the next line at column 0."""
    section = readme.split("\n## Layout\n", 1)[1].split("\n## ", 1)[0]
    lines = section.split("```")[1].splitlines()
    tree = []
    for line in lines[lines.index(ROOT) + 1:]:
        if line.strip() and not line.startswith(" "):
            break
        tree.append(line)
    return tree


def listed(tree: list[str]) -> tuple[dict[str, str], list[str]]:
    """Every entry's path below ``src/anyfit/`` (folders end with /) -> its description, and the lines that are
    not laid out as a tree. An entry is a name ending in .py or / at most one level deeper than the one above;
    any other line continues the description before it."""
    entries: dict[str, str] = {}
    problems: list[str] = []
    stack: list[str] = []
    for line in tree:
        indent = len(line) - len(line.lstrip(" "))
        name, _, description = line.strip().partition(" ")
        if not name.endswith(("/", ".py")) or indent > 2 * (len(stack) + 1):
            continue
        if indent == 0 or indent % 2:
            problems.append(f"{line.strip()!r}: indent names two spaces a level (found {indent})")
            continue
        stack = [*stack[:indent // 2 - 1], name]
        entries["".join(stack)] = description.strip()  # folders end with /
    return entries, problems


def layout_problems(entries: dict[str, str], package: Path) -> list[str]:
    """What the README's Layout must gain or lose to match ``package``'s files, one line each."""
    modules = {p.relative_to(package).as_posix() for p in package.rglob("*.py") if p.name not in NOT_LISTED}
    folders = {p.parent.relative_to(package).as_posix() + "/" for p in package.rglob("__init__.py")
               if p.parent != package}
    files_listed = {path for path in entries if path.endswith(".py")}
    folders_listed = {path for path in entries if path.endswith("/")}
    problems = [f"add {path} (a module of src/anyfit) under its package, with what it holds"
                for path in sorted(modules - files_listed)]
    problems += [f"add {path} (a package of src/anyfit)" for path in sorted(folders - folders_listed)]
    problems += [f"remove {path}: there is no src/anyfit/{path}" for path in sorted(files_listed - modules)]
    problems += [f"remove {path}: there is no folder src/anyfit/{path}" for path in sorted(folders_listed)
                 if not (package / path).is_dir()]
    problems += [f"say what {path} holds (its line names it only)" for path in sorted(files_listed & modules)
                 if not entries[path]]
    return problems


def test_the_readme_layout_lists_every_module_and_nothing_else():
    entries, problems = listed(layout_tree(README.read_text(encoding="utf-8")))
    problems += layout_problems(entries, PACKAGE)
    assert not problems, "README.md's Layout (the code block in '## Layout') does not match src/anyfit:\n" + \
        "\n".join(f"- {p}" for p in problems)


def test_the_check_catches_what_it_is_for(tmp_path):
    """A module missing from the tree, a listed file that is gone, a bare name and a bad indent are all reported;
    a description continued on the next line is not an entry."""
    package = tmp_path / "anyfit"
    for path in ("__init__.py", "cli.py", "data/__init__.py", "data/store.py", "data/new.py"):
        (package / path).parent.mkdir(parents=True, exist_ok=True)
        (package / path).write_text("")
    readme = "\n".join([
        "# anyfit", "", "## Layout", "", "```", ROOT,
        "  cli.py",
        "  data/",
        "    store.py          the token store, continued",
        "                      on a second line that names nothing.py",
        "    gone.py           renamed long ago",
        "   odd.py            three spaces",
        "notebooks/", "```", "", "## Next", ""])
    entries, problems = listed(layout_tree(readme))
    assert entries == {"cli.py": "", "data/": "", "data/store.py": "the token store, continued",
                       "data/gone.py": "renamed long ago"}
    problems += layout_problems(entries, package)
    assert problems == ["'odd.py            three spaces': indent names two spaces a level (found 3)",
                        "add data/new.py (a module of src/anyfit) under its package, with what it holds",
                        "remove data/gone.py: there is no src/anyfit/data/gone.py",
                        "say what cli.py holds (its line names it only)"]

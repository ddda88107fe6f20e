"""The example configs shipped inside the package, so a pip install has them too.

``anyfit train smollm2-lora-chat`` takes the shipped ``smollm2-lora-chat.yaml`` when no file of that name
exists; ``anyfit configs`` lists them, ``anyfit configs NAME`` prints one (to copy and edit), and
``anyfit configs --path NAME`` prints where it lies.
"""

from __future__ import annotations

from pathlib import Path

FOLDER = Path(__file__).resolve().parent
_SUFFIXES = (".yaml", ".yml")


def shipped() -> dict[str, Path]:
    """Name (the path below this folder without ``.yaml``) -> file, sorted by name."""
    files = [p for p in FOLDER.rglob("*") if p.suffix in _SUFFIXES]
    return {p.relative_to(FOLDER).with_suffix("").as_posix(): p for p in sorted(files)}


def find(name: str) -> Path | None:
    """The shipped config called ``name`` (with or without ``.yaml``), or None."""
    for suffix in _SUFFIXES:
        if name.endswith(suffix):
            name = name[: -len(suffix)]
    return shipped().get(name)


def summary(path: Path) -> str:
    """The first comment line of a shipped config: what it is for."""
    for line in path.read_text().splitlines():
        if line.startswith("#") and line.strip("# "):
            return line.lstrip("# ").strip()
    return ""

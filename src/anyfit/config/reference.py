"""Every config key in words: the ``--help-config`` text and the README's reference tables, generated from
the dataclasses' field help so the two can never disagree with the schema."""

from __future__ import annotations

import dataclasses
import typing
from typing import Any

from anyfit.config.loading import type_name
from anyfit.config.schema import SECTIONS


def field_help() -> list[tuple[str, str, Any, str]]:
    """(key, type, default, help) for every key, in declaration order."""
    rows = []
    hints_cache = {cls: typing.get_type_hints(cls) for cls in SECTIONS.values()}
    for s, cls in SECTIONS.items():
        for f in dataclasses.fields(cls):
            default = f.default if f.default is not dataclasses.MISSING else f.default_factory()
            rows.append((f"{s}.{f.name}", type_name(hints_cache[cls][f.name]), default, f.metadata.get("help", "")))
    return rows


def help_text() -> str:
    """Every key with its type, default and help, grouped by section (for --help-config)."""
    out = []
    section = None
    for key, tp, default, help in field_help():
        s = key.split(".")[0]
        if s != section:
            section = s
            out.append(f"\n{s}:  {SECTIONS[s].__doc__.strip()}")
        out.append(f"  {key} ({tp}, default {default!r})\n      {help}")
    return "\n".join(out)


def reference_markdown() -> str:
    """The README's config reference tables, generated from the dataclasses (scripts/update_readme.py)."""
    out: list[str] = []
    section = None
    for key, tp, default, help in field_help():
        s = key.split(".")[0]
        if s != section:
            section = s
            out += ([""] if out else []) + [f"**{s}**: {SECTIONS[s].__doc__.strip()}", "",
                                            "| key | type | default | meaning |", "|---|---|---|---|"]
        tp = tp.replace("|", "\\|").replace("NoneType", "null")
        out.append(f"| `{key}` | {tp} | `{default!r}` | {help} |")
    return "\n".join(out) + "\n"

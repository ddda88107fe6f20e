"""Regenerate the config reference in README.md from the config dataclasses: uv run python scripts/update_readme.py"""

from pathlib import Path

from anyfit.config import reference_markdown

START, END = "<!-- config-reference:start -->\n", "<!-- config-reference:end -->"
readme = Path(__file__).resolve().parents[1] / "README.md"
text = readme.read_text()
head, rest = text.split(START, 1)
_, tail = rest.split(END, 1)
readme.write_text(head + START + reference_markdown() + END + tail)
print(f"updated {readme}")

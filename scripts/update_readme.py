"""Regenerate README.md's generated parts: the config reference (from the config dataclasses), the saver ladder (from
anyfit.planning.savers' table), the 'What fits where' table (`anyfit plan` on the hardware guide's machines) and the
model families table (scripts/family_table.py): uv run python scripts/update_readme.py"""

import sys
from pathlib import Path

from anyfit.config import reference_markdown
from anyfit.planning.savers import ladder_markdown

sys.path.insert(0, str(Path(__file__).resolve().parent))
from family_table import markdown as family_markdown  # noqa: E402  (the scripts beside this one)
from hardware_guide import markdown as hardware_markdown  # noqa: E402

readme = Path(__file__).resolve().parents[1] / "README.md"
text = readme.read_text()
for name, body in (("config-reference", reference_markdown()), ("saver-ladder", ladder_markdown()),
                   ("hardware-guide", hardware_markdown()), ("family-table", family_markdown())):
    start, end = f"<!-- {name}:start -->\n", f"<!-- {name}:end -->"
    head, rest = text.split(start, 1)
    _, tail = rest.split(end, 1)
    text = head + start + body + end + tail
readme.write_text(text)
print(f"updated {readme}")

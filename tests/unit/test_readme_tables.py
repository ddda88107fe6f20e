"""README's generated tables are current: scripts/update_readme.py writes each from the code, and a change to what
the code decides (a plan's verdict, peak or time; a family's packing, LoRA targets or refusals) shows up here until
the README says it too.

- 'What fits where' (scripts/hardware_guide.py): `anyfit plan` on the hardware guide's machines.
- Model families (scripts/family_table.py): anyfit's rules run on a tiny model of each family (the packing
  self-test, LoRA's auto targets, the fused loss and tiled MLP, the sequence-parallel refusal, the planner's
  parameter count, GGUF export's check); each cell's behaviour is tested where its rule lives (packing:
  tests/equivalence/test_packing_families.py)."""

from __future__ import annotations

import importlib.util
import re
from pathlib import Path

import pytest
import transformers

REPO = Path(__file__).resolve().parents[2]  # the source tree beside this test, not the installed package


@pytest.mark.parametrize("script, marker", [("hardware_guide", "hardware-guide"), ("family_table", "family-table")])
def test_readme_table_is_current(script, marker):
    if script == "family_table" and transformers.__version__ != _pinned("transformers"):
        pytest.skip("the family table is made with the pinned transformers (another release builds other models)")
    spec = importlib.util.spec_from_file_location(script, REPO / "scripts" / f"{script}.py")
    made = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(made)
    readme = (REPO / "README.md").read_text()
    section = readme.split(f"<!-- {marker}:start -->\n", 1)[1].split(f"<!-- {marker}:end -->", 1)[0]
    assert section == made.markdown(), "run: uv run python scripts/update_readme.py"


def _pinned(package: str) -> str:
    """The exact version pyproject.toml's [tool.uv] constraint-dependencies pin for ``package``."""
    found = re.search(rf'"{package}==([^;"]+)', (REPO / "pyproject.toml").read_text())
    return found.group(1).strip() if found else ""

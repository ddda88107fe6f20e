"""The README's 'What fits where' table: `anyfit plan`'s verdict for the hardware guide's machines (a Mac with 128 GB,
an RTX 4090, an A100 80 GB, 8x L40S) on 7B, 13B and 70B models, full / LoRA / QLoRA. Model sizes are written out
(benchmarks/model_sizes.py), so nothing is downloaded; `scripts/update_readme.py` writes the table and
tests/unit/test_readme_tables.py checks it is current."""

from __future__ import annotations

import sys
from pathlib import Path

from anyfit.config import load_config
from anyfit.model.shape import shape_from_config
from anyfit.planning.ladder import plan_target
from anyfit.planning.presets import PRESETS
from anyfit.planning.time import duration_text
from anyfit.units import GIB

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))
from model_sizes import MODELS as SIZES  # noqa: E402  (benchmarks/ is not a package)

MACHINES = ("m-128", "rtx4090", "a100-80", "8xl40s")
# The hardware guide's sizes, as the published comparisons write them out (benchmarks/model_sizes.py).
MODELS = {f"{size} ({name})": SIZES[name]
          for size, name in (("7B", "Llama-2-7B"), ("13B", "Llama-2-13B"), ("70B", "Llama-3.1-70B"))}
METHODS = {"full": ["lora.enabled=false"], "LoRA": ["lora.enabled=true"],
           "QLoRA": ["lora.enabled=true", "lora.qlora=true"]}
RUN = ["data.max_length=2048", "train.effective_batch=16"]  # everything else: anyfit's defaults


def cell(plan) -> str:
    if plan.memory is None:
        return plan.verdict
    m = plan.memory
    per = "/GPU" if plan.target.device == "cuda" else ""
    parts = [f"{m.peak / GIB:.0f} GiB{per} at micro {plan.setup.micro_batch}"]
    if plan.setup.offload or plan.setup.processes > plan.target.num_devices:
        parts.append(f"host {m.host / GIB:.0f} GiB")
    parts.append(f"{duration_text(plan.seconds_per_100_steps)}/100 steps")
    return f"{plan.verdict}<br>{', '.join(parts)}"


def markdown() -> str:
    header = ["model", "method"] + [PRESETS[k].label().replace("NVIDIA ", "") for k in MACHINES]
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    for name, config in MODELS.items():
        shape = shape_from_config(config)
        for method, overrides in METHODS.items():
            cfg = load_config(None, ["model.name_or_path=guide", *RUN, *overrides])
            cells = [cell(plan_target(cfg, shape, PRESETS[k])) for k in MACHINES]
            lines.append("| " + " | ".join([name, method, *cells]) + " |")
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    print(markdown())

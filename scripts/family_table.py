"""The README's table of model families: what anyfit does for each, read off a tiny random-init model of that family
(tests/families.py: transformers' own config classes, 2 layers, windows of 8 tokens) by the very rules a run applies:
the packing self-test, LoRA's auto targets, the fused loss and tiled MLP wrappers, the sequence-parallel refusal, the
planner's parameter count against the built model, GGUF export's architecture check. Nothing is written by hand, so
a changed rule changes the table: `scripts/update_readme.py` writes it and tests/unit/test_readme_tables.py checks it
is current."""

from __future__ import annotations

import contextlib
import functools
import sys
from pathlib import Path

import numpy as np
import torch

from anyfit.config import ConfigError, LoraConfig, load_config
from anyfit.data.batching import IGNORE_INDEX, collate
from anyfit.export.request import ExportError, check_gguf_architecture
from anyfit.hardware.runtime import sequence_parallel_problem
from anyfit.model.attention import register
from anyfit.model.head import fuse_head
from anyfit.model.loading import find_lora_targets, linear_leaf_names
from anyfit.model.moe import lora_targets
from anyfit.model.packing import stateful_kinds
from anyfit.model.shape import shape_from_config
from anyfit.model.tiled import tile_mlps
from anyfit.training.packing_check import choose_packing

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))
from families import FAMILIES, tiny_config, tiny_model  # noqa: E402  (tests/ is not a package)

HEADER = ("| family (`model_type`) | packing | LoRA `auto` targets | fused loss | tiled MLP | sequence parallel "
          "| planner's parameters | GGUF export |\n|---|---|---|---|---|---|---|---|\n")


class _Examples(list):
    @property
    def lengths(self) -> np.ndarray:
        return np.array([len(e["input_ids"]) for e in self])


def _examples() -> _Examples:
    g = torch.Generator().manual_seed(1)
    out = _Examples()
    for length in (20, 5, 30, 12):
        ids = torch.randint(3, 512, (length,), generator=g).tolist()
        out.append({"input_ids": ids, "labels": [IGNORE_INDEX] * (length // 4) + ids[length // 4:]})
    return out


def _packing(family: str) -> str:
    verdict = choose_packing(tiny_model(family, "anyfit_varlen"), _examples(), functools.partial(collate, pad_id=0),
                             64, "cpu", torch.float32, contextlib.nullcontext)
    if not verdict.packed:
        return "padded batches (self-test)"
    state = ", state layers one example per row" if verdict.state == "per_example" else \
        ", state layers' kernels take the boundaries" if verdict.state else ""
    if verdict.attention != "anyfit_varlen":
        return f"exact: transformers' {verdict.attention}, block mask{state}"
    kernel = verdict.line.split("per example: ", 1)[-1]
    return ("exact: eager per example" if "eager" in kernel else
            "exact: SDPA per example, windowed" if "window" in kernel else "exact: SDPA per example") + state


def _refused(make) -> str:
    try:
        make()
    except (ConfigError, ExportError):
        return "refused"
    return "yes"


def _lora(family: str) -> str:
    """LoRA's auto targets: the linear layers, and the routed experts' fused tensors (PEFT parameters)."""
    model = tiny_model(family)
    linear = linear_leaf_names(model)
    chosen = lora_targets(model, find_lora_targets(model, "auto"), linear, LoraConfig())
    experts = [p.rsplit(".", 1)[-1] for p in chosen.parameters if ".weight" not in p]
    kept = [n for n in find_lora_targets(model, "auto") if n in linear]
    return ", ".join(kept) + (f"; experts: {', '.join(experts)}" if experts else "")


def _params(family: str) -> str:
    model = tiny_model(family)
    built = sum(p.numel() for p in model.parameters())
    shape = shape_from_config(model.config)
    cell = "exact" if shape.params == built else f"{shape.params / built:.3f} x"
    return cell + (f" (active {shape.active_params / shape.params:.0%})" if shape.active_params != shape.params else "")


def row(family: str) -> str:
    model_type, _ = FAMILIES[family]
    config = tiny_config(family)
    state = stateful_kinds(config)
    split = sequence_parallel_problem(load_config(None, ["model.name_or_path=unused", "runtime.sequence_parallel=2"]),
                                      2, config.num_attention_heads, config.num_key_value_heads, state=state)
    gguf = _refused(lambda: check_gguf_architecture({"architectures": [type(tiny_model(family)).__name__]}))
    cells = [f"`{model_type}`", _packing(family), _lora(family), _refused(lambda: fuse_head(tiny_model(family))),
             _refused(lambda: tile_mlps(tiny_model(family))), "refused" if split else "yes", _params(family), gguf]
    return "| " + " | ".join(cells) + " |\n"


def markdown() -> str:
    register()
    return HEADER + "".join(row(family) for family in FAMILIES)


if __name__ == "__main__":
    print(markdown(), end="")

"""What ``anyfit plan`` says for image LoRA runs of the 2026 vision-language models on a Mac, a T4 and an H100, from
their published sizes (nothing downloaded): the README's Images section quotes it.

Qwen3.5-9B: transformers' ``Qwen3_5Config()`` defaults are its model card's sizes (hidden 4,096, 32 layers laid out
3 Gated DeltaNet : 1 gated attention, FFN 12,288, DeltaNet heads 32 V / 16 QK of 128, attention 16 Q / 4 KV of 256,
vocabulary 248,320, untied head; a 27-layer 1,152-wide vision tower of 16-pixel patches merged 2x2), with the
tower's merger projecting to the language model's 4,096. Each example holds one 1024x1024 image: 4,096 patches,
1,024 image tokens, inside sequences of 2,048 tokens.

    uv run python benchmarks/image_plans.py
"""

from __future__ import annotations

import json
import sys
import tempfile
from dataclasses import replace
from pathlib import Path

from transformers import Qwen3_5Config

from anyfit.config import load_config
from anyfit.model.shape import shape_from_config
from anyfit.planning.presets import targets_from_args
from anyfit.planning.report import plan_dict

SIDE = 1024  # one screenshot-sized image per example
DEVICES = ("m-36", "m-128", "t4", "a100-40", "h100")


def qwen3_5_9b() -> Qwen3_5Config:
    config = Qwen3_5Config()
    config.vision_config.out_hidden_size = config.text_config.hidden_size
    return config


def main() -> None:
    config = qwen3_5_9b()
    shape = shape_from_config(config)
    shape = replace(shape, tower_patches=(SIDE // shape.tower_patch) ** 2)
    rows = []
    with tempfile.TemporaryDirectory() as folder:
        config.save_pretrained(folder)
        for train_vision in ("frozen", "lora"):
            cfg = load_config(None, [f"model.name_or_path={folder}", "lora.enabled=true", "lora.r=16",
                                     "data.max_length=2048", "train.effective_batch=16",
                                     f"model.train_vision={train_vision}"])
            for device in DEVICES:
                (target,) = plan_dict(cfg, targets_from_args(device, None, None), shape=shape)["targets"]
                rows.append({"model": "Qwen3.5-9B", "train_vision": train_vision, "device": device, **target})
    json.dump(rows, sys.stdout, indent=1, default=str)


if __name__ == "__main__":
    main()

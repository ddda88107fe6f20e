"""Per-step losses of short runs on a tiny Llama, pinned to committed references.

Any change that moves the numbers (tokenization, masking, packing, loss normalisation, optimizer,
schedule, initialisation of adapters, data order) fails here, even when every other test still passes.
When a change is meant to move them, regenerate on purpose and say why in the commit:

    ANYFIT_UPDATE_REFERENCE=1 uv run pytest tests/equivalence/test_reference_losses.py

The reference file also records the torch/transformers versions it was made with; a version bump that
moves the numbers beyond the tolerance is a change to look at, not noise.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
import torch
import transformers
from tiny_runs import config_for, write_dataset

from anyfit.training.loop import train

REFERENCE = Path(__file__).with_name("reference_losses.json")
# fp32 on CPU, same library versions: the runs are deterministic; the tolerance only absorbs a different
# BLAS code path on another CPU. A real change (one token more in a prompt, another normalisation) moves
# the losses by far more than this.
RTOL = 2e-4

VARIANTS = {
    "full_packed_chat": ["data.template=chat", "train.packing=true"],
    "full_padded_custom_template": ['data.template="Question: {prompt}\\nAnswer: "', "train.packing=false"],
    "lora_packed_accumulated": ["data.template=chat", "lora.enabled=true", "lora.dropout=0.1", "train.micro_batch=1",
                                "train.learning_rate=5e-3"],
}


def _losses(name: str, model_dir, tmp_path) -> list[float]:
    data = write_dataset(tmp_path / "d.jsonl", n=24)
    cfg = config_for(model_dir, data, tmp_path / name, "train.effective_batch=4", "train.micro_batch=2",
                     "train.max_steps=8", "train.learning_rate=1e-2", "train.warmup_steps=2", "runtime.device=cpu",
                     *VARIANTS[name])
    return train(cfg, echo=lambda *a: None).losses


@pytest.mark.parametrize("name", list(VARIANTS))
def test_losses_match_the_committed_reference(name, full_vocab_llama_dir, tmp_path):
    losses = _losses(name, full_vocab_llama_dir, tmp_path)
    assert len(losses) == 8 and all(map(torch.isfinite, torch.tensor(losses)))
    if os.environ.get("ANYFIT_UPDATE_REFERENCE"):
        stored = json.loads(REFERENCE.read_text()) if REFERENCE.is_file() else {}
        stored["versions"] = {"torch": torch.__version__, "transformers": transformers.__version__}
        stored[name] = losses
        REFERENCE.write_text(json.dumps(stored, indent=1, sort_keys=True) + "\n")
        pytest.skip(f"reference for {name} written to {REFERENCE}")
    reference = json.loads(REFERENCE.read_text())
    assert name in reference, f"no reference for {name}: regenerate (see this module's docstring)"
    assert losses == pytest.approx(reference[name], rel=RTOL), (
        f"per-step losses moved (made with {reference['versions']}); if that is intended, regenerate the reference")

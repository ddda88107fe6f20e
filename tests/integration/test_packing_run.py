"""The packing decision inside a real run: the self-test's line printed and recorded, and a packed run of a
windowed model (Mistral, window 8 tokens, examples of 10-30) or of a hybrid (Qwen3.5: linear attention, never
packed) giving the per-step losses of the same run with train.packing=false."""

from __future__ import annotations

import json

import pytest
from families import tiny_model
from tiny_runs import config_for, same_losses, write_dataset
from transformers import AutoTokenizer

from anyfit.training.loop import train

STEPS = 3


def _saved(family: str, tokenizer_dir, out):
    tok = AutoTokenizer.from_pretrained(tokenizer_dir)
    model = tiny_model(family, vocab_size=len(tok), pad_token_id=tok.pad_token_id, eos_token_id=tok.eos_token_id,
                       bos_token_id=None)
    model.save_pretrained(out)
    tok.save_pretrained(out)
    return out


@pytest.mark.slow
@pytest.mark.parametrize("family, packed_line", [
    ("mistral", "packing: self-test passed"),
    ("qwen3_5", "packing: off for this model (its 'linear_attention' layers carry a state along the row"),
])
def test_packed_run_equals_padded_run(family, packed_line, qwen_tokenizer_dir, tmp_path):
    model_dir = _saved(family, qwen_tokenizer_dir, tmp_path / "model")
    data = write_dataset(tmp_path / "d.jsonl", n=16)
    runs, said = {}, []
    for packing in ("true", "false"):
        cfg = config_for(model_dir, data, tmp_path / packing, "train.learning_rate=1e-2", f"train.packing={packing}",
                         f"train.max_steps={STEPS}", "train.effective_batch=4", "train.micro_batch=2")
        runs[packing] = train(cfg, echo=said.append if packing == "true" else lambda *a: None)
    assert same_losses(runs["true"].losses, runs["false"].losses, STEPS)
    assert any(packed_line in line for line in said), said
    info = json.loads((tmp_path / "true" / "run_info.json").read_text())
    assert info["packing"]["packed"] is (family != "qwen3_5")
    assert "packing" not in json.loads((tmp_path / "false" / "run_info.json").read_text())

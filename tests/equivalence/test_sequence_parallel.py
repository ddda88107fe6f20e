"""Sequence parallelism (``runtime.sequence_parallel``, DeepSpeed's Ulysses) with real processes over gloo: each
sequence cut in two, one part per process, and the run is the one-process run's: the same losses per step, the
same weights, the same validation loss, padded or packed, replicated or sharded, full or LoRA, with the tiled MLP,
with accumulation (effective batch 8 in micro-batches of 2); and its checkpoint continues unsplit.

Tolerance, as for sharding (test_sharded.py): the split changes only the order of fp32 sums (each part's loss,
the all-reduce of partial gradients, attention over the whole sequence for half of the heads), about 1e-7
relative per reduction; measured here about 2e-7 on the losses."""

from __future__ import annotations

import json
import shutil

import pytest
import torch
from launches import launch, losses, run_config, run_here
from safetensors.torch import load_file
from tiny_runs import read_metrics

pytestmark = [pytest.mark.multiprocess, pytest.mark.multirun]
pytest.importorskip("deepspeed")

SPLIT = "runtime.sequence_parallel=2"


@pytest.fixture(scope="module")
def split_run(tiny_llama_dir, tmp_path_factory):
    tmp = tmp_path_factory.mktemp("split")
    out = tmp / "out"
    log = launch(run_config(tmp, tiny_llama_dir), out, 2, SPLIT, "runtime.sharding=none")
    return tmp, out, log


def test_split_sequences_train_as_one_process_does(split_run, unsharded):
    _, out, log = split_run
    assert "each sequence split over 2 processes (DeepSpeed Ulysses), 1 data-parallel group" in log
    assert losses(out) == pytest.approx(losses(unsharded), rel=2e-4)
    a, b = load_file(unsharded / "model.safetensors"), load_file(out / "model.safetensors")
    for k in a:
        torch.testing.assert_close(b[k], a[k], rtol=1e-3, atol=2e-5)
    # the group's two processes share their examples: the tokens are counted once
    ours, theirs = read_metrics(out), read_metrics(unsharded)
    assert [m["real_tokens"] for m in ours if "loss" in m] == [m["real_tokens"] for m in theirs if "loss" in m]


def test_sharded_lora_over_split_sequences_trains_as_one_process_does_and_leaves_an_adapter_peft_loads(
        tiny_llama_dir, tmp_path):
    """LoRA adapters over split sequences (their gradients the reduced sum of each part's), FSDP2-sharded over the
    same two processes, with a validation loss on the way (its no-grad forwards must not leave gathered weights
    behind), four steps: the one-process run's losses and adapter; each process holds half, and process 1 built
    base and adapters on the meta device and received both; the adapter loads with PEFT, and its checkpoint
    continues replicated and exports as an adapter without the two processes that wrote it. (The sharded LoRA run
    of test_sharded.py, on this module's launch.)"""
    lora = ("lora: {enabled: true, dropout: 0.0}", "eval: {holdout: 4, every: 2}")
    one, split = tmp_path / "one", tmp_path / "split"
    run_here(run_config(tmp_path, tiny_llama_dir, *lora), one, "train.max_steps=4")
    launch(run_config(tmp_path, tiny_llama_dir, *lora), split, 2, SPLIT, "runtime.sharding=fsdp", "train.max_steps=4")
    assert losses(split) == pytest.approx(losses(one), rel=2e-4)
    vals = [[m["val_loss"] for m in read_metrics(o) if "val_loss" in m] for o in (one, split)]
    assert len(vals[1]) == 2 and vals[1] == pytest.approx(vals[0], rel=2e-4)
    a, b = load_file(one / "adapter_model.safetensors"), load_file(split / "adapter_model.safetensors")
    assert a.keys() == b.keys() and a
    for k in a:
        torch.testing.assert_close(b[k], a[k], rtol=1e-3, atol=2e-5)
    assert any(k.endswith("lora_B.weight") and v.abs().sum() > 0 for k, v in b.items())
    info = json.loads((split / "run_info.json").read_text())
    total = info["parameters"]["total"]
    assert all(abs(params - total / 2) <= 0.02 * total for params in info["held_per_process"]["parameters"])
    assert info["held_per_process"]["loaded_parameters"] == [total, 0]
    from peft import AutoPeftModelForCausalLM

    assert AutoPeftModelForCausalLM.from_pretrained(split) is not None
    # its checkpoint continues replicated and unsplit, on one process (in this one): the adapter and its optimizer
    # state carried over, whole tensors filled from both processes' shards
    again = tmp_path / "again"
    again.mkdir()
    shutil.copytree(split / "checkpoint-2", again / "checkpoint-2")
    run_here(run_config(tmp_path, tiny_llama_dir, *lora), again, "runtime.sharding=none", "train.max_steps=4",
             "train.resume=auto")
    assert losses(again) == pytest.approx(losses(split)[2:], rel=2e-4)
    from anyfit.export.folder import export

    assert export(split / "checkpoint-2", tmp_path / "exported", echo=lambda *a: None).merged_adapter


def test_a_split_checkpoint_continues_unsplit(split_run, unsharded, tiny_llama_dir):
    """The data order never depended on the split: its checkpoint continues on one process, as written."""
    tmp, out, _ = split_run
    again = tmp / "again"
    again.mkdir()
    shutil.copytree(out / "checkpoint-4", again / "checkpoint-4")
    log = run_here(run_config(tmp, tiny_llama_dir), again, "train.resume=auto")
    assert "resumed from" in log and "at step 4" in log
    assert losses(again) == pytest.approx(losses(unsharded)[4:], rel=2e-4)


def _long_examples(folder) -> str:
    """24 prompt/completion pairs of 40 to 200 words (about 60 to 330 tokens): longer than the tiny model's
    hidden size (32), so a process's part of a sequence is still cut into MLP tiles; in two files, mixed
    (``data.mix``), so the loss per source is split with the sequences too."""
    words = ["red", "green", "blue", "cyan", "gold", "pink", "gray", "navy"]
    paths = [folder / "long-even.jsonl", folder / "long-odd.jsonl"]
    files = [path.open("w") for path in paths]
    for i in range(24):
        k = 40 + 7 * i
        files[i % 2].write(json.dumps({"prompt": "Repeat " + " ".join(words[(i + j) % 8] for j in range(k)),
                                       "completion": " ".join(words[(i + 3 * j) % 8] for j in range(k // 2))}) + "\n")
    for f in files:
        f.close()
    return f"data.mix=[{{path: {paths[0]}, name: even}}, {{path: {paths[1]}, name: odd}}]"


def test_long_packed_rows_split_under_fsdp_with_every_saver_and_validation_match_one_process(tiny_llama_dir,
                                                                                            tmp_path):
    """Long packed rows (boundaries kept whole across the cut), FSDP2 sharding over the same two processes, the
    tiled MLP and the fused loss on each process's part, and the validation loss (each process computing its part
    of every held-out sequence), each per data source too, against one process with none of them."""
    data = (_long_examples(tmp_path), "data.path=")
    extra = ("eval: {holdout: 2, every: 2}",)  # two held-out records of each source
    one, split = tmp_path / "one", tmp_path / "split"
    run_here(run_config(tmp_path, tiny_llama_dir, *extra), one, *data, "train.max_steps=4")
    log = launch(run_config(tmp_path, tiny_llama_dir, *extra), split, 2, *data, "train.max_steps=4",
                 SPLIT, "runtime.sharding=fsdp", "train.packing=true", "model.tiled_mlp=true", "train.fused_loss=true")
    assert "sequence split over 2 processes" in log
    assert losses(split) == pytest.approx(losses(one), rel=2e-4)
    for key in ("val_loss", "val_loss/even", "val_loss/odd", "loss/even", "loss/odd", "trainable_tokens/odd"):
        values = [[m[key] for m in read_metrics(o) if key in m] for o in (one, split)]
        assert len(values[0]) == (2 if key.startswith("val") else 4) and values[1] == pytest.approx(values[0], rel=2e-4)
    assert json.loads((split / "run_info.json").read_text())["held_per_process"]["loaded_parameters"][1] == 0

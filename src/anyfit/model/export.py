"""``anyfit export``: a training run, or any model folder, as a standalone model another tool can use.

A LoRA adapter is merged into its base (PEFT ``merge_and_unload``); the result is written in one dtype as a
transformers folder with the tokenizer, the generation config and a model card (README.md) that says what
the model is and how it was made. Optionally, GGUF files for llama.cpp and the tools built on it (each one
loaded back and compared with the merged model before the export counts as done), and an upload of the
folder to the Hugging Face Hub.

The folder is written under a temporary name next to ``out`` and renamed at the end, so a failed or
interrupted export never leaves something that looks finished.
"""

# Which GGUF converter, and why.
#
# llama.cpp's own converter (convert_hf_to_gguf.py) lives in the llama.cpp repository and is not
# published on PyPI by its maintainers. What PyPI offers:
# - ``gguf`` (already a dependency of anyfit, pinned): llama.cpp's own Python package, published by
#   ggml-org from the same repository. It carries the file writer (GGUFWriter), the reference
#   quantizers in numpy (F32, F16, BF16, Q8_0, Q5_1, Q5_0, Q4_1, Q4_0, TQ1_0/TQ2_0; the K-quants only
#   dequantize), llama.cpp's tensor-name tables per architecture and the reader of special tokens and
#   chat templates. It does not carry the Hugging Face -> GGUF conversion script.
# - ``convert-hf-to-gguf`` 0.1.1: a repackaging of llama.cpp's conversion script by a third party, not by
#   ggml-org (uploaded by an individual, its repository under an anonymous-looking account with one
#   commit; the author field just says "GGML"). Its code reads as upstream's, but the wheel also ships its
#   own top-level ``gguf`` package (a newer snapshot of llama.cpp's), which installs over the ``gguf``
#   distribution anyfit and transformers' GGUF reader depend on: two distributions owning the same files,
#   where which copy wins depends on install order and removing either breaks the other. It also needs
#   sentencepiece (even for BPE models). Not a well-kept dependency to put next to a pinned ``gguf``.
# - llama-cpp-python compiles llama.cpp from source; other PyPI "converters" are small one-off projects.
#
# So the file is written with ``gguf`` itself: its writer, quantizers, tensor-name map and special-vocab
# reader do the format work, and this module adds only what the conversion script would decide for the
# architectures anyfit checks here: Llama (also SmolLM, and Mistral's architecture), Qwen2/2.5 and Qwen3, with
# a byte-level BPE tokenizer (llama.cpp's "gpt2" vocabulary; SentencePiece ones such as Llama 2's are not). Anything else is refused with a one-line error that
# names llama.cpp's script. Every file is loaded back with transformers (which dequantizes) and compared
# with the merged model before the export is kept (``check_gguf``).

from __future__ import annotations

import json
import math
import shutil
import tempfile
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from anyfit.config import ConfigError, load_config
from anyfit.model.loading import ModelLocation, load_for_inference, locate_model

DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}
_DTYPE_NAMES = {"float32": "fp32", "bfloat16": "bf16", "float16": "fp16"}

# GGUF types the numpy quantizers of ``gguf`` write.
GGUF_TYPES = ("f32", "f16", "bf16", "q8_0", "q5_1", "q5_0", "q4_1", "q4_0")
# How far the model transformers reads from a GGUF file may be from the merged model with its weights rounded
# to the file's types: max |logit difference| at a position, as a share of the spread (max - min) of the
# logits there. The weights are then the same numbers, so only the order of float operations differs
# (measured: exactly 0 for every type); a conversion error (a q/k permutation missing, a wrong tensor, norm or rope
# setting) lands at 0.3 and above at every width, which is why the check is not against the unrounded model:
# at 4 bits on a small model honest rounding alone moves the logits that far (see the README).
CONVERSION_TOLERANCE = 1e-3
# Types only llama.cpp's compiled llama-quantize makes (gguf's Python code can read them, not write them).
LLAMA_QUANTIZE_ONLY = ("q2_k", "q3_k_s", "q3_k_m", "q3_k_l", "q4_k_s", "q4_k_m", "q5_k_s", "q5_k_m", "q6_k",
                       "iq4_xs", "iq4_nl", "iq3_m", "iq3_xxs", "iq2_m", "iq2_xs", "iq2_xxs", "iq1_s", "iq1_m")

VERIFY_PROMPTS = ("The capital of France is", "def fibonacci(n):\n    return",
                  "Question: Tom has 12 apples and gives away 5. How many are left?\nAnswer:",
                  "Once upon a time, in a quiet village by the sea,")
VERIFY_NEW_TOKENS = 8


class ExportError(ConfigError):
    """An export that cannot be done as asked; the message says why (printed as ``anyfit: error: ...``)."""


@dataclass
class GGUFAgreement:
    """How a GGUF file, read back by transformers, compares with the merged model on the check prompts."""

    type: str
    conversion_diff: float  # max |logit diff| / logit spread against the merged model with rounded weights
    max_abs_diff: float  # against the merged model itself: largest |logit difference| over prompts and positions
    max_rel_diff: float  # the same, as a share of the merged model's logit spread at that position
    top1_agreement: float  # share of positions where both pick the same next token
    greedy_match: int  # prompts whose greedy continuation (VERIFY_NEW_TOKENS tokens) is identical
    prompts: int

    @property
    def ok(self) -> bool:
        return self.conversion_diff <= CONVERSION_TOLERANCE

    def describe(self) -> str:
        return (f"{self.type}: equal to the merged model with {self.type}-rounded weights within "
                f"{self.conversion_diff:.1e} of the logit spread (allowed {CONVERSION_TOLERANCE:.0e}); against the "
                f"merged model itself max |logit diff| {self.max_abs_diff:.3g} ({self.max_rel_diff:.1%} of the "
                f"spread), same top token at {self.top1_agreement:.1%} of positions, same greedy continuation "
                f"for {self.greedy_match}/{self.prompts} prompts")


@dataclass
class ExportResult:
    out: Path
    dtype: str
    merged_adapter: bool
    gguf: dict[str, Path] = field(default_factory=dict)
    agreement: dict[str, GGUFAgreement] = field(default_factory=dict)
    pushed: str | None = None


@dataclass(frozen=True)
class _Request:
    """An export request whose inputs have all been checked (before any weights are loaded)."""

    run: Path
    out: Path
    location: ModelLocation
    dtype: str
    dtype_reason: str
    gguf_types: tuple[str, ...]
    run_files: RunFiles
    eval_summary: dict[str, Any] | None
    push: str | None


# Checking the request


def export(run: str | Path, out: str | Path | None = None, *, dtype: str | None = None,
           gguf: str | list[str] | tuple[str, ...] = (), push: str | None = None, private: bool = False,
           overwrite: bool = False, eval_summary: str | Path | None = None, command: str | None = None,
           api=None, echo=print) -> ExportResult:
    """Export ``run`` (a training output folder, a checkpoint or any model folder) to ``out``.

    ``dtype``: bf16, fp16 or fp32 (default: the base model's recorded dtype, else bf16). ``gguf``: GGUF
    types to write next to the weights (``GGUF_TYPES``), each checked by ``check_gguf``. ``push``: a Hub
    repository to upload the folder to (``private`` creates it private); ``api`` is the
    ``huggingface_hub.HfApi`` to use (default: one with the token of the environment or ``hf auth login``).
    ``eval_summary``: an ``anyfit eval`` summary.json to report in the model card. ``command``: the command
    line to record in the card. Every input is checked before any weights load (``check_request``).
    """
    req = check_request(run, out, dtype=dtype, gguf=gguf, push=push, overwrite=overwrite,
                        eval_summary=eval_summary, api=api)
    echo(f"[anyfit] export: {req.run} -> {req.out} ({req.dtype}: {req.dtype_reason})")
    req.out.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{req.out.name}.", suffix=".partial", dir=req.out.parent))
    try:
        result = _export_into(req, tmp, command, echo)
        if req.out.exists():  # only reached with overwrite (checked in check_request)
            shutil.rmtree(req.out)
        tmp.rename(req.out)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    result.out = req.out
    result.gguf = {t: req.out / p.name for t, p in result.gguf.items()}
    echo(f"[anyfit] export: wrote {req.out}")
    if req.push:
        result.pushed = push_folder(req.out, req.push, private=private, api=api, echo=echo)
    return result


def check_request(run, out=None, *, dtype=None, gguf=(), push=None, overwrite=False, eval_summary=None,
                  api=None) -> _Request:
    """Every input checked, each problem a one-line ExportError, before anything heavy happens."""
    run_path = Path(run).expanduser()
    if not run_path.exists():
        raise ExportError(f"{run_path} does not exist: give a training output folder (train.output_dir) or a "
                          "model folder (config.json + weights).")
    if not run_path.is_dir():
        raise ExportError(f"{run_path} is not a folder: give a training output folder or a model folder "
                          "(a .gguf file is already an export).")
    _refuse_unfinished_run(run_path)
    location = locate_model(run_path)  # a folder without config.json/adapter_config.json: one-line error
    if dtype is not None and dtype not in DTYPES:
        raise ExportError(f"--dtype {dtype!r} is not one of {', '.join(DTYPES)}.")
    gguf_types = _gguf_types(gguf)
    run_files = RunFiles.find(run_path)
    if gguf_types:
        _check_gguf_support(location)
    out_path = Path(out).expanduser() if out else run_path.parent / f"{run_path.name}-export"
    _check_out(out_path, run_path, overwrite)
    summary = _read_eval_summary(eval_summary) if eval_summary else None
    if push:
        _check_push(push, api)
    name, reason = (dtype, "as asked") if dtype else default_dtype(run_path, location, run_files)
    return _Request(run_path, out_path, location, name, reason, gguf_types, run_files, summary, push)


def _refuse_unfinished_run(run: Path) -> None:
    from anyfit.training.checkpoint import PREFIX

    if (run / "config.json").is_file() or (run / "adapter_config.json").is_file():
        return
    checkpoints = sorted((p for p in run.glob(f"{PREFIX}*") if p.is_dir() and p.name[len(PREFIX):].isdigit()),
                         key=lambda p: int(p.name[len(PREFIX):]))
    if checkpoints or (run / "config.yaml").is_file():
        hint = (f" Export its newest checkpoint ({checkpoints[-1]}), or finish the run with train.resume=auto."
                if checkpoints else " Its final model is written when training ends.")
        raise ExportError(f"{run} is an unfinished training run: it holds no final model (config.json or "
                          f"adapter_config.json).{hint}")


def _gguf_types(gguf) -> tuple[str, ...]:
    types = [gguf] if isinstance(gguf, str) else list(gguf or ())
    types = [t.strip().lower() for item in types for t in item.split(",") if t.strip()]
    for t in types:
        if t in LLAMA_QUANTIZE_ONLY:
            raise ExportError(f"--gguf {t}: gguf's Python quantizers cannot write {t}; export f16 and run "
                              f"llama.cpp's `llama-quantize MODEL-F16.gguf MODEL-{t.upper()}.gguf {t.upper()}`, or "
                              f"pick one of {', '.join(GGUF_TYPES)}.")
        if t not in GGUF_TYPES:
            raise ExportError(f"--gguf {t!r} is not a GGUF type this export writes; choose from "
                              f"{', '.join(GGUF_TYPES)}.")
    if types:
        try:
            import gguf as _  # noqa: F401
        except ImportError:
            raise ExportError("GGUF export needs the 'gguf' package (llama.cpp's, a dependency of anyfit that is "
                              "missing here): `uv sync` in the anyfit repository, or pip install gguf==0.19.0."
                              ) from None
    return tuple(dict.fromkeys(types))


def _check_out(out: Path, run: Path, overwrite: bool) -> None:
    out_r, run_r = out.resolve(), run.resolve()
    if out_r == run_r or out_r in run_r.parents:
        raise ExportError(f"--out {out} would replace the model being exported ({run}); choose another folder.")
    if out.exists() and not overwrite:
        raise ExportError(f"--out {out} already exists; choose another folder or pass --overwrite to replace it.")
    if out.exists() and not out.is_dir():
        raise ExportError(f"--out {out} is a file, not a folder.")
    existing = next(p for p in out.absolute().parents if p.exists())  # missing folders above are created
    if not existing.is_dir():
        raise ExportError(f"--out {out}: {existing} is a file, not a folder.")


def _read_eval_summary(path) -> dict[str, Any]:
    p = Path(path).expanduser()
    if not p.is_file():
        raise ExportError(f"--eval-summary {p}: no such file (anyfit eval writes summary.json in its --out folder).")
    try:
        summary = json.loads(p.read_text(encoding="utf-8"))
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise ExportError(f"--eval-summary {p} is not valid JSON ({e}).") from None
    if not isinstance(summary, dict) or "accuracy" not in summary:
        raise ExportError(f"--eval-summary {p} is not an anyfit eval summary (no 'accuracy').")
    return summary


def _check_push(repo: str, api) -> None:
    from huggingface_hub import get_token
    from huggingface_hub.utils import HFValidationError, validate_repo_id

    try:
        validate_repo_id(repo)
    except HFValidationError as e:
        raise ExportError(f"--push {repo!r} is not a Hub repository id (owner/name): {e}") from None
    token = getattr(api, "token", None) if api is not None else None
    if not (token or get_token()):
        raise ExportError("--push needs a Hugging Face token with write access: set HF_TOKEN or run "
                          "`hf auth login`.")


def default_dtype(run: Path, location: ModelLocation, run_files: RunFiles) -> tuple[str, str]:
    """The dtype recorded in the base model's config.json (the adapter's base; the base a full fine-tune
    started from; a plain model folder's own), else bf16. ``(name, reason)``."""
    if location.adapter:
        base = location.base
    elif run_files.config is not None:
        base = run_files.config.model.name_or_path
    else:
        base = str(run)
    recorded = _recorded_dtype(base, run_files.config.model.revision if run_files.config else None)
    if recorded:
        return recorded, f"the base model's dtype ({base})"
    return "bf16", f"no dtype recorded for the base model ({base})"


def _recorded_dtype(base: str, revision: str | None) -> str | None:
    path = Path(base).expanduser()
    config = path / "config.json" if path.is_dir() else None
    if config is None and _looks_like_hub_id(base):
        from huggingface_hub import try_to_load_from_cache

        cached = try_to_load_from_cache(base, "config.json", revision=revision)  # a hub id: only if cached
        config = Path(cached) if isinstance(cached, str) else None
    if config is None or not config.is_file():
        return None
    data = json.loads(config.read_text())
    return _DTYPE_NAMES.get(data.get("dtype") or data.get("torch_dtype") or "")


# What the training run left: config.yaml, metrics.jsonl, run_info.json


@dataclass
class RunFiles:
    """The files a training run left next to its model (absent for a plain model folder)."""

    config_path: Path | None = None
    config: Any = None  # anyfit.config.Config
    metrics: list[dict[str, Any]] = field(default_factory=list)
    run_info: dict[str, Any] = field(default_factory=dict)

    @staticmethod
    def find(folder: Path) -> RunFiles:
        """A checkpoint folder carries config.yaml; its metrics and run_info are in the run folder above it,
        and only the metric lines up to its step describe it."""
        from anyfit.training.checkpoint import PREFIX

        files = RunFiles()
        if (folder / "config.yaml").is_file():
            files.config_path = folder / "config.yaml"
            try:
                files.config = load_config(files.config_path)
            except ConfigError as e:
                raise ExportError(f"{files.config_path} is not a readable anyfit config: {e}") from None
        step = None
        run_dir = folder
        if folder.name.startswith(PREFIX) and folder.name[len(PREFIX):].isdigit():
            step, run_dir = int(folder.name[len(PREFIX):]), folder.parent
        if (run_dir / "metrics.jsonl").is_file():
            for line in (run_dir / "metrics.jsonl").read_text().splitlines():
                try:
                    record = json.loads(line)
                except json.JSONDecodeError:
                    continue  # a line cut short by an interrupted write
                if isinstance(record, dict) and (step is None or record.get("step", 0) <= step):
                    files.metrics.append(record)
        if (run_dir / "run_info.json").is_file():
            try:
                files.run_info = json.loads((run_dir / "run_info.json").read_text())
            except json.JSONDecodeError:
                files.run_info = {}
        return files

    def final_metrics(self) -> dict[str, tuple[int, float]]:
        """The last value of each headline metric with its step: loss, val_loss, gen_accuracy."""
        last: dict[str, tuple[int, float]] = {}
        for record in self.metrics:
            for key in ("loss", "val_loss", "gen_accuracy"):
                value = record.get(key)
                if isinstance(value, (int, float)) and not math.isnan(value):
                    last[key] = (record.get("step", 0), value)
        return last


# The export itself


def _export_into(req: _Request, folder: Path, command: str | None, echo) -> ExportResult:
    # Loaded in the export dtype, not fp32 then cast: PEFT computes the LoRA delta in fp32 on the CPU and
    # adds it once, and a 7B model in fp32 would need twice the memory of the bf16 one.
    model, tokenizer = load_for_inference(req.run, device="cpu", dtype=DTYPES[req.dtype], merge_lora=True)
    result = ExportResult(req.out, req.dtype, merged_adapter=req.location.adapter is not None)
    if result.merged_adapter:
        echo(f"[anyfit] export: merged the LoRA adapter into {req.location.base}")
    model.save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    if req.run_files.config_path is not None:  # anyfit eval/generate then lay prompts out as in training
        shutil.copyfile(req.run_files.config_path, folder / "config.yaml")
    parameters = sum(p.numel() for p in model.parameters())
    if req.gguf_types:
        reference = reference_outputs(model.to(torch.float32), tokenizer)  # bf16/fp16 widen exactly
        del model
        for qtype in req.gguf_types:
            path = folder / f"{req.out.name}-{qtype.upper()}.gguf"
            write_gguf(folder, path, qtype, name=req.out.name, echo=echo)
            agreement = check_gguf(path, folder, tokenizer, reference, qtype)
            echo(f"[anyfit] export: GGUF {agreement.describe()}")
            if not agreement.ok:
                raise ExportError(f"the {qtype} GGUF file does not hold the merged model: {agreement.describe()}. "
                                  "The export was not kept; the conversion is wrong for this model (please report "
                                  "it with the model's config.json).")
            if agreement.greedy_match < agreement.prompts / 2:
                echo(f"[anyfit] export: warning: {qtype} rounding changes this model's greedy output on "
                     f"{agreement.prompts - agreement.greedy_match} of {agreement.prompts} check prompts; a wider "
                     "type (q8_0, f16) stays closer to it.")
            result.gguf[qtype], result.agreement[qtype] = path, agreement
    (folder / "README.md").write_text(model_card(req, result, parameters, command), encoding="utf-8")
    return result


# The model card


def model_card(req: _Request, result: ExportResult, parameters: int, command: str | None) -> str:
    """README.md: front matter for the Hub, then what the model is, what it was trained on and how."""
    import anyfit
    from anyfit.hardware.runtime import versions

    cfg = req.run_files.config
    base = cfg.model.name_or_path if cfg is not None else (req.location.base if req.location.adapter else None)
    data_source = cfg.data.path if cfg is not None else None
    front = ["---", "library_name: transformers", "pipeline_tag: text-generation"]
    if base and _looks_like_hub_id(base):
        front.append(f"base_model: {base}")
    if data_source and _looks_like_hub_id(data_source):
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
        lines += [f"A supervised fine-tune of `{base}` made with anyfit ({method}).", ""]
    else:
        lines += [f"`{req.run}` exported with anyfit.", ""]
    lines += ["## Model", ""]
    if base:
        revision = f" (revision `{cfg.model.revision}`)" if cfg is not None and cfg.model.revision else ""
        lines.append(f"- Base model: `{base}`{revision}")
    lines.append(f"- Weights: {result.dtype} safetensors, {parameters / 1e6:.1f}M parameters")
    lines.append("")
    lines += _gguf_section(result)
    if cfg is not None:
        lines += _data_section(cfg, req.run_files.run_info)
        lines += _training_section(cfg, req.run_files)
    lines += _results_section(req.run_files, req.eval_summary)
    lines += _usage_section(req.out.name, cfg)
    lines += ["## How this was made", "", "```", command or f"anyfit.model.export.export({str(req.run)!r})", "```", ""]
    v = versions()
    made_with = f"anyfit {anyfit.__version__}, transformers {v['transformers']}, torch {v['torch']}, peft {v['peft']}."
    lines += [made_with, ""]
    return "\n".join(front + lines)


def _gguf_section(result: ExportResult) -> list[str]:
    if not result.gguf:
        return []
    prompts = next(iter(result.agreement.values())).prompts
    intro = ("For llama.cpp and the tools built on it (e.g. `llama-cli -m FILE.gguf`). Each file was read back with "
             "transformers: it holds exactly the merged model with its weights rounded to the file's types, and the "
             f"columns say how far that rounding moves it from the merged model on {prompts} check prompts.")
    lines = ["## GGUF", "", intro, "",
             "| file | type | size | max logit change | share of logit spread | same top token | same greedy text |",
             "| --- | --- | --- | --- | --- | --- | --- |"]
    for qtype, path in result.gguf.items():
        a = result.agreement[qtype]
        lines.append(f"| `{path.name}` | {qtype} | {path.stat().st_size / 2**20:.1f} MiB | {a.max_abs_diff:.3g} | "
                     f"{a.max_rel_diff:.1%} | {a.top1_agreement:.1%} | {a.greedy_match}/{a.prompts} |")
    return lines + [""]


def _looks_like_hub_id(name: str) -> bool:
    from anyfit.hub import looks_local

    return name.count("/") == 1 and not looks_local(name)


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


def _usage_section(name: str, cfg) -> list[str]:
    chat = cfg is None or cfg.data.template == "chat"
    prompt = ('tok.apply_chat_template([{"role": "user", "content": "Hello!"}], add_generation_prompt=True, '
              'return_tensors="pt", return_dict=True)' if chat else 'tok("YOUR PROMPT", return_tensors="pt")')
    return ["## Usage", "", "```python", "from transformers import AutoModelForCausalLM, AutoTokenizer", "",
            f'model = AutoModelForCausalLM.from_pretrained("{name}")', f'tok = AutoTokenizer.from_pretrained("{name}")',
            f"inputs = {prompt}", "out = model.generate(**inputs, max_new_tokens=128)",
            'print(tok.decode(out[0][inputs["input_ids"].shape[1]:], skip_special_tokens=True))', "```", ""]


# GGUF: writing


@dataclass(frozen=True)
class _GGUFArch:
    arch: str  # gguf.MODEL_ARCH member name
    permute_qk: bool  # llama.cpp's llama layout interleaves the rotary halves of q/k (transformers undoes it)


_GGUF_ARCHS = {"LlamaForCausalLM": _GGUFArch("LLAMA", True), "MistralForCausalLM": _GGUFArch("LLAMA", True),
               "Qwen2ForCausalLM": _GGUFArch("QWEN2", False), "Qwen3ForCausalLM": _GGUFArch("QWEN3", False)}

# llama.cpp's pre-tokenizer names and the splitting each stands for (its llama-vocab.cpp), tried in order
# against the tokenizer's own pre-tokenizer on PROBE_TEXT. Several expressions apply one after the other.
_CONTRACTIONS = r"(?:'[sS]|'[tT]|'[rR][eE]|'[vV][eE]|'[mM]|'[lL][lL]|'[dD])"
_GPT2 = r"'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+"
_PRE_TOKENIZERS = {
    "qwen2": (_CONTRACTIONS + r"|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+",),
    "llama-bpe": (_CONTRACTIONS + r"|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+"
                  r"|\s+(?!\S)|\s+",),
    "smollm": (r"\p{N}", _GPT2),
    "gpt-2": (_GPT2,),
}
PROBE_TEXT = ("Hello world! I'm here, you'll see: DON'T stop.\n\n\tIndented  twice   spaces 12 345 67890 "
              "3.14159 $1,000.50 ab12cd x=y+z; foo_bar(baz) -> {'k': [1, 2]}\r\nhéllo wörld Ünïcode "
              "日本語テキスト 🙂🙂 end...   \n  \n")


def _check_gguf_support(location: ModelLocation) -> None:
    """Refuse, before any weights load, a model this writer does not convert. Reads the base's config.json
    and the tokenizer.json from their folders or the local hub cache; what is not at hand is checked when
    the GGUF file is written (from the exported folder)."""
    config, tok_json = _local_json(location.base, "config.json"), _local_json(location.tokenizer, "tokenizer.json")
    if config is not None:
        _check_gguf_architecture(config)
    if tok_json is not None:
        _check_gguf_tokenizer(tok_json)


def _local_json(name_or_path: str, filename: str) -> dict | None:
    path = Path(name_or_path).expanduser()
    if path.is_dir():
        return _read_json(path / filename) if (path / filename).is_file() else None
    if _looks_like_hub_id(name_or_path):
        from huggingface_hub import try_to_load_from_cache

        cached = try_to_load_from_cache(name_or_path, filename)
        return _read_json(Path(cached)) if isinstance(cached, str) else None
    return None


def _check_gguf_architecture(config: dict) -> None:
    archs = config.get("architectures") or []
    if not any(a in _GGUF_ARCHS for a in archs):
        raise ExportError(f"GGUF export handles {', '.join(_GGUF_ARCHS)}; this model is "
                          f"{', '.join(archs) or 'of an unrecorded architecture'}. Export without --gguf and convert "
                          "the folder with llama.cpp's convert_hf_to_gguf.py.")


def _check_gguf_tokenizer(tok_json: dict) -> None:
    model = tok_json.get("model") or {}
    if model.get("type") != "BPE" or not _is_byte_level(tok_json):
        kind = f"a {model.get('type')}" if model.get("type") else "an unrecognised"
        raise ExportError("GGUF export handles byte-level BPE tokenizers (Llama 3, Qwen, SmolLM, GPT-2 style); this "
                          f"model's tokenizer is {kind} one (SentencePiece-style tokenizers such as Llama 2's and "
                          "Mistral's are not converted here). Export without --gguf and convert the folder with "
                          "llama.cpp's convert_hf_to_gguf.py.")


def _is_byte_level(tok_json: dict) -> bool:
    def has(node) -> bool:
        if isinstance(node, dict):
            return node.get("type") == "ByteLevel" or any(has(v) for v in node.values())
        if isinstance(node, list):
            return any(has(v) for v in node)
        return False

    return has(tok_json.get("pre_tokenizer")) or has(tok_json.get("decoder"))


def _read_json(path: Path) -> dict:
    return json.loads(path.read_text(encoding="utf-8")) if path.is_file() else {}


def llama_cpp_pre_tokenizer(tokenizer) -> str:
    """llama.cpp's name for how ``tokenizer`` splits text before BPE, found by splitting PROBE_TEXT both
    ways; an ExportError if none of the known ones splits it the same (llama.cpp would tokenize differently)."""
    import regex

    backend = tokenizer.backend_tokenizer
    text = backend.normalizer.normalize_str(PROBE_TEXT) if backend.normalizer is not None else PROBE_TEXT
    split = ([(text, (0, len(text)))] if backend.pre_tokenizer is None
             else backend.pre_tokenizer.pre_tokenize_str(text))
    pieces = [text[a:b] for _, (a, b) in split]
    for name, expressions in _PRE_TOKENIZERS.items():
        candidate = [text]
        for expression in expressions:
            pattern = regex.compile(expression)
            candidate = [piece for part in candidate for piece in _split_keeping_gaps(pattern, part)]
        if candidate == pieces:
            return name
    raise ExportError("GGUF export: this tokenizer splits text before BPE in a way none of llama.cpp's known "
                      f"pre-tokenizers ({', '.join(_PRE_TOKENIZERS)}) does; convert the exported folder with "
                      "llama.cpp's convert_hf_to_gguf.py.")


def _split_keeping_gaps(pattern, text: str) -> list[str]:
    """The matches and the text between them, in order (how tokenizers' and llama.cpp's splits work)."""
    pieces, pos = [], 0
    for m in pattern.finditer(text):
        if m.start() > pos:
            pieces.append(text[pos:m.start()])
        if m.end() > m.start():
            pieces.append(m.group())
        pos = m.end()
    if pos < len(text):
        pieces.append(text[pos:])
    return pieces


def _tensor_type(qtype: str, gguf_name: str, shape: tuple[int, ...]):
    """GGML type of one tensor in a ``qtype`` file, as llama.cpp's converter decides it: 1-D tensors (norms,
    biases) stay F32; rows that do not split into whole quantization blocks fall back to F16; in the 4- and
    5-bit files the embeddings and the output head, the most sensitive matrices, get Q8_0 (llama-quantize
    would give them Q6_K, which gguf cannot write)."""
    import gguf

    types = {"f32": gguf.GGMLQuantizationType.F32, "f16": gguf.GGMLQuantizationType.F16,
             "bf16": gguf.GGMLQuantizationType.BF16, "q8_0": gguf.GGMLQuantizationType.Q8_0,
             "q5_1": gguf.GGMLQuantizationType.Q5_1, "q5_0": gguf.GGMLQuantizationType.Q5_0,
             "q4_1": gguf.GGMLQuantizationType.Q4_1, "q4_0": gguf.GGMLQuantizationType.Q4_0}
    if len(shape) < 2 or qtype == "f32":
        return gguf.GGMLQuantizationType.F32
    wanted = types[qtype]
    if qtype.startswith(("q4", "q5")) and gguf_name in ("token_embd.weight", "output.weight"):
        wanted = gguf.GGMLQuantizationType.Q8_0
    block = gguf.GGML_QUANT_SIZES[wanted][0]
    if shape[-1] % block:
        return gguf.GGMLQuantizationType.F16
    return wanted


_FILE_TYPES = {"f32": "ALL_F32", "f16": "MOSTLY_F16", "bf16": "MOSTLY_BF16", "q8_0": "MOSTLY_Q8_0",
               "q5_1": "MOSTLY_Q5_1", "q5_0": "MOSTLY_Q5_0", "q4_1": "MOSTLY_Q4_1", "q4_0": "MOSTLY_Q4_0"}


def write_gguf(folder: Path, path: Path, qtype: str, name: str | None = None, echo=print) -> Path:
    """Write the transformers model in ``folder`` (safetensors, tokenizer) as one GGUF file of type ``qtype``.

    Tensors are read, converted and written one at a time (the header first, with every tensor's size
    computed up front), so memory stays at about one tensor whatever the model's size; a progress bar counts
    the parameters. The file appears under its name only when complete.
    """
    import gguf
    import numpy as np
    from tqdm import tqdm
    from transformers import AutoConfig, AutoTokenizer

    _check_gguf_architecture(_read_json(folder / "config.json"))
    _check_gguf_tokenizer(_read_json(folder / "tokenizer.json"))
    config = AutoConfig.from_pretrained(folder)
    spec = next(_GGUF_ARCHS[a] for a in config.architectures if a in _GGUF_ARCHS)
    arch = gguf.MODEL_ARCH[spec.arch]
    tokenizer = AutoTokenizer.from_pretrained(folder)
    tensors = _list_tensors(folder)
    tie = bool(getattr(config, "tie_word_embeddings", False))
    name_map = gguf.get_tensor_name_map(arch, config.num_hidden_layers)
    plan = []  # (hf name, gguf name, shape, ggml type)
    for hf_name, (file, shape) in tensors.items():
        if hf_name.endswith("rotary_emb.inv_freq") or (tie and hf_name == "lm_head.weight"):
            continue  # recomputed by llama.cpp / the tied embeddings are the head
        gguf_name = name_map.get_name(hf_name, try_suffixes=(".weight", ".bias"))
        if gguf_name is None:
            raise ExportError(f"GGUF export: no llama.cpp tensor for {hf_name!r} of {config.architectures[0]}; "
                              "convert the exported folder with llama.cpp's convert_hf_to_gguf.py.")
        plan.append((hf_name, gguf_name, tuple(shape), _tensor_type(qtype, gguf_name, tuple(shape))))
    rope_freqs = _llama3_rope_factors(config)

    partial = path.with_name(path.name + ".partial")
    writer = gguf.GGUFWriter(partial, gguf.MODEL_ARCH_NAMES[arch])
    writer.add_type(gguf.GGUFType.MODEL)
    writer.add_name(name or folder.name)
    total = sum(math.prod(shape) for _, _, shape, _ in plan)
    writer.add_size_label(gguf.size_label(total, 0, 0, 0))
    _add_hparams(writer, config, spec, rope_freqs is not None)
    writer.add_file_type(gguf.LlamaFileType[_FILE_TYPES[qtype]])
    writer.add_quantization_version(gguf.GGML_QUANT_VERSION)
    _add_vocab(writer, tokenizer, folder, config)
    for _, gguf_name, shape, ggml_type in plan:
        writer.add_tensor_info(gguf_name, shape, np.dtype(np.float32), _nbytes(shape, ggml_type), raw_dtype=ggml_type)
    if rope_freqs is not None:
        writer.add_tensor_info("rope_freqs.weight", rope_freqs.shape, np.dtype(np.float32), rope_freqs.nbytes,
                               raw_dtype=gguf.GGMLQuantizationType.F32)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_ti_data_to_file()
    with tqdm(total=total, unit="param", unit_scale=True, desc=f"gguf {qtype}", leave=False) as bar, \
            _SafetensorsReader() as reader:
        for hf_name, gguf_name, shape, ggml_type in plan:
            data = reader.get(tensors[hf_name][0], hf_name).to(torch.float32)
            if spec.permute_qk and hf_name.endswith(("q_proj.weight", "q_proj.bias")):
                data = _permute(data, config.num_attention_heads)
            elif spec.permute_qk and hf_name.endswith(("k_proj.weight", "k_proj.bias")):
                data = _permute(data, config.num_key_value_heads)
            writer.write_tensor_data(gguf.quants.quantize(data.numpy(), ggml_type))
            bar.update(math.prod(shape))
    if rope_freqs is not None:
        writer.write_tensor_data(rope_freqs)
    writer.close()
    partial.replace(path)
    echo(f"[anyfit] export: wrote {path.name} ({path.stat().st_size / 2**20:.1f} MiB)")
    return path


def _list_tensors(folder: Path) -> dict[str, tuple[Path, list[int]]]:
    """Every tensor of the safetensors weights in ``folder``: name -> (file, shape), in file order."""
    from safetensors import safe_open

    index = folder / "model.safetensors.index.json"
    files = (sorted(set(json.loads(index.read_text())["weight_map"].values())) if index.is_file()
             else ["model.safetensors"])
    out: dict[str, tuple[Path, list[int]]] = {}
    for name in files:
        with safe_open(folder / name, framework="pt") as f:
            for key in f.keys():  # noqa: SIM118 (safe_open is not iterable)
                out[key] = (folder / name, list(f.get_slice(key).get_shape()))
    return out


class _SafetensorsReader:
    """Tensors read one at a time from their files (each file opened once)."""

    def __enter__(self):
        self.handles: dict[Path, Any] = {}
        return self

    def get(self, file: Path, name: str) -> torch.Tensor:
        from safetensors import safe_open

        if file not in self.handles:
            self.handles[file] = safe_open(file, framework="pt").__enter__()
        return self.handles[file].get_tensor(name)

    def __exit__(self, *exc):
        for handle in self.handles.values():
            handle.__exit__(None, None, None)


def _nbytes(shape: tuple[int, ...], ggml_type) -> int:
    import gguf

    block, size = gguf.GGML_QUANT_SIZES[ggml_type]
    return math.prod(shape) // block * size


def _permute(weights: torch.Tensor, n_head: int) -> torch.Tensor:
    """transformers keeps the two rotary halves of each head apart; llama.cpp's llama layout interleaves them."""
    return (weights.reshape(n_head, 2, weights.shape[0] // n_head // 2, *weights.shape[1:])
            .swapaxes(1, 2).reshape(weights.shape))


def _rope(config) -> dict[str, Any]:
    """The rotary settings, from transformers 5's ``rope_parameters`` or the older ``rope_scaling`` + theta."""
    params = dict(getattr(config, "rope_parameters", None) or {})
    if not params:
        params = dict(getattr(config, "rope_scaling", None) or {})
        params.setdefault("rope_theta", getattr(config, "rope_theta", 10000.0))
    params.setdefault("rope_type", params.get("type", "default"))
    return params


def _add_hparams(writer, config, spec: _GGUFArch, llama3_rope: bool) -> None:
    import gguf

    head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    writer.add_context_length(config.max_position_embeddings)
    writer.add_embedding_length(config.hidden_size)
    writer.add_feed_forward_length(config.intermediate_size)
    writer.add_block_count(config.num_hidden_layers)
    writer.add_head_count(config.num_attention_heads)
    writer.add_head_count_kv(config.num_key_value_heads or config.num_attention_heads)
    writer.add_layer_norm_rms_eps(config.rms_norm_eps)
    writer.add_key_length(head_dim)
    writer.add_value_length(head_dim)
    writer.add_vocab_size(config.vocab_size)
    if spec.arch == "LLAMA":
        writer.add_rope_dimension_count(head_dim)
    rope = _rope(config)
    writer.add_rope_freq_base(float(rope.get("rope_theta", 10000.0)))
    kind = rope["rope_type"]
    if kind == "linear":
        writer.add_rope_scaling_type(gguf.RopeScalingType.LINEAR)
        writer.add_rope_scaling_factor(float(rope["factor"]))
    elif kind == "yarn":
        writer.add_rope_scaling_type(gguf.RopeScalingType.YARN)
        writer.add_rope_scaling_factor(float(rope["factor"]))
        writer.add_rope_scaling_orig_ctx_len(int(rope["original_max_position_embeddings"]))
    elif kind not in ("default",) and not (kind == "llama3" and llama3_rope):
        raise ExportError(f"GGUF export: rope_type {kind!r} is not converted here; convert the exported folder "
                          "with llama.cpp's convert_hf_to_gguf.py.")


def _llama3_rope_factors(config):
    """Llama 3.1+'s frequency-dependent rope scaling, which llama.cpp reads as a rope_freqs tensor."""
    import numpy as np

    rope = _rope(config)
    if rope["rope_type"] != "llama3":
        return None
    dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    base = float(rope.get("rope_theta", 10000.0))
    factor, low, high = float(rope["factor"]), float(rope["low_freq_factor"]), float(rope["high_freq_factor"])
    old_context = float(rope["original_max_position_embeddings"])
    factors = []
    for i in range(0, dim, 2):
        wavelength = 2 * math.pi / (1.0 / base ** (i / dim))
        if wavelength < old_context / high:
            factors.append(1.0)
        elif wavelength > old_context / low:
            factors.append(factor)
        else:
            smooth = (old_context / wavelength - low) / (high - low)
            factors.append(1 / ((1 - smooth) / factor + smooth))
    return np.array(factors, dtype=np.float32)


def _add_vocab(writer, tokenizer, folder: Path, config) -> None:
    """llama.cpp's "gpt2" vocabulary: every id up to the model's vocab size (ids the tokenizer lacks become
    unused [PAD<i>] entries), token types from the tokenizer's added tokens, the merges, special ids and the
    chat template (gguf's SpecialVocab reads those from the folder)."""
    import gguf

    writer.add_tokenizer_model("gpt2")
    writer.add_tokenizer_pre(llama_cpp_pre_tokenizer(tokenizer))
    reverse = {i: t for t, i in tokenizer.get_vocab().items()}
    added = tokenizer.added_tokens_decoder
    size = config.vocab_size  # llama.cpp wants one token per embedding row
    if max(reverse) >= size:
        raise ExportError(f"GGUF export: the tokenizer has ids up to {max(reverse)} but the model only {size} "
                          "embedding rows; resize the embeddings to the tokenizer before exporting.")
    tokens, types = [], []
    for i in range(size):
        if i not in reverse:
            tokens.append(f"[PAD{i}]")
            types.append(gguf.TokenType.UNUSED)
        elif i in added:
            tokens.append(reverse[i])
            # <|...|> tokens marked not special (Qwen's fim and repo tokens) are still control tokens to
            # llama.cpp: never produced from plain text, not printed; its converter marks them so too
            looks_special = reverse[i].startswith("<|") and reverse[i].endswith("|>")
            types.append(gguf.TokenType.CONTROL if added[i].special or looks_special else gguf.TokenType.USER_DEFINED)
        else:
            tokens.append(reverse[i])
            types.append(gguf.TokenType.NORMAL)
    writer.add_token_list(tokens)
    writer.add_token_types(types)
    prefix_space = _read_json(folder / "tokenizer_config.json").get("add_prefix_space")
    if prefix_space is not None and writer.arch == "llama":  # as llama.cpp's converter records it
        writer.add_add_space_prefix(bool(prefix_space))
    gguf.SpecialVocab(folder, load_merges=True, n_vocab=size).add_to_gguf(writer, quiet=True)


# GGUF: checking


@dataclass
class _Reference:
    prompts: list[list[int]]
    logits: list[torch.Tensor]
    greedy: list[list[int]]


def _prompt_ids(tokenizer) -> list[list[int]]:
    """VERIFY_PROMPTS as token ids, plus one chat turn through the chat template when there is one."""
    ids = [tokenizer(p, add_special_tokens=True)["input_ids"] for p in VERIFY_PROMPTS]
    if getattr(tokenizer, "chat_template", None):
        text = tokenizer.apply_chat_template([{"role": "user", "content": "Hello! Who are you?"}], tokenize=False,
                                             add_generation_prompt=True)
        ids.append(tokenizer(text, add_special_tokens=False)["input_ids"])
    return ids


@torch.no_grad()
def _outputs(model, prompts: list[list[int]], pad_id: int,
             generate: bool = True) -> tuple[list[torch.Tensor], list[list[int]]]:
    """Each prompt's logits at every position, and (``generate``) its greedy continuation."""
    logits, greedy = [], []
    for ids in prompts:
        x = torch.tensor([ids])
        logits.append(model(x).logits[0].float())
        if generate:  # no eos: every prompt compares VERIFY_NEW_TOKENS tokens
            out = model.generate(x, attention_mask=torch.ones_like(x), max_new_tokens=VERIFY_NEW_TOKENS,
                                 do_sample=False, pad_token_id=pad_id, eos_token_id=None)
            greedy.append(out[0, len(ids):].tolist())
    return logits, greedy


def reference_outputs(model, tokenizer) -> _Reference:
    """The merged model's logits and greedy continuations on the check prompts (computed before its
    memory is given back, so the GGUF model can be loaded in its place)."""
    prompts = _prompt_ids(tokenizer)
    model.generation_config.do_sample = False  # a sampling default would only warn here; greedy is asked
    logits, greedy = _outputs(model, prompts, tokenizer.pad_token_id)
    return _Reference(prompts, logits, greedy)


def check_gguf(path: Path, folder: Path, tokenizer, reference: _Reference, qtype: str) -> GGUFAgreement:
    """Load ``path`` with transformers (dequantized to fp32) and compare it with the merged model.

    The tokenizer transformers rebuilds from the file must give the same ids for the prompts. The model must
    equal the merged model in ``folder`` with every weight rounded to the type it has in the file, within
    CONVERSION_TOLERANCE; how far rounding moved it from ``reference`` (the merged model as exported) is
    measured and reported, not judged: that is the price of the type, not an error.
    """
    from transformers import AutoModelForCausalLM, AutoTokenizer

    try:
        gguf_tok = AutoTokenizer.from_pretrained(path.parent, gguf_file=path.name)
        model = AutoModelForCausalLM.from_pretrained(path.parent, gguf_file=path.name, dtype=torch.float32)
    except Exception as e:  # whatever transformers cannot read is a failed export, said in one line
        raise ExportError(f"transformers cannot read the {qtype} GGUF file just written: "
                          f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}") from None
    for ids in reference.prompts:
        text = tokenizer.decode(ids, skip_special_tokens=False)
        again = gguf_tok(text, add_special_tokens=False)["input_ids"]
        expected = tokenizer(text, add_special_tokens=False)["input_ids"]
        if again != expected:
            raise ExportError(f"the {qtype} GGUF file's tokenizer splits {text[:40]!r} into {again[:12]} ..., the "
                              f"model's tokenizer into {expected[:12]} ...; the GGUF export is wrong for this "
                              "tokenizer.")
    model.eval()
    logits, greedy = _outputs(model, reference.prompts, tokenizer.pad_token_id)
    del model
    rounded, _ = _outputs(_rounded_model(folder, qtype), reference.prompts, tokenizer.pad_token_id, generate=False)
    conversion = max(_max_rel_diff(got, want) for got, want in zip(logits, rounded))
    max_abs = max(float((got - ref).abs().max()) for got, ref in zip(logits, reference.logits))
    max_rel = max(_max_rel_diff(got, ref) for got, ref in zip(logits, reference.logits))
    same = sum(int((got.argmax(-1) == ref.argmax(-1)).sum()) for got, ref in zip(logits, reference.logits))
    positions = sum(ref.shape[0] for ref in reference.logits)
    matches = sum(a == b for a, b in zip(greedy, reference.greedy))
    return GGUFAgreement(qtype, conversion, max_abs, max_rel, same / positions, matches, len(greedy))


def _max_rel_diff(got: torch.Tensor, ref: torch.Tensor) -> float:
    """Largest |logit difference| at a position over the spread (max - min) of ``ref``'s logits there."""
    spread = (ref.amax(dim=-1) - ref.amin(dim=-1)).clamp_min(1e-12)
    return float(((got - ref).abs().amax(dim=-1) / spread).max())


def _rounded_model(folder: Path, qtype: str):
    """The merged model in ``folder`` (fp32) with every weight rounded through gguf's quantizer to the type
    ``write_gguf`` gives it in a ``qtype`` file: the model the file should hold."""
    import gguf
    from transformers import AutoConfig, AutoModelForCausalLM

    config = AutoConfig.from_pretrained(folder)
    rope = _rope(config)
    if rope["rope_type"] != "default":
        # transformers' GGUF reader builds plain rope for these architectures: it reads neither llama.cpp's
        # rope_freqs tensor (Llama 3.1+) nor the rope.scaling keys write_gguf records, so compare like with like
        config.rope_parameters = {"rope_type": "default", "rope_theta": rope.get("rope_theta", 10000.0)}
    model = AutoModelForCausalLM.from_pretrained(folder, config=config, dtype=torch.float32)
    spec = next(_GGUF_ARCHS[a] for a in config.architectures if a in _GGUF_ARCHS)
    name_map = gguf.get_tensor_name_map(gguf.MODEL_ARCH[spec.arch], config.num_hidden_layers)
    with torch.no_grad():
        for name, param in model.named_parameters():  # a tied head is the embedding: rounded with it
            gguf_name = name_map.get_name(name, try_suffixes=(".weight", ".bias"))
            ggml_type = _tensor_type(qtype, gguf_name, tuple(param.shape))
            rounded = gguf.quants.dequantize(gguf.quants.quantize(param.detach().numpy(), ggml_type), ggml_type)
            param.copy_(torch.from_numpy(rounded.reshape(param.shape)))
    return model.eval()


# The Hub


def push_folder(folder: Path, repo: str, private: bool = False, api=None, echo=print) -> str:
    """Create ``repo`` (if it does not exist; ``private`` as asked) and upload ``folder`` in one commit.
    Returns the repository's URL."""
    from huggingface_hub import HfApi
    from huggingface_hub.errors import HfHubHTTPError

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

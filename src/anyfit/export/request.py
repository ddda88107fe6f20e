"""What is exported and from where, every input checked before any weights load (``check_request``): the run or
model folder, the dtype (``default_dtype`` when none is asked), the GGUF types and whether the writer converts
the model, the out folder, the eval summary for the card and the push target. Each problem is a one-line
ExportError. Also what those checks read (what a training run left, ``RunFiles``; a model's small JSON files,
``local_json``) and what an export produces (``ExportResult``, with a ``GGUFAgreement`` per GGUF file)."""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from huggingface_hub import get_token, try_to_load_from_cache
from huggingface_hub.utils import HFValidationError, validate_repo_id

from anyfit.config import ConfigError, load_config
from anyfit.export import ExportError
from anyfit.export.sharded import needs_gathering, sharded_location
from anyfit.hub import is_hub_id
from anyfit.durable import MANIFEST
from anyfit.model.source import ModelLocation, check_weights, locate_model
from anyfit.runfolder import (
    RUN_CONFIG,
    checkpoint_dirs,
    has_final_model,
    read_metrics,
    read_run_info,
    run_config_path,
    run_of,
)
from anyfit.training.checkpoints.integrity import STATE, checkpoint_problem, complete_checkpoints

DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}
_DTYPE_NAMES = {"float32": "fp32", "bfloat16": "bf16", "float16": "fp16"}


@dataclass(frozen=True)
class ExportRequest:
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
    gather: bool = False  # a sharded checkpoint, to be gathered into an ordinary folder before it loads


def check_request(run, out=None, *, dtype=None, gguf=(), push=None, overwrite=False, eval_summary=None,
                  api=None) -> ExportRequest:
    """Every input checked, each problem a one-line ExportError, before anything heavy happens."""
    run_path = Path(run).expanduser()
    if not run_path.exists():
        raise ExportError(f"{run_path} does not exist: give a training output folder (train.output_dir) or a "
                          "model folder (config.json + weights).")
    if not run_path.is_dir():
        raise ExportError(f"{run_path} is not a folder: give a training output folder or a model folder "
                          "(a .gguf file is already an export).")
    _refuse_incomplete_checkpoint(run_path, full=False)  # sizes: at once
    gather = needs_gathering(run_path)  # a sharded checkpoint: gathered into safetensors first (export.sharded)
    if not gather:
        _refuse_unfinished_run(run_path)
    # a folder without config.json/adapter_config.json: one-line error
    location = sharded_location(run_path) if gather else locate_model(run_path)
    if dtype is not None and dtype not in DTYPES:
        raise ExportError(f"--dtype {dtype!r} is not one of {', '.join(DTYPES)}.")
    gguf_types = parse_gguf_types(gguf)
    run_files = RunFiles.find(run_path)
    if gguf_types:
        check_gguf_support(location)
    out_path = Path(out).expanduser() if out else run_path.parent / f"{run_path.name}-export"
    _check_out(out_path, run_path, overwrite)
    summary = _read_eval_summary(eval_summary) if eval_summary else None
    if push:
        check_push(push, api)
    _refuse_incomplete_checkpoint(run_path, full=True)  # every byte, once the quick checks have passed
    if not gather:
        _check_weights(location)
    name, reason = (dtype, "as asked") if dtype else default_dtype(run_path, location, run_files)
    return ExportRequest(run_path, out_path, location, name, reason, gguf_types, run_files, summary, push, gather)


def _refuse_unfinished_run(run: Path) -> None:
    if has_final_model(run):
        return
    checkpoints = checkpoint_dirs(run)
    if checkpoints or run_config_path(run) is not None:
        hint = f" {_complete_ones(run)}" if checkpoints else " Its final model is written when training ends."
        raise ExportError(f"{run} is an unfinished training run: it holds no final model (config.json or "
                          f"adapter_config.json).{hint}")


def _complete_ones(run: Path, but: Path | None = None) -> str:
    """What to export instead from ``run``: its newest complete checkpoint (``integrity`` decides; sizes checked,
    hashes when it is exported), or that none is, and why not the newest."""
    complete = [p for p in complete_checkpoints(run) if p != but]
    if complete:
        return f"Export its newest complete checkpoint ({complete[-1]}), or finish the run with train.resume=auto."
    newest = ([p for p in checkpoint_dirs(run) if p != but] or [None])[-1]
    why = f" ({newest.name}: {checkpoint_problem(newest, full=False)})" if newest is not None else ""
    return (f"None of its checkpoints is complete{why}: nothing of it can be exported or resumed; train it again "
            "(train.overwrite=true).")


def _refuse_incomplete_checkpoint(folder: Path, full: bool) -> None:
    """A checkpoint anyfit wrote (``checkpoint-N`` with its manifest, or with its trainer state and config.yaml)
    must be complete and intact, every file's size (and with ``full`` its hash) as its manifest says
    (``integrity``), before any weights load: a copy cut short or a full disk is one line naming the file. Other
    folders called ``checkpoint-N`` (transformers' Trainer writes them; a model copied there) are checked as model
    folders."""
    _, step = run_of(folder)
    anyfits = (folder / MANIFEST).is_file() or all((folder / name).is_file() for name in (STATE, RUN_CONFIG))
    if step is None or not anyfits:
        return
    problem = checkpoint_problem(folder, full=full)
    if problem:
        raise ExportError(f"{folder} is not a complete checkpoint: {problem}. "
                          f"{_complete_ones(folder.parent, but=folder)}")


def _check_weights(location: ModelLocation) -> None:
    """The weights about to load are there and whole (``anyfit.model.source.check_weights``: each safetensors
    header against its file's size): the adapter's folder and a local base model's."""
    adapter = Path(location.adapter) if location.adapter else None
    folders = [adapter] if adapter is not None and any(adapter.glob("*.safetensors")) else []
    if location.gguf_file is None and Path(location.base).is_dir():
        folders.append(Path(location.base))
    for folder in folders:
        try:
            check_weights(folder)
        except ConfigError as e:
            raise ExportError(str(e).removeprefix("model.name_or_path: ")) from None


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
    """``base``'s config.json dtype from its folder or the local hub cache (a hub id: only if cached)."""
    data = local_json(base, "config.json", revision=revision) or {}
    return _DTYPE_NAMES.get(data.get("dtype") or data.get("torch_dtype") or "")


# --------------------------------------- what a training run left (for the default dtype and the model card)


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
        and only the metric lines up to its step describe it (``anyfit.runfolder`` reads them)."""
        files = RunFiles()
        config_path = run_config_path(folder)
        if config_path is not None:
            files.config_path = config_path
            try:
                files.config = load_config(config_path)
            except ConfigError as e:
                raise ExportError(f"{config_path} is not a readable anyfit config: {e}") from None
        run_dir, step = run_of(folder)
        files.metrics = read_metrics(run_dir, up_to_step=step)
        files.run_info = read_run_info(run_dir)
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


# -------------------------------------------------------------- a model's JSON files, never from the network


def read_json(path: Path) -> dict:
    """The JSON object in ``path``; ``{}`` when there is no such file."""
    return json.loads(path.read_text(encoding="utf-8")) if path.is_file() else {}


def local_json(name_or_path: str, filename: str, revision: str | None = None) -> dict | None:
    """``filename`` of the model ``name_or_path``: from its folder, or for a hub id from the local hub cache
    (at ``revision``, default main); None when it is not at hand here."""
    path = Path(name_or_path).expanduser()
    if path.is_dir():
        return read_json(path / filename) if (path / filename).is_file() else None
    if is_hub_id(name_or_path):
        cached = try_to_load_from_cache(name_or_path, filename, revision=revision)  # a hub id: only if cached
        return read_json(Path(cached)) if isinstance(cached, str) else None
    return None


# ------------------------------------------------------- what GGUF export converts (the writer: gguf_writer)


# Checked before any weights load; anything else is a one-line ExportError that names llama.cpp's own converter.
# Why anyfit writes GGUF itself is at the top of ``gguf_writer``.
# GGUF types the numpy quantizers of ``gguf`` write.
GGUF_TYPES = ("f32", "f16", "bf16", "q8_0", "q5_1", "q5_0", "q4_1", "q4_0")
# Types only llama.cpp's compiled llama-quantize makes (gguf's Python code can read them, not write them).
LLAMA_QUANTIZE_ONLY = ("q2_k", "q3_k_s", "q3_k_m", "q3_k_l", "q4_k_s", "q4_k_m", "q5_k_s", "q5_k_m", "q6_k",
                       "iq4_xs", "iq4_nl", "iq3_m", "iq3_xxs", "iq2_m", "iq2_xs", "iq2_xxs", "iq1_s", "iq1_m")


@dataclass(frozen=True)
class GGUFArch:
    arch: str  # gguf.MODEL_ARCH member name
    permute_qk: bool  # llama.cpp's llama layout interleaves the rotary halves of q/k (transformers undoes it)


GGUF_ARCHS = {"LlamaForCausalLM": GGUFArch("LLAMA", True), "MistralForCausalLM": GGUFArch("LLAMA", True),
              "Qwen2ForCausalLM": GGUFArch("QWEN2", False), "Qwen3ForCausalLM": GGUFArch("QWEN3", False)}


def parse_gguf_types(gguf) -> tuple[str, ...]:
    """The ``--gguf`` types asked (repeated or comma-separated), lower-cased and without repeats; a type gguf's
    quantizers do not write, or gguf missing, is an ExportError."""
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
            import gguf as _  # noqa: F401  (the check itself: whether gguf can be imported here)
        except ImportError:
            raise ExportError("GGUF export needs the 'gguf' package (llama.cpp's, a dependency of anyfit that is "
                              "missing here): `uv sync` in the anyfit repository, or pip install gguf==0.19.0."
                              ) from None
    return tuple(dict.fromkeys(types))


def check_gguf_support(location: ModelLocation) -> None:
    """Refuse, before any weights load, a model this writer does not convert. Reads the base's config.json
    and the tokenizer.json from their folders or the local hub cache; what is not at hand is checked when
    the GGUF file is written (from the exported folder)."""
    config, tok_json = local_json(location.base, "config.json"), local_json(location.tokenizer, "tokenizer.json")
    if config is not None:
        check_gguf_architecture(config)
    if tok_json is not None:
        check_gguf_tokenizer(tok_json)


def check_gguf_architecture(config: dict) -> None:
    archs = config.get("architectures") or []
    if not any(a in GGUF_ARCHS for a in archs):
        composite = (" (a composite: convert_hf_to_gguf.py writes its language model, and with --mmproj the rest)"
                     if isinstance(config.get("text_config"), dict) else "")
        raise ExportError(f"GGUF export handles {', '.join(GGUF_ARCHS)}; this model is "
                          f"{', '.join(archs) or 'of an unrecorded architecture'}. Export without --gguf and convert "
                          f"the folder with llama.cpp's convert_hf_to_gguf.py{composite}.")


def check_gguf_tokenizer(tok_json: dict) -> None:
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


# --------------------------------------------------------------------- the push target (the upload: publish)


def check_push(repo: str, api) -> None:
    """``repo`` is a valid repository id and a token is at hand (``api``'s, the environment's or the login's)."""
    try:
        validate_repo_id(repo)
    except HFValidationError as e:
        raise ExportError(f"--push {repo!r} is not a Hub repository id (owner/name): {e}") from None
    token = getattr(api, "token", None) if api is not None else None
    if not (token or get_token()):
        raise ExportError("--push needs a Hugging Face token with write access: set HF_TOKEN or run "
                          "`hf auth login`.")


# ----------------------------------------------------------------------------------- what an export produced


# How far the model transformers reads from a GGUF file may be from the merged model with its weights rounded
# to the file's types: max |logit difference| at a position, as a share of the spread (max - min) of the logits
# there. The weights are then the same numbers, so only the order of float operations may differ; a conversion
# error (a q/k permutation missing, a wrong tensor, norm or rope setting) lands far above. Not against the
# unrounded model: at 4 bits on a small model honest rounding alone moves the logits that far (the measurements:
# README.md, 'Export', GGUF).
CONVERSION_TOLERANCE = 1e-3


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
    auto_class: str = "AutoModelForCausalLM"  # what loads it with transformers (a composite: its own, for the card)

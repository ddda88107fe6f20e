"""Typed run configuration: dataclasses whose field help is shown by the CLI.

A config is a YAML file plus dotted ``key=value`` overrides (``train.learning_rate=1e-4``).
Everything is validated here, before any model or data is touched: an unknown key names the
closest valid one, a bad value names the key, the file and line, and what is allowed.
"""

from __future__ import annotations

import dataclasses
import difflib
import types
import typing
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal, Union

import yaml


class ConfigError(ValueError):
    """A problem with the user's configuration; the message says what to change."""


def _f(default: Any, help: str) -> Any:
    """A dataclass field with a help text (shown by ``anyfit train --help-config``)."""
    if isinstance(default, (list, dict)):
        return field(default_factory=lambda d=default: type(d)(d), metadata={"help": help})
    return field(default=default, metadata={"help": help})


@dataclass
class ModelConfig:
    """Which model to fine-tune and how to load it."""

    name_or_path: str = _f("", "Hub id (Qwen/Qwen2.5-Math-1.5B), a local HF folder, or a .gguf file.")
    gguf_file: str | None = _f(None, "GGUF file name inside name_or_path (set automatically when name_or_path is a .gguf file).")
    revision: str | None = _f(None, "Hub revision (branch, tag or commit) to load.")
    tokenizer: str | None = _f(None, "Tokenizer to use if it differs from the model's (hub id or folder).")
    trust_remote_code: bool = _f(False, "Run model code shipped with the checkpoint. Off unless you trust the source.")
    dtype: Literal["auto", "float32", "bfloat16", "float16"] = _f(
        "auto", "Dtype of the loaded weights. auto: float32 master weights for full fine-tuning "
        "(mixed precision runs compute in bf16/fp16), the compute dtype for a frozen LoRA base.")
    attn_implementation: Literal["auto", "anyfit_varlen", "sdpa", "eager", "flash_attention_2", "flex_attention"] = _f(
        "auto", "Attention kernel. auto: anyfit_varlen with train.packing (per-example attention in packed rows: "
        "PyTorch's varlen FlashAttention on CUDA bf16/fp16, SDPA per example elsewhere), else sdpa. The others "
        "are transformers' own; with packing they keep examples apart through position_ids.")
    gradient_checkpointing: bool = _f(False, "Recompute activations in the backward pass: less memory, about 30% slower.")
    checkpoint_every: int = _f(
        1, "With gradient_checkpointing: recompute every N-th decoder layer only (1: all of them). Larger N keeps "
        "more activations and recomputes less: a knob between speed and memory.")


@dataclass
class LoraConfig:
    """Low-rank adapters through PEFT. Off means full fine-tuning."""

    enabled: bool = _f(False, "Train LoRA adapters instead of all weights.")
    r: int = _f(16, "Adapter rank.")
    alpha: int = _f(32, "LoRA scaling numerator (the update is scaled by alpha / r).")
    dropout: float = _f(0.05, "Dropout on the adapter input.")
    qlora: bool = _f(False, "Load the frozen base in 4-bit NF4 (bitsandbytes, CUDA only) and train LoRA on top.")
    target_modules: list[str] | str = _f(
        "auto", "Module names to adapt, or 'auto' to find the attention and MLP projections from the "
        "model's module names (q_proj..., c_attn/c_proj, query_key_value, ...), or 'all-linear'.")


@dataclass
class DataConfig:
    """Where the training examples come from and how they become tokens."""

    path: str = _f("", "A local .jsonl/.json/.parquet file, or a hub dataset name.")
    subset: str | None = _f(None, "Hub dataset configuration name (e.g. 'main' for gsm8k).")
    split: str = _f("train", "Split, with optional slicing: 'train', 'train[:500]', 'train[10%:]'.")
    num_samples: int | None = _f(None, "Use at most this many examples (after loading, before shuffling).")
    format: Literal["auto", "messages", "prompt_completion", "text", "tokens"] = _f(
        "auto", "Example format. auto: detect from the fields (messages, prompt/completion, text, or "
        "input_ids + optional completion_mask for pre-tokenized data).")
    fields: dict[str, str] = _f(
        {}, "Map anyfit's fields to yours, e.g. {prompt: problem, completion: solution} for MATH.")
    template: str = _f(
        "chat", "How examples are laid out: 'chat' (the tokenizer's chat template; a string prompt becomes the user "
        "message); 'plain' (the text is prompt + completion, nothing added between them; each tokenized on its "
        "own); 'trl' (as TRL's SFTTrainer tokenizes the same records: prompt + completion + EOS tokenized whole, "
        "the loss from the first token that differs from the prompt's own; conversations through the chat "
        "template); 'r1_zero' (<think> ... </think> <answer> ... </answer>); or a custom string with {prompt} in it.")
    system_prompt: str | None = _f(None, "System message for the chat template.")
    max_length: int = _f(1024, "Longest example in tokens.")
    overlong: Literal["truncate", "drop"] = _f("truncate", "What to do with longer examples (both are counted and reported).")
    train_on: Literal["completion", "all"] = _f(
        "completion", "Which tokens carry loss: the completion/assistant tokens only, or all tokens.")
    add_eos: bool = _f(True, "End each completion with the tokenizer's EOS token (so the model learns to stop).")


@dataclass
class TrainConfig:
    """The optimisation: batch, schedule, checkpoints."""

    output_dir: str = _f("runs/anyfit", "Where the final model, checkpoints, metrics and resolved config go.")
    overwrite: bool = _f(False, "Allow writing into an output_dir that already holds a run.")
    effective_batch: int = _f(
        32, "Sequences per optimizer step, summed over micro-batches, accumulation and processes. "
        "The same on every machine: micro_batch and accumulation are derived from it.")
    micro_batch: int | Literal["auto"] = _f(
        4, "Sequences per forward pass per process; accumulation = effective / (micro x processes). 'auto': a "
        "short probe on the longest sequences measures peak memory and picks the largest that fits.")
    epochs: float = _f(1.0, "Passes over the data (ignored when max_steps > 0).")
    max_steps: int = _f(0, "Stop after this many optimizer steps (0: derive from epochs).")
    learning_rate: float = _f(2e-5, "Peak learning rate.")
    weight_decay: float = _f(0.0, "AdamW weight decay (not applied to biases and norms).")
    adam_beta1: float = _f(0.9, "AdamW beta1.")
    adam_beta2: float = _f(0.999, "AdamW beta2.")
    adam_eps: float = _f(1e-8, "AdamW epsilon.")
    optimizer: Literal["adamw", "adamw_8bit", "paged_adamw_8bit", "adafactor"] = _f(
        "adamw", "adamw: torch's AdamW (fused where it can be). adamw_8bit / paged_adamw_8bit: bitsandbytes' 8-bit "
        "states (CUDA only; paged moves them to host memory under pressure). adafactor: factored second moments, "
        "no first moment: a fraction of AdamW's state on every device.")
    lr_schedule: Literal["cosine", "linear", "constant"] = _f("cosine", "Decay after warmup.")
    warmup_steps: int = _f(0, "Linear warmup steps (overrides warmup_ratio when > 0).")
    warmup_ratio: float = _f(0.0, "Warmup as a fraction of the total steps.")
    min_lr_ratio: float = _f(0.0, "Final learning rate as a fraction of the peak (cosine and linear).")
    max_grad_norm: float = _f(1.0, "Clip the global gradient norm to this (0: no clipping).")
    save_every: int = _f(0, "Write a checkpoint every N steps (0: only the final model).")
    keep_last: int = _f(2, "Keep this many most recent checkpoints.")
    log_every: int = _f(10, "Write a metrics line every N steps (each costs one device-to-host sync).")
    report_to: list[str] | str = _f(
        "none", "Also send every metrics line to experiment trackers, through Accelerate's: none, or one or a list of "
        "tensorboard, wandb, mlflow, trackio (install the tracker: pip install 'anyfit[tensorboard]', ...). "
        "wandb offline: set WANDB_MODE=offline.")
    seed: int = _f(42, "Seed for initialisation of adapters, data order and dropout.")
    resume: str | None = _f(
        None, "Continue a run: 'auto' (the newest complete checkpoint in output_dir; a fresh start if there is "
        "none) or the path of a checkpoint-N folder. Restores weights, optimizer, scheduler, loss scaler, RNG "
        "states and the position in the data.")
    packing: bool = _f(
        True, "Concatenate each micro-batch's examples into one row without padding; attention still stops at "
        "example boundaries (position_ids). Off: right-pad each micro-batch to its longest example.")
    loss_chunk_tokens: int = _f(
        1024, "Take the cross-entropy in fp32 this many tokens at a time, so fp32 logits over the whole vocabulary "
        "never exist for more rows (0: plain torch cross-entropy on all trained positions at once).")
    max_nonfinite_steps: int = _f(
        3, "Stop with a diagnosis after this many optimizer steps in a row with a non-finite loss or gradient "
        "(each one is skipped: no update).")


@dataclass
class EvalConfig:
    """Evaluation during training: validation loss and generation accuracy on held-out examples."""

    path: str | None = _f(None, "Held-out data (file or hub name, read with the data.* settings); default: data.path.")
    split: str | None = _f(None, "Split of eval.path (e.g. 'test[:200]'). Set eval.path or eval.split to hold data out.")
    holdout: int = _f(0, "Instead of eval.path/split: hold out this many training records (seeded) for evaluation.")
    every: int = _f(0, "Validation loss every N optimizer steps (0: off); also at the end when eval data is set.")
    generate_every: int = _f(0, "Generation accuracy every N steps (0: off). Costs a generation pass each time.")
    generate_before: bool = _f(False, "Generation accuracy before the first step (the base model's score).")
    generate_at_end: bool = _f(False, "Generation accuracy after the last step.")
    num_generate: int = _f(64, "Held-out examples used for generation accuracy.")
    max_new_tokens: int = _f(256, "Longest generated answer in the generation eval, and in anyfit eval unless "
                             "--max-new-tokens is given.")
    batch_size: int | Literal["auto"] = _f("auto", "Generation batch size (also anyfit eval's, unless --batch-size is "
                                           "given); auto sizes it from free memory and the KV cache.")


@dataclass
class RuntimeConfig:
    """Hardware policy. 'auto' resolves once at start and is printed with its reason."""

    device: Literal["auto", "cuda", "mps", "cpu"] = _f("auto", "auto picks cuda > mps > cpu.")
    precision: Literal["auto", "fp32", "bf16", "fp16"] = _f(
        "auto", "auto: bf16 on CUDA with native bf16 (compute capability 8.0+), fp16 with loss scaling "
        "on older CUDA, fp32 on MPS and CPU.")
    tf32: bool = _f(True, "Allow TF32 matmuls on CUDA where the GPU has them.")
    fused_optimizer: bool = _f(True, "Fused AdamW (CUDA, MPS and CPU): one kernel per step, and non-finite steps are "
                               "skipped on the device without a host sync.")
    memory_fraction: float = _f(
        0.85, "Share of the device's memory (host RAM on CPU) that micro_batch=auto may plan to use.")
    num_workers: int | Literal["auto"] = _f(
        "auto", "Processes that prepare the next steps' batches while the current one trains (auto: 2 on CUDA, "
        "0 elsewhere: on a CPU they would compete with training for the cores).")
    compile: bool = _f(False, "torch.compile the model (inductor, dynamic shapes). Off by default until it is "
                       "measured to pay on a GPU (see BENCHMARKS.md).")
    sharding: Literal["auto", "none", "fsdp"] = _f(
        "auto", "fsdp: shard weights, gradients and optimizer states over the processes with PyTorch's FSDP2 "
        "(fully_shard per decoder layer). auto: what 'anyfit plan' recommends for this machine and process count "
        "(printed with its reason). none: every process holds everything (DDP).")
    fsdp_offload: bool = _f(False, "With sharding: keep parameters and optimizer states in host RAM (FSDP2 CPU "
                            "offload); slower, for models that do not fit in device memory even sharded.")


@dataclass
class Config:
    """A whole anyfit run."""

    model: ModelConfig = field(default_factory=ModelConfig)
    data: DataConfig = field(default_factory=DataConfig)
    lora: LoraConfig = field(default_factory=LoraConfig)
    train: TrainConfig = field(default_factory=TrainConfig)
    eval: EvalConfig = field(default_factory=EvalConfig)
    runtime: RuntimeConfig = field(default_factory=RuntimeConfig)

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    def to_yaml(self) -> str:
        return yaml.safe_dump(self.to_dict(), sort_keys=False)


SECTIONS: dict[str, type] = {"model": ModelConfig, "data": DataConfig, "lora": LoraConfig, "train": TrainConfig,
                             "eval": EvalConfig, "runtime": RuntimeConfig}


def all_keys() -> list[str]:
    """Every valid dotted key, e.g. 'train.learning_rate'."""
    return [f"{s}.{f.name}" for s, cls in SECTIONS.items() for f in dataclasses.fields(cls)]


def field_help() -> list[tuple[str, str, Any, str]]:
    """(key, type, default, help) for every key, in declaration order."""
    rows = []
    hints_cache = {cls: typing.get_type_hints(cls) for cls in SECTIONS.values()}
    for s, cls in SECTIONS.items():
        for f in dataclasses.fields(cls):
            default = f.default if f.default is not dataclasses.MISSING else f.default_factory()
            rows.append((f"{s}.{f.name}", _type_name(hints_cache[cls][f.name]), default, f.metadata.get("help", "")))
    return rows


def _type_name(tp: Any) -> str:
    origin = typing.get_origin(tp)
    if origin is Literal:
        return "|".join(str(a) for a in typing.get_args(tp))
    if origin in (Union, types.UnionType):
        return " or ".join(_type_name(a) for a in typing.get_args(tp))
    if origin is not None:
        return str(tp).replace("typing.", "")
    return getattr(tp, "__name__", str(tp))


def _expected(tp: Any) -> str:
    """A type in words, for error messages."""
    if typing.get_origin(tp) is Literal:
        return "one of " + ", ".join(repr(a) for a in typing.get_args(tp))
    if typing.get_origin(tp) is list:
        return "a list"
    if typing.get_origin(tp) is dict:
        return "a mapping"
    return {int: "an integer", float: "a number", str: "a string", bool: "true or false"}.get(tp, _type_name(tp))


_DERIVED = ("anyfit derives accumulation from train.effective_batch = micro_batch x accumulation x processes, so "
            "the same config keeps its effective batch on any machine and process count")
# Keys of TRL's SFTConfig / transformers' TrainingArguments and of Axolotl, with anyfit's key and, where
# the idea differs, why. Answered instead of a "did you mean" guess, which for these names misleads.
FOREIGN_KEYS: dict[str, tuple[str, str]] = {
    "per_device_train_batch_size": ("train.micro_batch", "sequences per forward pass per process"),
    "micro_batch_size": ("train.micro_batch", "sequences per forward pass per process"),
    "gradient_accumulation_steps": ("train.effective_batch", _DERIVED),
    "batch_size": ("train.effective_batch", "sequences per optimizer step over all processes; " + _DERIVED),
    "num_train_epochs": ("train.epochs", ""),
    "num_epochs": ("train.epochs", ""),
    "max_steps": ("train.max_steps", ""),
    "learning_rate": ("train.learning_rate", ""),
    "lr_scheduler_type": ("train.lr_schedule", "cosine, linear or constant"),
    "lr_scheduler": ("train.lr_schedule", "cosine, linear or constant"),
    "warmup_ratio": ("train.warmup_ratio", ""),
    "warmup_steps": ("train.warmup_steps", ""),
    "weight_decay": ("train.weight_decay", ""),
    "max_grad_norm": ("train.max_grad_norm", ""),
    "optim": ("train.optimizer", "adamw, adamw_8bit, paged_adamw_8bit or adafactor"),
    "optimizer": ("train.optimizer", "adamw, adamw_8bit, paged_adamw_8bit or adafactor"),
    "output_dir": ("train.output_dir", ""),
    "save_steps": ("train.save_every", ""),
    "save_total_limit": ("train.keep_last", ""),
    "logging_steps": ("train.log_every", ""),
    "seed": ("train.seed", ""),
    "resume_from_checkpoint": ("train.resume", "'auto' or a checkpoint folder"),
    "packing": ("train.packing", ""),
    "sample_packing": ("train.packing", ""),
    "max_seq_length": ("data.max_length", ""),
    "max_length": ("data.max_length", ""),
    "sequence_len": ("data.max_length", ""),
    "dataset_text_field": ("data.fields", "e.g. data.fields={text: your_column}"),
    "completion_only_loss": ("data.train_on", "completion (the default) or all"),
    "assistant_only_loss": ("data.train_on", "completion (the default: assistant turns) or all"),
    "train_on_inputs": ("data.train_on", "train_on_inputs: true is data.train_on=all"),
    "eval_steps": ("eval.every", ""),
    "model_name_or_path": ("model.name_or_path", ""),
    "base_model": ("model.name_or_path", ""),
    "gradient_checkpointing": ("model.gradient_checkpointing", ""),
    "bf16": ("runtime.precision", "runtime.precision=bf16 (auto picks it where the GPU has native bf16)"),
    "fp16": ("runtime.precision", "runtime.precision=fp16 (auto picks it on GPUs without native bf16)"),
    "torch_compile": ("runtime.compile", ""),
    "lora_r": ("lora.r", ""),
    "lora_alpha": ("lora.alpha", ""),
    "lora_dropout": ("lora.dropout", ""),
    "lora_target_modules": ("lora.target_modules", ""),
    "adapter": ("lora.enabled", "adapter: lora is lora.enabled=true; qlora is lora.qlora=true"),
    "load_in_4bit": ("lora.qlora", "4-bit base with LoRA on top"),
}


def _foreign(key: str) -> str:
    """The answer for a TRL/transformers/Axolotl key, or ''."""
    name = key.split(".")[-1]
    if name not in FOREIGN_KEYS:
        return ""
    ours, why = FOREIGN_KEYS[name]
    return f" '{name}' is how TRL/transformers/Axolotl call it; anyfit's key is {ours}" + (f" ({why})." if why else ".")


def _suggest(key: str, choices: list[str]) -> str:
    if _foreign(key):
        return _foreign(key)
    close = difflib.get_close_matches(key, choices, n=1, cutoff=0.5)
    if not close:  # also try matching the last part alone: 'lr_schedule' typed under the wrong section
        tail = key.split(".")[-1]
        by_tail = {c.split(".")[-1]: c for c in choices}
        close = [by_tail[m] for m in difflib.get_close_matches(tail, list(by_tail), n=1, cutoff=0.6)]
    return f" Did you mean '{close[0]}'?" if close else ""


def _coerce(value: Any, tp: Any, where: str) -> Any:
    """Check ``value`` against the annotation ``tp``; convert only what is lossless (int -> float)."""
    origin = typing.get_origin(tp)
    if origin is Literal:
        allowed = typing.get_args(tp)
        if value not in allowed:
            raise ConfigError(f"{where}: {value!r} is not allowed; use one of {', '.join(map(str, allowed))}.")
        return value
    if origin in (Union, types.UnionType):
        errors = []
        for arg in typing.get_args(tp):
            if arg is type(None):
                if value is None:
                    return None
                continue
            try:
                return _coerce(value, arg, where)
            except ConfigError as e:
                errors.append(str(e))
        wanted = " or ".join(_expected(a) for a in typing.get_args(tp) if a is not type(None))
        raise ConfigError(f"{where}: expected {wanted}, got {value!r}.")
    if origin is list:
        (item,) = typing.get_args(tp)
        if not isinstance(value, list):
            raise ConfigError(f"{where}: expected a list, got {value!r}.")
        return [_coerce(v, item, where) for v in value]
    if origin is dict:
        k_tp, v_tp = typing.get_args(tp)
        if not isinstance(value, dict):
            raise ConfigError(f"{where}: expected a mapping such as {{prompt: problem}}, got {value!r}.")
        return {_coerce(k, k_tp, where): _coerce(v, v_tp, where) for k, v in value.items()}
    if tp is bool:
        if not isinstance(value, bool):
            raise ConfigError(f"{where}: expected true or false, got {value!r}.")
        return value
    if tp is int:
        if isinstance(value, bool) or not isinstance(value, int):
            raise ConfigError(f"{where}: expected an integer, got {value!r}.")
        return value
    if tp is float:
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            raise ConfigError(f"{where}: expected a number, got {value!r}.")
        return float(value)
    if tp is str:
        if not isinstance(value, str):
            if isinstance(value, (int, float)) and not isinstance(value, bool):
                return str(value)
            raise ConfigError(f"{where}: expected a string, got {value!r}.")
        return value
    raise ConfigError(f"{where}: unsupported type {tp}")  # pragma: no cover - programming error


def _key_lines(text: str) -> dict[str, int]:
    """Line number (1-based) of every dotted key in a YAML text, for error messages."""
    lines: dict[str, int] = {}

    def walk(node: Any, prefix: str) -> None:
        if isinstance(node, yaml.MappingNode):
            for k, v in node.value:
                key = f"{prefix}{k.value}"
                lines[key] = k.start_mark.line + 1
                walk(v, key + ".")

    try:
        walk(yaml.compose(text), "")
    except yaml.YAMLError:
        pass
    return lines


def _parse_override(item: str) -> tuple[str, Any]:
    if "=" not in item:
        raise ConfigError(f"Override {item!r} must look like key=value, e.g. train.learning_rate=1e-4.")
    key, raw = item.split("=", 1)
    try:
        value = yaml.safe_load(raw) if raw.strip() else ""
    except yaml.YAMLError:
        value = raw
    # YAML 1.1 reads '1e-4' as a string; users mean a number.
    if isinstance(value, str):
        try:
            value = float(value) if any(c in value for c in ".eE") else value
        except ValueError:
            pass
    return key.strip(), value


def _flatten(d: dict[str, Any], prefix: str = "") -> dict[str, Any]:
    out: dict[str, Any] = {}
    for k, v in d.items():
        key = f"{prefix}{k}"
        if not prefix and k in SECTIONS and isinstance(v, dict):
            out.update(_flatten(v, key + "."))
        else:
            out[key] = v
    return out


def build_config(values: dict[str, Any], source: dict[str, str] | None = None) -> Config:
    """Validate flat dotted ``values`` and build a Config. ``source`` says where each key came from."""
    source = source or {}
    keys = all_keys()
    cfg = Config()
    hints = {s: typing.get_type_hints(cls) for s, cls in SECTIONS.items()}
    for key, value in values.items():
        where = f"{source.get(key, 'config')}: '{key}'"
        if key in SECTIONS:
            raise ConfigError(f"{where} must be a mapping of keys (e.g. {keys_of(key)[0]}: ...).")
        if key not in keys:
            raise ConfigError(f"{where} is not a known key.{_suggest(key, keys)} "
                              f"Run 'anyfit train --help-config' for the full list.")
        section, name = key.split(".", 1)
        if isinstance(value, str) and hints[section][name] in (float, int):
            try:
                value = hints[section][name](float(value)) if hints[section][name] is int else float(value)
            except ValueError:
                pass
        if isinstance(value, float) and hints[section][name] is int and value.is_integer():
            value = int(value)
        setattr(getattr(cfg, section), name, _coerce(value, hints[section][name], where))
    validate(cfg)
    return cfg


def keys_of(section: str) -> list[str]:
    return [k for k in all_keys() if k.startswith(section + ".")]


TRACKERS = ("tensorboard", "wandb", "mlflow", "trackio")  # train.report_to values (Accelerate's tracker names)
RUN_CONFIG = "config.yaml"  # the resolved config a training run writes into its output folder


def config_file(path: str | Path) -> Path:
    """``path`` if it is a file, else the shipped config of that name (``anyfit configs`` lists them)."""
    from anyfit import configs

    if Path(path).is_file():
        return Path(path)
    found = configs.find(str(path))
    if found is not None and not Path(path).parent.name:  # a bare name, never a missing path
        return found
    names = ", ".join(n for n in configs.shipped() if not n.startswith("accelerate/"))
    raise ConfigError(f"Config file {path} does not exist (shipped configs, usable by name: {names}; "
                      "`anyfit configs NAME` prints one to copy and edit).")


def _file_values(path: str | Path) -> tuple[dict[str, Any], dict[str, str]]:
    """Flat dotted values of a YAML config file, and the file:line each came from."""
    path = config_file(path)
    text = path.read_text()
    try:
        raw = yaml.safe_load(text) or {}
    except yaml.YAMLError as e:
        mark = getattr(e, "problem_mark", None)
        where = f"{path}:{mark.line + 1}" if mark is not None else str(path)
        what = " ".join(str(getattr(e, "problem", None) or e).split())  # one line: the CLI prints one
        raise ConfigError(f"{where}: not valid YAML ({what}); check the indentation and brackets there.") from None
    if not isinstance(raw, dict):
        raise ConfigError(f"{path}: the top level must be a mapping of sections (model:, data:, train:, ...).")
    lines = _key_lines(text)
    values = _flatten(raw)
    return values, {key: f"{path}:{lines.get(key, '?')}" for key in values}


def run_config_path(folder: str | Path) -> Path | None:
    """The ``config.yaml`` a training run left in ``folder`` (its output folder or a checkpoint), if any."""
    path = Path(folder) / RUN_CONFIG
    return path if path.is_file() else None


def load_config(path: str | Path | None, overrides: list[str] = (), base: str | Path | None = None,
                echo=None) -> Config:
    """The config, in layers: the defaults, then ``base`` (a training run's config.yaml, for eval/generate
    of its output), then the YAML file ``path``, then ``key=value`` overrides; all validated.

    With ``echo`` and a ``base``, says how many settings were inherited from the run and which of them
    the file or the overrides changed.
    """
    values: dict[str, Any] = {}
    source: dict[str, str] = {}
    inherited: dict[str, Any] = {}
    if base is not None:
        inherited, where = _file_values(base)
        values.update(inherited)
        source.update(where)
    if path is not None:
        file_values, where = _file_values(path)
        values.update(file_values)
        source.update(where)
    for item in overrides:
        key, value = _parse_override(item)
        values[key] = value
        source[key] = f"override {item!r}"
    cfg = build_config(values, source)
    if echo is not None and base is not None:
        changed = sorted(k for k in inherited if not source[k].startswith(f"{base}:"))
        echo(f"[anyfit] settings of the training run ({base}) are the base"
             + (f"; set here instead: {', '.join(changed)}" if changed else ""))
    return cfg


def set_by_user(cfg_path: str | Path | None, overrides: list[str], key: str) -> bool:
    """Whether the YAML file or the overrides (not a run's config.yaml) set the dotted ``key``."""
    if any(o.split("=", 1)[0].strip() == key for o in overrides):
        return True
    return cfg_path is not None and key in _file_values(cfg_path)[0]


def validate(cfg: Config) -> None:
    """Checks across fields; raised before any heavy work."""
    t = cfg.train
    for key, value, low in [
        ("train.effective_batch", t.effective_batch, 1),
        ("train.keep_last", t.keep_last, 1),
        ("train.log_every", t.log_every, 1),
        ("train.max_nonfinite_steps", t.max_nonfinite_steps, 1),
        ("data.max_length", cfg.data.max_length, 2),
        ("model.checkpoint_every", cfg.model.checkpoint_every, 1),
        ("lora.r", cfg.lora.r, 1),
        ("eval.max_new_tokens", cfg.eval.max_new_tokens, 1),
    ]:
        if value < low:
            raise ConfigError(f"'{key}' must be at least {low}, got {value}.")
    for key, value in [("eval.holdout", cfg.eval.holdout), ("eval.every", cfg.eval.every),
                       ("eval.generate_every", cfg.eval.generate_every), ("train.max_steps", t.max_steps), ("train.save_every", t.save_every),
                       ("train.warmup_steps", t.warmup_steps), ("train.loss_chunk_tokens", t.loss_chunk_tokens),
                       ("runtime.num_workers", 0 if cfg.runtime.num_workers == "auto" else cfg.runtime.num_workers)]:
        if value < 0:
            raise ConfigError(f"'{key}' must be 0 or more, got {value}.")
    if cfg.eval.holdout and (cfg.eval.path or cfg.eval.split):
        raise ConfigError("Set either eval.holdout (records taken from the training data) or eval.path/eval.split "
                          "(separate held-out data), not both.")
    if cfg.eval.batch_size != "auto" and cfg.eval.batch_size < 1:
        raise ConfigError(f"'eval.batch_size' must be at least 1 or 'auto', got {cfg.eval.batch_size}.")
    if t.learning_rate <= 0:
        raise ConfigError(f"'train.learning_rate' must be positive, got {t.learning_rate}.")
    if not 0 < cfg.runtime.memory_fraction <= 1:
        raise ConfigError(f"'runtime.memory_fraction' must be in (0, 1], got {cfg.runtime.memory_fraction}.")
    if not 0 <= t.warmup_ratio < 1:
        raise ConfigError(f"'train.warmup_ratio' must be in [0, 1), got {t.warmup_ratio}.")
    if t.max_steps == 0 and t.epochs <= 0:
        raise ConfigError("Set 'train.max_steps' > 0 or 'train.epochs' > 0: the run has no length.")
    if t.micro_batch != "auto" and t.micro_batch < 1:
        raise ConfigError(f"'train.micro_batch' must be at least 1 or 'auto', got {t.micro_batch}.")
    if t.micro_batch != "auto" and t.micro_batch > t.effective_batch:
        raise ConfigError(f"'train.micro_batch' ({t.micro_batch}) is larger than 'train.effective_batch' "
                          f"({t.effective_batch}); lower micro_batch or raise effective_batch.")
    trackers = [cfg.train.report_to] if isinstance(cfg.train.report_to, str) else list(cfg.train.report_to)
    unknown = [r for r in trackers if r not in TRACKERS and r != "none"]
    if unknown:
        raise ConfigError(f"'train.report_to' {unknown} is not a tracker anyfit knows; use none or any of "
                          f"{', '.join(TRACKERS)}.{_suggest(unknown[0], list(TRACKERS))}")
    from anyfit.data.templates import check_template  # the template names live with the templates

    check_template(cfg.data)
    unknown_fields = set(cfg.data.fields) - {"messages", "prompt", "completion", "text", "system", "answer"}
    if unknown_fields:
        raise ConfigError(f"'data.fields' maps unknown anyfit fields {sorted(unknown_fields)}; the keys must be among "
                          "messages, prompt, completion, text, system, answer (the values are your column names).")


def help_text() -> str:
    """Every key with its type, default and help, grouped by section (for --help-config)."""
    out = []
    section = None
    for key, tp, default, help in field_help():
        s = key.split(".")[0]
        if s != section:
            section = s
            out.append(f"\n{s}:  {SECTIONS[s].__doc__.strip()}")
        out.append(f"  {key} ({tp}, default {default!r})\n      {help}")
    return "\n".join(out)


def reference_markdown() -> str:
    """The README's config reference tables, generated from the dataclasses (scripts/update_readme.py)."""
    out: list[str] = []
    section = None
    for key, tp, default, help in field_help():
        s = key.split(".")[0]
        if s != section:
            section = s
            out += ([""] if out else []) + [f"**{s}**: {SECTIONS[s].__doc__.strip()}", "",
                                            "| key | type | default | meaning |", "|---|---|---|---|"]
        tp = tp.replace("|", "\\|").replace("NoneType", "null")
        out.append(f"| `{key}` | {tp} | `{default!r}` | {help} |")
    return "\n".join(out) + "\n"

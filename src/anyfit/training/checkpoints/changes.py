"""What a resumed run changes against the checkpoint it continues, and what is done with each change.

Every setting has one rule here (``RULES``; a test checks that none is missing): it is *applied* (and how, in
words the resume prints and ``run_info.json`` records), or *refused* (the resume stops in one line with the
reason and the value that continues the run). A difference is never ignored. The rule of thumb: what decides
which tensors exist or which examples a step draws is refused; what decides how fast or where the same
function is computed (layout, memory savers, logging) applies at once; the optimizer's hyperparameters and the
learning-rate schedule apply from the resumed step on, as the new config gives them (``follow_config``).

The data itself is compared by its content, not by the ``data.*`` settings (``anyfit.data.fingerprint``): a
setting that tokenizes the same records the same way changes nothing, one that does not is named there.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import yaml

from anyfit.config import Config, ConfigError
from anyfit.data import fingerprint
from anyfit.runfolder import RUN_CONFIG

APPLY, REFUSE = "applied", "refused"
# How this start was asked for, not what the run computes: never listed as a change.
INVOCATION = ("train.resume", "train.overwrite", "train.resume_changed_data")

_AT_ONCE = "takes effect at once"
_LAYOUT = "where and how fast the same function is computed: applied at once (the backends' own rules for a layout)"
_SAVER = "a memory saver: the same function, other memory and speed"
_SCHEDULE = ("the learning rate follows the new schedule from the resumed step on (the one the run would have had "
             "with these settings from step 0)")
_OPTIMIZER = "the optimizer's new hyperparameter applies from this step on (its moments are kept)"
_DATA = "checked by the data's content (anyfit.data.fingerprint): the same tokens change nothing"

_TENSORS = "it decides which tensors the checkpoint holds"


@dataclass(frozen=True)
class Rule:
    verdict: str  # APPLY or REFUSE
    why: str
    adapter_refusal: str | None = None  # with LoRA: refused, for this reason, instead


def _apply(why: str) -> Rule:
    return Rule(APPLY, why)


def _refuse(why: str) -> Rule:
    return Rule(REFUSE, why)


# Where the model is read from: a full fine-tune's every weight comes from the checkpoint (the place gives the
# architecture, checked when the weights load, and the tokenizer, whose tokens the data's fingerprint checks), so
# the same model moved to another folder or machine continues. An adapter was trained on that place's base weights,
# which anyfit cannot tell another place holds without reading them all.
_PLACE = Rule(APPLY, "every weight of a full fine-tune comes from the checkpoint; the new place gives the "
                     "architecture (checked as the weights load) and the tokenizer (checked by the data's tokens)",
              adapter_refusal="the adapter was trained on the base weights at that place")


RULES: dict[str, Rule] = {
    # model
    "model.name_or_path": _PLACE, "model.gguf_file": _PLACE, "model.revision": _PLACE,
    "model.tokenizer": _apply(_DATA),
    "model.trust_remote_code": _refuse("it decides the model's code"),
    "model.dtype": _apply("the weights are read from the checkpoint in the new dtype"),
    "model.attn_implementation": _apply("the same attention, another kernel (anyfit refuses one that is not exact)"),
    "model.gradient_checkpointing": _apply(_SAVER), "model.checkpoint_every": _apply(_SAVER),
    "model.activation_offload": _apply(_SAVER), "model.tiled_mlp": _apply(_SAVER),
    "model.train_vision": _refuse("it decides which weights train: the checkpoint's optimizer state (and an "
                                  "adapter's tensors) hold the others"),
    "model.train_projector": _refuse("it decides which weights train: the checkpoint's optimizer state (and an "
                                     "adapter's tensors) hold the others"),
    "model.keep_unloaded_tensors": _apply("the checkpoints and final model written from now on keep or drop the "
                                          "tensors the model does not load, as it says (read from the source)"),
    # lora
    "lora.enabled": _refuse(_TENSORS), "lora.qlora": _refuse("the adapter was trained on that base's weights"),
    "lora.r": _refuse(_TENSORS), "lora.target_modules": _refuse(_TENSORS), "lora.experts": _refuse(_TENSORS),
    "lora.alpha": _refuse("it scales what the trained adapter adds: the model would change without a step"),
    "lora.dropout": _apply("from this step on"),
    "lora.split_experts": _apply("the experts' adapters are computed the other way from this step on (the same "
                                 "function and tensors, up to round-off)"),
    "lora.qlora_upcast": _apply("the precision the 4-bit base is computed in, from this step on"),
    # data: by content
    **{f"data.{k}": _apply(_DATA) for k in (
        "path", "subset", "split", "num_samples", "format", "fields", "ignore_fields", "train_reasoning", "template",
        "system_prompt", "max_length", "overlong", "train_on", "chat_template", "chat_template_kwargs",
        "system_fallback", "train_empty_think", "reasoning_layout", "add_eos", "mix", "source_column")},
    "data.num_proc": _apply(_AT_ONCE), "data.cache_dir": _apply(_AT_ONCE), "data.allow_stop_only": _apply(_AT_ONCE),
    # train
    "train.output_dir": _apply("the run goes on in the new folder"), "train.overwrite": _apply(_AT_ONCE),
    "train.resume": _apply(_AT_ONCE), "train.resume_changed_data": _apply(_AT_ONCE),
    "train.effective_batch": _refuse("it decides what a step is: the examples each step draws and the number of "
                                     "steps, so the resumed steps would not continue the run"),
    "train.micro_batch": _apply("the same windows cut into other micro-batches: the same result up to round-off"),
    "train.epochs": _apply(_SCHEDULE), "train.max_steps": _apply(_SCHEDULE),
    "train.learning_rate": _apply(_SCHEDULE), "train.lr_schedule": _apply(_SCHEDULE),
    "train.warmup_steps": _apply(_SCHEDULE), "train.warmup_ratio": _apply(_SCHEDULE),
    "train.min_lr_ratio": _apply(_SCHEDULE),
    "train.weight_decay": _apply(_OPTIMIZER), "train.adam_beta1": _apply(_OPTIMIZER),
    "train.adam_beta2": _apply(_OPTIMIZER), "train.adam_eps": _apply(_OPTIMIZER),
    "train.optimizer": _refuse("its state does not fit another optimizer"),
    "train.max_grad_norm": _apply("from this step on"),
    "train.save_every": _apply(_AT_ONCE), "train.keep_last": _apply(_AT_ONCE), "train.save_final": _apply(_AT_ONCE),
    "train.keep_best": _apply("from this step on (another metric starts a new comparison; checkpoints kept stay)"),
    "train.log_every": _apply(_AT_ONCE),
    "train.report_to": _apply(_AT_ONCE), "train.max_nonfinite_steps": _apply(_AT_ONCE),
    "train.seed": _refuse("it decides the order of the examples and the records held out: the resumed steps would "
                          "draw other windows"),
    "train.packing": _apply("the same windows laid out in other rows (packing is used only where it is exact)"),
    "train.packing_check": _apply(_AT_ONCE), "train.inference_check": _apply(_AT_ONCE),
    "train.loss_chunk_tokens": _apply(_SAVER), "train.fused_loss": _apply(_SAVER),
    "train.router_aux_loss_coef": _apply("the routers' balance loss has the new weight from this step on"),
    "train.watch_base": _apply(_AT_ONCE), "train.base_kl_warn": _apply(_AT_ONCE),  # training.forgetting
    "train.base_kl_weight": _apply("the anchor to the base model has the new weight from this step on"),
    **{f"eval.{k}": _apply("takes effect at once (full fine-tuning: base_kl is off for the resume unless the run "
                           "folder holds the base's top-k of that text)") for k in (
        "base_text", "base_text_tokens", "base_top_k")},
    # eval
    "eval.holdout": _refuse("it decides which records train: the resumed steps would draw from other examples"),
    **{f"eval.{k}": _apply(_AT_ONCE) for k in (
        "path", "split", "every", "generate_every", "generate_before", "generate_at_end", "num_generate",
        "max_new_tokens", "batch_size")},
    # runtime
    **{f"runtime.{k}": _apply(_LAYOUT) for k in (
        "device", "precision", "tf32", "fused_optimizer", "memory_fraction", "num_workers", "compile", "sharding",
        "sequence_parallel", "fsdp_offload", "deepspeed_offload", "fsdp_reduce_every_micro_batch")},
    "runtime.profile": _apply(_AT_ONCE), "runtime.profile_warmup": _apply(_AT_ONCE),
}


@dataclass(frozen=True)
class Change:
    key: str
    before: Any
    after: Any
    rule: Rule

    def words(self) -> str:
        return f"{self.key} {_value(self.before)} -> {_value(self.after)}"


def settings(config: dict[str, Any]) -> dict[str, Any]:
    """A config as ``section.key`` -> value (the YAML's values, so a saved and a loaded config compare alike)."""
    return {f"{section}.{key}": value for section, values in config.items() if isinstance(values, dict)
            for key, value in values.items()}


def config_changes(saved: dict[str, Any], cfg: Config) -> list[Change]:
    """The settings whose value differs between a checkpoint's config and this run's, each with its rule. A key
    only one side has (a config of another anyfit version) counts as changed when the other side's value is not
    the default."""
    now = settings(yaml.safe_load(cfg.to_yaml()))
    before = settings(saved)
    defaults = settings(yaml.safe_load(Config().to_yaml()))
    changes = []
    for key in sorted(set(now) | set(before)):
        old, new = before.get(key, defaults.get(key)), now.get(key, defaults.get(key))
        if old != new and key not in INVOCATION:
            rule = RULES.get(key, _refuse("anyfit has no rule for this setting"))
            if rule.adapter_refusal and (cfg.lora.enabled or cfg.lora.qlora):
                rule = _refuse(rule.adapter_refusal)
            changes.append(Change(key, old, new, rule))
    return changes


def saved_config(directory: Path) -> dict[str, Any] | None:
    """A checkpoint's config.yaml (None: an older checkpoint without one, or unreadable)."""
    try:
        saved = yaml.safe_load((directory / RUN_CONFIG).read_text())
    except (OSError, UnicodeDecodeError, yaml.YAMLError):
        return None
    return saved if isinstance(saved, dict) else None


def check_config(directory: Path, cfg: Config) -> list[Change]:
    """The changes a resume from ``directory`` makes, all applied; refused in one line (naming every refused
    setting, its reason and the value that continues the run) when one may not change."""
    saved = saved_config(directory)
    if saved is None:  # an older checkpoint without config.yaml: its files are checked when they load
        return []
    changes = config_changes(saved, cfg)
    refused = [c for c in changes if c.rule.verdict == REFUSE]
    if refused:
        sets = " ".join(f"{c.key}={_value(c.before)}" for c in refused)
        raise ConfigError(f"train.resume: checkpoint {directory} was written with "
                          + "; ".join(f"{c.key}={_value(c.before)}, this run has {c.key}={_value(c.after)} "
                                      f"({c.rule.why})" for c in refused)
                          + f". Set {sets} to continue it, or start a new run in another train.output_dir.")
    return changes


def check_data(directory: Path, now: tuple[dict, list], allowed: bool) -> str | None:
    """None when this run draws from the examples the checkpoint's run drew from (or the checkpoint predates
    data fingerprints); else what changed, as a note, when ``train.resume_changed_data`` allows it; refused in
    one line otherwise."""
    saved, saved_digests = fingerprint.load(directory)
    if saved is None:
        return None
    changed = fingerprint.difference(saved, saved_digests, now[0], now[1])
    if changed is None:
        return None
    if not allowed:
        raise ConfigError(f"train.resume: the training data differs from what checkpoint {directory} was trained "
                          f"on: {changed}. Resume anyway with train.resume_changed_data=true (the remaining steps "
                          "draw from the new data, in its own seeded order), or start a new run in another "
                          "train.output_dir.")
    return f"the training data differs from the checkpoint's: {changed}"


def describe(changes: list[Change]) -> str:
    """The changes in words, those with the same rule together: 'a 1 -> 2, b 3 -> 4: why; ...'."""
    by_rule: dict[str, list[Change]] = {}
    for c in changes:
        by_rule.setdefault(c.rule.why, []).append(c)
    return "; ".join(f"{', '.join(c.words() for c in group)}: {why}" for why, group in by_rule.items())


def resume_lines(directory: Path, step: int, steps: int, changes: list[Change], data_note: str | None) -> list[str]:
    """What a resume prints: where it continues, then what changed (the settings, then the data)."""
    said = ([f"changed since the checkpoint: {describe(changes)}"] if changes else []) + ([data_note] if data_note
                                                                                        else [])
    return [f"[anyfit] resumed from {directory} at step {step} of {steps}", *(f"[anyfit] resume: {s}" for s in said)]


def resume_record(directory: Path, step: int, changes: list[Change], data_note: str | None) -> dict[str, Any]:
    """What ``run_info.json`` keeps of a resume: its step and checkpoint, per changed setting the values and what
    was done, and the data's note."""
    return {"step": step, "from": str(directory),
            "changed": {c.key: {"before": c.before, "after": c.after, "done": c.rule.why} for c in changes},
            **({"data": data_note} if data_note else {})}


def _value(value: Any) -> str:
    if value is None:
        return "null"
    if isinstance(value, bool):
        return str(value).lower()
    return str(value)


def unruled(cfg: Config | None = None) -> list[str]:
    """Settings of the config without a rule here (the architecture test keeps this empty)."""
    cfg = cfg or Config()
    keys = [f"{section.name}.{f.name}" for section in dataclasses.fields(cfg)
            for f in dataclasses.fields(getattr(cfg, section.name))]
    return [k for k in keys if k not in RULES]

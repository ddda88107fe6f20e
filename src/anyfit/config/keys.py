"""Answers for keys that are not anyfit's: the TRL / transformers / Axolotl name of a setting mapped to
anyfit's key, and a "did you mean" for typos. Used by the loader (unknown keys) and the schema (unknown values)."""

from __future__ import annotations

import difflib

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
    "load_best_model_at_end": ("train.keep_best", "validation_loss or accuracy; anyfit export takes the best"),
    "metric_for_best_model": ("train.keep_best", "validation_loss, accuracy, or min:KEY / max:KEY"),
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
    "loss_scale": ("data.train_on", "ms-swift's last_round is data.train_on=last_turn"),
    "chat_template_jinja": ("data.chat_template", "a .jinja file or the template text"),
    "ignore_empty_think": ("data.train_empty_think", "the empty think block is context by default"),
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
    "sequence_parallel_degree": ("runtime.sequence_parallel", "Axolotl's; DeepSpeed's Ulysses here"),
    "sp_size": ("runtime.sequence_parallel", "Accelerate's parallelism config; DeepSpeed's Ulysses here"),
    "context_parallel_size": ("runtime.sequence_parallel", "anyfit splits sequences with Ulysses, not ring attention"),
    "tiled_mlp": ("model.tiled_mlp", ""),
    "use_liger_kernel": ("train.fused_loss", "anyfit's fused head and loss, chunk by chunk, on every device"),
}


def foreign_answer(key: str) -> str:
    """The answer for a TRL/transformers/Axolotl key, or ''."""
    name = key.split(".")[-1]
    if name not in FOREIGN_KEYS:
        return ""
    ours, why = FOREIGN_KEYS[name]
    return f" '{name}' is how TRL/transformers/Axolotl call it; anyfit's key is {ours}" + (f" ({why})." if why else ".")


def suggest(key: str, choices: list[str]) -> str:
    if foreign_answer(key):
        return foreign_answer(key)
    close = difflib.get_close_matches(key, choices, n=1, cutoff=0.5)
    if not close:  # also try matching the last part alone: 'lr_schedule' typed under the wrong section
        tail = key.split(".")[-1]
        by_tail = {c.split(".")[-1]: c for c in choices}
        close = [by_tail[m] for m in difflib.get_close_matches(tail, list(by_tail), n=1, cutoff=0.6)]
    return f" Did you mean '{close[0]}'?" if close else ""

"""The typed run configuration: one dataclass per section, whose field help the CLI shows, and the checks
across fields (``validate``), run before any model or data is touched.

The accepted names of open-ended string keys (``data.template``, ``train.report_to``, ``data.fields``) are
schema too and live here, so every layer above asks this module instead of keeping its own list.
"""

from __future__ import annotations

import dataclasses
import re
from dataclasses import dataclass, field
from typing import Any, Literal

import yaml

from anyfit.config.keys import suggest


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
    activation_offload: bool = _f(
        False, "Move the activations the decoder body keeps for the backward to host RAM during the forward and "
        "back when the backward needs them (with gradient_checkpointing: each checkpointed layer's input). On CUDA "
        "it frees their device memory for two copies over PCIe, not overlapped with compute (anyfit plan counts "
        "them); on a CPU or Apple's unified memory it frees nothing.")
    tiled_mlp: bool = _f(
        False, "Run each decoder layer's MLP over the sequence in tiles of about hidden_size tokens (DeepSpeed's "
        "TiledMLP; the backward recomputes one tile at a time), so the MLP's intermediate activations never exist "
        "for a whole long sequence. Costs one more MLP forward per step.")
    train_vision: Literal["frozen", "lora", "full"] = _f(
        "frozen", "A vision-language composite's vision tower (the module transformers' get_encoder('image') "
        "returns: vision_tower, visual, vision_model): frozen (its loaded weights, bit for bit); lora: LoRA adapters on "
        "its linear layers too (needs lora.enabled or lora.qlora; lora.target_modules auto/all-linear takes every one "
        "of them, a list takes the names it shares with the tower); full: all its weights train (in a LoRA run they are "
        "saved whole in the adapter, PEFT's modules_to_save). With model.gradient_checkpointing its layers recompute "
        "only when it trains. A model without a vision tower refuses anything but frozen.")
    train_projector: bool = _f(
        False, "Train a composite's projector fully: its parameters outside the language model and the vision tower "
        "(LLaVA's, Gemma-3's, Mistral-3's multi_modal_projector, Idefics3's connector, Gemma-4's embed_vision; saved "
        "whole in a LoRA run's adapter). A model whose projector is part of its tower (Qwen's visual.merger) says so "
        "in one line: that one trains with the tower, or not at all.")
    keep_unloaded_tensors: bool = _f(
        True, "Tensors of the checkpoint that the model's transformers class does not load (Qwen3.5's multi-token "
        "prediction mtp.*, DeepSeek-V3's and GLM-4.5's extra MTP layer) are written unchanged, not trained, beside "
        "the weights of every checkpoint, the final model and full exports (listed in model.safetensors.index.json, "
        "where servers such as vLLM find them). false drops them. The run names them in one line either way.")


@dataclass
class LoraConfig:
    """Low-rank adapters through PEFT. Off means full fine-tuning."""

    enabled: bool = _f(False, "Train LoRA adapters instead of all weights.")
    r: int = _f(16, "Adapter rank.")
    alpha: int = _f(32, "LoRA scaling numerator (the update is scaled by alpha / r).")
    dropout: float = _f(0.05, "Dropout on the adapter input.")
    qlora: bool = _f(False, "Load the frozen base in 4-bit NF4 (bitsandbytes) and train LoRA on top. CUDA; also the "
                     "CPU with bitsandbytes>=0.50 (slow: for checking a config), not MPS.")
    qlora_upcast: bool = _f(
        True, "QLoRA: cast the weights that stay unquantized (embeddings, output head, norms) to fp32, as PEFT's "
        "prepare_model_for_kbit_training does. false keeps them in the compute dtype (bf16), as torchtune and LitGPT "
        "do: 2 bytes less per such weight and a bf16 residual stream (anyfit plan counts both).")
    target_modules: list[str] | str = _f(
        "auto", "Module names to adapt, or 'auto' to find the attention and MLP projections from the "
        "model's module names (q_proj..., c_attn/c_proj, query_key_value, ...), or 'all-linear'. In a mixture of "
        "experts a router is never adapted; the routed experts' fused tensors (gate_up_proj, down_proj) may be named.")
    experts: bool = _f(
        True, "Mixtures of experts: with target_modules auto/all-linear, adapt the routed experts too (PEFT's "
        "target_parameters on their fused tensors: an r x (in + out) adapter per expert). false: attention, shared "
        "experts and dense layers only. Fused expert tensors take no dropout (PEFT's rule); lora.dropout stays on "
        "the linear layers.")
    split_experts: bool = _f(
        True, "Mixtures of experts: compute the routed experts' adapters as base plus low-rank path, x·W + s·(x·A)·B "
        "over each expert's tokens (grouped matmuls), so memory holds one copy of the experts. false, or where a "
        "model's experts compute otherwise (checked at start, said in one line): PEFT's path, which forms W + BA "
        "for every expert in each forward and keeps it for the backward. The adapter is PEFT's either way.")


@dataclass
class DataConfig:
    """Where the training examples come from and how they become tokens."""

    path: str = _f("", "A local .jsonl/.json/.csv file (also compressed: .jsonl.gz, .bz2, .xz, .zst), .parquet or "
                   ".arrow file, a folder or a glob of them (data/train-*.jsonl), a folder written by save_to_disk, or a "
                   "hub dataset name.")
    subset: str | None = _f(None, "Hub dataset configuration name (e.g. 'main' for gsm8k).")
    split: str = _f("train", "Split, with optional slicing: 'train', 'train[:500]', 'train[10%:]'.")
    num_samples: int | None = _f(None, "Use at most this many examples (after loading, before shuffling).")
    format: Literal["auto", "messages", "prompt_completion", "alpaca", "text", "tokens"] = _f(
        "auto", "Example format. auto: detect from the fields (messages or conversations, prompt/completion, "
        "instruction/input/output, text, or input_ids + optional completion_mask for pre-tokenized data).")
    fields: dict[str, str] = _f(
        {}, "Map anyfit's fields to yours, e.g. {prompt: problem, completion: solution} for MATH; also input, "
        "system, answer, tools, messages, instruction, output, history.")
    ignore_fields: list[str] = _f(
        [], "Record fields or message keys (messages[].weight) that hold training content anyfit does not read and "
        "that you want it to train without; any other such field (input, tool_calls, reasoning_content, ...) stops "
        "the run.")
    train_reasoning: bool = _f(
        True, "Train the reasoning traces of assistant turns (reasoning_content / thinking / <think>). false: they "
        "stay in the context the model reads, and the loss is on the answers only.")
    template: str = _f(
        "chat", "How examples are laid out: 'chat' (the tokenizer's chat template; a string prompt becomes the user "
        "message); 'plain' (the text is prompt + completion, nothing added between them; each tokenized on its "
        "own); 'trl' (as TRL's SFTTrainer tokenizes the same records: prompt + completion + EOS tokenized whole, "
        "the loss from the first token that differs from the prompt's own; conversations through the chat "
        "template); 'r1_zero' (<think> ... </think> <answer> ... </answer>); or a custom string with {prompt} in it.")
    system_prompt: str | None = _f(None, "System message for the chat template.")
    max_length: int = _f(1024, "Longest example in tokens.")
    overlong: Literal["truncate", "drop"] = _f("truncate", "What to do with longer examples (both are counted and reported).")
    train_on: Literal["completion", "last_turn", "all"] = _f(
        "completion", "Which tokens carry loss: completion (every assistant turn, or the completion), last_turn (only "
        "a conversation's final assistant turn; earlier turns are context), or all tokens. A message with weight: 0, "
        "loss: false or train: false is context under completion and last_turn.")
    chat_template: str | None = _f(
        None, "A chat template replacing the tokenizer's: a .jinja file or the template text itself. Used for "
        "training, eval and generate, and written with the tokenizer into the run and the export.")
    chat_template_kwargs: dict[str, Any] = _f(
        {}, "Options handed to the chat template, as at serving time: e.g. {enable_thinking: false} (Qwen3), "
        "{reasoning_effort: high} (gpt-oss), {thinking: true} (DeepSeek-V3.1). A record's own chat_template_kwargs "
        "column overrides them for that record. Used by eval and generate too, and named in the model card.")
    system_fallback: Literal["refuse", "fold", "drop"] = _f(
        "refuse", "A system prompt with a chat template that has no system role (Gemma-2, Mistral v0.2): refuse (stop "
        "with one line), fold (put it before the first user message, a blank line between) or drop it.")
    train_empty_think: bool = _f(
        False, "Train the empty think block a chat template writes before an assistant turn without reasoning "
        "(Qwen3's empty <think></think>). false: it is context, so the model does not learn to skip thinking; the "
        "data report says how many turns had one.")
    reasoning_layout: str | None = _f(
        None, "The text around a reasoning trace, '{reasoning}' standing for it (e.g. '<think>\\n{reasoning}\\n</think>"
        "\\n\\n', DeepSeek-R1's), for a chat template that does not show how it lays reasoning out (one that reads no "
        "reasoning key, or drops the trace from finished turns). Unset: such data is refused in one line; templates "
        "that show their layout are always laid out as they show it.")
    add_eos: bool = _f(True, "End each completion with the tokenizer's EOS token (so the model learns to stop).")
    allow_stop_only: bool = _f(
        False, "Train data whose every example teaches only its end-of-turn or EOS token (all completions empty: "
        "the model would learn nothing but to stop). Refused unless true.")
    num_proc: int | Literal["auto"] = _f(
        "auto", "Processes that render and tokenize a large data set (20k records or more) while its token store is "
        "built; auto: the cores, at most one per GiB of available memory, at most 8.")
    cache_dir: str | None = _f(
        None, "Where token stores are kept: the data tokenized once and memory-mapped by every later run and "
        "process (anyfit prepare builds one ahead). Default: $ANYFIT_CACHE/tokens, else ~/.cache/anyfit/tokens.")
    source_column: str | None = _f(
        None, "A record field naming each record's source (e.g. source in allenai/tulu-3-sft-mixture): training and "
        "validation loss are then logged per source too (loss/<value>, val_loss/<value>), as with data.mix. Every "
        "record needs a value (eval.path data too); at most 64 distinct values. Not with data.mix, whose entries are "
        "the sources.")
    mix: list[dict[str, Any]] = _f(
        [], "Several sources in one run instead of data.path: a list of {path, weight, ...} where each entry may set "
        "any data.* key for itself (split, subset, fields, template, system_prompt, format, max_length, ...; the "
        "others come from data.*) and weight is its share of every epoch (examples drawn with a seeded sample, "
        "repeated when the share is more than the source holds); name (default: the file name) is what its loss is "
        "logged under, loss/<name>. E.g. [{path: math.jsonl, weight: 3}, {path: chat.jsonl, weight: 1, template: "
        "chat}].")


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
        "states (CUDA only; paged moves them to host memory under pressure); with runtime.sharding=fsdp, adamw_8bit "
        "is torchao's (any device, sharded states; its checkpoints continue on as many processes as wrote them). "
        "adafactor: factored second moments, no first moment: a fraction of AdamW's state (not with sharding).")
    lr_schedule: Literal["cosine", "linear", "constant"] = _f("cosine", "Decay after warmup.")
    warmup_steps: int = _f(0, "Linear warmup steps (overrides warmup_ratio when > 0).")
    warmup_ratio: float = _f(0.0, "Warmup as a fraction of the total steps.")
    min_lr_ratio: float = _f(0.0, "Final learning rate as a fraction of the peak (cosine and linear).")
    max_grad_norm: float = _f(1.0, "Clip the global gradient norm to this (0: no clipping).")
    save_every: int = _f(0, "Write a checkpoint every N steps (0: only the final model).")
    keep_last: int = _f(2, "Keep this many most recent checkpoints.")
    keep_best: str | None = _f(
        None, "Keep the checkpoint with the best validation metric outside keep_last's rotation: validation_loss, "
        "accuracy (generation accuracy), base_kl, or min:KEY / max:KEY for any metric of the evaluation lines. A "
        "better value writes a checkpoint at that step; best.json in the run folder names it, and anyfit export "
        "exports it by default (--last: the final model).")
    save_final: bool = _f(
        True, "Write the final model (or adapter) into output_dir at the end. false: a run whose steps are what counts "
        "(a benchmark; anyfit profile sets it for its run and its probes); the checkpoints still follow save_every.")
    log_every: int = _f(10, "Write a metrics line every N steps (each costs one device-to-host sync).")
    report_to: list[str] | str = _f(
        "none", "Also send every metrics line to experiment trackers, through Accelerate's: none, or one or a list of "
        "tensorboard, wandb, mlflow, trackio (install the tracker: pip install 'anyfit[tensorboard]', ...). "
        "wandb offline: set WANDB_MODE=offline.")
    seed: int = _f(42, "Seed for initialisation of adapters, data order and dropout.")
    resume: str | None = _f(
        None, "Continue a run: 'auto' (the newest complete checkpoint in output_dir; a fresh start if there is "
        "none) or the path of a checkpoint-N folder, written with any process count and sharding. Restores weights, "
        "optimizer, scheduler, loss scaler, RNG states and the position in the data. Unset inside a job that torchrun "
        "or SLURM restarted: auto. Settings changed since the checkpoint are listed: each is applied (a new "
        "learning rate or length: the new schedule from the resumed step on) or refused with the reason.")
    resume_changed_data: bool = _f(
        False, "Resume even though the training data differs from the checkpoint's (records edited, added or removed, "
        "or tokenized differently): the remaining steps draw from the new data in its own seeded order, and the "
        "difference is printed and recorded in run_info.json. Off: such a resume stops and says what changed.")
    packing: bool = _f(
        True, "Concatenate each micro-batch's examples into one row without padding; attention still stops at "
        "example boundaries (position_ids). Off: right-pad each micro-batch to its longest example. Layers that "
        "carry a state along the row (linear attention, state spaces, short convolutions: Qwen3.5, Qwen3-Next, LFM2, "
        "Falcon-H1, Granite-4.0-H, Jamba) run one example per row inside the packed row (or get the boundaries in "
        "kernels that take them), as the packing self-test decides; where neither is exact, padded batches, with a "
        "printed line.")
    packing_check: bool = _f(
        True, "With packing: before the first step, run a few probe examples (one longer than the smallest sliding "
        "window) packed and one at a time on the real model in its training dtype; if they differ beyond round-off, "
        "fall back to transformers' own attention with a block mask per row, then to padded batches, and say so. "
        "About two forwards of 256 tokens (more where a window is longer, at most data.max_length); false skips it, "
        "except for models with state layers or image data, which are always tested.")
    inference_check: bool | Literal["warn"] = _f(
        True, "Before the first step, check that the training forward (train mode, dropout off, the training dtype, "
        "packed or padded as the run trains) computes the logits that inference does: generate with its KV cache "
        "(or a hybrid model's state cache), a prefill and then one token at a time, forced to two probe sequences of "
        "32 data tokens, compared at every position against the dtype's round-off. A difference stops the run with "
        "one line naming the model class and the first decoder layer that differs. warn: print that line and train "
        "anyway; false: skip the check. About 70 forwards of one token and one of 64.")
    loss_chunk_tokens: int = _f(
        1024, "Take the cross-entropy in fp32 this many tokens at a time, so fp32 logits over the whole vocabulary "
        "never exist for more rows (0: plain torch cross-entropy on all trained positions at once).")
    fused_loss: bool = _f(
        False, "Run the output layer and the loss together, loss_chunk_tokens rows at a time, so the logits of all "
        "trained positions never exist (tokens x vocabulary: 9 GiB in bf16 at 32k tokens of a 152k vocabulary, "
        "twice that with their gradient). Costs one more output-layer matmul per token in the backward. For "
        "Llama, Mistral, Qwen2/3 (MoE too), Phi-3, SmolLM3 and OLMo-2 models.")
    router_aux_loss_coef: float | Literal["auto"] = _f(
        "auto", "Mixtures of experts: weight of the router's load-balancing loss (transformers' own aux_loss, "
        "added once per micro-batch and logged as aux_loss). auto: what the model's config asks (its "
        "router_aux_loss_coef when output_router_logits is true, else none); 0: none.")
    max_nonfinite_steps: int = _f(
        3, "Stop with a diagnosis after this many optimizer steps in a row with a non-finite loss or gradient "
        "(each one is skipped: no update).")
    watch_base: bool | Literal["auto"] = _f(
        "auto", "At every validation, log base_kl: the mean per-token KL divergence KL[base, tuned] in nats of the "
        "next-token distributions on held-out text (eval.base_text, else the validation prompts): how far the model drifts "
        "from the base on text it already handled. LoRA: exact (the adapters disabled), one more forward per "
        "validation batch. Full fine-tuning: the base's top eval.base_top_k log-probabilities are computed once "
        "before the first update and kept; the KL over them plus the rest of the vocabulary as one bucket is a lower "
        "bound of the full KL. auto: on with LoRA when eval.every > 0 and there is held-out text.")
    base_kl_warn: float = _f(
        0.5, "Print a warning when base_kl grows past this many nats per token (0: never). 0.5 nats is about a "
        "1.6x average change of the probability ratio of the base's likely tokens; a light fine-tune stays well "
        "below 0.1.")
    base_kl_weight: float = _f(
        0.0, "Add this weight x the mean per-token KL[base, tuned] over the trained tokens to the loss (normalised "
        "over the window's trained tokens as the loss is; the logged loss stays the cross-entropy): anchors the "
        "model to the base. LoRA only (the base is the adapters disabled: one more forward, without gradient, per "
        "micro-batch, and fp32 log-probabilities of both models at the trained positions); not with "
        "train.fused_loss. 0: off.")


@dataclass
class EvalConfig:
    """Evaluation during training: validation loss and generation accuracy on held-out examples."""

    path: str | None = _f(None, "Held-out data (file or hub name, read with the data.* settings); default: data.path.")
    split: str | None = _f(None, "Split of eval.path (e.g. 'test[:200]'). Set eval.path or eval.split to hold data out.")
    holdout: int = _f(0, "Instead of eval.path/split: hold out this many training records (seeded) for evaluation; "
                      "with data.mix, this many of each source (the validation loss is then reported per source too).")
    every: int = _f(0, "Validation loss every N optimizer steps (0: off); also at the end when eval data is set.")
    generate_every: int = _f(0, "Generation accuracy every N steps (0: off). Costs a generation pass each time.")
    generate_before: bool = _f(False, "Generation accuracy before the first step (the base model's score).")
    generate_at_end: bool = _f(False, "Generation accuracy after the last step.")
    num_generate: int = _f(64, "Held-out examples used for generation accuracy.")
    max_new_tokens: int = _f(256, "Longest generated answer in the generation eval, and in anyfit eval unless "
                             "--max-new-tokens is given.")
    batch_size: int | Literal["auto"] = _f("auto", "Generation batch size (also anyfit eval's, unless --batch-size is "
                                           "given); auto sizes it from free memory and the KV cache.")
    base_text: str | None = _f(
        None, "Held-out general text for base_kl (train.watch_base): a .jsonl (or .json, .csv, .parquet) file of "
        "{\"text\": ...} records, tokenized with the run's tokenizer. Default: the validation examples' prompts.")
    base_text_tokens: int = _f(
        32768, "At most this many tokens of eval.base_text (or of the validation prompts) for base_kl; each text is "
        "cut to data.max_length.")
    base_top_k: int = _f(
        64, "Full fine-tuning's base_kl: the base model's top-k log-probabilities kept per position (k x 12 bytes per "
        "position, in memory and in the run folder); exact when k >= the vocabulary.")


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
    sharding: Literal["auto", "none", "fsdp", "deepspeed"] = _f(
        "auto", "fsdp: shard weights, gradients and optimizer states over the processes with PyTorch's FSDP2 "
        "(fully_shard per decoder layer). deepspeed: the same with DeepSpeed ZeRO-3, driven by anyfit's loop "
        "(needs the deepspeed extra). auto: what 'anyfit plan' recommends for this machine and process count "
        "(printed with its reason; never deepspeed). none: every process holds everything (DDP).")
    sequence_parallel: int | Literal["auto"] = _f(
        1, "Split each sequence over this many processes (DeepSpeed's Ulysses: each process holds 1/N of a "
        "sequence's activations; attention heads are exchanged with an all-to-all). Must divide the process count "
        "and the attention heads; the remaining factor is data parallel. For examples too long for one device. "
        "auto: the degree 'anyfit plan' picks for this machine and process count (1 when the run fits without), "
        "printed with its reason.")
    fsdp_offload: bool = _f(False, "With sharding: keep parameters and optimizer states in host RAM (FSDP2 CPU "
                            "offload); slower, for models that do not fit in device memory even sharded.")
    deepspeed_offload: bool = _f(False, "With sharding=deepspeed: ZeRO-3 offload of parameters and optimizer "
                                 "states to host RAM (on CUDA the update runs in DeepSpeed's CPU Adam); for models "
                                 "that do not fit in device memory even sharded.")
    fsdp_reduce_every_micro_batch: bool = _f(
        False, "With sharding and accumulation: reduce-scatter the gradients after every micro-batch, so each "
        "process keeps only its 1/N shard of them through the window instead of an unsharded fp32 gradient of the "
        "whole model until the window's last micro-batch. Costs one reduce-scatter per micro-batch instead of one "
        "per window; 'anyfit plan' names it before CPU offload when memory is tight.")
    profile: int = _f(
        0, "Profile this many training steps with torch.profiler (after runtime.profile_warmup steps): a trace per "
        "process under OUTPUT/profile/ (Perfetto, TensorBoard), the step's time by phase, memory by kind beside "
        "the plan, and config advice with its measured reason (0: off). 'anyfit profile' runs only that.")
    profile_warmup: int = _f(3, "Steps before the profiled ones: the first allocates the optimizer state, the middle "
                             "ones time the step without the profiler, the last is traced but dropped and its memory "
                             "is counted by kind.")


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

    def value(self, key: str) -> Any:
        """The value of a dotted key ('model.tiled_mlp')."""
        section, name = key.split(".")
        return getattr(getattr(self, section), name)

    def to_yaml(self) -> str:
        return yaml.safe_dump(self.to_dict(), sort_keys=False)


SECTIONS: dict[str, type] = {"model": ModelConfig, "data": DataConfig, "lora": LoraConfig, "train": TrainConfig,
                             "eval": EvalConfig, "runtime": RuntimeConfig}


TRACKERS = ("tensorboard", "wandb", "mlflow", "trackio")  # train.report_to values (Accelerate's tracker names)
# data.template values that are names; any other value must be a custom text with a {prompt} placeholder.
NAMED_TEMPLATES = ("chat", "plain", "trl", "r1_zero")
DATA_FIELDS = ("messages", "prompt", "completion", "text", "system", "answer", "input", "tools", "instruction",
               "output", "history", "chat_template_kwargs")  # the keys data.fields may map


def all_keys() -> list[str]:
    """Every valid dotted key, e.g. 'train.learning_rate'."""
    return [f"{s}.{f.name}" for s, cls in SECTIONS.items() for f in dataclasses.fields(cls)]


def keys_of(section: str) -> list[str]:
    return [k for k in all_keys() if k.startswith(section + ".")]



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
        ("runtime.profile_warmup", cfg.runtime.profile_warmup, 1),
    ]:
        if value < low:
            raise ConfigError(f"'{key}' must be at least {low}, got {value}.")
    for key, value in [("eval.holdout", cfg.eval.holdout), ("eval.every", cfg.eval.every),
                       ("eval.generate_every", cfg.eval.generate_every), ("train.max_steps", t.max_steps), ("train.save_every", t.save_every),
                       ("train.warmup_steps", t.warmup_steps), ("train.loss_chunk_tokens", t.loss_chunk_tokens),
                       ("runtime.profile", cfg.runtime.profile),
                       ("runtime.num_workers", 0 if cfg.runtime.num_workers == "auto" else cfg.runtime.num_workers)]:
        if value < 0:
            raise ConfigError(f"'{key}' must be 0 or more, got {value}.")
    _check_forgetting(cfg)
    _check_vision(cfg)
    if cfg.eval.holdout and (cfg.eval.path or cfg.eval.split):
        raise ConfigError("Set either eval.holdout (records taken from the training data) or eval.path/eval.split "
                          "(separate held-out data), not both.")
    _check_mix(cfg)
    _check_keep_best(cfg)
    if cfg.data.reasoning_layout is not None and cfg.data.reasoning_layout.count("{reasoning}") != 1:
        raise ConfigError(f"'data.reasoning_layout' must hold '{{reasoning}}' once (where the trace goes), got "
                          f"{cfg.data.reasoning_layout!r}; e.g. '<think>\\n{{reasoning}}\\n</think>\\n\\n'.")
    if cfg.data.num_proc != "auto" and cfg.data.num_proc < 1:
        raise ConfigError(f"'data.num_proc' must be at least 1 or 'auto', got {cfg.data.num_proc}.")
    if cfg.eval.batch_size != "auto" and cfg.eval.batch_size < 1:
        raise ConfigError(f"'eval.batch_size' must be at least 1 or 'auto', got {cfg.eval.batch_size}.")
    if t.router_aux_loss_coef != "auto" and t.router_aux_loss_coef < 0:
        raise ConfigError(f"'train.router_aux_loss_coef' must be auto or 0 or more, got {t.router_aux_loss_coef}.")
    if t.learning_rate <= 0:
        raise ConfigError(f"'train.learning_rate' must be positive, got {t.learning_rate}.")
    if not 0 < cfg.runtime.memory_fraction <= 1:
        raise ConfigError(f"'runtime.memory_fraction' must be in (0, 1], got {cfg.runtime.memory_fraction}.")
    if not 0 <= t.warmup_ratio < 1:
        raise ConfigError(f"'train.warmup_ratio' must be in [0, 1), got {t.warmup_ratio}.")
    if t.max_steps == 0 and t.epochs <= 0:
        raise ConfigError("Set 'train.max_steps' > 0 or 'train.epochs' > 0: the run has no length.")
    if cfg.runtime.sequence_parallel != "auto" and cfg.runtime.sequence_parallel < 1:
        raise ConfigError(f"'runtime.sequence_parallel' must be at least 1 or 'auto', got "
                          f"{cfg.runtime.sequence_parallel}.")
    if t.micro_batch != "auto" and t.micro_batch < 1:
        raise ConfigError(f"'train.micro_batch' must be at least 1 or 'auto', got {t.micro_batch}.")
    if t.micro_batch != "auto" and t.micro_batch > t.effective_batch:
        raise ConfigError(f"'train.micro_batch' ({t.micro_batch}) is larger than 'train.effective_batch' "
                          f"({t.effective_batch}); lower micro_batch or raise effective_batch.")
    trackers = [cfg.train.report_to] if isinstance(cfg.train.report_to, str) else list(cfg.train.report_to)
    unknown = [r for r in trackers if r not in TRACKERS and r != "none"]
    if unknown:
        raise ConfigError(f"'train.report_to' {unknown} is not a tracker anyfit knows; use none or any of "
                          f"{', '.join(TRACKERS)}.{suggest(unknown[0], list(TRACKERS))}")
    _check_template(cfg.data.template, "data.template")
    if cfg.data.train_on == "last_turn" and cfg.data.template == "trl":
        raise ConfigError("data.train_on=last_turn is anyfit's (data.template=chat); TRL trains every assistant turn "
                          "or every token: use data.template=chat, or data.train_on=completion or all.")
    unknown_fields = set(cfg.data.fields) - set(DATA_FIELDS)
    if unknown_fields:
        raise ConfigError(f"'data.fields' maps unknown anyfit fields {sorted(unknown_fields)}; the keys must be among "
                          f"{', '.join(DATA_FIELDS)} (the values are your column names).")


# train.keep_best's names, as the metrics.jsonl key they compare and whether lower is better. Any other metric of
# an evaluation line is named with its direction: min:KEY or max:KEY.
BEST_METRICS = {"validation_loss": ("val_loss", True), "val_loss": ("val_loss", True),
                "accuracy": ("gen_accuracy", False), "gen_accuracy": ("gen_accuracy", False),
                "base_kl": ("base_kl", True)}


def best_metric(setting: str) -> tuple[str, bool]:
    """``train.keep_best``'s metrics.jsonl key and whether lower is better; a ConfigError for a name whose
    direction it cannot tell."""
    if setting in BEST_METRICS:
        return BEST_METRICS[setting]
    direction, _, key = setting.partition(":")
    if direction in ("min", "max") and key:
        return key, direction == "min"
    raise ConfigError(f"train.keep_best={setting!r}: use validation_loss, accuracy or base_kl, or any metric of the "
                      "evaluation lines with the direction that is better: min:KEY or max:KEY.")


def _check_keep_best(cfg: Config) -> None:
    """train.keep_best names a metric an evaluation of this run measures."""
    setting = cfg.train.keep_best
    if not setting:
        return
    key, _ = best_metric(setting)
    needs = {"val_loss": ("eval.every", cfg.eval.every), "base_kl": ("eval.every", cfg.eval.every),
             "gen_accuracy": ("eval.generate_every", cfg.eval.generate_every)}.get(key)
    if needs and not needs[1]:
        raise ConfigError(f"train.keep_best={setting} compares {key} at each evaluation, and none is run: set "
                          f"{needs[0]} > 0 (and held-out data: eval.holdout, eval.path or eval.split).")


def _check_forgetting(cfg: Config) -> None:
    """train.watch_base, base_kl_warn, base_kl_weight and eval.base_*."""
    t, lora = cfg.train, cfg.lora.enabled or cfg.lora.qlora
    for key, value in [("train.base_kl_warn", t.base_kl_warn), ("train.base_kl_weight", t.base_kl_weight)]:
        if value < 0:
            raise ConfigError(f"'{key}' must be 0 or more, got {value}.")
    for key, value in [("eval.base_text_tokens", cfg.eval.base_text_tokens), ("eval.base_top_k", cfg.eval.base_top_k)]:
        if value < 1:
            raise ConfigError(f"'{key}' must be at least 1, got {value}.")
    if t.watch_base is True and cfg.eval.every == 0:
        raise ConfigError("train.watch_base=true measures base_kl at every validation: set eval.every > 0.")
    if t.base_kl_weight and not lora:
        raise ConfigError("train.base_kl_weight > 0 needs LoRA (the base is the model with its adapters disabled); "
                          "with full fine-tuning it would need a second model: set train.base_kl_weight=0.")
    if t.base_kl_weight and t.fused_loss:
        raise ConfigError("train.base_kl_weight > 0 needs the logits, which train.fused_loss never forms: set one "
                          "of them off.")


def _check_vision(cfg: Config) -> None:
    """model.train_vision and model.train_projector against the LoRA settings (whether the model has a vision
    tower is known only once it is built: anyfit.model.vision.check_parts)."""
    lora = cfg.lora.enabled or cfg.lora.qlora
    if cfg.model.train_vision == "lora" and not lora:
        raise ConfigError("model.train_vision=lora puts LoRA adapters on the vision tower and needs lora.enabled=true "
                          "(or lora.qlora=true); in a full fine-tune use model.train_vision=full.")
    if cfg.lora.qlora and (cfg.model.train_vision == "full" or cfg.model.train_projector):
        # bitsandbytes quantizes the tower's and projector's linear layers too: 4-bit weights take no gradient
        raise ConfigError("lora.qlora loads the vision tower and projector in 4-bit, which cannot train fully: use "
                          "model.train_vision=lora (adapters on the tower) and model.train_projector=false, or "
                          "lora.enabled=true without qlora.")


# data.* keys a data.mix entry may set for itself (the store settings stay run-wide).
MIX_KEYS = ("path", "subset", "split", "num_samples", "format", "fields", "template", "system_prompt", "max_length",
            "overlong", "train_on", "add_eos", "ignore_fields", "train_reasoning", "chat_template_kwargs",
            "system_fallback", "train_empty_think", "reasoning_layout")


def _check_mix(cfg: Config) -> None:
    """data.mix: the entries' own keys and weights (their values are typed by the loader, as data.* keys)."""
    if not cfg.data.mix:
        return
    if cfg.data.path:
        raise ConfigError("Set either data.path (one source) or data.mix (several), not both.")
    if cfg.data.source_column:
        raise ConfigError("data.source_column splits the loss of one data set by a field; with data.mix the entries "
                          "are the sources already: set one of them.")
    if cfg.eval.split and not cfg.eval.path:
        raise ConfigError("eval.split alone takes held-out data from the one data.path; with data.mix use "
                          "eval.holdout (records of each source) or eval.path (and eval.split).")
    names = [entry.get("name") for entry in cfg.data.mix if entry.get("name") is not None]
    if len(set(names)) < len(names) or not all(isinstance(n, str) and n for n in names):
        raise ConfigError(f"data.mix: each entry's name is what its loss is logged under (loss/<name>): give "
                          f"distinct, non-empty names (got {names}).")
    for i, entry in enumerate(cfg.data.mix):
        where = f"data.mix[{i}]"
        unknown = sorted(set(entry) - set(MIX_KEYS) - {"weight", "name"})
        if unknown:
            raise ConfigError(f"{where} has unknown keys {unknown}; an entry may set weight, name and "
                              f"{', '.join(MIX_KEYS)}.{suggest(unknown[0], [*MIX_KEYS, 'weight', 'name'])}")
        if "template" in entry:
            _check_template(entry["template"], f"{where}.template")
        if not entry.get("path"):
            raise ConfigError(f"{where} needs a path (a data file, folder, glob or hub dataset name).")
        weight = entry.get("weight", 1.0)
        if isinstance(weight, bool) or not isinstance(weight, (int, float)) or weight <= 0:
            raise ConfigError(f"{where}: weight must be a positive number (its share of each epoch), got {weight!r}.")


def _check_template(template: str, key: str) -> None:
    if template not in NAMED_TEMPLATES and not re.search(r"\{[A-Za-z_]\w*\}", template):
        raise ConfigError(f"{key}={template!r} is not one of {', '.join(NAMED_TEMPLATES)} and has no placeholder "
                          "such as '{prompt}' or a record field ('{instruction}'); a custom template looks like "
                          "'Question: {prompt}\\nAnswer: '.")

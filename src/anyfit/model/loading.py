"""Loading the tokenizer and model (hub id, local folder or GGUF file) and wrapping it in LoRA."""

from __future__ import annotations

import difflib
from dataclasses import dataclass
from pathlib import Path

import torch
from torch import nn

from anyfit.config import Config, ConfigError, LoraConfig, ModelConfig
from anyfit.hardware.runtime import RuntimePolicy

# Leaf names of the projections LoRA usually targets, by architecture family. Used to order and
# explain the automatic choice; the choice itself comes from the model's own modules.
KNOWN_TARGETS = (
    "q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj",  # Llama, Qwen, Mistral, Gemma
    "c_attn", "c_proj", "c_fc",  # GPT-2
    "query_key_value", "dense", "dense_h_to_4h", "dense_4h_to_h",  # BLOOM, Falcon, GPT-NeoX
    "qkv_proj", "gate_up_proj", "out_proj", "fc1", "fc2", "Wqkv", "wq", "wk", "wv", "wo", "w1", "w2", "w3",
)


@dataclass(frozen=True)
class ModelSource:
    """Where weights come from: a hub id or folder, plus a GGUF file name inside it when loading GGUF."""

    path: str
    gguf_file: str | None = None

    @staticmethod
    def from_config(cfg: ModelConfig) -> "ModelSource":
        if not cfg.name_or_path:
            raise ConfigError("'model.name_or_path' is empty: set it to a hub id (Qwen/Qwen2.5-0.5B), "
                              "a local HF folder or a .gguf file.")
        p = Path(cfg.name_or_path).expanduser()
        if cfg.name_or_path.endswith(".gguf"):
            if not p.is_file():
                raise ConfigError(f"model.name_or_path: GGUF file {p} does not exist.")
            return ModelSource(str(p.parent), p.name)
        if cfg.gguf_file:
            return ModelSource(str(p) if p.exists() else cfg.name_or_path, cfg.gguf_file)
        looks_local = cfg.name_or_path.startswith((".", "/", "~")) or p.exists()
        if looks_local and not p.is_dir():
            raise ConfigError(f"model.name_or_path: {p} does not exist. Give an existing folder with config.json, "
                              "a .gguf file, or a hub id such as Qwen/Qwen2.5-0.5B.")
        return ModelSource(str(p) if looks_local else cfg.name_or_path)


def load_tokenizer(cfg: ModelConfig):
    """The tokenizer, with a pad token set when it has none (padding is masked out, so EOS is safe)."""
    from transformers import AutoTokenizer

    src = ModelSource.from_config(cfg)
    kwargs = dict(trust_remote_code=cfg.trust_remote_code, revision=cfg.revision)
    if cfg.tokenizer:
        tok = AutoTokenizer.from_pretrained(cfg.tokenizer, **kwargs)
    else:
        tok = AutoTokenizer.from_pretrained(src.path, gguf_file=src.gguf_file, **kwargs)
    if tok.pad_token is None:
        tok.pad_token = tok.eos_token if tok.eos_token is not None else tok.unk_token
    if tok.pad_token is None:
        raise ConfigError(f"The tokenizer of {cfg.name_or_path} has no pad, eos or unk token to pad with.")
    return tok


def weight_dtype(cfg: Config, policy: RuntimePolicy) -> torch.dtype:
    """Full fine-tuning keeps fp32 master weights (autocast computes in bf16/fp16); a frozen LoRA base
    can live in the compute dtype, halving its memory."""
    if cfg.model.dtype != "auto":
        return getattr(torch, cfg.model.dtype)
    if cfg.lora.enabled and policy.device == "cuda":
        return policy.compute_dtype
    return torch.float32


def load_model(cfg: Config, policy: RuntimePolicy, device_index: int = 0) -> nn.Module:
    """The causal LM in the policy's dtype, gradient checkpointing as configured, LoRA applied if enabled."""
    from transformers import AutoModelForCausalLM

    src = ModelSource.from_config(cfg.model)
    kwargs: dict = dict(dtype=weight_dtype(cfg, policy), trust_remote_code=cfg.model.trust_remote_code,
                        revision=cfg.model.revision)
    if src.gguf_file:
        kwargs["gguf_file"] = src.gguf_file
    attn = cfg.model.attn_implementation
    if attn == "auto" and cfg.train.packing:
        attn = "anyfit_varlen"  # packed rows: per-example attention, no dense block mask (anyfit.model.attention)
    if attn == "anyfit_varlen":
        from anyfit.model.attention import register

        register()
    if attn != "auto":
        kwargs["attn_implementation"] = attn
    if cfg.lora.qlora:
        from transformers import BitsAndBytesConfig

        kwargs["quantization_config"] = BitsAndBytesConfig(
            load_in_4bit=True, bnb_4bit_quant_type="nf4", bnb_4bit_use_double_quant=True,
            bnb_4bit_compute_dtype=policy.compute_dtype)
        kwargs["device_map"] = {"": device_index}
    try:
        model = AutoModelForCausalLM.from_pretrained(src.path, **kwargs)
    except ValueError:
        if cfg.model.attn_implementation != "auto" or attn != "anyfit_varlen":
            raise
        # an architecture without transformers' attention interface: its default attention, which still
        # keeps packed examples apart through position_ids (with a dense block mask)
        del kwargs["attn_implementation"]
        model = AutoModelForCausalLM.from_pretrained(src.path, **kwargs)
    if src.gguf_file:
        # GGUF weights arrive dequantized; drop the quantizer record so the result saves as plain safetensors.
        model.config.quantization_config = None
        if hasattr(model.config, "__dict__"):
            model.config.__dict__.pop("quantization_config", None)
        model.hf_quantizer = None
    if cfg.model.gradient_checkpointing:
        # Non-reentrant checkpointing works with frozen inputs (LoRA) without enable_input_require_grads.
        if hasattr(model, "activation_checkpointing_enable"):  # transformers >= 5.2x renamed it
            model.activation_checkpointing_enable(activation_checkpointing_kwargs={"use_reentrant": False})
        else:
            model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
        model.config.use_cache = False
    if cfg.lora.enabled or cfg.lora.qlora:
        model = apply_lora(model, cfg.lora)
    return model


def linear_leaf_names(model: nn.Module) -> list[str]:
    """Leaf names of the linear layers inside the model body (not the output head), in first-seen order."""
    from transformers.pytorch_utils import Conv1D

    head = model.get_output_embeddings() if hasattr(model, "get_output_embeddings") else None
    names: dict[str, None] = {}
    for name, module in model.named_modules():
        if module is head:
            continue
        if isinstance(module, (nn.Linear, Conv1D)) or type(module).__name__ in ("Linear4bit", "Linear8bitLt"):
            names[name.rsplit(".", 1)[-1]] = None
    return list(names)


def find_lora_targets(model: nn.Module, spec: list[str] | str) -> list[str]:
    """Resolve ``lora.target_modules``: 'auto'/'all-linear' -> every linear projection of the body;
    an explicit list is checked against the model so a typo fails here, not deep inside PEFT."""
    present = linear_leaf_names(model)
    if spec in ("auto", "all-linear"):
        known = [n for n in KNOWN_TARGETS if n in present]
        other = [n for n in present if n not in known]
        targets = known + other
        if not targets:
            raise ConfigError("lora.target_modules=auto found no linear layers in this model; list them explicitly.")
        return targets
    if isinstance(spec, str):
        spec = [spec]
    missing = [t for t in spec if t not in present]
    if missing:
        hints = {m: difflib.get_close_matches(m, present, n=1) for m in missing}
        hint = "; ".join(f"'{m}' -> did you mean '{h[0]}'?" for m, h in hints.items() if h)
        raise ConfigError(f"lora.target_modules {missing} match no module of this model. Its linear layers are: "
                          f"{', '.join(present)}. {hint}".strip())
    return list(spec)


def apply_lora(model: nn.Module, cfg: LoraConfig) -> nn.Module:
    from peft import LoraConfig as PeftLoraConfig
    from peft import get_peft_model, prepare_model_for_kbit_training

    targets = find_lora_targets(model, cfg.target_modules)
    if cfg.qlora:
        model = prepare_model_for_kbit_training(model, use_gradient_checkpointing=False)
    peft_cfg = PeftLoraConfig(r=cfg.r, lora_alpha=cfg.alpha, lora_dropout=cfg.dropout, target_modules=targets,
                              bias="none", task_type="CAUSAL_LM")
    return get_peft_model(model, peft_cfg)


def count_parameters(model: nn.Module) -> tuple[int, int]:
    """(trainable, total) parameter counts."""
    trainable = sum(p.numel() for p in model.parameters() if p.requires_grad)
    total = sum(p.numel() for p in model.parameters())
    return trainable, total

"""Every way anyfit loads a model, in one place: the tokenizer and model for training (hub id, local
folder or GGUF file, LoRA/QLoRA applied), and for inference (the same sources plus a training output
folder: a full fine-tune, or a LoRA adapter on its base).

The rules the two paths share live here once: where weights come from (``ModelSource``), the pad-token
fallback (``ensure_pad_token``), the clean-up of a dequantized GGUF model (``drop_gguf_quantizer``).
Device and dtypes are the runtime policy's (``anyfit.hardware.runtime``).
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import torch
from torch import nn

from anyfit.config import Config, ConfigError, LoraConfig, ModelConfig, load_config, run_config_path
from anyfit.hardware.runtime import RuntimePolicy, inference_policy, weight_dtype
from anyfit.hub import check_model_id, looks_local
from anyfit.model.shape import resolve_lora_targets


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
            if not p.exists():  # a hub repository of GGUF files: checked fast, one line if it is not there
                check_model_id(cfg.name_or_path, cfg.revision, cfg.gguf_file)
            return ModelSource(str(p) if p.exists() else cfg.name_or_path, cfg.gguf_file)
        local = looks_local(cfg.name_or_path)
        if not local:  # a hub id: found (cached or online) in about a second, or a one-line error
            check_model_id(cfg.name_or_path, cfg.revision)
            return ModelSource(cfg.name_or_path)
        if not p.is_dir():
            raise ConfigError(f"model.name_or_path: {p} does not exist. Give an existing folder with config.json, "
                              "a .gguf file, or a hub id such as Qwen/Qwen2.5-0.5B.")
        if not (p / "config.json").is_file():
            ggufs = sorted(f.name for f in p.glob("*.gguf"))
            hint = (f" It holds {', '.join(ggufs[:3])}: set model.gguf_file (or point at the file)." if ggufs else
                    " Point it at a Hugging Face model folder (config.json + weights), a .gguf file or a hub id.")
            raise ConfigError(f"model.name_or_path: {p} has no config.json, so it is not a model folder.{hint}")
        return ModelSource(str(p))


def load_tokenizer(cfg: ModelConfig):
    """The tokenizer, with a pad token set when it has none (padding is masked out, so EOS is safe)."""
    from transformers import AutoTokenizer

    src = ModelSource.from_config(cfg)
    kwargs = dict(trust_remote_code=cfg.trust_remote_code, revision=cfg.revision)
    if cfg.tokenizer:
        check_model_id(cfg.tokenizer, cfg.revision, key="model.tokenizer")
        tok = AutoTokenizer.from_pretrained(cfg.tokenizer, **kwargs)
    else:
        tok = AutoTokenizer.from_pretrained(src.path, gguf_file=src.gguf_file, **kwargs)
    return ensure_pad_token(tok, cfg.tokenizer or cfg.name_or_path)


def ensure_pad_token(tokenizer, name: str):
    """Give a tokenizer without a pad token its EOS (or UNK) as pad: padding is masked out, so it is safe."""
    if tokenizer.pad_token is None:
        tokenizer.pad_token = tokenizer.eos_token if tokenizer.eos_token is not None else tokenizer.unk_token
    if tokenizer.pad_token is None:
        raise ConfigError(f"The tokenizer of {name} has no pad, eos or unk token to pad with.")
    return tokenizer


def drop_gguf_quantizer(model: nn.Module) -> None:
    """GGUF weights arrive dequantized; drop the quantizer record so the model saves as plain safetensors
    (save_pretrained refuses otherwise, and the saved folder would claim to be quantized)."""
    model.config.quantization_config = None
    if hasattr(model.config, "__dict__"):
        model.config.__dict__.pop("quantization_config", None)
    model.hf_quantizer = None


def load_model(cfg: Config, policy: RuntimePolicy, device_index: int = 0) -> nn.Module:
    """The causal LM in the policy's dtype, gradient checkpointing as configured, LoRA applied if enabled."""
    from transformers import AutoModelForCausalLM

    src = ModelSource.from_config(cfg.model)
    dtype = weight_dtype(cfg.model.dtype, cfg.lora.enabled or cfg.lora.qlora, policy.device, policy.precision)
    kwargs: dict = dict(dtype=dtype, trust_remote_code=cfg.model.trust_remote_code, revision=cfg.model.revision)
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
        drop_gguf_quantizer(model)
    if cfg.model.gradient_checkpointing:
        enable_checkpointing(model, cfg.model.checkpoint_every)
    if cfg.lora.enabled or cfg.lora.qlora:
        model = apply_lora(model, cfg.lora)
    return model


def enable_checkpointing(model: nn.Module, every: int = 1) -> None:
    """Activation checkpointing through transformers' own layers, on every ``every``-th decoder layer.

    Non-reentrant checkpointing works with frozen inputs (LoRA) without enable_input_require_grads. Every
    decoder layer of transformers is a ``GradientCheckpointingLayer`` with its own ``gradient_checkpointing``
    switch: enabling it model-wide and switching it off on the layers in between keeps their activations
    (more memory, less recomputation).
    """
    from transformers.modeling_layers import GradientCheckpointingLayer

    if hasattr(model, "activation_checkpointing_enable"):  # transformers >= 5.2x renamed it
        model.activation_checkpointing_enable(activation_checkpointing_kwargs={"use_reentrant": False})
    else:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    model.config.use_cache = False
    layers = [m for m in model.modules() if isinstance(m, GradientCheckpointingLayer)]
    for i, layer in enumerate(layers):
        layer.gradient_checkpointing = i % every == 0


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
    """Resolve ``lora.target_modules`` over the model's own linear layers (``anyfit.model.shape``'s rule)."""
    return resolve_lora_targets(linear_leaf_names(model), spec)


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


# Inference: a model, or the output of a training run


@dataclass(frozen=True)
class ModelLocation:
    """Where the pieces of a model for inference live. ``adapter`` is set for a LoRA output folder."""

    base: str  # hub id or folder of the (base) weights
    tokenizer: str  # where the tokenizer is read from
    adapter: str | None = None
    gguf_file: str | None = None


def locate_model(name_or_path: str | Path, tokenizer: str | None = None, revision: str | None = None) -> ModelLocation:
    """Tell a LoRA output folder from a full model (folder, GGUF file or hub id) and find its tokenizer."""
    spec = str(name_or_path)
    path = Path(spec).expanduser()
    if path.is_dir() and (path / "adapter_config.json").is_file():
        adapter_cfg = json.loads((path / "adapter_config.json").read_text())
        base = adapter_cfg.get("base_model_name_or_path")
        if not base:
            raise ConfigError(f"{path}/adapter_config.json has no base_model_name_or_path: cannot tell which base "
                              "model the adapter belongs to.")
        base = _base_from_training_config(path, base)
        has_tokenizer = any((path / f).is_file() for f in ("tokenizer.json", "tokenizer_config.json"))
        src = ModelSource.from_config(ModelConfig(name_or_path=base, revision=revision))
        tok = tokenizer or (str(path) if has_tokenizer else src.path)
        return ModelLocation(base=src.path, tokenizer=tok, adapter=str(path), gguf_file=src.gguf_file)
    if path.is_dir() and not (path / "config.json").is_file():
        checkpoints = sorted((p for p in path.glob("checkpoint-*") if p.is_dir()),
                             key=lambda p: int(p.name.split("-")[-1]) if p.name.split("-")[-1].isdigit() else -1)
        hint = (f" It holds checkpoints; the newest is {checkpoints[-1]} (pass that folder)." if checkpoints else
                " Is the training run finished? The final model is written when it ends.")
        raise ConfigError(f"{path} holds neither a model (config.json) nor a LoRA adapter (adapter_config.json).{hint}")
    src = ModelSource.from_config(ModelConfig(name_or_path=spec, revision=revision))
    return ModelLocation(base=src.path, tokenizer=tokenizer or src.path, gguf_file=src.gguf_file)


def _base_from_training_config(adapter_dir: Path, base: str) -> str:
    """PEFT records the folder a GGUF base was read from, which holds no config.json; the training run's
    config.yaml in the same output folder names the actual file."""
    local = Path(base).expanduser()
    run_config = run_config_path(adapter_dir)
    if local.is_dir() and not (local / "config.json").is_file() and run_config is not None:
        model = load_config(run_config).model
        if model.name_or_path:
            if model.gguf_file and not model.name_or_path.endswith(".gguf"):
                return str(Path(model.name_or_path) / model.gguf_file)
            return model.name_or_path
    return base




def load_for_inference(name_or_path: str | Path, device: str = "cpu", dtype: str | torch.dtype = "auto", *,
                       merge_lora: bool = False, tokenizer: str | None = None, trust_remote_code: bool = False,
                       revision: str | None = None):
    """``(model, tokenizer)`` ready to generate: eval mode, on ``device``, no gradients required.

    A LoRA output folder loads its base model and applies the adapter with PEFT; ``merge_lora`` folds the
    adapter into the weights (faster generation, no PEFT wrapper left).
    """
    from transformers import AutoModelForCausalLM, AutoTokenizer

    loc = locate_model(name_or_path, tokenizer, revision)
    common = dict(trust_remote_code=trust_remote_code, revision=revision)
    tok = AutoTokenizer.from_pretrained(loc.tokenizer, **({"gguf_file": loc.gguf_file}
                                                           if loc.tokenizer == loc.base and loc.gguf_file else {}),
                                        **common)
    ensure_pad_token(tok, loc.tokenizer)
    if not isinstance(dtype, torch.dtype):  # "auto" or a dtype name: the runtime policy decides and checks
        dtype = inference_policy(device, dtype).compute_dtype
    kwargs = dict(dtype=dtype, **common)
    if loc.gguf_file:
        kwargs["gguf_file"] = loc.gguf_file
    model = AutoModelForCausalLM.from_pretrained(loc.base, **kwargs)
    if loc.gguf_file:
        drop_gguf_quantizer(model)
    if loc.adapter:
        from peft import PeftModel

        model = PeftModel.from_pretrained(model, loc.adapter, is_trainable=False)
        if merge_lora:
            model = model.merge_and_unload()
    model.to(device)
    model.eval()
    model.requires_grad_(False)
    return model, tok

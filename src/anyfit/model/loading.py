"""Every way anyfit loads a model, in one place: for training (hub id, local folder or GGUF file, LoRA/QLoRA
applied), and for inference (the same sources plus a training output folder: a full fine-tune, or a LoRA adapter on
its base). The tokenizer and its pad-token fallback are ``anyfit.model.tokenizer``'s.

The rules the two paths share live here once: LoRA targets. The memory savers that change the model (checkpointing,
activation offload, the tiled MLP, the fused head) are installed through ``anyfit.model.savers``. Where weights come
from is ``anyfit.model.source``'s; the clean-up of a dequantized GGUF model is ``anyfit.model.gguf_cache``'s; device
and dtypes are the runtime policy's (``anyfit.hardware.runtime``).
"""

from __future__ import annotations

import sys
from pathlib import Path

import torch
from torch import nn

from anyfit.config import Config, ConfigError, LoraConfig
from anyfit.hardware.runtime import RuntimePolicy, inference_policy, weight_dtype
from anyfit.model.attention import register as register_varlen_attention
from anyfit.model.composite import language_attention, language_modules, lora_scope, model_class
from anyfit.model.expert_lora import split_expert_classes
from anyfit.model.gguf_cache import drop_gguf_quantizer
from anyfit.model.moe import balance_routers, expert_leaf_names, lora_targets, moe_blocks, restore_dropout
from anyfit.model.savers import install_savers
from anyfit.model.shape import resolve_lora_targets
from anyfit.model.source import ModelSource, locate_model
from anyfit.model.quiet import quiet_peft
from anyfit.model.tokenizer import as_its_file, ensure_pad_token
from anyfit.model.vision import check_parts, freeze_untrained, parts, tower_lora_targets


def load_model(cfg: Config, policy: RuntimePolicy, device_index: int = 0, *, empty: bool = False) -> nn.Module:
    """The causal LM in the policy's dtype, gradient checkpointing as configured, LoRA applied if enabled.

    ``empty``: read no weights: the same architecture (LoRA included) with its parameters on the meta device,
    for a process that receives its shards from the one that read them (``anyfit.backends.fsdp``)."""
    src = ModelSource.from_config(cfg.model)
    dtype = weight_dtype(cfg.model.dtype, cfg.lora.enabled or cfg.lora.qlora, policy.device, policy.precision)
    kwargs: dict = dict(dtype=dtype, trust_remote_code=cfg.model.trust_remote_code, revision=cfg.model.revision)
    if src.gguf_file:
        kwargs["gguf_file"] = src.gguf_file
    attn = cfg.model.attn_implementation
    if attn == "auto" and cfg.train.packing:
        attn = "anyfit_varlen"  # packed rows: per-example attention, no dense block mask (anyfit.model.attention)
    if attn == "anyfit_varlen":
        register_varlen_attention()
    if attn != "auto":
        kwargs["attn_implementation"] = attn
    if cfg.lora.qlora:
        from transformers import BitsAndBytesConfig

        kwargs["quantization_config"] = BitsAndBytesConfig(
            load_in_4bit=True, bnb_4bit_quant_type="nf4", bnb_4bit_use_double_quant=True,
            bnb_4bit_compute_dtype=policy.compute_dtype)
        kwargs["device_map"] = {"": device_index if policy.device == "cuda" else policy.device}
    try:
        model = _instantiate(src, kwargs, empty)
    except ConfigError:
        raise
    except ValueError:
        if cfg.model.attn_implementation != "auto" or attn != "anyfit_varlen":
            raise
        # an architecture without transformers' attention interface: its default attention, which still
        # keeps packed examples apart through position_ids (with a dense block mask)
        del kwargs["attn_implementation"]
        model = _instantiate(src, kwargs, empty)
    if src.gguf_file:
        drop_gguf_quantizer(model)
    if cfg.lora.qlora:
        keep_one_4bit_path(model)
    m, lora = cfg.model, cfg.lora.enabled or cfg.lora.qlora
    notes = check_parts(model, m.train_vision, m.train_projector, lora)  # a composite: what trains, in a line
    freeze_untrained(model, m.train_vision, m.train_projector)  # a composite: its language model, and what is asked
    install_savers(model, cfg, policy)  # checkpointing, activation offload, tiled MLP, fused head: as configured
    balance_routers(model, cfg.train.router_aux_loss_coef)  # MoE: the router's load-balancing loss, if asked
    if lora:
        model = apply_lora(model, cfg.lora, m.train_vision, m.train_projector)
    model.anyfit_parts = notes  # printed with the parameter counts (anyfit.backends.base.Loaded)
    return model


def keep_one_4bit_path(model: nn.Module) -> None:
    """Keep bitsandbytes' 4-bit layers on the path training runs, also for a forward without gradients.

    On a CPU with AVX-512 BF16, bitsandbytes (0.50) repacks a ``Linear4bit``'s weight in place at its first forward in
    eval mode without gradients (an evaluation, the packing self-test), and every later forward, training included,
    runs its inference kernel, which computes in bf16 and has no backward: after the first evaluation the gradients
    through the frozen base were silently wrong (LoRA gradients off by more than 100% on a 64-wide Llama), and
    layers narrower than its 64-wide block failed outright. The flag is the layer's own switch for that path (set
    at construction from the CPU's features); off, evaluation runs exactly the function training does, at the
    training path's speed."""
    for module in model.modules():
        if getattr(module, "support_avx512bf16_for_cpu", False):
            module.support_avx512bf16_for_cpu = False


def _instantiate(src: ModelSource, kwargs: dict, empty: bool) -> nn.Module:
    """``from_pretrained``, or with ``empty`` the architecture alone: built from the config under Accelerate's
    ``init_empty_weights``, which puts every parameter on the meta device (no memory, nothing read) and keeps
    buffers real, so buffers that are computed rather than saved (rotary frequencies) are right already. The class
    is the checkpoint's own (``anyfit.model.composite.model_class``: a vision-language composite stays whole)."""
    from transformers import AutoConfig, AutoModelForCausalLM

    if src.gguf_file and not empty:  # a GGUF file holds one language model
        return AutoModelForCausalLM.from_pretrained(src.path, **kwargs)
    common = {k: kwargs[k] for k in ("trust_remote_code", "revision", "gguf_file") if k in kwargs}
    config = AutoConfig.from_pretrained(src.path, **common)
    auto = model_class(config, src.path, bool(kwargs.get("trust_remote_code")))
    if "attn_implementation" in kwargs:  # a composite's towers keep their own attention
        kwargs = {**kwargs, "attn_implementation": language_attention(config, kwargs["attn_implementation"])}
    if not empty:
        return auto.from_pretrained(src.path, **kwargs)
    from accelerate import init_empty_weights

    built = {k: kwargs[k] for k in ("dtype", "attn_implementation", "trust_remote_code") if k in kwargs}
    with init_empty_weights():
        model = auto.from_config(config, **built)
    model.tie_weights()  # as from_pretrained does (from_config under init_empty_weights leaves them apart)
    return model


def linear_leaf_names(model: nn.Module) -> list[str]:
    """Leaf names of the linear layers inside the model body (not the output head), in first-seen order; of a
    composite's language model only."""
    from transformers.pytorch_utils import Conv1D

    head = model.get_output_embeddings() if hasattr(model, "get_output_embeddings") else None
    gates = {gate for block in moe_blocks(model) for gate in block.gates}  # an MoE router is never adapted
    names: dict[str, None] = {}
    for name, module in language_modules(model):
        if module is head or name in gates:
            continue
        if isinstance(module, (nn.Linear, Conv1D)) or type(module).__name__ in ("Linear4bit", "Linear8bitLt"):
            names[name.rsplit(".", 1)[-1]] = None
    return list(names)


def find_lora_targets(model: nn.Module, spec: list[str] | str) -> list[str]:
    """Resolve ``lora.target_modules`` over the model's own linear layers and fused MoE expert tensors
    (``anyfit.model.shape``'s rule)."""
    return resolve_lora_targets(list(dict.fromkeys(linear_leaf_names(model) + expert_leaf_names(moe_blocks(model)))),
                                spec)


def apply_lora(model: nn.Module, cfg: LoraConfig, train_vision: str = "frozen",
               train_projector: bool = False) -> nn.Module:
    """PEFT's LoRA on the language model's linear layers (and MoE experts) as ``cfg`` says; in a composite also on
    the vision tower's with ``train_vision`` lora, and the tower (``full``) or the projector (``train_projector``)
    trained and saved whole in the adapter (PEFT's ``modules_to_save``)."""
    with quiet_peft(cfg.qlora):
        from peft import LoraConfig as PeftLoraConfig
        from peft import get_peft_model, prepare_model_for_kbit_training

    linear = linear_leaf_names(model)
    targets = lora_targets(model, find_lora_targets(model, cfg.target_modules), linear, cfg)  # + the MoE experts
    if cfg.qlora and cfg.qlora_upcast:  # its fp32 cast of the unquantized weights (get_peft_model freezes the base)
        model = prepare_model_for_kbit_training(model, use_gradient_checkpointing=False)
    dropout = 0.0 if targets.parameters else cfg.dropout  # PEFT takes no dropout with parameters: restore_dropout
    tower = tower_lora_targets(model, cfg.target_modules) if train_vision == "lora" else None
    whole = parts(model).saved_whole(train_vision, train_projector)
    peft_cfg = PeftLoraConfig(r=cfg.r, lora_alpha=cfg.alpha, lora_dropout=dropout,
                              target_modules=lora_scope(model, targets.modules, tower),
                              bias="none", task_type="CAUSAL_LM", modules_to_save=whole or None,
                              **({"target_parameters": targets.parameters} if targets.parameters else {}))
    split, kept = (split_expert_classes(model, targets.parameters, cfg.r)
                   if targets.parameters and cfg.split_experts else ({}, []))
    if split:  # LoRA on these experts as base plus low-rank path, in PEFT's own adapter layout
        peft_cfg._register_custom_module(split)
    for line in kept:
        print(line, file=sys.stderr)
    with quiet_peft(cfg.qlora):
        model = get_peft_model(model, peft_cfg)
    if dropout != cfg.dropout:
        restore_dropout(model, cfg.dropout)
    model.anyfit_left_out = targets.left_out  # named in the MoE summary line (anyfit.model.moe.moe_summary)
    return model


def count_parameters(model: nn.Module) -> tuple[int, int]:
    """(trainable, total) parameter counts (a parameter DeepSpeed ZeRO-3 partitioned as it was built is empty
    here: ``ds_numel`` is its whole size)."""
    trainable = sum(getattr(p, "ds_numel", p.numel()) for p in model.parameters() if p.requires_grad)
    total = sum(getattr(p, "ds_numel", p.numel()) for p in model.parameters())
    return trainable, total


def load_for_inference(name_or_path: str | Path, device: str = "cpu", dtype: str | torch.dtype = "auto", *,
                       merge_lora: bool = False, tokenizer: str | None = None, trust_remote_code: bool = False,
                       revision: str | None = None):
    """``(model, tokenizer)`` ready to generate: eval mode, on ``device``, no gradients required.

    A LoRA output folder loads its base model and applies the adapter with PEFT; ``merge_lora`` folds the
    adapter into the weights (faster generation, no PEFT wrapper left).
    """
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

    loc = locate_model(name_or_path, tokenizer, revision)
    common = dict(trust_remote_code=trust_remote_code, revision=revision)
    tok = AutoTokenizer.from_pretrained(loc.tokenizer, **({"gguf_file": loc.gguf_file}
                                                           if loc.tokenizer == loc.base and loc.gguf_file else {}),
                                        **common)
    tok = ensure_pad_token(as_its_file(tok, revision), loc.tokenizer)
    if not isinstance(dtype, torch.dtype):  # "auto" or a dtype name: the runtime policy decides and checks
        dtype = inference_policy(device, dtype).compute_dtype
    kwargs = dict(dtype=dtype, **common)
    if loc.gguf_file:
        kwargs["gguf_file"] = loc.gguf_file
    auto = AutoModelForCausalLM if loc.gguf_file else model_class(AutoConfig.from_pretrained(loc.base, **common),
                                                                    loc.base, trust_remote_code)
    model = auto.from_pretrained(loc.base, **kwargs)
    if loc.gguf_file:
        drop_gguf_quantizer(model)
    if loc.adapter:
        with quiet_peft(quantized=False):
            from peft import PeftModel

            model = PeftModel.from_pretrained(model, loc.adapter, is_trainable=False)
        if merge_lora:
            model = model.merge_and_unload()
    model.to(device)
    model.eval()
    model.requires_grad_(False)
    return model, tok


def shared_parameter_names(model: torch.nn.Module) -> list[list[str]]:
    """The names of each parameter reachable under more than one name (tied embeddings), first name first."""
    names: dict[int, list[str]] = {}
    for name, param in model.named_parameters(remove_duplicate=False):
        names.setdefault(id(param), []).append(name)
    return [shared for shared in names.values() if len(shared) > 1]


def model_dtype(model: nn.Module) -> torch.dtype | None:
    """The dtype floating-point inputs (processed images) are given to ``model`` in, in training and in generation:
    its floating-point parameters' (a QLoRA base's 4-bit weights are stored as integers and can come first)."""
    return next((p.dtype for p in model.parameters() if p.is_floating_point()), None)

"""Composite checkpoints: a language model inside a larger one (the vision-language ``*ForConditionalGeneration``
of Qwen3.5, Llama-4, Gemma-3/4, Mistral-Small-3), fine-tuned on text and saved as it came.

transformers' ``AutoModelForCausalLM`` is no way to load them: for some model types it maps the composite config
to the text model alone (``Qwen3_5ForCausalLM``, ``Llama4ForCausalLM``: its checkpoint conversion strips the
``language_model`` prefix and ``_keys_to_ignore_on_load_unexpected`` drops the vision tower without a word, so a
model saved from it is another architecture with fewer tensors), for others it knows no class at all
(``Mistral3Config``). Here the class is the one the checkpoint was saved as: config.json's ``architectures``,
found through transformers' own auto mappings (``model_class``). Its language model is the module the model's own
``get_decoder()`` returns, with the input and output embeddings (``language_parameters``); what else trains (the
vision tower, the projector: ``model.train_vision``, ``model.train_projector``) is ``anyfit.model.vision``'s rule,
and LoRA targets the language model, and the tower only when asked (``lora_scope``). The model's own
``save_pretrained`` then writes the same architecture, tensor names and count.

A plain language model (its config is its own text config) goes through ``AutoModelForCausalLM`` as before.
"""

from __future__ import annotations

import inspect
import re
from typing import TYPE_CHECKING

from anyfit.config import ConfigError

if TYPE_CHECKING:  # annotations only: anyfit prepare reads is_composite without importing torch (~1.3 s)
    from torch import nn

# transformers' auto classes whose models generate text from input_ids, in the order a composite without a
# recorded architecture tries them (the whole model first: the causal-LM class of a composite may be its text part).
_AUTO_CLASSES = ("AutoModelForImageTextToText", "AutoModelForMultimodalLM", "AutoModelForCausalLM")


def is_composite(config) -> bool:
    """A config holding a text config beside other parts (vision, audio): ``get_text_config()`` is not itself."""
    return hasattr(config, "get_text_config") and config.get_text_config() is not config


def model_class(config, name: str = "the model", trust_remote_code: bool = False):
    """The transformers auto class that loads a checkpoint of ``config`` as the class it was saved as.

    A plain language model: ``AutoModelForCausalLM``. A composite: the auto class whose mapping gives the class
    named first in config.json's ``architectures`` (remote code: the auto class its ``auto_map`` names for it);
    none recorded: the first of image-text-to-text, multimodal LM, causal LM that knows the config. A composite
    that is an encoder-decoder, whose architecture no text-generating auto class gives, or whose forward needs
    more than text (an image), is a ConfigError."""
    import transformers

    if not is_composite(config):
        return transformers.AutoModelForCausalLM
    arch = (getattr(config, "architectures", None) or [None])[0]
    described = f"{name} ({arch or 'no architecture recorded'}, model_type {config.model_type!r})"
    if getattr(config, "is_encoder_decoder", False) or getattr(config.get_text_config(), "is_encoder_decoder", False):
        raise ConfigError(f"{described} is an encoder-decoder; anyfit fine-tunes decoder-only language models and "
                          "composites that hold one. Use a decoder-only model.")
    auto_map = getattr(config, "auto_map", None) or {}
    for auto_name in _AUTO_CLASSES:
        if trust_remote_code and auto_name in auto_map:
            if arch is None or str(auto_map[auto_name]).rsplit(".", 1)[-1] == arch:
                return getattr(transformers, auto_name)
            continue
        auto = getattr(transformers, auto_name, None)
        mapped = auto._model_mapping.get(type(config), None) if auto is not None else None  # imports that one class
        if mapped is not None and (arch is None or getattr(mapped, "__name__", None) == arch):
            needs = _required_inputs(mapped)
            if needs:
                raise ConfigError(f"{described}: its forward needs {', '.join(needs)}, so it cannot train on text "
                                  "alone; fine-tune a checkpoint of its language model alone.")
            return auto
    raise ConfigError(f"{described} is a composite model that transformers {transformers.__version__} loads neither "
                      "as a causal LM nor as an image-text-to-text model under that architecture, so anyfit cannot "
                      "train and save it whole. Upgrade transformers, or fine-tune a checkpoint of its language "
                      "model alone.")


def _required_inputs(cls) -> list[str]:
    """The inputs ``cls.forward`` cannot do without besides ``input_ids`` (BLIP-2's ``pixel_values``)."""
    try:
        params = list(inspect.signature(cls.forward).parameters.values())[1:]
    except (TypeError, ValueError):  # no signature to read: nothing is known to be required
        return []
    return [p.name for p in params if p.default is inspect.Parameter.empty and p.name != "input_ids"
            and p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY)]


def language_parameters(model: nn.Module) -> set[int]:
    """``id()`` of the language model's parameters: the decoder ``get_decoder()`` returns, the input embeddings and
    the output layer (tied or not)."""
    parts = [model.get_decoder(), model.get_input_embeddings(), model.get_output_embeddings()]
    return {id(p) for part in parts if part is not None for p in part.parameters()}


def language_prefixes(model: nn.Module) -> list[str] | None:
    """The qualified names of the modules that make up a composite's language model (decoder, input embeddings,
    output layer), or None for a model that is all language model (a plain causal LM, or a composite whose
    decoder holds every parameter)."""
    if not is_composite(getattr(model, "config", None)):
        return None
    language = language_parameters(model)
    if all(id(p) in language for p in model.parameters()):
        return None
    parts = {id(m) for m in (model.get_decoder(), model.get_input_embeddings(), model.get_output_embeddings())
             if m is not None}
    names = [name for name, module in model.named_modules() if id(module) in parts and name]
    if not names:
        raise ConfigError(f"{type(model).__name__}: its get_decoder() is not a part of it, so anyfit cannot tell its "
                          "language model from the rest; fine-tune a checkpoint of its language model alone.")
    return [n for n in names if not any(n.startswith(other + ".") for other in names)]


def language_modules(model: nn.Module):
    """``named_modules()`` of the language model only (every module of a plain language model)."""
    prefixes = language_prefixes(model)
    for name, module in model.named_modules():
        if prefixes is None or any(name == p or name.startswith(p + ".") for p in prefixes):
            yield name, module


def lora_scope(model: nn.Module, targets: list[str],
               tower: tuple[str, list[str], list[str]] | None = None) -> list[str] | str:
    """PEFT's ``target_modules`` for the leaf names ``targets``: the list itself for a plain language model; for a
    composite, a pattern (PEFT matches a string with ``re.fullmatch`` against each module's qualified name) that
    takes those leaves only inside the language model, so a vision tower's ``q_proj`` is left alone. With ``tower``
    (its name, its leaf names, the qualified names of its modules to leave out: model.train_vision=lora,
    ``anyfit.model.vision.tower_lora_targets``) those leaves inside the tower too."""
    prefixes = language_prefixes(model)
    if prefixes is None:
        return targets

    def inside(names: list[str], leaves: list[str]) -> str:
        return rf"(?:{'|'.join(re.escape(n) for n in names)})\.(?:.*\.)?(?:{'|'.join(re.escape(t) for t in leaves)})"

    pattern = inside(prefixes, targets)
    if tower is None:
        return pattern
    name, leaves, left_out = tower
    unless = f"(?!(?:{'|'.join(re.escape(n) for n in left_out)})$)" if left_out else ""
    return f"{pattern}|{unless}{inside([name], leaves)}"


def language_attention(config, name: str) -> str | dict:
    """The ``attn_implementation`` that gives ``name`` to the language model of ``config`` alone: a composite's vision
    and audio towers keep their own. Packed rows' example boundaries (``anyfit_varlen``'s ``packed_lengths``) are the
    text row's, and some composites hand the forward's keyword arguments on to their tower, which would then split
    its own patch sequence by them (SigLIP and CLIP towers computed garbage under it)."""
    if not is_composite(config):
        return name
    text = config.get_text_config()
    return {"": name, **{key: name for key in config.sub_configs if getattr(config, key, None) is text}}

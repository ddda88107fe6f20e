"""Which part of a vision-language composite is which, and which parts train (``model.train_vision``,
``model.train_projector``): the one owner of that rule for loading, freezing, LoRA, checkpointing and the planner.

- the language model: ``anyfit.model.composite.language_parameters`` (decoder, input embeddings, output layer);
- the vision tower: the module transformers' own ``get_encoder(modality="image")`` returns (``vision_tower``,
  ``visual``, ``vision_model``, ``vision_encoder``, ``image_tower``), with whatever it holds (Qwen's ``visual.merger``,
  Llama-4's ``vision_adapter``: they train with the tower);
- the audio tower: ``get_encoder(modality="audio")``, never trained here;
- the projector: every other parameter (LLaVA's, Gemma-3's, Mistral-3's ``multi_modal_projector``, Idefics3's
  ``connector``, Gemma-4's ``embed_vision``).

Frozen parts keep their loaded values bit for bit: no gradient, no optimizer state. A fully trained part of a LoRA
run is PEFT's ``modules_to_save``: PEFT freezes everything but its adapters (``get_peft_model``), so a plain
``requires_grad`` on the tower would neither train nor be saved in the adapter; ``modules_to_save`` trains a copy of
the module and writes it whole into the adapter, so adapter + base reproduce the trained model.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from anyfit.config import ConfigError
from anyfit.model.composite import is_composite, language_parameters, language_prefixes, model_class


@dataclass(frozen=True)
class Parts:
    """A composite's parts by qualified module name, and the ``id()`` of each part's parameters."""

    language: frozenset[int]
    tower: str | None  # the image tower's name; None: the model has none
    tower_ids: frozenset[int]
    projector: tuple[str, ...]  # the largest modules that hold projector parameters only
    projector_ids: frozenset[int]
    loose: tuple[str, ...]  # projector parameters held by a module that holds other parts too (LLaVA-NeXT's image_newline)
    audio_ids: frozenset[int]

    def trained(self, train_vision: str, train_projector: bool) -> frozenset[int]:
        """The parameters that train (LoRA aside: its adapters are new parameters)."""
        return (self.language | (self.tower_ids if train_vision == "full" else frozenset())
                | (self.projector_ids if train_projector else frozenset()))

    def saved_whole(self, train_vision: str, train_projector: bool) -> list[str]:
        """The modules a LoRA adapter must hold whole (PEFT's ``modules_to_save``)."""
        return ([self.tower] if train_vision == "full" and self.tower else []) + (
            list(self.projector) if train_projector else [])


def _encoder(model: nn.Module, modality: str) -> nn.Module | None:
    """transformers' ``get_encoder(modality)``, None where it finds none: it then returns the model itself or its
    base model (Gemma-4 without audio: None)."""
    get = getattr(model, "get_encoder", None)
    found = get(modality=modality) if get is not None else None
    if found is None or found is model or found is getattr(model, "base_model", None):
        return None
    return found


def parts(model: nn.Module) -> Parts:
    """Which parameter of ``model`` belongs to which part (``language`` alone for a plain language model)."""
    language = frozenset(language_parameters(model)) if is_composite(getattr(model, "config", None)) else \
        frozenset(id(p) for p in model.parameters())
    names = {id(m): name for name, m in model.named_modules()}
    tower_module = _encoder(model, "image")
    if tower_module is not None and any(id(p) in language for p in tower_module.parameters()):
        tower_module = None  # an "encoder" that holds the language model is no tower
    audio_module = _encoder(model, "audio")
    tower_ids = frozenset(id(p) for p in tower_module.parameters()) if tower_module is not None else frozenset()
    audio_ids = frozenset(id(p) for p in audio_module.parameters()) if audio_module is not None else frozenset()
    rest = {id(p) for p in model.parameters()} - language - tower_ids - audio_ids
    chosen: list[str] = []
    for name, module in model.named_modules():
        ids = {id(p) for p in module.parameters()}
        if name and ids and ids <= rest and not any(name.startswith(c + ".") for c in chosen):
            chosen.append(name)
    covered = {id(p) for c in chosen for p in model.get_submodule(c).parameters()}
    loose = tuple(n for n, p in model.named_parameters() if id(p) in rest and id(p) not in covered)
    return Parts(language, names.get(id(tower_module)) if tower_module is not None else None, tower_ids,
                 tuple(chosen), frozenset(rest), loose, audio_ids)


def check_parts(model: nn.Module, train_vision: str, train_projector: bool, lora: bool) -> list[str]:
    """Refuse settings the model cannot honour (a ConfigError in one line); returns the lines to print about what
    trains in a composite (none for a plain language model at the defaults)."""
    found = parts(model)
    kind = type(model).__name__
    if found.tower is None:
        asked = [f"model.train_vision={train_vision}"] if train_vision != "frozen" else []
        asked += ["model.train_projector=true"] if train_projector else []
        if asked:
            raise ConfigError(f"{' and '.join(asked)} but {kind} has no vision tower; train a vision-language "
                              "composite, or leave model.train_vision=frozen and model.train_projector=false.")
        return []
    if train_projector and lora and found.loose:
        raise ConfigError(f"model.train_projector=true with LoRA: {kind}'s {found.loose[0]} sits in a module beside "
                          "the language model, which a PEFT adapter cannot hold whole (modules_to_save); train it in "
                          "a full fine-tune, or set model.train_projector=false.")
    lines = []
    if train_projector and not found.projector_ids:
        lines.append(f"[anyfit] model.train_projector=true: {kind} has no projector outside its vision tower "
                     f"({found.tower}, which holds it): it " + (f"trains with the tower (model.train_vision="
                     f"{train_vision})" if train_vision != "frozen" else "stays frozen with the tower "
                     "(model.train_vision=frozen)"))
    projector = ", ".join(found.projector) or "none"
    lines.append(f"[anyfit] composite: language model trains; vision tower {found.tower} {train_vision}; "
                 f"projector ({projector}) {'trains' if train_projector and found.projector_ids else 'frozen'}"
                 + ("; audio tower frozen" if found.audio_ids else ""))
    return lines


def freeze_untrained(model: nn.Module, train_vision: str = "frozen", train_projector: bool = False) -> int:
    """Freeze every parameter of a composite that does not train: the vision tower unless ``train_vision`` is full,
    the projector unless ``train_projector``, any audio tower always. The language model is left as loaded. Returns
    how many parameters were frozen (0 for a plain language model)."""
    if language_prefixes(model) is None:
        return 0
    trained = parts(model).trained(train_vision, train_projector)
    frozen = 0
    for param in model.parameters():
        if id(param) not in trained:
            param.requires_grad_(False)
            frozen += param.numel()
    return frozen


def _is_linear(module: nn.Module) -> bool:
    from transformers.pytorch_utils import Conv1D

    return isinstance(module, (nn.Linear, Conv1D)) or type(module).__name__ in ("Linear4bit", "Linear8bitLt")


def tower_linear_leaves(model: nn.Module) -> list[str]:
    """Leaf names of the vision tower's linear layers, in first-seen order ([] without a tower)."""
    found = parts(model)
    if found.tower is None:
        return []
    tower = model.get_submodule(found.tower)
    return list(dict.fromkeys(name.rsplit(".", 1)[-1] for name, m in tower.named_modules() if name and _is_linear(m)))


def tower_lora_targets(model: nn.Module, spec: list[str] | str) -> tuple[str, list[str], list[str]]:
    """(the tower's name, the leaf names LoRA adapts in it, the tower's other modules of those names) for
    ``lora.target_modules`` ``spec``: auto/all-linear every linear layer of the tower, a list the names it shares with
    the tower (a ConfigError if none). PEFT matches by name and adapts convolutions too: Qwen's patch embedding is a
    Conv3d named ``proj`` like its attention output, so the pattern must leave the third list out."""
    found = parts(model)
    leaves = tower_linear_leaves(model)
    if spec in ("auto", "all-linear"):
        chosen = leaves
    else:
        listed = [spec] if isinstance(spec, str) else list(spec)
        chosen = [t for t in listed if t in leaves]
        if not chosen:
            raise ConfigError(f"model.train_vision=lora: lora.target_modules {listed} names none of the vision "
                              f"tower's linear layers ({', '.join(leaves)}); add some, or use lora.target_modules=auto.")
    tower = model.get_submodule(found.tower)
    others = [f"{found.tower}.{name}" for name, m in tower.named_modules()
              if name and name.rsplit(".", 1)[-1] in chosen and not _is_linear(m)]
    return found.tower, chosen, others


def checkpointed_stacks(model: nn.Module, tower_trains: bool) -> tuple[list[nn.Module], list[nn.Module]]:
    """(the language model's checkpointable layers, the tower's when it trains, else []): transformers'
    ``GradientCheckpointingLayer`` blocks of each, in order. A frozen tower runs no backward (its input, the pixels,
    needs no gradient): checkpointing it would keep nothing less and only add the wrapper."""
    from transformers.modeling_layers import GradientCheckpointingLayer

    prefixes = language_prefixes(model)
    found = parts(model) if prefixes is not None else None
    language, tower = [], []
    for name, module in model.named_modules():
        if not isinstance(module, GradientCheckpointingLayer):
            continue
        if prefixes is None or any(name.startswith(p + ".") for p in prefixes):
            language.append(module)
        elif tower_trains and found.tower and name.startswith(found.tower + "."):
            tower.append(module)
    return language, tower


def frozen_encoders(model: nn.Module, tower_trains: bool) -> list[nn.Module]:
    """The encoders no gradient should pass through: the image tower unless it trains, any audio tower."""
    found = [] if tower_trains else [_encoder(model, "image")]
    return [m for m in (*found, _encoder(model, "audio")) if m is not None and language_prefixes(model) is not None]


@dataclass(frozen=True)
class PartSizes:
    """Parameter counts of a composite's parts outside the language model, for the planner."""

    tower: int = 0
    projector: int = 0
    audio: int = 0
    # the tower's linear layers as (leaf name, d_in, d_out, count): what LoRA adapts with train_vision=lora
    tower_linears: tuple[tuple[str, int, int, int], ...] = ()

    @property
    def outside(self) -> int:
        return self.tower + self.projector + self.audio


def part_sizes(config) -> PartSizes:
    """Counted by building the checkpoint's class on the meta device (nothing allocated, nothing read); all zero
    for a plain language model."""
    if not is_composite(config):
        return PartSizes()
    try:
        with torch.device("meta"):
            model = model_class(config).from_config(config)
    except Exception as e:  # any failure to build means: no count for this architecture
        raise ConfigError(f"Cannot count the parts of the composite {config.model_type!r} outside its language "
                          f"model ({type(e).__name__}: {str(e).splitlines()[0][:200] if str(e) else ''}).") from e
    if language_prefixes(model) is None:
        return PartSizes()
    found = parts(model)
    size = {id(p): p.numel() for p in model.parameters()}
    linears: dict[tuple[str, int, int], int] = {}
    if found.tower is not None:
        for name, m in model.get_submodule(found.tower).named_modules():
            if name and _is_linear(m):
                d_out, d_in = m.weight.shape if isinstance(m, nn.Linear) else m.weight.shape[::-1]  # Conv1D: (in, out)
                key = (name.rsplit(".", 1)[-1], d_in, d_out)
                linears[key] = linears.get(key, 0) + 1
    return PartSizes(tower=sum(size[i] for i in found.tower_ids), projector=sum(size[i] for i in found.projector_ids),
                     audio=sum(size[i] for i in found.audio_ids),
                     tower_linears=tuple((n, i, o, c) for (n, i, o), c in linears.items()))

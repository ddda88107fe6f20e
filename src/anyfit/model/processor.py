"""The model's processor, for records with images: loaded for a vision-language checkpoint (a composite with a vision
config: ``anyfit.model.composite``), with anyfit's tokenizer in it (its pad token, its checked file, the run's chat
template), so the processor's ids and the text pipeline's come from one tokenizer. A text-only model gets none, and
its image records are refused in one line (``anyfit.data.image_tokens.ImageTokens`` holds the processor, or why there
is none).
"""

from __future__ import annotations

import shutil
from pathlib import Path

from anyfit.config import ModelConfig
from anyfit.model.composite import is_composite
from anyfit.model.source import ModelLocation, ModelSource


def load_processor(cfg: ModelConfig, tokenizer) -> tuple[object | None, str]:
    """(the processor of ``cfg``'s model, ""), or (None, why there is none: a text-only model, a GGUF file, a
    processor that does not load)."""
    from transformers import AutoConfig

    src = ModelSource.from_config(cfg)
    name = cfg.name_or_path
    if src.gguf_file:
        return None, f"{name} is a GGUF file, which holds a language model only"
    try:
        config = AutoConfig.from_pretrained(src.path, trust_remote_code=cfg.trust_remote_code, revision=cfg.revision)
    except (OSError, ValueError) as e:
        return None, f"the config of {name} could not be read ({' '.join(str(e).split())[:200]})"
    return processor_of(config, src.path, tokenizer, name, revision=cfg.revision,
                        trust_remote_code=cfg.trust_remote_code)


def processor_of(config, folder: str, tokenizer, name: str, *, revision: str | None = None,
                 trust_remote_code: bool = False) -> tuple[object | None, str]:
    """(the processor in ``folder`` of a model with this ``config``, ""), or (None, why there is none)."""
    if not is_composite(config) or getattr(config, "vision_config", None) is None:
        return None, f"{name} is a text-only model (model_type {config.model_type!r}, no vision config)"
    # Imported only here: it imports transformers' image processing and torchvision (~2 s of a text-only
    # anyfit prepare's start-up on the 2-core VM).
    from transformers import AutoProcessor

    try:
        processor = AutoProcessor.from_pretrained(folder, tokenizer=tokenizer, revision=revision,
                                                  trust_remote_code=trust_remote_code)
    except (OSError, ValueError, ImportError, TypeError) as e:
        fix = "; install torchvision (pip install 'anyfit[vision]')" if "orchvision" in str(e) else ""
        return None, f"the processor of {name} could not be loaded ({' '.join(str(e).split())[:300]}){fix}"
    if not hasattr(processor, "image_processor"):
        return None, f"{name}'s processor ({type(processor).__name__}) has no image processor"
    return processor, ""


def inference_processor(config, loc: ModelLocation, tokenizer, name: str, *, revision: str | None = None,
                        trust_remote_code: bool = False) -> tuple[object | None, str]:
    """``processor_of`` for a model located by ``locate_model``: a training output (full or LoRA) keeps its
    processor files beside its tokenizer (``save_processor``); a base model has them with its weights."""
    if loc.gguf_file:
        return None, f"{name} is a GGUF file, which holds a language model only"
    here = Path(loc.tokenizer)
    folder = str(here) if any((here / f).is_file() for f in PROCESSOR_FILES) else loc.base
    return processor_of(config, folder, tokenizer, name, revision=None if folder == str(here) and here.is_dir()
                        else revision, trust_remote_code=trust_remote_code)


# The files of a processor beside the tokenizer's: what transformers' AutoProcessor and vLLM read to process images.
PROCESSOR_FILES = ("preprocessor_config.json", "processor_config.json", "video_preprocessor_config.json")


def save_processor(cfg: ModelConfig, tokenizer, directory: Path) -> list[str]:
    """The model's processor files into ``directory`` beside the saved model and tokenizer (nothing for a text-only
    model), with the chat template the run trained with; the file names written."""
    processor, _ = load_processor(cfg, tokenizer)
    if processor is None:
        return []
    processor.chat_template = tokenizer.chat_template  # the run's template (an override, its baked options)
    processor.save_pretrained(directory)
    return [name for name in PROCESSOR_FILES if (directory / name).is_file()]


def copy_processor_files(source: Path, folder: Path) -> list[str]:
    """A saved run's processor files copied into an export of it (the tokenizer and template are saved apart)."""
    copied = []
    for name in PROCESSOR_FILES:
        if (source / name).is_file():
            shutil.copyfile(source / name, folder / name)
            copied.append(name)
    return copied

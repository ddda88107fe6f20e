"""A sharded checkpoint (``checkpoint-N/sharded/``, written by the processes of an FSDP2 run, or
``checkpoint-N/deepspeed/``, by a DeepSpeed ZeRO-3 run) turned into an ordinary model folder by one process,
without the processes that wrote it: what ``anyfit export`` does first when it is given such a checkpoint.

The model is built as training built it (``load_model`` with the checkpoint's own config.yaml, on the CPU in
fp32: the same parameter names, LoRA adapters included), then the backend that wrote the checkpoint reads every
process's slices into its whole tensors (``anyfit.backends``: FSDP2's through ``torch.distributed.checkpoint``,
with no process group, one process planning and reading them all), and ``save_pretrained`` writes the weights
(or the adapter) into the checkpoint folder beside ``sharded/``, so the checkpoint then also is what a replicated
run's checkpoint is: a folder transformers or PEFT loads. The ``sharded/`` (or ``deepspeed/``) files and the manifest are left as they were: the checkpoint still resumes.
"""

from __future__ import annotations

from pathlib import Path

from anyfit.backends import writer_of
from anyfit.config import ConfigError, load_config
from anyfit.data.chat import serve_as_trained
from anyfit.durable import follow_umask
from anyfit.export import ExportError
from anyfit.hardware.runtime import inference_policy
from anyfit.model.loading import load_model
from anyfit.model.tokenizer import load_tokenizer
from anyfit.model.source import ModelLocation, ModelSource, record_base
from anyfit.model.unloaded import find_unloaded
from anyfit.runfolder import RUN_CONFIG, has_final_model


def needs_gathering(folder: Path) -> bool:
    """A sharded checkpoint whose model was not yet gathered into an ordinary folder."""
    return writer_of(folder).sharded and not has_final_model(folder)


def sharded_location(folder: Path) -> ModelLocation:
    """Where the gathered model's pieces will be, from the checkpoint's config.yaml (checked before any
    weights load)."""
    cfg = _config(folder)
    src = ModelSource.from_config(cfg.model)
    lora = cfg.lora.enabled or cfg.lora.qlora
    return ModelLocation(base=src.path, tokenizer=src.path, adapter=str(folder) if lora else None,
                         gguf_file=src.gguf_file)


def gather_sharded_checkpoint(folder: Path, echo=print) -> None:
    """Write the model (or adapter) a sharded checkpoint holds into that folder as safetensors, with the
    tokenizer: the backend that wrote it reads it (``Backend.read_whole``), in this one process."""
    cfg = _config(folder)
    model = load_model(cfg, inference_policy("cpu", "float32"))
    writer = writer_of(folder)
    try:
        writer.read_whole(folder, model)
    except ConfigError as e:  # the backend's own one line (DeepSpeed missing, another model's weights)
        raise ExportError(str(e)) from None
    except Exception as e:  # a missing or damaged shard file: DCP raises a CheckpointException listing them
        first = str(e).strip().splitlines()[0][:200] if str(e).strip() else type(e).__name__
        raise ExportError(f"{folder}/{writer.folder} cannot be read ({first}); export an earlier checkpoint.") from e
    model.save_pretrained(folder, safe_serialization=True)
    lora = cfg.lora.enabled or cfg.lora.qlora
    unloaded = None if lora else find_unloaded(model, cfg.model)  # the base's MTP tensors, as training saves them
    if unloaded is not None:
        unloaded.write_into(folder)  # named by the export that reads this folder next
    tokenizer = load_tokenizer(cfg.model)
    # the template the run trained with and its options as defaults, as the run saves it
    serve_as_trained(tokenizer, cfg.data.chat_template, cfg.data.chat_template_kwargs)
    tokenizer.save_pretrained(folder)
    if (folder / "adapter_config.json").is_file():
        record_base(folder, cfg.model)
    follow_umask(folder)
    echo(f"[anyfit] export: gathered the sharded checkpoint {folder} into ordinary safetensors "
         f"({'adapter' if lora else 'model'}) by one process")


def _config(folder: Path):
    try:
        return load_config(folder / RUN_CONFIG)
    except (ConfigError, OSError) as e:
        raise ExportError(f"{folder} is a sharded checkpoint whose {RUN_CONFIG} cannot be read ({e}); it is "
                          "needed to rebuild the model its shards belong to.") from None

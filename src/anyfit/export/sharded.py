"""A sharded checkpoint (``checkpoint-N/sharded/``, written by the processes of an FSDP2 run, or
``checkpoint-N/deepspeed/``, by a DeepSpeed ZeRO-3 run) turned into an ordinary model folder by one process,
without the processes that wrote it: what ``anyfit export`` does first when it is given such a checkpoint.

The model is built as training built it (``load_model`` with the checkpoint's own config.yaml, on the CPU in
fp32: the same parameter names, LoRA adapters included), then ``torch.distributed.checkpoint`` reads every
process's slices into its whole tensors (with no process group, one process plans and reads them all), and
``save_pretrained`` writes the weights (or the adapter) into the checkpoint folder beside ``sharded/``, so the
checkpoint then also is what a replicated run's checkpoint is: a folder transformers or PEFT loads. The
``sharded/`` files and the manifest are left as they were: the checkpoint still resumes. A ZeRO-3 checkpoint is
read by DeepSpeed's own ``zero_to_fp32`` (the fp32 master weights, every process's partitions joined) instead.
"""

from __future__ import annotations

from pathlib import Path

from anyfit.config import ConfigError, load_config
from anyfit.export.errors import ExportError
from anyfit.hardware.runtime import inference_policy
from anyfit.model.loading import load_model, load_tokenizer, shared_parameter_names
from anyfit.model.source import ModelLocation, ModelSource, record_base
from anyfit.runfolder import DEEPSPEED_DIR, RUN_CONFIG, SHARDED_DIR, follow_umask, has_final_model


def needs_gathering(folder: Path) -> bool:
    """A sharded checkpoint whose model was not yet gathered into an ordinary folder."""
    return ((folder / SHARDED_DIR).is_dir() or (folder / DEEPSPEED_DIR).is_dir()) and not has_final_model(folder)


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
    tokenizer."""
    import torch.distributed.checkpoint as dcp

    cfg = _config(folder)
    model = load_model(cfg, inference_policy("cpu", "float32"))
    state = model.state_dict()
    where = DEEPSPEED_DIR if (folder / DEEPSPEED_DIR).is_dir() else SHARDED_DIR
    try:
        if where == DEEPSPEED_DIR:
            _read_zero3(folder / DEEPSPEED_DIR, model)
        else:
            dcp.load({"model": state}, checkpoint_id=str(folder / SHARDED_DIR))  # into these very tensors
    except ExportError:
        raise
    except Exception as e:  # a missing or damaged shard file: DCP raises a CheckpointException listing them
        first = str(e).strip().splitlines()[0][:200] if str(e).strip() else type(e).__name__
        raise ExportError(f"{folder}/{where} cannot be read ({first}); export an earlier checkpoint.") from e
    model.save_pretrained(folder, safe_serialization=True)
    load_tokenizer(cfg.model).save_pretrained(folder)
    if (folder / "adapter_config.json").is_file():
        record_base(folder, cfg.model)
    follow_umask(folder)
    echo(f"[anyfit] export: gathered the sharded checkpoint {folder} into ordinary safetensors "
         f"({'adapter' if cfg.lora.enabled or cfg.lora.qlora else 'model'}) by one process")


def _read_zero3(directory: Path, model) -> None:
    """The fp32 weights of a DeepSpeed ZeRO-3 checkpoint into ``model`` (DeepSpeed's zero_to_fp32, on the CPU)."""
    import os

    os.environ.setdefault("DS_ACCELERATOR", "cpu")  # reading files needs no accelerator: DeepSpeed's CPU one
    try:
        from deepspeed.utils.zero_to_fp32 import get_fp32_state_dict_from_zero_checkpoint
    except ImportError:
        raise ExportError(f"{directory} was written by DeepSpeed ZeRO-3: reading it needs DeepSpeed (pip install "
                          "'anyfit[deepspeed]').") from None
    state = get_fp32_state_dict_from_zero_checkpoint(str(directory), tag="state")
    missing, unexpected = model.load_state_dict(state, strict=False)
    tied = {name for group in shared_parameter_names(model) for name in group[1:]}  # saved once, under the first name
    if [k for k in missing if k not in tied] or unexpected:
        raise ExportError(f"{directory} does not hold this model's weights (missing {list(missing)[:3]}, unexpected "
                          f"{list(unexpected)[:3]}); export a checkpoint of this run.")


def _config(folder: Path):
    try:
        return load_config(folder / RUN_CONFIG)
    except (ConfigError, OSError) as e:
        raise ExportError(f"{folder} is a sharded checkpoint whose {RUN_CONFIG} cannot be read ({e}); it is "
                          "needed to rebuild the model its shards belong to.") from None

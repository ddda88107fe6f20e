"""``anyfit export``: the checked request (``request``) made into a standalone model folder, then pushed.

The model is loaded with a LoRA adapter merged into its base and written in one dtype with its tokenizer, the
run's config.yaml and a model card (``publish``); each GGUF file asked is written (``gguf_writer``) and loaded back
and compared with the merged model (``gguf_check``) before the export counts as done; the folder is then
uploaded if asked (``publish``).

The folder is written under a temporary name next to ``out`` and renamed at the end, so a failed or
interrupted export never leaves something that looks finished.
"""

from __future__ import annotations

import shutil
import tempfile
from pathlib import Path

import torch

from anyfit.data.chat import serve_as_trained
from anyfit.data.stopping import write_generation_config
from anyfit.data.templates import default_system_prompt
from anyfit.durable import follow_umask
from anyfit.export import ExportError
from anyfit.export.gguf_check import check_gguf, reference_outputs
from anyfit.export.gguf_writer import write_gguf
from anyfit.export.publish import model_card, push_folder
from anyfit.export.request import DTYPES, ExportRequest, ExportResult, check_request
from anyfit.export.sharded import gather_sharded_checkpoint
from anyfit.config import ModelConfig
from anyfit.hardware.runtime import quiet_deepspeed
from anyfit.model.composite import model_class
from anyfit.model.loading import load_for_inference
from anyfit.model.processor import copy_processor_files
from anyfit.model.unloaded import find_unloaded
from anyfit.runfolder import RUN_CONFIG
from anyfit.training.checkpoints.best import FINAL, read_best


def export(run: str | Path, out: str | Path | None = None, *, dtype: str | None = None,
           gguf: str | list[str] | tuple[str, ...] = (), push: str | None = None, private: bool = False,
           overwrite: bool = False, eval_summary: str | Path | None = None, command: str | None = None,
           last: bool = False, api=None, echo=print) -> ExportResult:
    """Export ``run`` (a training output folder, a checkpoint or any model folder) to ``out``. A run that kept
    its best checkpoint (``train.keep_best``) is exported from that one unless ``last`` (its final model).

    ``dtype``: bf16, fp16 or fp32 (default: the base model's recorded dtype, else bf16). ``gguf``: GGUF
    types to write next to the weights (``GGUF_TYPES``), each checked by ``check_gguf``. ``push``: a Hub
    repository to upload the folder to (``private`` creates it private); ``api`` is the
    ``huggingface_hub.HfApi`` to use (default: one with the token of the environment or ``hf auth login``).
    ``eval_summary``: an ``anyfit eval`` summary.json to report in the model card. ``command``: the command
    line to record in the card. Every input is checked before any weights load (``check_request``).
    """
    quiet_deepspeed()
    run, out = Path(run).expanduser(), out or f"{Path(run).expanduser()}-export"  # next to RUN, also from its best
    req = check_request(best_of(run, last, echo), out, dtype=dtype, gguf=gguf, push=push, overwrite=overwrite,
                        eval_summary=eval_summary, api=api)
    echo(f"[anyfit] export: {req.run} -> {req.out} ({req.dtype}: {req.dtype_reason})")
    if req.gather:
        gather_sharded_checkpoint(req.run, echo)
    req.out.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{req.out.name}.", suffix=".partial", dir=req.out.parent))
    try:
        result = _export_into(req, tmp, command, echo)
        if req.out.exists():  # only reached with overwrite (checked in check_request)
            shutil.rmtree(req.out)
        tmp.rename(req.out)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    result.out = req.out
    result.gguf = {t: req.out / p.name for t, p in result.gguf.items()}
    echo(f"[anyfit] export: wrote {req.out}")
    if req.push:
        result.pushed = push_folder(req.out, req.push, private=private, api=api, echo=echo)
    return result


def _export_into(req: ExportRequest, folder: Path, command: str | None, echo) -> ExportResult:
    # Loaded in the export dtype, not fp32 then cast: PEFT computes the LoRA delta in fp32 on the CPU and
    # adds it once, and a 7B model in fp32 would need twice the memory of the bf16 one.
    model, tokenizer = load_for_inference(req.run, device="cpu", dtype=DTYPES[req.dtype], merge_lora=True)
    result = ExportResult(req.out, req.dtype, merged_adapter=req.location.adapter is not None,
                          auto_class=model_class(model.config).__name__)
    if result.merged_adapter:
        echo(f"[anyfit] export: merged the LoRA adapter into {req.location.base}")
    model.save_pretrained(folder)
    keep_unloaded(req, model, folder, echo)
    if req.run_files.config is not None:  # a run saved before its options were its template's defaults gets them
        serve_as_trained(tokenizer, None, req.run_files.config.data.chat_template_kwargs)
    tokenizer.save_pretrained(folder)
    copy_processor_files(Path(req.location.tokenizer), folder)  # a vision-language model's image processing
    # Other tools generate with generation_config.json: it must stop where the chat template ends a turn.
    stops = write_generation_config(folder, model, tokenizer)
    if stops:
        echo(f"[anyfit] export: generation stops at {', '.join(stops)}")
    if req.run_files.config_path is not None:  # anyfit eval/generate then lay prompts out as in training
        shutil.copyfile(req.run_files.config_path, folder / RUN_CONFIG)
    parameters = sum(p.numel() for p in model.parameters())
    if req.gguf_types:
        reference = reference_outputs(model.to(torch.float32), tokenizer)  # bf16/fp16 widen exactly
        del model
        for qtype in req.gguf_types:
            path = folder / f"{req.out.name}-{qtype.upper()}.gguf"
            write_gguf(folder, path, qtype, name=req.out.name, echo=echo)
            agreement = check_gguf(path, folder, tokenizer, reference, qtype)
            echo(f"[anyfit] export: GGUF {agreement.describe()}")
            if not agreement.ok:
                raise ExportError(f"the {qtype} GGUF file does not hold the merged model: {agreement.describe()}. "
                                  "The export was not kept; the conversion is wrong for this model (please report "
                                  "it with the model's config.json).")
            if agreement.greedy_match < agreement.prompts / 2:
                echo(f"[anyfit] export: warning: {qtype} rounding changes this model's greedy output on "
                     f"{agreement.prompts - agreement.greedy_match} of {agreement.prompts} check prompts; a wider "
                     "type (q8_0, f16) stays closer to it.")
            result.gguf[qtype], result.agreement[qtype] = path, agreement
    card = model_card(req, result, parameters, command, default_system=default_system_prompt(tokenizer))
    (folder / "README.md").write_text(card, encoding="utf-8")
    follow_umask(folder)
    return result


def keep_unloaded(req: ExportRequest, model, folder: Path, echo) -> None:
    """The tensors of the weights the model was read from (a run's folder, or an adapter's base) that it does not
    load (MTP layers: ``anyfit.model.unloaded``), written beside it unchanged unless the run dropped them
    (``model.keep_unloaded_tensors`` of its config.yaml)."""
    config = req.run_files.config
    keep = config.model.keep_unloaded_tensors if config is not None else True
    unloaded = find_unloaded(model, ModelConfig(name_or_path=req.location.base, gguf_file=req.location.gguf_file,
                                                keep_unloaded_tensors=keep))
    if unloaded is not None:
        unloaded.write_into(folder)
        echo(unloaded.line("[anyfit] export:"))


def best_of(run: Path, last: bool, echo=print) -> Path:
    """The folder to export of ``run``: the checkpoint ``best.json`` names (``train.keep_best``) unless ``last``
    or the final model is the best; ``run`` itself otherwise."""
    best = None if last else read_best(run)
    if best is None or best["checkpoint"] == FINAL:
        return run
    echo(f"[anyfit] export: the run's best checkpoint by {best['metric']} ({best['value']:.6g} at step "
         f"{best['step']}): {best['checkpoint']} (--last exports the final model)")
    return run / best["checkpoint"]

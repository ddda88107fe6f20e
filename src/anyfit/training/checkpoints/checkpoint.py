"""Checkpoints and the final model: writing them, and restoring a run from one.

A checkpoint is ``checkpoint-<step>/`` holding the model and optimizer states as the run's backend writes them
(``anyfit.backends``: safetensors and ``optimizer.pt`` replicated, only the adapter for LoRA; every process's
shards under ``sharded/`` with FSDP2; the engine's files under ``deepspeed/`` with ZeRO-3), the scheduler
state, each process's RNG state, ``trainer_state.json``, the resolved ``config.yaml``, the fingerprint of the
examples the run draws from (``data.json``, ``data_records-*.npy``: ``anyfit.data.fingerprint``) and, written last,
``manifest.json`` (``anyfit.training.checkpoints.integrity``). The folder is written under a temporary name and renamed when complete, so a
crash mid-write never leaves a folder that looks like a finished checkpoint.
"""

from __future__ import annotations

import json
import random
import shutil
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch

from anyfit.backends import Backend, load_states, unwrapped
from anyfit.config import Config
from anyfit.backends.reading import damaged, torch_load
from anyfit.data import fingerprint
from anyfit.data.stopping import write_generation_config
from anyfit.durable import follow_umask
from anyfit.model.processor import save_processor
from anyfit.model.source import record_base
from anyfit.model.unloaded import UnloadedTensors, clear_kept
from anyfit.runfolder import (
    CHECKPOINT_PREFIX,
    DELETING_CHECKPOINT_PREFIX,
    RUN_CONFIG,
    TMP_CHECKPOINT_PREFIX,
    NotWritten,
    checkpoint_dirs,
    checkpoint_step,
    remove_leftovers,
)
from anyfit.training.checkpoints.best import FINAL, Best
from anyfit.training.parts import Parts
from anyfit.training.checkpoints.integrity import SCHEDULER, STATE, checkpoint_problem, write_manifest
from anyfit.training.checkpoints.disk import (
    agreed,
    bytes_to_write,
    is_write_error,
    not_written,
    remove_partial,
    room_problem,
    write_failure,
)


@dataclass(frozen=True)
class TrainState:
    """What a checkpoint saves of a run and restores into it: the objects the loop steps, as the backend
    wrapped them (``Backend.wrap``), and the tokenizer saved beside the weights (None: none)."""

    model: torch.nn.Module
    optimizer: Any
    scheduler: Any
    tokenizer: Any = None
    data: tuple[dict, list] | None = None  # the fingerprint of the examples drawn from (anyfit.data.fingerprint)
    unloaded: UnloadedTensors | None = None  # the source's tensors the model does not load (anyfit.model.unloaded)


def rng_state() -> dict[str, Any]:
    state = {"python": random.getstate(), "numpy": np.random.get_state(), "torch": torch.get_rng_state()}
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def save_model(backend: Backend, accelerator, model, tokenizer, directory: Path, model_cfg=None,
               unloaded: UnloadedTensors | None = None) -> list[str]:
    """The trainable weights as safetensors (LoRA: the adapter only), plus the tokenizer; a whole model also with
    ``unloaded`` (the source's tensors it does not load, when kept). Main process writes; every process must call
    this because gathering a sharded (FSDP/DeepSpeed) state dict is collective.

    With ``model_cfg`` (the run's ModelConfig), an adapter records a base others can load (see
    :func:`portable_base`) instead of the path the weights happened to be read from. A whole model's
    generation_config.json stops at the chat template's end of turn; returns those stop tokens (main process,
    whole model with its tokenizer; else [])."""
    stops: list[str] = []
    state_dict = backend.full_state_dict(accelerator, model)
    if accelerator.is_main_process:
        bare = unwrapped(model)
        clear_kept(directory)  # what an earlier save of this folder kept (a resumed run's final model)
        bare.save_pretrained(directory, state_dict=state_dict, safe_serialization=True)
        adapter = (directory / "adapter_config.json").is_file()
        if unloaded is not None and not adapter:
            unloaded.write_into(directory)
        if tokenizer is not None:
            tokenizer.save_pretrained(directory)
            if model_cfg is not None:  # a vision-language model's processor, with the run's chat template
                save_processor(model_cfg, tokenizer, directory)
            if not adapter:  # an adapter is loaded on its base, with the base's generation config
                stops = write_generation_config(directory, bare, tokenizer)
        if model_cfg is not None and adapter:
            record_base(directory, model_cfg)
        follow_umask(directory)
    return stops


class Checkpointer:
    """The run's checkpoints: written when ``train.save_every`` says (never at the last step: the final model is
    written then), and at a stop. A failed write mid-run is a warning and training goes on; at a stop, where the
    steps since the last checkpoint would be lost, it ends the run."""

    def __init__(self, parts: Parts, *, state: TrainState, guard, total_steps: int, steps_per_epoch: int,
                 best: Best | None = None):
        self.backend, self.accelerator, self.out, self.cfg, self.say = (parts.backend, parts.accelerator, parts.out,
                                                                        parts.cfg, parts.say)
        self.state = state
        self.guard, self.total_steps, self.steps_per_epoch = guard, total_steps, steps_per_epoch
        self.best = best  # train.keep_best (anyfit.training.checkpoints.best)

    def due(self, step: int) -> bool:
        every = self.cfg.train.save_every
        return bool(every) and step % every == 0 and step < self.total_steps

    def saw(self, record: dict[str, Any]) -> None:
        """An evaluation line: with ``train.keep_best``, a better value makes its step's checkpoint due (every
        process agrees: generation accuracy is measured on the main one only). At the last step the final model
        is the best (``best.json`` says so once it is written: ``final_saved``)."""
        if self.best is None:
            return
        self.best.saw(record)
        if self.accelerator.num_processes > 1:
            from accelerate.utils import broadcast_object_list

            self.best.pending = broadcast_object_list([self.best.pending])[0]
        if self.best.pending is not None and self.best.pending[0] >= self.total_steps:
            self.best.kept()

    def final_saved(self) -> str | None:
        """After the final model is written: ``best.json`` names the best, the final model when the last step was
        the best (written only now: a final save that failed leaves it naming a checkpoint that exists); the line
        that says where the best is (None without ``train.keep_best`` or a measured value)."""
        if self.best is None or self.best.step is None:
            return None
        if self.accelerator.is_main_process:
            self.best.write(self.out, final_step=self.total_steps)
        where = self.best.as_dict(final_step=self.total_steps)["checkpoint"]
        return (f"[anyfit] best {self.best.key}: {self.best.value:.6g} at step {self.best.step} "
                f"({'the final model' if where == FINAL else where}); anyfit export {self.out} exports it")

    def save(self, step: int, last: bool = False) -> Path | None:
        """``checkpoint-<step>`` when due (or ``last``: a stop's; or the best so far); its path, or None when none
        was written."""
        best_due = self.best is not None and self.best.pending is not None and self.best.pending[0] == step
        if not (last or best_due or self.due(step)):
            return None
        self.guard.flush()  # the count of skipped steps is part of the checkpoint
        trainer_state = {"epoch": (step - 1) // self.steps_per_epoch, "total_steps": self.total_steps,
                         "skipped_steps": self.guard.skipped}
        if self.best is not None and (best_due or self.best.step is not None):
            record = Best(self.best.key, self.best.lower, *(self.best.pending or (self.best.step, self.best.value)))
            trainer_state["best"] = record.as_dict()
        try:
            path = save_checkpoint(self.backend, self.accelerator, self.out, step, self.state, cfg=self.cfg,
                                   trainer_state=trainer_state, keep=self.best.protected() if self.best else ())
        except NotWritten as e:
            if last:
                raise
            if best_due:
                self.best.pending = None  # the best stays the one whose checkpoint exists
            self.say(f"[anyfit] warning: {e} Training goes on; make room before the next checkpoint (step "
                     f"{step + self.cfg.train.save_every}) or the end, or the steps since the last one are lost.")
            return None
        if best_due:
            self.best.kept()
            if self.accelerator.is_main_process:
                self.best.write(self.out)
                self.say(f"[anyfit] best {self.best.key} so far: {self.best.value:.6g} at step {step} ({path.name}, "
                         "kept outside train.keep_last)")
        return path


def save_checkpoint(backend: Backend, accelerator, output_dir: Path, step: int, state: TrainState, *, cfg: Config,
                    trainer_state: dict[str, Any], keep: tuple[int, ...] = ()) -> Path:
    """Write ``checkpoint-<step>`` of ``state`` (collective), with the run's config ``cfg`` and ``trainer_state``;
    keeps the newest ``train.keep_last``, and the checkpoints of the steps in ``keep`` (the best). Raises
    ``NotWritten`` on every process alike when the disk has no room for it or a write fails: the temporary folder is
    removed, earlier checkpoints are untouched."""
    final = output_dir / f"{CHECKPOINT_PREFIX}{step}"
    tmp = output_dir / f"{TMP_CHECKPOINT_PREFIX}{step}"
    need = bytes_to_write(state.model, state.optimizer)
    problem = None
    if accelerator.is_main_process:
        shutil.rmtree(tmp, ignore_errors=True)
        tmp.mkdir(parents=True)
        problem = room_problem(output_dir, need)
    problem = agreed(accelerator, problem)
    if problem is None:
        problem = agreed(accelerator, _attempt(lambda: _write_checkpoint(
            backend, accelerator, tmp, state, cfg.to_yaml(), cfg.model), output_dir, need))
    if problem is None and accelerator.is_main_process:
        problem = _attempt(lambda: _finish_checkpoint(tmp, final, {**trainer_state, "step": step}), output_dir, need)
    problem = agreed(accelerator, problem)
    if problem is not None:
        if accelerator.is_main_process:
            shutil.rmtree(tmp, ignore_errors=True)
        raise not_written(final.name, output_dir, problem)
    if accelerator.is_main_process:
        prune(output_dir, cfg.train.keep_last, keep)
    accelerator.wait_for_everyone()
    return final


def _attempt(write, folder: Path, need: int) -> str | None:
    """Run ``write``; a disk's failure becomes its one-line description (None: written)."""
    try:
        write()
    except BaseException as error:
        if not is_write_error(error):
            raise
        return write_failure(error, folder, need)
    return None


def _write_checkpoint(backend: Backend, accelerator, tmp: Path, state: TrainState, config_yaml: str,
                      model_cfg) -> None:
    """Every file of a checkpoint but its trainer state and manifest, into ``tmp`` (collective)."""
    backend.save_states(accelerator, state.model, state.optimizer, tmp, save_weights=lambda: save_model(
        backend, accelerator, state.model, state.tokenizer, tmp, model_cfg, state.unloaded))
    torch.save(rng_state(), tmp / f"rng_state_{accelerator.process_index}.pt")
    if accelerator.is_main_process:
        torch.save(state.scheduler.state_dict(), tmp / SCHEDULER)
        scaler = getattr(accelerator, "scaler", None)
        if scaler is not None:
            torch.save(scaler.state_dict(), tmp / "scaler.pt")
        (tmp / RUN_CONFIG).write_text(config_yaml)
        if state.data is not None:
            fingerprint.save(tmp, *state.data)


def _finish_checkpoint(tmp: Path, final: Path, state: dict[str, Any]) -> None:
    """Main process, once every process's files are in: the state, the manifest last, then the rename."""
    (tmp / STATE).write_text(json.dumps(state, indent=2))
    write_manifest(tmp)
    if final.exists():
        shutil.rmtree(final)
    tmp.rename(final)


def save_final_model(backend: Backend, accelerator, model, tokenizer, directory: Path, model_cfg=None,
                     unloaded: UnloadedTensors | None = None) -> list[str]:
    """The final model into the run folder (collective); ``NotWritten`` when it cannot be, with its partly
    written files removed (the checkpoints stay). Returns the tokens its generation config stops at
    (``save_model``)."""
    before = set(directory.iterdir()) if accelerator.is_main_process else set()
    stops: list[str] = []
    problem = _attempt(lambda: stops.extend(save_model(backend, accelerator, model, tokenizer, directory,
                                                       model_cfg, unloaded)),
                       directory, bytes_to_write(model, optimizer=None))
    problem = agreed(accelerator, problem)
    if problem is not None:
        if accelerator.is_main_process:
            remove_partial([p for p in directory.iterdir() if p not in before])
        raise not_written("the final model", directory, problem)
    return stops


def prune(output_dir: Path, keep_last: int, keep: tuple[int, ...] = ()) -> None:
    """Keep the newest ``keep_last`` intact checkpoints (sizes checked) and those of the steps in ``keep`` (the
    best, ``train.keep_best``), and delete every older folder, each whole or not at all (``delete_checkpoint``);
    what an earlier, killed prune left is removed first. Damaged ones newer than those are left for
    ``resume=auto`` to name and skip."""
    remove_leftovers(output_dir, (DELETING_CHECKPOINT_PREFIX,))
    dirs = checkpoint_dirs(output_dir)
    intact = [p for p in dirs if checkpoint_problem(p, full=False) is None]
    if not intact:
        return
    oldest_kept = checkpoint_step(intact[-max(1, keep_last):][0])
    for old in dirs:
        if checkpoint_step(old) < oldest_kept and checkpoint_step(old) not in keep:
            delete_checkpoint(old)


def delete_checkpoint(folder: Path) -> None:
    """Rename ``folder`` to ``.deleting-checkpoint-<step>`` (one atomic step), then remove it. A kill while its
    files are removed one by one leaves that hidden name, which nothing takes for a checkpoint (not anyfit's
    resume or export, not other tools that look for ``checkpoint-<step>``), never a ``checkpoint-<step>`` that
    lacks some of its files; the next prune or run removes it (``runfolder.remove_leftovers``). A folder that
    cannot be renamed (permissions) is left whole."""
    hidden = folder.with_name(f"{DELETING_CHECKPOINT_PREFIX}{checkpoint_step(folder)}")
    shutil.rmtree(hidden, ignore_errors=True)
    try:
        folder.rename(hidden)
    except OSError:
        return
    shutil.rmtree(hidden, ignore_errors=True)


def load_checkpoint(backend: Backend, accelerator, directory: Path, state: TrainState) -> dict[str, Any]:
    """Restore everything a checkpoint holds into ``state`` (its tokenizer aside); returns its trainer state.
    A file that cannot be read is a ConfigError naming it (resolve_resume has normally caught it already).
    The model and optimizer states are read by the backend that wrote them, into ``backend``'s layout
    (``anyfit.backends.load_states``). The optimizer's hyperparameters and the learning rate are this run's
    config's (``follow_config``)."""
    groups = state.scheduler.optimizer.param_groups  # the groups the update reads, as this run's config built them
    configured = [{k: v for k, v in group.items() if k != "params"} for group in groups]
    load_states(backend, accelerator, state.model, state.optimizer, directory)
    follow_config(state.scheduler, torch_load(directory / SCHEDULER), configured)
    scaler = getattr(accelerator, "scaler", None)
    if scaler is not None and (directory / "scaler.pt").is_file():
        scaler.load_state_dict(torch_load(directory / "scaler.pt"))
    rng_file = directory / f"rng_state_{accelerator.process_index}.pt"
    if rng_file.is_file():  # absent when resuming with more processes than saved: those start from the seed
        set_rng_state(torch_load(rng_file))
    try:
        return json.loads((directory / STATE).read_text())
    except (OSError, UnicodeDecodeError, ValueError) as e:
        raise damaged(directory / STATE, e) from e


def follow_config(scheduler, saved: dict[str, Any], configured: list[dict[str, Any]]) -> None:
    """After a checkpoint's optimizer state is loaded, its parameter groups hold the hyperparameters of the run
    that wrote it (torch restores a group's lr, betas, eps and weight decay with its moments) and its scheduler
    state the old peak learning rates (LambdaLR's ``base_lrs``): resumed as saved, a changed learning rate would
    be ignored in silence. This run's config decides them instead: the groups get the hyperparameters it built
    them with, and the learning rate is its schedule at the resumed step (``lr_lambdas`` are this run's, built
    with its length and warm-up). Unchanged, every value is the saved one to the bit: the same product LambdaLR
    computes."""
    groups = scheduler.optimizer.param_groups
    for group, mine in zip(groups, configured):
        group.update({k: v for k, v in mine.items() if k != "lr"})  # initial_lr: the configured peak
    bases = [group["initial_lr"] for group in groups]
    lrs = [base * fn(saved["last_epoch"]) for base, fn in zip(bases, scheduler.lr_lambdas)]
    for group, lr in zip(groups, lrs):
        group["lr"] = lr
    scheduler.load_state_dict({**saved, "base_lrs": bases, "_last_lr": lrs})


def set_rng_state(state: dict[str, Any]) -> None:
    random.setstate(state["python"])
    np.random.set_state(state["numpy"])
    torch.set_rng_state(state["torch"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])

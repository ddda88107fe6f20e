"""The training loop: ``train(cfg)`` sets a run up (``set_up``), then ``run_steps`` runs it, each read top to bottom.

Setup asks the module that owns each part: the runtime policy (``hardware.runtime``), the backend that spreads
the run over its processes (``anyfit.backends``, chosen once and never branched on), where the run starts
(``training.checkpoints.start``), the data and held-out sets (``data.prepare``), the model and optimizer (the backend,
``training.optim``), the micro-batch (``training.autofit``) and the run folder (``training.run_record``).

Per optimizer step: take this process's micro-batches of the step's accumulation window, run forward
and backward on each (gradients reduced as the backend does), scale so the update is the mean over every
trainable token of the whole window on all processes, let the backend clip and step unless non-finite, log,
evaluate, then checkpoint (``training.checkpoints.checkpoint.Checkpointer``, at its own cadence) or stop.
"""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass, field
from pathlib import Path

import torch
from torch.profiler import record_function
from tqdm.auto import tqdm

from anyfit.backends import Backend, choose_backend, choose_sequence_parallel
from anyfit.backends.sequence import SequenceSplit, split_attention
from anyfit.config import Config
from anyfit.data.batching import (
    BatchPlan,
    StepStream,
    WindowBatches,
    WindowSampler,
    collate,
)
from anyfit.data.prepare import TrainingData, data_fingerprint, prepare_training_data
from anyfit.data.source_names import loss_sources
from anyfit.hardware.runtime import RuntimePolicy, make_accelerator, resolve_runtime
from anyfit.model.tokenizer import load_tokenizer
from anyfit.model.moe import adapter_in_experts, router_balance_of
from anyfit.model.shape import shape_from_config
from anyfit.model.source import ModelSource
from anyfit.profiling.flops import DevicePeak, ModelFlops, device_peak
from anyfit.profiling.session import ProfiledRun, profiled
from anyfit.runfolder import METRICS, RunLock
from anyfit.training.autofit import auto_micro_batch, backward_with_retry
from anyfit.training.checkpoints.checkpoint import Checkpointer, TrainState, load_checkpoint, save_final_model
from anyfit.training.divergence import NonFiniteGuard, TrainingDiverged, diagnosis
from anyfit.training.forgetting import watch_base
from anyfit.training.checkpoints.integrity import complete_checkpoints
from anyfit.training.interruption import StopOnSignal
from anyfit.training.loss import token_loss_sum
from anyfit.training.metrics import (
    MetricsLog,
    StepMeter,
    finish_failed_trackers,
    finish_trackers,
    requested_trackers,
    start_trackers,
)
from anyfit.training.packing_check import choose_packing
from anyfit.training.optim import build_optimizer, build_scheduler, check_optimizer
from anyfit.training.run_record import (
    describe_run,
    record_held_per_process,
    start_run_dir,
)
from anyfit.training.plot import plot_run
from anyfit.training.report import write_report
from anyfit.training.checkpoints.best import Best
from anyfit.training.checkpoints.changes import check_data, resume_lines, resume_record
from anyfit.training.checkpoints.start import where_to_start
from anyfit.training.validation import InTrainingEval


@dataclass
class TrainResult:
    output_dir: Path
    steps: int
    losses: list[float] = field(default_factory=list)
    model: torch.nn.Module | None = None  # the trained model, unwrapped (e.g. to generate right away)
    tokenizer: object = None
    evals: list[dict] = field(default_factory=list)  # validation loss / generation accuracy records
    interrupted: str | None = None  # the signal that stopped the run early (a checkpoint was written)
    skipped_steps: int = 0  # updates skipped for a non-finite loss or gradient


@dataclass
class Run:
    """Everything a set-up run is made of, built by ``set_up`` and stepped through by ``run_steps``."""

    cfg: Config
    policy: RuntimePolicy
    backend: Backend
    accelerator: object
    state: TrainState  # model, optimizer, scheduler (as the backend wrapped them) and tokenizer: what checkpoints hold
    # the model as loaded: the same module under the backend's wrapper (its config, result); not Accelerate's
    # unwrap_model, which imports DeepSpeed (and mlflow through it: 2 s) wherever DeepSpeed is installed
    bare: torch.nn.Module
    data: TrainingData
    stream: StepStream
    evaluator: InTrainingEval
    loss_fn: object
    out: Path
    steps: int
    start: int = 0
    skipped_before: int = 0
    best_before: dict | None = None  # train.keep_best's record in the resumed checkpoint
    loaded: int = 0  # parameter elements this process read from the weights (none on the meta device)
    flops: ModelFlops | None = None  # model FLOPs of a window (for MFU; anyfit.profiling.flops)
    peak: DevicePeak | None = None  # one device's dense peak, what MFU is measured against
    split: SequenceSplit = SequenceSplit()  # runtime.sequence_parallel: this process's part of each sequence


def total_steps(cfg: Config, sampler: WindowSampler, say=print) -> int:
    """Optimizer steps of the run (``train.max_steps``, else epochs); says how many examples each epoch skips."""
    dropped_tail = len(sampler.lengths) - sampler.steps_per_epoch * sampler.plan.effective_batch
    if dropped_tail:
        say(f"[anyfit] {dropped_tail} examples per epoch do not fill a last effective batch and are skipped "
            "in that epoch (a different shuffle each epoch).")
    if cfg.train.max_steps > 0:
        return cfg.train.max_steps
    return max(1, math.ceil(cfg.train.epochs * sampler.steps_per_epoch))


def train(cfg: Config, policy: RuntimePolicy | None = None, echo=print, loss_fn=None) -> TrainResult:
    """Train as ``cfg`` says; ``loss_fn(model, batch)`` (summed token loss) replaces the default for tests. Under a
    launcher the process group outlives the call: ``anyfit.hardware.runtime.end_process_group()`` ends it (the CLI
    does, after the run)."""
    policy = policy or resolve_runtime(cfg.runtime, qlora=cfg.lora.qlora)
    trackers = requested_trackers(cfg.train.report_to)
    accelerator = make_accelerator(policy, cfg.runtime.compile, trackers, str(Path(cfg.train.output_dir) / "logs"))
    # one run per folder: the main process holds its lock until the run ends, so a second run started on the same
    # folder stops at once instead of writing its checkpoints between this one's
    with RunLock(Path(cfg.train.output_dir), enabled=accelerator.is_main_process):
        say = echo if accelerator.is_main_process else (lambda *a, **k: None)
        run = set_up(cfg, policy, accelerator, say, loss_fn)
        try:
            start_trackers(accelerator, trackers, run.out.resolve().name, cfg.to_dict())
            return run_steps(run, say)  # closes the trackers at its end
        except BaseException as error:
            finish_failed_trackers(accelerator, error)
            raise


def set_up(cfg: Config, policy: RuntimePolicy, accelerator, say, loss_fn) -> Run:
    """Every part of the run, each from the module that owns it (see the module docstring), restored from the
    checkpoint it continues; the run folder started."""
    from accelerate.utils import set_seed

    # runtime.sequence_parallel: groups of N processes share each sequence; the groups split the window's data
    degree, split_reason = choose_sequence_parallel(cfg, accelerator.num_processes)
    split = SequenceSplit.of(degree, accelerator.process_index, accelerator.num_processes)
    plan = BatchPlan.from_config(cfg.train, split.data_size)
    backend = choose_backend(cfg, policy, accelerator.num_processes, plan.micro_batch, plan.accumulation)
    check_optimizer(cfg.train.optimizer, policy.device, backend.sharded)
    start = where_to_start(cfg, backend, accelerator, say)  # fresh, resumed or restarted, and whether it may
    resume_from, out = start.resume_from, start.out
    say(f"[anyfit] runtime: {policy.describe()}\n  - {backend.reason}"
        + (f"\n  - {split_reason}" if split_reason else ""))
    say(f"[anyfit] batch: effective batch {plan.effective_batch}, micro-batch auto (measured once the model is "
        f"loaded)" if cfg.train.micro_batch == "auto" else f"[anyfit] batch: {plan.describe()}")
    set_seed(cfg.train.seed)
    loss_fn = split.loss(loss_fn or functools.partial(token_loss_sum, chunk_tokens=cfg.train.loss_chunk_tokens))

    # data: one process per machine tokenizes into the token store (or finds it), every process maps it and
    # draws the same windows
    ModelSource.from_config(cfg.model).check_weights()  # a broken model folder is one line before any data work
    tokenizer = load_tokenizer(cfg.model)
    data = prepare_training_data(cfg, tokenizer, say)
    say(f"[anyfit] data: {data.report.summary()}")
    drawn = data_fingerprint(data.examples)  # what the windows read: each checkpoint keeps it, a resume compares
    data_note = resume_from and check_data(resume_from, drawn, cfg.train.resume_changed_data)  # before the model
    if data.eval_report:
        say(f"[anyfit] eval data: {data.eval_report.summary()}")
    sampler = WindowSampler.of(data.examples, plan, split.data_rank, cfg.train.seed)
    steps = total_steps(cfg, sampler, say)

    # the backend loads (and shards) the model, then wraps it with the optimizer it updates with
    loaded = backend.load(cfg, policy, accelerator, resume_from, say)
    optimizer = backend.optimizer(build_optimizer(loaded.model, cfg.train, policy.device,
                                                  cfg.runtime.fused_optimizer, backend.sharded), cfg, policy.device)
    scheduler = build_scheduler(optimizer, cfg.train, steps)  # on the optimizer whose groups the update reads
    model, optimizer = backend.wrap(loaded.model, optimizer, accelerator, say)
    packing = None
    if cfg.train.packing:  # packed rows only where they give what one example at a time gives (training.packing_check)
        packing = choose_packing(model, data.examples, tokenizer.pad_token_id, cfg.data.max_length,
                                 accelerator.device, policy.compute_dtype, accelerator.autocast,
                                 check=cfg.train.packing_check)
        say(f"[anyfit] {packing.line}")
    collate_fn = functools.partial(collate, pad_id=tokenizer.pad_token_id, packed=bool(packing and packing.packed))
    if split.active:  # after the self-test, which runs whole sequences on every process
        split_attention(loaded.model, split.degree)
        say(f"[anyfit] sequence parallel: each sequence split over {split.degree} processes (DeepSpeed Ulysses), "
            f"{split.data_size} data-parallel group(s)")
    model.train()
    flops = ModelFlops.of(shape_from_config(loaded.model.config.get_text_config()),
                          loaded.trainable if cfg.lora.enabled or cfg.lora.qlora else 0,
                          adapter_in_experts(loaded.model))  # LoRA on fused MoE experts (ModelShape.lora_flops)
    peak = device_peak(policy.device, policy.precision)
    base = watch_base(cfg, backend, accelerator, model, loaded, data, tokenizer, collate_fn, loss_fn, split, start, say)
    if cfg.train.micro_batch == "auto":
        plan = sampler.plan = auto_micro_batch(backend, accelerator, model, data.examples, plan, collate_fn, base.loss,
                                               device=policy.device, memory_fraction=cfg.runtime.memory_fraction,
                                               trainable_params=loaded.trainable, echo=say, lockstep=split.active)
    stream = StepStream(WindowBatches(sampler, data.examples, collate_fn), steps, policy.num_workers,
                        policy.pin_memory)
    run = Run(cfg=cfg, policy=policy, backend=backend, accelerator=accelerator,
              state=TrainState(model=model, optimizer=optimizer, scheduler=scheduler, tokenizer=tokenizer, data=drawn),
              bare=loaded.model, data=data, stream=stream,
              evaluator=InTrainingEval(cfg, data, tokenizer, collate_fn, loss_fn, split, base.watch), loss_fn=base.loss,
              out=out, steps=steps, loaded=loaded.read, flops=flops, peak=peak, split=split)
    accelerator.wait_for_everyone()  # every process has checked the folder before the main one fills it
    if resume_from is not None:
        saved = load_checkpoint(backend, accelerator, resume_from, run.state)
        run.start, run.skipped_before = saved["step"], saved.get("skipped_steps", 0)
        run.best_before = saved.get("best")
        for line in resume_lines(resume_from, run.start, steps, start.changes, data_note):
            say(line)
    if accelerator.is_main_process:
        start_run_dir(out, run.start if resume_from else None, cfg.to_yaml(),
                      describe_run(cfg, policy, backend, plan, steps, data.report, loaded, accelerator.num_processes)
                      | {"mfu": peak.as_dict(), **base.record()} | ({"packing": packing.as_dict()} if packing else {}),
                      resume=resume_from and resume_record(resume_from, run.start, start.changes, data_note))
    return run


def run_steps(run: Run, say=print) -> TrainResult:
    """The loop: from ``run.start`` to ``run.steps``, or to a stop signal; then the checkpoint or final model.

    Kept whole: the training loop is meant to be read top to bottom (window, backward, guarded
    step, metrics, evaluation, checkpoint, stop); each of those is a small tested function it calls.
    """
    cfg, acc, model, optimizer = run.cfg, run.accelerator, run.state.model, run.state.optimizer
    result = TrainResult(run.out, run.steps)
    log = MetricsLog(run.out / METRICS, enabled=acc.is_main_process, accelerator=acc)
    guard = NonFiniteGuard(cfg.train.max_nonfinite_steps, skipped=run.skipped_before)
    sources = loss_sources(run.data.examples)  # data.mix: each source's loss is logged as well
    meter = StepMeter(acc.device, run.peak.flops_per_s if run.peak else 0.0, router=router_balance_of(model),
                      sources=sources)
    sampler = run.stream.batches.sampler
    steps_per_epoch = sampler.steps_per_epoch
    max_norm = cfg.train.max_grad_norm if cfg.train.max_grad_norm > 0 else float("inf")
    bar = tqdm(total=run.steps, initial=run.start, disable=not acc.is_main_process, desc="train", dynamic_ncols=True)

    def evaluate(done: int) -> None:
        loss, generate = run.evaluator.due(done, run.steps)
        if not (loss or generate):
            return
        record = run.evaluator.run(run.backend, acc, model, done, run.stream.plan.micro_batch, loss, generate)
        if record:
            log.write(record)
            result.evals.append(record)
            say(f"[anyfit] eval at step {done}: " + ", ".join(f"{k}={v}" for k, v in record.items() if k != "step"))
            checkpoints.saw(record)  # train.keep_best: a better value makes this step's checkpoint due

    checkpoints = Checkpointer(run.backend, acc, run.out, cfg, state=run.state, guard=guard, total_steps=run.steps,
                               steps_per_epoch=steps_per_epoch, best=Best.of(cfg.train.keep_best, run.best_before),
                               say=say)
    if run.start == 0:
        evaluate(0)
    done = run.start
    watched = ProfiledRun(cfg=cfg, policy=run.policy, accelerator=acc, model=model, bare=run.bare,
                          optimizer=optimizer, sampler=sampler, report=run.data.report, out=run.out, start=run.start,
                          sharded=run.backend.sharded, flops=run.flops, peak=run.peak)
    with StopOnSignal() as stop, profiled(watched, say) as profiler:  # runtime.profile: a no-op unless set
        for step in range(run.start, run.steps):
            window = backward_with_retry(run.backend, acc, model, optimizer, run.stream, step, run.loss_fn,
                                         run.policy.device, say)
            with record_function("anyfit.optimizer"):  # clip, step unless non-finite (the backend's update)
                grad_norm, finite = run.backend.update(acc, model, optimizer, window.loss_sum, max_norm,
                                                       run.policy.precision)
                run.state.scheduler.step()
                optimizer.zero_grad(set_to_none=True)
            done = step + 1
            guard.add(finite)
            # a sequence-parallel group shares its examples: one of its processes counts their tokens and FLOPs
            counts = run.split.counts()
            real = counts * sum(len(run.data.examples[i]["input_ids"]) for idx in window.indices for i in idx)
            flops = (run.flops.of_window(sampler.lengths, sampler.trainable, window.indices)
                     if run.flops and counts else 0.0)
            by_source = ((window.by_source, run.data.examples.trained_by_source(sampler.examples_of(step)))
                         if sources else None)  # data.mix, data.source_column: each source's sum and tokens
            meter.add(window.loss_sum, finite, window.trainable_tokens, real_tokens=real, flops=flops,
                      by_source=by_source)
            bar.update(1)
            log_now = done % cfg.train.log_every == 0 or done == run.steps
            if log_now:
                guard.flush()  # deferred on-device flags are read here, once per logged step
            if guard.exhausted:
                kept = complete_checkpoints(run.out)  # listed, not verified: nothing may hide the diagnosis
                raise TrainingDiverged(diagnosis(cfg, run.policy, done, str(kept[-1]) if kept else None))
            if log_now:
                record = meter.line(acc, run.policy.device, step=done, lr=float(run.state.scheduler.get_last_lr()[0]),
                                    grad_norm=round(float(grad_norm), 6), epoch=round(step / steps_per_epoch, 4),
                                    skipped_steps=guard.skipped, micro_batch=run.stream.plan.micro_batch)
                log.write(record)
                result.losses.append(record["loss"])
                bar.set_postfix(loss=f"{record['loss']:.4f}", tok_s=f"{record['tokens_per_s']:.0f}",
                                **({"mfu": f"{record['mfu']:.1%}"} if "mfu" in record else {}))
            evaluate(done)
            # Several processes agree on a stop with a collective (a host sync): only on logged steps.
            if (acc.num_processes == 1 or log_now) and stop.requested(acc) and done < run.steps:
                result.interrupted = stop.signal_name or "signal"
                break
            checkpoints.save(done)  # when train.save_every says
            profiler.step()
    bar.close()
    guard.flush()
    result.skipped_steps = guard.skipped
    record_held_per_process(run.out, acc, model, optimizer, run.loaded)
    if guard.skipped:
        say(f"[anyfit] {guard.skipped} update(s) were skipped for a non-finite loss or gradient.")
    if result.interrupted:
        path = checkpoints.save(done, last=True)
        say(f"[anyfit] {result.interrupted} received: saved {path} after step {done}. "
            f"Continue with: anyfit train <config> train.output_dir={run.out} train.resume=auto")
    elif cfg.train.save_final:  # the final model: loadable by transformers (or PEFT for an adapter)
        stops = save_final_model(run.backend, acc, model, run.state.tokenizer, run.out, cfg.model)
        acc.wait_for_everyone()
        say(f"[anyfit] saved the final {'adapter' if cfg.lora.enabled else 'model'} to {run.out}")
        if stops:
            say(f"[anyfit] generation stops at {', '.join(stops)} (generation_config.json)")
        best = checkpoints.final_saved()  # train.keep_best: best.json now names a model that exists
        if best:
            say(best)
    if acc.is_main_process and result.losses + result.evals:
        try:
            say(f"[anyfit] curves: {plot_run(run.out)}")
        except OSError as e:  # a full disk after the model was saved: the run is complete, only the picture is not
            say(f"[anyfit] warning: loss.png was not written ({e.strerror or e}); draw it later with anyfit plot "
                f"{run.out}")
    if acc.is_main_process:
        try:
            say(f"[anyfit] report: {write_report(run.out)}")
        except Exception as e:  # noqa: BLE001 - the run is complete, only its page is not: never a failed run for it
            say(f"[anyfit] warning: the run's report was not written ({e}); write it later with anyfit report "
                f"{run.out}")
    # every process ends together: one that tears its process group down while the main one still writes the
    # profile's report was once aborted by gloo at exit (terminate called without an active exception)
    acc.wait_for_everyone()
    finish_trackers(acc)  # the process group stays: the caller destroys it after the model (end_process_group)
    result.model, result.tokenizer = run.bare, run.state.tokenizer
    return result

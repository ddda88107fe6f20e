"""The training loop: ``train(cfg)`` sets a run up (``set_up``), then ``run_steps`` runs it, each read top to bottom.

Setup asks the module that owns each part and keeps it in one record (``training.parts.Parts``): the runtime policy
(``hardware.runtime``), the backend that spreads the run over its processes (``anyfit.backends``, chosen once and
never branched on), where the run starts (``training.checkpoints.start``), the data and held-out sets
(``data.prepare``), the model and optimizer (the backend, ``training.optim``), the start-up checks on the real model
(``start_up_checks``: the packing self-test, then the training forward against generate's cached decoding), the
micro-batch (``training.autofit``) and the run folder (``training.run_record``).

Per optimizer step: take this process's micro-batches of the step's accumulation window, run forward
and backward on each (gradients reduced as the backend does), scale so the update is the mean over every
trainable token of the whole window on all processes, let the backend clip and step unless non-finite; then the
features (``FEATURES``: the metrics line, evaluation, ...) each see the step (``training.hooks``), and the loop
checkpoints (``training.checkpoints.checkpoint.Checkpointer``, at its own cadence) or stops.
"""

from __future__ import annotations

import functools
import math
from pathlib import Path

from torch.profiler import record_function

from anyfit.backends import choose_backend, choose_sequence_parallel
from anyfit.backends.sequence import SequenceSplit, split_attention
from anyfit.config import Config
from anyfit.data.batching import BatchPlan, StepStream, WindowBatches, WindowSampler, collate
from anyfit.data.image_batches import ImageBatches
from anyfit.data.image_tokens import ImageTokens
from anyfit.data.prepare import data_fingerprint, prepare_training_data
from anyfit.hardware.runtime import RuntimePolicy, make_accelerator, resolve_runtime
from anyfit.model.processor import load_processor
from anyfit.model.tokenizer import load_tokenizer
from anyfit.model.expert_lora import splits_in
from anyfit.model.moe import adapter_in_experts
from anyfit.model.shape import shape_from_config
from anyfit.model.source import ModelSource
from anyfit.profiling.flops import ModelFlops, device_peak
from anyfit.profiling.session import ProfiledRun, profiled
from anyfit.runfolder import METRICS, RunLock
from anyfit.training.autofit import auto_micro_batch, backward_with_retry
from anyfit.training.checkpoints.best import Best
from anyfit.training.checkpoints.changes import check_data, resume_lines, resume_record
from anyfit.training.checkpoints.checkpoint import Checkpointer, TrainState, load_checkpoint
from anyfit.training.checkpoints.integrity import complete_checkpoints
from anyfit.training.checkpoints.start import where_to_start
from anyfit.training.divergence import NonFiniteGuard, TrainingDiverged, diagnosis
from anyfit.training.evaluation_hook import Evaluation
from anyfit.training.forgetting import watch_base
from anyfit.training.hooks import Loop, RunEnd, StepDone
from anyfit.training.inference_check import InferenceVerdict, check_inference
from anyfit.training.interruption import StopOnSignal
from anyfit.training.loss import token_loss_sum
from anyfit.training.metrics import MetricsLog, finish_failed_trackers, requested_trackers, start_trackers
from anyfit.training.optim import build_optimizer, build_scheduler, check_optimizer
from anyfit.training.packing_check import PackingVerdict, choose_packing
from anyfit.training.parts import Parts
from anyfit.training.run import Run, TrainResult
from anyfit.training.run_end import Curves, FinalModel, HeldPerProcess, Report, Trackers
from anyfit.training.run_record import describe_run, start_run_dir
from anyfit.training.step_metrics import StepMetrics
from anyfit.training.validation import InTrainingEval

__all__ = ["FEATURES", "Run", "TrainResult", "run_steps", "set_up", "train"]

# The loop's features, called in this order before the first step, after each step and at the end
# (``training.hooks``). A new one is a module with a Hook subclass and one entry here.
FEATURES = (StepMetrics, Evaluation, HeldPerProcess, FinalModel, Curves, Report, Trackers)


def total_steps(cfg: Config, sampler: WindowSampler, say=print) -> int:
    """Optimizer steps of the run (``train.max_steps``, else epochs); says how many examples each epoch skips."""
    dropped_tail = len(sampler.lengths) - sampler.steps_per_epoch * sampler.plan.effective_batch
    if dropped_tail:
        say(f"[anyfit] {dropped_tail} examples per epoch do not fill a last effective batch and are skipped "
            "in that epoch (a different shuffle each epoch).")
    if cfg.train.max_steps > 0:
        return cfg.train.max_steps
    return max(1, math.ceil(cfg.train.epochs * sampler.steps_per_epoch))


def start_up_checks(parts: Parts, examples) -> tuple[PackingVerdict | None, InferenceVerdict]:
    """Before step 1, on the real model: the packing self-test decides how micro-batches are laid out
    (``parts.collate``), then the training forward, laid out so, is checked against generate's cached decoding."""
    cfg, policy, acc, pad_id = parts.cfg, parts.policy, parts.accelerator, parts.tokenizer.pad_token_id
    packing = None
    images = ImageBatches(parts.images) if getattr(parts.images, "processor", None) else None  # the batch workers'
    rows = functools.partial(collate, pad_id=pad_id, images=images)
    if cfg.train.packing:  # packed rows only where they give what one example at a time gives (training.packing_check)
        packing = choose_packing(parts.model, examples, rows, cfg.data.max_length, acc.device, policy.compute_dtype,
                                 acc.autocast, check=cfg.train.packing_check)
        parts.say(f"[anyfit] {packing.line}")
    parts.collate = functools.partial(rows, packed=bool(packing and packing.packed),
                                      positions=packing.positions if packing else True)
    inference = check_inference(parts.model, examples=examples, collate=parts.collate, pad_id=pad_id,
                                device=acc.device, compute_dtype=policy.compute_dtype, autocast=acc.autocast,
                                mode=cfg.train.inference_check)  # training.inference_check
    parts.say(f"[anyfit] {inference.line}")
    return packing, inference


def train(cfg: Config, policy: RuntimePolicy | None = None, echo=print, loss_fn=None) -> TrainResult:
    """Train as ``cfg`` says; ``loss_fn(model, batch)`` (summed token loss) replaces the default for tests. Under a
    launcher the process group outlives the call: ``anyfit.hardware.runtime.end_process_group()`` ends it (the CLI
    does, after the run)."""
    policy = policy or resolve_runtime(cfg.runtime, qlora=cfg.lora.qlora)
    trackers = requested_trackers(cfg.train.report_to)
    accelerator = make_accelerator(policy, cfg.runtime.compile, trackers, str(Path(cfg.train.output_dir) / "logs"),
                                   # a tower or projector that trains gets no gradient from a batch of text records
                                   unused_parameters=cfg.model.train_vision != "frozen" or cfg.model.train_projector)
    # one run per folder: the main process holds its lock until the run ends, so a second run started on the same
    # folder stops at once instead of writing its checkpoints between this one's
    with RunLock(Path(cfg.train.output_dir), enabled=accelerator.is_main_process):
        say = echo if accelerator.is_main_process else (lambda *a, **k: None)
        run = set_up(cfg, policy, accelerator, say, loss_fn)
        try:
            start_trackers(accelerator, trackers, run.out.resolve().name, cfg.to_dict())
            return run_steps(run)  # closes the trackers at its end
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
    parts = Parts(cfg, policy, backend, accelerator, split, say)
    check_optimizer(cfg.train.optimizer, policy.device, backend.sharded)
    start = where_to_start(cfg, backend, accelerator, say)  # fresh, resumed or restarted, and whether it may
    resume_from, parts.out = start.resume_from, start.out
    say(f"[anyfit] runtime: {policy.describe()}\n  - {backend.reason}"
        + (f"\n  - {split_reason}" if split_reason else ""))
    say(f"[anyfit] batch: effective batch {plan.effective_batch}, micro-batch auto (measured once the model is "
        f"loaded)" if cfg.train.micro_batch == "auto" else f"[anyfit] batch: {plan.describe()}")
    set_seed(cfg.train.seed)
    parts.loss_fn = split.loss(loss_fn or functools.partial(token_loss_sum, chunk_tokens=cfg.train.loss_chunk_tokens))

    # data: one process per machine tokenizes into the token store (or finds it), every process maps it and
    # draws the same windows
    ModelSource.from_config(cfg.model).check_weights()  # a broken model folder is one line before any data work
    parts.tokenizer = load_tokenizer(cfg.model)
    parts.images = ImageTokens(*load_processor(cfg.model, parts.tokenizer))  # a vision-language model's, else why none
    data = parts.data = prepare_training_data(cfg, parts.tokenizer, say, parts.images)
    say(f"[anyfit] data: {data.report.summary()}")
    drawn = data_fingerprint(data.examples)  # what the windows read: each checkpoint keeps it, a resume compares
    data_note = resume_from and check_data(resume_from, drawn, cfg.train.resume_changed_data)  # before the model
    if data.eval_report:
        say(f"[anyfit] eval data: {data.eval_report.summary()}")
    sampler = WindowSampler.of(data.examples, plan, split.data_rank, cfg.train.seed)
    steps = total_steps(cfg, sampler, say)

    # the backend loads (and shards) the model, then wraps it with the optimizer it updates with
    loaded = parts.loaded = backend.load(cfg, policy, accelerator, resume_from, say)
    optimizer = backend.optimizer(build_optimizer(loaded.model, cfg.train, policy.device,
                                                  cfg.runtime.fused_optimizer, backend.sharded), cfg, policy.device)
    scheduler = build_scheduler(optimizer, cfg.train, steps)  # on the optimizer whose groups the update reads
    parts.model, optimizer = backend.wrap(loaded.model, optimizer, accelerator, say)
    packing, inference = start_up_checks(parts, data.examples)
    if split.active:  # after the start-up checks, which run whole sequences on every process
        split_attention(loaded.model, split.degree)
        say(f"[anyfit] sequence parallel: each sequence split over {split.degree} processes (DeepSpeed Ulysses), "
            f"{split.data_size} data-parallel group(s)")
    parts.model.train()
    flops = ModelFlops.of(shape_from_config(loaded.model.config),
                          loaded.trainable if cfg.lora.enabled or cfg.lora.qlora else 0,
                          adapter_in_experts(loaded.model),  # LoRA on fused MoE experts (ModelShape.lora_flops)
                          splits_in(loaded.model))
    peak = device_peak(policy.device, policy.precision)
    base = watch_base(parts, resumed=resume_from is not None)
    parts.train_loss = base.loss
    if cfg.train.micro_batch == "auto":
        plan = sampler.plan = auto_micro_batch(parts, plan)
    stream = StepStream(WindowBatches(sampler, data.examples, parts.collate), steps, policy.num_workers,
                        policy.pin_memory)
    run = Run(parts, TrainState(model=parts.model, optimizer=optimizer, scheduler=scheduler, tokenizer=parts.tokenizer,
                                data=drawn, unloaded=loaded.unloaded),
              stream, InTrainingEval(parts, base.watch), steps, flops=flops, peak=peak)
    accelerator.wait_for_everyone()  # every process has checked the folder before the main one fills it
    if resume_from is not None:
        saved = load_checkpoint(backend, accelerator, resume_from, run.state)
        run.start, run.skipped_before = saved["step"], saved.get("skipped_steps", 0)
        run.best_before = saved.get("best")
        for line in resume_lines(resume_from, run.start, steps, start.changes, data_note):
            say(line)
    if accelerator.is_main_process:
        start_run_dir(parts.out, run.start if resume_from else None, cfg.to_yaml(),
                      describe_run(cfg, policy, backend, plan, steps, data.report, loaded,
                                   accelerator.num_processes)
                      | {"mfu": peak.as_dict(), **base.record(), "inference_check": inference.as_dict()}
                      | ({"packing": packing.as_dict()} if packing else {}),
                      resume=resume_from and resume_record(resume_from, run.start, start.changes, data_note))
    return run


def run_steps(run: Run) -> TrainResult:
    """The loop: from ``run.start`` to ``run.steps``, or to a stop signal; each step's features, then theirs at the
    end (the final model, the report, ...).

    Kept whole: the training loop is meant to be read top to bottom (window, backward, guarded step, the features,
    stop, checkpoint); each of those is a small tested function or ``Hook`` it calls.
    """
    parts, state = run.parts, run.state
    acc, cfg, model, optimizer = parts.accelerator, parts.cfg, state.model, state.optimizer
    guard = NonFiniteGuard(cfg.train.max_nonfinite_steps, skipped=run.skipped_before)
    checkpoints = Checkpointer(parts, state=state, guard=guard, total_steps=run.steps,
                               steps_per_epoch=run.stream.batches.sampler.steps_per_epoch,
                               best=Best.of(cfg.train.keep_best, run.best_before))
    loop = Loop(run, TrainResult(run.out, run.steps), MetricsLog(run.out / METRICS, enabled=acc.is_main_process,
                                                                 accelerator=acc), guard, checkpoints)
    features = [feature(loop) for feature in FEATURES]
    for feature in features:
        feature.start()
    max_norm = cfg.train.max_grad_norm if cfg.train.max_grad_norm > 0 else float("inf")
    done = run.start
    with StopOnSignal() as stop, profiled(profiled_run(run), parts.say) as profiler:  # runtime.profile, else no-op
        for step in range(run.start, run.steps):
            window = backward_with_retry(parts, optimizer, run.stream, step)
            with record_function("anyfit.optimizer"):  # clip, step unless non-finite (the backend's update)
                grad_norm, finite = parts.backend.update(acc, model, optimizer, window.loss_sum, max_norm,
                                                         parts.policy.precision)
                state.scheduler.step()
                optimizer.zero_grad(set_to_none=True)
            done = step + 1
            guard.add(finite)
            log_now = done % cfg.train.log_every == 0 or done == run.steps
            if log_now:
                guard.flush()  # deferred on-device flags are read here, once per logged step
            if guard.exhausted:
                kept = complete_checkpoints(run.out)  # listed, not verified: nothing may hide the diagnosis
                raise TrainingDiverged(diagnosis(cfg, parts.policy, done, str(kept[-1]) if kept else None))
            step_done = StepDone(done, window, grad_norm, finite, log_now)
            for feature in features:
                feature.after_step(step_done)
            # Several processes agree on a stop with a collective (a host sync): only on logged steps.
            if (acc.num_processes == 1 or log_now) and stop.requested(acc) and done < run.steps:
                loop.result.interrupted = stop.signal_name or "signal"
                break
            checkpoints.save(done)  # when train.save_every says
            profiler.step()
    for feature in features:
        feature.at_end(RunEnd(done, loop.result.interrupted))
    loop.result.model, loop.result.tokenizer = parts.bare, state.tokenizer
    return loop.result


def profiled_run(run: Run) -> ProfiledRun:
    """What ``runtime.profile`` reads of the run (``anyfit.profiling`` sits below training and cannot read ``Run``)."""
    parts = run.parts
    return ProfiledRun(cfg=parts.cfg, policy=parts.policy, accelerator=parts.accelerator, model=run.state.model,
                       bare=parts.bare, optimizer=run.state.optimizer, sampler=run.stream.batches.sampler,
                       report=parts.data.report, out=run.out, start=run.start, sharded=parts.backend.sharded,
                       flops=run.flops, peak=run.peak)

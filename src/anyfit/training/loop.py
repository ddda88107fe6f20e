"""The training loop: one function, read top to bottom.

Per optimizer step: take this process's micro-batches of the step's accumulation window, run forward
and backward on each (gradients are all-reduced only on the last one), scale so the update is the mean
over every trainable token of the whole window on all processes, clip, step, log, checkpoint.
"""

from __future__ import annotations

import contextlib
import functools
import json
import math
import shutil
import time
from dataclasses import dataclass, field
from pathlib import Path

import torch
from tqdm.auto import tqdm

from anyfit.training.autofit import free_memory, halve_micro_batch, is_oom, probe_micro_batch
from anyfit.data.batching import BatchPlan, WindowBatches, WindowSampler, collate, to_device, window_loader
from anyfit.training.checkpoint import PREFIX, TMP_PREFIX, load_checkpoint, resolve_resume, save_checkpoint, save_model
from anyfit.config import Config, ConfigError
from anyfit.data.sources import load_records
from anyfit.training.divergence import NonFiniteGuard, TrainingDiverged, diagnosis
from anyfit.training.interruption import StopOnSignal
from anyfit.training.loss import token_loss_sum
from anyfit.training.metrics import MetricsLog, peak_memory_gib
from anyfit.model.loading import count_parameters, load_model, load_tokenizer
from anyfit.training.optim import build_optimizer, build_scheduler
from anyfit.training.validation import split_eval_records, validation_loss
from anyfit.hardware.runtime import RuntimePolicy, apply_policy, resolve_runtime, versions
from anyfit.data.tokenization import tokenize_dataset


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


def backward_window(accelerator, model, micro_batches: list[dict[str, torch.Tensor]], window_tokens: int,
                    loss_fn=token_loss_sum) -> torch.Tensor:
    """Forward and backward over one accumulation window; returns this process's summed token loss (detached).

    Each micro-batch's summed loss is divided by the trainable tokens of the *global* window and
    multiplied by the process count (DDP averages gradients over processes), so the accumulated gradient
    is d(mean token loss over the window) whatever the split into micro-batches and processes.
    """
    scale = accelerator.num_processes / max(1, window_tokens)
    total = torch.zeros((), device=accelerator.device)
    for i, batch in enumerate(micro_batches):
        last = i == len(micro_batches) - 1
        # Skip the gradient all-reduce on all but the last micro-step: gradients just accumulate locally.
        sync = contextlib.nullcontext() if last else accelerator.no_sync(model)
        with sync:
            loss_sum = loss_fn(model, batch)
            accelerator.backward(loss_sum * scale)
        total += loss_sum.detach()
    return total


def compile_plugin(enabled: bool):
    """Accelerate's torch.compile settings: inductor with dynamic shapes (packed rows change length every step)."""
    from accelerate.utils import TorchDynamoPlugin

    return TorchDynamoPlugin(backend="inductor", dynamic=True) if enabled else None


def check_output_dir(cfg: Config, resuming: bool) -> Path:
    """Refuse to mix two runs in one folder unless asked to overwrite or resume (checked before heavy work)."""
    out = Path(cfg.train.output_dir)
    if out.exists() and not resuming:
        previous = [p for p in ("config.yaml", "metrics.jsonl") if (out / p).exists()]
        previous += [p.name for p in out.glob(f"{PREFIX}*")]
        if previous and not cfg.train.overwrite:
            raise ConfigError(f"train.output_dir {out} already holds a run ({', '.join(sorted(previous)[:4])}). "
                              "Choose another train.output_dir, or pass train.overwrite=true to replace it.")
    return out


def create_output_dir(out: Path) -> None:
    """Clear what a previous run left (only reached when overwriting is allowed) and create the folder."""
    for p in [*out.glob(f"{PREFIX}*"), *out.glob(f"{TMP_PREFIX}*")]:
        shutil.rmtree(p)
    (out / "metrics.jsonl").unlink(missing_ok=True)
    out.mkdir(parents=True, exist_ok=True)


def trim_metrics(path: Path, last_step: int) -> None:
    """Keep only metric lines up to ``last_step`` (a resumed run logs the later steps again)."""
    if path.is_file():
        keep = [line for line in path.read_text().splitlines() if line and json.loads(line)["step"] <= last_step]
        path.write_text("".join(line + "\n" for line in keep))


def total_steps(cfg: Config, steps_per_epoch: int) -> int:
    if cfg.train.max_steps > 0:
        return cfg.train.max_steps
    return max(1, math.ceil(cfg.train.epochs * steps_per_epoch))


def train(cfg: Config, policy: RuntimePolicy | None = None, echo=print, loss_fn=None) -> TrainResult:
    """Train as ``cfg`` says; ``loss_fn(model, batch)`` (summed token loss) replaces the default for tests."""
    from accelerate import Accelerator
    from accelerate.utils import set_seed

    # --- runtime: device, precision and processes, decided once -----------------------------------
    policy = policy or resolve_runtime(cfg.runtime, qlora=cfg.lora.qlora)
    apply_policy(policy)
    accelerator = Accelerator(cpu=policy.device == "cpu", mixed_precision=policy.mixed_precision,
                              dynamo_plugin=compile_plugin(cfg.runtime.compile))
    main = accelerator.is_main_process
    say = echo if main else (lambda *a, **k: None)
    plan = BatchPlan.from_config(cfg.train, accelerator.num_processes)
    resume_from = resolve_resume(cfg.train.resume, Path(cfg.train.output_dir))
    out = check_output_dir(cfg, resuming=resume_from is not None)
    say(f"[anyfit] runtime: {policy.describe()}")
    say(f"[anyfit] batch: effective batch {plan.effective_batch}, micro-batch auto (measured once the model is loaded)"
        if cfg.train.micro_batch == "auto" else f"[anyfit] batch: {plan.describe()}")
    set_seed(cfg.train.seed)

    loss_fn = loss_fn or functools.partial(token_loss_sum, chunk_tokens=cfg.train.loss_chunk_tokens)

    # --- data: every process tokenizes the same examples and draws the same windows ---------------
    tokenizer = load_tokenizer(cfg.model)
    collate_fn = functools.partial(collate, pad_id=tokenizer.pad_token_id, packed=cfg.train.packing)
    train_records, eval_records = split_eval_records(cfg, load_records(cfg.data))
    examples, report = tokenize_dataset(train_records, tokenizer, cfg.data)
    say(f"[anyfit] data: {report.summary()}")
    eval_examples, gen_examples = [], []
    if eval_records:
        from anyfit.data.formats import to_examples

        eval_examples, eval_report = tokenize_dataset(eval_records, tokenizer, cfg.data)
        if cfg.eval.generate_before or cfg.eval.generate_every or cfg.eval.generate_at_end:
            from anyfit.evaluation.evaluate import example_gold

            # Checked now, not after hours of training: generation accuracy needs gold answers.
            gen_examples = [e for e in to_examples(eval_records, cfg.data) if example_gold(e) is not None]
            if not gen_examples:
                raise ConfigError("eval.generate_* is on but no held-out record has a gold answer: map an answer "
                                  "column with data.fields: {answer: ...}, or use solutions ending in \\boxed{...} "
                                  "or '#### N'.")
            gen_examples = gen_examples[:cfg.eval.num_generate]
        say(f"[anyfit] eval data: {eval_report.summary()}")
    sampler = WindowSampler([len(e["input_ids"]) for e in examples],
                            [sum(1 for t in e["labels"] if t != -100) for e in examples],
                            plan, accelerator.process_index, cfg.train.seed)
    if sampler.steps_per_epoch == 0:
        raise ConfigError(f"Only {len(examples)} examples are left after filtering, fewer than one effective batch "
                          f"(train.effective_batch={cfg.train.effective_batch}); lower it or add data.")
    steps = total_steps(cfg, sampler.steps_per_epoch)
    dropped_tail = len(examples) - sampler.steps_per_epoch * plan.effective_batch
    if dropped_tail:
        say(f"[anyfit] {dropped_tail} examples per epoch do not fill a last effective batch and are skipped "
            "in that epoch (a different shuffle each epoch).")

    # --- model and optimizer ---------------------------------------------------------------------------
    model = load_model(cfg, policy, accelerator.local_process_index)
    trainable, total = count_parameters(model)
    say(f"[anyfit] model: {total / 1e6:.1f}M parameters, {trainable / 1e6:.2f}M trainable "
        f"({'LoRA' if cfg.lora.enabled or cfg.lora.qlora else 'full fine-tuning'})")
    optimizer = build_optimizer(model, cfg.train, policy.device, cfg.runtime.fused_optimizer)
    scheduler = build_scheduler(optimizer, cfg.train, steps)
    model, optimizer = accelerator.prepare(model, optimizer)
    model.train()
    if cfg.train.micro_batch == "auto":
        # Measured, not guessed: forward+backward on the longest sequences at growing micro-batch sizes.
        # No gradient all-reduce during the probe, and the RNG is left as it was (resume stays exact).
        rng_devices = [torch.cuda.current_device()] if policy.device == "cuda" else []
        with accelerator.no_sync(model), torch.random.fork_rng(devices=rng_devices):
            micro = probe_micro_batch(model, examples, plan, collate_fn, loss_fn, policy.device,
                                      cfg.runtime.memory_fraction, optimizer_bytes=8 * trainable, echo=say)
        micro = int(accelerator.gather(torch.tensor([micro], device=accelerator.device)).min())  # all agree
        plan = sampler.plan = plan.with_micro_batch(micro)
        say(f"[anyfit] micro_batch=auto chose {micro}: {plan.describe()}")

    config_yaml = cfg.to_yaml()
    accelerator.wait_for_everyone()  # every process has checked the folder before the main one fills it
    start, skipped_before = 0, 0
    if resume_from is not None:
        state = load_checkpoint(accelerator, resume_from, model, optimizer, scheduler)
        start, skipped_before = state["step"], state.get("skipped_steps", 0)
        say(f"[anyfit] resumed from {resume_from} at step {start} of {steps}")
    if main:
        if resume_from is None:
            create_output_dir(out)
        else:  # lines logged after the checkpoint belong to steps that are about to be redone
            trim_metrics(out / "metrics.jsonl", start)
        (out / "config.yaml").write_text(config_yaml)
        (out / "run_info.json").write_text(json.dumps({
            "policy": {"device": policy.device, "precision": policy.precision, "tf32": policy.tf32,
                       "reasons": list(policy.reasons)},
            "batch": plan.__dict__, "steps": steps, "data": report.__dict__, "versions": versions(),
            "parameters": {"trainable": trainable, "total": total}}, indent=2, default=str))
    log = MetricsLog(out / "metrics.jsonl", enabled=main)
    max_norm = cfg.train.max_grad_norm if cfg.train.max_grad_norm > 0 else float("inf")

    # --- the loop -----------------------------------------------------------------------------------------
    result = TrainResult(out, steps)
    guard = NonFiniteGuard(cfg.train.max_nonfinite_steps)
    guard.skipped = skipped_before
    # Fused AdamW can skip a non-finite update on the device (its found_inf input, the GradScaler protocol),
    # so the loop never waits for the GPU to learn whether a step was finite; other optimizers need a sync.
    skip_on_device = policy.precision != "fp16" and bool(optimizer.optimizer.defaults.get("fused"))
    bar = tqdm(total=steps, initial=start, disable=not main, desc="train", dynamic_ncols=True)
    zero = functools.partial(torch.zeros, (), device=accelerator.device)
    real_tokens, loss_since_log, tokens_since_log = zero(), zero(), zero(dtype=torch.long)
    t_log = time.perf_counter()
    workers = cfg.runtime.num_workers if cfg.runtime.num_workers != "auto" else (2 if policy.device == "cuda" else 0)
    windows = WindowBatches(sampler, examples, collate_fn)
    loader = iter(window_loader(windows, start, steps, workers, pin_memory=policy.device == "cuda"))

    def checkpoint(done: int) -> Path:
        guard.flush()
        return save_checkpoint(accelerator, out, done, model, optimizer, scheduler, tokenizer, config_yaml,
                               {"epoch": (done - 1) // sampler.steps_per_epoch, "total_steps": steps,
                                "skipped_steps": guard.skipped}, cfg.train.keep_last)

    def evaluate_now(done: int, loss: bool, generate: bool) -> None:
        """Validation loss (all processes) and generation accuracy (main process, others wait), logged."""
        record: dict = {"step": done}
        if loss and eval_examples:
            record["val_loss"] = round(validation_loss(accelerator, model, eval_examples, plan.micro_batch,
                                                       collate_fn, loss_fn), 6)
        if generate and gen_examples:
            if main:
                from anyfit.evaluation.evaluate import generation_eval

                summary = generation_eval(accelerator.unwrap_model(model), tokenizer, gen_examples, cfg.data,
                                          cfg.eval.max_new_tokens, cfg.eval.batch_size)
                record.update({f"gen_{k}": summary[k] for k in ("accuracy", "format_rate", "fallback_rate",
                                                                "mean_completion_tokens", "tokens_per_second", "n")})
            accelerator.wait_for_everyone()
        if len(record) > 1:
            log.write(record)
            result.evals.append(record)
            say(f"[anyfit] eval at step {done}: " + ", ".join(f"{k}={v}" for k, v in record.items() if k != "step"))

    if cfg.eval.generate_before and start == 0:
        evaluate_now(0, loss=cfg.eval.every > 0, generate=True)

    with StopOnSignal() as stop:
        for step in range(start, steps):
            indices, window_tokens, cpu_batches = next(loader)  # the position in the data is the step number
            loss_sum = None
            while loss_sum is None:  # repeated only after an out-of-memory error, with smaller micro-batches
                batches = [to_device(b, accelerator.device, non_blocking=True) for b in cpu_batches]
                try:
                    loss_sum = backward_window(accelerator, model, batches, window_tokens, loss_fn)
                except Exception as e:  # noqa: BLE001 - only out-of-memory is handled
                    if not is_oom(e):
                        raise
                    del batches
                    optimizer.zero_grad(set_to_none=True)  # drop the partial window: the step is redone whole
                    free_memory(policy.device)
                    plan = sampler.plan = halve_micro_batch(plan, accelerator.num_processes, e)
                    say(f"[anyfit] out of memory at step {step + 1}: retrying the step with {plan.describe()}")
                    loader = iter(window_loader(windows, step, steps, workers, pin_memory=policy.device == "cuda"))
                    indices, window_tokens, cpu_batches = next(loader)
            grad_norm = accelerator.clip_grad_norm_(model.parameters(), max_norm)
            # A non-finite loss or gradient norm skips the update (fp16 overflow is the scaler's job, not a failure).
            finite = torch.isfinite(loss_sum) if policy.precision == "fp16" else \
                torch.isfinite(loss_sum) & torch.isfinite(grad_norm)
            if skip_on_device:
                optimizer.optimizer.found_inf = (~finite).float()
                optimizer.step()
                del optimizer.optimizer.found_inf
                guard.defer(finite)
            else:
                finite = bool(finite)
                guard.record(finite)
                if finite:
                    optimizer.step()
            scheduler.step()
            optimizer.zero_grad(set_to_none=True)
            done = step + 1
            loss_since_log += torch.where(torch.as_tensor(finite, device=accelerator.device), loss_sum, 0.0)
            tokens_since_log += torch.as_tensor(finite, device=accelerator.device) * window_tokens
            real_tokens += sum(len(examples[i]["input_ids"]) for idx in indices for i in idx)  # host ints: no sync
            bar.update(1)
            log_now = done % cfg.train.log_every == 0 or done == steps
            if log_now:
                guard.flush()  # deferred checks are read here, once per logged step
            if guard.exhausted:
                last = resolve_resume("auto", out)
                raise TrainingDiverged(diagnosis(cfg, policy, done, str(last) if last else None))
            if log_now:
                # One collective per logged step: the loss sum and real-token count of all processes.
                loss_total, tokens_total = accelerator.reduce(torch.stack([loss_since_log, real_tokens]),
                                                              reduction="sum").tolist()
                elapsed = time.perf_counter() - t_log  # after the sync above: the device work is included
                trained = int(tokens_since_log)
                loss = loss_total / trained if trained else float("nan")
                record = {"step": done, "loss": round(loss, 6), "lr": scheduler.get_last_lr()[0],
                          "grad_norm": round(float(grad_norm), 6), "tokens_per_s": round(tokens_total / elapsed, 1),
                          "real_tokens": int(tokens_total), "trainable_tokens": trained,
                          "peak_mem_gib": round(peak_memory_gib(policy.device), 3),
                          "epoch": round(step / sampler.steps_per_epoch, 4), "skipped_steps": guard.skipped,
                          "micro_batch": plan.micro_batch}
                log.write(record)
                result.losses.append(loss)
                bar.set_postfix(loss=f"{loss:.4f}", lr=f"{record['lr']:.2e}", tok_s=f"{record['tokens_per_s']:.0f}")
                loss_since_log.zero_()
                real_tokens.zero_()
                tokens_since_log.zero_()
                t_log = time.perf_counter()
            eval_loss_now = cfg.eval.every and (done % cfg.eval.every == 0 or done == steps)
            eval_gen_now = (cfg.eval.generate_every and done % cfg.eval.generate_every == 0) or \
                (cfg.eval.generate_at_end and done == steps)
            if eval_loss_now or eval_gen_now:
                evaluate_now(done, loss=bool(eval_loss_now), generate=bool(eval_gen_now))
            # Several processes agree on a stop with a collective (a host sync): only on logged steps.
            if (accelerator.num_processes == 1 or log_now) and stop.requested(accelerator) and done < steps:
                path = checkpoint(done)
                bar.close()
                say(f"[anyfit] {stop.signal_name or 'a stop signal'} received: saved {path} after step {done}. "
                    f"Continue with: anyfit train <config> train.output_dir={out} train.resume=auto")
                result.interrupted = stop.signal_name or "signal"
                result.skipped_steps = guard.skipped
                return result
            if cfg.train.save_every and done % cfg.train.save_every == 0 and done < steps:
                checkpoint(done)
    bar.close()
    guard.flush()
    result.skipped_steps = guard.skipped
    if guard.skipped:
        say(f"[anyfit] {guard.skipped} update(s) were skipped for a non-finite loss or gradient.")

    # --- the final model: loadable by transformers (or PEFT for an adapter) ----------------------------
    save_model(accelerator, model, tokenizer, out)
    accelerator.wait_for_everyone()
    say(f"[anyfit] saved the final {'adapter' if cfg.lora.enabled else 'model'} to {out}")
    accelerator.end_training()
    result.model = accelerator.unwrap_model(model)
    result.tokenizer = tokenizer
    return result

"""What a run leaves at its end, as loop features in the order the loop calls them: what each process held, the
final model (or, after a stop signal, the checkpoint to continue from), the loss curves, the report page, and the
trackers closed once every process is done."""

from __future__ import annotations

from anyfit.training.checkpoints.checkpoint import save_final_model
from anyfit.training.hooks import Hook, RunEnd
from anyfit.training.metrics import finish_trackers
from anyfit.training.plot import plot_run
from anyfit.training.report import write_report
from anyfit.training.run_record import record_held_per_process


class HeldPerProcess(Hook):
    """``run_info.json``: the parameter and optimizer-state elements each process held (collective)."""

    def at_end(self, end: RunEnd) -> None:
        run = self.loop.run
        record_held_per_process(run.out, run.parts.accelerator, run.state.model, run.state.optimizer,
                                run.parts.loaded.read)


class FinalModel(Hook):
    """The final model, loadable by transformers (or PEFT for an adapter), unless ``train.save_final=false``; after
    a stop signal the checkpoint to continue from instead."""

    def at_end(self, end: RunEnd) -> None:
        run, checkpoints = self.loop.run, self.loop.checkpoints
        parts, say = run.parts, run.parts.say
        if end.interrupted:
            path = checkpoints.save(end.done, last=True)
            say(f"[anyfit] {end.interrupted} received: saved {path} after step {end.done}. "
                f"Continue with: anyfit train <config> train.output_dir={run.out} train.resume=auto")
            return
        if not parts.cfg.train.save_final:
            return
        stops = save_final_model(parts.backend, parts.accelerator, run.state.model, run.state.tokenizer, run.out,
                                 parts.cfg.model, run.state.unloaded)
        parts.accelerator.wait_for_everyone()
        say(f"[anyfit] saved the final {'adapter' if parts.cfg.lora.enabled else 'model'} to {run.out}")
        if stops:
            say(f"[anyfit] generation stops at {', '.join(stops)} (generation_config.json)")
        best = checkpoints.final_saved()  # train.keep_best: best.json now names a model that exists
        if best:
            say(best)


class Curves(Hook):
    """``loss.png`` (main process), when anything was logged."""

    def at_end(self, end: RunEnd) -> None:
        run, result = self.loop.run, self.loop.result
        if not (run.parts.accelerator.is_main_process and result.losses + result.evals):
            return
        try:
            run.parts.say(f"[anyfit] curves: {plot_run(run.out)}")
        except OSError as e:  # a full disk after the model was saved: the run is complete, only the picture is not
            run.parts.say(f"[anyfit] warning: loss.png was not written ({e.strerror or e}); draw it later with "
                          f"anyfit plot {run.out}")


class Report(Hook):
    """``report.html`` (main process)."""

    def at_end(self, end: RunEnd) -> None:
        run = self.loop.run
        if not run.parts.accelerator.is_main_process:
            return
        try:
            run.parts.say(f"[anyfit] report: {write_report(run.out)}")
        except Exception as e:  # noqa: BLE001 - the run is complete, only its page is not: never a failed run for it
            run.parts.say(f"[anyfit] warning: the run's report was not written ({e}); write it later with anyfit "
                          f"report {run.out}")


class Trackers(Hook):
    """The experiment trackers closed, once every process is done."""

    def at_end(self, end: RunEnd) -> None:
        accelerator = self.loop.run.parts.accelerator
        # every process ends together: one that tears its process group down while the main one still writes the
        # profile's report was once aborted by gloo at exit (terminate called without an active exception)
        accelerator.wait_for_everyone()
        finish_trackers(accelerator)  # the process group stays: the caller destroys it after the model

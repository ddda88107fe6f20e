"""Evaluation as a loop feature: the validation loss, base_kl (``training.forgetting``) and generation accuracy when
``eval.*`` says (``training.validation.InTrainingEval``); each line logged, kept in the result, printed, and shown
to ``train.keep_best``."""

from __future__ import annotations

from anyfit.training.hooks import Hook, StepDone


class Evaluation(Hook):
    """The 'before' evaluation of a fresh run, then one after every step it is due."""

    def start(self) -> None:
        if self.loop.run.start == 0:
            self.evaluate(0)

    def after_step(self, step: StepDone) -> None:
        self.evaluate(step.done)

    def evaluate(self, done: int) -> None:
        run = self.loop.run
        loss, generate = run.evaluator.due(done, run.steps)
        if not (loss or generate):
            return
        record = run.evaluator.run(done, run.stream.plan.micro_batch, loss, generate)
        if record:
            self.loop.log.write(record)
            self.loop.result.evals.append(record)
            run.parts.say(f"[anyfit] eval at step {done}: "
                          + ", ".join(f"{k}={v:.4g}" if isinstance(v, float) else f"{k}={v}"
                                      for k, v in record.items() if k != "step"))
            self.loop.checkpoints.saw(record)  # train.keep_best: a better value makes this step's checkpoint due

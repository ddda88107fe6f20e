"""Which machine a launch rents: ``--gpu auto`` takes the cheapest machine of the provider's offer on which the
planner (``anyfit plan``'s ``plan_target``) says the config fits as it is, for the whole run (or per 100 steps
when the run's length is unknown); ``--gpu NAME`` is planned alone and refused in one line with the plan's reason
when the config does not fit there as it is.

"Fits as it is": the plan's verdict is ``fits`` (the micro-batch may be chosen, as ``train.micro_batch=auto``
chooses it on the machine). A plan that needs a saver the config does not turn on (checkpointing, 8-bit states,
LoRA, ...) is not taken silently: the launch ships the config that passed locally, so the refusal names the
settings to add (they change the run: the user decides).
"""

from __future__ import annotations

import difflib
import math
from dataclasses import dataclass, replace

from anyfit.config import Config, ConfigError
from anyfit.launch.machines import Machine, offer, price_note
from anyfit.model.shape import ModelShape
from anyfit.planning.ladder import TargetPlan, plan_target
from anyfit.planning.savers import config_overrides
from anyfit.planning.time import duration_text


@dataclass(frozen=True)
class Choice:
    """The machine chosen and its plan; ``steps``: the run's optimizer steps (None: unknown)."""

    machine: Machine
    plan: TargetPlan
    steps: int | None

    @property
    def seconds(self) -> float | None:
        if self.steps is None or self.plan.seconds_per_100_steps is None:
            return None
        return self.steps * self.plan.seconds_per_100_steps / 100

    @property
    def cost(self) -> float | None:
        """The whole run's cost; HF Jobs bill whole minutes (so a short run costs at least one minute)."""
        if self.seconds is None or self.plan.price_per_hour is None:
            return None
        seconds = 60 * math.ceil(self.seconds / 60) if self.machine.provider == "hf-jobs" else self.seconds
        return self.plan.price_per_hour * seconds / 3600

    def lines(self) -> list[str]:
        """What is printed before anything is spent."""
        p, s = self.plan, self.plan.setup
        run = (f"; whole run ({self.steps:,} steps): {duration_text(self.seconds)}, ${self.cost:,.2f}"
               if self.cost is not None else "; whole run: unknown length (set train.max_steps, data.num_samples or "
               "pass --examples N)")
        return [f"machine: {self.machine.name} ({p.target.label()}, {p.target.memory_gib:.0f} GiB per GPU, "
                f"${p.price_per_hour:.2f}/h)",
                f"plan: {p.verdict}; micro-batch {s.micro_batch} x accumulation {s.accumulation} x {s.processes} "
                f"process{'es' if s.processes > 1 else ''}, {s.precision}, peak {p.memory.peak / 2**30:.1f} of "
                f"{p.budget_bytes / 2**30:.1f} GiB per GPU",
                f"time and cost: {duration_text(p.seconds_per_100_steps)} and ${p.cost_per_100_steps:.2f} per 100 steps"
                + run,
                price_note(self.machine.provider)]


def run_steps(cfg: Config, plan: TargetPlan) -> int | None:
    """The run's optimizer steps: train.max_steps, else epochs x the plan's steps per epoch (None: unknown)."""
    if cfg.train.max_steps > 0:
        return cfg.train.max_steps
    if plan.steps_per_epoch is None:
        return None
    return int(cfg.train.epochs * plan.steps_per_epoch)


def fits_as_is(plan: TargetPlan) -> bool:
    return plan.setup is not None and plan.verdict == "fits"


def _changes(cfg: Config, plan: TargetPlan) -> list[str]:
    """The plan's settings (``key=value``) that differ from the config's."""
    out = []
    for item in config_overrides(plan.setup):
        key, value = item.split("=", 1)
        section, name = key.split(".", 1)
        have = getattr(getattr(cfg, section), name, None)
        if str(have).lower() != value.lower() and key != "train.micro_batch":  # the micro-batch is chosen there
            out.append(item)
    return out


def _why_not(cfg: Config, plan: TargetPlan) -> str:
    """The plan's reason a machine does not take the config as it is, with the settings that would make it."""
    if plan.setup is None:
        return f"{plan.verdict} ({'; '.join(plan.notes[-1:]) or 'nothing fits'})"
    return (f"the config {plan.verdict} there (add {' '.join(_changes(cfg, plan))} to the command, or pick a "
            "larger machine)")


def _price(machine: Machine, price_per_hour: float | None) -> Machine:
    if price_per_hour is None:
        return machine
    return replace(machine, target=replace(machine.target, price_per_hour=price_per_hour))


def choose_machine(cfg: Config, shape: ModelShape, provider: str, gpu: str = "auto", gpus: int | None = None,
                   examples: int | None = None, price_per_hour: float | None = None) -> Choice:
    """The machine to rent for ``cfg`` on ``provider`` and its plan, or ``ConfigError`` (one line) when none
    takes the config as it is. ``gpus``: only machines with that many GPUs."""
    machines = offer(provider)
    if gpu != "auto":
        names = {m.name.lower(): m for m in machines}
        key = gpu.lower() if provider == "hf-jobs" or ":" in gpu else f"{gpu.lower()}:{gpus or 1}"
        if key not in names:
            close = difflib.get_close_matches(key, list(names), n=1)
            hint = f" Did you mean '{names[close[0]].name}'?" if close else ""
            listed = ", ".join(dict.fromkeys(m.name.split(":")[0] for m in machines))
            raise ConfigError(f"--gpu {gpu}: not a machine of {provider}.{hint} Its machines: {listed}; or --gpu auto.")
        machines = [names[key]]
    if gpus is not None:
        machines = [m for m in machines if m.gpus == gpus]
        if not machines:
            raise ConfigError(f"--gpus {gpus}: {provider} has no such machine"
                              + (f" of --gpu {gpu}" if gpu != "auto" else "") + ".")
    # the micro-batch the run will use: the config's, or the largest that fits where it says auto
    micro = None if cfg.train.micro_batch == "auto" else cfg.train.micro_batch
    plans = [(m, plan_target(cfg, shape, _price(m, price_per_hour).target, examples=examples, micro_batch=micro))
             for m in machines]
    fitting = [(m, p) for m, p in plans if fits_as_is(p)]
    if gpu != "auto" and not fitting:
        m, p = plans[0]
        raise ConfigError(f"--gpu {m.name}: {_why_not(cfg, p)}.")
    if not fitting:
        best = min(plans, key=lambda mp: (mp[1].setup is None, mp[1].cost_per_100_steps or 0.0))
        raise ConfigError(f"No {provider} machine takes this config as it is; the cheapest plan, on "
                          f"{best[0].name}: {_why_not(cfg, best[1])}.")
    choices = [Choice(m, p, run_steps(cfg, p)) for m, p in fitting]
    return min(choices, key=lambda c: (c.cost if c.cost is not None else c.plan.cost_per_100_steps,
                                       c.plan.price_per_hour, c.machine.gpus))

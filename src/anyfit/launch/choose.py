"""Which machine a launch rents: ``--gpu auto`` takes the cheapest machine of the provider's offer on which the
planner (``anyfit plan``'s ``plan_target``) fits the config at the memory savers it chooses there, for the whole run
(or per 100 steps when the run's length is unknown); ``--gpu NAME`` is planned alone and checked the same way,
refused in one line with the plan's reason.

The savers the plan chooses (checkpointing, 8-bit AdamW, FSDP sharding or CPU offload over the machine's GPUs,
sequence parallelism, activation offload, tiled MLP, fused loss) keep the method and its data, so the launch takes
them: they are shipped as overrides of the resolved config (``Choice.applied``, printed in the spec), since
``anyfit train`` applies only its own ``auto`` settings (``train.micro_batch``, ``runtime.sharding``,
``runtime.sequence_parallel``) by itself, and those it keeps deciding on the machine. A plan that changes what is
trained (LoRA or QLoRA for a full fine-tune, Adafactor for AdamW) or needs more GPUs than the machine has is not
taken: the refusal names the settings (they change the run: the user decides).
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
from anyfit.planning.setup import Workload
from anyfit.planning.time import duration_text


@dataclass(frozen=True)
class Choice:
    """The machine chosen and its plan; ``steps``: the run's optimizer steps (None: unknown)."""

    machine: Machine
    plan: TargetPlan
    steps: int | None
    applied: tuple[str, ...] = ()  # the plan's savers the config does not have, as key=value overrides

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
                *([f"applied: {' '.join(self.applied)} (the plan's memory savers, shipped as overrides of the "
                   "resolved config)"] if self.applied else []),
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


def method(cfg: Config) -> str:
    return "qlora" if cfg.lora.qlora else ("lora" if cfg.lora.enabled else "full")


def differences(cfg: Config, plan: TargetPlan) -> list[str]:
    """The plan's settings (``key=value``, ``anyfit plan``'s ``config_overrides``) that differ from the config's,
    less what the run decides itself on the machine: the micro-batch, and ``runtime.sharding`` /
    ``runtime.sequence_parallel`` left at ``auto`` where the plan does not turn them on (the run asks the same
    planner, ``anyfit.planning.recommend``); a DeepSpeed config keeps DeepSpeed (the plan counts it as FSDP2)."""
    out = []
    for item in config_overrides(plan.setup):
        key, value = item.split("=", 1)
        have = cfg.value(key)
        if key == "train.micro_batch" or (have == "auto" and value in ("none", "1")):
            continue
        if cfg.runtime.sharding == "deepspeed" and key in ("runtime.sharding", "runtime.fsdp_offload"):
            continue
        if str(have).lower() != value.lower():
            out.append(item)
    return out


def why_not(cfg: Config, plan: TargetPlan, machine: Machine) -> str:
    """Why a launch does not take ``plan`` on ``machine`` ('' when it does): nothing fits, the plan changes what
    is trained (another method, Adafactor), or it needs more GPUs of this kind than the machine has."""
    if plan.setup is None:
        return f"{plan.verdict} ({'; '.join(plan.notes[-1:]) or 'nothing fits'})"
    s = plan.setup
    if s.processes > machine.gpus:
        return (f"the config {plan.verdict} there: {s.processes} GPUs of this kind (pick a machine with them, "
                "or a larger GPU)")
    if s.method != method(cfg) or (s.optimizer == "adafactor" and cfg.train.optimizer != "adafactor"):
        return (f"the config {plan.verdict} there (add {' '.join(differences(cfg, plan))} to the command, or pick "
                "a larger machine)")
    return ""


def _price(machine: Machine, price_per_hour: float | None) -> Machine:
    if price_per_hour is None:
        return machine
    return replace(machine, target=replace(machine.target, price_per_hour=price_per_hour))


def choose_machine(cfg: Config, shape: ModelShape, provider: str, gpu: str = "auto", gpus: int | None = None,
                   examples: int | None = None, price_per_hour: float | None = None) -> Choice:
    """The machine to rent for ``cfg`` on ``provider``, its plan and the savers to apply, or ``ConfigError`` (one
    line) when none takes the config (``why_not``). ``gpus``: only machines with that many GPUs."""
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
    workload = Workload.of(cfg, examples=examples)
    plans = [(m, plan_target(cfg, shape, _price(m, price_per_hour).target, workload, micro_batch=micro))
             for m in machines]
    fitting = [(m, p) for m, p in plans if not why_not(cfg, p, m)]
    if gpu != "auto" and not fitting:
        m, p = plans[0]
        raise ConfigError(f"--gpu {m.name}: {why_not(cfg, p, m)}.")
    if not fitting:
        best = min(plans, key=lambda mp: (mp[1].setup is None, mp[1].cost_per_100_steps or 0.0))
        raise ConfigError(f"No {provider} machine takes this config at the savers that keep its method; the "
                          f"cheapest plan, on {best[0].name}: {why_not(cfg, best[1], best[0])}.")
    choices = [Choice(m, p, run_steps(cfg, p), tuple(differences(cfg, p))) for m, p in fitting]
    return min(choices, key=lambda c: (c.cost if c.cost is not None else c.plan.cost_per_100_steps,
                                       c.plan.price_per_hour, c.machine.gpus))

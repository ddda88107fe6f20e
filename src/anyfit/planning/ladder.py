"""The plan for one machine: the run as configured, else the cheapest memory savers that make it fit (the saver
ladder: ``Planner`` tries the rows of ``anyfit.planning.savers`` in their tiers), and the planner
``anyfit.planning.recommend`` asks for ``runtime.sharding=auto`` and ``runtime.sequence_parallel=auto``."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any

from anyfit.config import Config, ConfigError
from anyfit.data.batching import choose_micro_batch
from anyfit.hardware.runtime import (
    BNB_CPU,
    EIGHT_BIT_OPTIMIZERS,
    bitsandbytes_cpu_problem,
    resolve_runtime,
    sequence_parallel_problem,
    sharding_refusal,
)
from anyfit.model.shape import ModelShape
from anyfit.planning.memory import MemoryEstimate, estimate_memory
from anyfit.planning.presets import PCIE4_GBS, Target
from anyfit.planning.savers import (
    SAVERS,
    Option,
    Trial,
    checkpoint_every,
    checkpointing,
    config_overrides,
    saver_words,
    verdict_for,
)
from anyfit.planning.setup import SAFETY, Setup, Workload, setup_for
from anyfit.planning.time import StepTime, duration_text, step_seconds, step_time
from anyfit.units import GIB


@dataclass(frozen=True)
class TargetPlan:
    """What the planner decided for one machine."""

    target: Target
    verdict: str
    setup: Setup | None  # the chosen way to run (None when nothing fits)
    memory: MemoryEstimate | None
    seconds_per_100_steps: float | None
    budget_bytes: int
    notes: tuple[str, ...] = ()
    alternatives: tuple[str, ...] = ()
    time: StepTime | None = None  # one optimizer step of the chosen setup
    steps_per_epoch: int | None = None  # None: the data size is unknown (--examples / data.num_samples)
    host_budget_bytes: int | None = None  # None: the target's host RAM is unknown (or is its device memory)

    @property
    def savers(self) -> list[str]:
        """The memory savers of the chosen setup (configured or added), in words."""
        return [] if self.setup is None else saver_words(self.setup)

    @property
    def price_per_hour(self) -> float | None:
        """The target's price, scaled to the GPUs the plan uses where it spreads over more than the target has."""
        if self.target.price_per_hour is None:
            return None
        processes = self.setup.processes if self.setup is not None else 1
        return self.target.price_per_hour * max(1.0, processes / self.target.num_devices)

    @property
    def cost_per_100_steps(self) -> float | None:
        if self.price_per_hour is None or self.seconds_per_100_steps is None:
            return None
        return self.price_per_hour * self.seconds_per_100_steps / 3600

    @property
    def seconds_per_epoch(self) -> float | None:
        if self.steps_per_epoch is None or self.seconds_per_100_steps is None:
            return None
        return self.steps_per_epoch * self.seconds_per_100_steps / 100

    @property
    def cost_per_epoch(self) -> float | None:
        if self.price_per_hour is None or self.seconds_per_epoch is None:
            return None
        return self.price_per_hour * self.seconds_per_epoch / 3600

    def as_dict(self) -> dict[str, Any]:
        s = self.setup

        def r(x, nd=1):
            return None if x is None else round(x, nd)

        return {
            "target": self.target.key, "name": self.target.label(), "device": self.target.device,
            "devices": self.target.num_devices, "memory_gib_per_device": round(self.target.memory_gib, 2),
            "budget_gib": round(self.budget_bytes / GIB, 2),
            "host_memory_gib": self.target.host_memory_gib,
            "host_budget_gib": None if self.host_budget_bytes is None else round(self.host_budget_bytes / GIB, 2),
            "interconnect_gbs": self.target.interconnect_gbs, "verdict": self.verdict, "savers": self.savers,
            "setup": None if s is None else {
                "method": s.method, "precision": s.precision, "weight_bytes": s.weight_bytes,
                "micro_batch": s.micro_batch, "accumulation": s.accumulation, "processes": s.processes,
                "seq_len": s.seq_len, "gradient_checkpointing": s.gradient_checkpointing,
                "checkpoint_every": s.checkpoint_every if s.gradient_checkpointing else None,
                "optimizer": s.optimizer, "fsdp": s.fsdp, "fsdp_offload": s.offload,
                "fsdp_reduce_every_micro_batch": s.reduces_every_micro_batch,
                "config": config_overrides(s)},
            "memory": None if self.memory is None else self.memory.as_dict(),
            "step_time": None if self.time is None else self.time.as_dict(),
            "seconds_per_100_steps": r(self.seconds_per_100_steps),
            "price_per_hour": self.price_per_hour, "cost_per_100_steps": r(self.cost_per_100_steps, 2),
            "steps_per_epoch": self.steps_per_epoch, "seconds_per_epoch": r(self.seconds_per_epoch),
            "cost_per_epoch": r(self.cost_per_epoch, 2),
            "notes": list(self.notes), "alternatives": list(self.alternatives),
        }


def _precision(cfg: Config, target: Target, qlora: bool) -> tuple[str, list[str]]:
    """The precision anyfit's runtime policy picks on the target (the configured one when it is allowed there)."""
    rc = dataclasses.replace(cfg.runtime, device=target.device)
    try:
        return resolve_runtime(rc, target.hardware(), qlora=qlora).precision, []
    except ConfigError:
        policy = resolve_runtime(dataclasses.replace(rc, precision="auto"), target.hardware(), qlora=qlora)
        return policy.precision, [f"runtime.precision={cfg.runtime.precision} is not allowed on {target.device}; "
                                  f"planned with {policy.precision}"]


def _processes(effective: int, devices: int) -> int:
    """Use as many devices as split the effective batch evenly."""
    return max(p for p in range(1, devices + 1) if effective % p == 0)


def _sharding_blocker(cfg: Config, precision: str, device: str, method: str, optimizer: str) -> str:
    """Why this run cannot be sharded on this device ('' when it can): the runtime policy's rule, which the
    training loop applies too, asked for ``method`` and the ``optimizer`` the ladder tries."""
    if method == "qlora":
        return "QLoRA's 4-bit weights are not sharded by anyfit"
    return sharding_refusal(dataclasses.replace(cfg, lora=dataclasses.replace(cfg.lora, qlora=False)), device,
                            precision, optimizer)


class Planner:
    """The ladder's state for one target: the budget, the configured run, and a cache of fits.

    Public for ``anyfit.planning.recommend``: ``configured(processes)``, ``fit(option)``, ``sp_degrees(processes)``,
    ``blocker(method)``, ``precision(method)``, and ``asked``: the config's saver values as the ladder plans them (an
    8-bit optimizer off CUDA planned as AdamW, DeepSpeed's ZeRO-3 as FSDP2's full shard)."""

    def __init__(self, cfg: Config, shape: ModelShape, target: Target, safety: float, overhead_gib: float | None,
                 workload: Workload, processes: int | None = None, micro_batch: int | None = None):
        self.cfg, self.shape, self.target = cfg, shape, target
        self.fixed_micro = micro_batch  # planned as given (``anyfit plan --micro-batch``), not the largest that fits
        self.overhead_gib = overhead_gib
        self.workload = workload  # what the time estimates compute on
        self.notes: list[str] = []
        self.effective = cfg.train.effective_batch
        self.seq = cfg.data.max_length
        self.cuda = target.device == "cuda"
        procs = processes if processes is not None else _processes(self.effective, target.num_devices)
        self.procs = procs
        # CPU processes share the host RAM: each may use its share.
        share = procs if target.device == "cpu" else 1
        self.budget = int(target.memory_gib * GIB * safety) // share
        self.host_budget = (int(target.host_memory_gib * GIB * safety)
                            if target.host_memory_gib is not None and self.cuda else None)
        self.host_short: dict[Option, int] = {}
        self._fits: dict[Option, tuple[Setup, MemoryEstimate] | None] = {}
        self._blockers: dict[tuple[str, str], str] = {}

        method = "qlora" if cfg.lora.qlora else ("lora" if cfg.lora.enabled else "full")
        self.instead = ""  # why a QLoRA config is planned as LoRA on this target
        if method == "qlora" and target.device == "mps":
            self.instead = "QLoRA does not run on MPS"
        elif method == "qlora" and target.device == "cpu" and (problem := bitsandbytes_cpu_problem()):
            self.instead = f"QLoRA on the CPU needs bitsandbytes>={'.'.join(map(str, BNB_CPU))}: {problem}"
        if self.instead:
            self.notes.append(f"{self.instead}; planned as LoRA here")
            method = "lora"
        self.method = method
        self.asked = {key: cfg.value(key) for saver in SAVERS for key in saver.keys}
        self.asked.update(checkpointing(checkpoint_every(self.asked)))  # without checkpointing: every 1, as options
        optimizer = self.asked["train.optimizer"]
        if optimizer in EIGHT_BIT_OPTIMIZERS and not self.cuda:
            self.notes.append(f"train.optimizer={optimizer} needs CUDA (bitsandbytes); planned with adamw here")
            self.asked["train.optimizer"] = "adamw"
        sharding = cfg.runtime.sharding
        if sharding == "deepspeed":
            # ZeRO-3 holds what FSDP2's full shard holds (1/N of weights, gradients and states, a layer gathered at
            # a time) and reduce-scatters every micro-batch; its offload keeps them in host RAM as FSDP2's does
            sharding = "offload" if cfg.runtime.deepspeed_offload and self.cuda else "fsdp"
            self.asked["runtime.fsdp_reduce_every_micro_batch"] = True
            self.notes.append("DeepSpeed ZeRO-3 planned as FSDP2's full shard (the same partitions"
                              + (", offloaded to host RAM)" if sharding == "offload" else ")"))
        elif cfg.runtime.fsdp_offload and sharding != "none" and self.cuda:
            sharding = "offload"
        elif cfg.runtime.fsdp_offload:
            self.notes.append("runtime.fsdp_offload needs CUDA and sharding; planned without it")
        self.sharding_mode = sharding  # auto | none | fsdp | offload
        self.asked["runtime.sharding"] = "fsdp" if sharding == "offload" else sharding
        self.asked["runtime.fsdp_offload"] = sharding == "offload"

    def precision(self, method: str) -> str:
        precision, notes = _precision(self.cfg, self.target, qlora=method == "qlora")
        for note in notes:
            if note not in self.notes:
                self.notes.append(note)
        return precision

    def blocker(self, method: str, optimizer: str | None = None) -> str:
        key = (method, optimizer or self.asked["train.optimizer"])
        if key not in self._blockers:
            self._blockers[key] = _sharding_blocker(self.cfg, self.precision(method), self.target.device, *key)
        return self._blockers[key]

    def _note(self, note: str) -> None:
        if note not in self.notes:
            self.notes.append(note)

    def configured(self, processes: int | None = None) -> Option:
        """The run exactly as configured (runtime.sharding=auto starts unsharded: it shards only when that
        does not fit, which is what the ladder decides)."""
        values = dict(self.asked)
        if values["runtime.sharding"] == "auto":
            values["runtime.sharding"] = "none"
        if values["runtime.sharding"] != "none" and self.blocker(self.method):
            self._note(f"runtime.sharding={self.cfg.runtime.sharding} is refused for this run: "
                       f"{self.blocker(self.method)}")
            values.update({"runtime.sharding": "none", "runtime.fsdp_offload": False})
        values["runtime.fsdp_reduce_every_micro_batch"] &= values["runtime.sharding"] != "none"
        processes = processes or self.procs
        sp = values["runtime.sequence_parallel"] if isinstance(values["runtime.sequence_parallel"], int) else 1
        if sp > 1 and (problem := self.sp_problem(processes, sp)):
            self._note(f"runtime.sequence_parallel={sp} is refused for this run: {problem}")
            sp = 1
        values["runtime.sequence_parallel"] = sp
        return Option.of(self.method, processes, values)

    def sp_problem(self, processes: int, degree: int) -> str:
        """Why ``processes`` cannot split each sequence ``degree`` ways ('' when they can): the loop's rule, and
        the batch: the effective batch must split over the data-parallel groups."""
        problem = sequence_parallel_problem(self.cfg, processes, self.shape.num_heads, self.shape.num_kv_heads,
                                            degree, state=self.shape.stateful)
        if not problem and self.effective % (processes // degree):
            problem = f"train.effective_batch={self.effective} does not split over {processes // degree} groups"
        return problem

    def sp_degrees(self, processes: int) -> list[int]:
        """The sequence-parallel degrees the ladder tries: the configured one, or with "auto" every one the
        processes, the heads and the batch allow (1 first)."""
        if isinstance(self.asked["runtime.sequence_parallel"], int):
            return [self.configured(processes)["runtime.sequence_parallel"]]
        return [1] + [d for d in range(2, processes + 1) if processes % d == 0 and not self.sp_problem(processes, d)]

    def options(self, method: str, rank: int, processes: int, shardings: tuple[str, ...] | None = None) -> list[Option]:
        """The saver combinations for ``method`` (``rank``: 0 the configured method, 1 LoRA, 2 QLoRA), every value
        each saver may take (``anyfit.planning.savers.SAVERS``, in its order) with every value of the ones after it;
        ``shardings``: the sharding modes to try (none | fsdp | offload; default: the config's)."""
        combos: list[dict[str, Any]] = [{}]
        for saver in SAVERS:
            combos = [{**chosen, **values} for chosen in combos
                      for values in saver.tries(self, Trial(method, processes, shardings, chosen))]

        def tier(values: dict[str, Any]) -> int:  # the costliest saver it adds (one the config names costs nothing)
            return max((t for saver in SAVERS if (t := saver.tier(values)) > saver.tier(self.asked)), default=0)

        return [Option.of(method, processes, values, (rank, tier(values))) for values in combos]

    def fit(self, option: Option) -> tuple[Setup, MemoryEstimate] | None:
        """The largest micro-batch that fits ``option`` (the rule micro_batch=auto follows, with estimated
        instead of measured peaks), or None; a plan over the host RAM does not fit either."""
        if option in self._fits:
            return self._fits[option]
        precision = self.precision(option.method)

        def setup(micro: int) -> Setup:
            return setup_for(self.cfg, method=option.method, device=self.target.device, precision=precision,
                             micro_batch=micro, processes=option.processes, overrides=dict(option.overrides))

        def peak(m: int) -> int:
            return estimate_memory(self.shape, setup(m), overhead_gib=self.overhead_gib).peak

        share = self.effective // (option.processes // option["runtime.sequence_parallel"])  # per data-parallel group
        if self.fixed_micro:  # as given: it must split this option's share of the batch and fit
            micro = self.fixed_micro if share % self.fixed_micro == 0 and peak(self.fixed_micro) <= self.budget \
                else None
        else:
            micro = choose_micro_batch(share, peak, self.budget)
        found = None
        if micro is not None:
            mem = estimate_memory(self.shape, setup(micro), overhead_gib=self.overhead_gib)
            host_budget = self.host_budget_for(option.processes)
            if host_budget is not None and mem.host > host_budget:
                self.host_short[option] = mem.host
            else:
                found = (setup(micro), mem)
        self._fits[option] = found
        return found

    def host_budget_for(self, processes: int) -> int | None:
        """A node with more GPUs of this kind (the "more GPUs" alternative) has proportionally more host RAM."""
        if self.host_budget is None:
            return None
        return int(self.host_budget * max(1.0, processes / self.target.num_devices))

    def seconds(self, setup: Setup) -> float:
        return step_seconds(self.shape, setup, self.target, self.workload)

    def best(self, options: list[Option]) -> tuple[Option, Setup, MemoryEstimate] | None:
        """The fitting option of the lowest tier with the shortest estimated step (ties: the earlier option)."""
        scored = []
        for i, option in enumerate(options):
            found = self.fit(option)
            if found:
                # to the millisecond: a saver whose extra compute only hides as much communication (offload) ties
                scored.append(((option.tier, round(self.seconds(found[0]), 3), i), option, *found))
        if not scored:
            return None
        _, option, setup, mem = min(scored, key=lambda x: x[0])
        return option, setup, mem


def plan_target(cfg: Config, shape: ModelShape, target: Target, workload: Workload | None = None,
                safety: float = SAFETY, overhead_gib: float | None = None, micro_batch: int | None = None
                ) -> TargetPlan:
    """Find how the configured run fits on ``target``, with the cheapest memory savers that make it fit.

    First the run as configured, then the saver ladder in the tiers ``anyfit.planning.savers`` gives and explains
    (``Planner.options``); else a bigger GPU. At each option the micro-batch is chosen as ``micro_batch=auto``
    chooses it (the largest divisor of the per-process share of the effective batch that fits), here under
    ``safety`` x the target's memory; accumulation keeps the effective batch; ``micro_batch`` fixes it instead (an
    option it does not fit does not fit). ``workload`` (default: the config's, ``Workload.of``) is the data the
    time and the steps per epoch are for.

    Kept whole: it is the ladder itself, step by step in the order it is tried; its parts (the
    options, fitting, scoring) are the ``Planner`` methods it calls.
    """
    workload = workload or Workload.of(cfg)
    p = Planner(cfg, shape, target, safety, overhead_gib, workload, micro_batch=micro_batch)
    procs, effective, cuda = p.procs, p.effective, p.cuda
    if procs < target.num_devices:
        p.notes.append(f"train.effective_batch={effective} does not split over {target.num_devices} GPUs; "
                       f"planned on {procs}")
    configured = p.configured()
    chosen = None
    if p.fit(configured):
        chosen = (configured, *p.fit(configured))
    else:
        options = p.options(p.method, 0, procs)
        if p.method == "full":
            options += p.options("lora", 1, procs)
        if cuda and p.method != "qlora":
            options += p.options("qlora", 2, procs, shardings=("none",))
        chosen = p.best(options)
        if chosen is None and p.method == "qlora" and procs > 1:  # QLoRA is not sharded; LoRA is, over these GPUs
            chosen = p.best(p.options("lora", 1, procs, shardings=("fsdp", "offload")))

    alternatives: list[str] = []
    slow = chosen is not None and chosen[0].tier != (0, 0)  # offload, Adafactor, LoRA, QLoRA
    if cuda and (chosen is None or slow) and not p.blocker(p.method):
        # How many GPUs of this kind a full shard of the configured method would need.
        for gpus in range(max(2, procs + 1), 65):
            if effective % gpus:
                continue
            found = p.best([o for o in p.options(p.method, 0, gpus, shardings=("fsdp",)) if o["train.optimizer"] != "adafactor"
                            or p.asked["train.optimizer"] == "adafactor"])
            if found:
                text = verdict_for(found[1], p.configured(gpus))
                if chosen is None:
                    chosen = found
                else:
                    extra = f" ({duration_text(100 * p.seconds(found[1]))} per 100 steps)"
                    alternatives.append(f"or keep {p.method} fine-tuning on {gpus} GPUs of this kind: "
                                        f"{text.removeprefix('needs ')}{extra}")
                break
    if chosen is not None and chosen[1].offload:  # the seeds' ZeRO-3 + CPU offload: the same memory, through DeepSpeed
        alternatives.append(f"or DeepSpeed ZeRO-3 + CPU offload, the same partitions in host RAM: "
                            f"runtime.sharding=deepspeed runtime.deepspeed_offload=true "
                            f"train.micro_batch={chosen[1].micro_batch}")
    if chosen is not None and chosen[1].offload and chosen[0].tier[0] == 0:
        lora = p.best([o for o in p.options("lora", 1, procs) if o["runtime.sharding"] == "none"]) if p.method == "full" else None
        if lora:
            alternatives.append(f"or LoRA on {'these GPUs' if procs > 1 else 'this GPU'} without offload: "
                                f"{duration_text(100 * p.seconds(lora[1]))} per 100 steps")
    for option, host in p.host_short.items():
        if option["runtime.fsdp_offload"] and (chosen is None or not chosen[1].offload):
            p.notes.append(f"CPU offload (FSDP2 or DeepSpeed ZeRO-3) would fit the GPU memory but needs "
                           f"{host / GIB:.0f} GiB of host RAM (budget {p.host_budget / GIB:.0f} GiB)")
            break

    steps_per_epoch = None
    examples = workload.examples
    if examples is not None:
        steps_per_epoch = examples // effective  # a partial last window is left out, as the training loop does
        if steps_per_epoch == 0:
            p.notes.append(f"{examples} examples are fewer than one effective batch ({effective})")

    if chosen is None:
        verdict = "needs a bigger GPU" if target.device != "cpu" else "needs more memory"
        method = "qlora" if cuda else "lora"
        precision = p.precision(method)
        smallest = setup_for(cfg, method=method, device=target.device, precision=precision, micro_batch=1,
                             overrides={**checkpointing(1), "train.optimizer": "adamw", "runtime.sharding": "none"})
        smallest = estimate_memory(shape, smallest, overhead_gib=overhead_gib)
        p.notes.append(f"even {'QLoRA' if cuda else 'LoRA'} with micro-batch 1 and checkpointing needs "
                       f"{smallest.peak / GIB:.1f} GiB (budget {p.budget / GIB:.1f} GiB)")
        return TargetPlan(target, verdict, None, None, None, p.budget, tuple(p.notes), tuple(alternatives),
                          steps_per_epoch=steps_per_epoch, host_budget_bytes=p.host_budget)

    option, setup, mem = chosen
    verdict = verdict_for(setup, configured)
    if p.instead:  # QLoRA asked for where bitsandbytes does not run: the plan is LoRA's
        verdict = f"needs LoRA ({p.instead})" + verdict.removeprefix("fits")
    notes = p.notes
    if verdict == "fits" and cfg.model.gradient_checkpointing:
        without = p.fit(configured.with_(checkpointing(0)))
        if without:
            notes.append("gradient checkpointing is not needed here (turning it off saves the recomputation, "
                         f"{duration_text(100 * (p.seconds(setup) - p.seconds(without[0])))} per 100 steps)")
    if setup.micro_batch != cfg.train.micro_batch:
        notes.append(f"micro-batch {setup.micro_batch} (config has {cfg.train.micro_batch})")
    time = step_time(shape, setup, target, workload)
    if time.communication > 0.25 * time.total:
        notes.append(f"communication is {time.communication / time.total:.0%} of the step "
                     f"({target.interconnect_gbs or PCIE4_GBS:g} GB/s between GPUs, "
                     f"{target.host_link_gbs:g} GB/s to the host)")
    return TargetPlan(target, verdict, setup, mem, 100 * time.total, p.budget, tuple(notes), tuple(alternatives),
                      time=time, steps_per_epoch=steps_per_epoch, host_budget_bytes=p.host_budget_for(setup.processes))

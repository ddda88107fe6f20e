"""The plan for one machine: the run as configured, else the cheapest memory savers that make it fit (the
saver ladder), and the answer to ``runtime.sharding=auto`` that the training loop asks for."""

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
from anyfit.model.head import PLAIN_HEAD
from anyfit.model.shape import ModelShape
from anyfit.planning.memory import MemoryEstimate, estimate_memory
from anyfit.planning.presets import PCIE4_GBS, Target
from anyfit.planning.setup import OPTIMIZER_NAMES, SAFETY, Setup, config_overrides, setup_for
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
        return [] if self.setup is None else self.setup.savers()

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


@dataclass(frozen=True)
class _Option:
    """One combination of savers the ladder may try."""

    method: str  # full | lora | qlora
    ckpt: int  # 0: no checkpointing, else checkpoint_every
    optimizer: str
    sharding: str  # none | fsdp | offload
    processes: int
    # (method: 0 configured, 1 LoRA, 2 QLoRA; savers: 0 cheap, 1 sequence parallelism, 2 CPU offload, 3 Adafactor)
    tier: tuple[int, int]
    reduce: bool = False  # sharded: reduce-scatter every micro-batch (runtime.fsdp_reduce_every_micro_batch)
    act_offload: bool = False  # model.activation_offload
    tiled: bool = False  # model.tiled_mlp
    sp: int = 1  # runtime.sequence_parallel
    fused: bool = False  # train.fused_loss


# The saver ladder, cheapest first:
# - 8-bit AdamW states (CUDA): 6 of AdamW's 8 bytes per parameter, results matching 32-bit AdamW (Dettmers et
#   al. 2022, "8-bit Optimizers via Block-wise Quantization");
# - checkpointing every 4th / 2nd / every layer: recomputes that share of the forward (1/3 of a full fine-tuning
#   step, 1/2 with a frozen LoRA base);
# - activation offload on top of checkpointing every layer (CUDA): the layer inputs checkpointing keeps go to host
#   RAM, two PCIe copies per micro-batch (long sequences: what checkpointing alone cannot bring down);
# - the tiled MLP on top of checkpointing every layer: the recomputed layer's MLP intermediates, one tile at a time
#   (long sequences), for one more MLP forward;
# - the fused head and loss: no logits of all trained positions, for one more head matmul per token (models whose
#   logits are the head's output as it is);
# - FSDP sharding: 1/N of everything, for the communication compute cannot hide (little over NVLink, a lot over
#   PCIe); with accumulation, a reduce-scatter every micro-batch also drops the unsharded fp32 gradient;
# - CPU offload: every weight crosses PCIe twice per micro-batch and the optimizer runs on the CPU.
# All but CPU offload keep the run's math (8-bit states almost), so they are one tier: the combination with the
# shortest *estimated* step on this target wins (on NVLink sharding usually beats dense checkpointing, on PCIe not);
# ties go to _Planner.options' order. Sequence parallelism over N of the GPUs (each holds 1/N of every sequence;
# all-to-alls in every layer, and N times fewer data-parallel groups) is the next tier: what one GPU's activations
# cannot hold even with every saver above. CPU offload is a tier of its own, tried only when nothing before fits: its
# time estimate is the least certain. Then the savers that change the run: Adafactor (no first moment, relative step
# sizes), LoRA, QLoRA (CUDA), each with the savers above; last, more GPUs of this kind, sharded. Savers the config
# names are kept: checkpointing may only get denser, a configured optimizer or sharding mode is not swapped (and costs
# no tier), and an explicit runtime.sharding=none is never overridden.
_CKPT_LEVELS = (4, 2, 1)


class _Planner:
    """The ladder's state for one target: the budget, the configured run, and a cache of fits."""

    def __init__(self, cfg: Config, shape: ModelShape, target: Target, safety: float, overhead_gib: float | None,
                 tokens_per_sequence: float, processes: int | None = None, micro_batch: int | None = None):
        self.cfg, self.shape, self.target = cfg, shape, target
        self.fixed_micro = micro_batch  # planned as given (``anyfit plan --micro-batch``), not the largest that fits
        self.overhead_gib = overhead_gib
        self.tokens_per_sequence = tokens_per_sequence
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
        self.host_short: dict[_Option, int] = {}
        self._fits: dict[_Option, tuple[Setup, MemoryEstimate] | None] = {}
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
        optimizer = cfg.train.optimizer
        if optimizer in EIGHT_BIT_OPTIMIZERS and not self.cuda:
            self.notes.append(f"train.optimizer={optimizer} needs CUDA (bitsandbytes); planned with adamw here")
            optimizer = "adamw"
        self.optimizer = optimizer
        self.ckpt = cfg.model.checkpoint_every if cfg.model.gradient_checkpointing else 0
        self.act_offload = cfg.model.activation_offload
        self.tiled = cfg.model.tiled_mlp
        self.fused = cfg.train.fused_loss
        self.can_fuse = shape.model_type in PLAIN_HEAD and cfg.train.loss_chunk_tokens > 0
        self.sp = cfg.runtime.sequence_parallel  # a number is kept; "auto" lets the ladder choose
        sharding = cfg.runtime.sharding
        self.reduce = cfg.runtime.fsdp_reduce_every_micro_batch  # configured: kept; else the ladder may add it
        if sharding == "deepspeed":
            # ZeRO-3 holds what FSDP2's full shard holds (1/N of weights, gradients and states, a layer gathered at
            # a time) and reduce-scatters every micro-batch; its offload keeps them in host RAM as FSDP2's does
            sharding = "offload" if cfg.runtime.deepspeed_offload and self.cuda else "fsdp"
            self.reduce = True
            self.notes.append("DeepSpeed ZeRO-3 planned as FSDP2's full shard (the same partitions"
                              + (", offloaded to host RAM)" if sharding == "offload" else ")"))
        elif cfg.runtime.fsdp_offload and sharding != "none" and self.cuda:
            sharding = "offload"
        elif cfg.runtime.fsdp_offload:
            self.notes.append("runtime.fsdp_offload needs CUDA and sharding; planned without it")
        self.sharding_mode = sharding  # auto | none | fsdp | offload

    def precision(self, method: str) -> str:
        precision, notes = _precision(self.cfg, self.target, qlora=method == "qlora")
        for note in notes:
            if note not in self.notes:
                self.notes.append(note)
        return precision

    def blocker(self, method: str, optimizer: str | None = None) -> str:
        key = (method, optimizer or self.optimizer)
        if key not in self._blockers:
            self._blockers[key] = _sharding_blocker(self.cfg, self.precision(method), self.target.device, *key)
        return self._blockers[key]

    def configured(self, processes: int | None = None) -> _Option:
        """The run exactly as configured (runtime.sharding=auto starts unsharded: it shards only when that
        does not fit, which is what the ladder decides)."""
        sharding = {"auto": "none"}.get(self.sharding_mode, self.sharding_mode)
        if sharding != "none" and self.blocker(self.method):
            note = f"runtime.sharding={self.cfg.runtime.sharding} is refused for this run: {self.blocker(self.method)}"
            if note not in self.notes:
                self.notes.append(note)
            sharding = "none"
        processes = processes or self.procs
        sp = self.sp if isinstance(self.sp, int) else 1
        if sp > 1 and (problem := self.sp_problem(processes, sp)):
            note = f"runtime.sequence_parallel={sp} is refused for this run: {problem}"
            if note not in self.notes:
                self.notes.append(note)
            sp = 1
        return _Option(self.method, self.ckpt, self.optimizer, sharding, processes, (0, 0),
                       self.reduce and sharding != "none", self.act_offload, self.tiled, sp, self.fused)

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
        if isinstance(self.sp, int):
            return [self.configured(processes).sp]
        return [1] + [d for d in range(2, processes + 1) if processes % d == 0 and not self.sp_problem(processes, d)]

    def options(self, method: str, rank: int, processes: int, shardings: tuple[str, ...] | None = None) -> list[_Option]:
        """The saver combinations for ``method`` (``rank``: 0 the configured method, 1 LoRA, 2 QLoRA), in ladder
        order (cheapest first where the estimates tie)."""
        if self.ckpt:  # configured checkpointing: only denser
            ckpts = [self.ckpt] + [k for k in _CKPT_LEVELS if k < self.ckpt]
        else:
            ckpts = [0, *_CKPT_LEVELS]
        seen, unique = set(), []
        for k in ckpts:  # every 4 and every 2 recompute the same layers of a 2-layer model
            layers = len(range(0, self.shape.num_layers, k)) if k else 0
            if layers not in seen:
                seen.add(layers)
                unique.append(k)
        if self.optimizer != "adamw" or method != "full":  # a configured optimizer is kept; LoRA states are tiny
            optimizers = [self.optimizer]
        else:
            optimizers = ["adamw"] + (["adamw_8bit"] if self.cuda else []) + ["adafactor"]
        if shardings is None:
            shardings = {"none": ("none",), "fsdp": ("fsdp",), "offload": ("offload",)}.get(
                self.sharding_mode, ("none",) + (("fsdp",) if processes > 1 else ()) + (("offload",) if self.cuda else ()))
        def saver_rank(sharding: str, optimizer: str, sp: int) -> int:
            if optimizer == "adafactor" and self.optimizer != "adafactor":
                return 3
            if sharding == "offload" and self.sharding_mode != "offload":
                return 2
            return 1 if sp > 1 and not isinstance(self.sp, int) else 0

        def allowed(optimizer: str) -> list[str]:
            # What the loop would refuse is left out: sharding with fp16, generation eval or Adafactor (its
            # in-place row/column norms do not run on sharded weights), on MPS, or of QLoRA; and 8-bit states
            # with CPU offload (bitsandbytes' kernels need the states on the GPU).
            ok = [sh for sh in shardings if (sh == "none" or not self.blocker(method, optimizer))
                  and not (sh == "offload" and optimizer in EIGHT_BIT_OPTIMIZERS)]
            return ok or ["none"]  # a configured sharding the loop would refuse: planned unsharded (and noted)

        def reduces(sharding: str) -> tuple[bool, ...]:
            return (False,) if sharding == "none" else (True,) if self.reduce else (False, True)

        def offloads(k: int) -> tuple[bool, ...]:  # a configured offload is kept; else only with full checkpointing
            return (True,) if self.act_offload else (False, True) if self.cuda and k == 1 else (False,)

        def tiles(k: int) -> tuple[bool, ...]:  # a configured tiled MLP is kept; else only with full checkpointing
            return (True,) if self.tiled else (False, True) if k == 1 else (False,)

        fuses = (True,) if self.fused else (False, True) if self.can_fuse else (False,)  # a configured one is kept
        return [_Option(method, k, opt, sh, processes, (rank, saver_rank(sh, opt, sp)), red, off, tiled, sp, fused)
                for sp in self.sp_degrees(processes) for opt in optimizers for sh in allowed(opt)
                for red in reduces(sh) for k in unique for off in offloads(k) for tiled in tiles(k) for fused in fuses]

    def fit(self, option: _Option) -> tuple[Setup, MemoryEstimate] | None:
        """The largest micro-batch that fits ``option`` (the rule micro_batch=auto follows, with estimated
        instead of measured peaks), or None; a plan over the host RAM does not fit either."""
        if option in self._fits:
            return self._fits[option]
        cfg, method = self.cfg, option.method
        precision = self.precision(method)

        def setup(micro: int) -> Setup:
            return setup_for(cfg, method=method, device=self.target.device, precision=precision, micro_batch=micro,
                             processes=option.processes, checkpoint_every=option.ckpt, optimizer=option.optimizer,
                             sharding=option.sharding, reduce_every=option.reduce, activation_offload=option.act_offload,
                             tiled_mlp=option.tiled, sequence_parallel=option.sp, fused_loss=option.fused)

        def peak(m: int) -> int:
            return estimate_memory(self.shape, setup(m), overhead_gib=self.overhead_gib).peak

        share = self.effective // (option.processes // option.sp)  # per data-parallel group
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
        return step_seconds(self.shape, setup, self.target, self.tokens_per_sequence)

    def best(self, options: list[_Option]) -> tuple[_Option, Setup, MemoryEstimate] | None:
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


_REDUCE_EVERY = "reduce-scatter every micro-batch"
_ACT_OFFLOAD = "activation offload"
_TILED = "tiled MLP"
_FUSED = "fused loss"
_CHEAP = ("8-bit AdamW", "paged 8-bit AdamW", "checkpointing", _REDUCE_EVERY, _ACT_OFFLOAD, _TILED, _FUSED)


def _verdict(setup: Setup, configured: _Option) -> str:
    """'fits', 'fits with <cheap savers>' (checkpointing, 8-bit states) or 'needs <the biggest change>[ with
    <the other savers>]', naming what differs from the config."""
    added = []
    method = {"lora": "LoRA", "qlora": "QLoRA"}.get(setup.method) if setup.method != configured.method else None
    if method:
        added.append(method)
    if setup.optimizer == "adafactor" and configured.optimizer != "adafactor":
        added.append("Adafactor")
    want = "offload" if setup.offload else ("fsdp" if setup.fsdp else "none")
    if want != configured.sharding or setup.processes != configured.processes:
        if setup.offload:
            added.append(f"CPU offload (FSDP over {setup.processes} GPU{'s' if setup.processes > 1 else ''})")
        elif setup.fsdp:
            added.append(f"sharding over {setup.processes} GPUs")
    if setup.sequence_parallel != configured.sp:
        added.append(f"sequence parallelism over {setup.sequence_parallel} GPUs")
    if setup.reduces_every_micro_batch and not configured.reduce:
        added.append(_REDUCE_EVERY)
    if setup.optimizer in EIGHT_BIT_OPTIMIZERS and configured.optimizer not in EIGHT_BIT_OPTIMIZERS:
        added.append(OPTIMIZER_NAMES[setup.optimizer])
    ckpt = setup.checkpoint_every if setup.gradient_checkpointing else 0
    if ckpt != configured.ckpt:
        added.append("gradient checkpointing" if ckpt == 1 else f"checkpointing every {ckpt} layers")
    if setup.activation_offload and not configured.act_offload:
        added.append(_ACT_OFFLOAD)
    if setup.tiled_mlp and not configured.tiled:
        added.append(_TILED)
    if setup.fused_loss and not configured.fused:
        added.append(_FUSED)
    if not added:
        return "fits"
    if all(a.startswith(_CHEAP) or a == "gradient checkpointing" for a in added):
        return "fits with " + " + ".join(added)
    first, rest = added[0], added[1:]
    return f"needs {first}" + (" with " + " + ".join(rest) if rest else "")


def plan_target(cfg: Config, shape: ModelShape, target: Target, mean_tokens: float | None = None,
                safety: float = SAFETY, overhead_gib: float | None = None,
                examples: int | None = None, micro_batch: int | None = None) -> TargetPlan:
    """Find how the configured run fits on ``target``, with the cheapest memory savers that make it fit.

    First the run as configured, then the saver ladder in the order the comment above ``_Planner`` gives and
    explains; else a bigger GPU. At each option the micro-batch is chosen as ``micro_batch=auto`` chooses it (the
    largest divisor of the per-process share of the effective batch that fits), here under ``safety`` x the target's
    memory; accumulation keeps the effective batch; ``micro_batch`` fixes it instead (an option it does not fit does
    not fit). ``examples`` (or data.num_samples) gives the steps per epoch.

    Kept whole: it is the ladder itself, step by step in the order it is tried; its parts (the
    options, fitting, scoring) are the ``_Planner`` methods it calls.
    """
    tokens_per_sequence = mean_tokens or cfg.data.max_length
    p = _Planner(cfg, shape, target, safety, overhead_gib, tokens_per_sequence, micro_batch=micro_batch)
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
            found = p.best([o for o in p.options(p.method, 0, gpus, shardings=("fsdp",)) if o.optimizer != "adafactor"
                            or p.optimizer == "adafactor"])
            if found:
                text = _verdict(found[1], p.configured(gpus))
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
        lora = p.best([o for o in p.options("lora", 1, procs) if o.sharding == "none"]) if p.method == "full" else None
        if lora:
            alternatives.append(f"or LoRA on {'these GPUs' if procs > 1 else 'this GPU'} without offload: "
                                f"{duration_text(100 * p.seconds(lora[1]))} per 100 steps")
    for option, host in p.host_short.items():
        if option.sharding == "offload" and (chosen is None or not chosen[1].offload):
            p.notes.append(f"CPU offload (FSDP2 or DeepSpeed ZeRO-3) would fit the GPU memory but needs "
                           f"{host / GIB:.0f} GiB of host RAM (budget {p.host_budget / GIB:.0f} GiB)")
            break

    steps_per_epoch = None
    examples = examples if examples is not None else cfg.data.num_samples
    if examples is not None:
        steps_per_epoch = examples // effective  # a partial last window is left out, as the training loop does
        if steps_per_epoch == 0:
            p.notes.append(f"{examples} examples are fewer than one effective batch ({effective})")

    if chosen is None:
        verdict = "needs a bigger GPU" if target.device != "cpu" else "needs more memory"
        method = "qlora" if cuda else "lora"
        precision = p.precision(method)
        smallest = estimate_memory(shape, setup_for(cfg, method=method, device=target.device, precision=precision,
                                                    micro_batch=1, checkpoint_every=1, optimizer="adamw"),
                                   overhead_gib=overhead_gib)
        p.notes.append(f"even {'QLoRA' if cuda else 'LoRA'} with micro-batch 1 and checkpointing needs "
                       f"{smallest.peak / GIB:.1f} GiB (budget {p.budget / GIB:.1f} GiB)")
        return TargetPlan(target, verdict, None, None, None, p.budget, tuple(p.notes), tuple(alternatives),
                          steps_per_epoch=steps_per_epoch, host_budget_bytes=p.host_budget)

    option, setup, mem = chosen
    verdict = _verdict(setup, configured)
    if p.instead:  # QLoRA asked for where bitsandbytes does not run: the plan is LoRA's
        verdict = f"needs LoRA ({p.instead})" + verdict.removeprefix("fits")
    notes = p.notes
    if verdict == "fits" and cfg.model.gradient_checkpointing:
        without = p.fit(dataclasses.replace(configured, ckpt=0))
        if without:
            notes.append("gradient checkpointing is not needed here (turning it off saves the recomputation, "
                         f"{duration_text(100 * (p.seconds(setup) - p.seconds(without[0])))} per 100 steps)")
    if setup.micro_batch != cfg.train.micro_batch:
        notes.append(f"micro-batch {setup.micro_batch} (config has {cfg.train.micro_batch})")
    time = step_time(shape, setup, target, tokens_per_sequence)
    if time.communication > 0.25 * time.total:
        notes.append(f"communication is {time.communication / time.total:.0%} of the step "
                     f"({target.interconnect_gbs or PCIE4_GBS:g} GB/s between GPUs, "
                     f"{target.host_link_gbs:g} GB/s to the host)")
    return TargetPlan(target, verdict, setup, mem, 100 * time.total, p.budget, tuple(notes), tuple(alternatives),
                      time=time, steps_per_epoch=steps_per_epoch, host_budget_bytes=p.host_budget_for(setup.processes))

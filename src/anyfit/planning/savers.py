"""The memory savers, one row each: the config keys a saver sets, the values the saver ladder may try, the tier it
costs, the words the plan prints for it, where the memory and time model count it and the model hook that installs
it. The ladder (``anyfit.planning.ladder``), the plan's texts and the README's ladder section are read from here.

The ladder, in tiers (``TIERS``): the cheap savers first, all one tier (the combination with the shortest *estimated*
step on the target wins: on NVLink sharding usually beats dense checkpointing, on PCIe not; ties go to the order
``SAVERS`` tries them in); then sequence parallelism, CPU offload and Adafactor, each a tier of its own; then the same
with LoRA, then QLoRA (CUDA); last, more GPUs of the target's kind, sharded. Savers the config names are kept:
checkpointing may only get denser, a configured optimizer or sharding mode is not swapped (and costs no tier), and an
explicit ``runtime.sharding=none`` is never overridden.

Adding a saver: a row here (its keys, the values the ladder may try, its words), its term in the memory and time
model (``Setup``'s field, filled by ``setup_for``) and, when it changes the model, its hook in
``anyfit.model.savers.MODEL_HOOKS``.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any, NamedTuple

from anyfit.hardware.runtime import EIGHT_BIT_OPTIMIZERS
from anyfit.model.head import PLAIN_HEAD
from anyfit.planning.setup import OPTIMIZER_NAMES, Setup

# What each tier of the ladder holds (an option's tier is that of the costliest saver it adds to the config).
TIERS = {
    0: "the cheap savers: the run's math is kept (8-bit states almost), so the combination with the shortest "
       "estimated step wins (on NVLink sharding usually beats dense checkpointing, on PCIe not)",
    1: "what one GPU's activations cannot hold even with every cheap saver",
    2: "tried only when nothing before fits: its time estimate is the least certain",
    3: "changes the optimizer's math",
}
CKPT_LEVELS = (4, 2, 1)  # checkpointing every 4th, every 2nd, every layer


class Rung(NamedTuple):
    """One value of a saver as the ladder adds it: its name, the setting that turns it on ('key: value'), its tier,
    and why."""

    name: str
    setting: str
    tier: int
    why: str
    used: Callable[[Mapping[str, Any]], bool] | None = None  # whether config values use it (default: the setting)

    def uses(self, values: Mapping[str, Any]) -> bool:
        if self.used is not None:
            return self.used(values)
        key, _, text = self.setting.partition(": ")
        return values[key] == {"true": True, "false": False}.get(text, text)


class Trial(NamedTuple):
    """What the ladder is enumerating: the method and processes, the sharding modes it may try (None: the config's
    choice) and the values the savers before this one took."""

    method: str
    processes: int
    shardings: tuple[str, ...] | None
    chosen: Mapping[str, Any]


@dataclass(frozen=True)
class Option:
    """One way the ladder may run the step: the method, the processes and the config overrides it applies (every
    saver's keys, so two options are equal when they run alike); ``tier`` ranks it: (method: 0 configured, 1 LoRA,
    2 QLoRA; savers: the costliest saver's tier it adds)."""

    method: str
    processes: int
    overrides: tuple[tuple[str, Any], ...]  # (key, value), sorted by key
    tier: tuple[int, int] = (0, 0)

    @classmethod
    def of(cls, method: str, processes: int, overrides: Mapping[str, Any], tier: tuple[int, int] = (0, 0)) -> Option:
        return cls(method, processes, tuple(sorted(overrides.items())), tier)

    def __getitem__(self, key: str) -> Any:
        return dict(self.overrides)[key]

    def with_(self, changes: Mapping[str, Any]) -> Option:
        """This option with some config values changed."""
        return Option.of(self.method, self.processes, {**dict(self.overrides), **changes}, self.tier)


def checkpointing(every: int) -> dict[str, Any]:
    """The checkpointing keys for ``every`` (0: none; else every N-th layer recomputes)."""
    return {"model.gradient_checkpointing": every > 0, "model.checkpoint_every": every or 1}


def checkpoint_every(values: Mapping[str, Any] | Option) -> int:
    """0 without checkpointing, else model.checkpoint_every."""
    return values["model.checkpoint_every"] if values["model.gradient_checkpointing"] else 0


class Words(NamedTuple):
    """A setup's use of one saver in the plan's words: its entries in the saver list, in the one-line description and
    in the table's short labels, and what it adds to the configured option, each with whether that changes the run
    or its GPUs (the verdict then reads "needs ..." rather than "fits with ...")."""

    listed: tuple[str, ...] = ()
    described: tuple[str, ...] = ()
    short: tuple[str, ...] = ()
    added: tuple[tuple[str, bool], ...] = ()


@dataclass(frozen=True)
class Saver:
    """One row: config keys the ladder varies together, and three functions of the row's own.

    ``tries(planner, trial)``: the values the ladder may try ({key: value} each, in the order it tries them; the
    planner is ``anyfit.planning.ladder.Planner``, whose ``asked`` holds the config's values as it plans them).
    ``words(setup, configured)``: the setup's use of the saver in words (``Words``; ``added`` against the configured
    ``Option``, empty without one). ``settings(setup)``: the config keys that select it. ``on_off`` makes the row of
    a saver that is one bool key."""

    name: str
    keys: tuple[str, ...]
    fields: tuple[str, ...]  # the Setup fields setup_for fills from the keys
    rungs: tuple[Rung, ...]  # the values the ladder may add, with their tiers
    memory: tuple[str, ...]  # the functions of anyfit.planning.memory that count it
    time: tuple[str, ...]  # the functions of anyfit.planning.time that count it
    tries: Callable[[Any, Trial], list[dict[str, Any]]]
    words: Callable[[Setup, Option | None], Words]
    settings: Callable[[Setup], dict[str, Any]]
    hook: str = ""  # its model hook: a key of anyfit.model.savers.MODEL_HOOKS ('': not the model's)

    def tier(self, values: Mapping[str, Any]) -> int:
        return max((rung.tier for rung in self.rungs if rung.uses(values)), default=0)


def on_off(name: str, key: str, rung: Rung, memory: tuple[str, ...], time: tuple[str, ...], words: tuple[str, str, str],
           may_add: Callable[[Any, Trial], bool]) -> Saver:
    """The row of a saver that is one bool key (its Setup field of the same name after the section): kept when
    configured, else tried off and on where ``may_add``; ``words``: its entry in the saver list, the description and
    the short labels ('': none)."""
    field = key.split(".", 1)[1]

    def tries(planner: Any, trial: Trial) -> list[dict[str, Any]]:
        values = (True,) if planner.asked[key] else (False, True) if may_add(planner, trial) else (False,)
        return [{key: value} for value in values]

    def said(s: Setup, configured: Option | None) -> Words:
        if not getattr(s, field):
            return Words()
        listed, described, short = ((w,) if w else () for w in words)
        return Words(listed, described, short, ((words[0], False),) if configured and not configured[key] else ())

    return Saver(name, (key,), (field,), (rung,), memory, time, tries, said,
                 lambda s: {key: True} if getattr(s, field) else {}, hook=key)


def _split_tries(planner: Any, trial: Trial) -> list[dict[str, Any]]:
    return [{"runtime.sequence_parallel": d} for d in planner.sp_degrees(trial.processes)]


def _split_words(s: Setup, configured: Option | None) -> Words:
    if s.sequence_parallel <= 1:
        return Words()
    added = () if configured is None or s.sequence_parallel == configured["runtime.sequence_parallel"] else (
        (f"sequence parallelism over {s.sequence_parallel} GPUs", True),)
    return Words((f"sequence parallel over {s.sequence_parallel}",),
                 (f"each sequence over {s.sequence_parallel} processes",), (), added)


def _optimizer_tries(planner: Any, trial: Trial) -> list[dict[str, Any]]:
    configured = planner.asked["train.optimizer"]
    if configured != "adamw" or trial.method != "full":  # a configured optimizer is kept; LoRA states are tiny
        names = [configured]
    else:
        names = ["adamw"] + (["adamw_8bit"] if planner.cuda else []) + ["adafactor"]
    return [{"train.optimizer": name} for name in names]


def _optimizer_words(s: Setup, configured: Option | None) -> Words:
    labels = {"adamw_8bit": "8-bit", "paged_adamw_8bit": "paged 8-bit", "adafactor": "Adafactor"}
    changed = s.optimizer != "adamw"
    added: tuple[tuple[str, bool], ...] = ()
    if configured is not None:
        was = configured["train.optimizer"]
        if s.optimizer == "adafactor" and was != "adafactor":
            added = (("Adafactor", True),)
        elif s.optimizer in EIGHT_BIT_OPTIMIZERS and was not in EIGHT_BIT_OPTIMIZERS:
            added = ((OPTIMIZER_NAMES[s.optimizer], False),)
    return Words((OPTIMIZER_NAMES[s.optimizer],) if changed else (), (OPTIMIZER_NAMES[s.optimizer],),
                 (labels[s.optimizer],) if changed else (), added)


def _sharding_tries(planner: Any, trial: Trial) -> list[dict[str, Any]]:
    """FSDP2's full shard (cheap), its CPU offload (a tier of its own), and with either a reduce-scatter every
    micro-batch."""
    shardings = trial.shardings or {"none": ("none",), "fsdp": ("fsdp",), "offload": ("offload",)}.get(
        planner.sharding_mode,
        ("none",) + (("fsdp",) if trial.processes > 1 else ()) + (("offload",) if planner.cuda else ()))
    optimizer = trial.chosen["train.optimizer"]
    # What the loop would refuse is left out: sharding with fp16, generation eval or Adafactor (its in-place
    # row/column norms do not run on sharded weights), on MPS, or of QLoRA; and 8-bit states with CPU offload
    # (bitsandbytes' kernels need the states on the GPU).
    allowed = [sh for sh in shardings if (sh == "none" or not planner.blocker(trial.method, optimizer))
               and not (sh == "offload" and optimizer in EIGHT_BIT_OPTIMIZERS)]
    out = []
    for sh in allowed or ["none"]:  # a configured sharding the loop would refuse: planned unsharded (and noted)
        configured_reduce = planner.asked["runtime.fsdp_reduce_every_micro_batch"]
        for reduce in (False,) if sh == "none" else (True,) if configured_reduce else (False, True):
            out.append({"runtime.sharding": "none" if sh == "none" else "fsdp",
                        "runtime.fsdp_offload": sh == "offload", "runtime.fsdp_reduce_every_micro_batch": reduce})
    return out


def _sharding_words(s: Setup, configured: Option | None) -> Words:
    reduce = ("reduce-scatter every micro-batch",) if s.reduces_every_micro_batch else ()
    listed = ((f"CPU offload (FSDP over {s.processes})",) if s.offload else (f"sharding over {s.processes}",)
              if s.fsdp else ()) + reduce
    described = (f"FSDP over {s.processes}" + (" with CPU offload" if s.offload else "")
                 + (", reduce-scatter every micro-batch" if s.reduces_every_micro_batch else ""),) if s.fsdp else ()
    short = (f"offload/{s.processes}",) if s.offload else (f"FSDP/{s.processes}",) if s.fsdp else ()
    added: list[tuple[str, bool]] = []
    if configured is not None:
        was = "offload" if configured["runtime.fsdp_offload"] else configured["runtime.sharding"]
        now = "offload" if s.offload else ("fsdp" if s.fsdp else "none")
        if now != was or s.processes != configured.processes:
            if s.offload:
                added.append((f"CPU offload (FSDP over {s.processes} GPU{'s' if s.processes > 1 else ''})", True))
            elif s.fsdp:
                added.append((f"sharding over {s.processes} GPUs", True))
        if s.reduces_every_micro_batch and not configured["runtime.fsdp_reduce_every_micro_batch"]:
            added.append(("reduce-scatter every micro-batch", False))
    return Words(listed, described, short, tuple(added))


def _sharding_settings(s: Setup) -> dict[str, Any]:
    out = {"runtime.sharding": "fsdp" if s.fsdp else "none", "runtime.fsdp_offload": s.offload}
    return out | ({"runtime.fsdp_reduce_every_micro_batch": True} if s.reduces_every_micro_batch else {})


def _checkpointing_tries(planner: Any, trial: Trial) -> list[dict[str, Any]]:
    """Every 4th, 2nd or every layer recomputed; a configured level may only get denser."""
    configured = checkpoint_every(planner.asked)
    levels = [configured] + [k for k in CKPT_LEVELS if k < configured] if configured else [0, *CKPT_LEVELS]
    seen, out = set(), []
    for k in levels:  # every 4 and every 2 recompute the same layers of a 2-layer model
        layers = len(range(0, planner.shape.num_layers, k)) if k else 0
        if layers not in seen:
            seen.add(layers)
            out.append(checkpointing(k))
    return out


def _checkpointing_words(s: Setup, configured: Option | None) -> Words:
    k = s.checkpoint_every if s.gradient_checkpointing else 0
    added = () if configured is None or k == checkpoint_every(configured) else (
        ("gradient checkpointing" if k == 1 else f"checkpointing every {k} layers", False),)
    if not k:
        return Words(added=added)
    return Words(("checkpointing every layer" if k == 1 else f"checkpointing every {k} layers",),
                 ("gradient checkpointing" + ("" if k == 1 else f" every {k} layers"),),
                 ("ckpt" if k == 1 else f"ckpt/{k}",), added)


def _checkpointing_settings(s: Setup) -> dict[str, Any]:
    return {"model.gradient_checkpointing": s.gradient_checkpointing} | (
        {"model.checkpoint_every": s.checkpoint_every} if s.gradient_checkpointing else {})


def _full_checkpointing(planner: Any, trial: Trial) -> bool:
    return checkpoint_every(trial.chosen) == 1


# In the order the ladder tries them: the savers each depends on come first (sharding on the optimizer, activation
# offload and the tiled MLP on checkpointing); within a tier, ties go to the earlier combination.
SAVERS: tuple[Saver, ...] = (
    Saver(
        "sequence_parallel", ("runtime.sequence_parallel",), ("sequence_parallel",),
        (Rung("sequence parallelism", "runtime.sequence_parallel: auto", 1,
              "over N of the GPUs: each holds 1/N of every sequence, for all-to-alls in every layer and N times fewer "
              "data-parallel groups (DeepSpeed's Ulysses attention)",
              lambda v: isinstance(v["runtime.sequence_parallel"], int) and v["runtime.sequence_parallel"] > 1),),
        ("estimate_memory", "activation_bytes"), ("sequence_exchange_seconds",), _split_tries, _split_words,
        lambda s: {"runtime.sequence_parallel": s.sequence_parallel} if s.sequence_parallel > 1 else {}),
    Saver(
        "optimizer", ("train.optimizer",), ("optimizer",),
        (Rung("8-bit AdamW", "train.optimizer: adamw_8bit", 0,
              "CUDA: 6 of AdamW's 8 bytes of state per parameter, results matching 32-bit AdamW (Dettmers et al. "
              "2022, \"8-bit Optimizers via Block-wise Quantization\")"),
         Rung("Adafactor", "train.optimizer: adafactor", 3,
              "no first moment and factored second moments, relative step sizes: a fraction of AdamW's state")),
        ("optimizer_state_bytes",), ("step_time",), _optimizer_tries, _optimizer_words,
        lambda s: {"train.optimizer": s.optimizer}),
    Saver(
        "sharding", ("runtime.sharding", "runtime.fsdp_offload", "runtime.fsdp_reduce_every_micro_batch"),
        ("fsdp", "offload", "fsdp_unsharded_accumulation"),
        (Rung("FSDP sharding", "runtime.sharding: fsdp", 0,
              "1/N of weights, gradients and optimizer states on each GPU, for the communication compute cannot "
              "hide (little over NVLink, a lot over PCIe)"),
         Rung("a reduce-scatter every micro-batch", "runtime.fsdp_reduce_every_micro_batch: true", 0,
              "sharded, with accumulation: drops the unsharded fp32 gradient kept until the window's last "
              "micro-batch, for a reduce-scatter per micro-batch"),
         Rung("CPU offload", "runtime.fsdp_offload: true", 2,
              "FSDP2's shards in host RAM: every weight crosses PCIe twice per micro-batch and the optimizer runs on "
              "the CPU")),
        ("estimate_memory", "forward_transients", "host_bytes"), ("communication_seconds",), _sharding_tries,
        _sharding_words, _sharding_settings),
    Saver(
        "checkpointing", ("model.gradient_checkpointing", "model.checkpoint_every"),
        ("gradient_checkpointing", "checkpoint_every"),
        (Rung("checkpointing every 4th, 2nd or every layer", "model.gradient_checkpointing: true", 0,
              "keeps only each checkpointed layer's input, for the forward of that share of the layers again (1/3 "
              "of a full fine-tuning step, 1/2 with a frozen LoRA base)"),),
        ("activation_bytes", "activations_and_logits"), ("flops_per_token",), _checkpointing_tries,
        _checkpointing_words, _checkpointing_settings, hook="model.gradient_checkpointing"),
    on_off("activation_offload", "model.activation_offload",
           Rung("activation offload", "model.activation_offload: true", 0,
                "CUDA, with checkpointing every layer: the layer inputs checkpointing keeps go to host RAM, for two "
                "PCIe copies per micro-batch (long sequences: what checkpointing alone cannot bring down)"),
           ("activations_and_logits", "offloaded_activation_bytes"), ("step_time",),
           ("activation offload", "", "act-offload"),
           lambda planner, trial: planner.cuda and _full_checkpointing(planner, trial)),
    on_off("tiled_mlp", "model.tiled_mlp",
           Rung("tiled MLP", "model.tiled_mlp: true", 0,
                "with checkpointing every layer: the recomputed layer's MLP intermediates exist one tile at a time "
                "(long sequences), for one more MLP forward"),
           ("activation_bytes", "linear_inputs"), ("flops_per_token",), ("tiled MLP", "tiled MLP", ""),
           _full_checkpointing),
    on_off("fused_loss", "train.fused_loss",
           Rung("fused loss", "train.fused_loss: true", 0,
                "no logits of all trained positions, for one more head matmul per token (models whose logits are the "
                "head's output as it is)"),
           ("activations_and_logits",), ("flops_per_token",), ("fused loss", "fused head and loss", ""),
           lambda planner, trial: (planner.shape.model_type in PLAIN_HEAD and planner.cfg.train.loss_chunk_tokens > 0)),
)
BY_NAME = {saver.name: saver for saver in SAVERS}

# The methods the ladder falls back to, each with the savers above, after every tier of the configured method:
# method -> (its name, what turns it on, why).
METHODS = {"lora": ("LoRA", "lora.enabled: true", "a frozen base: the adapters' gradients and states only"),
           "qlora": ("QLoRA", "lora.qlora: true", "CUDA: the frozen base in 4 bits")}

# The order every text names the savers in (the ladder tries them in SAVERS' order): the plan's saver list, its
# one-line description, the table's short labels, the config keys and the verdict (what the plan adds to the
# config: first what changes the run or its GPUs, then the rest) name the sharding first and the sequence split last.
SHOWN = ("sharding", "optimizer", "checkpointing", "activation_offload", "tiled_mlp", "fused_loss", "sequence_parallel")


def _said(s: Setup, configured: Option | None = None) -> list[Words]:
    return [BY_NAME[name].words(s, configured) for name in SHOWN]


def saver_words(s: Setup) -> list[str]:
    """The memory savers ``s`` uses, in words."""
    return [word for words in _said(s) for word in words.listed]


def short_words(s: Setup) -> str:
    """The savers for the plan's table, abbreviated (the notes and --json spell them out)."""
    return " ".join(word for words in _said(s) for word in words.short) or "-"


def describe(s: Setup) -> str:
    """``s`` in one line: method, precision, batch split, sequence length, and the savers (the optimizer among them)."""
    what = {"full": "full fine-tuning", "lora": f"LoRA r={s.lora_r}", "qlora": f"QLoRA r={s.lora_r}"}
    parts = [what[s.method], s.precision, f"micro {s.micro_batch} x accum {s.accumulation} x procs {s.processes}",
             f"seq {s.seq_len}"]
    return ", ".join(parts + [word for words in _said(s) for word in words.described])


def config_overrides(s: Setup) -> list[str]:
    """The config keys that select this setup (what to put in the YAML or on the command line)."""
    out = [f"lora.enabled={str(s.lora).lower()}"]
    if s.method == "qlora":
        out.append("lora.qlora=true")
        if not s.qlora_upcast:
            out.append("lora.qlora_upcast=false")
    for name in SHOWN:
        out += [f"{key}={str(value).lower() if isinstance(value, bool) else value}"
                for key, value in BY_NAME[name].settings(s).items()]
    return out + [f"train.micro_batch={s.micro_batch}"]


def verdict_for(s: Setup, configured: Option) -> str:
    """'fits', 'fits with <savers that keep the run and its GPUs>' (checkpointing, 8-bit states, ...) or 'needs <the
    biggest change>[ with <the other savers>]', naming what ``s`` adds to the configured option."""
    changes = [(METHODS[s.method][0], True)] if s.method != configured.method and s.method in METHODS else []
    changes += [change for words in _said(s, configured) for change in words.added]
    needs = [word for word, big in changes if big]
    cheap = [word for word, big in changes if not big]
    if not needs:
        return "fits with " + " + ".join(cheap) if cheap else "fits"
    rest = needs[1:] + cheap
    return f"needs {needs[0]}" + (" with " + " + ".join(rest) if rest else "")


def ladder_markdown() -> str:
    """The README's ladder section: the savers by tier, each with what turns it on and why."""
    lines = ["| tier | saver | turned on by | what it saves, what it costs |", "|---|---|---|---|"]
    rungs = sorted(((rung.tier, i, rung) for i, saver in enumerate(SAVERS) for rung in saver.rungs),
                   key=lambda x: x[:2])
    for tier, _, rung in rungs:
        lines.append(f"| {tier + 1} | {rung.name} | `{rung.setting}` | {rung.why} |")
    for i, (name, setting, why) in enumerate(METHODS.values()):
        lines.append(f"| {len(TIERS) + i + 1} | {name}, with the savers above | `{setting}` | {why} |")
    lines += [f"| {len(TIERS) + len(METHODS) + 1} | more GPUs of the target's kind, sharded | `anyfit plan --gpus N` | "
              "the configured method kept (CUDA) |", ""]
    lines += [f"- tier {tier + 1}: {text}" for tier, text in TIERS.items()]
    return "\n".join(lines) + "\n"

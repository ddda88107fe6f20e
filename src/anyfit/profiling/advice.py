"""Rules from what a profiled run measured to the config keys that would make it faster (or fit better).

Each rule reads the profile (``Profile``: the average profiled step, memory by kind, padding) and what the
config and the machine allow (``Facts``), and either stays silent or returns one ``Advice``: the key to set,
the reason as measured in this run, and the expected effect. A rule fires only above a threshold of its own
measured share (the constants below), so a run gets no advice its numbers do not support.

Time predictions come from one step model: the measured step is data wait + host-to-device + the micro-batches'
forward/backward + optimizer + the rest. The micro-batches' cost is fitted on this run's own micro-batches (the
faster half of them: what else runs on the machine only adds time, see ``micro_fit``) as ``seconds = a + b x
positions + c x trained tokens`` (``a``: the fixed cost of a forward/backward call: Python, operator dispatch,
kernel launches, a dense embedding gradient; ``b``: per token position, padding included; ``c``: the output head,
which runs on trained tokens only); a change of micro-batch size or of packing changes the number of calls and
positions (``Layout``, counted on the profiled windows themselves) and nothing else: the step's time changes by
``a`` and ``b`` times those differences. Tokens per second scale as the inverse of the step time (the same real
tokens per step).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from anyfit.units import GIB

# A rule fires when its measured share of the step (or of the memory) reaches:
PADDING_SHARE = 0.10  # padded positions among all positions, now or at the proposed micro-batch
DATA_WAIT_SHARE = 0.05  # the step waiting for its batches
MIN_GAIN = 1.10  # a predicted tokens/s factor below this is not worth a change
FAST_SHARE = 0.5  # the micro-batches the cost fit keeps: the fastest against the fit (``micro_fit``)
MAX_CONCENTRATION_STEPS = 20
COLLINEAR_R2 = 0.95  # a regressor this well explained by the others has no cost of its own the timings can tell
OPTIMIZER_SHARE = 0.25  # the optimizer step under CPU offload
COMMUNICATION_SHARE = 0.25  # collectives, with nothing to amortise them over (accumulation 1)
ELEMENTWISE_SHARE = 0.30  # non-matmul, non-communication kernels on CUDA (what torch.compile fuses)
MATMUL_SHARE = 0.30  # matmul kernels on CUDA (what bf16 makes faster)
LOGITS_SHARE = 0.20  # the logits among what a micro-batch keeps for backward (activations + logits)
COMPILE_ELEMENTWISE_CUT = 0.5  # assumed: fusion halves the elementwise kernels' time (not measured here)
CHUNK = 1024  # train.loss_chunk_tokens' default


@dataclass(frozen=True)
class Layout:
    """One way to cut the profiled windows into micro-batches: forward/backward calls and token positions per step
    (padding included), and the padding share among those positions."""

    micro_batches: float
    positions: float
    real_tokens: float

    @property
    def padding(self) -> float:
        return 1 - self.real_tokens / self.positions if self.positions else 0.0


@dataclass
class Facts:
    """What the config, the machine and the planner say, beside the profile."""

    device: str
    precision: str
    processes: int
    packing: bool
    num_workers: int
    micro_batch: int
    per_process: int
    accumulation: int
    gradient_checkpointing: bool = False
    checkpoint_share: float = 0.0  # share of the layers that recompute
    offload: bool = False
    compile: bool = False
    native_bf16: bool = False
    bf16_speedup: float = 1.0  # dense bf16 peak / fp32 (TF32) peak of this GPU
    loss_chunk_tokens: int = CHUNK
    layouts: dict[tuple[bool, int], Layout] = field(default_factory=dict)  # (packed, micro) -> Layout
    proposed_micro: int | None = None  # the largest micro-batch that fits by measurement and by the planner
    fits_without_checkpointing: bool = False
    fits_without_offload: bool = False
    logits_chunked_bytes: int = 0  # the planner's logits bytes with chunking, for the largest micro-batch


@dataclass
class Profile:
    """The average profiled step (seconds) and the memory census (bytes), as the rules read them."""

    step: float
    phases: dict[str, float]
    micro_seconds: list[float]
    micro_positions: list[float]
    micro_trained: list[float] = field(default_factory=list)  # trained tokens of each micro-batch
    untraced_step: float | None = None  # the same step's seconds without the profiler (the time predictions' unit)
    communication: float = 0.0
    device_busy: float | None = None
    device_matmul: float = 0.0
    device_communication: float = 0.0
    activations: int = 0
    logits: int = 0

    def share(self, seconds: float) -> float:
        return seconds / self.step if self.step > 0 else 0.0


@dataclass(frozen=True)
class Advice:
    key: str
    value: str
    reason: str
    effect: str
    factor: float | None = None  # expected tokens/s multiplier (None: a memory change, no speed claim)

    @property
    def setting(self) -> str:
        return f"{self.key}={self.value}"


def micro_fit(profile: Profile) -> tuple[np.ndarray, np.ndarray]:
    """The coefficients of ``seconds = a + b x positions (+ c x trained tokens)`` per micro-batch, and the fitted
    seconds of each profiled micro-batch (empty arrays: nothing to fit).

    Trained tokens get their own column because the output head runs on them only, and they vary apart from the
    positions. With too few distinct sizes, all the cost is per position (a = 0: no gain claimed from fewer,
    larger micro-batches). No coefficient is negative, whatever the timing noise.

    Timing noise only adds time, and on a shared machine (a CI runner, a laptop) it comes in bursts that least
    squares would read as cost per token or per call. So the fit keeps the ``FAST_SHARE`` of micro-batches lying
    lowest against the current fit and refits, until the kept set stops changing (the concentration steps of
    Rousseeuw & Van Driessen's FAST-LTS, on the lower side). Hand-written: numpy has no trimmed or non-negative
    fit, and scipy is not a dependency."""
    t, x = np.asarray(profile.micro_seconds, dtype=np.float64), np.asarray(profile.micro_positions, dtype=np.float64)
    if not len(t) or len(t) != len(x):
        return np.zeros(0), np.zeros(0)
    columns = [np.ones_like(x), x]
    if len(profile.micro_trained) == len(x) and not _collinear(np.stack(columns, axis=1), profile.micro_trained):
        columns.append(np.asarray(profile.micro_trained, dtype=np.float64))
    distinct = len(set(x.tolist()))
    columns = columns[:max(0, min(len(columns), distinct - 1))]
    if len(columns) < 2:
        b = float(t.sum() / x.sum()) if x.sum() else 0.0
        return np.array([0.0, b]), b * x
    a = np.stack(columns, axis=1)
    coef = nonnegative_lstsq(a, t)
    keep = max(a.shape[1] + 1, int(np.ceil(FAST_SHARE * len(t))))
    if keep < len(t):
        kept = None
        for _ in range(MAX_CONCENTRATION_STEPS):
            lowest = np.sort(np.argsort(t - a @ coef, kind="stable")[:keep])
            if kept is not None and np.array_equal(lowest, kept):
                break
            kept, coef = lowest, nonnegative_lstsq(a[lowest], t[lowest])
    return coef, a @ coef


def _collinear(a: np.ndarray, column) -> bool:
    """Whether ``column`` is (nearly) a linear function of ``a``'s columns: the share of its variance they explain
    reaches ``COLLINEAR_R2``. Then timing noise alone decides how cost splits between them (when every example's
    prompt is about as long as its answer, trained tokens follow the positions), so the fit leaves it out and its
    cost lands on the positions it follows."""
    y = np.asarray(column, dtype=np.float64)
    spread = float(np.sum((y - y.mean()) ** 2))
    if spread == 0:
        return True
    residual = y - a @ np.linalg.lstsq(a, y, rcond=None)[0]
    return 1 - float(residual @ residual) / spread >= COLLINEAR_R2


def micro_cost(profile: Profile) -> tuple[float, float, float]:
    """From ``micro_fit``: (a, b, compute): a micro-batch's fixed seconds, its seconds per token position (padding
    included), and the profiled step's forward/backward seconds as the fit has them (the measured ones less the
    contention the fit left out; the measured ones where there is nothing to fit). The trained tokens' cost is the
    same whatever the layout, so it is not returned."""
    coef, fitted = micro_fit(profile)
    measured = profile.phases["forward"] + profile.phases["backward"]
    total = float(np.sum(profile.micro_seconds))
    compute = measured * float(fitted.sum()) / total if len(fitted) and total > 0 else measured
    return (float(coef[0]), float(coef[1]), compute) if len(coef) else (0.0, 0.0, compute)


def nonnegative_lstsq(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    """argmin ||a c - b|| over c >= 0, for a handful of columns: the least-squares solutions on every subset of
    the columns, the best one with no negative coefficient (the optimum is one of them). Written here because
    scipy (whose ``optimize.nnls`` does this) is not a dependency; timing noise that tilts one slope below zero
    then clamps that slope to zero instead of discarding the whole fit."""
    n = a.shape[1]
    best, best_residual = np.zeros(n), float(b @ b)
    for subset in range(1, 2 ** n):
        keep = [i for i in range(n) if subset >> i & 1]
        part = np.linalg.lstsq(a[:, keep], b, rcond=None)[0]
        if (part < 0).any():
            continue
        coef = np.zeros(n)
        coef[keep] = part
        residual = float(np.sum((a @ coef - b) ** 2))
        if residual < best_residual:
            best, best_residual = coef, residual
    return best


def predicted_step(profile: Profile, facts: Facts, packed: bool, micro: int, data_wait: bool = True,
                   saved: float = 0.0) -> float | None:
    """The step's seconds with another layout (and without the data wait, or minus ``saved`` seconds)."""
    now, then = facts.layouts.get((facts.packing, facts.micro_batch)), facts.layouts.get((packed, micro))
    if now is None or then is None:
        return None
    a, b, measured = micro_cost(profile)
    traced = profile.step - profile.phases["forward"] - profile.phases["backward"] + measured
    if profile.untraced_step and traced > profile.untraced_step:
        # The traced step is slower than the untraced one by the profiler's per-operator cost and by whatever else
        # took the cores during the traced steps only. Neither is a cost of the layout, so the fitted costs keep
        # their shares of the traced step, in the untraced step's seconds. (Subtracting the difference from the
        # per-call cost instead read a busy CI runner during the traced steps as "no fixed cost".)
        scale = profile.untraced_step / traced
        a, b, measured = a * scale, b * scale, measured * scale
    # What changes: the calls' fixed cost and the positions' cost; the rest of the measured compute stays.
    compute = max(0.0, measured + a * (then.micro_batches - now.micro_batches) + b * (then.positions - now.positions))
    rest = base_step(profile) - measured - (0.0 if data_wait else profile.phases["data_wait"]) - saved
    return max(1e-9, rest + compute)


def base_step(profile: Profile) -> float:
    """The step's seconds as the run goes without the profiler (when measured), else as traced."""
    return profile.untraced_step or profile.step


def factor_text(factor: float) -> str:
    return f"about x{factor:.2f} tokens/s"


def padding_rule(p: Profile, f: Facts) -> Advice | None:
    """Padding -> train.packing."""
    if f.packing:
        return None
    micro = f.proposed_micro or f.micro_batch
    now = f.layouts.get((False, f.micro_batch))
    there = f.layouts.get((False, micro))
    shares = [(m, layout.padding) for m, layout in ((f.micro_batch, now), (micro, there)) if layout]
    if not shares or max(s for _, s in shares) < PADDING_SHARE:
        return None
    m, share = max(shares, key=lambda s: s[1])
    layout = f.layouts[(False, m)]
    new, old = predicted_step(p, f, True, m), predicted_step(p, f, False, m)
    factor = old / new if new and old else None
    where = "now" if m == f.micro_batch else f"at micro-batch {m}"
    return Advice("train.packing", "true", f"{share:.0%} of the token positions are padding {where} "
                  f"({layout.positions:.0f} positions for {layout.real_tokens:.0f} real tokens per step)",
                  "no padding: each micro-batch is one row of real tokens" +
                  (f"; {factor_text(factor)}" if factor else ""), factor)


def micro_batch_rule(p: Profile, f: Facts) -> Advice | None:
    """A small micro-batch with memory to spare -> the micro-batch that fits (or auto)."""
    m = f.proposed_micro
    if not m or m <= f.micro_batch:
        return None
    a, _, _ = micro_cost(p)
    packed = True if padding_rule(p, f) else f.packing  # larger padded micro-batches pad more: with packing
    new, old = predicted_step(p, f, packed, m), predicted_step(p, f, packed, f.micro_batch)
    if old and packed == f.packing:
        old = base_step(p)
    if not new or not old or old / new < MIN_GAIN:
        return None
    calls = f.layouts[(f.packing, f.micro_batch)].micro_batches
    return Advice("train.micro_batch", str(m), f"{calls:.0f} forward/backward calls per step, each with a fixed cost "
                  f"of {a * 1e3:.1f} ms measured (fitted on this run's micro-batches); memory allows {m} "
                  f"(measured peak scaled, and the planner's estimate; train.micro_batch=auto measures it)",
                  f"{calls / (f.per_process / m):.0f}x fewer calls; {factor_text(old / new)}", old / new)


def data_wait_rule(p: Profile, f: Facts) -> Advice | None:
    """Waiting for data -> runtime.num_workers."""
    wait = p.share(p.phases["data_wait"])
    if f.num_workers > 0 or wait < DATA_WAIT_SHARE:
        return None
    factor = base_step(p) / predicted_step(p, f, f.packing, f.micro_batch, data_wait=False)
    note = " (on a CPU the workers take cores from the training step: measure)" if f.device == "cpu" else ""
    return Advice("runtime.num_workers", "2", f"the step waits {wait:.0%} of its time for its batches "
                  f"({p.phases['data_wait'] * 1e3:.1f} ms per step)",
                  f"batches prepared while the step runs; up to {factor_text(factor)}{note}", factor)


def checkpointing_rule(p: Profile, f: Facts) -> Advice | None:
    """Activation checkpointing with memory to spare -> off."""
    if not f.gradient_checkpointing or not f.fits_without_checkpointing:
        return None
    recompute = p.phases["forward"] * f.checkpoint_share  # the backward pass runs the forward again
    factor = p.step / max(1e-9, p.step - recompute)
    if factor < MIN_GAIN / 1.05:
        return None
    return Advice("model.gradient_checkpointing", "false", f"memory allows keeping every activation (measured "
                  f"and planned), and the backward pass recomputes {f.checkpoint_share:.0%} of a forward that takes "
                  f"{p.phases['forward'] * 1e3:.0f} ms per step", f"no recomputation; {factor_text(factor)}", factor)


def offload_rule(p: Profile, f: Facts) -> Advice | None:
    """The optimizer step a large share under CPU offload -> offload off where it fits, else more nodes."""
    share = p.share(p.phases["optimizer"])
    if not f.offload or share < OPTIMIZER_SHARE:
        return None
    reason = f"the optimizer step runs on the CPU (FSDP offload) and takes {share:.0%} of the step"
    if f.fits_without_offload:
        factor = p.step / max(1e-9, p.step - p.phases["optimizer"])
        return Advice("runtime.fsdp_offload", "false", reason + "; the planner says the sharded states fit on the GPUs",
                      f"the update on the GPUs (its time about vanishes next to the CPU's); up to {factor_text(factor)}",
                      factor)
    factor = p.step / max(1e-9, p.step - p.phases["optimizer"] / 2)
    return Advice("train.optimizer", "adafactor", reason + "; nothing fits without offload",
                  "a state-light optimizer streams less host memory per step; or twice the GPUs over two nodes "
                  f"(each node's host updates half the shards): {factor_text(factor)}", None)


def communication_rule(p: Profile, f: Facts) -> Advice | None:
    """Communication-bound with accumulation 1 -> more accumulation (a larger effective batch)."""
    share = p.share(p.communication)
    if f.processes < 2 or f.accumulation != 1 or share < COMMUNICATION_SHARE:
        return None
    factor = 2 * p.step / (2 * (p.step - p.communication) + p.communication)
    return Advice("train.effective_batch", f"{2 * f.per_process * f.processes}",
                  f"collectives take {share:.0%} of the step and accumulation is 1: every micro-batch pays a gradient "
                  "reduction", f"accumulation 2: one reduction per two micro-batches; {factor_text(factor)} "
                  "(a larger batch: check the learning rate)", factor)


def compile_rule(p: Profile, f: Facts) -> Advice | None:
    """compile off on CUDA with many small kernels -> runtime.compile."""
    if f.device != "cuda" or f.compile or not p.device_busy:
        return None
    elementwise = p.device_busy - p.device_matmul - p.device_communication
    share = p.share(elementwise)
    if share < ELEMENTWISE_SHARE:
        return None
    factor = p.step / max(1e-9, p.step - COMPILE_ELEMENTWISE_CUT * elementwise)
    return Advice("runtime.compile", "true", f"kernels other than matmuls and collectives (elementwise, norms, "
                  f"softmax) take {share:.0%} of the step", f"torch.compile fuses them; {factor_text(factor)} if "
                  f"fusion halves their time (an assumption: measure)", factor)


def precision_rule(p: Profile, f: Facts) -> Advice | None:
    """fp32 on a GPU with native bf16 -> runtime.precision=bf16."""
    if f.device != "cuda" or f.precision != "fp32" or not f.native_bf16 or f.bf16_speedup <= 1:
        return None
    share = p.share(p.device_matmul)
    if share < MATMUL_SHARE:
        return None
    factor = p.step / max(1e-9, p.step - p.device_matmul * (1 - 1 / f.bf16_speedup))
    return Advice("runtime.precision", "bf16", f"matmuls take {share:.0%} of the step in fp32 (TF32) on a GPU with "
                  f"native bf16 ({f.bf16_speedup:.1f}x the dense peak)", f"bf16 autocast, fp32 master weights kept; "
                  f"{factor_text(factor)}", factor)


def logits_rule(p: Profile, f: Facts) -> Advice | None:
    """The logits a large share of the kept memory, unchunked -> train.loss_chunk_tokens."""
    kept = p.activations + p.logits
    if f.loss_chunk_tokens > 0 or not kept or p.logits / kept < LOGITS_SHARE:
        return None
    after = f"{f.logits_chunked_bytes / GIB:.2f} GiB planned" if f.logits_chunked_bytes else "less"
    return Advice("train.loss_chunk_tokens", str(CHUNK), f"the logits are {p.logits / kept:.0%} of what a micro-batch "
                  f"keeps for backward ({p.logits / GIB:.2f} GiB measured): fp32 over the whole vocabulary at once",
                  f"logits memory {p.logits / GIB:.2f} GiB -> {after}; the same speed (BENCHMARKS.md)", None)


RULES = (padding_rule, micro_batch_rule, data_wait_rule, checkpointing_rule, offload_rule, communication_rule,
         compile_rule, precision_rule, logits_rule)


def advise(profile: Profile, facts: Facts) -> list[Advice]:
    """Every rule that fires, in the order of RULES."""
    return [a for rule in RULES if (a := rule(profile, facts)) is not None]


def combined_factor(profile: Profile, facts: Facts, advice: list[Advice]) -> float | None:
    """The expected tokens/s factor of following every layout and data advice at once (one step model, so the
    gains are not multiplied as if independent)."""
    keys = {a.key: a.value for a in advice}
    if not keys.keys() & {"train.packing", "train.micro_batch", "runtime.num_workers"}:
        return None
    packed = keys.get("train.packing") == "true" or facts.packing
    micro = int(keys.get("train.micro_batch", facts.micro_batch))
    new = predicted_step(profile, facts, packed, micro, data_wait="runtime.num_workers" not in keys)
    return base_step(profile) / new if new else None

"""Where a hybrid's training step spends its time, packed against padded (issue 55): per module kind, per op.

    uv run --group bench python benchmarks/hybrid_profile.py --models qwen3_5,falcon_h1 --hidden 128
    uv run --group bench python benchmarks/hybrid_profile.py --models qwen3_5 --hidden 768

The models and micro-batches of ``benchmarks/hybrid_packing.py`` (``--batch`` chat rows, sorted longest first, as
anyfit's sampler gives one micro-batch; padded: right-padded to the longest, transformers' SDPA; packed: one row, the
packing self-test's verdict). For each micro-batch, one process:
- the whole forward and backward, each side (medians over ``--micro`` micro-batches);
- each module kind alone (state layers, attention, MLPs, head and loss), forward and backward on the inputs it got in
  that step, the hooks of ``anyfit.model.state_layers`` included on the packed side: time per kind, and the rest
  (embeddings, norms, residuals, the model's own mask building) as the step minus their sum;
- the tokens each side computes: real, padded rows (``batch x longest``), the state layers' right-padded groups, and
  the same rounded up to the chunk size of their chunked fallbacks (64);
- ``torch.profiler`` over one packed and one padded step: the ops with the most self CPU time, and the hooks' own
  index_select / index_copy / cat (and their backward) on the packed side.
Also the packing self-test's time (``choose_packing``), against a step. Prints a report; ``--out`` writes it as JSON.
"""

from __future__ import annotations

import argparse
import functools
import json
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from hybrid_packing import _Lengths, chat_rows, model_config, twin_models  # noqa: E402

KINDS = ("state", "attention", "mlp", "head+loss")
HOOK_OPS = ("aten::index_select", "aten::index_copy", "aten::cat", "aten::index_add_", "aten::index_add",
            "aten::new_zeros", "aten::zeros", "aten::argsort")


def modules_by_kind(model) -> dict[str, list]:
    from anyfit.model.packing import state_modules

    state = state_modules(model)
    inside = {id(m) for s in state for m in s.modules()}
    kinds = {"state": state, "attention": [], "mlp": []}
    for name, module in model.named_modules():
        if id(module) in inside:
            continue
        if name.endswith(("self_attn", ".attention")):
            kinds["attention"].append(module)
        elif name.endswith((".mlp", ".feed_forward")):
            kinds["mlp"].append(module)
    return kinds


def _detached(value):
    if isinstance(value, torch.Tensor) and value.is_floating_point():
        return value.detach().clone().requires_grad_(True)
    if isinstance(value, tuple) and value and all(isinstance(v, torch.Tensor) for v in value):
        return tuple(_detached(v) for v in value)
    return value


def _first_tensor(output):
    return output if isinstance(output, torch.Tensor) else next(o for o in output if isinstance(o, torch.Tensor))


def capture(model, kinds, batch, step) -> dict[int, tuple]:
    """Each module's inputs in one step of ``batch`` (hooks prepended: they see the inputs before anyfit's)."""
    seen: dict[int, tuple] = {}

    def grab(module, args, kwargs):
        seen[id(module)] = (tuple(_detached(a) for a in args), {k: _detached(v) for k, v in kwargs.items()})

    handles = [m.register_forward_pre_hook(grab, with_kwargs=True, prepend=True) for ms in kinds.values() for m in ms]
    try:
        step(model, batch)
    finally:
        for h in handles:
            h.remove()
    return seen


def alone(module, args, kwargs) -> float:
    """Forward and backward of one module on its captured inputs (seconds)."""
    args, kwargs = tuple(_detached(a) for a in args), {k: _detached(v) for k, v in kwargs.items()}
    start = time.perf_counter()
    out = _first_tensor(module(*args, **kwargs))
    out.backward(torch.ones_like(out))
    return time.perf_counter() - start


def head_and_loss(model, batch) -> float:
    from anyfit.training.loss import cross_entropy_sum

    hidden = torch.randn(len(batch["keep_targets"]), model.config.hidden_size, requires_grad=True)
    start = time.perf_counter()
    logits = model.lm_head(hidden)
    cross_entropy_sum(logits, batch["keep_targets"], 1024, None, 1).backward()
    return time.perf_counter() - start


def step_seconds(model, batch) -> float:
    from anyfit.training.loss import token_loss_sum

    start = time.perf_counter()
    token_loss_sum(model, batch).backward()
    return time.perf_counter() - start


def token_counts(lengths: list[int], chunk: int = 64) -> dict[str, int]:
    from anyfit.model.state_layers import _Layout

    layout = _Layout(tuple(lengths), "cpu", chunk)
    up = lambda n: -(-n // chunk) * chunk  # noqa: E731
    longest = max(lengths)
    return {"real": sum(lengths), "padded rows": len(lengths) * longest,
            "padded rows, chunk-rounded": len(lengths) * up(longest),
            "state groups": sum(g.rows * g.longest for g in layout.groups),
            "state groups, chunk-rounded": sum(g.rows * up(g.longest) for g in layout.groups),
            "groups": len(layout.groups), "longest": longest, "examples": len(lengths),
            "chunk loop iterations, padded": up(longest) // chunk,
            "chunk loop iterations, groups": sum(up(g.longest) // chunk for g in layout.groups)}


def op_table(model, batch, top: int) -> tuple[list, dict[str, float]]:
    from torch.profiler import ProfilerActivity, profile

    step_seconds(model, batch)  # warm
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        step_seconds(model, batch)
    events = prof.key_averages()
    total = sum(e.self_cpu_time_total for e in events)
    rows = sorted(((e.key, e.self_cpu_time_total / 1e3, e.count) for e in events), key=lambda r: -r[1])
    hooks = {k: sum(e.self_cpu_time_total for e in events if e.key == k) / 1e3 for k in HOOK_OPS}
    backward = {e.key: e.self_cpu_time_total / 1e3 for e in events
                if e.key.startswith("autograd::engine::evaluate_function: Index")
                or e.key.startswith("autograd::engine::evaluate_function: CatBackward")}
    return rows[:top], {"total_ms": total / 1e3, **hooks, **backward}


def profile_family(family: str, args) -> dict:
    from anyfit.data.batching import IGNORE_INDEX, collate
    from anyfit.training.packing_check import choose_packing

    config = model_config(family, args.hidden)
    config.pad_token_id = config.vocab_size - 1
    rows = chat_rows(args.batch * (args.micro + 1), config.vocab_size, args.seed)
    examples = _Lengths({"input_ids": r["input_ids"], "labels": [t if m else IGNORE_INDEX for t, m in
                                                                 zip(r["input_ids"], r["completion_mask"])]}
                        for r in rows)
    packed_model, padded_model = twin_models(config)
    start = time.perf_counter()
    verdict = choose_packing(packed_model, examples, functools.partial(collate, pad_id=config.pad_token_id),
                             1024, "cpu", torch.float32)
    self_test = time.perf_counter() - start
    sides = {"packed": (packed_model, True), "padded": (padded_model, False)}
    times = {side: {k: [] for k in ("step", *KINDS)} for side in sides}
    counts = []
    for i in range(args.micro + 1):  # the first micro-batch warms up, untimed
        micro = sorted(examples[i * args.batch:(i + 1) * args.batch], key=lambda e: -len(e["input_ids"]))
        counts.append(token_counts([len(e["input_ids"]) for e in micro]))
        for side, (model, packed) in sides.items():
            batch = collate(micro, config.pad_token_id, packed=packed and verdict.packed)
            kinds = modules_by_kind(model)
            seen = capture(model, kinds, batch, step_seconds)
            step = step_seconds(model, batch)
            per_kind = {kind: sum(alone(m, *seen[id(m)]) for m in kinds[kind]) for kind in kinds}
            per_kind["head+loss"] = head_and_loss(model, batch)
            if i:
                times[side]["step"].append(step)
                for kind, t in per_kind.items():
                    times[side][kind].append(t)
            model.zero_grad(set_to_none=True)
    micro = sorted(examples[:args.batch], key=lambda e: -len(e["input_ids"]))
    ops = {side: op_table(model, collate(micro, config.pad_token_id, packed=packed and verdict.packed), args.top)
           for side, (model, packed) in sides.items()}
    medians = {side: {k: statistics.median(v) * 1e3 for k, v in t.items()} for side, t in times.items()}
    for side in medians:
        medians[side]["rest"] = medians[side]["step"] - sum(medians[side][k] for k in KINDS)
    return {"family": family, "hidden": args.hidden, "verdict": verdict.line, "self_test_s": self_test,
            "ms": medians, "ms_all": times, "tokens": counts[1:], "ops": ops}


def report(r: dict) -> str:
    lines = [f"## {r['family']}, hidden {r['hidden']}", r["verdict"],
             f"self-test {r['self_test_s']:.2f} s = {r['self_test_s'] * 1e3 / r['ms']['padded']['step']:.1f} "
             "padded steps", "", "| kind | packed ms | padded ms | packed / padded |", "|---|---|---|---|"]
    for kind in ("step", *KINDS, "rest"):
        p, q = r["ms"]["packed"][kind], r["ms"]["padded"][kind]
        lines.append(f"| {kind} | {p:.1f} | {q:.1f} | {p / q:.2f} |")
    keys = [k for k in r["tokens"][0] if k not in ("longest", "examples")]
    lines += ["", "tokens (median over micro-batches): " + ", ".join(
        f"{k} {statistics.median(t[k] for t in r['tokens']):,.0f}" for k in keys)]
    for side, (top, hooks) in r["ops"].items():
        lines += ["", f"{side}: top ops by self CPU ms (one step, profiled; total {hooks['total_ms']:.0f} ms)"]
        lines += [f"  {name} {ms:.1f} ({count})" for name, ms, count in top]
        lines += ["  hook-like ops: " + ", ".join(f"{k} {v:.1f}" for k, v in hooks.items() if k != "total_ms")]
    return "\n".join(lines)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--models", default="qwen3_5,falcon_h1")
    p.add_argument("--hidden", type=int, default=128)
    p.add_argument("--batch", type=int, default=16)
    p.add_argument("--micro", type=int, default=4, help="micro-batches timed (after one untimed)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--top", type=int, default=12)
    p.add_argument("--out", default="")
    args = p.parse_args()
    results = [profile_family(f, args) for f in args.models.split(",")]
    for r in results:
        print(report(r), flush=True)
    if args.out:
        Path(args.out).write_text(json.dumps(results, indent=1, default=str))


if __name__ == "__main__":
    main()

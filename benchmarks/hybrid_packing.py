"""Hybrid models packed against padded batches (issue 55): tokens/s and the per-step losses, side by side in one run.

    uv run --group bench python benchmarks/hybrid_packing.py --out benchmarks/results/hybrid_packing
    (--models qwen3_5,falcon_h1 picks models; --steps, --warmup, --examples, --batch, --seed change the defaults)

Models (random init, seed 0, fp32 on the CPU, with speed_vs_trl's WordLevel tokenizer):
- ``qwen3_5``: a tiny Qwen3.5-like text model: 4 layers, 3 Gated DeltaNet and 1 full attention (Qwen3.5's 3:1
  pattern), hidden 128;
- ``falcon_h1``: a tiny Falcon-H1 (Mamba-2 mixer beside attention in every layer), 4 layers, hidden 128.
Data: short chat rows as token ids, a prompt and an answer of log-normal lengths (medians 40 and 100 tokens, clipped
to [4, 512] and [8, 512]), the loss on the answer only (``completion_mask``).

First, in-process step pairs (``paired_steps``): the same micro-batches' forward and backward packed and padded, one
after the other. Then runs (each in its own process, through speed_vs_trl's child): ``packed`` (anyfit's defaults: the packing self-test
decides, here the state layers one example per row) and ``padded`` (``train.packing=false``: what every hybrid trained
on before issue 55). Both draw the same windows from the same seed, so the per-step losses must agree to fp32 round-off:
the largest relative difference is printed. tokens/s counts real tokens (never padding) over the steps after
``--warmup``; each variant runs ``--pairs`` times in turn, and the speed-up is the median of the pairs' ratios.
Writes ``--out``/results.json and results.md.
"""

from __future__ import annotations

import argparse
import json
import math
import random
import shutil
import statistics
import sys
import tempfile
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
from speed_vs_trl import (Workload, anyfit_spec, build_random_model, environment, fmt,  # noqa: E402
                          lognormal_lengths, run_child, summarise, write_rows)

RUNS = {"packed": "anyfit", "padded": "anyfit-no-packing"}  # this benchmark's name -> speed_vs_trl's variant


def model_config(family: str, hidden: int = 128):
    """The tiny model of ``family``; ``hidden`` widens it (heads of 32, MLP and state widths scaled alike) from
    the default 128 to a width where matrix products, not per-operation overhead, fill the step."""
    from transformers import AutoConfig

    heads = hidden // 32
    small = dict(hidden_size=hidden, intermediate_size=2 * hidden, num_hidden_layers=4, num_attention_heads=heads,
                 num_key_value_heads=heads // 2, head_dim=32, vocab_size=1000, max_position_embeddings=2048,
                 tie_word_embeddings=True)
    if family == "qwen3_5":
        return AutoConfig.for_model("qwen3_5_text", **small, layer_types=["linear_attention"] * 3 + ["full_attention"],
                                    linear_num_key_heads=heads // 2, linear_num_value_heads=heads,
                                    linear_key_head_dim=32, linear_value_head_dim=32)
    return AutoConfig.for_model("falcon_h1", **small, mamba_d_ssm=2 * hidden, mamba_n_heads=2 * heads,
                                mamba_d_head=32, mamba_n_groups=1, mamba_d_state=16, mamba_chunk_size=64)


def chat_rows(n: int, vocab: int, seed: int) -> list[dict[str, list[int]]]:
    """``n`` rows of a prompt and an answer of log-normal lengths, loss on the answer."""
    rng = random.Random(seed + 1)
    prompts = lognormal_lengths(n, seed, median=40, sigma=0.7, low=4, high=512)
    answers = lognormal_lengths(n, seed + 2, median=100, sigma=0.7, low=8, high=512)
    return [{"input_ids": [rng.randrange(vocab - 2) for _ in range(p + a)], "completion_mask": [0] * p + [1] * a}
            for p, a in zip(prompts, answers)]


def workload(family: str, args: argparse.Namespace, work: Path) -> Workload:
    model_dir, data = work / "model", work / "data.jsonl"
    vocab = build_random_model(model_dir, tiny=True, config=model_config(family, args.hidden))
    rows = chat_rows(args.examples, vocab, args.seed)
    write_rows(rows, data)
    config = json.loads((model_dir / "config.json").read_text())
    return Workload(name=family, device="cpu", model_dir=str(model_dir), data_path=str(data), n_examples=len(rows),
                    mean_length=sum(len(r["input_ids"]) for r in rows) / len(rows),
                    layers=config["num_hidden_layers"], hidden=config["hidden_size"], max_length=1024,
                    learning_rate=1e-4, steps=args.steps, lora=False, has_completion_mask=True,
                    notes=[f"random-init tiny {family}, short chat rows"])


def measure(family: str, args: argparse.Namespace, out: Path) -> dict[str, Any]:
    """``--pairs`` runs of each variant, packed and padded in turn (A B A B: a drift of the shared machine's speed
    moves both alike); tokens/s is each variant's median, the speed-up the median of the pairs' ratios."""
    work = Path(tempfile.mkdtemp(prefix=f"hybrid_packing_{family}_"))
    try:
        wl = workload(family, args, work)
        runs: dict[str, list[dict[str, Any]]] = {name: [] for name in RUNS}
        for pair in range(args.pairs):
            for name, variant in RUNS.items():
                spec = anyfit_spec(variant, wl, args, work)
                spec["overrides"] += [f"train.effective_batch={args.batch}", f"train.micro_batch={args.batch}"]
                spec.update(name=f"{family}-{name}", device="cpu", model_dir=wl.model_dir, data_path=wl.data_path)
                raw = run_child(spec, work, out / "logs" / f"{family}-{name}-{pair}.log")
                runs[name].append(summarise(name, "anyfit", spec["settings"], raw, wl, args.warmup, None))
                print(f"[{family} {name} {pair}] {fmt(runs[name][-1].get('tokens_per_s'), ',.0f')} tokens/s "
                      f"{runs[name][-1].get('error', '')}", flush=True)
        if any("error" in r for rs in runs.values() for r in rs):
            return {"model": family, "workload": wl.__dict__, "runs": runs}
        losses = [[s["loss"] for s in runs[n][0]["steps"]] for n in RUNS]
        tps = {n: [r["tokens_per_s"] for r in runs[n]] for n in RUNS}
        return {"model": family, "workload": wl.__dict__, "runs": runs, "tokens_per_s": tps,
                "loss_max_rel_diff": max(abs(a - b) / abs(b) for a, b in zip(*losses)),
                "median": {n: statistics.median(v) for n, v in tps.items()},
                "speedup": statistics.median(p / q for p, q in zip(tps["packed"], tps["padded"])),
                "packing_line": packing_line(out / "logs" / f"{family}-packed-0.log")}
    finally:
        shutil.rmtree(work, ignore_errors=True)


def paired_steps(family: str, args: argparse.Namespace) -> dict[str, Any]:
    """Forward and backward of the same micro-batches (``--batch`` examples drawn at random, sorted by length as
    anyfit's sampler does), packed as the self-test decides and padded through transformers' SDPA, one after the other,
    ``--step-pairs`` times: on a shared machine whose speed swings within a run, a pair a second apart is the fairest
    comparison. Returns each side's median tokens/s and the median (and range) of the pairs' ratios."""
    import functools
    import time

    import torch

    from anyfit.data.batching import IGNORE_INDEX, collate
    from anyfit.training.loss import token_loss_sum
    from anyfit.training.packing_check import choose_packing

    config = model_config(family, args.hidden)
    config.pad_token_id = config.vocab_size - 1
    rows = chat_rows(args.batch * args.step_pairs, config.vocab_size, args.seed)
    examples = _Lengths({"input_ids": r["input_ids"], "labels": [t if m else IGNORE_INDEX for t, m in
                                                                 zip(r["input_ids"], r["completion_mask"])]}
                        for r in rows)
    packed_model, padded_model = twin_models(config)
    verdict = choose_packing(packed_model, examples, functools.partial(collate, pad_id=config.pad_token_id),
                             1024, "cpu", torch.float32)

    def seconds(model, batch) -> float:
        start = time.perf_counter()
        token_loss_sum(model, batch).backward()
        return time.perf_counter() - start

    ratios, rates = [], {"packed": [], "padded": []}
    for i in range(args.step_pairs):
        micro = sorted(examples[i * args.batch:(i + 1) * args.batch], key=lambda e: -len(e["input_ids"]))
        tokens = sum(len(e["input_ids"]) for e in micro)
        packed = seconds(packed_model, collate(micro, config.pad_token_id, packed=verdict.packed))
        padded = seconds(padded_model, collate(micro, config.pad_token_id))
        rates["packed"].append(tokens / packed)
        rates["padded"].append(tokens / padded)
        ratios.append(padded / packed)
    return {"line": verdict.line, "tokens_per_s": {k: statistics.median(v) for k, v in rates.items()},
            "speedup": statistics.median(ratios), "range": [min(ratios), max(ratios)], "pairs": args.step_pairs}


def twin_models(config):
    """The same random model twice: for packed rows (``anyfit_varlen``) and for padded ones (transformers' SDPA).
    Each gets its own copy of ``config``: ``from_config`` sets the attention on the config object it is given, so
    a shared one would switch the packed model to SDPA too (its packed rows then run transformers' dense block mask
    over the whole row, which the step pairs before 2026-11-28 measured)."""
    import copy

    import torch
    from transformers import AutoModelForCausalLM

    from anyfit.model.attention import register

    register()
    torch.manual_seed(0)
    packed = AutoModelForCausalLM.from_config(copy.deepcopy(config), attn_implementation="anyfit_varlen")
    torch.manual_seed(0)
    padded = AutoModelForCausalLM.from_config(copy.deepcopy(config), attn_implementation="sdpa")
    return packed, padded


class _Lengths(list):
    """Examples with the ``lengths`` array the packing self-test reads of a token store's view."""

    @property
    def lengths(self):
        import numpy as np

        return np.asarray([len(e["input_ids"]) for e in self])


def packing_line(log: Path) -> str:
    return next((line.split("] ", 1)[1] for line in log.read_text(errors="replace").splitlines()
                 if line.startswith("[anyfit] packing:")), "")


def table(results: list[dict[str, Any]]) -> str:
    lines = ["| model | mean tokens/example | packed tokens/s (runs) | padded tokens/s (runs) | packed / padded "
             "(median of pairs) | step pairs: packed / padded | "
             "per-step losses, max rel. diff |", "|---|---|---|---|---|---|---|"]
    for r in results:
        pairs = f"{r['step_pairs']['speedup']:.2f}x" if r.get("step_pairs") else "not measured"
        if "speedup" not in r:
            runs = "not measured (--pairs 0)" if r.get("runs") == 0 else "FAILED: see logs"
            lines.append(f"| {r['model']} | {runs} | | | | {pairs} | |")
            continue
        m, t = r["median"], r["tokens_per_s"]
        lines.append(f"| {r['model']} | {r['workload']['mean_length']:.0f} | {m['packed']:,.0f} "
                     f"({', '.join(f'{v:,.0f}' for v in t['packed'])}) | {m['padded']:,.0f} "
                     f"({', '.join(f'{v:,.0f}' for v in t['padded'])}) | {r['speedup']:.2f}x | "
                     f"{pairs} | "
                     f"{r['loss_max_rel_diff']:.1e} |")
    return "\n".join(lines)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", default="benchmarks/results/hybrid_packing")
    p.add_argument("--models", default="qwen3_5,falcon_h1")
    p.add_argument("--steps", type=int, default=20)
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--examples", type=int, default=2000)
    p.add_argument("--batch", type=int, default=16, help="examples per step (one micro-batch)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--hidden", type=int, default=128, help="model width (128: the tiny models above)")
    p.add_argument("--pairs", type=int, default=3, help="runs of each variant, in turn")
    p.add_argument("--step-pairs", type=int, default=12, help="micro-batches timed packed then padded, in-process")
    args = p.parse_args()
    out = Path(args.out)
    (out / "logs").mkdir(parents=True, exist_ok=True)
    env = environment("cpu")
    print(f"[env] {env}", flush=True)
    results = []
    for family in args.models.split(","):
        steps = paired_steps(family, args) if args.step_pairs else None
        if steps:
            print(f"[{family} step pairs] packed {steps['tokens_per_s']['packed']:,.0f}, padded "
                  f"{steps['tokens_per_s']['padded']:,.0f} tokens/s, packed / padded {steps['speedup']:.2f}x "
                  f"(min {steps['range'][0]:.2f}x, max {steps['range'][1]:.2f}x over {steps['pairs']} pairs)",
                  flush=True)
        runs = measure(family, args, out) if args.pairs else {"model": family, "runs": 0}
        results.append({**runs, "step_pairs": steps})
    (out / "results.json").write_text(json.dumps({"env": env, "args": vars(args), "results": results}, indent=1))
    md = table(results)
    (out / "results.md").write_text(md + "\n")
    print(md)
    for r in results:
        print(f"{r['model']}: {r.get('packing_line', '')}")
    sys.exit(0 if all(r.get("runs") == 0 or math.isfinite(r.get("speedup", math.nan)) for r in results) else 1)


if __name__ == "__main__":
    main()

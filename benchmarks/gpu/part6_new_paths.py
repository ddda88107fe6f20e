"""Part 6: the CUDA paths added since the kit was built (issue 55's GPU workloads of its new benchmarks), each cell
pass/fail with its error, never aborting.

    python benchmarks/gpu/part6_new_paths.py --out DIR [--dry-run] [--budget SECONDS] [--only CELL,CELL]

Cells, in ``ORDER`` (each in its own process; sizes in ``SIZES``, the dry run's tiny on the CPU):

- ``hybrid-steps`` (in-process, ``anyfit_api``; benchmarks/hybrid_packing.py's paired steps at a realistic width): a
  random-init Qwen3.5-like text model (hidden 1024, 8 layers, 3 Gated DeltaNet : 1 attention) on log-normal short
  chat rows (prompt median 40, answer median 100 tokens, loss on the answer), bf16 autocast, fp32 weights. The same
  micro-batches' forward and backward, in turn: ``padded`` (transformers' SDPA), ``per_example`` (packed through
  anyfit_varlen, the state layers one example per row) and, where flash-linear-attention imports, ``kernels``
  (packed, the row's boundaries handed to fla's kernels as ``cu_seq_lens``). Real tokens/s of each (median over the
  timed batches) and each packed way's largest relative loss difference from padded. Also the packing self-test's
  verdict on the same model (which way a run would take). Fails where ``per_example`` differs from padded beyond
  bf16's round-off, or where the self-test picks ``kernels`` and they differ. Expected on the GPU: ``kernels``
  differs, since Qwen3.5's short convolution takes the boundaries only through the causal-conv1d extension (not
  bundled) and transformers' PyTorch fallback convolves across them; the self-test then keeps ``per_example``.
- ``expert-lora`` (command line): LoRA r=16 on a random-init Qwen3-MoE (6 layers, 64 experts of 1024x512, top 8;
  2.25 GiB of fp32 experts) on 1024-token rows, batch 8: ``frozen`` (lora.experts=false), ``peft``
  (lora.split_experts=false: PEFT forms W + BA per expert each forward) and ``split`` (the default: x·W + s·(x·A)·B).
  Peak ``torch.cuda.max_memory_allocated`` (the runs' ``peak_mem_gib``), median step time after the first two, and
  split's per-step losses against PEFT's (the same function: bf16 round-off).
- ``image-sft`` (command line): LoRA r=16 on a LLaVA-1.5 of tests/vlm_fixtures (its CLIP tower tiny, its Llama
  language model 1024 wide, 4 layers: ``save_vlm(text_config=...)``) on image records (one 64x48 image, a question
  and an answer of log-normal lengths): ``packed`` (the defaults: the self-test decides; anyfit_varlen on image
  rows) against ``padded`` (train.packing=false). The frozen base is bf16, so the images go in as bf16. Per-step
  losses (bf16 round-off), tokens/s, and the run's packing line.
- ``hybrid-runs`` (command line, last, while time is left): the hybrid model of ``hybrid-steps`` trained end to
  end, ``packed`` (defaults) against ``padded``: per-step losses, tokens/s, the packing line.

Writes results.json, new_paths.md (the table), cells.log (every child's output); run_all.sh adds part.log.
"""

from __future__ import annotations

import argparse
import importlib.metadata
import importlib.util
import json
import math
import random
import statistics
import sys
import time
import traceback
from pathlib import Path
from typing import Any

import kit

sys.path.insert(0, str(kit.REPO / "benchmarks"))
sys.path.insert(0, str(kit.REPO / "tests"))  # vlm_fixtures: the tests' VLM families and images
from hybrid_packing import _Lengths, chat_rows  # noqa: E402  (hybrid_packing.py's rows, at this width)

ORDER = ["hybrid-steps", "expert-lora", "image-sft", "hybrid-runs"]
# Relative loss differences packed/split against padded/PEFT: bf16's round-off over sums of thousands of token
# losses and a few optimizer steps (the tests' 1e-2 for one bf16 forward, doubled for the steps); fp32 in the dry run.
TOLERANCE = {"gpu": 2e-2, "dry": 1e-3}
HYBRID_LAYERS = {"gpu": 8, "dry": 4}
SIZES = {
    "gpu": {
        "hybrid": dict(hidden_size=1024, intermediate_size=3072, num_attention_heads=8, num_key_value_heads=2,
                       head_dim=128, linear_num_key_heads=8, linear_num_value_heads=8, linear_key_head_dim=128,
                       linear_value_head_dim=128, max_position_embeddings=4096, tie_word_embeddings=True),
        "hybrid_batch": 32, "hybrid_warmup": 2, "hybrid_timed": 6, "hybrid_steps": 10,
        "moe": dict(hidden_size=1024, intermediate_size=3072, moe_intermediate_size=512, num_experts=64,
                    num_experts_per_tok=8, num_hidden_layers=6, num_attention_heads=16, num_key_value_heads=4,
                    head_dim=64, max_position_embeddings=4096, tie_word_embeddings=True),
        "moe_length": 1024, "moe_batch": 8, "moe_steps": 8,
        "vlm_text": dict(hidden_size=1024, intermediate_size=2816, num_hidden_layers=4, num_attention_heads=16,
                         num_key_value_heads=4, head_dim=64, max_position_embeddings=4096, initializer_range=0.02),
        "vlm_records": 512, "vlm_batch": 32, "vlm_steps": 10,
    },
    "dry": {
        "hybrid": dict(hidden_size=64, intermediate_size=128, num_attention_heads=4, num_key_value_heads=2,
                       head_dim=16, linear_num_key_heads=2, linear_num_value_heads=4, linear_key_head_dim=16,
                       linear_value_head_dim=16, max_position_embeddings=2048, tie_word_embeddings=True),
        "hybrid_batch": 4, "hybrid_warmup": 1, "hybrid_timed": 1, "hybrid_steps": 2,
        "moe": dict(hidden_size=64, intermediate_size=128, moe_intermediate_size=32, num_experts=8,
                    num_experts_per_tok=2, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                    head_dim=16, max_position_embeddings=2048, tie_word_embeddings=True),
        "moe_length": 128, "moe_batch": 2, "moe_steps": 3,
        "vlm_text": None, "vlm_records": 16, "vlm_batch": 4, "vlm_steps": 2,
    },
}
EXPERT_RUNS = {"frozen": ["lora.experts=false"], "peft": ["lora.split_experts=false"], "split": []}
PACKING_RUNS = {"packed": [], "padded": ["train.packing=false"]}


def sizes(dry_run: bool) -> dict[str, Any]:
    return SIZES["dry" if dry_run else "gpu"]


def hybrid_dims(dry_run: bool) -> dict[str, Any]:
    layers = HYBRID_LAYERS["dry" if dry_run else "gpu"]
    return dict(sizes(dry_run)["hybrid"], num_hidden_layers=layers,
                layer_types=(["linear_attention"] * 3 + ["full_attention"]) * (layers // 4))


def fla_status() -> tuple[bool, str]:
    """Whether flash-linear-attention imports as transformers imports it (``import fla``: on failure transformers
    falls back to its PyTorch reference silently), and its version or the error."""
    if importlib.util.find_spec("fla") is None:
        return False, "not installed (carry .whl/fla)"
    try:
        import fla  # noqa: F401  (what transformers' use_kernel_func_from_hub_with_fallback imports)
        from fla.ops.gated_delta_rule import chunk_gated_delta_rule  # noqa: F401  (Qwen3.5's Gated DeltaNet kernel)
    except Exception as e:  # noqa: BLE001 - any failure means transformers runs its PyTorch reference
        return False, f"import fails: {type(e).__name__}: {e}"[:300]
    return True, f"flash-linear-attention {importlib.metadata.version('flash-linear-attention')}"


def fla_available() -> bool:
    return fla_status()[0]


# ------------------------------------------------------------------------------------------------------------
# hybrid-steps (child process)
# ------------------------------------------------------------------------------------------------------------

def hybrid_examples(n: int, vocab: int) -> list[dict]:
    """chat_rows as anyfit's examples: the loss on the answer (labels IGNORE_INDEX on the prompt)."""
    return _Lengths({"input_ids": r["input_ids"],
                     "labels": [t if m else kit.IGNORE_INDEX for t, m in zip(r["input_ids"], r["completion_mask"])]}
                    for r in chat_rows(n, vocab, seed=0))


def step(model, batch: dict, dev: str, autocast) -> tuple[float, float]:
    """One forward and backward of ``batch``: seconds (the device's work included) and the summed loss."""
    import torch

    import anyfit_api as api

    batch = {k: v.to(dev) if isinstance(v, torch.Tensor) else v for k, v in batch.items()}
    if dev == "cuda":
        torch.cuda.synchronize()
    t0 = time.perf_counter()
    with autocast():
        loss = api.token_loss_sum(model, batch)
    loss.backward()
    if dev == "cuda":
        torch.cuda.synchronize()
    seconds = time.perf_counter() - t0
    model.zero_grad(set_to_none=True)
    return seconds, float(loss)


def cell_hybrid_steps(ctx: dict) -> dict:
    import contextlib
    import functools

    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    import anyfit_api as api

    dev = "cuda" if torch.cuda.is_available() else "cpu"
    size = sizes(ctx["dry_run"])
    config = AutoConfig.for_model("qwen3_5_text", vocab_size=ctx["vocab"], pad_token_id=ctx["pad_id"],
                                  **hybrid_dims(ctx["dry_run"]))
    bf16 = dev == "cuda"
    autocast = (lambda: torch.autocast("cuda", dtype=torch.bfloat16)) if bf16 else contextlib.nullcontext
    batches = size["hybrid_warmup"] + size["hybrid_timed"]
    examples = hybrid_examples(size["hybrid_batch"] * batches, ctx["ids"])
    name = api.register_varlen_attention()

    def model(attention: str):
        torch.manual_seed(0)
        return AutoModelForCausalLM.from_config(config, attn_implementation=attention).to(dev)

    rows = functools.partial(api.collate, pad_id=config.pad_token_id)
    judged = model(name)  # the self-test leaves its hooks on the model it judges: a model of its own
    verdict = api.choose_packing(judged, examples, rows, 1024, dev, torch.bfloat16 if bf16 else torch.float32,
                                 autocast)
    del judged
    padded, packed = model("sdpa"), model(name)
    ways = ["padded", "per_example"] + (["kernels"] if dev == "cuda" and fla_available() else [])
    seconds: dict[str, list[float]] = {w: [] for w in ways}
    losses: dict[str, list[float]] = {w: [] for w in ways}
    tokens: list[int] = []
    for i in range(batches):
        micro = sorted(examples[i * size["hybrid_batch"]:(i + 1) * size["hybrid_batch"]],
                       key=lambda e: -len(e["input_ids"]))  # as anyfit's sampler lays out a micro-batch
        for way in ways:
            if way == "padded":
                dt, loss = step(padded, rows(micro), dev, autocast)
            else:
                hooks = api.Boundaries(packed, api.WAYS[way])
                try:
                    dt, loss = step(packed, rows(micro, packed=True), dev, autocast)
                finally:
                    hooks.remove()
            if i >= size["hybrid_warmup"]:
                seconds[way].append(dt)
            losses[way].append(loss)
        if i >= size["hybrid_warmup"]:
            tokens.append(sum(len(e["input_ids"]) for e in micro))
    tol = TOLERANCE["gpu" if bf16 else "dry"]
    out: dict[str, Any] = {"device": dev, "precision": "bf16 autocast" if bf16 else "fp32", "ways": ways,
                           "fla": fla_status()[1], "verdict": verdict.line, "verdict_state": verdict.state,
                           "tolerance": tol, "mean_tokens_per_example": statistics.mean(
                               len(e["input_ids"]) for e in examples), "losses": losses}
    for way in ways:
        out[f"tokens_per_s_{way}"] = statistics.median(t / s for t, s in zip(tokens, seconds[way]))
        if way != "padded":
            out[f"max_rel_loss_diff_{way}"] = max(abs(a - b) / abs(b) for a, b in zip(losses[way], losses["padded"]))
            out[f"speedup_{way}"] = out[f"tokens_per_s_{way}"] / out["tokens_per_s_padded"]
    assert out["max_rel_loss_diff_per_example"] <= tol, \
        f"per_example packed differs from padded by {out['max_rel_loss_diff_per_example']:.2e} (tolerance {tol:.0e})"
    if verdict.state == api.WAYS["kernels"]:
        diff = out.get("max_rel_loss_diff_kernels")
        assert diff is not None and diff <= tol, f"the self-test picked kernels, which differ from padded by {diff}"
    return out


CELL_FUNCTIONS = {"hybrid-steps": cell_hybrid_steps}


def child(names: list[str], ctx_path: Path) -> None:
    ctx = json.loads(ctx_path.read_text())
    kit.run_cells(names, CELL_FUNCTIONS, ctx, ctx_path.parent)


def in_process_cell(name: str, args, ctx: dict, results: kit.Results, log: Path) -> None:
    ctx_path = args.work / "context.json"
    ctx_path.write_text(json.dumps(ctx, default=str))
    (args.work / f"cell-{name}.json").unlink(missing_ok=True)
    cmd = [sys.executable, str(Path(__file__).resolve()), "--out", str(args.out), "--work", str(args.work),
           "--cell", name]
    res = kit.run_logged(cmd, log, timeout=min(240, args.deadline.left()))
    path = args.work / f"cell-{name}.json"
    if path.is_file():
        results.cell(name, **json.loads(path.read_text()))
    else:
        results.cell(name, status="fail", error=kit.error_line(res), wall_s=res["wall_s"])


# ------------------------------------------------------------------------------------------------------------
# Command-line cells (parent)
# ------------------------------------------------------------------------------------------------------------

def common(args, name: str, model: Path, data: Path, steps: int, batch: int, length: int) -> list[str]:
    return [f"model.name_or_path={model}", f"data.path={data}", f"data.max_length={length}",
            f"train.output_dir={args.work / name}", "train.overwrite=true", f"train.effective_batch={batch}",
            f"train.micro_batch={batch}", f"train.max_steps={steps}", "train.learning_rate=1e-4",
            "train.log_every=1", "train.save_every=0", "train.seed=0"] + (["runtime.device=cpu"] if args.dry_run else [])


def run_variants(args, cell: str, variants: dict[str, list[str]], base: list[str], log: Path,
                 timeout: float = 180) -> dict[str, dict[str, Any]]:
    """``anyfit train`` once per variant (``base`` with the variant's output folder and overrides): per-step
    losses, peak memory, median step seconds and tokens/s after the first two steps, the packing line; a run that
    could not start in time is left out."""
    import anyfit_api as api

    runs: dict[str, dict[str, Any]] = {}
    for variant, extra in variants.items():
        name = f"{cell}-{variant}"
        over = [o for o in base if not o.startswith("train.output_dir=")] + \
            [f"train.output_dir={args.work / name}", *extra]
        api.validate(over)
        if args.deadline.left() < 45:
            runs[variant] = {"error": "out of time (the part's budget)", "skipped": True}
            continue
        res = kit.run_logged(kit.anyfit_cmd("train", *over), log, timeout=min(timeout, args.deadline.left()))
        run = kit.read_run(args.work / name)
        steady = run["steps"][2:] or run["steps"]
        row: dict[str, Any] = {"overrides": extra, "wall_s": res["wall_s"], "losses": kit.losses(run),
                               "peak_mem_gib": max((r.get("peak_mem_gib", 0) for r in run["steps"]), default=None),
                               "packing": (run["run_info"].get("packing") or {}).get("line")}
        if steady:
            row["tokens_per_s"] = statistics.median(r["tokens_per_s"] for r in steady)
            row["step_s"] = statistics.median(r["real_tokens"] / r["tokens_per_s"] for r in steady
                                              if r.get("tokens_per_s"))
        if res["rc"] != 0 or not kit.finite(row["losses"]):
            row["error"] = kit.error_line(res)
        runs[variant] = row
    return runs


def compare(results: kit.Results, cell: str, runs: dict, pairs: list[tuple[str, str]], tol: float,
            **fields: Any) -> None:
    """The cell's result: fail where a run failed or a pair's per-step losses differ beyond ``tol``."""
    errors = [f"{v}: {r['error']}" for v, r in runs.items() if r.get("error") and not r.get("skipped")]
    for a, b in pairs:
        if runs.get(a, {}).get("losses") and runs.get(b, {}).get("losses"):
            diff = kit.max_rel_diff(runs[a]["losses"], runs[b]["losses"])
            fields[f"max_rel_loss_diff_{a}_vs_{b}"] = diff
            if diff is None or diff > tol:
                errors.append(f"{a} and {b} per-step losses differ by {diff} (tolerance {tol:.0e})")
    done = [v for v, r in runs.items() if not r.get("skipped")]
    status = "fail" if errors else "pass" if done else "skip"
    results.cell(cell, status=status, runs=runs, tolerance=tol, **fields,
                 **({"error": "; ".join(errors)[:600]} if errors else {}),
                 **({"note": f"out of time after {done}"} if len(done) < len(runs) else {}))


def cell_expert_lora(args, ctx: dict, results: kit.Results, log: Path) -> None:
    size = sizes(args.dry_run)
    model = kit.save_random_model(args.work / "model-moe", "qwen3_moe", size["moe"], ctx["tokenizer"])
    data = kit.write_jsonl(args.work / "moe-tokens.jsonl",
                           kit.token_rows(size["moe_batch"] * size["moe_steps"], ctx["ids"] + 298,
                                          length=size["moe_length"]))  # token_rows draws below vocab - 300
    base = common(args, "expert-lora", model, data, size["moe_steps"], size["moe_batch"], size["moe_length"]) + \
        ["data.format=tokens", "lora.enabled=true", "lora.r=16", "lora.alpha=32", "lora.dropout=0.0"]
    runs = run_variants(args, "expert-lora", EXPERT_RUNS, base, log)
    d = size["moe"]
    experts_gib = d["num_hidden_layers"] * d["num_experts"] * 3 * d["hidden_size"] * d["moe_intermediate_size"] * 4 \
        / 2**30
    frozen = runs.get("frozen", {}).get("peak_mem_gib")
    fields = {"experts_fp32_gib": round(experts_gib, 3)}
    for v in ("peft", "split"):
        mine = runs.get(v, {}).get("peak_mem_gib")
        if mine is not None and frozen is not None:
            fields[f"peak_above_frozen_gib_{v}"] = round(mine - frozen, 3)
        if runs.get(v, {}).get("step_s") and runs.get("frozen", {}).get("step_s"):
            fields[f"step_vs_frozen_{v}"] = round(runs[v]["step_s"] / runs["frozen"]["step_s"], 3)
    compare(results, "expert-lora", runs, [("split", "peft")], TOLERANCE["dry" if args.dry_run else "gpu"], **fields)


def image_records(folder: Path, n: int) -> Path:
    """``n`` TRL-shaped records, one 64x48 random-pixel PNG each (tests/vlm_fixtures.write_image), a question and
    an answer of log-normal word counts (medians 12 and 20), paths relative to the data file."""
    from vlm_fixtures import write_image

    rng = random.Random(0)
    words = ("red", "green", "blue", "sky", "field", "wall", "left", "right", "top", "bottom", "light", "dark")

    def text(median: float) -> str:
        k = min(120, max(1, int(rng.lognormvariate(math.log(median), 0.7))))
        return " ".join(rng.choice(words) for _ in range(k))

    records = []
    for i in range(n):
        rel = f"images/{i:05d}.png"
        write_image(folder / rel, seed=i)
        messages = [{"role": "user", "content": [{"type": "image"},
                                                 {"type": "text", "text": f"Describe the image: {text(12)}?"}]},
                    {"role": "assistant", "content": [{"type": "text", "text": text(20) + "."}]}]
        records.append({"messages": messages, "images": [rel]})
    return kit.write_jsonl(folder / "data.jsonl", records)


def cell_image_sft(args, ctx: dict, results: kit.Results, log: Path) -> None:
    from vlm_fixtures import missing_for, save_vlm

    size = sizes(args.dry_run)
    if why := missing_for("llava"):
        results.cell("image-sft", status="fail", error=why)
        return
    model = args.work / "model-llava"
    if not (model / "config.json").is_file():
        save_vlm(model, "llava", text_config=size["vlm_text"])
    data = image_records(args.work / "images", size["vlm_records"])
    base = common(args, "image-sft", model, data, size["vlm_steps"], size["vlm_batch"], 512) + \
        ["data.template=chat", f"data.cache_dir={args.work / 'image-cache'}", "lora.enabled=true", "lora.r=16",
         "lora.alpha=32", "lora.dropout=0.0"]
    runs = run_variants(args, "image-sft", PACKING_RUNS, base, log, timeout=240)
    fields: dict[str, Any] = {}
    if runs.get("packed", {}).get("tokens_per_s") and runs.get("padded", {}).get("tokens_per_s"):
        fields["speedup_packed"] = runs["packed"]["tokens_per_s"] / runs["padded"]["tokens_per_s"]
    fields["packed_rows"] = "packing: self-test passed" in (runs.get("packed", {}).get("packing") or "")
    compare(results, "image-sft", runs, [("packed", "padded")], TOLERANCE["dry" if args.dry_run else "gpu"], **fields)


def cell_hybrid_runs(args, ctx: dict, results: kit.Results, log: Path) -> None:
    size = sizes(args.dry_run)
    model = kit.save_random_model(args.work / "model-hybrid", "qwen3_5_text", hybrid_dims(args.dry_run),
                                  ctx["tokenizer"])
    rows = chat_rows(size["hybrid_batch"] * size["hybrid_steps"], ctx["ids"], seed=0)
    data = kit.write_jsonl(args.work / "hybrid-rows.jsonl", rows)
    base = common(args, "hybrid-runs", model, data, size["hybrid_steps"], size["hybrid_batch"], 1024) + \
        ["data.format=tokens"]
    runs = run_variants(args, "hybrid-runs", PACKING_RUNS, base, log)
    fields: dict[str, Any] = {"fla": fla_status()[1]}
    if runs.get("packed", {}).get("tokens_per_s") and runs.get("padded", {}).get("tokens_per_s"):
        fields["speedup_packed"] = runs["packed"]["tokens_per_s"] / runs["padded"]["tokens_per_s"]
    compare(results, "hybrid-runs", runs, [("packed", "padded")], TOLERANCE["dry" if args.dry_run else "gpu"],
            **fields)


CLI_CELLS = {"expert-lora": cell_expert_lora, "image-sft": cell_image_sft, "hybrid-runs": cell_hybrid_runs}


# ------------------------------------------------------------------------------------------------------------
# The part (parent)
# ------------------------------------------------------------------------------------------------------------

def write_table(results: kit.Results, path: Path) -> None:
    rows = []
    for name, c in results.data["cells"].items():
        if "runs" in c:
            for variant, r in c["runs"].items():
                rows.append([name, variant, c.get("status"), r.get("tokens_per_s"), r.get("step_s"),
                             r.get("peak_mem_gib"), (r.get("packing") or "")[:140], (r.get("error") or "")[:160]])
        else:
            for way in c.get("ways", []):
                diff = c.get(f"max_rel_loss_diff_{way}")
                note = "the reference" if way == "padded" else f"max rel loss diff vs padded {diff:.2e}"
                rows.append([name, way, c.get("status"), c.get(f"tokens_per_s_{way}"), None, None, note,
                             (c.get("error") or "")[:160]])
            if not c.get("ways"):
                rows.append([name, "", c.get("status"), None, None, None, c.get("note", ""),
                             (c.get("error") or "")[:160]])
    env = results.data["env"]
    head = (f"New CUDA paths on {env.get('gpu') or 'CPU (dry run)'}, torch {env.get('torch')}, transformers "
            f"{env.get('transformers')}, flash-linear-attention: {results.data.get('fla')}. Cells' numbers "
            "(loss differences, speed-ups, peaks above frozen experts) are in results.json.\n\n")
    path.write_text(head + kit.markdown_table(["cell", "run / way", "status", "tokens/s", "step s", "peak GiB",
                                               "packing / note", "error"], rows))


def main() -> int:
    args = kit.part_args(__doc__.split("\n\n")[0], lambda p: (
        p.add_argument("--only", default="", help="comma-separated cells (default: all, in ORDER): " + ", ".join(ORDER)),
        p.add_argument("--cell", help=argparse.SUPPRESS)))
    if args.cell:
        child(args.cell.split(","), args.work / "context.json")
        return 0
    args.deadline = kit.Deadline(args.budget)
    results = kit.Results(args.out / "results.json", "part6", args.dry_run)
    log = args.out / "cells.log"
    tok = kit.cut_tokenizer_dir(args.work / "tokenizer-cut")
    from transformers import AutoTokenizer

    t = AutoTokenizer.from_pretrained(tok)
    # Token ids are drawn below the first special token (chat_rows draws below ``ids`` - 2): ordinary tokens only,
    # no EOS or padding inside a row. The models' vocabulary is the tokenizer's.
    ctx = {"dry_run": args.dry_run, "tokenizer": str(tok), "vocab": len(t), "ids": min(t.all_special_ids) + 2,
           "pad_id": t.pad_token_id}
    results.data["fla"] = fla_status()[1]
    print(f"[part6] flash-linear-attention: {results.data['fla']}", flush=True)
    for name in (n for n in ORDER if not args.only or n in args.only.split(",")):
        if args.deadline.left() < 45:
            results.cell(name, status="skip", note="out of time (the part's budget)")
            continue
        try:
            if name in CELL_FUNCTIONS:
                in_process_cell(name, args, ctx, results, log)
            else:
                CLI_CELLS[name](args, ctx, results, log)
        except Exception as e:  # noqa: BLE001 - a broken cell is recorded, the part goes on
            traceback.print_exc()
            results.cell(name, status="fail", error=f"{type(e).__name__}: {e}"[:600])
    write_table(results, args.out / "new_paths.md")
    print((args.out / "new_paths.md").read_text(), flush=True)
    failed = results.failed()
    print(f"[part6] {len(results.data['cells']) - len(failed)} cells ok, {len(failed)} failed: {failed}", flush=True)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())

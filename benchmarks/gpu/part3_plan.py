"""Part 3: the planner's CUDA memory estimates against measured CUDA peaks (full, LoRA, QLoRA; with and without
gradient checkpointing), the CUDA counterpart of benchmarks/plan_vs_measured.py.

    python benchmarks/gpu/part3_plan.py --out DIR [--dry-run] [--budget SECONDS]

Per case, both through the command line with the same overrides: ``python -m anyfit plan --json --device local``
(the plan for this GPU) and ``python -m anyfit train`` (3 optimizer steps: the peak comes once AdamW states
exist). The model is random-init Qwen2.5-0.5B-shaped with Qwen2.5's tokenizer; every example is exactly
``SEQ`` tokens (pre-tokenized, every token trained), so no micro-batch is padded and the plan's sequence length
is the real one; effective batch 8. The plan picks the micro-batch as ``micro_batch=auto`` would (8 on an H100),
so the run is trained with the plan's own setup (its ``setup.config`` overrides): like for like by construction.

Compared: predicted = the plan's peak per device minus its fixed runtime overhead (``overhead_gib``: CUDA
context and allocator slack, which ``max_memory_allocated`` does not count), measured = the largest
``peak_mem_gib`` in metrics.jsonl (``torch.cuda.max_memory_allocated``: the whole run, model loading included);
a case more than 15% off is flagged. The plan's step time is set against the measured one too (information).

Writes results.json, plan_vs_measured.md (the table) and runs.log.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

import kit

SEQ = 1024
CKPT = "model.gradient_checkpointing=true"
QLORA = ["lora.enabled=true", "lora.qlora=true"]
CASES = {
    "full": [], "full+ckpt": [CKPT],
    "lora": ["lora.enabled=true"], "lora+ckpt": ["lora.enabled=true", CKPT],
    "qlora": QLORA, "qlora+ckpt": [*QLORA, CKPT],
}
DRY_RUN_CASES = ("full",)  # trained on CPU in the dry run; the others are planned or validated only
TOLERANCE = 0.15


def base_overrides(args, ctx: dict, name: str) -> list[str]:
    steps = 1 if args.dry_run else 3
    return [f"model.name_or_path={ctx['model']}", f"data.path={ctx['tokens']}", "data.format=tokens",
            f"data.max_length={ctx['seq']}", f"train.output_dir={args.work / name.replace('+', '-')}",
            "train.overwrite=true", "train.effective_batch=8", f"train.max_steps={steps}",
            "train.learning_rate=1e-5", "train.log_every=1", "train.seed=0"] + \
        (["runtime.device=cpu"] if args.dry_run else [])


def plan_case(args, overrides: list[str], log: Path) -> dict[str, Any]:
    """``anyfit plan --json`` for this GPU (the H100 preset in the dry run, which has no GPU)."""
    device = "h100" if args.dry_run else "local"
    out = args.work / "plan.json"
    cmd = kit.anyfit_cmd("plan", "--json", "--device", device, *[o for o in overrides if o != "runtime.device=cpu"])
    res = kit.run_logged(cmd, log, timeout=min(120, args.deadline.left()), stdout=out)
    assert res["rc"] == 0, "anyfit plan: " + kit.error_line(res)
    target = json.loads(out.read_text())["targets"][0]
    mem, setup = target["memory"], target["setup"] or {}
    assert mem, f"the plan has no memory estimate: {target['verdict']}"
    return {"target": target["name"], "verdict": target["verdict"], "setup": setup,
            "predicted_gib": round(mem["peak_gib"] - mem["overhead_gib"], 3), "plan_peak_gib": mem["peak_gib"],
            "overhead_gib": mem["overhead_gib"], "phase": mem["phase"],
            "breakdown_gib": {k: v for k, v in mem.items() if k.endswith("_gib")},
            "plan_step_s": (target.get("step_time") or {}).get("total_s")}


def setup_differs(case: str, setup: dict) -> list[str]:
    """Where the plan's setup is not the configured run (then the comparison is not like for like)."""
    want = {"gradient_checkpointing": "ckpt" in case, "optimizer": "adamw", "fsdp": False,
            "method": "qlora" if case.startswith("qlora") else "lora" if case.startswith("lora") else "full"}
    return [f"{k}: plan {setup.get(k)!r}, run {v!r}" for k, v in want.items() if setup.get(k) != v]


def run_case(args, ctx: dict, case: str, log: Path, results: kit.Results) -> None:
    import anyfit_api as api

    overrides = base_overrides(args, ctx, case) + CASES[case]
    api.validate(overrides)
    planned = args.dry_run and case not in ("full", "qlora")
    if planned:
        results.cell(case, status="checked", note="config validated (dry run)", overrides=CASES[case])
        return
    fields: dict[str, Any] = {"overrides": CASES[case], **plan_case(args, overrides, log)}
    fields["plan_setup_differs"] = setup_differs(case, fields["setup"])
    if args.dry_run and case not in DRY_RUN_CASES:
        results.cell(case, status="checked", note="planned, not trained (dry run)", **fields)
        return
    overrides += fields["setup"].get("config", [])  # the plan's micro-batch (and any saver it added: flagged)
    res = kit.run_logged(kit.anyfit_cmd("train", *overrides), log, timeout=min(180, args.deadline.left()))
    run = kit.read_run(args.work / case.replace("+", "-"))
    if res["rc"] != 0 or not run["steps"]:
        results.cell(case, status="fail", error=kit.error_line(res), wall_s=res["wall_s"], **fields)
        return
    measured = max(r["peak_mem_gib"] for r in run["steps"])
    last = run["steps"][-1]
    error = fields["predicted_gib"] / measured - 1
    fields.update(measured_gib=measured, rel_error=round(error, 4), within_15_percent=abs(error) <= TOLERANCE,
                  micro_batch=last.get("micro_batch"),
                  measured_step_s=round(8 * ctx["seq"] / last["tokens_per_s"], 4), losses=kit.losses(run),
                  wall_s=res["wall_s"])
    results.cell(case, status="pass" if abs(error) <= TOLERANCE or args.dry_run else "off",
                 note=f"predicted {fields['predicted_gib']:.2f} GiB, measured {measured:.2f} GiB ({error:+.1%})",
                 **fields)


def write_table(results: kit.Results, path: Path, args) -> None:
    rows = []
    for case, c in results.data["cells"].items():
        if "measured_gib" not in c:
            rows.append([case, c.get("predicted_gib"), None, None, c.get("status"), None, None,
                         c.get("error") or c.get("note")])
            continue
        rows.append([case, c["predicted_gib"], c["measured_gib"], f"{c['rel_error']:+.1%}",
                     "ok" if c["within_15_percent"] else "**off by more than 15%**", c.get("plan_step_s"),
                     c.get("measured_step_s"), "; ".join(c["plan_setup_differs"]) or c.get("phase")])
    env = results.data["env"]
    head = (f"Planner vs measured on {env.get('gpu') or 'CPU (dry run)'}, torch {env.get('torch')}, transformers "
            f"{env.get('transformers')}; random-init Qwen2.5-0.5B shape (dry run: tiny), {args.seq} tokens per "
            f"example, effective batch 8 at the plan's micro-batch, bf16 autocast. Predicted = `anyfit plan` peak "
            "minus its runtime overhead; measured = max `peak_mem_gib` (torch.cuda.max_memory_allocated).\n\n")
    path.write_text(head + kit.markdown_table(
        ["case", "predicted GiB", "measured GiB", "error", "verdict", "plan step s", "measured step s", "notes"], rows))


def main() -> int:
    args = kit.part_args(__doc__.split("\n\n")[0], lambda p: p.add_argument(
        "--seq", type=int, default=None, help=f"tokens per example ({SEQ}; dry run 64)"))
    args.seq = args.seq or (64 if args.dry_run else SEQ)
    args.deadline = kit.Deadline(args.budget)
    results = kit.Results(args.out / "results.json", "part3", args.dry_run)
    tok = kit.qwen_tokenizer_dir(args.work / "tokenizer")
    model = kit.save_model(args.work / ("model-tiny" if args.dry_run else "model-0.5b"),
                           "tiny" if args.dry_run else "qwen2.5-0.5b", tok)
    vocab = json.loads((model / "config.json").read_text())["vocab_size"]
    ctx = {"model": model, "seq": args.seq,
           "tokens": kit.write_jsonl(args.work / "tokens.jsonl", kit.token_rows(64, vocab, length=args.seq))}
    log = args.out / "runs.log"
    for case in CASES:
        if args.deadline.left() < 45:
            results.cell(case, status="skip", note="out of time (the part's budget)")
            continue
        try:
            run_case(args, ctx, case, log, results)
        except Exception as e:  # noqa: BLE001 - one broken case does not stop the others
            results.cell(case, status="fail", error=f"{type(e).__name__}: {e}"[:600])
    write_table(results, args.out / "plan_vs_measured.md", args)
    print((args.out / "plan_vs_measured.md").read_text(), flush=True)
    failed = results.failed()
    print(f"[part3] failed: {failed}", flush=True)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())

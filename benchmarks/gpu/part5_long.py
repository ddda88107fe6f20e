"""Part 5: the longest sequence a Qwen2.5-0.5B-shaped model trains on one GPU, rung by rung (issue 34), and the
planner's peak for each run beside the measured one.

    python benchmarks/gpu/part5_long.py --out DIR [--dry-run] [--budget SECONDS]

Rungs (each adds to the one before): gradient checkpointing; + the fused loss (no logits of all positions);
+ the tiled MLP and activation offload. Per rung the sequence doubles from ``START`` tokens until a one-step run
fails (out of memory or the part's time) or reaches ``STOP``. One example per step, every token trained (the
reasoning-trace case: the logits of every position exist unless the loss is fused), full fine-tuning, bf16
autocast, 8-bit AdamW off (torch's fused AdamW). Measured: ``peak_mem_gib`` (``torch.cuda.max_memory_allocated``)
and the step's tokens/s; planned: ``anyfit plan --json --device local`` with the same overrides.

Writes results.json, long.md (the table) and runs.log.
"""

from __future__ import annotations

import json
import sys
from typing import Any

import kit

START, STOP = 8192, 262144
CKPT = ["model.gradient_checkpointing=true"]
RUNGS = {
    "checkpointing": CKPT,
    "+fused loss": [*CKPT, "train.fused_loss=true"],
    "+tiled MLP, activation offload": [*CKPT, "train.fused_loss=true", "model.tiled_mlp=true",
                                       "model.activation_offload=true"],
}


def overrides(args, ctx: dict, name: str, length: int) -> list[str]:
    return [f"model.name_or_path={ctx['model']}", f"data.path={ctx['tokens'][length]}", "data.format=tokens",
            f"data.max_length={length}", f"train.output_dir={args.work / name}", "train.overwrite=true",
            "train.effective_batch=1", "train.micro_batch=1", "train.max_steps=1", "train.log_every=1",
            "train.save_every=0", "train.learning_rate=1e-5"] + (["runtime.device=cpu"] if args.dry_run else [])


def planned_gib(args, cmd_overrides: list[str], log) -> float | None:
    out = args.work / "plan.json"
    cmd = kit.anyfit_cmd("plan", "--json", "--device", "h100" if args.dry_run else "local",
                         *[o for o in cmd_overrides if o != "runtime.device=cpu"])
    res = kit.run_logged(cmd, log, timeout=min(120, args.deadline.left()), stdout=out)
    if res["rc"] != 0:
        return None
    mem = json.loads(out.read_text())["targets"][0]["memory"]
    return round(mem["peak_gib"] - mem["overhead_gib"], 3) if mem else None


def run_rung(args, ctx: dict, rung: str, log, results: kit.Results) -> None:
    import anyfit_api as api

    rows: list[dict[str, Any]] = []
    length = ctx["start"]
    while length <= ctx["stop"]:
        if args.deadline.left() < 60:
            results.cell(rung, status="pass" if rows else "skip", note=f"out of time at {length} tokens", rows=rows)
            return
        name = f"{rung.replace(' ', '_').replace(',', '').replace('+', 'p')}-{length}"
        over = overrides(args, ctx, name, length) + RUNGS[rung]
        api.validate(over)
        row: dict[str, Any] = {"tokens": length, "planned_gib": planned_gib(args, over, log)}
        res = kit.run_logged(kit.anyfit_cmd("train", *over), log, timeout=min(240, args.deadline.left()))
        run = kit.read_run(args.work / name)
        if res["rc"] != 0 or not run["steps"]:
            row.update(fits=False, error=kit.error_line(res))
            rows.append(row)
            break
        last = run["steps"][-1]
        row.update(fits=True, measured_gib=last["peak_mem_gib"], tokens_per_s=last["tokens_per_s"],
                   wall_s=res["wall_s"])
        rows.append(row)
        length *= 2
    longest = max((r["tokens"] for r in rows if r.get("fits")), default=0)
    results.cell(rung, status="pass" if longest else "fail", note=f"longest that trained: {longest} tokens",
                 longest=longest, rows=rows)


def write_table(results: kit.Results, path) -> None:
    rows = []
    for rung, c in results.data["cells"].items():
        for r in c.get("rows", []):
            rows.append([rung, r["tokens"], r.get("planned_gib"), r.get("measured_gib"),
                         "yes" if r.get("fits") else "no", r.get("tokens_per_s"), r.get("error")])
    env = results.data["env"]
    head = (f"Longest sequence per rung on {env.get('gpu') or 'CPU (dry run)'}, torch {env.get('torch')}: random-init "
            "Qwen2.5-0.5B shape (dry run: tiny), one example per step, every token trained, full fine-tuning, bf16 "
            "autocast. Planned = `anyfit plan` peak minus its runtime overhead; measured = `peak_mem_gib` "
            "(torch.cuda.max_memory_allocated).\n\n")
    path.write_text(head + kit.markdown_table(
        ["rung", "tokens", "planned GiB", "measured GiB", "trained", "tokens/s", "error"], rows))


def main() -> int:
    args = kit.part_args(__doc__.split("\n\n")[0])
    args.deadline = kit.Deadline(args.budget)
    results = kit.Results(args.out / "results.json", "part5", args.dry_run)
    tok = kit.qwen_tokenizer_dir(args.work / "tokenizer")
    model = kit.save_model(args.work / ("model-tiny" if args.dry_run else "model-0.5b"),
                           "tiny" if args.dry_run else "qwen2.5-0.5b", tok)
    vocab = json.loads((model / "config.json").read_text())["vocab_size"]
    start, stop = (64, 128) if args.dry_run else (START, STOP)
    lengths = [start * 2 ** i for i in range((stop // start).bit_length())]
    ctx = {"model": model, "start": start, "stop": stop,
           "tokens": {n: kit.write_jsonl(args.work / f"tokens-{n}.jsonl", kit.token_rows(1, vocab, length=n))
                      for n in lengths}}
    log = args.out / "runs.log"
    for rung in RUNGS:
        try:
            run_rung(args, ctx, rung, log, results)
        except Exception as e:  # noqa: BLE001 - one broken rung does not stop the others
            results.cell(rung, status="fail", error=f"{type(e).__name__}: {e}"[:600])
    write_table(results, args.out / "long.md")
    print((args.out / "long.md").read_text(), flush=True)
    failed = results.failed()
    print(f"[part5] failed: {failed}", flush=True)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())

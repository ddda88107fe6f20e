"""Part 4: FSDP2 with CPU offload on one GPU and DeepSpeed ZeRO-3 with CPU offload on one GPU, per-step losses
against the plain run.

    python benchmarks/gpu/part4_sharding.py --out DIR [--dry-run] [--budget SECONDS]

Runs (the same random-init Qwen2.5-0.5B-shaped model, the same token data and seed, bf16, effective batch 8,
10 steps, every step logged):

- ``plain``: ``python -m anyfit train ... runtime.sharding=none`` (micro-batch 8);
- ``fsdp``: ``torchrun --standalone --nproc_per_node 1 -m anyfit train ... runtime.sharding=fsdp`` (NCCL, one rank);
- ``fsdp-offload``: the same with ``runtime.fsdp_offload=true`` (FSDP2's CPUOffloadPolicy: weights, gradients and
  AdamW states in host RAM, the optimizer step on the CPU);
- ``deepspeed-zero3``: ``torchrun ... runtime.sharding=deepspeed`` with micro-batch 4 x accumulation 2 (anyfit's
  window as DeepSpeed's boundary, train.max_grad_norm as its clip: issue 20 part 3, built on CPU);
- ``deepspeed-zero3-offload``: the same with ``runtime.deepspeed_offload=true`` (ZeRO-3 parameter and optimizer
  offload; the update runs in DeepSpeed's CPU Adam, which DeepSpeed compiles on first use: ninja and g++ on the
  GPU machine, DS_SKIP_CUDA_CHECK=1, about a minute).

Per run: pass/fail with the error, per-step losses and their largest relative difference from ``plain`` (flagged
above 2%: bf16 numerics differ between autocast, FSDP2's mixed precision and DeepSpeed's bf16 mode), GPU peak
(``peak_mem_gib``), tokens/s, and what each process held (``run_info.json``). Writes results.json, sharding.md,
runs.log.
"""

from __future__ import annotations

import json
import os
import shutil
import sys
from pathlib import Path
from typing import Any

import kit

STEPS = 10
TOLERANCE = 0.02
MICRO = 8


def commands(args, ctx: dict) -> dict[str, tuple[list[str] | None, list[str]]]:
    """Per run: (launcher or None, overrides)."""
    steps = 2 if args.dry_run else STEPS
    base = [f"model.name_or_path={ctx['model']}", f"data.path={ctx['tokens']}", "data.format=tokens",
            "data.max_length=1024", "train.overwrite=true", f"train.effective_batch={MICRO}",
            f"train.micro_batch={MICRO}",
            f"train.max_steps={steps}", "train.learning_rate=1e-5", "train.log_every=1", "train.seed=0"] + \
        (["runtime.device=cpu"] if args.dry_run else [])
    torchrun = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "1"]

    zero3 = base + ["runtime.sharding=deepspeed", f"train.micro_batch={MICRO // 2}"]
    return {
        "plain": (None, base + ["runtime.sharding=none"]),
        "fsdp": (torchrun, base + ["runtime.sharding=fsdp"]),
        "fsdp-offload": (torchrun, base + ["runtime.sharding=fsdp", "runtime.fsdp_offload=true"]),
        "deepspeed-zero3": (torchrun, zero3),
        "deepspeed-zero3-offload": (torchrun, zero3 + ["runtime.deepspeed_offload=true"]),
    }


def deepspeed_env(work: Path) -> dict[str, str]:
    """DeepSpeed's just-in-time build of CPU Adam: where CUDA is, no refusal over a CUDA minor-version mismatch."""
    extra = {"DS_SKIP_CUDA_CHECK": "1", "TORCH_EXTENSIONS_DIR": str(work / "torch_extensions")}
    nvcc = shutil.which("nvcc")
    if "CUDA_HOME" not in os.environ and nvcc:
        extra["CUDA_HOME"] = str(Path(nvcc).resolve().parent.parent)
    return kit.child_env(**extra)


def run_one(name: str, launcher, overrides: list[str], args, ctx: dict, results: kit.Results, log: Path) -> None:
    import anyfit_api as api

    out = args.work / name
    overrides = overrides + [f"train.output_dir={out}"]
    api.validate(overrides)
    if args.dry_run and name not in ("plain", "fsdp"):
        why = "DeepSpeed runs on CPU in the test suite: config and overrides checked" if name.startswith("deepspeed") \
            else "on CPU offload moves nothing: the fsdp run covers this path"
        results.cell(name, status="checked", note=why, command=" ".join(kit.anyfit_cmd("train", launcher=launcher)))
        return
    env = deepspeed_env(args.work) if name.startswith("deepspeed") else None
    offset = log.stat().st_size if log.is_file() else 0
    res = kit.run_logged(kit.anyfit_cmd("train", *overrides, launcher=launcher), log,
                         timeout=min(300, args.deadline.left()), env=env)
    run = kit.read_run(out)
    with log.open(errors="replace") as f:  # this run's own output: did a DeepSpeed engine run at all?
        f.seek(offset)
        engine = [line.strip()[:200] for line in f if "DeepSpeed" in line or "ZeRO" in line]
    fields: dict[str, Any] = {"wall_s": res["wall_s"], "losses": kit.losses(run),
                              "peak_mem_gib": max((r.get("peak_mem_gib", 0) for r in run["steps"]), default=None),
                              "held_per_process": run["run_info"].get("held_per_process"),
                              "policy_reasons": run["run_info"].get("policy", {}).get("reasons")}
    if name.startswith("deepspeed"):
        fields.update(deepspeed_log_lines=len(engine), deepspeed_log_first=engine[:5])
    rates = [r["tokens_per_s"] for r in run["steps"][2:]]
    fields["tokens_per_s"] = sum(rates) / len(rates) if rates else None
    if res["rc"] != 0 or not kit.finite(fields["losses"]) or len(fields["losses"]) < 2:
        results.cell(name, status="fail", error=kit.error_line(res), **fields)
        return
    plain = results.data["cells"].get("plain", {}).get("losses")
    if name != "plain" and plain:
        fields["max_rel_loss_diff_vs_plain"] = diff = kit.max_rel_diff(fields["losses"], plain)
        fields["first_step_rel_diff"] = kit.max_rel_diff(fields["losses"][:1], plain[:1])
        if diff > TOLERANCE and not args.dry_run:
            results.cell(name, status="off", note=f"losses differ from plain by up to {diff:.1%}", **fields)
            return
    results.cell(name, status="pass", **fields)


def main() -> int:
    args = kit.part_args(__doc__.split("\n\n")[0])
    args.deadline = kit.Deadline(args.budget)
    results = kit.Results(args.out / "results.json", "part4", args.dry_run)
    log = args.out / "runs.log"
    tok = kit.qwen_tokenizer_dir(args.work / "tokenizer")
    model = kit.save_model(args.work / ("model-tiny" if args.dry_run else "model-0.5b"),
                           "tiny" if args.dry_run else "qwen2.5-0.5b", tok)
    vocab = json.loads((model / "config.json").read_text())["vocab_size"]
    ctx = {"model": model, "tokens": kit.write_jsonl(args.work / "tokens.jsonl",
                                                     kit.token_rows(16 if args.dry_run else 200, vocab))}
    for name, (launcher, overrides) in commands(args, ctx).items():
        if args.deadline.left() < 60:
            results.cell(name, status="skip", note="out of time (the part's budget)")
            continue
        try:
            run_one(name, launcher, overrides, args, ctx, results, log)
        except Exception as e:  # noqa: BLE001 - one broken run does not stop the others
            results.cell(name, status="fail", error=f"{type(e).__name__}: {e}"[:600])
    rows = [[n, c.get("status"), c.get("max_rel_loss_diff_vs_plain"), c.get("peak_mem_gib"), c.get("tokens_per_s"),
             c.get("wall_s"), c.get("error") or c.get("note")] for n, c in results.data["cells"].items()]
    table = kit.markdown_table(["run", "status", "max rel loss diff vs plain", "GPU peak GiB", "tokens/s", "wall s",
                                "error / note"], rows)
    (args.out / "sharding.md").write_text(table)
    print(table, flush=True)
    failed = results.failed()
    print(f"[part4] failed: {failed}", flush=True)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())

"""Part 1: the ``gpu``-marked tests and a CUDA smoke matrix, each cell pass/fail with its error, never aborting.

    python benchmarks/gpu/part1_smoke.py --out DIR [--dry-run] [--budget SECONDS] [--only CELL,CELL]

Cells (``ORDER`` below gives the order they run in; each is its own process, so a CUDA error in one cannot poison
the next):

- ``gpu-tests``: ``pytest -m gpu`` on every test file that has a ``pytest.mark.gpu`` test;
- command-line runs (``python -m anyfit train``, a random-init Qwen2 with Qwen2.5's tokenizer on two-digit
  additions through the chat template, 12 steps): ``bf16`` (the defaults: bf16 autocast, fp32 master weights,
  2 pinned-memory batch workers), ``fp16-scaler`` (fp16 autocast, Accelerate's GradScaler: finite losses), ``workers-0`` (no batch workers: the same
  losses as ``bf16``), ``compile`` (``runtime.compile``: losses against ``bf16``, time to first step),
  ``micro-batch-auto`` (the probe on real CUDA memory), ``qlora``, ``adamw-8bit``, ``paged-adamw-8bit``, ``lora``,
  ``grad-ckpt``, ``sdpa-packed`` (transformers' block mask instead of anyfit_varlen), ``gguf-export`` (``anyfit
  export --gguf f16,q8_0`` of the ``bf16`` run, checked by loading back);
- in-process checks (``anyfit_api``): ``fused-skip`` (fused AdamW skips a forced non-finite step on the device:
  weights and step count unchanged, no host sync; then a run whose step 2 has an infinite loss skips exactly
  that step), ``varlen-vs-padded`` (one batch packed through anyfit_varlen and padded through SDPA: loss and
  gradients agree, and which attention kernels ran), ``oom-forced`` (an out-of-memory error raised for
  micro-batches over 2: the run halves and finishes), ``oom-real`` (a per-process memory cap between the peaks
  of micro-batch 1 and 8: a real CUDA out-of-memory error, the back-off, the run finishes).

Writes results.json (every cell: status pass/fail/skip, error, numbers), smoke.md (the table), pytest.log,
cells.log (every child's output); run_all.sh adds part.log.
"""

from __future__ import annotations

import gc
import json
import subprocess
import sys
import warnings
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

import kit

STEPS = 12


@dataclass
class Cell:
    name: str
    overrides: list[str] = field(default_factory=list)
    cuda_only: bool = False  # the dry run only validates its config
    baseline: str | None = None  # compare per-step losses with this cell's
    check: Callable[[dict, dict], dict] | None = None  # (run, context) -> extra fields; raises AssertionError
    timeout: float = 150
    tokens: bool = False  # train on the 1024-token pre-tokenized rows instead of the chat records


# ------------------------------------------------------------------------------------------------------------
# Checks of command-line cells
# ------------------------------------------------------------------------------------------------------------

def policy(run: dict) -> dict:
    return run["run_info"].get("policy", {})


def expect_precision(name: str):
    def check(run: dict, ctx: dict) -> dict:
        got = policy(run).get("precision")
        assert ctx["dry_run"] or got == name, f"run_info says precision {got}, expected {name}"
        return {"precision": got}
    return check


def check_workers(run: dict, ctx: dict) -> dict:
    reasons = policy(run).get("reasons", [])
    return {"num_workers": policy(run).get("num_workers"), "worker_reason": next((r for r in reasons if "worker" in r), None)}


def check_micro_auto(run: dict, ctx: dict) -> dict:
    chosen = {r.get("micro_batch") for r in run["steps"]}
    return {"micro_batch_chosen": sorted(x for x in chosen if x is not None)}


def check_adapter(run: dict, ctx: dict) -> dict:
    folder = Path(ctx["output_dir"])
    assert (folder / "adapter_model.safetensors").is_file(), "no adapter_model.safetensors in the run folder"
    return {"parameters": run["run_info"].get("parameters")}


def check_compile(run: dict, ctx: dict) -> dict:
    rates = [r["tokens_per_s"] for r in run["steps"][3:]]
    base = ctx["cells"].get("bf16", {}).get("tokens_per_s")
    mine = sum(rates) / len(rates) if rates else None
    return {"tokens_per_s": mine, "speed_vs_bf16": mine / base if mine and base else None}


def cli_cells() -> list[Cell]:
    return [
        Cell("bf16", check=lambda run, ctx: {**expect_precision("bf16")(run, ctx), **check_workers(run, ctx)}),
        Cell("fp16-scaler", ["runtime.precision=fp16"], cuda_only=True, check=expect_precision("fp16")),
        Cell("workers-0", ["runtime.num_workers=0"], baseline="bf16", check=check_workers),
        Cell("micro-batch-auto", ["train.micro_batch=auto", "train.effective_batch=32", "data.format=tokens",
                                  "data.max_length=1024"], check=check_micro_auto, tokens=True),
        Cell("qlora", ["lora.enabled=true", "lora.qlora=true", "train.learning_rate=2e-3"], cuda_only=True,
             check=check_adapter),
        Cell("adamw-8bit", ["train.optimizer=adamw_8bit"], cuda_only=True, baseline="bf16"),
        Cell("compile", ["runtime.compile=true"], baseline="bf16", check=check_compile, timeout=300),
        Cell("lora", ["lora.enabled=true", "train.learning_rate=2e-3"], check=check_adapter),
        Cell("grad-ckpt", ["model.gradient_checkpointing=true"], baseline="bf16"),
        Cell("sdpa-packed", ["model.attn_implementation=sdpa"], baseline="bf16"),
        Cell("paged-adamw-8bit", ["train.optimizer=paged_adamw_8bit"], cuda_only=True, baseline="bf16"),
    ]


# Run order: the cells the issue names first, then the rest; compile last (the slowest: on 2026-11-28 it used up a
# call's budget and left four cells behind it unrun). gguf-export needs the bf16 run.
ORDER = ["gpu-tests", "bf16", "fused-skip", "fp16-scaler", "varlen-vs-padded", "oom-forced", "oom-real",
         "micro-batch-auto", "qlora", "adamw-8bit", "workers-0", "lora", "grad-ckpt", "sdpa-packed",
         "paged-adamw-8bit", "gguf-export", "compile"]
IN_PROCESS = ("fused-skip", "varlen-vs-padded", "oom-forced", "oom-real")
CUDA_ONLY_IN_PROCESS = ("oom-real",)


def base_overrides(ctx: dict, name: str) -> list[str]:
    dry = ctx["dry_run"]
    out = [f"model.name_or_path={ctx['model']}", f"data.path={ctx['records']}", "data.max_length=256",
           f"train.output_dir={ctx['work'] / name}", "train.overwrite=true", "train.effective_batch=8",
           "train.micro_batch=8", f"train.max_steps={1 if dry else STEPS}", "train.learning_rate=5e-4",
           "train.log_every=1", "train.seed=0"]
    return out + (["runtime.device=cpu"] if dry else [])


# ------------------------------------------------------------------------------------------------------------
# In-process cells (``--cell``): run in a child process of their own
# ------------------------------------------------------------------------------------------------------------

def device() -> str:
    import torch

    return "cuda" if torch.cuda.is_available() else "cpu"


def examples(tokenizer_dir: Path, n: int = 6) -> list[dict]:
    """Real chat-template examples of varied lengths with the loss on the answer (anyfit's example shape)."""
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(tokenizer_dir)
    out = []
    for i, rec in enumerate(kit.arithmetic_records(n, seed=1)):
        prompt = tok.apply_chat_template([{"role": "user", "content": rec["prompt"] + " ok" * (7 * i)}],
                                         tokenize=False, add_generation_prompt=True)
        p_ids = tok(prompt, add_special_tokens=False)["input_ids"]
        c_ids = tok(rec["completion"], add_special_tokens=False)["input_ids"] + [tok.eos_token_id]
        out.append({"input_ids": p_ids + c_ids, "labels": [kit.IGNORE_INDEX] * len(p_ids) + c_ids})
    return out


def to_device(batch: dict, dev: str) -> dict:
    import torch

    return {k: v.to(dev) if isinstance(v, torch.Tensor) else v for k, v in batch.items()}


def cell_fused_skip(ctx: dict) -> dict:
    """Fused AdamW + guarded_step: a non-finite flag skips the update on the device (no host sync), then an
    end-to-end run whose step 2 has an infinite loss skips that one step and finishes."""
    import torch
    from transformers import AutoModelForCausalLM

    import anyfit_api as api

    dev = device()
    cfg = api.validate(base_overrides(ctx, "fused-skip"))
    model = AutoModelForCausalLM.from_pretrained(ctx["model"], dtype=torch.float32).to(dev)
    opt = api.build_optimizer(model, cfg.train, dev, True)
    assert opt.defaults.get("fused"), f"build_optimizer did not make a fused AdamW: {opt.defaults}"
    precision = "bf16" if dev == "cuda" else "fp32"
    assert api.skips_on_device(opt, precision), "skips_on_device is False for fused AdamW"
    batch = to_device(api.collate(examples(ctx["tokenizer"])[:4], pad_id=0, packed=False), dev)
    no, yes = torch.tensor(False, device=dev), torch.tensor(True, device=dev)

    def step_counts() -> list[float]:
        return sorted({float(s["step"]) for s in opt.state.values() if "step" in s})

    api.token_loss_sum(model, batch).backward()
    api.guarded_step(opt, yes, on_device=True)  # a finite step first: AdamW's state exists (step 1)
    opt.zero_grad(set_to_none=True)
    api.token_loss_sum(model, batch).backward()
    before = [p.detach().clone() for p in model.parameters()]
    syncs = 0
    if dev == "cuda":
        torch.cuda.synchronize()
        torch.cuda.set_sync_debug_mode("warn")
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        returned = api.guarded_step(opt, no, on_device=True)  # the skipped step: nothing may wait for the GPU
    if dev == "cuda":
        torch.cuda.set_sync_debug_mode("default")
        syncs = sum("synchroniz" in str(w.message).lower() for w in caught)
    unchanged = all(torch.equal(a, p.detach()) for a, p in zip(before, model.parameters()))
    steps = step_counts()
    assert unchanged, "a skipped (non-finite) step changed the weights"
    assert steps == [1.0], f"the skipped step changed AdamW's step count to {steps} (1 expected)"
    assert isinstance(returned, torch.Tensor), "guarded_step read the flag on the host (on_device=True)"
    api.guarded_step(opt, yes, on_device=True)
    changed = any(not torch.equal(a, p.detach()) for a, p in zip(before, model.parameters()))
    assert changed and step_counts() == [2.0], f"the finite step did not update (step count {step_counts()})"
    assert syncs == 0, f"{syncs} host synchronisation(s) inside the skipped step: {caught[0].message}"
    del model, opt

    calls = {"n": 0}

    def inf_at_step_2(model, batch):
        loss = api.token_loss_sum(model, batch)
        calls["n"] += 1
        return loss * float("inf") if calls["n"] == 2 else loss  # one micro-batch per step: call 2 = step 2

    out = ctx["work"] / "fused-skip-run"
    run_cfg = api.validate(base_overrides(ctx, "fused-skip-run") + [f"train.max_steps={2 if ctx['dry_run'] else 4}"])
    result = api.train(run_cfg, loss_fn=inf_at_step_2)
    run = kit.read_run(out)
    skipped = run["steps"][-1].get("skipped_steps") if run["steps"] else None
    assert result.skipped_steps == 1 and skipped == 1, \
        f"expected exactly one skipped step, got {result.skipped_steps} (metrics: {skipped})"
    return {"host_syncs_in_skipped_step": syncs, "step_count_after_skip": steps, "e2e_losses": kit.losses(run),
            "e2e_skipped_steps": skipped}


def cell_varlen_vs_padded(ctx: dict) -> dict:
    """The same examples as one packed row through anyfit_varlen and as a padded batch through SDPA."""
    import torch
    from transformers import AutoModelForCausalLM

    import anyfit_api as api

    dev = device()
    name = api.register_varlen_attention()
    exs = examples(ctx["tokenizer"])
    packed = to_device(api.collate(exs, pad_id=0, packed=True), dev)
    padded = to_device(api.collate(exs, pad_id=0, packed=False), dev)
    out: dict[str, Any] = {"lengths": [len(e["input_ids"]) for e in exs]}
    settings = [("fp32", None, 1e-4)] + ([("bf16-autocast", torch.bfloat16, 2e-2)] if dev == "cuda" else [])
    for label, dtype, tol in settings:
        results = {}
        for attn, batch in ((name, packed), ("sdpa", padded)):
            model = AutoModelForCausalLM.from_pretrained(ctx["model"], dtype=torch.float32,
                                                         attn_implementation=attn).to(dev)
            with torch.autocast(dev, dtype=dtype or torch.float32, enabled=dtype is not None):
                loss = api.token_loss_sum(model, batch)
            loss.backward()
            grad = torch.cat([p.grad.flatten().float() for p in model.parameters() if p.grad is not None])
            results[attn] = (float(loss), grad)
            del model
        (lv, gv), (lp, gp) = results[name], results["sdpa"]
        rel = abs(lv - lp) / abs(lp)
        cos = float(torch.nn.functional.cosine_similarity(gv, gp, dim=0))
        out[label] = {"loss_varlen": lv, "loss_padded": lp, "rel_diff": rel, "grad_cosine": cos, "tolerance": tol}
        assert rel < tol and cos > 1 - tol, f"{label}: packed varlen and padded differ (loss rel {rel:.2e}, " \
                                            f"gradient cosine {cos:.6f})"
    if dev == "cuda":  # which kernels the packed bf16 forward ran: PyTorch's varlen flash is the point of it
        from torch.profiler import ProfilerActivity, profile

        model = AutoModelForCausalLM.from_pretrained(ctx["model"], dtype=torch.float32,
                                                     attn_implementation=name).to(dev)
        with profile(activities=[ProfilerActivity.CUDA]) as prof, torch.no_grad(), \
                torch.autocast("cuda", dtype=torch.bfloat16):
            api.token_loss_sum(model, packed)
            torch.cuda.synchronize()
        kernels = sorted({e.key for e in prof.key_averages() if "flash" in e.key.lower() or "fmha" in e.key.lower()
                          or "attention" in e.key.lower()})
        out["attention_kernels"] = kernels[:10]
        assert any("flash" in k.lower() for k in kernels), f"no FlashAttention kernel ran for packed rows: {kernels}"
    return out


def cell_oom_forced(ctx: dict) -> dict:
    """An out-of-memory error for every micro-batch over 2 sequences: the step is redone with half, then a quarter."""
    import torch

    import anyfit_api as api

    seen: list[int] = []

    def loss_fn(model, batch):
        rows = len(batch["packed_lengths"]) if "packed_lengths" in batch else batch["input_ids"].shape[0]
        seen.append(rows)
        if rows > 2:
            raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB (forced by the GPU kit)")
        return api.token_loss_sum(model, batch)

    cfg = api.validate(base_overrides(ctx, "oom-forced") + [f"train.max_steps={1 if ctx['dry_run'] else 3}"])
    result = api.train(cfg, loss_fn=loss_fn)
    run = kit.read_run(ctx["work"] / "oom-forced")
    micro = [r.get("micro_batch") for r in run["steps"]]
    assert result.steps == cfg.train.max_steps and micro and all(m == 2 for m in micro), \
        f"expected every step at micro-batch 2 after the back-off, got {micro}"
    return {"micro_batches_tried": seen[:6], "micro_batch_per_step": micro, "losses": kit.losses(run)}


def cell_oom_real(ctx: dict) -> dict:
    """A real CUDA out-of-memory error: cap this process's memory between the measured peaks of micro-batch 1 and
    8 (1024-token rows), then train at micro-batch 8; the back-off must find a size that fits and finish."""
    import torch

    import anyfit_api as api

    assert torch.cuda.is_available(), "needs CUDA"
    total = torch.cuda.get_device_properties(0).total_memory
    base = base_overrides(ctx, "oom-real") + [f"data.path={ctx['tokens']}", "data.format=tokens",
                                              "data.max_length=1024"]

    leftover: list[float] = []  # memory still allocated before each run (a previous run not freed)

    def peak(micro: int, steps: int) -> tuple[int, Any]:
        gc.collect()
        torch.cuda.empty_cache()
        leftover.append(torch.cuda.memory_allocated() / 2**30)
        torch.cuda.reset_peak_memory_stats()
        result = api.train(api.validate(base + [f"train.micro_batch={micro}", f"train.max_steps={steps}"]))
        used = torch.cuda.max_memory_allocated()
        result.model = None
        return used, result

    p1, _ = peak(1, 1)
    p8, _ = peak(8, 1)
    cap = p1 + 0.4 * (p8 - p1)
    gc.collect()
    torch.cuda.empty_cache()
    torch.cuda.set_per_process_memory_fraction(cap / total)
    try:
        _, result = peak(8, 3)
    finally:
        torch.cuda.set_per_process_memory_fraction(1.0)
    run = kit.read_run(ctx["work"] / "oom-real")
    micro = [r.get("micro_batch") for r in run["steps"]]
    assert result.steps == 3 and micro and micro[-1] < 8, f"expected a back-off below micro-batch 8, got {micro}"
    return {"peak_gib_micro1": p1 / 2**30, "peak_gib_micro8": p8 / 2**30, "cap_gib": cap / 2**30,
            "allocated_gib_before_each_run": leftover,
            "micro_batch_per_step": micro, "losses": kit.losses(run)}


CELL_FUNCTIONS = {"fused-skip": cell_fused_skip, "varlen-vs-padded": cell_varlen_vs_padded,
                  "oom-forced": cell_oom_forced, "oom-real": cell_oom_real}


def child(names: list[str], ctx_path: Path) -> None:
    """Run in-process cells (in this fresh process) and write one JSON result per cell next to the context."""
    ctx = json.loads(ctx_path.read_text())
    ctx.update(work=Path(ctx["work"]))
    kit.run_cells(names, CELL_FUNCTIONS, ctx, ctx_path.parent)


# ------------------------------------------------------------------------------------------------------------
# The matrix (parent)
# ------------------------------------------------------------------------------------------------------------

def prepare(args) -> dict:
    tok = kit.qwen_tokenizer_dir(args.work / "tokenizer")
    model = kit.save_model(args.work / ("model-tiny" if args.dry_run else "model-small"),
                           "tiny" if args.dry_run else "small", tok)
    vocab = json.loads((model / "config.json").read_text())["vocab_size"]
    return {"dry_run": args.dry_run, "work": args.work, "tokenizer": str(tok), "model": str(model),
            "records": str(kit.write_jsonl(args.work / "records.jsonl", kit.arithmetic_records(256))),
            "tokens": str(kit.write_jsonl(args.work / "tokens.jsonl", kit.token_rows(64, vocab, length=1024))),
            "cells": {}}


def gpu_tests(args, results: kit.Results, log: Path) -> None:
    files = subprocess.run(["grep", "-rl", "--include=*.py", "mark.gpu", "tests"], cwd=kit.REPO, capture_output=True,
                           text=True).stdout.split()
    if not files:
        results.cell("gpu-tests", status="fail", error="no test file has a pytest.mark.gpu test")
        return
    # -o addopts=: pyproject's addopts ask for pytest-xdist (-n auto), which the GPU image does not have; one GPU
    # is one worker anyway.
    cmd = [sys.executable, "-m", "pytest", "-o", "addopts=", "-m", "gpu", "-p", "no:cacheprovider", "-q", "-rA",
           *sorted(files)]
    if args.dry_run:
        cmd.append("--collect-only")
    res = kit.run_logged(cmd, log, timeout=min(240, args.deadline.left()))
    summary = next((line for line in reversed(res["tail"]) if " passed" in line or " failed" in line
                    or " skipped" in line or "collected" in line or " error" in line), (res["tail"] or [""])[-1])
    ok = res["rc"] == 0 or (args.dry_run and res["rc"] == 5)
    results.cell("gpu-tests", status="pass" if ok else "fail", files=sorted(files), summary=summary,
                 wall_s=res["wall_s"], **({} if ok else {"error": kit.error_line(res)}))


def cli_cell(cell: Cell, args, ctx: dict, results: kit.Results, log: Path) -> None:
    import anyfit_api as api

    overrides = base_overrides(ctx, cell.name) + ([f"data.path={ctx['tokens']}"] if cell.tokens else []) \
        + cell.overrides
    api.validate(overrides)  # a typo in a key fails here, before any run
    if args.dry_run and (cell.cuda_only or cell.name != "bf16"):
        results.cell(cell.name, status="checked", note="config validated (dry run)", overrides=cell.overrides)
        return
    ctx_cell = {**ctx, "output_dir": str(ctx["work"] / cell.name)}
    res = kit.run_logged(kit.anyfit_cmd("train", *overrides), log, timeout=min(cell.timeout, args.deadline.left()))
    run = kit.read_run(ctx["work"] / cell.name)
    fields: dict[str, Any] = {"overrides": cell.overrides, "wall_s": res["wall_s"], "losses": kit.losses(run),
                              "peak_mem_gib": max((r.get("peak_mem_gib", 0) for r in run["steps"]), default=None)}
    try:
        assert res["rc"] == 0, kit.error_line(res)
        assert kit.finite(fields["losses"]), f"non-finite or missing losses: {fields['losses']}"
        if cell.check:
            fields.update(cell.check(run, ctx_cell))
        if cell.baseline and cell.baseline in ctx["cells"]:
            diff = kit.max_rel_diff(fields["losses"], ctx["cells"][cell.baseline]["losses"])
            fields[f"max_rel_loss_diff_vs_{cell.baseline}"] = diff
        rates = [r["tokens_per_s"] for r in run["steps"][3:]]
        fields.setdefault("tokens_per_s", sum(rates) / len(rates) if rates else None)
        fields["status"] = "pass"
        ctx["cells"][cell.name] = fields
    except AssertionError as e:
        fields.update(status="fail", error=str(e)[:600])
    results.cell(cell.name, **fields)


def gguf_cell(args, ctx: dict, results: kit.Results, log: Path) -> None:
    if "bf16" not in ctx["cells"]:
        results.cell("gguf-export", status="skip", note="needs the bf16 run")
        return
    out = ctx["work"] / "bf16-export"
    # The dry run exports without GGUF: writing and loading back a 151k-token GGUF vocabulary takes minutes on 2 cores.
    gguf = [] if args.dry_run else ["--gguf", "f16,q8_0"]
    res = kit.run_logged(kit.anyfit_cmd("export", str(ctx["work"] / "bf16"), "--out", str(out), *gguf, "--overwrite"),
                         log, timeout=min(180, args.deadline.left()))
    ggufs = sorted(p.name for p in out.glob("*.gguf")) if out.is_dir() else []
    ok = res["rc"] == 0 and len(ggufs) == (0 if args.dry_run else 2)  # f16 and q8_0
    results.cell("gguf-export", status="pass" if ok else "fail", files=ggufs, wall_s=res["wall_s"],
                 **({"note": "exported without --gguf (dry run)"} if args.dry_run else {}),
                 **({} if ok else {"error": kit.error_line(res)}))


def in_process_cells(names: list[str], args, ctx: dict, results: kit.Results, log: Path) -> None:
    ctx_path = args.work / "context.json"
    ctx_path.write_text(json.dumps({k: v for k, v in ctx.items() if k != "cells"}, default=str))
    for name in names:
        (args.work / f"cell-{name}.json").unlink(missing_ok=True)
    cmd = [sys.executable, str(Path(__file__).resolve()), "--out", str(args.out), "--work", str(args.work),
           "--cell", ",".join(names)]
    res = kit.run_logged(cmd, log, timeout=min(240 * len(names), args.deadline.left()))
    for name in names:
        path = args.work / f"cell-{name}.json"
        if path.is_file():
            results.cell(name, **json.loads(path.read_text()))
        else:
            results.cell(name, status="fail", error=kit.error_line(res), wall_s=res["wall_s"])


def write_table(results: kit.Results, path: Path) -> None:
    rows = []
    for name, c in results.data["cells"].items():
        numbers = {k: v for k, v in c.items() if k.startswith(("max_rel", "speed_vs", "micro_batch", "rel_"))}
        rows.append([name, c.get("status"), c.get("wall_s"), c.get("peak_mem_gib"),
                     json.dumps(numbers, default=str)[:160] if numbers else "", (c.get("error") or "")[:200]])
    path.write_text(kit.markdown_table(["cell", "status", "wall s", "peak GiB", "numbers", "error"], rows))


def main() -> int:
    args = kit.part_args(__doc__.split("\n\n")[0], lambda p: (
        p.add_argument("--only", default="", help="comma-separated cells (default: all, in ORDER)"),
        p.add_argument("--cell", help="internal: run these in-process cells here")))
    if args.cell:
        child(args.cell.split(","), args.work / "context.json")
        return 0
    args.deadline = kit.Deadline(args.budget)
    results = kit.Results(args.out / "results.json", "part1", args.dry_run)
    log = args.out / "cells.log"
    ctx = prepare(args)
    cells = {c.name: c for c in cli_cells()}
    wanted = [n for n in ORDER if not args.only or n in args.only.split(",")]
    if args.dry_run:  # the in-process cells share one child here: the imports alone take a while on 2 cores
        runnable = [n for n in wanted if n in IN_PROCESS and n not in CUDA_ONLY_IN_PROCESS]
        in_process_cells(runnable, args, ctx, results, log)
        for name in (n for n in wanted if n in CUDA_ONLY_IN_PROCESS):
            results.cell(name, status="checked", note="CUDA only: not run in the dry run")
    for name in wanted:
        if args.dry_run and name in IN_PROCESS:
            continue
        if args.deadline.left() < 20:
            results.cell(name, status="skip", note="out of time (the part's budget)")
            continue
        try:
            if name == "gpu-tests":
                gpu_tests(args, results, args.out / "pytest.log")
            elif name == "gguf-export":
                gguf_cell(args, ctx, results, log)
            elif name in IN_PROCESS:
                in_process_cells([name], args, ctx, results, log)
            else:
                cli_cell(cells[name], args, ctx, results, log)
        except Exception as e:  # noqa: BLE001 - a broken cell is recorded, the matrix goes on
            results.cell(name, status="fail", error=f"{type(e).__name__}: {e}"[:600])
    write_table(results, args.out / "smoke.md")
    failed = results.failed()
    print(f"[part1] {len(results.data['cells']) - len(failed)} cells ok, {len(failed)} failed: {failed}", flush=True)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())

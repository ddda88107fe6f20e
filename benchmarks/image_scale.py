"""Images at scale (issue 54): memory of anyfit's token store build and of a training start as the image count grows.

    uv run --group bench python benchmarks/image_scale.py --images 10000,100000
    (--only prepare,warm picks measurements; --num-proc 1,2; --work DIR keeps data, model and stores)

Data: N TRL-shaped records (``benchmarks/image_sft.write_image_records``), each with its own image file: N distinct
64x48 random-pixel PNGs (about 9 KiB each; small so that 100k of them are written in a minute or two: the build reads
an image's header and bytes, never its pixels, so the file's size matters to its sha256 alone). Model: the
Qwen2.5-VL fixture of tests/vlm_fixtures (a 64x48 image is 12 image tokens; a record about 60 tokens).

Measured per N, each in a fresh process, with the whole process tree's RSS and PSS sampled every 0.2 s (the
machinery of ``benchmarks/data_scale.py``, whose functions run these):
- ``prepare-npK``: ``python -m anyfit prepare CFG data.num_proc=K`` into an empty cache: wall, images/s, peak tree
  RSS (the spawned workers included), the store's size on disk and per image.
- ``warm``: ``python -m anyfit train CFG train.max_steps=1`` on the built store: when the store is mapped, the
  model loaded and the first step logged; peak RSS (the step decodes and processes its 8 images).

Writes (merging) ``--out`` and prints a table. A benchmark, not a test: nothing asserts a speed or a size.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import sys
import time
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent / "tests"))
sys.path.insert(0, str(HERE))
from data_scale import ROOT, anyfit_prepare, anyfit_warm, compile_bytecode, environment
from image_sft import MAX_LENGTH, model_dir, write_image_records

GIB = 2**30
SIZE = (64, 48)


def image_data(work: Path, n: int, seed: int) -> tuple[Path, dict[str, Any]]:
    folder = work / f"images-{n}-seed{seed}"
    path = folder / "data.jsonl"
    stats_path = folder / "stats.json"
    if not path.is_file():
        print(f"[data] writing {n:,} records and {SIZE[0]}x{SIZE[1]} PNGs under {folder}", flush=True)
        t0 = time.perf_counter()
        write_image_records(folder, n, seed, small=SIZE)
        stats_path.write_text(json.dumps({"write_s": round(time.perf_counter() - t0, 1)}))
    stats = json.loads(stats_path.read_text())
    if "image_bytes" not in stats:
        stats["image_bytes"] = sum(f.stat().st_size for f in (folder / "images").rglob("*.png"))
        stats_path.write_text(json.dumps(stats))
    print(f"[data] {n:,} images, {stats['image_bytes'] / GIB:.2f} GiB (written in {stats['write_s']} s)", flush=True)
    return path, stats


def write_config(work: Path, n: int, model: Path, data: Path) -> Path:
    path = work / f"config-{n}.yaml"
    path.write_text(f"model: {{name_or_path: {model}, dtype: float32}}\n"
                    f"data: {{path: {data}, template: chat, max_length: {MAX_LENGTH}}}\n"
                    "train: {effective_batch: 8, micro_batch: 8, max_steps: 1, learning_rate: 1.0e-4, seed: 0, "
                    "log_every: 1}\n"
                    "runtime: {device: cpu, precision: fp32}\n")
    return path


def table(results: dict[str, Any]) -> str:
    lines = ["| images | run | wall s | peak tree RSS GiB (PSS) | details | load 1m (start / mean) |",
             "|---|---|---|---|---|---|"]
    for n in sorted(results["runs"], key=int):
        for name, r in results["runs"][n]["measurements"].items():
            load = r.get("load_1m") or {}
            where = f"{load.get('start', 0):.1f} / {load.get('mean') or 0:.1f}"
            if "error" in r:
                lines.append(f"| {int(n):,} | {name} | FAILED | | {r['error'][:150].replace('|', '/')} | {where} |")
                continue
            if name.startswith("prepare"):
                details = (f"{int(n) / r['wall_s']:,.0f} images/s (whole process); store "
                           f"{r.get('store_bytes', 0) / 2**20:.1f} MiB, {r.get('store_bytes', 0) / int(n):,.0f} bytes "
                           f"an image, {r.get('tokens', 0) / 1e6:.2f}M tokens")
            else:
                ev = r["events_s"]
                details = (f"store mapped at {ev.get('store_mapped', '?')} s, model loaded at "
                           f"{ev.get('model_loaded', '?')} s, first step logged at {ev.get('first_step', '?')} s; "
                           + ("reused, nothing tokenized" if r.get("reused_store") and not r.get("tokenized")
                              else "RE-TOKENIZED"))
            lines.append(f"| {int(n):,} | {name} | {r['wall_s']:.1f} | {r['peak_tree_rss_gib']:.2f} "
                         f"({r['peak_tree_pss_gib']:.2f}) | {details} | {where} |")
    return "\n".join(lines)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--images", default="10000,100000", help="comma-separated image counts (one record each)")
    p.add_argument("--only", default="prepare,warm", help="comma-separated among prepare, warm")
    p.add_argument("--num-proc", default="2", help="data.num_proc values of the cold builds")
    p.add_argument("--family", default="qwen2_5_vl")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--work", default="/tmp/anyfit_image_scale")
    p.add_argument("--out", default=str(ROOT / "benchmarks" / "results" / "image_scale.json"))
    p.add_argument("--timeout", type=float, default=3600, help="seconds per child process")
    args = p.parse_args()
    work = Path(args.work)
    work.mkdir(parents=True, exist_ok=True)
    out = Path(args.out)
    results = json.loads(out.read_text()) if out.is_file() else {"runs": {}}
    results["env"] = environment()
    model = model_dir(work, args.family)
    compile_bytecode(work)
    only = {m for m in args.only.split(",") if m}

    def save():
        out.parent.mkdir(parents=True, exist_ok=True)
        out.write_text(json.dumps(results, indent=1) + "\n")

    for n in (int(x) for x in args.images.split(",") if x):
        data, stats = image_data(work, n, args.seed)
        # the context data_scale's measurements read (their "rows" are our records, one image each)
        ctx = {"work": work, "rows": n, "data": data, "model": model, "timeout": args.timeout,
               "config": write_config(work, n, model, data), "logs": work / "logs" / str(n)}
        entry = results["runs"].setdefault(str(n), {"measurements": {}})
        entry.update(data=stats, family=args.family, seed=args.seed)
        plan = [(f"prepare-np{k}", lambda k=int(k), ctx=ctx: anyfit_prepare(ctx, k)) for k in args.num_proc.split(",")
                if "prepare" in only]
        if "warm" in only:
            plan.append(("warm", lambda ctx=ctx: anyfit_warm(ctx)))
        for name, fn in plan:
            print(f"[{n:,} images] {name} (load {os.getloadavg()[0]:.1f}) ...", flush=True)
            r = fn()
            r["date"] = datetime.datetime.now().isoformat(timespec="seconds")
            if name in entry["measurements"]:
                entry.setdefault("earlier", []).append({name: entry["measurements"][name]})
            entry["measurements"][name] = r
            print(f"  {name}: {r['wall_s']:.1f} s, peak tree RSS {r['peak_tree_rss_gib']:.2f} GiB"
                  + (f", ERROR {r['error']}" if "error" in r else "") + (f", events {r['events_s']}" if r["events_s"]
                                                                           else ""), flush=True)
            save()
    save()
    print("\n" + table(results))


if __name__ == "__main__":
    main()

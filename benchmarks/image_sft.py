"""Images (issue 54): anyfit's image path against HF TRL's SFTTrainer with its vision collator, on the same image
records and the same tiny vision-language model.

    uv run --group bench python benchmarks/image_sft.py                                  # everything, 400 records
    uv run --group bench python benchmarks/image_sft.py --only prepare,collate --records 1000
    uv run --group bench python benchmarks/image_sft.py --only train --repeat 3           # medians of 3 rounds
    uv run --group bench python benchmarks/image_sft.py --profile collate                # cProfile, anyfit's batches
    uv run --group bench python benchmarks/image_sft.py --profile prepare                # cProfile, its store build
    (--family picks the fixture among tests/vlm_fixtures.FAMILIES; --work DIR keeps data and model between calls;
    every invocation merges its results into --out)

Data: ``--records`` N records in TRL's shape, one JSON Lines file: ``{"messages": [user: [image part, question],
assistant: short answer], "images": ["images/000/000123.jpg"]}``, the path relative to the data file. One generated
JPEG per record (smooth colour fields with a little noise, quality 90, so files are photo-sized: about 30-200 KiB),
its size drawn from a mix of camera/screen sizes: 320x240 (20%), 640x480 (35%), 800x600 (20%), 1024x768 (15%),
768x1024 (10%). Deterministic under ``--seed``; written once per N and seed under ``--work``.

Model: ``tests/vlm_fixtures.save_vlm(family)``: a 2-layer, 32-wide random-init model of a real family with its real
processor (Qwen2.5-VL by default: transformers' Qwen2VLImageProcessor, sized so that an image becomes at most 64x64
pixels, i.e. up to 16 image tokens). The language model is tiny on purpose: what is compared is the data path
(reading, decoding, resizing images, templates, tokenizing) around a step, which a real model would hide under
its compute on a GPU but which is all there is on this CPU.

What is measured, each in its own process (the whole process tree's RSS sampled with psutil every 0.2 s, as
``benchmarks/data_scale.py`` does):
- ``prepare``: anyfit's token store build, ``prepare_training_data`` with the model's processor (what ``anyfit
  prepare`` runs): records/s of the build itself, the process's wall and peak RSS, the store's size. TRL has no
  counterpart: for a vision data set SFTTrainer skips dataset preparation (``_skip_prepare_dataset``) and does all
  of the per-record work in its collator, on every step; ``trl-init`` times SFTTrainer(...) on the same data.
- ``collate``: the per-batch work of both, in one process, batch by batch in turn (anyfit, TRL, anyfit, ...) over
  the same batches of ``--batch`` records: anyfit's ``batching.collate`` with ``ImageBatches`` (read the file,
  sha256 it against the store, decode, processor, check the ids against the store's) on the store's examples;
  TRL's ``DataCollatorForVisionLanguageModeling`` on the records of a ``datasets`` data set whose ``images`` column
  is cast to ``Image()`` (the file decoded when the row is read, then ``processor.apply_chat_template``). records/s
  of each and their ratio. The same pass compares the ids: TRL's input_ids of each record (its padding removed)
  against the store's ids of that record.
- ``train-anyfit``, ``train-trl``, ``train-trl-no-ckpt``: ``--steps`` optimizer steps of ``--batch`` records
  (one micro-batch, no accumulation), fp32, AdamW lr 1e-4 with a linear decay, no warmup; anyfit with its defaults
  (padded rows for image records, loss on the assistant's tokens), TRL with its defaults (gradient checkpointing
  on, loss on every token of a conversation: image tokens included) and without gradient checkpointing. Over the
  steps after ``--warmup``: records/s and real tokens/s from the wall time between step ends (data included: both
  make batches in the training process on a CPU), peak tree RSS, the last loss.

Threads: every child runs torch with ``--threads`` intra-op threads (1 by default, both frameworks alike). On a
2-core machine shared with other jobs, two threads make every parallel op wait for a core another process holds: a
tiny model's step is hundreds of small ops, and the same 12 steps took anywhere from 0.06 to 1.5 s a step from one
run to the next (a uint8 HWC-to-CHW copy of a 1024x768 image: 1.1 ms on one thread, 11.8 ms on two, at a load of 6).

Writes (merging with earlier invocations) ``--out`` (JSON) and prints a markdown table of what it holds. This is a
benchmark, not a test: nothing here asserts a speed.
"""

from __future__ import annotations

import argparse
import cProfile
import datetime
import json
import os
import pstats
import shutil
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent / "tests"))
sys.path.insert(0, str(HERE))
from data_scale import ROOT, child_env, compile_bytecode, environment, measured_run
from speed_vs_trl import StepClock

MEASUREMENTS = ("prepare", "collate", "train")
TRAIN_RUNS = ("train-anyfit", "train-trl", "train-trl-no-ckpt")
# (width, height, share): a mix of camera and screen sizes
SIZES = ((320, 240, 0.20), (640, 480, 0.35), (800, 600, 0.20), (1024, 768, 0.15), (768, 1024, 0.10))
QUESTIONS = ("What is in this picture?", "Which colour dominates the image?", "Describe the image in one word.",
             "Is this photo taken indoors or outdoors?", "What is the main colour at the top left?")
ANSWERS = ("A field.", "Blue.", "Sky.", "Outdoors.", "Red.", "A wall.", "Green.", "Sunset.")
MAX_LENGTH = 1024


# ----------------------------------------------------------------------------------------------------------
# Model and data (parent)
# ----------------------------------------------------------------------------------------------------------

def model_dir(work: Path, family: str) -> Path:
    """The fixture's model folder (tests/vlm_fixtures.save_vlm), built once under ``work``."""
    out = work / f"model-{family}"
    if not (out / "config.json").is_file():
        from vlm_fixtures import missing_for, save_vlm

        if why := missing_for(family):
            sys.exit(why)
        tmp = out.with_name(out.name + ".tmp")
        shutil.rmtree(tmp, ignore_errors=True)
        save_vlm(tmp, family)
        tmp.rename(out)
    return out


def photo(rng: np.random.Generator, width: int, height: int):
    """A smooth colour field (a 6x6 grid of random colours, bicubic-upscaled) with a little noise: compresses like a
    photograph, unlike pure noise."""
    from PIL import Image

    small = Image.fromarray(rng.integers(0, 256, (6, 6, 3), dtype=np.uint8), "RGB")
    pixels = np.asarray(small.resize((width, height), Image.BICUBIC), dtype=np.int16)
    pixels = pixels + rng.integers(-6, 7, pixels.shape, dtype=np.int16)
    return Image.fromarray(np.clip(pixels, 0, 255).astype(np.uint8), "RGB")


def write_image_records(folder: Path, n: int, seed: int, small: tuple[int, int] | None = None) -> Path:
    """``n`` TRL-shaped records in ``folder``/data.jsonl, one image each under ``folder``/images/ (1,000 a
    subfolder), named relative to the data file. ``small`` (width, height): every image that size, random-pixel
    PNG (the scale check's many small files); else photo-like JPEGs of SIZES' mix."""
    rng = np.random.default_rng(seed)
    shares = np.array([s for *_, s in SIZES])
    picks = rng.choice(len(SIZES), size=n, p=shares / shares.sum())
    lines = []
    for i in range(n):
        rel = f"images/{i // 1000:03d}/{i:06d}." + ("png" if small else "jpg")
        path = folder / rel
        if i % 1000 == 0:
            path.parent.mkdir(parents=True, exist_ok=True)
        if small:
            from PIL import Image

            Image.fromarray(rng.integers(0, 256, (small[1], small[0], 3), dtype=np.uint8), "RGB").save(path)
        else:
            width, height, _ = SIZES[picks[i]]
            photo(rng, width, height).save(path, quality=90)
        messages = [{"role": "user", "content": [{"type": "image"},
                                                 {"type": "text", "text": QUESTIONS[i % len(QUESTIONS)]}]},
                    {"role": "assistant", "content": [{"type": "text", "text": ANSWERS[i % len(ANSWERS)]}]}]
        lines.append(json.dumps({"messages": messages, "images": [rel]}))
    path = folder / "data.jsonl"
    tmp = path.with_suffix(".tmp")
    tmp.write_text("\n".join(lines) + "\n")
    tmp.rename(path)
    return path


def dataset(work: Path, n: int, seed: int) -> tuple[Path, dict[str, Any]]:
    folder = work / f"data-{n}-seed{seed}"
    path = folder / "data.jsonl"
    if not path.is_file():
        t0 = time.perf_counter()
        print(f"[data] writing {n:,} records and images under {folder}", flush=True)
        write_image_records(folder, n, seed)
        print(f"[data] written in {time.perf_counter() - t0:.0f} s", flush=True)
    files = list((folder / "images").rglob("*.jpg"))
    sizes = [f.stat().st_size for f in files]
    return path, {"records": n, "image_files": len(files), "image_bytes": sum(sizes),
                  "image_kib_median": round(float(np.median(sizes)) / 1024, 1)}


def config_overrides(model: Path, data: Path, cache: Path, out: Path, args: argparse.Namespace) -> list[str]:
    """anyfit's settings for these runs: its defaults plus the benchmark's batch, steps and precision."""
    return [f"model.name_or_path={model}", "model.dtype=float32", f"data.path={data}", "data.template=chat",
            f"data.max_length={MAX_LENGTH}", f"data.cache_dir={cache}", f"train.output_dir={out}", "train.overwrite=true",
            f"train.effective_batch={args.batch}", f"train.micro_batch={args.batch}", f"train.max_steps={args.steps}",
            "train.learning_rate=1e-4", "train.lr_schedule=linear", "train.warmup_steps=0", "train.log_every=1",
            f"train.seed={args.seed}", "runtime.device=cpu", "runtime.precision=fp32"]


# ----------------------------------------------------------------------------------------------------------
# Children
# ----------------------------------------------------------------------------------------------------------

def _anyfit_data(overrides: list[str]):
    """(config, the processor's ImageTokens, the store's TrainingData): what `anyfit prepare` and train do."""
    from anyfit.config import load_config
    from anyfit.data.image_tokens import ImageTokens
    from anyfit.data.prepare import prepare_training_data
    from anyfit.model.processor import load_processor
    from anyfit.model.tokenizer import load_tokenizer

    cfg = load_config(None, overrides)
    tokenizer = load_tokenizer(cfg.model)
    images = ImageTokens(*load_processor(cfg.model, tokenizer))
    t0 = time.perf_counter()
    data = prepare_training_data(cfg, tokenizer, echo=lambda *a: print(*a, flush=True), images=images)
    return cfg, tokenizer, images, data, time.perf_counter() - t0


def child_prepare(spec: dict[str, Any]) -> dict[str, Any]:
    t0 = time.perf_counter()
    import anyfit.data.prepare  # noqa: F401 - imports apart from the build's own time

    t_import = time.perf_counter() - t0
    profile = cProfile.Profile() if spec.get("profile") else None
    if profile:
        profile.enable()
    _, _, _, data, build_s = _anyfit_data(spec["overrides"])
    if profile:
        profile.disable()
    n = len(data.examples)
    store = data.examples.store
    return {**({"profile": top_functions(pstats.Stats(profile), 40)} if profile else {}),"examples": n, "build_s": round(build_s, 2), "records_per_s": round(n / build_s, 1),
            "import_s": round(t_import, 2), "store_bytes": sum(p.stat().st_size for p in store.folder.rglob("*")
                                                              if p.is_file()),
            "report": data.report.summary()}


def trl_dataset(data_path: str):
    """The records as a TRL user loads them: ``load_dataset("json")``, the relative paths made absolute and the
    ``images`` column cast to ``Image()`` (decoded when a row is read)."""
    import datasets

    folder = str(Path(data_path).parent)
    ds = datasets.load_dataset("json", data_files=data_path, split="train")
    ds = ds.map(lambda r: {"images": [os.path.join(folder, p) for p in r["images"]]})
    feature = datasets.List(datasets.Image()) if hasattr(datasets, "List") else datasets.Sequence(datasets.Image())
    return ds.cast_column("images", feature)


def child_collate(spec: dict[str, Any]) -> dict[str, Any]:
    """Both frameworks' per-batch work on the same batches, in turn; and TRL's ids against the store's."""
    import torch
    from transformers import AutoProcessor
    from trl.trainer.sft_trainer import DataCollatorForVisionLanguageModeling

    from anyfit.data.batching import collate
    from anyfit.data.image_batches import ImageBatches

    _, tokenizer, images, data, _ = _anyfit_data(spec["overrides"])
    examples = data.examples
    ds = trl_dataset(spec["data"])
    # TRL's collator with the processor SFTTrainer loads (AutoProcessor of the model folder), its defaults
    processor = AutoProcessor.from_pretrained(spec["model"])
    trl_collate = DataCollatorForVisionLanguageModeling(processor=processor, max_length=MAX_LENGTH)
    batches = ImageBatches(images)
    pad = tokenizer.pad_token_id
    n, b = min(spec["records"], len(examples), len(ds)), spec["batch"]
    order = [list(range(i, min(i + b, n))) for i in range(0, n, b)]
    times = {"anyfit": 0.0, "trl": 0.0}
    same = differ = 0
    trl_longer: dict[str, int] = {}  # the text TRL's ids hold after the store's ids end: records
    first_diff = None
    profile = cProfile.Profile() if spec.get("profile") else None
    for k, rows in enumerate(order):
        turn = ("anyfit", "trl") if k % 2 == 0 else ("trl", "anyfit")  # alternate who goes first
        for who in turn:
            t0 = time.perf_counter()
            if who == "anyfit":
                if profile:
                    profile.enable()
                got = collate([examples[i] for i in rows], pad, images=batches)
                if profile:
                    profile.disable()
                ours = got
            else:
                theirs = trl_collate([ds[i] for i in rows])
            times[who] += time.perf_counter() - t0
        for j, i in enumerate(rows):  # TRL's ids of record i (padding removed) against the store's
            mask = theirs["attention_mask"][j].bool()
            trl_ids = theirs["input_ids"][j][mask].tolist()
            store_ids = [int(t) for t in examples[i]["input_ids"]]
            if trl_ids == store_ids:
                same += 1
            elif trl_ids[:len(store_ids)] == store_ids:  # TRL's ids go on after the store's last token
                extra = tokenizer.decode(trl_ids[len(store_ids):])
                trl_longer[extra] = trl_longer.get(extra, 0) + 1
            else:
                differ += 1
                if first_diff is None:
                    first_diff = _id_difference(i, store_ids, trl_ids, tokenizer)
    del ours
    out = {"records": n, "batch": b, "batches": len(order),
           "anyfit_s": round(times["anyfit"], 3), "trl_s": round(times["trl"], 3),
           "anyfit_records_per_s": round(n / times["anyfit"], 1), "trl_records_per_s": round(n / times["trl"], 1),
           "trl_over_anyfit_time": round(times["trl"] / times["anyfit"], 3),
           "ids_same": same, "ids_differ": differ, "ids_trl_longer": trl_longer, "first_difference": first_diff,
           "torch_threads": torch.get_num_threads()}
    if profile:
        out["profile"] = top_functions(pstats.Stats(profile), 25)
    return out


def _id_difference(i: int, ours: list[int], theirs: list[int], tokenizer) -> dict[str, Any]:
    at = next((k for k, (x, y) in enumerate(zip(ours, theirs)) if x != y), min(len(ours), len(theirs)))
    return {"record": i, "store_len": len(ours), "trl_len": len(theirs), "first_index": at,
            "store_tail": tokenizer.decode(ours[at:at + 8]), "trl_tail": tokenizer.decode(theirs[at:at + 8])}


def top_functions(st: pstats.Stats, top: int) -> list[dict[str, Any]]:
    st.sort_stats("cumulative")
    out = []
    for func in st.fcn_list[:top]:
        _, nc, tt, ct, _ = st.stats[func]
        file, line, name = func
        where = f"{Path(file).name}:{line}" if line else file
        for marker in ("site-packages/", "src/"):
            if marker in file:
                where = file.split(marker, 1)[1] + f":{line}"
        out.append({"function": name, "where": where, "calls": nc, "tottime_s": round(tt, 3),
                    "cumtime_s": round(ct, 3)})
    return out


def child_train_anyfit(spec: dict[str, Any]) -> dict[str, Any]:
    import anyfit.training.loop as anyfit_train
    from anyfit.config import load_config

    clock = StepClock("cpu")

    class TimedMetricsLog(anyfit_train.MetricsLog):
        def write(self, record: dict[str, Any]) -> None:
            if "loss" in record:
                clock.end(record["step"])
            super().write(record)

    anyfit_train.MetricsLog = TimedMetricsLog  # train() looks the class up in its module at call time
    cfg = load_config(None, spec["overrides"])
    clock.begin()
    anyfit_train.train(cfg, echo=lambda *a: print(*a, flush=True))
    out = Path(cfg.train.output_dir)
    steps = [{"step": r["step"], "loss": r["loss"], "real_tokens": r.get("real_tokens"),
              "seconds": clock.seconds(r["step"])}
             for r in map(json.loads, (out / "metrics.jsonl").read_text().splitlines()) if "loss" in r]
    import torch

    return {"steps": steps, "torch_threads": torch.get_num_threads()}


def child_train_trl(spec: dict[str, Any]) -> dict[str, Any]:
    import trl
    from transformers import TrainerCallback

    clock = StepClock("cpu")
    logged: dict[int, dict[str, float]] = {}

    class Clock(TrainerCallback):
        def on_step_begin(self, args, state, control, **kwargs):
            clock.begin()

        def on_step_end(self, args, state, control, **kwargs):
            clock.end(state.global_step)

        def on_log(self, args, state, control, logs=None, **kwargs):
            if logs and "loss" in logs:
                logged[state.global_step] = {"loss": logs["loss"], "num_tokens": logs.get("num_tokens")}

    ds = trl_dataset(spec["data"])
    t0 = time.perf_counter()
    trainer = trl.SFTTrainer(model=spec["model"], args=trl.SFTConfig(**spec["sft_args"]), train_dataset=ds,
                             callbacks=[Clock()])
    init_s = time.perf_counter() - t0
    trainer.train()
    steps, before = [], 0
    for step in sorted(logged):
        tokens = logged[step]["num_tokens"]
        steps.append({"step": step, "loss": logged[step]["loss"],
                      "real_tokens": None if tokens is None else int(tokens - before), "seconds": clock.seconds(step)})
        before = tokens or 0
    import torch

    return {"steps": steps, "sft_trainer_init_s": round(init_s, 2), "torch_threads": torch.get_num_threads(),
            "resolved": {"gradient_checkpointing": trainer.args.gradient_checkpointing,
                         "collator": type(trainer.data_collator).__name__,
                         "skip_prepare_dataset": trainer._skip_prepare_dataset,
                         "columns": trainer.train_dataset.column_names}}


def child_main(spec_path: str) -> None:
    spec = json.loads(Path(spec_path).read_text())
    if spec.get("threads"):
        import torch

        torch.set_num_threads(spec["threads"])
    task = {"prepare": child_prepare, "collate": child_collate, "train-anyfit": child_train_anyfit,
            "train-trl": child_train_trl}[spec["task"]]
    Path(spec["result_path"]).write_text(json.dumps(task(spec)))


# ----------------------------------------------------------------------------------------------------------
# Measurements (parent)
# ----------------------------------------------------------------------------------------------------------

def child_run(ctx: dict[str, Any], name: str, spec: dict[str, Any]) -> dict[str, Any]:
    spec_path = ctx["work"] / f"spec-{name}.json"
    result_path = ctx["work"] / f"result-{name}.json"
    result_path.unlink(missing_ok=True)
    spec_path.write_text(json.dumps({**spec, "result_path": str(result_path), "threads": ctx["args"].threads}))
    r = measured_run([sys.executable, __file__, "--child", str(spec_path)], child_env(ctx["work"]),
                     ctx["logs"] / f"{name}.log", ctx["timeout"])
    if result_path.is_file():
        r["inside"] = json.loads(result_path.read_text())
    elif "error" not in r:
        r["error"] = "the child wrote no result"
    return r


def measure_prepare(ctx: dict[str, Any], profile: bool = False) -> dict[str, Any]:
    cache = ctx["work"] / "stores" / f"{ctx['records']}-{ctx['family']}"
    shutil.rmtree(cache, ignore_errors=True)  # cold: the store built from nothing
    spec = {"task": "prepare", "overrides": config_overrides(ctx["model"], ctx["data"], cache, ctx["work"] / "unused",
                                                             ctx["args"]), "profile": profile}
    return child_run(ctx, "prepare-profile" if profile else "prepare", spec)


def _store_cache(ctx: dict[str, Any]) -> Path:
    return ctx["work"] / "stores" / f"{ctx['records']}-{ctx['family']}"


def measure_collate(ctx: dict[str, Any], profile: bool = False) -> dict[str, Any]:
    args = ctx["args"]
    spec = {"task": "collate", "overrides": config_overrides(ctx["model"], ctx["data"], _store_cache(ctx),
                                                             ctx["work"] / "unused", args),
            "data": str(ctx["data"]), "model": str(ctx["model"]), "records": args.collate_records or ctx["records"],
            "batch": args.batch, "profile": profile}
    return child_run(ctx, "collate-profile" if profile else "collate", spec)


def measure_train(ctx: dict[str, Any], name: str) -> dict[str, Any]:
    args = ctx["args"]
    out = ctx["work"] / "runs" / name
    shutil.rmtree(out, ignore_errors=True)
    if name == "train-anyfit":
        spec = {"task": "train-anyfit",
                "overrides": config_overrides(ctx["model"], ctx["data"], _store_cache(ctx), out, args)}
    else:
        sft_args = {"output_dir": str(out), "max_steps": args.steps, "per_device_train_batch_size": args.batch,
                    "gradient_accumulation_steps": 1, "learning_rate": 1e-4, "lr_scheduler_type": "linear",
                    "max_length": MAX_LENGTH, "logging_steps": 1, "save_strategy": "no", "report_to": "none",
                    "seed": args.seed, "use_cpu": True, "bf16": False, "model_init_kwargs": {"dtype": "float32"}}
        if name == "train-trl-no-ckpt":
            sft_args["gradient_checkpointing"] = False
        spec = {"task": "train-trl", "data": str(ctx["data"]), "model": str(ctx["model"]), "sft_args": sft_args}
    r = child_run(ctx, name, spec)
    shutil.rmtree(out, ignore_errors=True)
    if "inside" in r:
        r.update(summarise_steps(r["inside"]["steps"], args.warmup, args.batch))
    return r


def rounds_of(earlier: list[dict[str, Any]], r: dict[str, Any]) -> dict[str, Any]:
    """``r`` with every round so far of its run under ``rounds`` and the medians of their rates."""
    earlier.append({k: r.get(k) for k in ("records_per_s", "tokens_per_s", "step_s", "last_loss", "peak_tree_rss_gib",
                                          "wall_s", "load_1m", "error")})
    ok = [e for e in earlier if not e.get("error") and e.get("records_per_s")]
    r["rounds"] = list(earlier)
    for key in ("records_per_s", "tokens_per_s", "step_s"):
        values = [e[key] for e in ok if e.get(key) is not None]
        if values:
            r[key] = round(float(np.median(values)), 3)
            r[f"{key}_range"] = [min(values), max(values)]
    if ok:
        r["peak_tree_rss_gib"] = max(e["peak_tree_rss_gib"] for e in ok)
    return r


def summarise_steps(steps: list[dict[str, Any]], warmup: int, batch: int) -> dict[str, Any]:
    measured = [s for s in steps if s["step"] > warmup and s.get("seconds")]
    seconds = sum(s["seconds"] for s in measured)
    tokens = [s["real_tokens"] for s in measured if s.get("real_tokens") is not None]
    return {"measured_steps": len(measured), "step_s": round(seconds / len(measured), 3) if measured else None,
            "records_per_s": round(batch * len(measured) / seconds, 2) if seconds else None,
            "tokens_per_s": round(sum(tokens) / seconds, 1) if seconds and len(tokens) == len(measured) else None,
            "tokens_per_step": round(sum(tokens) / len(tokens), 1) if tokens else None,
            "last_loss": steps[-1]["loss"] if steps else None}


# ----------------------------------------------------------------------------------------------------------
# Reporting
# ----------------------------------------------------------------------------------------------------------

def _g(v: float | None, spec: str = ".2f") -> str:
    return "-" if v is None else format(v, spec)


def table(results: dict[str, Any]) -> str:
    lines = ["| data | run | result | wall s | peak tree RSS GiB | load 1m (start / mean) |", "|---|---|---|---|---|---|"]
    for key in sorted(results["runs"]):
        for name, r in results["runs"][key]["measurements"].items():
            load = r.get("load_1m") or {}
            where = f"{load.get('start', 0):.1f} / {load.get('mean') or 0:.1f}"
            if "error" in r:
                lines.append(f"| {key} | {name} | FAILED: {r['error'][:150].replace('|', '/')} | | | {where} |")
                continue
            inside = r.get("inside", {})
            if name.endswith("-profile"):
                top = inside.get("profile", [{}])[0]
                what = f"cProfile (in the JSON): {top.get('cumtime_s')} s in {top.get('function')}"
            elif name == "prepare":
                what = (f"{inside['records_per_s']:,.0f} records/s ({inside['examples']:,} in {inside['build_s']} s), "
                        f"store {inside['store_bytes'] / 2**20:.1f} MiB")
            elif name.startswith("collate"):
                what = (f"anyfit {inside['anyfit_records_per_s']:,.0f} records/s, TRL {inside['trl_records_per_s']:,.0f} "
                        f"(TRL time / anyfit time {inside['trl_over_anyfit_time']:.2f}; ids: "
                        f"{inside['ids_same']} same, {inside['ids_differ']} differ"
                        + "".join(f", {n} the same but TRL's go on with {text!r}"
                                  for text, n in inside.get("ids_trl_longer", {}).items()) + ")")
            else:
                spread = r.get("records_per_s_range")
                what = (f"{_g(r.get('records_per_s'))} records/s"
                        + (f" (median of {len(r['rounds'])}: {spread[0]:.2f}-{spread[1]:.2f})" if spread and
                           len(r.get("rounds", [])) > 1 else "") + ", "
                        f"{_g(r.get('tokens_per_s'), ',.0f')} tokens/s "
                        f"({_g(r.get('tokens_per_step'), ',.0f')} a step), {_g(r.get('step_s'), '.3f')} s/step, "
                        f"last loss {_g(r.get('last_loss'), '.4f')}")
            lines.append(f"| {key} | {name} | {what} | {r['wall_s']:.1f} | {r['peak_tree_rss_gib']:.2f} | {where} |")
    return "\n".join(lines)


# ----------------------------------------------------------------------------------------------------------

def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--records", type=int, default=400, help="image records in the data set")
    p.add_argument("--family", default="qwen2_5_vl", help="the fixture's model family (tests/vlm_fixtures.FAMILIES)")
    p.add_argument("--only", default=",".join(MEASUREMENTS), help=f"comma-separated among {', '.join(MEASUREMENTS)}")
    p.add_argument("--batch", type=int, default=8, help="records a step (and a collated batch)")
    p.add_argument("--steps", type=int, default=12, help="optimizer steps of each training run")
    p.add_argument("--repeat", type=int, default=1, help="rounds of the training runs, in turn (medians reported)")
    p.add_argument("--warmup", type=int, default=2, help="first steps left out of the training rates")
    p.add_argument("--collate-records", type=int, default=0, help="records the collate pass covers (default: all)")
    p.add_argument("--threads", type=int, default=1,
                   help="torch threads of every child (0: torch's default, one a core); see the module doc")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--work", default="/tmp/anyfit_image_sft", help="data, model, stores (kept for later runs)")
    p.add_argument("--out", default=str(ROOT / "benchmarks" / "results" / "image_sft.json"))
    p.add_argument("--timeout", type=float, default=1800, help="seconds per child process")
    p.add_argument("--profile", choices=("collate", "prepare"),
                   help="instead: cProfile anyfit's batches in the collate pass, or its store build")
    p.add_argument("--child", help=argparse.SUPPRESS)
    args = p.parse_args()
    if not args.child and args.steps <= args.warmup:
        p.error("--steps must exceed --warmup")
    return args


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
    model = model_dir(work, args.family)
    data, stats = dataset(work, args.records, args.seed)
    compile_bytecode(work)
    key = f"{args.records}-{args.family}"
    entry = results["runs"].setdefault(key, {"measurements": {}})
    entry.update(data=stats, family=args.family, batch=args.batch, seed=args.seed)
    ctx = {"work": work, "records": args.records, "family": args.family, "model": model, "data": data, "args": args,
           "timeout": args.timeout, "logs": work / "logs" / key}

    def save():
        out.parent.mkdir(parents=True, exist_ok=True)
        out.write_text(json.dumps(results, indent=1) + "\n")

    only = {m for m in args.only.split(",") if m}
    plan: list[tuple[str, Any]] = []
    if args.profile == "prepare":  # data.num_proc=auto: one process for a small data set
        plan.append(("prepare-profile", lambda: measure_prepare(ctx, profile=True)))
    elif args.profile:
        plan.append(("collate-profile", lambda: measure_collate(ctx, profile=True)))
    else:
        if "prepare" in only or not (_store_cache(ctx)).is_dir():
            plan.append(("prepare", lambda: measure_prepare(ctx)))
        if "collate" in only:
            plan.append(("collate", lambda: measure_collate(ctx)))
        if "train" in only:  # the runs in turn, --repeat rounds: on a shared machine each round sees another load
            rounds: dict[str, list[dict[str, Any]]] = {name: [] for name in TRAIN_RUNS}
            for k in range(args.repeat):
                plan += [(name, lambda name=name: rounds_of(rounds[name], measure_train(ctx, name)))
                         for name in TRAIN_RUNS]
    for name, fn in plan:
        print(f"[{key}] {name} (load {os.getloadavg()[0]:.1f}) ...", flush=True)
        r = fn()
        r["date"] = datetime.datetime.now().isoformat(timespec="seconds")
        if name in entry["measurements"] and len(r.get("rounds", [None])) == 1:  # measured again (a new series)
            entry.setdefault("earlier", []).append({name: entry["measurements"][name]})
        entry["measurements"][name] = r
        print(f"  {name}: {r['wall_s']:.1f} s, peak tree RSS {r['peak_tree_rss_gib']:.2f} GiB"
              + (f", ERROR {r['error']}" if "error" in r else ""), flush=True)
        save()
        if name.endswith("-profile") and "inside" in r:
            for f in r["inside"]["profile"]:
                print(f"  {f['cumtime_s']:8.3f} s cum {f['tottime_s']:8.3f} s own {f['calls']:>7} x {f['function']} "
                      f"({f['where']})")
    save()
    print("\n" + table(results))


if __name__ == "__main__":
    main()

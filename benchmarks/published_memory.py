"""anyfit's memory planner held against PUBLISHED peak GPU memory of fine-tuning runs (no GPU needed).

    uv run python benchmarks/published_memory.py            # print the table
    uv run python benchmarks/published_memory.py --write    # and put it into benchmarks/PLAN_VS_MEASURED.md

Every published number below was read in its source (URL / repository + path + commit in ``SOURCES``), with
the recipe settings that source states (its config file where the table names one). Model sizes are written
out from LitGPT's own ``litgpt/config.py`` (the configs the measured runs used), so nothing is downloaded.

What is compared, and why:
- LitGPT prints ``torch.cuda.max_memory_allocated() / 1e9`` ("GB", decimal, allocated tensors only; no CUDA
  context), so it is compared with the planner's tensors: the estimate without its runtime overhead. The
  planner's total (what ``anyfit plan`` reports, + ``RUNTIME_OVERHEAD_GIB['cuda']``) is shown beside it.
- the planner models anyfit's runtime (Hugging Face + PEFT + FSDP2); the published runs used LitGPT or torchtune.
  Where that runtime difference cannot be put into a ``Setup`` the row says so in its notes, and where the
  run itself cannot be expressed (CPU offload, unstated per-row settings) it is excluded from the statistics.
No planner constant is fitted to these numbers: this only reports.
"""

from __future__ import annotations

import argparse
import dataclasses
import statistics
from dataclasses import dataclass, field
from pathlib import Path

from model_sizes import MODELS  # run from benchmarks/: the model table the comparisons share

from anyfit.config import load_config
from anyfit.model.shape import ModelShape, shape_from_config
from anyfit.planning.memory import estimate_memory
from anyfit.planning.setup import setup_for
from anyfit.units import GIB

GB = 1e9
DATE = "2026-11-26"
SECTION = "## Against published measurements"

SOURCES = {
    "litgpt-rt": "Lightning-AI/litgpt tutorials/resource-tables.md (commit 4839345; tables of 10/20/2023, LitGPT "
                 "8641822, 1x/2x/4x A100-SXM4-40GB, PyTorch 2.1.0, bitsandbytes 0.41.1); settings from "
                 "finetune/lora.py at 8641822",
    "litgpt-hub": "Lightning-AI/litgpt config_hub/finetune/README.md (last changed 00af8b0d, 2024-09-27; A10G 24 GB); "
                  "settings from config_hub/finetune/<model>/<method>.yaml at 26857050 and litgpt/finetune/*.py at "
                  "00af8b0d",
    "torchtune": "pytorch/torchtune README.md (commit 0031bfb), 'Memory and training speed'",
}

QV = ["q_proj", "v_proj"]  # LitGPT lora_query + lora_value
ALL7 = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]

# Runtime differences common to the LitGPT rows, which a Setup cannot state (so they stay in the error):
LITGPT_QLORA = ("LitGPT quantizes lm_head too and keeps embeddings in bf16; anyfit/PEFT keeps both in fp32")
LITGPT_HEAD = "LitGPT lora_head adapter not expressible (anyfit targets no lm_head): left out"


@dataclass
class Row:
    source: str
    model: str
    method: str  # full | lora | qlora
    published: float
    unit: str  # "GB" (1e9) | "GiB"
    measures: str
    micro: int
    seq: int
    batch: int = 8  # global (effective) batch
    procs: int = 1
    fsdp: bool = False
    ckpt: bool = False
    r: int = 8
    targets: list[str] = field(default_factory=lambda: list(QV))
    dropout: float = 0.05
    quant: str = ""  # what the source calls its quantization
    assumed: str = ""
    notes: str = ""
    excluded: str = ""  # "not expressible: <why>"; such rows stay out of the statistics


# Why the resource tables' FSDP rows are not a training step's peak (read in the script of that period).
RT_FSDP_START = ("not expressible: a start-up peak. finetune/lora.py of that period (read at 0010d8ef; 8641822 is "
                 "not stored here) builds the whole bf16 model on every GPU before FSDP shards it "
                 "(fabric.init_module(empty_init=False), then setup_module) and loads the checkpoint through a full "
                 "state dict (fabric.load_raw, state_dict_type='full'), so each GPU's max_memory_allocated holds the "
                 "unsharded model at start; anyfit's process 0 reads it, the others receive shards, and the plan is "
                 "the training step's")


def rt(model: str, method: str, gb: float, micro: int, procs: int = 1, quant: str = "") -> Row:
    """A LitGPT resource-tables row: finetune/lora.py of 10/2023 (r=8 alpha=16 dropout=0.05 on q and v, batch 128,
    bf16-true, torch AdamW or bnb PagedAdamW (32-bit) when quantized; FSDP with Block checkpointing on >1 GPU)."""
    return Row("litgpt-rt", model, method, gb, "GB", "max_memory_allocated", micro, 1304, batch=128, procs=procs,
               fsdp=procs > 1, ckpt=procs > 1, quant=quant,
               assumed="seq 1304 (the longest Llama 2 Alpaca example the page states; the page does not say the "
                       "peak batch held it)", notes=LITGPT_QLORA if method == "qlora" else "",
               excluded=RT_FSDP_START if procs > 1 else "")


def hub(model: str, method: str, gb: float, micro: int, batch: int, r: int = 32, targets: list[str] | None = None,
        dropout: float = 0.05, procs: int = 1, notes: str = "") -> Row:
    """A LitGPT config_hub row: Alpaca2k, max_seq_length 512, bf16-true, torch AdamW (bnb PagedAdamW when quantized),
    no checkpointing on 1 GPU, FSDP with Block checkpointing on several."""
    extra = [LITGPT_QLORA] if method == "qlora" else []
    return Row("litgpt-hub", model, method, gb, "GB", "max_memory_allocated", micro, 512, batch=batch, procs=procs,
               fsdp=procs > 1, ckpt=procs > 1, r=r, targets=targets or list(QV), dropout=dropout,
               quant="bnb.nf4" if method == "qlora" else "",
               assumed="seq 512 (max_seq_length; peak batch assumed to reach it); settings from the yaml at HEAD",
               notes="; ".join(extra + ([notes] if notes else [])))


TT_EXCLUDED = ("not expressible: the README gives batch 2, packed 2048, torch.compile for all rows but not the "
               "per-row memory knobs (the 4090 and A6000 rows of the same recipe differ by unstated settings)")

ROWS: list[Row] = [
    rt("Llama-2-7B", "lora", 21.30, 1),
    rt("Llama-2-7B", "qlora", 14.14, 1, quant="bnb.nf4"),
    rt("Llama-2-7B", "qlora", 13.84, 1, quant="bnb.nf4-dq"),
    rt("Llama-2-7B", "lora", 29.07, 2),
    rt("Llama-2-13B", "lora", 38.12, 1),
    rt("Llama-2-13B", "qlora", 23.14, 1, quant="bnb.nf4"),
    rt("Llama-2-13B", "qlora", 22.55, 1, quant="bnb.nf4-dq"),
    rt("Llama-2-7B", "lora", 22.18, 1, procs=2),
    rt("Llama-2-7B", "lora", 22.47, 2, procs=2),
    rt("Llama-2-7B", "lora", 23.39, 4, procs=2),
    rt("Llama-2-13B", "lora", 35.57, 1, procs=4),
    hub("Llama-2-7B", "lora", 19.77, 2, 8),
    hub("Llama-2-7B", "qlora", 13.68, 2, 8),
    hub("Llama-3-8B", "lora", 19.73, 1, 8),
    hub("Llama-3-8B", "qlora", 17.41, 2, 8),
    hub("Llama-3-8B", "lora", 19.73, 1, 8, notes="published as llama-3.1-8b (same sizes at 512 tokens)"),
    hub("Llama-3-8B", "qlora", 17.41, 2, 8, notes="published as llama-3.1-8b (same sizes at 512 tokens)"),
    hub("Mistral-7B-v0.1", "lora", 20.66, 2, 8),
    hub("Mistral-7B-v0.1", "qlora", 14.29, 2, 8),
    hub("TinyLlama-1.1B", "full", 14.10, 4, 32),
    hub("TinyLlama-1.1B", "lora", 13.50, 8, 8, targets=ALL7, notes=LITGPT_HEAD),
    hub("TinyLlama-1.1B", "qlora", 16.24, 8, 8, targets=ALL7, notes=LITGPT_HEAD),
    hub("Gemma-2B", "lora", 12.62, 2, 6, r=8, targets=ALL7, dropout=0.1, notes=LITGPT_HEAD),
    hub("Gemma-2B", "qlora", 11.58, 2, 6, r=16, targets=ALL7, dropout=0.1, notes=LITGPT_HEAD),
    hub("Gemma-2B", "full", 17.43, 1, 16, procs=4,
        notes="LitGPT FSDP1 accumulates unsharded bf16 grads (no_backward_sync); anyfit's FSDP2 window fp32"),
] + [Row("torchtune", m, meth, v, "GiB", "peak memory per GPU (kind not stated)", 2, 2048, excluded=TT_EXCLUDED)
     for m, meth, v in (("Llama-3.1-8B (1x 4090)", "full", 18.9), ("Llama-3.1-8B (1x A6000)", "full", 37.4),
                        ("Llama-3.1-8B (1x 4090)", "lora", 16.2), ("Llama-3.1-8B (1x A6000)", "lora", 30.3),
                        ("Llama-3.1-8B (1x 4090)", "qlora", 7.4), ("Llama-3.1-70B (8x A100)", "lora", 27.6))] + [
    Row("torchtune", "Llama-3.1-70B (8x A100)", "full", 13.9, "GiB", "peak memory per GPU (kind not stated)", 2, 2048,
        excluded="not expressible: CPU offload with the optimizer fused into backward (README footnote **)"),
    Row("torchtune", "Llama-3.1-405B (8x A100)", "qlora", 44.8, "GB", "peak memory per GPU (kind not stated)", 2, 2048,
        excluded="not expressible: QLoRA under FSDP (anyfit does not shard QLoRA); per-row settings unstated"),
]


def estimate(row: Row, shape: ModelShape) -> tuple[float, float]:
    """(tensors GiB, planner total GiB) for ``row``, through anyfit's own config -> Setup mapping."""
    cfg = load_config(None, [
        "model.name_or_path=published", "model.dtype=bfloat16",  # LitGPT bf16-true: bf16 weights, no autocast
        f"model.gradient_checkpointing={str(row.ckpt).lower()}", f"data.max_length={row.seq}",
        f"train.effective_batch={row.batch}", f"train.micro_batch={row.micro}",
        "train.packing=true",  # LitGPT pads without an attention mask: no mask bytes (padding=False below)
        "train.loss_chunk_tokens=128",  # LitGPT: lm_head_chunk_size=128 + chunked_cross_entropy, bf16 logits
        "runtime.fused_optimizer=false",  # torch.optim.AdamW's default (foreach), bnb PagedAdamW: not fused
        f"lora.r={row.r}", f"lora.dropout={row.dropout}"])
    s = setup_for(cfg, method=row.method, device="cuda", precision="bf16", micro_batch=row.micro,
                  processes=row.procs, overrides={"runtime.sharding": "fsdp" if row.fsdp else "none"})
    # LitGPT batches hold whole sequences (no packing): the seq is the padded length of the micro-batch.
    s = dataclasses.replace(s, lora_targets=row.targets, padding=False)
    est = estimate_memory(shape, s)
    return (est.peak - est.overhead) / GIB, est.peak / GIB


def to_gib(value: float, unit: str) -> float:
    return value * GB / GIB if unit == "GB" else value


def build() -> tuple[list[list[str]], list[str]]:
    """The table rows (as text) and the summary lines."""
    table, errors = [], []
    for i, row in enumerate(ROWS, 1):
        pub = to_gib(row.published, row.unit)
        method = row.method + (f" ({row.quant})" if row.quant else "")
        lora = f"r={row.r} on {'q,v' if row.targets == QV else 'all 7 linears'}, dropout {row.dropout}; " \
            if row.method != "full" else ""
        settings = (f"{lora}micro {row.micro} x seq {row.seq}, batch {row.batch}, bf16-true, "
                    f"{'FSDP x' + str(row.procs) + ', ' if row.fsdp else ''}"
                    f"checkpointing {'on' if row.ckpt else 'off'}")
        if row.excluded or row.model not in MODELS:
            table.append([str(i), row.source, row.model, method, f"micro {row.micro} x seq {row.seq}",
                          f"{row.published} {row.unit}", row.measures, f"{pub:.2f}", "-", "-", "-",
                          row.excluded])
            continue
        tensors, total = estimate(row, shape_from_config(MODELS[row.model]))
        ratio = tensors / pub  # allocated bytes: compare without the CUDA context the planner adds
        errors.append((ratio, i, row))
        note = "; ".join(x for x in (f"assumed {row.assumed}", row.notes) if x)
        table.append([str(i), row.source, row.model, method, settings, f"{row.published} {row.unit}", row.measures,
                      f"{pub:.2f}", f"{tensors:.2f}", f"{total:.2f}", f"{ratio:.2f}", note])
    ratios = [r for r, _, _ in errors]
    abs_err = [abs(r - 1) for r in ratios]
    worst = sorted(errors, key=lambda e: abs(e[0] - 1), reverse=True)[:5]
    summary = [
        f"Rows: {len(ROWS)} published numbers, {len(errors)} compared, {len(ROWS) - len(errors)} not expressible.",
        f"Median ratio estimate/published: {statistics.median(ratios):.3f} "
        f"(min {min(ratios):.2f}, max {max(ratios):.2f}).",
        f"Median absolute error: {100 * statistics.median(abs_err):.1f}%.",
        f"Within 10%: {sum(e <= 0.10 for e in abs_err)}/{len(errors)}; within 20%: "
        f"{sum(e <= 0.20 for e in abs_err)}/{len(errors)}.",
        "Worst rows: " + "; ".join(f"#{i} {r.model} {r.method}{' ' + r.quant if r.quant else ''} micro {r.micro}"
                                   f"{' x' + str(r.procs) + ' GPUs' if r.procs > 1 else ''} ({q:.2f})"
                                   for q, i, r in worst) + ".",
    ]
    return table, summary


READING = [
    "LitGPT's FSDP LoRA rows (#8-#11) are left out since 2026-11-26 (they read 0.27-0.48 before): their per-GPU "
    "peak on 2 or 4 GPUs is the single-GPU peak or more (22.18 GB on 2 GPUs vs 21.30 GB on 1) because the script "
    "of that period put the whole unsharded model on every GPU at start (the rows' note says where); that is its "
    "loader's peak, not the sharded step the planner estimates, and anyfit's loader does not do it.",
    "QLoRA rows (0.84-1.01 since 2026-11-26; 0.74-0.83, every one low, before): bitsandbytes' MatMul4Bit saves its "
    "input A for backward whenever the input needs a gradient (ctx.tensors = (A, B)), so each NF4 linear keeps its "
    "bf16 input, frozen or not; the planner counted none. It now does (planning/memory.py, _four_bit_inputs: one "
    "cast copy per reader under PEFT's fp32 residual stream), a term read from bitsandbytes' code, not fitted. "
    "LitGPT's quantized lm_head and bf16 embeddings push the other way (the planner counts both in fp32).",
    "nf4 vs nf4-dq (#2/#3, #6/#7): the planner always assumes double quantization; the published difference "
    "(0.28 / 0.55 GiB) is the fp32 absmax per 64 weights that dq removes.",
]

HEADER = ["#", "source", "model", "method", "settings", "published", "measures", "published GiB",
          "anyfit tensors GiB", "anyfit plan GiB", "ratio", "notes"]


def markdown(table: list[list[str]], summary: list[str]) -> str:
    lines = [SECTION, "",
             f"Command: `uv run python benchmarks/published_memory.py --write` ({DATE}). No GPU: estimates only, "
             "published numbers from their sources.", "",
             "Each published peak is compared with anyfit's estimate for the settings its source states "
             "(`anyfit.planning.memory.estimate_memory` through `setup_for`). LitGPT reports "
             "`torch.cuda.max_memory_allocated() / 1e9`, so the ratio is *anyfit tensors* (the estimate without "
             "its 0.5 GiB CUDA runtime overhead) / published GiB; *anyfit plan* is what `anyfit plan` reports. "
             "The planner models anyfit's runtime (transformers + PEFT + FSDP2), not LitGPT's or torchtune's: the "
             "notes name the differences a `Setup` cannot state. No planner constant is fitted to these numbers; one "
             "term was added after reading bitsandbytes' code (QLoRA, below).", "",
             "Sources:", ""]
    lines += [f"- `{k}`: {v}" for k, v in SOURCES.items()]
    lines += ["", "| " + " | ".join(HEADER) + " |", "|" + "---|" * len(HEADER)]
    lines += ["| " + " | ".join(c.replace("|", "/") for c in row) + " |" for row in table]
    lines += [""] + [f"- {s}" for s in summary] + ["", "Reading of the worst rows (nothing fitted):", ""]
    lines += [f"- {s}" for s in READING] + [""]
    return "\n".join(lines)


def write_section(path: Path, text: str, section: str = SECTION) -> None:
    """Replace (or append) ``section``, keeping everything else in the file (published_speed.py uses it too)."""
    old = path.read_text()
    if section in old:
        head, rest = old.split(section, 1)
        nxt = rest.find("\n## ")
        old = head + (rest[nxt + 1:] if nxt >= 0 else "")
        old = old.rstrip("\n") + "\n"
    path.write_text(old.rstrip("\n") + "\n\n" + text)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--write", action="store_true", help="write the section into benchmarks/PLAN_VS_MEASURED.md")
    args = p.parse_args()
    table, summary = build()
    text = markdown(table, summary)
    print(text)
    if args.write:
        write_section(Path(__file__).with_name("PLAN_VS_MEASURED.md"), text)


if __name__ == "__main__":
    main()

"""LoRA on routed experts, CPU: peak memory and step time of the split path (lora.split_experts=true, the default:
x·W + s·(x·A)·B over each expert's tokens) against PEFT's path (lora.split_experts=false: W + BA formed for every
expert in each forward) and against the frozen-expert run (lora.experts=false), on a tiny Qwen3-MoE and a
gpt-oss-shaped model (biases, interleaved gate/up, its clamped activation).

Each run is its own process (fp32, no checkpointing, LoRA r=16 with target_modules auto, anyfit's apply_lora and
AdamW): forward, backward and optimizer step on 2 x 512 random tokens. The model has a 512-token vocabulary so the
loss's logits do not hide the decoder body. Peak: the process's peak resident set during the steps minus its resident
set before them (anyfit.hardware.memory.peak_bytes, as the runs report peak_mem_gib); step time: the median over the
steps after the first.

Usage: uv run python benchmarks/expert_lora.py [--steps 6] [--write]
(--write: the rows into benchmarks/results/expert_lora.json; BENCHMARKS.md's section is updated by hand)
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path


ROOT = Path(__file__).resolve().parents[1]
COMMON = dict(num_hidden_layers=4, num_attention_heads=8, num_key_value_heads=4, head_dim=64,
              max_position_embeddings=4096)
MODELS = {
    # 4 layers x 64 experts x 3 x 512 x 256: 0.375 GiB of fp32 experts
    "qwen3_moe": ("Qwen3MoeConfig", "Qwen3MoeForCausalLM",
                  dict(COMMON, hidden_size=512, intermediate_size=1024, moe_intermediate_size=256, num_experts=64,
                       num_experts_per_tok=4)),
    # 4 layers x 32 experts x (3 x 512 x 512 + biases): 0.375 GiB
    "gpt_oss": ("GptOssConfig", "GptOssForCausalLM",
                dict(COMMON, hidden_size=512, intermediate_size=512, num_local_experts=32, num_experts_per_tok=4,
                     layer_types=["sliding_attention", "full_attention"] * 2, sliding_window=128)),
}
RUNS = {"frozen experts": {"experts": False}, "PEFT path": {"split_experts": False}, "split path": {}}


def one(family: str, run: str, steps: int) -> dict:
    """One run in this process: the peak above the resident set before the steps, and the median step time."""
    import psutil
    import torch
    import transformers

    from anyfit.config import LoraConfig
    from anyfit.hardware.memory import peak_bytes
    from anyfit.model.loading import apply_lora

    config_cls, model_cls, dims = MODELS[family]
    torch.manual_seed(0)
    model = getattr(transformers, model_cls)(getattr(transformers, config_cls)(vocab_size=512, **dims))
    experts = sum(p.numel() * 4 for n, p in model.named_parameters() if ".experts." in n)
    model = apply_lora(model, LoraConfig(enabled=True, r=16, dropout=0.0, **RUNS[run]))
    model.train()
    optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-4)
    ids = torch.randint(3, 512, (2, 512), generator=torch.Generator().manual_seed(0))
    before, times, losses = psutil.Process().memory_info().rss, [], []
    for _ in range(steps):
        start = time.perf_counter()
        loss = model(input_ids=ids, labels=ids).loss
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        times.append(time.perf_counter() - start)
        losses.append(round(loss.item(), 6))
    from anyfit.model.moe import adapter_in_experts

    states = 16 * adapter_in_experts(model)  # the experts' adapter: fp32 weights, gradients, AdamW's two states
    return {"family": family, "run": run, "experts_gib": round(experts / 2**30, 3),
            "expert_adapter_states_gib": round(states / 2**30, 3),
            "peak_above_start_gib": round((peak_bytes("cpu") - before) / 2**30, 3),
            "step_s": round(statistics.median(times[1:] or times), 3), "losses": losses}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=6)
    parser.add_argument("--families", nargs="+", default=list(MODELS))
    parser.add_argument("--write", action="store_true")
    parser.add_argument("--one", nargs=2, metavar=("FAMILY", "RUN"), help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.one:
        print(json.dumps(one(*args.one, args.steps)), flush=True)
        return
    rows = []
    for family in args.families:
        results = {}
        for run in RUNS:
            done = subprocess.run([sys.executable, __file__, "--one", family, run, "--steps", str(args.steps)],
                                  capture_output=True, text=True, env={**os.environ, "TOKENIZERS_PARALLELISM": "false"})
            if done.returncode:
                raise SystemExit(done.stderr[-3000:])
            results[run] = json.loads(done.stdout.strip().splitlines()[-1])
        frozen = results["frozen experts"]
        for run, r in results.items():
            r["above_frozen_of_experts"] = round((r["peak_above_start_gib"] - frozen["peak_above_start_gib"])
                                                 / r["experts_gib"], 3)
            r["step_vs_frozen"] = round(r["step_s"] / frozen["step_s"], 3)
            rows.append(r)
            print(json.dumps(r), flush=True)
    if args.write:
        (ROOT / "benchmarks" / "results" / "expert_lora.json").write_text(json.dumps(rows, indent=1) + "\n")


if __name__ == "__main__":
    main()

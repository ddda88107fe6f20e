"""LoRA on routed experts, CPU: peak memory and step time of the split path (lora.split_experts=true, the default:
x·W + s·(x·A)·B over each expert's tokens) against PEFT's path (lora.split_experts=false: W + BA formed for every
expert in each forward) and against the frozen-expert run (lora.experts=false), on a tiny Qwen3-MoE and a
gpt-oss-shaped model (biases, interleaved gate/up, its clamped activation).

Each run is its own process (fp32, no checkpointing, LoRA r=16 with target_modules auto, anyfit's apply_lora and
AdamW): forward, backward and optimizer step on 2 x 512 random tokens. The model has a 512-token vocabulary so the
loss's logits do not hide the decoder body. Peak: the process's peak resident set during the steps minus its resident
set before them (anyfit.hardware.memory.peak_bytes, as the runs report peak_mem_gib); step time: the median over the
steps after the first.

After the timed steps one more step is accounted by tensor, independent of malloc: what autograd keeps for the backward
(saved_tensors_hooks, deduplicated by storage, parameters left out) and the peak of live tensor bytes during the step
(torch.profiler, profile_memory=True) plus the optimizer's states; the rows split the peak above the frozen-expert run
into the expert adapter's AdamW states, the saved activations, and the rest (the gradients that exist at the peak,
and the backward's transients).

Usage: uv run python benchmarks/expert_lora.py [--steps 6] [--write]
       uv run python benchmarks/expert_lora.py --paired qwen3_30b_experts --steps 9   (step time, steps in turn)
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
# Qwen3-30B-A3B's experts (hidden 2048, moe_intermediate 768, top 8 of 128): 2 layers of 32 of them, 1.125 GiB of
# fp32 experts (with 32 experts each has 4x the rows it would have among 128: the activations weigh 4x more here)
MODELS["qwen3_30b_experts"] = ("Qwen3MoeConfig", "Qwen3MoeForCausalLM",
                               dict(COMMON, num_hidden_layers=2, num_attention_heads=32, head_dim=128, hidden_size=2048,
                                    intermediate_size=6144, moe_intermediate_size=768, num_experts=32,
                                    num_experts_per_tok=8))
RUNS = {"frozen experts": {"experts": False}, "PEFT path": {"split_experts": False}, "split path": {}}


def build(family: str, run: str) -> tuple:
    """(model with the run's LoRA, its AdamW, the 2 x 512 random tokens, the expert weights' fp32 bytes)."""
    import torch
    import transformers

    from anyfit.config import LoraConfig
    from anyfit.model.loading import apply_lora

    config_cls, model_cls, dims = MODELS[family]
    torch.manual_seed(0)
    model = getattr(transformers, model_cls)(getattr(transformers, config_cls)(vocab_size=512, **dims))
    experts = sum(p.numel() * 4 for n, p in model.named_parameters() if ".experts." in n)
    model = apply_lora(model, LoraConfig(enabled=True, r=16, dropout=0.0, **RUNS[run]))
    model.train()
    optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-4)
    ids = torch.randint(3, 512, (2, 512), generator=torch.Generator().manual_seed(0))
    return model, optimizer, ids, experts


def timed_step(model, optimizer, ids) -> tuple[float, float]:
    """(seconds, loss) of one forward, backward and optimizer step."""
    start = time.perf_counter()
    loss = model(input_ids=ids, labels=ids).loss
    loss.backward()
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    return time.perf_counter() - start, round(loss.item(), 6)


def paired(family: str, steps: int) -> dict:
    """Step time of the split path against the frozen-expert run in one process, their steps in turn (frozen,
    split, frozen, ...): each ratio pairs two steps seconds apart, so load from other jobs on a shared machine moves
    both of a pair where whole-process pairs (a minute apart) differ by it. Medians over the steps after the first."""
    runs = {run: build(family, run) for run in ("frozen experts", "split path")}
    times: dict[str, list[float]] = {run: [] for run in runs}
    for _ in range(steps):
        for run, (model, optimizer, ids, _) in runs.items():
            times[run].append(timed_step(model, optimizer, ids)[0])
    ratios = [s / f for s, f in zip(times["split path"][1:], times["frozen experts"][1:])]
    return {"family": family, "frozen_step_s": round(statistics.median(times["frozen experts"][1:]), 3),
            "split_step_s": round(statistics.median(times["split path"][1:]), 3),
            "split_over_frozen_median": round(statistics.median(ratios), 3),
            "ratios": [round(r, 3) for r in ratios]}


def one(family: str, run: str, steps: int) -> dict:
    """One run in this process: the peak above the resident set before the steps, and the median step time."""
    import psutil

    from anyfit.hardware.memory import peak_bytes

    model, optimizer, ids, experts = build(family, run)
    before, times, losses = psutil.Process().memory_info().rss, [], []
    for _ in range(steps):
        seconds, loss = timed_step(model, optimizer, ids)
        times.append(seconds)
        losses.append(loss)
    from anyfit.model.moe import adapter_in_experts

    states = 16 * adapter_in_experts(model)  # the experts' adapter: fp32 weights, gradients, AdamW's two states
    saved, live = accounted_step(model, optimizer, ids)
    return {"family": family, "run": run, "experts_gib": round(experts / 2**30, 3),
            "expert_adapter_states_gib": round(states / 2**30, 3),
            "expert_adapter_adamw_gib": round(8 * adapter_in_experts(model) / 2**30, 4),
            "saved_gib": round(saved / 2**30, 4), "tensor_peak_above_start_gib": round(live / 2**30, 4),
            "peak_above_start_gib": round((peak_bytes("cpu") - before) / 2**30, 3),
            "step_s": round(statistics.median(times[1:] or times), 3), "losses": losses}


def accounted_step(model, optimizer, ids) -> tuple[int, int]:
    """(bytes autograd keeps for the backward, beyond the parameters; peak live tensor bytes of one step above the
    resident set before the steps): the profiler's allocation events summed in time order, plus the optimizer's
    states (allocated by the first step, alive since)."""
    import torch
    from torch.profiler import ProfilerActivity, profile

    from anyfit.profiling.memory import saved_storages

    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        with saved_storages(model) as kept:
            loss = model(input_ids=ids, labels=ids).loss
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
    live = peak = 0
    for _, nbytes in sorted((e.start_ns(), e.nbytes()) for e in prof.profiler.kineto_results.events()
                            if e.name() == "[memory]"):
        live += nbytes
        peak = max(peak, live)
    states = sum(t.numel() * t.element_size() for s in optimizer.state.values() for t in s.values()
                 if torch.is_tensor(t))
    return sum(kept.values()), peak + states


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=6)
    parser.add_argument("--families", nargs="+", default=list(MODELS))
    parser.add_argument("--write", action="store_true")
    parser.add_argument("--one", nargs=2, metavar=("FAMILY", "RUN"), help=argparse.SUPPRESS)
    parser.add_argument("--paired", metavar="FAMILY", help="step time only: split path and frozen experts in one "
                        "process, steps in turn")
    args = parser.parse_args()
    if args.paired:
        print(json.dumps(paired(args.paired, args.steps)), flush=True)
        return
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
            of = 1 / r["experts_gib"]  # above the frozen run, of the expert weights, by tensor
            r["tensor_above_frozen_of_experts"] = round(
                (r["tensor_peak_above_start_gib"] - frozen["tensor_peak_above_start_gib"]) * of, 3)
            r["of_it_adapter_adamw"] = round(r["expert_adapter_adamw_gib"] * of, 3)
            r["of_it_saved"] = round((r["saved_gib"] - frozen["saved_gib"]) * of, 3)
            # the rest: the gradients that exist at the peak (during the backward: part of them) and the transients
            r["of_it_grads_and_transient"] = round(r["tensor_above_frozen_of_experts"] - r["of_it_adapter_adamw"]
                                                   - r["of_it_saved"], 3)
            rows.append(r)
            print(json.dumps(r), flush=True)
    if args.write:
        (ROOT / "benchmarks" / "results" / "expert_lora.json").write_text(json.dumps(rows, indent=1) + "\n")


if __name__ == "__main__":
    main()

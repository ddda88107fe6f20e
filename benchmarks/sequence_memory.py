"""Peak memory per process against sequence length, one process vs two splitting each sequence
(``runtime.sequence_parallel=2``, DeepSpeed's Ulysses over gloo), on the CPU of this machine.

The model is a random-init Llama of 4 layers, 256 wide (8 heads, 4 key/value heads), with Qwen2.5's tokenizer;
one example per step: a prompt of about L tokens and a 16-token completion, so the loss's logits stay small and
what grows with L is the decoder body's activations (the part sequence parallelism divides). Full fine-tuning,
fp32, no checkpointing, one optimizer step; the number is the process's peak resident set (``peak_mem_gib`` of
``metrics.jsonl``, process 0), which includes the Python/torch baseline and the weights and AdamW states (the same
for both layouts).

Usage: uv run python benchmarks/sequence_memory.py [--lengths 1024 2048 ...] [--write]
(--write: the table into benchmarks/results/sequence_memory.json and BENCHMARKS.md's section is updated by hand)
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from plan_vs_measured import qwen_tokenizer, save_random_model  # the same assets' helpers

ROOT = Path(__file__).resolve().parents[1]
WORDS = ["red", "green", "blue", "cyan", "gold", "pink", "gray", "navy"]


def model_dir(tmp: Path) -> Path:
    from transformers import AutoTokenizer, LlamaConfig, LlamaForCausalLM

    tok = AutoTokenizer.from_pretrained(qwen_tokenizer(tmp))
    return save_random_model(tmp, tok, LlamaConfig, LlamaForCausalLM, hidden_size=256, intermediate_size=688,
                             num_hidden_layers=4, num_attention_heads=8, num_key_value_heads=4,
                             max_position_embeddings=65536)


def run(model: Path, tmp: Path, length: int, processes: int) -> dict:
    data = tmp / f"d{length}.jsonl"
    prompt = " ".join(WORDS[i % 7] for i in range(length))
    data.write_text(json.dumps({"prompt": prompt, "completion": " ".join(WORDS[:8] * 2)}) + "\n")
    out = tmp / f"out{length}-{processes}"
    args = [f"model.name_or_path={model}", f"data.path={data}", "data.template=plain",
            f"data.max_length={2 * length + 64}", f"train.output_dir={out}", "train.effective_batch=1",
            "train.micro_batch=1", "train.max_steps=1", "train.log_every=1", "train.save_every=0",
            "runtime.sharding=none"] + (["runtime.sequence_parallel=2"] if processes == 2 else [])
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", str(processes),
           "--master_port", str(29500 + length % 1000 + processes), "-m", "anyfit", "train", *args]
    env = {**os.environ, "OMP_NUM_THREADS": str(2 // processes), "TOKENIZERS_PARALLELISM": "false"}
    start = time.perf_counter()
    done = subprocess.run(cmd, env=env, capture_output=True, text=True)
    if done.returncode:
        raise SystemExit(done.stderr[-3000:])
    record = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()][-1]
    info = json.loads((out / "run_info.json").read_text())
    return {"length": length, "processes": processes, "tokens": info["data"]["max_length"],
            "peak_gib": record["peak_mem_gib"], "seconds": round(time.perf_counter() - start, 1)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--lengths", type=int, nargs="+", default=[1024, 2048, 4096, 8192, 16384, 32768])
    parser.add_argument("--write", action="store_true")
    args = parser.parse_args()
    rows = []
    with tempfile.TemporaryDirectory() as d:
        tmp = Path(d)
        model = model_dir(tmp)
        for length in args.lengths:
            for processes in (1, 2):
                rows.append(run(model, tmp, length, processes))
                print(json.dumps(rows[-1]), flush=True)
    if args.write:
        (ROOT / "benchmarks" / "results" / "sequence_memory.json").write_text(json.dumps(rows, indent=1) + "\n")


if __name__ == "__main__":
    main()

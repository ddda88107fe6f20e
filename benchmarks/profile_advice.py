"""Does following ``anyfit profile``'s advice give the speed-up it predicts? (issue 21)

    uv run python benchmarks/profile_advice.py [--steps 10] [--repeats 2]

1. Builds a random-init Llama (4 layers, 64 wide, Qwen2.5's 151k-token tokenizer, tied embeddings) and 256
   prompt/completion records of 10 to 100 words.
2. Profiles a slow config: padded rows (``train.packing=false``), micro-batch 1, no batch workers
   (``runtime.num_workers=0``), effective batch 16; reads the advice and the predicted tokens/s factor of
   following all its layout and data advice together: the probe's measured factor (``profile.json``:
   ``probe.factor``, a few untraced steps of each config), and the step model's (``combined_factor``) beside it.
3. Trains the slow config and the advised one for ``--steps`` steps each, ``--repeats`` times alternating (the
   machine is shared: alternating spreads its load over both), and takes the median tokens/s of each run's
   steps after the first two.
4. Prints the predicted and the measured factor, whether they agree within 25%, and the load average.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

from plan_vs_measured import WORDS, qwen_tokenizer, save_random_model

SLOW = ["train.packing=false", "train.micro_batch=1", "runtime.num_workers=0", "train.effective_batch=16",
        "train.learning_rate=1e-4", "train.seed=0", "data.template=plain"]


def build(root: Path) -> tuple[Path, Path]:
    from transformers import AutoTokenizer, LlamaConfig, LlamaForCausalLM

    tok = AutoTokenizer.from_pretrained(qwen_tokenizer(root))
    model_dir = save_random_model(root, tok, LlamaConfig, LlamaForCausalLM, hidden_size=64, intermediate_size=256,
                                  num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2,
                                  max_position_embeddings=1024)
    rng = random.Random(0)
    data = root / "data.jsonl"
    with data.open("w") as f:
        for _ in range(256):
            prompt = " ".join(rng.choice(WORDS) for _ in range(rng.randint(5, 60)))
            completion = " ".join(rng.choice(WORDS) for _ in range(rng.randint(5, 40)))
            f.write(json.dumps({"prompt": prompt, "completion": completion}) + "\n")
    return model_dir, data


def anyfit(*args: str) -> None:
    env = {**os.environ, "TOKENIZERS_PARALLELISM": "false"}
    run = subprocess.run([sys.executable, "-m", "anyfit", *args], env=env, capture_output=True, text=True)
    if run.returncode:
        sys.exit(run.stderr[-3000:])


def tokens_per_s(base: list[str], overrides: list[str], out: Path, steps: int) -> float:
    anyfit("train", *base, *overrides, f"train.max_steps={steps}", "train.log_every=1", f"train.output_dir={out}",
           "train.overwrite=true")
    lines = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    return statistics.median(m["tokens_per_s"] for m in lines[2:])


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--repeats", type=int, default=2)
    args = parser.parse_args()
    load_before = os.getloadavg()
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        model_dir, data = build(root)
        base = [f"model.name_or_path={model_dir}", f"data.path={data}", *SLOW]
        anyfit("profile", *base, "--steps", "3", "--out", str(root / "profile"))
        profile = json.loads((root / "profile" / "profile" / "profile.json").read_text())
        advised = [a["setting"] for a in profile["advice"] if a["factor"]]
        modelled, probe = profile["combined_factor"], profile.get("probe") or {}
        predicted = probe.get("factor") or modelled  # what anyfit profile printed as the expected effect
        print("advice:", *(f"  {a['setting']}: {a['reason']}; expected {a['effect']}" for a in profile["advice"]),
              sep="\n")
        slow, fast = [], []
        for i in range(args.repeats):
            slow.append(tokens_per_s(base, [], root / f"slow{i}", args.steps))
            fast.append(tokens_per_s(base, advised, root / f"fast{i}", args.steps))
    measured = statistics.median(fast) / statistics.median(slow)
    agree = predicted is not None and abs(measured / predicted - 1) <= 0.25
    print(f"slow config tokens/s {[round(x) for x in slow]}, advised ({' '.join(advised)}) {[round(x) for x in fast]}")
    print(f"step model x{modelled or float('nan'):.2f}; probe x{probe.get('factor') or float('nan'):.2f}")
    print(f"predicted x{predicted or float('nan'):.2f}, measured x{measured:.2f}: "
          f"{'within' if agree else 'NOT within'} 25%")
    print(f"load average before {load_before[0]:.2f}, after {os.getloadavg()[0]:.2f}; cores {os.cpu_count()}")
    return 0 if agree else 1


if __name__ == "__main__":
    sys.exit(main())

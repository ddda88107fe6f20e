"""Short training runs on tiny real-architecture models, shared by the integration and equivalence tests."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from anyfit.config import load_config
from anyfit.training.loop import train

# PYTHONFAULTHANDLER: a launched process that dies of a signal (SIGABRT, SIGSEGV) prints every thread's Python stack
# into the stderr a failing test shows: a rare abort of one rank ("terminate called without an active exception",
# seen twice in full suites on a loaded 2-core VM, once after the weights loaded, once after the last step) has
# left no trace of where it happened.
ENV = {**os.environ, "OMP_NUM_THREADS": "1", "TOKENIZERS_PARALLELISM": "false", "PYTHONFAULTHANDLER": "1"}
STEPS = 12
# How long a test waits for a process or an event before it calls it hung: a guard against hangs, not a timing.
# Generous, so that a machine four times slower than a quiet 2-core VM, busy with the suite's other worker,
# passes too (the longest wait, a 4-process sharded run, is about a minute on the quiet VM).
HANG_S = 1200


def save_tiny(out: Path, tokenizer_dir: Path, arch: str = "llama", **overrides) -> Path:
    """A 2-layer random-init model of a real architecture (llama, qwen2, qwen3) with the given tokenizer, saved
    as an HF folder. 32 wide by default; ``overrides`` change the config (width, init, rope, ...)."""
    from transformers import (
        AutoTokenizer,
        LlamaConfig,
        LlamaForCausalLM,
        Qwen2Config,
        Qwen2ForCausalLM,
        Qwen3Config,
        Qwen3ForCausalLM,
    )

    tok = AutoTokenizer.from_pretrained(tokenizer_dir)
    config = dict(vocab_size=len(tok), hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                  num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512,
                  eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id, tie_word_embeddings=True,
                  # Wider than the usual 0.02 so a 32-wide model has logits LoRA can move (|logit| ~ width x std).
                  initializer_range=0.3)
    config.update(overrides)
    classes = {"llama": (LlamaForCausalLM, LlamaConfig), "qwen2": (Qwen2ForCausalLM, Qwen2Config),
               "qwen3": (Qwen3ForCausalLM, Qwen3Config)}
    model_class, config_class = classes[arch]
    torch.manual_seed(0)
    model = model_class(config_class(**config))
    model.save_pretrained(out)
    tok.save_pretrained(out)
    return out


def cut_qwen_tokenizer(src: Path, out: Path, keep: int = 1000) -> int:
    """Qwen2.5's tokenizer with the first ``keep`` tokens (the bytes and the first merges) and its special
    tokens renumbered after them: the same pre-tokenizer, template and kinds of token, 1/150 of the size."""
    tok_json = json.loads((src / "tokenizer.json").read_text())
    vocab = {t: i for t, i in tok_json["model"]["vocab"].items() if i < keep}
    merges = [m for m in tok_json["model"]["merges"]
              if all(p in vocab for p in (m.split(" ") if isinstance(m, str) else m))
              and "".join(m.split(" ") if isinstance(m, str) else m) in vocab]
    renumber = {t["id"]: keep + n for n, t in enumerate(tok_json["added_tokens"])}
    for t in tok_json["added_tokens"]:
        t["id"] = renumber[t["id"]]
    tok_json["model"].update(vocab=vocab, merges=merges)
    out.mkdir(parents=True, exist_ok=True)
    (out / "tokenizer.json").write_text(json.dumps(tok_json, ensure_ascii=False))
    cfg = json.loads((src / "tokenizer_config.json").read_text())
    cfg["added_tokens_decoder"] = {str(renumber[int(i)]): v for i, v in cfg.get("added_tokens_decoder", {}).items()}
    (out / "tokenizer_config.json").write_text(json.dumps(cfg, ensure_ascii=False))
    return keep + len(renumber)


def write_dataset(path: Path, n: int = 16) -> Path:
    """Variable-length prompt/completion pairs: a toy mapping the tiny model can memorise."""
    words = ["red", "green", "blue", "cyan", "gold", "pink", "gray", "navy"]
    with path.open("w") as f:
        for i in range(n):
            k = 1 + i % 5
            prompt = f"Repeat {' '.join(words[(i + j) % 8] for j in range(k))}"
            completion = " ".join(words[(i + j) % 8] for j in range(k)) + f" #{i}"
            f.write(json.dumps({"prompt": prompt, "completion": completion, "answer": str(i)}) + "\n")
    return path


SOURCES = ("words", "numbers")  # the sources of write_mix's mixture


def write_mix(tmp: Path) -> str:
    """Two data sets of two shapes (prompt/completion, and plain text with every token trained) as a ``data.mix``
    override, one source named in the config and one by its file."""
    words = write_dataset(tmp / "words.jsonl", n=20)
    numbers = tmp / "numbers.jsonl"
    numbers.write_text("".join(json.dumps({"text": " ".join(str(i * j % 97) for j in range(2 + i % 7))}) + "\n"
                               for i in range(14)))
    return f"data.mix=[{{path: {words}, weight: 2, name: words}}, {{path: {numbers}, weight: 1}}]"


def metrics_by_step(out: Path) -> dict[int, dict]:
    return {m["step"]: m for m in read_metrics(out) if "loss" in m}


def assert_same_sources(a: Path, b: Path, steps: int, rel: float) -> None:
    """Two runs of write_mix's mixture logged the same per-source training and validation losses (within ``rel``)
    and trained the same tokens of each source at every step."""
    ma, mb = metrics_by_step(a), metrics_by_step(b)
    assert sorted(ma) == sorted(mb) == list(range(1, steps + 1))
    for step in ma:
        for name in SOURCES:
            assert ma[step][f"trainable_tokens/{name}"] == mb[step][f"trainable_tokens/{name}"]
            assert (f"loss/{name}" in ma[step]) == (f"loss/{name}" in mb[step])
            if f"loss/{name}" in ma[step]:
                assert ma[step][f"loss/{name}"] == pytest.approx(mb[step][f"loss/{name}"], rel=rel), (step, name)
    evals = [[m for m in read_metrics(out) if "val_loss" in m] for out in (a, b)]
    assert len(evals[0]) == len(evals[1]) > 0
    for ea, eb in zip(*evals):
        assert ea["step"] == eb["step"]
        for name in SOURCES:
            assert ea[f"val_loss/{name}"] == pytest.approx(eb[f"val_loss/{name}"], rel=rel), (ea["step"], name)


def config_for(model_dir, data, out, *extra):
    return load_config(None, [f"model.name_or_path={model_dir}", f"data.path={data}", "data.template=plain",
                              f"train.output_dir={out}", "train.seed=0", "train.log_every=1", *extra])


def read_metrics(out: Path) -> list[dict]:
    return [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]


def train_variants(model_dir, tmp_path, key: str, values: tuple[str, ...], *extra: str) -> dict[str, object]:
    """Short runs on the same data that differ only in ``key`` (one per value)."""
    data = write_dataset(tmp_path / "d.jsonl", n=16)
    return {v: train(config_for(model_dir, data, tmp_path / v, "train.learning_rate=1e-2", f"{key}={v}", *extra),
                     echo=lambda *a: None) for v in values}


def same_losses(a: list[float], b: list[float], steps: int) -> bool:
    return len(a) == len(b) == steps and all(abs(x - y) <= 1e-4 * abs(y) for x, y in zip(a, b))


def resume_config(tmp_path: Path, model_dir: Path, lora: bool) -> Path:
    data = write_dataset(tmp_path / "d.jsonl", n=24)
    lora_yaml = "lora: {enabled: true, dropout: 0.2}\n" if lora else ""  # dropout: the RNG state matters
    p = tmp_path / "c.yaml"
    p.write_text(f"model: {{name_or_path: {model_dir}}}\ndata: {{path: {data}, template: plain}}\n{lora_yaml}"
                 f"train: {{effective_batch: 4, micro_batch: 2, max_steps: {STEPS}, learning_rate: 1.0e-3, "
                 "save_every: 2, keep_last: 2, seed: 0, log_every: 1}\n")
    return p


def start_train(cfg: Path, out: Path, *extra: str) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-m", "anyfit", "train", str(cfg), f"train.output_dir={out}", *extra],
                            env=ENV, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def final_weights(out: Path) -> dict[str, torch.Tensor]:
    name = "adapter_model.safetensors" if (out / "adapter_model.safetensors").exists() else "model.safetensors"
    return load_file(out / name)


def wait_for(predicate, proc: subprocess.Popen, timeout: float = HANG_S) -> None:
    t0 = time.time()
    while not predicate():
        assert proc.poll() is None, f"run ended before the event: {proc.communicate()[1][-2000:]}"
        assert time.time() - t0 < timeout, "timed out waiting"
        time.sleep(0.05)


def metric_steps(out: Path) -> list[int]:
    path = out / "metrics.jsonl"
    return [json.loads(line)["step"] for line in path.read_text().splitlines()] if path.exists() else []

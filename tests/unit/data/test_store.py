"""The token store: the same tokens as the in-memory path for every template and format, reused when nothing
changed, rebuilt when anything that changes tokens did, never trusted when damaged or half-written, built by one
process while the others wait."""

from __future__ import annotations

import dataclasses
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import psutil
import pytest
from tiny_runs import HANG_S
from transformers import AutoTokenizer

from anyfit import cache, durable
from anyfit.config import load_config
from anyfit.data.prepare import prepare_training_data
from anyfit.data.sources import load_records
from anyfit.data.store import TokenStore, open_or_build, store_key, store_problem
from anyfit.data.tokenization import tokenize_dataset


@pytest.fixture(scope="module")
def tokenizer(qwen_tokenizer_dir):
    return AutoTokenizer.from_pretrained(qwen_tokenizer_dir)


def write_jsonl(path: Path, rows: list[dict]) -> Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def problems(n: int) -> list[dict]:
    """GSM8K-like records of varied length, some with a short answer field, one without a usable answer."""
    rows = []
    for i in range(n):
        steps = " ".join(f"Step {k}: {i} + {k} = {i + k}." for k in range(i % 7))
        rows.append({"question": f"What is {i} plus {i % 5}? " + "Think. " * (i % 11),
                     "answer": f"{steps}\n#### {i + i % 5}" if i % 13 else "no final answer here"})
    return rows


def data_cfg(path: Path, tmp: Path, *extra: str):
    return load_config(None, [f"data.path={path}", f"data.cache_dir={tmp / 'stores'}",
                              "data.fields={prompt: question, completion: answer}", *extra]).data


CASES = {
    "chat": ["data.template=chat"],
    "plain": ["data.template=plain"],
    "trl": ["data.template=trl"],
    "r1_zero": ["data.template=r1_zero"],
    "custom": ["data.template='Q: {prompt}\nA: '"],
    "truncate": ["data.template=plain", "data.max_length=24"],
    "drop": ["data.template=plain", "data.max_length=40", "data.overlong=drop"],
    "all": ["data.template=chat", "data.train_on=all"],
}


@pytest.mark.slow
@pytest.mark.parametrize("case", list(CASES))
def test_the_store_holds_exactly_what_tokenize_dataset_makes(case, tokenizer, tmp_path):
    """Batches of 1,024 records (three here, the last one short) against the whole set tokenized at once."""
    path = write_jsonl(tmp_path / "d.jsonl", problems(2100))
    cfg = data_cfg(path, tmp_path, *CASES[case])
    expected, report = tokenize_dataset(load_records(cfg), tokenizer, cfg)
    store = open_or_build(cfg, tokenizer, echo=lambda *a: None)
    got = store.view()
    assert got.report == report
    assert len(got) == len(expected) and list(got) == expected
    assert got[len(got) - 1] == expected[-1]
    assert got.lengths.tolist() == [len(e["input_ids"]) for e in expected]
    assert got.trainable.tolist() == [sum(t != -100 for t in e["labels"]) for e in expected]


@pytest.mark.slow
def test_conversations_and_pretokenized_records(tokenizer, tmp_path):
    chats = [{"messages": [{"role": "user", "content": f"hi {i}"}, {"role": "assistant", "content": "x " * (i % 9 + 1)},
                           {"role": "user", "content": "more"}, {"role": "assistant", "content": f"{i}"}]}
             for i in range(1100)]
    tokens = [{"input_ids": list(range(5, 20 + i % 20)), "completion_mask": [0] * 5 + [1] * (10 + i % 20)}
              for i in range(1100)]
    for name, rows, extra in (("chat", chats, ["data.template=chat"]), ("tokens", tokens, ["data.format=tokens"])):
        path = write_jsonl(tmp_path / f"{name}.jsonl", rows)
        cfg = load_config(None, [f"data.path={path}", f"data.cache_dir={tmp_path / 'stores'}", *extra]).data
        expected, _ = tokenize_dataset(load_records(cfg), tokenizer, cfg)
        got = open_or_build(cfg, tokenizer, echo=lambda *a: None).view()
        assert list(got) == expected, name


@pytest.mark.slow
def test_an_unchanged_input_reuses_the_store_and_a_changed_one_never_does(tokenizer, tmp_path):
    path = write_jsonl(tmp_path / "d.jsonl", problems(50))
    cfg = data_cfg(path, tmp_path, "data.template=plain")
    said: list[str] = []
    first = open_or_build(cfg, tokenizer, echo=said.append)
    stamp = (first.folder / "manifest.json").stat().st_mtime_ns
    again = open_or_build(dataclasses.replace(cfg, num_proc=3), tokenizer, echo=said.append)  # not a token setting
    assert again.folder == first.folder and (again.folder / "manifest.json").stat().st_mtime_ns == stamp
    assert "built" in said[0] and "reused" in said[1]
    key = store_key(cfg, tokenizer)
    assert store_key(dataclasses.replace(cfg, max_length=512), tokenizer) != key
    assert store_key(dataclasses.replace(cfg, template="chat"), tokenizer) != key
    assert store_key(dataclasses.replace(cfg, add_eos=False), tokenizer) != key
    changed_tokenizer = AutoTokenizer.from_pretrained(tokenizer.name_or_path)
    changed_tokenizer.chat_template = "{{ messages }}"
    assert store_key(cfg, changed_tokenizer) != key
    rows = problems(50)
    rows[37]["answer"] += " "  # one byte of the data
    write_jsonl(path, rows)
    assert store_key(cfg, tokenizer) != key
    rebuilt = open_or_build(cfg, tokenizer, echo=said.append)
    assert rebuilt.folder != first.folder and "built" in said[-1]


@pytest.mark.parametrize("damage", ["truncate", "flip", "flip-verified-before", "manifest"])
def test_a_damaged_store_is_rebuilt_not_trusted(damage, tokenizer, tmp_path, monkeypatch):
    path = write_jsonl(tmp_path / "d.jsonl", problems(40))
    cfg = data_cfg(path, tmp_path, "data.template=plain")
    store = open_or_build(cfg, tokenizer, echo=lambda *a: None)
    good = list(store.view())
    target = store.folder / "input_ids.bin"
    if damage == "flip-verified-before":  # its digest remembered (anyfit.cache), then a byte changed in place
        monkeypatch.setattr(durable, "RACY_S", 0.0)
        assert store_problem(store.folder, verify=True) is None
        assert any((cache.cache_root() / "digests").iterdir())
    if damage == "truncate":
        target.write_bytes(target.read_bytes()[:-4])
    elif damage.startswith("flip"):
        before = os.stat(target)
        with open(target, "r+b") as f:
            f.seek(10)
            byte = f.read(1)[0]
            f.seek(10)
            f.write(bytes([byte ^ 0xFF]))
        os.utime(target, ns=(before.st_atime_ns, before.st_mtime_ns))  # the same size and mtime: only ctime moves
    else:
        (store.folder / "manifest.json").write_text("{")
    assert store_problem(store.folder, verify=True) is not None
    said: list[str] = []
    again = open_or_build(cfg, tokenizer, echo=said.append)
    assert "damaged" in said[0] and "built" in said[-1]
    assert list(again.view()) == good


def test_holdout_views_match_splitting_the_records(tokenizer, tmp_path):
    """eval.holdout: the seeded record sample, tokenized as before (each part reported on its own, the tokens
    truncation cut from each part's records among it)."""
    import random

    path = write_jsonl(tmp_path / "d.jsonl", problems(300))
    cfg = load_config(None, [f"data.path={path}", f"data.cache_dir={tmp_path / 'stores'}", "data.template=plain",
                             "data.fields={prompt: question, completion: answer}", "eval.holdout=37", "train.seed=5",
                             "data.max_length=24"])
    data = prepare_training_data(cfg, tokenizer, echo=lambda *a: None)
    records = load_records(cfg.data)
    order = list(range(len(records)))
    random.Random(5).shuffle(order)
    held = set(order[:37])
    train, train_report = tokenize_dataset([r for i, r in enumerate(records) if i not in held], tokenizer, cfg.data)
    heldout, held_report = tokenize_dataset([records[i] for i in sorted(held)], tokenizer, cfg.data)
    assert list(data.examples) == train and data.report == train_report
    assert 0 < train_report.truncated_tokens and 0 < held_report.truncated_tokens
    assert list(data.eval_examples) == heldout and data.eval_report == held_report


def test_a_store_maps_the_same_files_in_another_process(tokenizer, tmp_path):
    import pickle

    path = write_jsonl(tmp_path / "d.jsonl", problems(30))
    store = open_or_build(data_cfg(path, tmp_path), tokenizer, echo=lambda *a: None)
    copy = pickle.loads(pickle.dumps(store))  # what a spawned DataLoader worker receives
    assert copy.folder == store.folder and isinstance(copy.arrays["input_ids"], np.memmap)
    assert len(pickle.dumps(store)) < 1000  # the path, not the data


@pytest.mark.multiprocess
def test_parallel_build_gives_the_same_store(tokenizer, tmp_path):
    rows = [{**r, "origin": f"set {i % 3}"} for i, r in enumerate(problems(2600))]  # data.source_column too
    path = write_jsonl(tmp_path / "d.jsonl", rows)
    one = open_or_build(data_cfg(path, tmp_path / "a", "data.template=chat", "data.num_proc=1",
                                 "data.source_column=origin"), tokenizer, echo=lambda *a: None)
    two = open_or_build(data_cfg(path, tmp_path / "b", "data.template=chat", "data.num_proc=2",
                                 "data.source_column=origin"), tokenizer, echo=lambda *a: None)
    assert one.folder.name == two.folder.name  # num_proc is not part of the key
    for name in ("input_ids", "loss_mask", "offsets", "trainable", "part_record", "part_fate", "part_example",
                 "example_source"):
        assert (one.folder / f"{name}.bin").read_bytes() == (two.folder / f"{name}.bin").read_bytes(), name
    assert one.sources == two.sources == ["set 0", "set 1", "set 2"]


def test_a_source_column_gives_every_example_its_records_source(tokenizer, tmp_path):
    """data.source_column: each kept example carries its own record's value, numbered in order of first
    appearance, past dropped records; the names are fit for metric keys."""
    rows = [{**r, "source": ["gsm/8k", 7, "gsm/8k", "other"][i % 4]} for i, r in enumerate(problems(40))]
    path = write_jsonl(tmp_path / "d.jsonl", rows)
    store = open_or_build(data_cfg(path, tmp_path, "data.template=plain", "data.max_length=40", "data.overlong=drop",
                                   "data.source_column=source"), tokenizer, echo=lambda *a: None)
    assert store.sources == ["gsm/8k", "7", "other"] and store.view().names == ["gsm_8k", "7", "other"]
    part_example, part_record = store.arrays["part_example"], store.arrays["part_record"]
    assert (part_example < 0).any()  # some records dropped: the numbering must step over them
    for part in np.flatnonzero(part_example >= 0):
        record = int(part_record[part])
        example = store[int(part_example[part])]
        assert example["source"] == {"gsm/8k": 0, 7: 1, "other": 2}[rows[record]["source"]]
        assert example["sources"] == 3
    plain = open_or_build(data_cfg(path, tmp_path, "data.template=plain"), tokenizer, echo=lambda *a: None)
    assert plain.sources == [] and set(plain[0]) == {"input_ids", "labels"}


@pytest.mark.parametrize("rows, needle", [
    ([{"question": "a", "answer": "b", "source": "x"}, {"question": "c", "answer": "d"}], "d.jsonl:2: data.source_column"),
    ([{"question": "a", "answer": "b", "source": str(i)} for i in range(70)], "more than 64 distinct values"),
])
def test_a_source_column_without_a_value_or_with_too_many_stops_the_build(tokenizer, tmp_path, rows, needle):
    from anyfit.data.sources import DataError

    path = write_jsonl(tmp_path / "d.jsonl", rows)
    with pytest.raises(DataError, match=needle):
        open_or_build(data_cfg(path, tmp_path, "data.template=plain", "data.source_column=source"), tokenizer,
                      echo=lambda *a: None)


def prepare_command(config: Path, env: dict) -> subprocess.Popen:
    """``anyfit prepare`` as a terminal's foreground job: a process group of its own (Ctrl-C reaches it whole), and
    SIGINT at its default, whatever this process inherited (a shell without job control starts a background command,
    ``pytest &`` in a script, with SIGINT ignored, and an ignored signal stays ignored in every child)."""
    start = ("import os, signal, sys; signal.signal(signal.SIGINT, signal.SIG_DFL); "
             "os.execv(sys.executable, [sys.executable, '-m', 'anyfit', *sys.argv[1:]])")
    return subprocess.Popen([sys.executable, "-c", start, "prepare", str(config)], env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True)


@pytest.fixture
def big_config(tmp_path, qwen_tokenizer_dir, tiny_llama_dir):
    path = write_jsonl(tmp_path / "big.jsonl", problems(12_000))
    config = tmp_path / "c.yaml"
    config.write_text(f"model: {{name_or_path: {tiny_llama_dir}}}\n"
                      f"data: {{path: {path}, template: plain, cache_dir: {tmp_path / 'stores'}, num_proc: 1, "
                      "fields: {prompt: question, completion: answer}}\n")
    return config


def half_written(stores: Path) -> bool:
    """A temporary store folder that already holds tokens: the build is under way."""
    return stores.is_dir() and any(p.is_dir() and p.name.startswith(".") and (p / "input_ids.bin").is_file()
                                   and (p / "input_ids.bin").stat().st_size > 0 for p in stores.iterdir())


def prepare_until_tokens(config: Path, tmp_path: Path, env: dict) -> tuple[subprocess.Popen, Path]:
    """``anyfit prepare`` started and caught while it writes tokens (its store half-written)."""
    victim = prepare_command(config, env)
    stores = tmp_path / "stores"
    deadline = time.time() + HANG_S
    while not half_written(stores):
        assert victim.poll() is None, victim.communicate()[1][-2000:]
        assert time.time() < deadline
        time.sleep(0.05)
    return victim, stores


@pytest.mark.multiprocess
def test_a_build_killed_midway_leaves_nothing_that_looks_complete(big_config, tmp_path, capsys):
    """SIGKILL while tokenizing: only a temporary folder is left, and the next prepare builds a complete store
    and removes that folder."""
    env = {**os.environ, "TOKENIZERS_PARALLELISM": "false"}
    victim, stores = prepare_until_tokens(big_config, tmp_path, env)
    victim.send_signal(signal.SIGKILL)
    victim.wait()
    assert not [p for p in stores.iterdir() if p.is_dir() and not p.name.startswith(".")]  # no store yet
    from anyfit.cli import main  # the next prepare: the CLI in this process

    assert main(["prepare", str(big_config)]) == 0
    out = capsys.readouterr().out
    (store,) = [p for p in stores.iterdir() if p.is_dir() and not p.name.startswith(".")]
    assert store_problem(store, verify=True) is None and "built" in out
    assert len(TokenStore.open(store)) > 10_000
    assert not [p for p in stores.iterdir() if ".tmp-" in p.name]  # the killed build's folder is gone


@pytest.mark.multiprocess
def test_two_processes_one_builds_the_other_waits_and_reuses(big_config):
    env = {**os.environ, "TOKENIZERS_PARALLELISM": "false"}
    runs = [prepare_command(big_config, env) for _ in range(2)]
    outs = [r.communicate(timeout=HANG_S) for r in runs]
    assert [r.returncode for r in runs] == [0, 0], [o[1][-1000:] for o in outs]
    said = sorted("built" if "(built" in out else "reused" if "(reused" in out else out for out, _ in outs)
    assert said == ["built", "reused"]


@pytest.mark.multiprocess
def test_ctrl_c_while_tokenizing_is_one_line_and_keeps_nothing(big_config, tmp_path):
    """Ctrl-C as a terminal sends it: SIGINT to the whole process group, the build's workers included (the
    parent tokenizes the first batch itself, so the one-process path is covered on the way)."""
    num_proc = 2
    big_config.write_text(big_config.read_text().replace("num_proc: 1", f"num_proc: {num_proc}"))
    env = {**os.environ, "TOKENIZERS_PARALLELISM": "false"}
    victim, stores = prepare_until_tokens(big_config, tmp_path, env)

    def spawned() -> list[psutil.Process]:  # the pool's workers: spawned, or forked by the fork server
        tree = psutil.Process(victim.pid).children(recursive=True)
        servers = {c.pid for c in tree if "forkserver" in " ".join(c.cmdline())}
        return [c for c in tree if "spawn_main" in " ".join(c.cmdline()) or c.ppid() in servers]

    deadline = time.time() + HANG_S
    while num_proc > 1 and len(spawned()) < num_proc:  # the pool's workers are up (maybe still importing)
        assert victim.poll() is None and time.time() < deadline
        time.sleep(0.05)
    for worker in spawned():  # the mechanism, not only its effect: each worker holds SIGINT blocked (Linux)
        status = Path(f"/proc/{worker.pid}/status")
        if status.exists():
            mask = next(line for line in status.read_text().splitlines() if line.startswith("SigBlk:"))
            assert int(mask.split()[1], 16) & 1 << (signal.SIGINT - 1), f"a worker takes Ctrl-C itself: {mask}"
    workers = psutil.Process(victim.pid).children(recursive=True)
    os.killpg(victim.pid, signal.SIGINT)
    _, err = victim.communicate(timeout=HANG_S)
    _, alive = psutil.wait_procs(workers, timeout=HANG_S)
    assert not alive, [" ".join(w.cmdline()) for w in alive]  # the workers end with the build, none left behind
    assert victim.returncode == 130
    # the progress bar redraws its line with carriage returns; what is left besides it is the one message line
    lines = [line for line in err.splitlines() if line.strip() and not line.startswith("tokenize:")]
    assert len(lines) == 1 and lines[0].startswith("anyfit: interrupted: stopped while tokenizing"), err[-2000:]
    assert "nothing was kept" in lines[0] and "records" in lines[0] and "Traceback" not in err
    assert not [p for p in stores.iterdir() if p.is_dir()]  # neither a store nor a half-written folder
